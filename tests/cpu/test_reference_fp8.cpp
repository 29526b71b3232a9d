// The FP8 recipe's numerics (src/reference/fp8.hpp, docs/fp8.md) against independent,
// naive definitions written here: e4m3 decoding from the format's formula, encoding by brute
// force over all codes (nearest, ties to the even code, saturating), scales by searching for
// the smallest power of two, and dot products in float64.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "mok/error.hpp"
#include "reference/bf16.hpp"
#include "reference/fp8.hpp"

namespace mok::ref {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---- independent e4m3 definitions ----
bool is_nan_code(int c) { return (c & 0x7F) == 0x7F; }

double naive_decode(int c) {
  const int s = c >> 7, e = (c >> 3) & 0xF, m = c & 7;
  const double a = e == 0 ? (m / 8.0) * std::pow(2.0, -6) : (1 + m / 8.0) * std::pow(2.0, e - 7);
  return s ? -a : a;
}

// Nearest of the 127 non-negative finite codes, ties to the even code, beyond 448 -> 448.
uint8_t naive_encode(float v) {
  static const std::array<double, 0x7F> value = [] {
    std::array<double, 0x7F> t{};
    for (int c = 0; c < 0x7F; ++c) t[c] = naive_decode(c);
    return t;
  }();
  const double a = std::fabs(double(v));
  int best = 0;
  for (int c = 1; c <= 0x7E; ++c) {
    const double d = std::fabs(value[c] - a), db = std::fabs(value[best] - a);
    if (d < db || (d == db && (c & 1) == 0)) best = c;
  }
  return static_cast<uint8_t>((std::signbit(v) ? 0x80 : 0) | best);
}

// Half an e4m3 ulp at the (scaled, |s| <= 448) value s.
double half_ulp(double s) {
  if (std::fabs(s) < std::ldexp(1.0, -6)) return std::ldexp(1.0, -10);
  int e;
  std::frexp(s, &e);  // |s| in [2^(e-1), 2^e): ulp 2^(e-1-3)
  return std::ldexp(1.0, e - 5);
}

// The smallest k >= -126 with amax <= 448 * 2^k, by search.
int naive_scale_exponent(float amax) {
  if (amax == 0) return 0;
  int k = -126;
  while (double(amax) > 448.0 * std::ldexp(1.0, k)) ++k;
  return k;
}

TEST(Fp8E4m3, EveryCodeDecodesExactlyAndReencodesToItself) {
  for (int c = 0; c < 256; ++c) {
    const float f = from_e4m3(static_cast<uint8_t>(c));
    if (is_nan_code(c)) {
      EXPECT_TRUE(std::isnan(f)) << c;
      EXPECT_EQ(to_e4m3(f), kE4m3NaN) << c;
      continue;
    }
    EXPECT_EQ(double(f), naive_decode(c)) << c;
    EXPECT_EQ(std::signbit(f), c >= 0x80) << c;  // 0x80 is -0
    EXPECT_EQ(to_e4m3(f), c) << c;
  }
  for (int c = 0; c < 0x7E; ++c) EXPECT_LT(from_e4m3(c), from_e4m3(c + 1)) << c;
  EXPECT_EQ(from_e4m3(0x01), 0x1p-9f);
  EXPECT_EQ(from_e4m3(0x08), 0x1p-6f);
  EXPECT_EQ(from_e4m3(0x7E), 448.0f);
  EXPECT_EQ(from_e4m3(0xFE), -448.0f);
}

TEST(Fp8E4m3, MidpointsRoundToTheEvenCodeIncludingSubnormals) {
  for (int c = 0; c < 0x7E; ++c) {
    const float lo = from_e4m3(c), hi = from_e4m3(c + 1);
    const float mid = (lo + hi) / 2;  // at most 5 significant bits: exact
    ASSERT_EQ(double(mid), (double(lo) + double(hi)) / 2);
    const int even = (c & 1) ? c + 1 : c;
    EXPECT_EQ(to_e4m3(mid), even) << "between codes " << c << " and " << c + 1;
    EXPECT_EQ(to_e4m3(-mid), 0x80 | even) << c;
    EXPECT_EQ(to_e4m3(std::nextafter(mid, 0.0f)), c) << c;
    EXPECT_EQ(to_e4m3(std::nextafter(mid, kInf)), c + 1) << c;
  }
  EXPECT_EQ(to_e4m3(0x1p-10f), 0x00);                 // 0 / 2^-9 tie: even 0
  EXPECT_EQ(to_e4m3(3 * 0x1p-10f), 0x02);             // 2^-9 / 2^-8 tie: even 2 * 2^-9
  EXPECT_EQ(to_e4m3(0x1p-6f - 0x1p-10f), 0x08);       // 7 * 2^-9 / 2^-6 tie: even code 8
}

TEST(Fp8E4m3, SaturatesAndHandlesSpecials) {
  for (float v : {448.0f, std::nextafter(448.0f, kInf), 449.0f, 464.0f, 480.0f, 1e30f,
                  std::numeric_limits<float>::max(), kInf}) {
    EXPECT_EQ(to_e4m3(v), 0x7E) << v;
    EXPECT_EQ(to_e4m3(-v), 0xFE) << v;
  }
  EXPECT_EQ(to_e4m3(432.0f), 0x7E);                          // 416 / 448 tie: even 448
  EXPECT_EQ(to_e4m3(std::nextafter(432.0f, 0.0f)), 0x7D);    // just below: stays 416
  EXPECT_EQ(to_e4m3(kNaN), kE4m3NaN);
  EXPECT_EQ(to_e4m3(-kNaN), kE4m3NaN);                       // NaN's sign is dropped
  EXPECT_EQ(to_e4m3(0.0f), 0x00);
  EXPECT_EQ(to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(to_e4m3(-1e-30f), 0x80);                         // rounds to zero, sign kept
  EXPECT_EQ(to_e4m3(std::numeric_limits<float>::denorm_min()), 0x00);
}

TEST(Fp8E4m3, MatchesBruteForceOnRandomValues) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> exp(-14, 10);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t mant = rng() & 0x007FFFFFu, sign = rng() & 0x80000000u;
    const uint32_t bits = sign | (uint32_t(exp(rng) + 127) << 23) | mant;
    float v;
    std::memcpy(&v, &bits, 4);
    ASSERT_EQ(to_e4m3(v), naive_encode(v)) << v;
  }
  for (int i = 0; i < 50000; ++i) {  // any fp32 bits
    const uint32_t bits = rng();
    float v;
    std::memcpy(&v, &bits, 4);
    if (std::isnan(v)) continue;
    ASSERT_EQ(to_e4m3(v), naive_encode(v)) << v;
  }
}

