// GPU tests of the FP8 block quantizers (src/gemm/fp8_quantize): codes and scales bit for bit
// against the CPU reference (docs/fp8.md) on inputs spanning many binades (subnormal and
// flushed-to-zero codes, rounding ties, zero blocks, signed zeros, clamped scales), with partial
// blocks, padded strides and misaligned views; every byte outside the tensors keeps its poison;
// a non-finite input is reported at the first one in row-major order; repeats are bitwise equal.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gemm/fp8_quantize.hpp"
#include "mok/error.hpp"
#include "reference/fp8.hpp"
#include "test_gemm_util.hpp"

namespace mok::gemm_test {
namespace {

using ref::Fp8Tensor;

#define SKIP_WITHOUT_GPU() \
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount reports none)"

constexpr uint16_t kNaN = 0x7FC0, kPosInf = 0x7F80, kNegInf = 0xFF80;
constexpr int64_t kTail = 64;  // poisoned elements after every output, to catch overruns
const float kPoisonScale = std::bit_cast<float>(0xFFFFFFFFu);

int64_t ceil128(int64_t n) { return (n + 127) / 128; }

// Random bf16 bits [rows][ld] over many binades: element (r, c) has the exponent
// base + (a shift in [-10, 10] per 32x32 region) - (0..20), 7 random mantissa bits and a random
// sign; below bf16's range it rounds to a subnormal or a zero. 3% are signed zeros; rows
// r % 11 == 5 and columns c % 13 == 7 are all (signed) zeros, so some 1x128 and 128x1 blocks
// are zero blocks. Columns past cols (the ld padding) hold NaN: reading them would be reported.
Bits random_wide(int64_t rows, int64_t cols, int64_t ld, uint32_t seed, int base) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> shift(-10, 10), drop(0, 20), mant(0, 127), coin(0, 99);
  const int64_t region_cols = (cols + 31) / 32;
  std::vector<int> region(static_cast<size_t>((rows + 31) / 32 * region_cols));
  for (auto& s : region) s = shift(gen);
  Bits x(static_cast<size_t>(rows * ld), kNaN);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int roll = coin(gen);
      const uint16_t sign = (roll & 1) ? 0x8000 : 0;
      if (r % 11 == 5 || c % 13 == 7 || roll < 3) {
        x[r * ld + c] = sign;
        continue;
      }
      int e = base + region[static_cast<size_t>((r / 32) * region_cols + c / 32)] - drop(gen);
      e = std::clamp(e, -140, 127);
      const float v = std::ldexp(1.0f + static_cast<float>(mant(gen)) / 128.0f, e);
      x[r * ld + c] = static_cast<uint16_t>(to_bf16(v) | sign);
    }
  }
  return x;
}

template <class T>
void expect_same(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      uint64_t g = 0, w = 0;
      std::memcpy(&g, &got[i], sizeof(T));
      std::memcpy(&w, &want[i], sizeof(T));
      ADD_FAILURE() << what << ": first mismatch at index " << i << ": got 0x" << std::hex << g << ", want 0x" << w;
      return;
    }
  }
}

struct Outputs {
  std::vector<uint8_t> codes, codes_t;
  std::vector<float> scales, scales_t;
};

void expect_same(const Outputs& got, const Outputs& want, const std::string& what) {
  expect_same(got.codes, want.codes, what + " codes");
  expect_same(got.scales, want.scales, what + " scales");
  expect_same(got.codes_t, want.codes_t, what + " codes_t");
  expect_same(got.scales_t, want.scales_t, what + " scales_t");
}

// A device NonFiniteRecord, reset.
struct Record {
  DeviceBuffer<gemm::NonFiniteRecord> d{1};
  Record() { gemm::reset_nonfinite(d.ptr, nullptr); }
};

// Uploads x at element offset `off` of a fresh device buffer.
DeviceBuffer<uint16_t> device_input(const Bits& x, int64_t off) {
  DeviceBuffer<uint16_t> d(static_cast<size_t>(off) + x.size());
  cudaMemcpy(d.ptr + off, x.data(), x.size() * sizeof(uint16_t), cudaMemcpyHostToDevice);
  return d;
}

const __nv_bfloat16* as_bf16(const uint16_t* p) { return reinterpret_cast<const __nv_bfloat16*>(p); }

// ---- 1x128 rows ----

struct RowsCase {
  int64_t rows, cols, ld, codes_ld, scales_ld;  // 0 = the API's default
  int base;                                      // exponent of the largest values
  int64_t x_off = 0, codes_off = 0;              // misaligned views (elements / bytes)
  int64_t ld_() const { return ld ? ld : cols; }
  int64_t codes_ld_() const { return codes_ld ? codes_ld : cols; }
  int64_t scales_ld_() const { return scales_ld ? scales_ld : rows; }
  std::string name() const {
    return "rows " + std::to_string(rows) + " x cols " + std::to_string(cols) + " (ld " + std::to_string(ld_()) +
           ", base 2^" + std::to_string(base) + ")";
  }
};

