// Helpers of the grouped GEMM tests: device buffers, random bf16 data, segment layouts, the
// CPU reference of every kind (docs/numerics.md rounding) and comparisons.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "reference/bf16.hpp"

namespace mok::gemm_test {

using mok::ref::from_bf16;
using mok::ref::round_bf16;
using mok::ref::to_bf16;
using Bits = std::vector<uint16_t>;

inline bool has_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

template <class T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t count = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : count(n) {
    if (cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) ptr = nullptr;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr(o.ptr), count(o.count) { o.ptr = nullptr; }
  ~DeviceBuffer() { cudaFree(ptr); }
  void upload(const std::vector<T>& v) { cudaMemcpy(ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice); }
  std::vector<T> download() const {
    std::vector<T> v(count);
    cudaMemcpy(v.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
  }
  void poison() { cudaMemset(ptr, 0xFF, count * sizeof(T)); }  // 0xFFFF bf16 / 0xFFFFFFFF fp32: NaN
};

// Segments: segment e holds rows[e] real rows, padded to 128, plus extra[e] whole padding tiles.
struct SegmentLayout {
  std::vector<int32_t> offsets, rows;
  int64_t buffer_rows = 0;
  int experts() const { return static_cast<int>(rows.size()); }
  int seg_len(int e) const { return offsets[e + 1] - offsets[e]; }
  bool is_real(int64_t r) const {
    for (int e = 0; e < experts(); ++e)
      if (r >= offsets[e] && r < offsets[e + 1]) return r - offsets[e] < rows[e];
    return false;
  }
};

inline SegmentLayout make_layout(const std::vector<int>& rows, const std::vector<int>& extra = {}) {
  SegmentLayout l;
  l.rows.assign(rows.begin(), rows.end());
  l.offsets.push_back(0);
  for (size_t e = 0; e < rows.size(); ++e) {
    const int pad = (rows[e] + 127) / 128 * 128 + 128 * (e < extra.size() ? extra[e] : 0);
    l.offsets.push_back(l.offsets.back() + pad);
  }
  l.buffer_rows = l.offsets.back() + 128;  // slack rows after the last segment
  return l;
}

// Uniform random bf16 values in [-scale, scale] (never all zero).
inline Bits random_bits(size_t n, uint32_t seed, float scale) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  Bits v(n);
  for (auto& x : v) x = to_bf16(dist(gen));
  return v;
}

// A row operand [buffer_rows, cols]: random on real rows, zero on padding rows (contract).
inline Bits random_rows(const SegmentLayout& l, int64_t cols, uint32_t seed, float scale) {
  Bits v = random_bits(static_cast<size_t>(l.buffer_rows * cols), seed, scale);
  for (int64_t r = 0; r < l.buffer_rows; ++r)
    if (!l.is_real(r)) std::fill(v.begin() + r * cols, v.begin() + (r + 1) * cols, uint16_t{0});
  return v;
}

inline std::vector<float> to_float(const Bits& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = from_bf16(b[i]);
  return f;
}

// ||gpu - ref|| / ||ref|| (callers pass the real rows only). NaN makes it NaN (never passes).
inline double rel_err(const std::vector<float>& gpu, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = double(gpu[i]) - double(ref[i]);
    num += d * d;
    den += double(ref[i]) * double(ref[i]);
  }
  return std::sqrt(num / den);
}

inline std::vector<float> real_rows_of(const SegmentLayout& l, const std::vector<float>& v, int64_t cols) {
  std::vector<float> out;
  for (int64_t r = 0; r < l.buffer_rows; ++r)
    if (l.is_real(r)) out.insert(out.end(), v.begin() + r * cols, v.begin() + (r + 1) * cols);
  return out;
}

// Rows inside segments that are padding must be exactly zero (the epilogue writes them).
inline void expect_padding_zero(const SegmentLayout& l, const Bits& out, int64_t cols, const char* what) {
  for (int64_t r = 0; r < l.offsets.back(); ++r) {
    if (l.is_real(r)) continue;
    for (int64_t c = 0; c < cols; ++c) {
      if (out[r * cols + c] != 0) {
        ADD_FAILURE() << what << ": padding row " << r << " col " << c << " is 0x" << std::hex << out[r * cols + c];
        return;
      }
    }
  }
}