TEST(Fp8Scale, ExponentIsTheSmallestPowerOfTwoThatFits) {
  EXPECT_EQ(scale_exponent(0.0f), 0);
  EXPECT_EQ(scale_exponent(448.0f), 0);
  EXPECT_EQ(scale_exponent(std::nextafter(448.0f, kInf)), 1);
  EXPECT_EQ(scale_exponent(224.0f), -1);
  EXPECT_EQ(scale_exponent(std::nextafter(224.0f, kInf)), 0);
  EXPECT_EQ(scale_exponent(1.0f), -8);  // 1 / 2^-8 = 256
  EXPECT_EQ(scale_exponent(std::numeric_limits<float>::max()), 120);
  EXPECT_EQ(scale_exponent(448.0f * 0x1p-126f), -126);
  EXPECT_EQ(scale_exponent(224.0f * 0x1p-126f), -126);  // clamped: 2^-127 is not a normal fp32
  EXPECT_EQ(scale_exponent(std::numeric_limits<float>::denorm_min()), -126);
  for (float bad : {-1.0f, kInf, kNaN}) EXPECT_THROW(scale_exponent(bad), Error) << bad;

  std::mt19937 rng(11);
  for (int i = 0; i < 100000; ++i) {
    const uint32_t bits = rng() & 0x7FFFFFFFu;
    float amax;
    std::memcpy(&amax, &bits, 4);
    if (!std::isfinite(amax)) continue;
    const int k = scale_exponent(amax);
    ASSERT_EQ(k, naive_scale_exponent(amax)) << amax;
    ASSERT_EQ(double(pow2(k)), std::ldexp(1.0, k));
    if (amax > 0 && k > -126) {
      const double q = double(amax) / std::ldexp(1.0, k);
      ASSERT_TRUE(q > 224.0 && q <= 448.0) << amax;
    }
  }
}