Outputs run_rows(const RowsCase& k, const Bits& x, gemm::NonFiniteRecord* rec) {
  DeviceBuffer<uint16_t> dx = device_input(x, k.x_off);
  DeviceBuffer<uint8_t> codes(static_cast<size_t>(k.codes_off + k.rows * k.codes_ld_() + kTail));
  DeviceBuffer<float> scales(static_cast<size_t>(ceil128(k.cols) * k.scales_ld_() + kTail));
  codes.poison();
  scales.poison();
  gemm::QuantizeRowsArgs a;
  a.x = as_bf16(dx.ptr + k.x_off);
  a.rows = k.rows, a.cols = k.cols, a.ld = k.ld;
  a.codes = codes.ptr + k.codes_off, a.codes_ld = k.codes_ld;
  a.scales = scales.ptr, a.scales_ld = k.scales_ld;
  a.nonfinite = rec;
  gemm::quantize_rows_1x128(a, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {codes.download(), {}, scales.download(), {}};
}

Outputs want_rows(const RowsCase& k, const Bits& x) {
  const Fp8Tensor t = ref::quantize_rows_1x128(x.data(), k.rows, k.cols, "x", k.ld_());
  const int64_t nb = ceil128(k.cols);
  Outputs w{std::vector<uint8_t>(static_cast<size_t>(k.codes_off + k.rows * k.codes_ld_() + kTail), 0xFF), {},
            std::vector<float>(static_cast<size_t>(nb * k.scales_ld_() + kTail), kPoisonScale), {}};
  for (int64_t r = 0; r < k.rows; ++r) {
    for (int64_t c = 0; c < k.cols; ++c) w.codes[k.codes_off + r * k.codes_ld_() + c] = t.data[r * k.cols + c];
    for (int64_t b = 0; b < nb; ++b) w.scales[b * k.scales_ld_() + r] = t.scales[r * nb + b];
  }
  return w;
}

TEST(Fp8Quantize, RowsMatchReference) {
  SKIP_WITHOUT_GPU();
  const RowsCase cases[] = {
      {1, 1, 0, 16, 0, 0},          {3, 77, 80, 80, 5, 3},      {5, 128, 0, 0, 0, -20},
      {130, 200, 203, 224, 131, 7}, {33, 2880, 0, 0, 40, 0},    {7, 2880, 2888, 2896, 0, 120},
      {257, 129, 0, 144, 0, -118},  {9, 300, 302, 320, 0, -128}, {20, 256, 256, 256, 0, 10, 1, 3},
  };
  uint32_t seed = 1;
  for (const RowsCase& k : cases) {
    Record rec;
    const Bits x = random_wide(k.rows, k.cols, k.ld_(), seed++, k.base);
    const Outputs first = run_rows(k, x, rec.d.ptr);
    expect_same(first, want_rows(k, x), k.name());
    expect_same(run_rows(k, x, rec.d.ptr), first, k.name() + " repeat");
    EXPECT_NO_THROW(gemm::check_nonfinite(rec.d.ptr, k.cols, "x", nullptr)) << k.name();
  }
}

// The inverse: quantize_rows_1x128 then dequantize_rows_1x128 gives ref::dequantize's values
// rounded to bf16 (exact here), also in strided layouts; nothing outside the output is written.
TEST(Fp8Quantize, DequantizeRowsInvertsTheQuantizer) {
  SKIP_WITHOUT_GPU();
  const RowsCase cases[] = {{3, 77, 80, 80, 5, 3}, {130, 200, 203, 224, 131, 7}, {33, 2880, 0, 0, 40, 0},
                            {257, 129, 0, 144, 0, -118}};
  uint32_t seed = 900;
  for (const RowsCase& k : cases) {
    Record rec;
    const Bits x = random_wide(k.rows, k.cols, k.ld_(), seed++, k.base);
    DeviceBuffer<uint16_t> dx = device_input(x, 0);
    DeviceBuffer<uint8_t> codes(static_cast<size_t>(k.rows * k.codes_ld_()));
    DeviceBuffer<float> scales(static_cast<size_t>(ceil128(k.cols) * k.scales_ld_()));
    const int64_t out_ld = k.cols + 8;
    DeviceBuffer<uint16_t> out(static_cast<size_t>(k.rows * out_ld + kTail));
    out.poison();
    gemm::QuantizeRowsArgs q;
    q.x = as_bf16(dx.ptr), q.rows = k.rows, q.cols = k.cols, q.ld = k.ld;
    q.codes = codes.ptr, q.codes_ld = k.codes_ld, q.scales = scales.ptr, q.scales_ld = k.scales_ld;
    q.nonfinite = rec.d.ptr;
    gemm::quantize_rows_1x128(q, nullptr);
    gemm::DequantizeRowsArgs d;
    d.codes = codes.ptr, d.rows = k.rows, d.cols = k.cols, d.codes_ld = k.codes_ld;
    d.scales = scales.ptr, d.scales_ld = k.scales_ld;
    d.out = reinterpret_cast<__nv_bfloat16*>(out.ptr), d.ld = out_ld;
    gemm::dequantize_rows_1x128(d, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<uint16_t> got = out.download();
    const std::vector<float> want = ref::dequantize(ref::quantize_rows_1x128(x.data(), k.rows, k.cols, "x", k.ld_()));
    int64_t bad = 0, poisoned = 0;
    for (int64_t r = 0; r < k.rows; ++r) {
      for (int64_t c = 0; c < out_ld; ++c) {
        const uint16_t g = got[r * out_ld + c];
        if (c < k.cols) bad += g != ref::to_bf16(want[r * k.cols + c]);
        else poisoned += g != got.back();
      }
    }
    EXPECT_EQ(bad, 0) << k.name();
    EXPECT_EQ(poisoned, 0) << k.name() << ": written past cols";
  }
}

// ---- 128x1 blocks along the rows of x, written transposed ----

struct ColsCase {
  int64_t rows, cols, ld, codes_t_ld, scales_t_ld;
  int base;
  int64_t x_off = 0;
  int64_t ld_() const { return ld ? ld : cols; }
  int64_t codes_t_ld_() const { return codes_t_ld ? codes_t_ld : rows; }
  int64_t scales_t_ld_() const { return scales_t_ld ? scales_t_ld : cols; }
  std::string name() const {
    return "rows " + std::to_string(rows) + " x cols " + std::to_string(cols) + " transposed (ld " +
           std::to_string(ld_()) + ", base 2^" + std::to_string(base) + ")";
  }
};

// With row_codes_ld > 0 the row quantization of the same x too (QuantizeColsArgs::row_codes: codes
// [rows][row_codes_ld], K-block major scales with ld rows); limit_dev: the optional device row limit.
Outputs run_cols(const ColsCase& k, const Bits& x, gemm::NonFiniteRecord* rec, int64_t row_codes_ld = 0,
                 const int64_t* limit_dev = nullptr) {
  DeviceBuffer<uint16_t> dx = device_input(x, k.x_off);
  DeviceBuffer<uint8_t> codes_t(static_cast<size_t>(k.cols * k.codes_t_ld_() + kTail));
  DeviceBuffer<float> scales_t(static_cast<size_t>(ceil128(k.rows) * k.scales_t_ld_() + kTail));
  const bool rows_too = row_codes_ld > 0;
  DeviceBuffer<uint8_t> codes(rows_too ? static_cast<size_t>(k.rows * row_codes_ld + kTail) : 1);
  DeviceBuffer<float> scales(rows_too ? static_cast<size_t>(ceil128(k.cols) * k.rows + kTail) : 1);
  codes_t.poison();
  scales_t.poison();
  codes.poison();
  scales.poison();
  gemm::QuantizeColsArgs a;
  a.x = as_bf16(dx.ptr + k.x_off);
  a.rows = k.rows, a.cols = k.cols, a.ld = k.ld;
  a.codes_t = codes_t.ptr, a.codes_t_ld = k.codes_t_ld;
  a.scales_t = scales_t.ptr, a.scales_t_ld = k.scales_t_ld;
  if (rows_too) {
    a.row_codes = codes.ptr, a.row_codes_ld = row_codes_ld;
    a.row_scales = scales.ptr;
  }
  a.nonfinite = rec;
  a.rows_limit = limit_dev;
  gemm::quantize_cols_128x1_transposed(a, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (!rows_too) return {{}, codes_t.download(), {}, scales_t.download()};
  return {codes.download(), codes_t.download(), scales.download(), scales_t.download()};
}

// The reference on the transposed matrix: quantize_rows_1x128 of x^T [cols][rows].
Outputs want_cols(const ColsCase& k, const Bits& x) {
  Bits xt(static_cast<size_t>(k.rows * k.cols));
  for (int64_t r = 0; r < k.rows; ++r)
    for (int64_t c = 0; c < k.cols; ++c) xt[c * k.rows + r] = x[r * k.ld_() + c];
  const Fp8Tensor t = ref::quantize_rows_1x128(xt.data(), k.cols, k.rows, "x^T");
  const int64_t nb = ceil128(k.rows);
  Outputs w{{}, std::vector<uint8_t>(static_cast<size_t>(k.cols * k.codes_t_ld_() + kTail), 0xFF), {},
            std::vector<float>(static_cast<size_t>(nb * k.scales_t_ld_() + kTail), kPoisonScale)};
  for (int64_t c = 0; c < k.cols; ++c) {
    for (int64_t r = 0; r < k.rows; ++r) w.codes_t[c * k.codes_t_ld_() + r] = t.data[c * k.rows + r];
    for (int64_t b = 0; b < nb; ++b) w.scales_t[b * k.scales_t_ld_() + c] = t.scales[c * nb + b];
  }
  return w;
}

TEST(Fp8Quantize, ColsTransposedMatchReference) {
  SKIP_WITHOUT_GPU();
  const ColsCase cases[] = {
      {1, 1, 0, 16, 0, 0},       {77, 3, 5, 80, 4, 2},       {128, 128, 0, 0, 0, -30},
      {200, 77, 80, 208, 77, 9}, {2880, 33, 0, 0, 40, 0},    {300, 130, 131, 320, 133, 120},
      {129, 257, 0, 144, 0, -118}, {256, 200, 200, 256, 0, -128, 1},
      // the vector path (cols and ld multiples of 8): partial row and column tiles, a strided x
      {300, 136, 0, 320, 0, 7},    {130, 264, 272, 144, 0, -120}, {1, 8, 0, 16, 0, 0},
  };
  uint32_t seed = 100;
  for (const ColsCase& k : cases) {
    Record rec;
    const Bits x = random_wide(k.rows, k.cols, k.ld_(), seed++, k.base);
    const Outputs first = run_cols(k, x, rec.d.ptr);
    expect_same(first, want_cols(k, x), k.name());
    expect_same(run_cols(k, x, rec.d.ptr), first, k.name() + " repeat");
    EXPECT_NO_THROW(gemm::check_nonfinite(rec.d.ptr, k.cols, "x", nullptr)) << k.name();
  }
}

// ---- 128x128 blocks of a stack of matrices ----

struct BlocksCase {
  int64_t batch, rows, cols, stride;  // stride 0 = rows * cols
  bool transposed;
  int base;
  int64_t stride_() const { return stride ? stride : rows * cols; }
  std::string name() const {
    return std::to_string(batch) + " x " + std::to_string(rows) + " x " + std::to_string(cols) + " blocks (stride " +
           std::to_string(stride_()) + (transposed ? ", transposed copy" : "") + ", base 2^" + std::to_string(base) +
           ")";
  }
};

// One matrix stack of random_wide values (the gaps between matrices hold NaN); matrix 0's
// top-right 128x128 block is zero.
Bits blocks_input(const BlocksCase& k, uint32_t seed) {
  Bits w(static_cast<size_t>(k.batch * k.stride_()), kNaN);
  for (int64_t e = 0; e < k.batch; ++e) {
    const Bits m = random_wide(k.rows, k.cols, k.cols, seed + static_cast<uint32_t>(e), k.base);
    std::copy(m.begin(), m.end(), w.begin() + e * k.stride_());
  }
  const int64_t c0 = (ceil128(k.cols) - 1) * 128;
  for (int64_t r = 0; r < std::min<int64_t>(k.rows, 128); ++r)
    for (int64_t c = c0; c < k.cols; ++c) w[r * k.cols + c] = (r + c) % 2 ? 0x8000 : 0;
  return w;
}

Outputs run_blocks(const BlocksCase& k, const Bits& w, gemm::NonFiniteRecord* rec) {
  const int64_t n = k.batch * k.rows * k.cols, ns = k.batch * ceil128(k.rows) * ceil128(k.cols);
  DeviceBuffer<uint16_t> dw = device_input(w, 0);
  DeviceBuffer<uint8_t> codes(static_cast<size_t>(n + kTail)), codes_t(static_cast<size_t>(n + kTail));
  DeviceBuffer<float> scales(static_cast<size_t>(ns + kTail)), scales_t(static_cast<size_t>(ns + kTail));
  codes.poison();
  codes_t.poison();
  scales.poison();
  scales_t.poison();
  gemm::QuantizeBlocksArgs a;
  a.w = as_bf16(dw.ptr);
  a.batch = k.batch, a.rows = k.rows, a.cols = k.cols, a.batch_stride = k.stride;
  a.codes = codes.ptr, a.scales = scales.ptr;
  if (k.transposed) a.codes_t = codes_t.ptr, a.scales_t = scales_t.ptr;
  a.nonfinite = rec;
  gemm::quantize_blocks_128x128(a, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {codes.download(), codes_t.download(), scales.download(), scales_t.download()};
}

// The reference per matrix; the transposed copy is its codes and scale grid transposed
// (untouched poison without one).
Outputs want_blocks(const BlocksCase& k, const Bits& w) {
  const int64_t n = k.batch * k.rows * k.cols, nbr = ceil128(k.rows), nbc = ceil128(k.cols);
  const int64_t ns = k.batch * nbr * nbc;
  Outputs o{std::vector<uint8_t>(static_cast<size_t>(n + kTail), 0xFF),
            std::vector<uint8_t>(static_cast<size_t>(n + kTail), 0xFF),
            std::vector<float>(static_cast<size_t>(ns + kTail), kPoisonScale),
            std::vector<float>(static_cast<size_t>(ns + kTail), kPoisonScale)};
  for (int64_t e = 0; e < k.batch; ++e) {
    const Fp8Tensor t = ref::quantize_blocks_128x128(w.data() + e * k.stride_(), k.rows, k.cols, "w");
    const int64_t m0 = e * k.rows * k.cols, s0 = e * nbr * nbc;
    for (int64_t r = 0; r < k.rows; ++r) {
      for (int64_t c = 0; c < k.cols; ++c) {
        o.codes[m0 + r * k.cols + c] = t.data[r * k.cols + c];
        if (k.transposed) o.codes_t[m0 + c * k.rows + r] = t.data[r * k.cols + c];
      }
    }
    for (int64_t br = 0; br < nbr; ++br) {
      for (int64_t bc = 0; bc < nbc; ++bc) {
        o.scales[s0 + br * nbc + bc] = t.scales[br * nbc + bc];
        if (k.transposed) o.scales_t[s0 + bc * nbr + br] = t.scales[br * nbc + bc];
      }
    }
  }
  return o;
}

TEST(Fp8Quantize, BlocksMatchReference) {
  SKIP_WITHOUT_GPU();
  const BlocksCase cases[] = {
      {1, 1, 1, 0, true, 0},          {2, 77, 200, 77 * 200 + 5, true, 4}, {3, 128, 128, 0, true, -25},
      {2, 200, 2880, 200 * 2880 + 135, true, 0}, {2, 130, 77, 130 * 77 + 3, false, 120},
      {1, 257, 129, 0, true, -118},   {2, 140, 300, 0, true, -128},
  };
  uint32_t seed = 200;
  for (const BlocksCase& k : cases) {
    Record rec;
    const Bits w = blocks_input(k, seed);
    seed += 10;
    const Outputs first = run_blocks(k, w, rec.d.ptr);
    expect_same(first, want_blocks(k, w), k.name());
    expect_same(run_blocks(k, w, rec.d.ptr), first, k.name() + " repeat");
    EXPECT_NO_THROW(gemm::check_nonfinite(rec.d.ptr, k.cols, "w", nullptr)) << k.name();
  }
}

// ---- rounding ties, subnormal codes and flushed values at several scales ----

// Values in units of the block scale 2^K: every e4m3 rounding midpoint (normal and subnormal),
// every code value, values at or below 2^-10 (zero codes), both signs.
std::vector<float> tie_values() {
  std::vector<float> v;
  for (int e = -6; e <= 8; ++e) {
    for (int m = 0; m < 8; ++m) {
      const float code = std::ldexp(8.0f + m, e - 3), mid = std::ldexp(8.5f + m, e - 3);
      if (code <= 448.0f) v.push_back(code);
      if (mid < 448.0f) v.push_back(mid);
    }
  }
  for (int m = 0; m < 8; ++m) {
    v.push_back(std::ldexp(float(m), -9));
    v.push_back(std::ldexp(m + 0.5f, -9));
  }
  for (float t : {0x1p-10f, 0x1p-11f, 0x1.8p-11f, 0x1p-12f, 0x1.8p-10f}) v.push_back(t);
  const size_t n = v.size();
  for (size_t i = 0; i < n; ++i) v.push_back(-v[i]);
  return v;
}

TEST(Fp8Quantize, TiesSubnormalsAndZerosExact) {
  SKIP_WITHOUT_GPU();
  const std::vector<float> vals = tie_values();
  for (int K : {-3, 0, 100, -120}) {
    // x [4][300]: every 128-wide block of a row starts with +-448 * 2^K (its amax, so its scale
    // is exactly 2^K); the rest cycles through the values. x^T is quantized along its rows the
    // same way by the transposed quantizer.
    const int64_t rows = 4, cols = 300;
    Bits x(rows * cols);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const float v = c % 128 == 0 ? ((r + c) % 2 ? -448.0f : 448.0f) : vals[(r * 37 + c) % vals.size()];
        x[r * cols + c] = to_bf16(std::ldexp(v, K));
        ASSERT_EQ(from_bf16(x[r * cols + c]), std::ldexp(v, K)) << "test value not exact in bf16";
      }
    }
    // A few codes spelled out (the reference defines them; these pin the GPU conversion):
    // 432 (tie 416/448) -> 448 = 0x7E; 1.0625 (tie 1/1.125) -> 1.0 = 0x38; 1.1875 -> 1.25 = 0x3A;
    // 3 * 2^-10 (tie 2^-9 / 2^-8) -> 0x02; 2^-10 (tie 0 / 2^-9) -> +0; -2^-10 -> -0 = 0x80.
    const std::pair<float, uint8_t> pinned[] = {{432.0f, 0x7E}, {1.0625f, 0x38}, {1.1875f, 0x3A},
                                                {0x1.8p-9f, 0x02}, {0x1p-10f, 0x00}, {-0x1p-10f, 0x80},
                                                {-0.0f, 0x80}};
    for (size_t i = 0; i < std::size(pinned); ++i) x[1 + i] = to_bf16(std::ldexp(pinned[i].first, K));
    // Inputs far below the block's scale (row 2): v * 2^-K below 2^-126 (an fp32 subnormal or
    // flushed product) unless K = -120, and the smallest bf16 subnormal: signed zero codes.
    const float far = std::ldexp(1.0f, std::max(K - 140, -133));
    const std::pair<uint16_t, uint8_t> tiny[] = {{to_bf16(far), 0x00}, {to_bf16(-far), 0x80},
                                                 {0x0001, 0x00}, {0x8001, 0x80}};
    for (size_t i = 0; i < std::size(tiny); ++i) x[2 * cols + 1 + i] = tiny[i].first;
    const std::string what = "K = " + std::to_string(K);

    Record rec;
    const RowsCase rk{rows, cols, 0, 304, 0, 0};
    const Outputs rows_out = run_rows(rk, x, rec.d.ptr);
    expect_same(rows_out, want_rows(rk, x), what + " rows");
    for (size_t i = 0; i < std::size(pinned); ++i) {
      EXPECT_EQ(int{rows_out.codes[1 + i]}, int{pinned[i].second}) << what << ": code of " << pinned[i].first << " * 2^K";
    }
    for (size_t i = 0; i < std::size(tiny); ++i) {
      EXPECT_EQ(int{rows_out.codes[2 * 304 + 1 + i]}, int{tiny[i].second}) << what << ": code of bf16 0x" << std::hex
                                                                             << tiny[i].first;
    }
    EXPECT_EQ(rows_out.scales[0], std::ldexp(1.0f, K)) << what;

    Bits xt(rows * cols);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) xt[c * rows + r] = x[r * cols + c];
    const ColsCase ck{cols, rows, 0, 304, 0, 0};
    const Outputs cols_out = run_cols(ck, xt, rec.d.ptr);
    expect_same(cols_out, want_cols(ck, xt), what + " transposed");
    for (int64_t r = 0; r < rows; ++r)  // quantizing x^T along its columns gives x's row codes
      for (int64_t c = 0; c < cols; ++c)
        ASSERT_EQ(int{cols_out.codes_t[r * 304 + c]}, int{rows_out.codes[r * 304 + c]}) << what << " row " << r << " col " << c;

    const BlocksCase bk{1, rows, cols, 0, true, 0};
    expect_same(run_blocks(bk, x, rec.d.ptr), want_blocks(bk, x), what + " blocks");
    EXPECT_NO_THROW(gemm::check_nonfinite(rec.d.ptr, cols, "x", nullptr)) << what;
  }
}

// ---- non-finite inputs ----

// Expects check_nonfinite to throw kInvalidArgument naming `where` ("x at row R, column C").
void expect_nonfinite(gemm::NonFiniteRecord* rec, int64_t cols, const char* name, const std::string& where) {
  try {
    gemm::check_nonfinite(rec, cols, name, nullptr);
    ADD_FAILURE() << "no error for a non-finite value at " << where;
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("non-finite value in " + where), std::string::npos) << e.what();
  }
}

