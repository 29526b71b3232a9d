// The FP8 recipe's roundings (see fp8.hpp and docs/fp8.md). Integer bit arithmetic for e4m3
// and exact frexp/ldexp for the scales, so the results do not depend on the host's rounding
// mode, instruction set or libm.
#include "reference/fp8.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <string>

#include "mok/error.hpp"
#include "reference/bf16.hpp"

namespace mok::ref {

uint8_t to_e4m3(float v) {
  const uint32_t bits = std::bit_cast<uint32_t>(v);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return kE4m3NaN;          // NaN, sign dropped (as CUDA does)
  const float a = std::bit_cast<float>(abs_bits);
  if (a > kE4m3Max) return sign | 0x7E;                 // saturate, infinities included
  if (a <= 0x1p-10f) return sign;                       // half the smallest subnormal or less:
                                                        // zero (the tie 2^-10 goes to even 0)
  // a = sig * 2^(exp - 150) with a 24-bit significand. Keep it in units of the e4m3 ulp:
  // 2^(e - 3) for a normal e4m3 binade e >= -6, 2^-9 in the subnormal range; that drops
  // `shift` low bits (20 for normals, 21..24 for subnormals), rounded half to even.
  const int exp = static_cast<int>(abs_bits >> 23);
  const uint32_t sig = (abs_bits & 0x007FFFFFu) | 0x00800000u;
  const int e = exp - 127;
  const int shift = e >= -6 ? 20 : 141 - exp;
  uint32_t q = sig >> shift;
  const uint32_t rest = sig & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rest > half || (rest == half && (q & 1u))) ++q;
  // Normal: q in [8, 16]; code = (e + 7) << 3 | (q - 8), and q == 16 carries into the next
  // binade by plain addition. Subnormal: q in [0, 8] is the code (8 is the smallest normal).
  // a <= 448 here, so the carry never reaches the NaN code.
  const uint32_t code = e >= -6 ? (static_cast<uint32_t>(e + 6) << 3) + q : q;
  return static_cast<uint8_t>(sign | code);
}

float from_e4m3(uint8_t code) {
  const int e = (code >> 3) & 0xF;
  const int m = code & 0x7;
  float a;
  if (e == 0xF && m == 0x7) {
    a = std::numeric_limits<float>::quiet_NaN();
  } else if (e == 0) {
    a = std::ldexp(static_cast<float>(m), -9);      // subnormal: m * 2^-9
  } else {
    a = std::ldexp(static_cast<float>(8 + m), e - 10);  // (1 + m/8) * 2^(e - 7)
  }
  return (code & 0x80) ? -a : a;
}

int scale_exponent(float amax) {
  if (!(amax >= 0.0f) || !std::isfinite(amax)) {
    throw_invalid("amax", "a finite value >= 0", std::to_string(amax));
  }
  if (amax == 0.0f) return 0;  // zero block: scale 1, every code encodes zero
  int e;
  const float m = std::frexp(amax, &e);  // amax = m * 2^e, m in [0.5, 1), exact
  // amax / 2^k <= 448 = 0.875 * 2^9  <=>  m * 2^(e - k - 9) <= 0.875: k = e - 9 when
  // m <= 0.875 (amax / 2^k = 512 m in [256, 448]), else k = e - 8 (256 m in (224, 256)).
  const int k = m <= 0.875f ? e - 9 : e - 8;
  return std::max(k, kMinScaleExponent);
}

float pow2(int k) { return std::ldexp(1.0f, k); }

uint8_t quantize_e4m3(float v, int k) {
  // Exact unless the product falls below 2^-126, where both it and its fp32 rounding encode
  // to a zero (anything <= 2^-10 does), so the code is the same either way.
  return to_e4m3(v * pow2(-k));
}

namespace {

// Validates a [rows, cols] view with row stride ld (0 = cols) and returns the stride.
int64_t check_view(const void* v, int64_t rows, int64_t cols, int64_t ld, const char* name) {
  const std::string arg = name ? name : "(unnamed tensor)";
  if (!name) throw_invalid("name", "the tensor's name", "nullptr");
  if (rows < 0 || cols < 0) {
    throw_invalid(arg, "rows >= 0 and cols >= 0",
                  std::to_string(rows) + " x " + std::to_string(cols));
  }
  if (ld == 0) ld = cols;
  if (ld < cols) throw_invalid(arg + " ld", "a row stride >= cols = " + std::to_string(cols),
                               std::to_string(ld));
  if (!v && rows > 0 && cols > 0) throw_invalid(arg, "a pointer to the values", "nullptr");
  return ld;
}

Fp8Tensor quantize_blocks(const float* v, int64_t rows, int64_t cols, int64_t ld,
                          int block_rows, int block_cols, const char* name) {
  ld = check_view(v, rows, cols, ld, name);
  // The first non-finite input in row-major order is reported before anything is computed,
  // so the error does not depend on the block shape or the order blocks are visited.
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float x = v[r * ld + c];
      if (!std::isfinite(x)) {
        throw_invalid(std::string(name) + "[row " + std::to_string(r) + ", col " +
                          std::to_string(c) + "]",
                      "a finite value to quantize to fp8", std::to_string(x));
      }
    }
  }
  Fp8Tensor t;
  t.rows = rows;
  t.cols = cols;
  t.block_rows = block_rows;
  t.block_cols = block_cols;
  t.data.resize(static_cast<size_t>(rows * cols));
  t.scales.resize(static_cast<size_t>(t.scale_rows() * t.scale_cols()));
  for (int64_t br = 0; br < t.scale_rows(); ++br) {
    for (int64_t bc = 0; bc < t.scale_cols(); ++bc) {
      // Edge blocks cover only the elements that exist: nothing is padded.
      const int64_t r0 = br * block_rows, r1 = std::min(rows, r0 + block_rows);
      const int64_t c0 = bc * block_cols, c1 = std::min(cols, c0 + block_cols);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(v[r * ld + c]));
      }
      const int k = scale_exponent(amax);
      t.scales[static_cast<size_t>(br * t.scale_cols() + bc)] = pow2(k);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) t.data[r * cols + c] = quantize_e4m3(v[r * ld + c], k);
      }
    }
  }
  return t;
}