// Values spanning many magnitudes: per row a base exponent, per element a spread of up to
// 2^`spread`, some exact zeros, bf16-representable like mok's inputs.
std::vector<float> random_values(std::mt19937_64& rng, int64_t rows, int64_t cols, int spread) {
  std::uniform_int_distribution<int> base(-40, 40), off(0, spread), zero(0, 19);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    const int b = base(rng);
    for (int64_t c = 0; c < cols; ++c) {
      const float x = zero(rng) == 0 ? 0.0f : std::ldexp(mant(rng), b - off(rng));
      v[r * cols + c] = round_bf16((rng() & 1) ? -x : x);
    }
  }
  return v;
}

// Every block: scale = the power of two of the amax over its existing elements (ld-strided
// input), codes = to_e4m3(v / scale) = to_e4m3(v * (1 / scale)), dequantization exact and
// within half an e4m3 ulp of the scaled value times the scale.
void check_quantized(const Fp8Tensor& t, const float* v, int64_t ld) {
  ASSERT_EQ(t.data.size(), size_t(t.rows * t.cols));
  ASSERT_EQ(t.scales.size(), size_t(t.scale_rows() * t.scale_cols()));
  const std::vector<float> deq = dequantize(t);
  for (int64_t br = 0; br < t.scale_rows(); ++br) {
    for (int64_t bc = 0; bc < t.scale_cols(); ++bc) {
      float amax = 0;
      for (int64_t r = br * t.block_rows; r < std::min(t.rows, (br + 1) * t.block_rows); ++r) {
        for (int64_t c = bc * t.block_cols; c < std::min(t.cols, (bc + 1) * t.block_cols); ++c)
          amax = std::max(amax, std::fabs(v[r * ld + c]));
      }
      const float scale = t.scales[br * t.scale_cols() + bc];
      const int k = naive_scale_exponent(amax);
      ASSERT_EQ(double(scale), std::ldexp(1.0, k)) << "block " << br << ", " << bc;
      if (amax > 0 && k > -126) {
        ASSERT_GT(amax / scale, 224.0f);
        ASSERT_LE(amax / scale, 448.0f);
      }
    }
  }
  for (int64_t r = 0; r < t.rows; ++r) {
    for (int64_t c = 0; c < t.cols; ++c) {
      const float x = v[r * ld + c], scale = t.scale_at(r, c);
      const uint8_t code = t.data[r * t.cols + c];
      ASSERT_EQ(code, to_e4m3(x / scale)) << r << ", " << c;
      ASSERT_EQ(code, to_e4m3(x * (1.0f / scale))) << r << ", " << c;
      const double d = deq[r * t.cols + c];
      ASSERT_EQ(d, naive_decode(code) * double(scale));
      ASSERT_LE(std::fabs(d - x), half_ulp(double(x) / scale) * scale) << r << ", " << c;
    }
  }
}