// Non-finite elements count as +0: the outputs equal the reference on the input with them zeroed.
Bits zeroed(Bits x, const std::vector<int64_t>& at) {
  for (int64_t i : at) x[i] = 0;
  return x;
}

TEST(Fp8Quantize, NonFiniteReportsFirstInRowMajorOrder) {
  SKIP_WITHOUT_GPU();
  Record rec;
  // rows: the first in row-major order is (2, 5); the others sit in other blocks and rows. Cols 300
  // runs the scalar path, 304 the vector path (16-byte loads).
  for (const RowsCase& k : {RowsCase{5, 300, 304, 304, 0, 0}, RowsCase{5, 304, 304, 304, 0, 0}}) {
    gemm::reset_nonfinite(rec.d.ptr, nullptr);
    Bits x = random_wide(k.rows, k.cols, k.ld_(), 7, 0);
    const std::vector<int64_t> at = {2 * 304 + 200, 2 * 304 + 5, 3 * 304 + 0, 4 * 304 + 299};
    x[at[0]] = kPosInf, x[at[1]] = kNaN, x[at[2]] = kNegInf, x[at[3]] = 0xFFC1;  // negative NaN
    const Outputs out = run_rows(k, x, rec.d.ptr);
    expect_same(out, want_rows(k, zeroed(x, at)), "rows with non-finite values");
    expect_nonfinite(rec.d.ptr, k.cols, "x", "x at row 2, column 5");
    gemm::reset_nonfinite(rec.d.ptr, nullptr);
    run_rows(k, zeroed(x, at), rec.d.ptr);
    EXPECT_NO_THROW(gemm::check_nonfinite(rec.d.ptr, k.cols, "x", nullptr));
  }
  // transposed: the order is x's row-major order, not the transposed output's: (2, 77) comes
  // before (130, 3) although column 3 is written first. Cols 100: the scalar path; 104: the vector path.
  for (const ColsCase& k : {ColsCase{200, 100, 0, 208, 0, 0}, ColsCase{200, 104, 0, 208, 0, 0}}) {
    gemm::reset_nonfinite(rec.d.ptr, nullptr);
    Bits x = random_wide(k.rows, k.cols, k.ld_(), 8, 0);
    const int64_t n = k.cols;
    const std::vector<int64_t> at = {130 * n + 3, 2 * n + 77, 199 * n + 99};
    x[at[0]] = kNaN, x[at[1]] = kNegInf, x[at[2]] = kPosInf;
    const Outputs out = run_cols(k, x, rec.d.ptr);
    expect_same(out, want_cols(k, zeroed(x, at)), "transposed with non-finite values");
    expect_nonfinite(rec.d.ptr, k.cols, "dy", "dy at row 2, column 77");
    gemm::reset_nonfinite(rec.d.ptr, nullptr);
    run_cols(k, zeroed(x, at), rec.d.ptr);
    EXPECT_NO_THROW(gemm::check_nonfinite(rec.d.ptr, k.cols, "dy", nullptr));
  }
  {  // blocks: the stack is one [batch * rows][cols] tensor; matrix 1, row 3, col 5 = row 153.
    const BlocksCase k{2, 150, 140, 150 * 140 + 9, true, 0};
    Bits w = blocks_input(k, 9);
    const int64_t m1 = k.stride_();
    const std::vector<int64_t> at = {m1 + 3 * 140 + 130, m1 + 3 * 140 + 5, m1 + 140 * 140 + 0, m1 + 149 * 140 + 139};
    w[at[0]] = kNegInf, w[at[1]] = kNaN, w[at[2]] = kPosInf, w[at[3]] = kNaN;
    const Outputs out = run_blocks(k, w, rec.d.ptr);
    expect_same(out, want_blocks(k, zeroed(w, at)), "blocks with non-finite values");
    expect_nonfinite(rec.d.ptr, k.cols, "w_gate", "w_gate at row 153, column 5");
    gemm::reset_nonfinite(rec.d.ptr, nullptr);
    run_blocks(k, zeroed(w, at), rec.d.ptr);
    EXPECT_NO_THROW(gemm::check_nonfinite(rec.d.ptr, k.cols, "w_gate", nullptr));
  }
}