std::vector<float> widen(const uint16_t* v, int64_t rows, int64_t cols, int64_t ld,
                         const char* name) {
  ld = check_view(v, rows, cols, ld, name);
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = from_bf16(v[r * ld + c]);
  }
  return out;
}

}  // namespace

Fp8Tensor quantize_rows_1x128(const float* v, int64_t rows, int64_t cols, const char* name,
                              int64_t ld) {
  return quantize_blocks(v, rows, cols, ld, 1, 128, name);
}

Fp8Tensor quantize_blocks_128x128(const float* v, int64_t rows, int64_t cols, const char* name,
                                  int64_t ld) {
  return quantize_blocks(v, rows, cols, ld, 128, 128, name);
}

Fp8Tensor quantize_rows_1x128(const uint16_t* v, int64_t rows, int64_t cols, const char* name,
                              int64_t ld) {
  const std::vector<float> f = widen(v, rows, cols, ld, name);
  return quantize_blocks(f.data(), rows, cols, cols, 1, 128, name);
}

Fp8Tensor quantize_blocks_128x128(const uint16_t* v, int64_t rows, int64_t cols,
                                  const char* name, int64_t ld) {
  const std::vector<float> f = widen(v, rows, cols, ld, name);
  return quantize_blocks(f.data(), rows, cols, cols, 128, 128, name);
}

std::vector<float> dequantize(const Fp8Tensor& t) {
  std::vector<float> out(t.data.size());
  for (int64_t r = 0; r < t.rows; ++r) {
    for (int64_t c = 0; c < t.cols; ++c) {
      out[r * t.cols + c] = from_e4m3(t.data[r * t.cols + c]) * t.scale_at(r, c);  // exact
    }
  }
  return out;
}

float dot_fp8(const uint8_t* a, const float* a_scales, const uint8_t* w, const float* w_scales,
              int64_t k) {
  return dot_fp8_from(0.0f, a, a_scales, w, w_scales, k);
}

float dot_fp8_from(float acc, const uint8_t* a, const float* a_scales, const uint8_t* w,
                   const float* w_scales, int64_t k) {
  for (int64_t b = 0, k0 = 0; k0 < k; ++b, k0 += 128) {
    const int64_t k1 = std::min(k, k0 + 128);
    float partial = 0.0f;
    // A product of two e4m3 values has at most 8 significant bits: exact in fp32, so whether
    // the compiler contracts this into an fma does not change the result.
    for (int64_t i = k0; i < k1; ++i) partial += from_e4m3(a[i]) * from_e4m3(w[i]);
    // The promotion: block scales applied once per block, one rounding (powers of two make
    // the scale product exact).
    acc = std::fmaf(partial, a_scales[b] * w_scales[b], acc);
  }
  return acc;
}

float dot_fp8(const Fp8Tensor& a, int64_t m, const Fp8Tensor& w, int64_t n) {
  if (a.cols != w.cols) {
    throw_invalid("w.cols", "a.cols = " + std::to_string(a.cols), std::to_string(w.cols));
  }
  if (a.block_cols != 128 || w.block_cols != 128) {
    throw_invalid("a.block_cols, w.block_cols", "128 (the promotion interval)",
                  std::to_string(a.block_cols) + ", " + std::to_string(w.block_cols));
  }
  if (m < 0 || m >= a.rows) throw_invalid("m", "a row of a", std::to_string(m));
  if (n < 0 || n >= w.rows) throw_invalid("n", "a row of w", std::to_string(n));
  const float* sa = a.scales.data() + (m / a.block_rows) * a.scale_cols();
  const float* sw = w.scales.data() + (n / w.block_rows) * w.scale_cols();
  return dot_fp8(a.data.data() + m * a.cols, sa, w.data.data() + n * w.cols, sw, a.cols);
}

}  // namespace mok::ref