TEST(Fp8Quantize, ErrorWithinHalfAnUlpAcrossMagnitudesAndSeeds) {
  for (uint64_t seed : {1, 2, 3, 4, 5}) {
    std::mt19937_64 rng(seed);
    const int spread = seed % 2 ? 4 : 30;  // narrow and very wide blocks (subnormals, zeros)
    const int64_t rows = 37 + 50 * seed, cols = 64 + 97 * seed;
    const std::vector<float> v = random_values(rng, rows, cols, spread);
    SCOPED_TRACE("seed " + std::to_string(seed));
    check_quantized(quantize_rows_1x128(v.data(), rows, cols, "x"), v.data(), cols);
    check_quantized(quantize_blocks_128x128(v.data(), rows, cols, "w"), v.data(), cols);
  }
  // A block holding both fp32 extremes: the small values' scaled products underflow fp32
  // and still encode to zero.
  std::vector<float> v = {3e38f, 1e-38f, -2e-45f, 1.0f, -3e38f};
  check_quantized(quantize_rows_1x128(v.data(), 1, 5, "x"), v.data(), 5);
}

TEST(Fp8Quantize, ZeroBlocksHaveScaleOneAndZeroCodes) {
  const int64_t rows = 3, cols = 300;
  std::vector<float> v(rows * cols, 0.0f);
  for (int64_t c = 128; c < 256; ++c) v[cols + c] = 1.5f;     // row 1, block 1: not zero
  for (int64_t c = 256; c < 300; ++c) v[cols + c] = -0.0f;    // row 1, block 2: -0
  const Fp8Tensor t = quantize_rows_1x128(v.data(), rows, cols, "x");
  const std::vector<float> deq = dequantize(t);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      if (r == 1 && c >= 128 && c < 256) continue;
      EXPECT_EQ(t.scale_at(r, c), 1.0f);
      EXPECT_EQ(t.data[r * cols + c], std::signbit(v[r * cols + c]) ? 0x80 : 0x00);
      EXPECT_EQ(deq[r * cols + c], 0.0f);
      EXPECT_EQ(std::signbit(deq[r * cols + c]), std::signbit(v[r * cols + c]));
    }
  }
  const std::vector<float> zeros(130 * 200, 0.0f);
  const Fp8Tensor w = quantize_blocks_128x128(zeros.data(), 130, 200, "w");
  EXPECT_EQ(w.scales, std::vector<float>(4, 1.0f));
  EXPECT_EQ(w.data, std::vector<uint8_t>(130 * 200, 0));
  EXPECT_EQ(dequantize(w), zeros);
}

TEST(Fp8Quantize, PartialBlocksUseOnlyExistingElements) {
  // A [130, 200] tensor inside a [256, 256] buffer whose padding is huge (and NaN in places):
  // none of it may reach a scale, a code or the non-finite check.
  const int64_t rows = 130, cols = 200, ld = 256;
  std::vector<float> buf(256 * 256, 1e30f);
  buf[5 * ld + 201] = kNaN;
  buf[129 * ld + 255] = kInf;
  buf[200 * ld + 7] = kNaN;
  std::mt19937_64 rng(42);
  const std::vector<float> v = random_values(rng, rows, cols, 6);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) buf[r * ld + c] = v[r * cols + c];
  }
  for (int kind = 0; kind < 2; ++kind) {
    using Quantize = Fp8Tensor (*)(const float*, int64_t, int64_t, const char*, int64_t);
    const Quantize quantize_fn = kind == 0 ? Quantize(quantize_rows_1x128)
                                           : Quantize(quantize_blocks_128x128);
    const auto quantize = [&](const float* p, int64_t r, int64_t c, int64_t l) {
      return quantize_fn(p, r, c, "t", l);
    };
    const Fp8Tensor t = quantize(buf.data(), rows, cols, ld);
    EXPECT_EQ(t.scale_rows(), kind == 0 ? 130 : 2);
    EXPECT_EQ(t.scale_cols(), 2);
    check_quantized(t, buf.data(), ld);
    const Fp8Tensor dense = quantize(v.data(), rows, cols, 0);
    EXPECT_EQ(t.data, dense.data);
    EXPECT_EQ(t.scales, dense.scales);
  }
}