// The transposed quantizer with the row quantization of the same x in the same pass
// (QuantizeColsArgs::row_codes; the FP8 backward's dy): both outputs bit for bit the two quantizers',
// on the vector path (one pass) and where the layouts fall back to two passes (odd ld, odd cols), with
// a device row limit (rows past it untouched in both outputs) and non-finite values.
TEST(Fp8Quantize, ColsWithRowsMatchBothQuantizers) {
  SKIP_WITHOUT_GPU();
  struct Case {
    ColsCase k;
    int64_t codes_ld, live;  // live: the device row limit (rows = none)
  };
  const Case cases[] = {
      {{300, 136, 0, 320, 0, 7}, 144, 300},       // vector path: partial row and column tiles
      {{300, 2880, 0, 304, 0, 0}, 2880, 257},     // gpt-oss's H, a row limit inside a tile
      {{130, 264, 272, 144, 0, -120}, 272, 130},  // strided x
      {{200, 77, 80, 208, 77, 9}, 80, 200},       // odd cols: the two passes
      {{129, 256, 258, 144, 0, 3}, 256, 100},     // odd ld: the two passes, with a limit
  };
  uint32_t seed = 400;
  for (const Case& c : cases) {
    const ColsCase& k = c.k;
    Record rec;
    Bits x = random_wide(k.rows, k.cols, k.ld_(), seed++, k.base);
    // one non-finite value inside the live rows: reported, counted as +0 by both outputs
    const int64_t bad = (c.live / 2) * k.ld_() + k.cols / 3;
    x[bad] = kNaN;
    DeviceBuffer<int64_t> limit(1);
    cudaMemcpy(limit.ptr, &c.live, sizeof c.live, cudaMemcpyHostToDevice);
    const Outputs got = run_cols(k, x, rec.d.ptr, c.codes_ld, limit.ptr);
    // want: the live rows of the input with the bad value zeroed, through each reference quantizer
    const Bits xz = zeroed(x, {bad});
    const Bits live(xz.begin(), xz.begin() + c.live * k.ld_());
    ColsCase kl = k;
    kl.rows = c.live;
    const Outputs wc = want_cols(kl, live);
    const RowsCase rk{c.live, k.cols, k.ld, c.codes_ld, 0, k.base};
    const Outputs wr = want_rows(rk, live);
    // expected buffers at the full sizes: the reference's values in the live part, poison elsewhere
    Outputs want{std::vector<uint8_t>(static_cast<size_t>(k.rows * c.codes_ld + kTail), 0xFF),
                 std::vector<uint8_t>(static_cast<size_t>(k.cols * k.codes_t_ld_() + kTail), 0xFF),
                 std::vector<float>(static_cast<size_t>(ceil128(k.cols) * k.rows + kTail), kPoisonScale),
                 std::vector<float>(static_cast<size_t>(ceil128(k.rows) * k.scales_t_ld_() + kTail), kPoisonScale)};
    for (int64_t r = 0; r < c.live; ++r) {
      for (int64_t col = 0; col < k.cols; ++col) want.codes[r * c.codes_ld + col] = wr.codes[r * c.codes_ld + col];
      for (int64_t b = 0; b < ceil128(k.cols); ++b) want.scales[b * k.rows + r] = wr.scales[b * c.live + r];
    }
    for (int64_t col = 0; col < k.cols; ++col) {
      for (int64_t r = 0; r < c.live; ++r) want.codes_t[col * k.codes_t_ld_() + r] = wc.codes_t[col * k.codes_t_ld_() + r];
      for (int64_t b = 0; b < ceil128(c.live); ++b) {
        want.scales_t[b * k.scales_t_ld_() + col] = wc.scales_t[b * k.scales_t_ld_() + col];
      }
    }
    expect_same(got, want, k.name() + " with rows (live " + std::to_string(c.live) + ")");
    const int64_t br = bad / k.ld_(), bc = bad % k.ld_();
    expect_nonfinite(rec.d.ptr, k.cols, "dy",
                     "dy at row " + std::to_string(br) + ", column " + std::to_string(bc));
  }
}