template <class T>
inline void expect_bitwise_equal(const std::vector<T>& a, const std::vector<T>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  if (std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0) return;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) {
      ADD_FAILURE() << what << ": first mismatch at index " << i;
      return;
    }
  }
}

// ---- CPU reference (fp32 sums in index order; bf16 rounding where numerics.md says) ----

inline float sigmoid_ref(float g) { return 1.0f / (1.0f + std::exp(-g)); }

struct Gemm1Ref { std::vector<float> h, g, u; };

// x [R, H], w_gate/w_up [E, I, H] -> h, g, u [R, I] (zeros on padding rows).
inline Gemm1Ref ref_gemm1(const SegmentLayout& l, const std::vector<float>& x, const std::vector<float>& wg,
                          const std::vector<float>& wu, int64_t H, int64_t I) {
  Gemm1Ref o{std::vector<float>(l.buffer_rows * I), std::vector<float>(l.buffer_rows * I),
             std::vector<float>(l.buffer_rows * I)};
  for (int e = 0; e < l.experts(); ++e) {
    for (int r = l.offsets[e]; r < l.offsets[e] + l.rows[e]; ++r) {
      const float* xr = &x[r * H];
      for (int64_t i = 0; i < I; ++i) {
        const float* a = &wg[(e * I + i) * H];
        const float* b = &wu[(e * I + i) * H];
        float sg = 0, su = 0;
        for (int64_t k = 0; k < H; ++k) {
          sg += xr[k] * a[k];
          su += xr[k] * b[k];
        }
        const float g = round_bf16(sg), u = round_bf16(su);
        o.g[r * I + i] = g;
        o.u[r * I + i] = u;
        o.h[r * I + i] = round_bf16(g * sigmoid_ref(g) * u);
      }
    }
  }
  return o;
}

// out[r][n] = bf16(sum_k a[r][k] * bt[e][k][n]) with bt given K x N per expert (row-major),
// a = concatenation of a_parts along K (each [R, Kp]).
inline std::vector<float> ref_rows_gemm(const SegmentLayout& l, const std::vector<const std::vector<float>*>& a_parts,
                                        const std::vector<const std::vector<float>*>& bt_parts, int64_t Kp, int64_t N) {
  std::vector<float> out(l.buffer_rows * N, 0.0f), acc(N);
  for (int e = 0; e < l.experts(); ++e) {
    for (int r = l.offsets[e]; r < l.offsets[e] + l.rows[e]; ++r) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (size_t part = 0; part < a_parts.size(); ++part) {
        const float* ar = &(*a_parts[part])[r * Kp];
        const float* bt = &(*bt_parts[part])[e * Kp * N];
        for (int64_t k = 0; k < Kp; ++k) {
          const float av = ar[k];
          const float* brow = bt + k * N;
          for (int64_t n = 0; n < N; ++n) acc[n] += av * brow[n];
        }
      }
      for (int64_t n = 0; n < N; ++n) out[r * N + n] = round_bf16(acc[n]);
    }
  }
  return out;
}

// [E, R, C] -> [E, C, R] per expert.
inline std::vector<float> transpose_experts(const std::vector<float>& w, int E, int64_t R, int64_t C) {
  std::vector<float> t(w.size());
  for (int e = 0; e < E; ++e)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) t[(e * C + c) * R + r] = w[(e * R + r) * C + c];
  return t;
}

// dW[e][m][n] = sum over real rows r of a[r][m] * b[r][n] (fp32).
inline std::vector<float> ref_wgrad(const SegmentLayout& l, const std::vector<float>& a, const std::vector<float>& b,
                                    int64_t M, int64_t N) {
  std::vector<float> dw(l.experts() * M * N, 0.0f);
  for (int e = 0; e < l.experts(); ++e) {
    for (int r = l.offsets[e]; r < l.offsets[e] + l.rows[e]; ++r) {
      for (int64_t m = 0; m < M; ++m) {
        const float av = a[r * M + m];
        float* d = &dw[(e * M + m) * N];
        const float* br = &b[r * N];
        for (int64_t n = 0; n < N; ++n) d[n] += av * br[n];
      }
    }
  }
  return dw;
}

}  // namespace mok::gemm_test