void expect_error(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no mok::Error; expected one naming " << needle;
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Fp8Quantize, NonFiniteInputsThrowNamingTheFirstElement) {
  std::vector<float> x(4 * 300, 0.5f);
  x[2 * 300 + 250] = kNaN;
  x[3 * 300 + 5] = kInf;
  expect_error([&] { quantize_rows_1x128(x.data(), 4, 300, "x"); }, "x[row 2, col 250]");
  x[2 * 300 + 250] = -kInf;
  expect_error([&] { quantize_rows_1x128(x.data(), 4, 300, "x"); }, "got -inf");
  // First in row-major order, not in block order: (3, 150) is in block (0, 1), after (0, 0).
  std::vector<float> w(200 * 300, -0.25f);
  w[3 * 300 + 150] = kInf;
  w[100 * 300 + 2] = kNaN;
  expect_error([&] { quantize_blocks_128x128(w.data(), 200, 300, "w_gate"); },
               "w_gate[row 3, col 150]");
  std::vector<uint16_t> b(2 * 130, to_bf16(1.0f));
  b[130 + 129] = 0x7FC0;  // bf16 NaN
  expect_error([&] { quantize_rows_1x128(b.data(), 2, 130, "dy"); }, "dy[row 1, col 129]");
}

TEST(Fp8Quantize, RejectsBadViews) {
  const std::vector<float> v(64, 1.0f);
  expect_error([&] { quantize_rows_1x128(v.data(), -1, 8, "x"); }, "x: expected rows >= 0");
  expect_error([&] { quantize_rows_1x128(v.data(), 2, 8, "x", 4); }, "x ld");
  expect_error([&] { quantize_blocks_128x128(static_cast<const float*>(nullptr), 2, 8, "w"); },
               "w: expected a pointer");
  expect_error([&] { quantize_rows_1x128(v.data(), 2, 8, nullptr); }, "name");
  const Fp8Tensor empty = quantize_rows_1x128(static_cast<const float*>(nullptr), 0, 0, "x");
  EXPECT_TRUE(empty.data.empty() && empty.scales.empty());
}

TEST(Fp8Quantize, Bf16InputsMatchTheirFp32Values) {
  std::mt19937_64 rng(9);
  const int64_t rows = 140, cols = 300, ld = 320;
  const std::vector<float> f = random_values(rng, rows, ld, 20);
  std::vector<uint16_t> b(f.size());
  for (size_t i = 0; i < f.size(); ++i) b[i] = to_bf16(f[i]);  // exact: f is bf16-valued
  for (int64_t l : {int64_t{0}, ld}) {
    const int64_t c = l ? cols : ld;
    const Fp8Tensor x1 = quantize_rows_1x128(b.data(), rows, c, "x", l);
    const Fp8Tensor x2 = quantize_rows_1x128(f.data(), rows, c, "x", l);
    EXPECT_EQ(x1.data, x2.data);
    EXPECT_EQ(x1.scales, x2.scales);
    const Fp8Tensor w1 = quantize_blocks_128x128(b.data(), rows, c, "w", l);
    const Fp8Tensor w2 = quantize_blocks_128x128(f.data(), rows, c, "w", l);
    EXPECT_EQ(w1.data, w2.data);
    EXPECT_EQ(w1.scales, w2.scales);
  }
}

// The dgrad's K-major W^T needs no new rounding: a 128x128 block's amax does not depend on
// the orientation, so quantizing W^T is transposing W's codes and scale grid.
TEST(Fp8Quantize, TransposeOf128x128BlocksIsExact) {
  std::mt19937_64 rng(5);
  const int64_t R = 200, C = 300;
  const std::vector<float> w = random_values(rng, R, C, 12);
  std::vector<float> wt(w.size());
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) wt[c * R + r] = w[r * C + c];
  }
  const Fp8Tensor q = quantize_blocks_128x128(w.data(), R, C, "w");
  const Fp8Tensor qt = quantize_blocks_128x128(wt.data(), C, R, "w^T");
  ASSERT_EQ(qt.scale_rows(), q.scale_cols());
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) {
      ASSERT_EQ(qt.data[c * R + r], q.data[r * C + c]);
      ASSERT_EQ(qt.scale_at(c, r), q.scale_at(r, c));
    }
  }
}