// ---- repeatability on larger shapes ----

TEST(Fp8Quantize, BitwiseRepeatable) {
  SKIP_WITHOUT_GPU();
  Record rec;
  const RowsCase rk{1000, 2880, 0, 0, 0, 5};
  const Bits x = random_wide(rk.rows, rk.cols, rk.cols, 300, 5);
  expect_same(run_rows(rk, x, rec.d.ptr), run_rows(rk, x, rec.d.ptr), "rows");
  const ColsCase ck{1000, 2880, 0, 1008, 0, 5};
  expect_same(run_cols(ck, x, rec.d.ptr), run_cols(ck, x, rec.d.ptr), "transposed");
  const BlocksCase bk{3, 1000, 960, 0, true, 5};
  const Bits w = blocks_input(bk, 301);
  expect_same(run_blocks(bk, w, rec.d.ptr), run_blocks(bk, w, rec.d.ptr), "blocks");
  EXPECT_NO_THROW(gemm::check_nonfinite(rec.d.ptr, rk.cols, "x", nullptr));
}

// ---- argument checks (host only: they throw before any device work) ----

template <class F>
void expect_invalid(F&& f, const std::string& argument) {
  try {
    f();
    ADD_FAILURE() << "no error for a bad " << argument;
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument) << e.what();
    EXPECT_EQ(std::string(e.what()).rfind(argument + ":", 0), 0u) << e.what();
  }
}

TEST(Fp8Quantize, RejectsBadArguments) {
  gemm::NonFiniteRecord host_rec{};  // never dereferenced: every call below throws or has no work
  alignas(16) static uint16_t x[16];
  alignas(16) static uint8_t codes[16];
  alignas(16) static float scales[16];
  const auto* bx = as_bf16(x);
  auto rows = [&](gemm::QuantizeRowsArgs a) { gemm::quantize_rows_1x128(a, nullptr); };
  const gemm::QuantizeRowsArgs r{bx, 4, 77, 0, codes, 80, scales, 0, &host_rec};
  expect_invalid([&] { auto a = r; a.rows = -1; rows(a); }, "a.rows");
  expect_invalid([&] { auto a = r; a.cols = -3; rows(a); }, "a.cols");
  expect_invalid([&] { auto a = r; a.ld = 76; rows(a); }, "a.ld");
  expect_invalid([&] { auto a = r; a.codes_ld = 0; rows(a); }, "a.codes_ld");  // 77: not a multiple of 16
  expect_invalid([&] { auto a = r; a.codes_ld = 88; rows(a); }, "a.codes_ld");
  expect_invalid([&] { auto a = r; a.scales_ld = 3; rows(a); }, "a.scales_ld");
  expect_invalid([&] { auto a = r; a.scales_row_stride = -1; rows(a); }, "a.scales_row_stride");
  expect_invalid([&] { auto a = r; a.nonfinite = nullptr; rows(a); }, "a.nonfinite");
  expect_invalid([&] { auto a = r; a.scales = nullptr; rows(a); }, "a.scales");
  expect_invalid([&] { auto a = r; a.x = as_bf16(reinterpret_cast<const uint16_t*>(codes + 1)); rows(a); }, "a.x");
  EXPECT_NO_THROW(rows({nullptr, 0, 77, 0, nullptr, 80, nullptr, 0, &host_rec}));  // no rows: nothing to do

  auto cols = [&](gemm::QuantizeColsArgs a) { gemm::quantize_cols_128x1_transposed(a, nullptr); };
  const gemm::QuantizeColsArgs c{bx, 77, 4, 0, codes, 80, scales, 0, &host_rec};
  expect_invalid([&] { auto a = c; a.codes_t_ld = 0; cols(a); }, "a.codes_t_ld");  // rows = 77
  expect_invalid([&] { auto a = c; a.scales_t_ld = 2; cols(a); }, "a.scales_t_ld");
  expect_invalid([&] { auto a = c; a.codes_t = nullptr; cols(a); }, "a.codes_t");
  EXPECT_NO_THROW(cols({nullptr, 77, 0, 0, nullptr, 80, nullptr, 0, &host_rec}));  // no columns

  auto blocks = [&](gemm::QuantizeBlocksArgs a) { gemm::quantize_blocks_128x128(a, nullptr); };
  const gemm::QuantizeBlocksArgs b{bx, 2, 3, 5, 0, codes, scales, nullptr, nullptr, &host_rec};
  expect_invalid([&] { auto a = b; a.batch = -1; blocks(a); }, "a.batch");
  expect_invalid([&] { auto a = b; a.batch_stride = 14; blocks(a); }, "a.batch_stride");
  expect_invalid([&] { auto a = b; a.codes_t = codes; blocks(a); }, "a.codes_t, a.scales_t");
  expect_invalid([&] { auto a = b; a.codes = nullptr; blocks(a); }, "a.codes");
  EXPECT_NO_THROW(blocks({bx, 0, 3, 5, 0, nullptr, nullptr, nullptr, nullptr, &host_rec}));  // empty stack

  expect_invalid([&] { gemm::reset_nonfinite(nullptr, nullptr); }, "nonfinite");
  expect_invalid([&] { gemm::check_nonfinite(nullptr, 4, "x", nullptr); }, "nonfinite");
}

}  // namespace
}  // namespace mok::gemm_test