TEST(Fp8Dot, MatchesFloat64OfTheDequantizedOperands) {
  for (uint64_t seed : {1, 2, 3}) {
    for (int64_t K : {int64_t{300}, int64_t{1024}, int64_t{77}}) {
      std::mt19937_64 rng(seed * 100 + K);
      const int64_t M = 6, N = 150;  // two weight block rows
      const std::vector<float> a = random_values(rng, M, K, 8), w = random_values(rng, N, K, 8);
      const Fp8Tensor qa = quantize_rows_1x128(a.data(), M, K, "x");
      const Fp8Tensor qw = quantize_blocks_128x128(w.data(), N, K, "w");
      const std::vector<float> da = dequantize(qa), dw = dequantize(qw);
      const int64_t blocks = (K + 127) / 128;
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t n = 0; n < N; ++n) {
          double exact = 0, magnitude = 0;  // products of dequantized values: exact in double
          for (int64_t k = 0; k < K; ++k) {
            exact += double(da[m * K + k]) * double(dw[n * K + k]);
            magnitude += std::fabs(double(da[m * K + k]) * double(dw[n * K + k]));
          }
          const float got = dot_fp8(qa, m, qw, n);
          // fp32 summation bound: <= 127 roundings inside a block, one per promotion.
          const double bound = (128 + blocks) * 0x1p-24 * magnitude * 1.01;
          ASSERT_LE(std::fabs(double(got) - exact), bound) << m << ", " << n << ", K " << K;
        }
      }
    }
  }
}

TEST(Fp8Dot, HandComputedCasesBitExact) {
  // K = 130: block 0 is 128 x (1 * 0.5) = 64, block 1 is 2 * 1.5 + 3 * -0.25 = 2.25;
  // scales 0.5 * 4 and 8 * 0.25: 64 * 2 + 2.25 * 2 = 132.5.
  std::vector<uint8_t> a(130, 0x38), w(130, 0x30);
  a[128] = 0x40, a[129] = 0x44, w[128] = 0x3C, w[129] = 0xA8;
  ASSERT_EQ(from_e4m3(0x44), 3.0f);
  ASSERT_EQ(from_e4m3(0xA8), -0.25f);
  const float sa[] = {0.5f, 8.0f}, sw[] = {4.0f, 0.25f};
  EXPECT_EQ(dot_fp8(a.data(), sa, w.data(), sw, 130), 132.5f);

  // The order is part of the definition. K = 300 (blocks of 128, 128, 44):
  //  block 0: 256 * 256 + 1 * 2^-8 + 1 * 2^-8: each 2^-8 is half an ulp of 65536, a tie
  //           that stays at the even 65536; times 2^8 * 1 = 2^24.
  //  block 1: 1 * 1 times 0.5 * 2 = 1: 2^24 + 1 is a tie, stays 2^24; block 2 likewise.
  // The exact value is 2^24 + 4; the definition gives exactly 2^24.
  std::vector<uint8_t> a2(300, 0x00), w2(300, 0x00);
  a2[0] = 0x78, w2[0] = 0x78;  // 256, 256
  a2[1] = a2[2] = 0x38;        // 1
  w2[1] = w2[2] = 0x02;        // 2^-8 (subnormal)
  a2[128] = w2[128] = 0x38;
  a2[299] = w2[299] = 0x38;
  ASSERT_EQ(from_e4m3(0x78), 256.0f);
  ASSERT_EQ(from_e4m3(0x02), 0x1p-8f);
  const float sa2[] = {256.0f, 0.5f, 8.0f}, sw2[] = {1.0f, 2.0f, 0.125f};
  EXPECT_EQ(dot_fp8(a2.data(), sa2, w2.data(), sw2, 300), 16777216.0f);
  EXPECT_EQ(dot_fp8(a2.data(), sa2, w2.data(), sw2, 0), 0.0f);
}

}  // namespace
}  // namespace mok::ref
