// GPU tests of the FP8 kinds of the grouped GEMM engine (src/gemm/sm90_kinds_fp8.cuh) against
// the CPU reference of the FP8 recipe (src/reference/fp8.hpp, docs/fp8.md): operands quantized
// on the CPU, every output within 2e-3 (relative norm) of ref::dot_fp8 rounded to bf16 (only
// the order of the sum inside a 128-wide block is the tensor core's), padding rows zero,
// partial 128-blocks along N and K, empty experts, bitwise determinism across grid sizes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <tuple>
#include <utility>
#include <algorithm>

#include "gemm/grouped_gemm_fp8.hpp"
#include "mok/error.hpp"
#include "reference/dense.hpp"
#include "reference/fp8.hpp"
#include "test_gemm_util.hpp"

#include <random>

namespace mok::gemm_test {
namespace {

using gemm::bf16;
constexpr double kTol = 2e-3;
const int kGrids[] = {0, 132, 66, 7};

#define SKIP_WITHOUT_GPU() \
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount reports none)"

struct Shape {
  std::vector<int> rows, extra;
  int64_t H, I;
};

// Weights [E, n, k] with a magnitude that changes from one 128x128 block to the next (so the
// block scales differ), quantized per expert.
struct QuantWeights {
  std::vector<uint8_t> codes;
  std::vector<float> scales;          // [E][ceil(n/128)][ceil(k/128)]
  std::vector<ref::Fp8Tensor> per_e;  // the reference's view
  std::vector<float> exact;           // the bf16 values (for the FP8-vs-BF16 error)
};

QuantWeights make_weights(int E, int64_t n, int64_t k, uint32_t seed) {
  QuantWeights w;
  Bits b = random_bits(static_cast<size_t>(E) * n * k, seed, 0.1f);
  for (int e = 0; e < E; ++e)
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < k; ++c) {
        const int mag = static_cast<int>((e + r / 128 + 2 * (c / 128)) % 5) - 2;  // 2^-2 .. 2^2
        uint16_t& v = b[(e * n + r) * k + c];
        v = to_bf16(from_bf16(v) * std::ldexp(1.0f, mag));
      }
  w.exact = to_float(b);
  for (int e = 0; e < E; ++e) {
    w.per_e.push_back(ref::quantize_blocks_128x128(b.data() + e * n * k, n, k, "w"));
    const auto& q = w.per_e.back();
    w.codes.insert(w.codes.end(), q.data.begin(), q.data.end());
    w.scales.insert(w.scales.end(), q.scales.begin(), q.scales.end());
  }
  return w;
}

// Rows [buffer_rows, k] (padding rows zero) quantized 1x128; scales re-laid K-block major.
struct QuantRows {
  ref::Fp8Tensor q;
  std::vector<float> scales_kmajor;  // [ceil(k/128)][buffer_rows]
  std::vector<float> exact;
};

QuantRows make_rows(const SegmentLayout& l, int64_t k, uint32_t seed) {
  QuantRows a;
  Bits b = random_rows(l, k, seed, 1.0f);
  // Rows of very different magnitudes: each row's scales differ.
  for (int64_t r = 0; r < l.buffer_rows; ++r)
    for (int64_t c = 0; c < k; ++c) {
      uint16_t& v = b[r * k + c];
      v = to_bf16(from_bf16(v) * std::ldexp(1.0f, static_cast<int>(r % 7) - 3));
    }
  a.exact = to_float(b);
  a.q = ref::quantize_rows_1x128(b.data(), l.buffer_rows, k, "h");
  const int64_t kb = a.q.scale_cols();
  a.scales_kmajor.resize(static_cast<size_t>(kb * l.buffer_rows));
  for (int64_t r = 0; r < l.buffer_rows; ++r)
    for (int64_t j = 0; j < kb; ++j) a.scales_kmajor[j * l.buffer_rows + r] = a.q.scales[r * kb + j];
  return a;
}

template <class T>
DeviceBuffer<T> device(const std::vector<T>& v) {
  DeviceBuffer<T> d(v.size());
  d.upload(v);
  return d;
}

// Runs body(e, r) for every real row r of every expert e, the rows on all hardware threads: each
// body writes only its row's reference values and its sums stay sequential, so the reference's bits
// do not depend on the threads (the "Larger" cases took ~47 s each on one thread).
template <class Body>
void for_each_real_row(const SegmentLayout& l, Body body) {
  std::vector<std::pair<int, int64_t>> rows;
  for (int e = 0; e < static_cast<int>(l.rows.size()); ++e)
    for (int64_t r = l.offsets[e]; r < l.offsets[e] + l.rows[e]; ++r) rows.emplace_back(e, r);
  ref::detail::parallel_for(static_cast<int64_t>(rows.size()), 0,
                            [&](int64_t i) { body(rows[i].first, rows[i].second); });
}

void test_gemm2_fp8(const Shape& s, uint32_t seed) {
  const SegmentLayout l = make_layout(s.rows, s.extra);
  const int E = static_cast<int>(s.rows.size());
  const int64_t R = l.buffer_rows, H = s.H, I = s.I;
  const QuantRows h = make_rows(l, I, seed);
  const QuantWeights w = make_weights(E, H, I, seed + 1);

  // Reference: ref::dot_fp8 per output, rounded to bf16; and the exact bf16-input product.
  std::vector<float> ref(R * H, 0.0f), exact(R * H, 0.0f);
  for_each_real_row(l, [&](int e, int64_t r) {
    for (int64_t n = 0; n < H; ++n) {
      ref[r * H + n] = from_bf16(to_bf16(ref::dot_fp8(h.q, r, w.per_e[e], n)));
      double d = 0;
      for (int64_t c = 0; c < I; ++c) d += double(h.exact[r * I + c]) * w.exact[(e * H + n) * I + c];
      exact[r * H + n] = static_cast<float>(d);
    }
  });

  DeviceBuffer<int32_t> d_off = device(l.offsets), d_rows = device(l.rows);
  DeviceBuffer<uint32_t> d_err(1);
  cudaMemset(d_err.ptr, 0, sizeof(uint32_t));
  auto d_hc = device(h.q.data), d_wc = device(w.codes);
  auto d_hs = device(h.scales_kmajor), d_ws = device(w.scales);
  DeviceBuffer<uint16_t> out(R * H);

  gemm::Gemm2Fp8Args a;
  a.seg = {d_off.ptr, d_rows.ptr, E, R};
  a.hidden = H;
  a.intermediate = I;
  a.h = {d_hc.ptr, d_hs.ptr};
  a.w_down = {d_wc.ptr, d_ws.ptr};
  a.out = reinterpret_cast<bf16*>(out.ptr);

  Bits first;
  for (int grid : kGrids) {
    out.poison();
    gemm::gemm2_fp8(a, {grid, d_err.ptr, 10.0, 0}, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(d_err.download()[0], 0u) << "kernel error flag";
    const Bits got = out.download();
    if (first.empty()) {
      first = got;
      const auto gf = real_rows_of(l, to_float(got), H);
      const double err = rel_err(gf, real_rows_of(l, ref, H));
      const double vs_bf16 = rel_err(gf, real_rows_of(l, exact, H));
      std::printf("gemm2_fp8 H=%lld I=%lld: rel err vs ref::dot_fp8 %.3g, vs the bf16-input product %.3g\n",
                  static_cast<long long>(H), static_cast<long long>(I), err, vs_bf16);
      EXPECT_LE(err, kTol);
      EXPECT_LE(vs_bf16, 0.1) << "FP8 quantization error far beyond e4m3's (a few percent)";
      expect_padding_zero(l, got, H, "gemm2_fp8 out");
    } else {
      expect_bitwise_equal(got, first, "gemm2_fp8 out, grid " + std::to_string(grid));
    }
  }
}

// Partial blocks along N (320 = 2.5 x 128) and K (192 = 1.5 x 128), an empty expert, a
// segment of whole padding tiles.
TEST(GemmFp8, Gemm2PartialBlocks) { SKIP_WITHOUT_GPU(); test_gemm2_fp8({{70, 0, 129, 300}, {0, 0, 1, 0}, 320, 192}, 11); }
TEST(GemmFp8, Gemm2Larger) { SKIP_WITHOUT_GPU(); test_gemm2_fp8({{200, 513, 0, 384, 77, 640}, {}, 1024, 768}, 12); }
TEST(GemmFp8, SanitizerSmallGemm2) { SKIP_WITHOUT_GPU(); test_gemm2_fp8({{70, 0, 129}, {0, 0, 1}, 128, 192}, 13); }

// ---- dgrad of GEMM 1 ---------------------------------------------------------------------

// W [E, n, k] -> W^T [E, k, n] per expert, quantized 128x128 (the transposed copy's codes).
QuantWeights transposed(const QuantWeights& w, int E, int64_t n, int64_t k) {
  QuantWeights t;
  t.exact.resize(w.exact.size());
  for (int e = 0; e < E; ++e) {
    Bits bt(static_cast<size_t>(k * n));
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < k; ++c) {
        const float v = w.exact[(e * n + r) * k + c];
        bt[c * n + r] = to_bf16(v);
        t.exact[(e * k + c) * n + r] = v;
      }
    t.per_e.push_back(ref::quantize_blocks_128x128(bt.data(), k, n, "w^T"));
    const auto& q = t.per_e.back();
    t.codes.insert(t.codes.end(), q.data.begin(), q.data.end());
    t.scales.insert(t.scales.end(), q.scales.begin(), q.scales.end());
  }
  return t;
}

// The two-level FP8 dot (docs/fp8.md) over consecutive K ranges in one accumulator: row m of
// each range's a with row n of its w, the first range's blocks first (ref::dot_fp8_from).
float dot_fp8_ranges(const std::vector<std::pair<const ref::Fp8Tensor*, const ref::Fp8Tensor*>>& ranges, int64_t m,
                     int64_t n) {
  float acc = 0.0f;
  for (const auto& [a, w] : ranges) {
    const int64_t kb = a->scale_cols();
    acc = ref::dot_fp8_from(acc, a->data.data() + m * a->cols, a->scales.data() + m * kb,
                            w->data.data() + n * w->cols, w->scales.data() + (n / w->block_rows) * kb, a->cols);
  }
  return acc;
}

void test_dgrad_input_fp8(const Shape& s, uint32_t seed) {
  const SegmentLayout l = make_layout(s.rows, s.extra);
  const int E = static_cast<int>(s.rows.size());
  const int64_t R = l.buffer_rows, H = s.H, I = s.I;
  const QuantRows dg = make_rows(l, I, seed), du = make_rows(l, I, seed + 1);
  const QuantWeights wg = make_weights(E, I, H, seed + 2), wu = make_weights(E, I, H, seed + 3);
  const QuantWeights wgt = transposed(wg, E, I, H), wut = transposed(wu, E, I, H);  // [E, H, I]

  std::vector<float> ref(R * H, 0.0f), exact(R * H, 0.0f);
  for_each_real_row(l, [&](int e, int64_t r) {
    for (int64_t n = 0; n < H; ++n) {
      ref[r * H + n] = round_bf16(dot_fp8_ranges({{&dg.q, &wgt.per_e[e]}, {&du.q, &wut.per_e[e]}}, r, n));
      double d = 0;
      for (int64_t c = 0; c < I; ++c) {
        d += double(dg.exact[r * I + c]) * wg.exact[(e * I + c) * H + n] +
             double(du.exact[r * I + c]) * wu.exact[(e * I + c) * H + n];
      }
      exact[r * H + n] = static_cast<float>(d);
    }
  });

  DeviceBuffer<int32_t> d_off = device(l.offsets), d_rows = device(l.rows);
  DeviceBuffer<uint32_t> d_err(1);
  cudaMemset(d_err.ptr, 0, sizeof(uint32_t));
  auto d_gc = device(dg.q.data), d_uc = device(du.q.data), d_wgc = device(wgt.codes), d_wuc = device(wut.codes);
  auto d_gs = device(dg.scales_kmajor), d_us = device(du.scales_kmajor), d_wgs = device(wgt.scales),
       d_wus = device(wut.scales);
  DeviceBuffer<uint16_t> dx(R * H);
  gemm::DgradInputFp8Args a;
  a.seg = {d_off.ptr, d_rows.ptr, E, R};
  a.hidden = H;
  a.intermediate = I;
  a.dg = {d_gc.ptr, d_gs.ptr};
  a.du = {d_uc.ptr, d_us.ptr};
  a.w_gate_t = {d_wgc.ptr, d_wgs.ptr};
  a.w_up_t = {d_wuc.ptr, d_wus.ptr};
  a.dx = reinterpret_cast<bf16*>(dx.ptr);
  Bits first;
  for (int grid : kGrids) {
    dx.poison();
    gemm::dgrad_input_fp8(a, {grid, d_err.ptr, 10.0, 0}, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(d_err.download()[0], 0u) << "kernel error flag";
    const Bits got = dx.download();
    if (first.empty()) {
      first = got;
      const auto gf = real_rows_of(l, to_float(got), H);
      const double err = rel_err(gf, real_rows_of(l, ref, H));
      const double vs_bf16 = rel_err(gf, real_rows_of(l, exact, H));
      std::printf("dgrad_input_fp8 H=%lld I=%lld: rel err vs reference %.3g, vs the bf16-input product %.3g\n",
                  static_cast<long long>(H), static_cast<long long>(I), err, vs_bf16);
      EXPECT_LE(err, kTol);
      EXPECT_LE(vs_bf16, 0.1);
      expect_padding_zero(l, got, H, "dgrad_input_fp8 dx");
    } else {
      expect_bitwise_equal(got, first, "dgrad_input_fp8 dx, grid " + std::to_string(grid));
    }
  }
}

TEST(GemmFp8, DgradInputPartialBlocks) {
  SKIP_WITHOUT_GPU();
  test_dgrad_input_fp8({{70, 0, 129, 300}, {0, 0, 1, 0}, 320, 192}, 31);
}
TEST(GemmFp8, DgradInputLarger) { SKIP_WITHOUT_GPU(); test_dgrad_input_fp8({{200, 513, 0, 384}, {}, 768, 512}, 32); }

// h = bf16(silu(g) * u) of rounded g, u (numerics.md).
float silu_mul_ref(float g, float u) { return round_bf16(g * sigmoid_ref(g) * u); }

// ---- dgrad of GEMM 2 + SwiGLU backward, dg and du quantized ------------------------------

// Bits of a bf16 [rows, cols] buffer quantized 1x128 against the kernel's codes and K-block-major
// scales, on the segments' rows.
void expect_quantized_rows(const SegmentLayout& l, const Bits& v, int64_t cols, const std::vector<uint8_t>& codes,
                           const std::vector<float>& scales, const std::string& what) {
  const int64_t rows = l.offsets.back(), kb = (cols + 127) / 128;
  const ref::Fp8Tensor q = ref::quantize_rows_1x128(v.data(), rows, cols, what.c_str());
  expect_bitwise_equal(std::vector<uint8_t>(codes.begin(), codes.begin() + rows * cols), q.data, what + " codes");
  std::vector<float> got(kb * rows);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < kb; ++j) got[r * kb + j] = scales[j * l.buffer_rows + r];
  expect_bitwise_equal(got, q.scales, what + " scales");
}

void test_dgrad_hidden_fp8(const Shape& s, uint32_t seed, bool routed) {
  const SegmentLayout l = make_layout(s.rows, s.extra);
  const int E = static_cast<int>(s.rows.size());
  const int64_t R = l.buffer_rows, H = s.H, I = s.I, ib = (I + 127) / 128, ct = (I + 255) / 256;
  const QuantRows dys = make_rows(l, H, seed);
  const QuantWeights wd = make_weights(E, H, I, seed + 1);  // W_down [E, H, I]
  const QuantWeights wdt = transposed(wd, E, H, I);         // [E, I, H]
  const Bits g = random_rows(l, I, seed + 2, 2.0f), u = random_rows(l, I, seed + 3, 2.0f);
  std::vector<float> row_w(R, 0.0f);
  {
    std::mt19937 gen(seed + 4);
    std::uniform_real_distribution<float> d(0.05f, 1.0f);
    for (int64_t r = 0; r < R; ++r) row_w[r] = l.is_real(r) ? d(gen) : 0.0f;
  }
  const auto fg = to_float(g), fu = to_float(u);
  std::vector<float> ref_dg(R * I, 0.0f), ref_du(R * I, 0.0f), ref_dw(R, 0.0f);
  for_each_real_row(l, [&](int e, int64_t r) {
    for (int64_t i = 0; i < I; ++i) {
      const float dhr = ref::dot_fp8(dys.q, r, wdt.per_e[e], i);
      const float dh = routed ? row_w[r] * dhr : dhr;
      const float gg = fg[r * I + i], uu = fu[r * I + i], sg = sigmoid_ref(gg);
      ref_dg[r * I + i] = round_bf16(dh * uu * sg * (1.0f + gg * (1.0f - sg)));
      ref_du[r * I + i] = round_bf16(dh * gg * sg);
      ref_dw[r] += dhr * silu_mul_ref(gg, uu);
    }
  });

  DeviceBuffer<int32_t> d_off = device(l.offsets), d_rows = device(l.rows);
  DeviceBuffer<uint32_t> d_err(1);
  cudaMemset(d_err.ptr, 0, sizeof(uint32_t));
  auto d_yc = device(dys.q.data), d_wc = device(wdt.codes);
  auto d_ys = device(dys.scales_kmajor), d_ws = device(wdt.scales), d_rw = device(row_w);
  DeviceBuffer<uint16_t> d_g(R * I), d_u(R * I), dg(R * I), du(R * I);
  d_g.upload(g);
  d_u.upload(u);
  DeviceBuffer<uint8_t> dgc(R * I), duc(R * I);
  DeviceBuffer<float> dgs(ib * R), dus(ib * R), dwp(R * ct);
  DeviceBuffer<gemm::NonFiniteRecord> rec(1);
  gemm::DgradHiddenFp8Args a;
  a.seg = {d_off.ptr, d_rows.ptr, E, R};
  a.hidden = H;
  a.intermediate = I;
  a.dys = {d_yc.ptr, d_ys.ptr};
  a.w_down_t = {d_wc.ptr, d_ws.ptr};
  a.g = reinterpret_cast<const bf16*>(d_g.ptr);
  a.u = reinterpret_cast<const bf16*>(d_u.ptr);
  a.dg = reinterpret_cast<bf16*>(dg.ptr);
  a.du = reinterpret_cast<bf16*>(du.ptr);
  a.row_w = routed ? d_rw.ptr : nullptr;
  a.dw_part = routed ? dwp.ptr : nullptr;
  a.dg_codes = dgc.ptr;
  a.du_codes = duc.ptr;
  a.dg_scales = dgs.ptr;
  a.du_scales = dus.ptr;
  a.nonfinite = rec.ptr;
  Bits first_dg, first_du;
  std::vector<uint8_t> first_c;
  for (int grid : kGrids) {
    for (auto* b : {&dg, &du}) b->poison();
    dgc.poison();
    duc.poison();
    dgs.poison();
    dus.poison();
    dwp.poison();
    gemm::reset_nonfinite(rec.ptr, nullptr);
    gemm::dgrad_hidden_swiglu_fp8(a, {grid, d_err.ptr, 10.0, 0}, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(d_err.download()[0], 0u) << "kernel error flag";
    gemm::check_nonfinite(rec.ptr, I, "dg", nullptr);
    const Bits gdg = dg.download(), gdu = du.download();
    const auto gc = dgc.download();
    if (first_dg.empty()) {
      for (auto [out, ref, name] : {std::tuple{&gdg, &ref_dg, "dg"}, std::tuple{&gdu, &ref_du, "du"}}) {
        const double err = rel_err(real_rows_of(l, to_float(*out), I), real_rows_of(l, *ref, I));
        std::printf("dgrad_hidden_swiglu_fp8%s H=%lld I=%lld: %s rel err vs reference %.3g\n", routed ? " (routed)" : "",
                    static_cast<long long>(H), static_cast<long long>(I), name, err);
        EXPECT_LE(err, kTol) << name;
        expect_padding_zero(l, *out, I, name);
      }
      expect_quantized_rows(l, gdg, I, gc, dgs.download(), "dg");
      expect_quantized_rows(l, gdu, I, duc.download(), dus.download(), "du");
      if (routed) {
        const auto parts = dwp.download();
        std::vector<float> got_dw, want_dw;
        for (int64_t r = 0; r < R; ++r) {
          if (!l.is_real(r)) continue;
          float sum = 0.0f;
          for (int64_t c = 0; c < ct; ++c) sum += parts[r * ct + c];
          got_dw.push_back(sum);
          want_dw.push_back(ref_dw[r]);
        }
        const double err = rel_err(got_dw, want_dw);
        std::printf("dgrad_hidden_swiglu_fp8 (routed): d topk_w rel err vs reference %.3g\n", err);
        EXPECT_LE(err, kTol);
      }
      first_dg = gdg;
      first_du = gdu;
      first_c = gc;
    } else {
      expect_bitwise_equal(gdg, first_dg, "dg, grid " + std::to_string(grid));
      expect_bitwise_equal(gdu, first_du, "du, grid " + std::to_string(grid));
      expect_bitwise_equal(gc, first_c, "dg codes, grid " + std::to_string(grid));
    }
  }
}

// I = 320: the last 256-column tile has one partial 128-block and one block past I.
TEST(GemmFp8, DgradHiddenPartialBlocks) {
  SKIP_WITHOUT_GPU();
  test_dgrad_hidden_fp8({{70, 0, 129, 300}, {0, 0, 1, 0}, 192, 320}, 41, false);
}
TEST(GemmFp8, DgradHiddenRoutedPartialBlocks) {
  SKIP_WITHOUT_GPU();
  test_dgrad_hidden_fp8({{70, 0, 129, 300}, {0, 0, 1, 0}, 192, 320}, 42, true);
}
TEST(GemmFp8, DgradHiddenRoutedLarger) {
  SKIP_WITHOUT_GPU();
  test_dgrad_hidden_fp8({{200, 513, 0, 384}, {}, 512, 768}, 43, true);
}

// ---- GEMM 1 + SwiGLU with h quantized ---------------------------------------------------


struct Gemm1Fp8Out {
  Bits g, u, h;
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};

void test_gemm1_fp8(const Shape& s, uint32_t seed, bool poison_x_to_inf = false) {
  const SegmentLayout l = make_layout(s.rows, s.extra);
  const int E = static_cast<int>(s.rows.size());
  const int64_t R = l.buffer_rows, H = s.H, I = s.I, kb = (I + 127) / 128;
  const QuantRows x = make_rows(l, H, seed);
  const QuantWeights wg = make_weights(E, I, H, seed + 1), wu = make_weights(E, I, H, seed + 2);

  DeviceBuffer<int32_t> d_off = device(l.offsets), d_rows = device(l.rows);
  DeviceBuffer<uint32_t> d_err(1);
  cudaMemset(d_err.ptr, 0, sizeof(uint32_t));
  auto d_xc = device(x.q.data), d_gc = device(wg.codes), d_uc = device(wu.codes);
  auto d_xs = device(x.scales_kmajor), d_gs = device(wg.scales), d_us = device(wu.scales);
  if (poison_x_to_inf) {
    // The largest scales there are: every product overflows fp32, g and u are infinite.
    std::vector<float> big(x.scales_kmajor.size(), std::ldexp(1.0f, 120));
    d_xs.upload(big);
    std::vector<float> bigw(wg.scales.size(), std::ldexp(1.0f, 120));
    d_gs.upload(bigw);
    d_us.upload(bigw);
  }
  DeviceBuffer<uint16_t> g(R * I), u(R * I), h(R * I);
  DeviceBuffer<uint8_t> codes(R * I);
  DeviceBuffer<float> scales(kb * R);
  DeviceBuffer<gemm::NonFiniteRecord> rec(1);

  gemm::Gemm1SwigluFp8Args a;
  a.seg = {d_off.ptr, d_rows.ptr, E, R};
  a.hidden = H;
  a.intermediate = I;
  a.x = {d_xc.ptr, d_xs.ptr};
  a.w_gate = {d_gc.ptr, d_gs.ptr};
  a.w_up = {d_uc.ptr, d_us.ptr};
  a.g = reinterpret_cast<bf16*>(g.ptr);
  a.u = reinterpret_cast<bf16*>(u.ptr);
  a.h = reinterpret_cast<bf16*>(h.ptr);
  a.h_codes = codes.ptr;
  a.h_scales = scales.ptr;
  a.nonfinite = rec.ptr;

  auto run = [&](int grid, bool with_h) {
    for (auto* b : {&g, &u, &h}) b->poison();
    codes.poison();
    scales.poison();
    gemm::reset_nonfinite(rec.ptr, nullptr);
    a.h = with_h ? reinterpret_cast<bf16*>(h.ptr) : nullptr;
    gemm::gemm1_swiglu_fp8(a, {grid, d_err.ptr, 10.0, 0}, nullptr);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(d_err.download()[0], 0u) << "kernel error flag";
    return Gemm1Fp8Out{g.download(), u.download(), h.download(), codes.download(), scales.download()};
  };

  if (poison_x_to_inf) {
    // g, u quantized in the epilogue too: an infinite g is recorded in their record.
    DeviceBuffer<uint8_t> gc(R * I), uc(R * I);
    DeviceBuffer<float> gs(kb * R), us(kb * R);
    DeviceBuffer<gemm::NonFiniteRecord> gu_rec(1);
    gemm::reset_nonfinite(gu_rec.ptr, nullptr);
    a.g_codes = gc.ptr;
    a.g_scales = gs.ptr;
    a.u_codes = uc.ptr;
    a.u_scales = us.ptr;
    a.gu_nonfinite = gu_rec.ptr;
    run(0, true);
    for (auto [record, name] : {std::pair{rec.ptr, "h"}, std::pair{gu_rec.ptr, "g or u"}}) {
      try {
        gemm::check_nonfinite(record, I, name, nullptr);
        ADD_FAILURE() << "no error for an infinite " << name;
      } catch (const mok::Error& e) {
        EXPECT_NE(std::string(e.what()).find(std::string(name) + " at row"), std::string::npos) << e.what();
      }
    }
    return;
  }

  // Reference g, u, h (padding rows zero).
  std::vector<float> rg(R * I, 0.0f), ru(R * I, 0.0f), rh(R * I, 0.0f);
  for_each_real_row(l, [&](int e, int64_t r) {
    for (int64_t i = 0; i < I; ++i) {
      const float gv = round_bf16(ref::dot_fp8(x.q, r, wg.per_e[e], i));
      const float uv = round_bf16(ref::dot_fp8(x.q, r, wu.per_e[e], i));
      rg[r * I + i] = gv;
      ru[r * I + i] = uv;
      rh[r * I + i] = silu_mul_ref(gv, uv);
    }
  });

  // codes [R, I] and K-block major scales [kb][R]: bit for bit ref::quantize_rows_1x128 of the bf16
  // `bits` on every row of the segments.
  auto expect_quantized_rows = [&](const Bits& bits, const std::vector<uint8_t>& codes_all,
                                   const std::vector<float>& scales_all, const std::string& name) {
    const int64_t rows = l.offsets.back();
    const ref::Fp8Tensor q = ref::quantize_rows_1x128(bits.data(), rows, I, name.c_str());
    std::vector<uint8_t> codes_seg(codes_all.begin(), codes_all.begin() + rows * I);
    expect_bitwise_equal(codes_seg, q.data, name + " codes");
    std::vector<float> sc(kb * rows), sg(kb * rows);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < kb; ++j) {
        sc[r * kb + j] = scales_all[j * R + r];
        sg[r * kb + j] = q.scales[r * kb + j];
      }
    expect_bitwise_equal(sc, sg, name + " scales");
  };

  Gemm1Fp8Out first;
  for (int grid : kGrids) {
    Gemm1Fp8Out got = run(grid, true);
    gemm::check_nonfinite(rec.ptr, I, "h", nullptr);  // throws (fails the test) on a recorded one
    if (grid == kGrids[0]) {
      for (auto [out, ref, name] : {std::tuple{&got.g, &rg, "g"}, std::tuple{&got.u, &ru, "u"},
                                    std::tuple{&got.h, &rh, "h"}}) {
        const double err = rel_err(real_rows_of(l, to_float(*out), I), real_rows_of(l, *ref, I));
        std::printf("gemm1_swiglu_fp8 H=%lld I=%lld: %s rel err vs reference %.3g\n", static_cast<long long>(H),
                    static_cast<long long>(I), name, err);
        EXPECT_LE(err, kTol) << name;
        expect_padding_zero(l, *out, I, name);
      }
      // h's codes and scales: the quantization of the kernel's own bf16 h, bit for bit, on every
      // row of the segments (padding rows: codes 0, scale 1).
      expect_quantized_rows(got.h, got.codes, got.scales, "h");
      first = got;
    } else {
      expect_bitwise_equal(got.g, first.g, "g, grid " + std::to_string(grid));
      expect_bitwise_equal(got.u, first.u, "u, grid " + std::to_string(grid));
      expect_bitwise_equal(got.h, first.h, "h, grid " + std::to_string(grid));
      expect_bitwise_equal(got.codes, first.codes, "h codes, grid " + std::to_string(grid));
      expect_bitwise_equal(got.scales, first.scales, "h scales, grid " + std::to_string(grid));
    }
  }
  // Without the bf16 h: the same g, u, codes and scales.
  Gemm1Fp8Out no_h = run(0, false);
  expect_bitwise_equal(no_h.g, first.g, "g without h");
  expect_bitwise_equal(no_h.codes, first.codes, "h codes without h");
  expect_bitwise_equal(no_h.scales, first.scales, "h scales without h");

  // g and u quantized in the epilogue too (the FP8 context's copies): bit for bit the quantization of
  // the kernel's bf16 g, u, with and without those bf16 outputs, and the rest unchanged.
  DeviceBuffer<uint8_t> gc(R * I), uc(R * I);
  DeviceBuffer<float> gs(kb * R), us(kb * R);
  DeviceBuffer<gemm::NonFiniteRecord> gu_rec(1);
  a.g_codes = gc.ptr;
  a.g_scales = gs.ptr;
  a.u_codes = uc.ptr;
  a.u_scales = us.ptr;
  a.gu_nonfinite = gu_rec.ptr;
  for (bool with_bf16 : {true, false}) {
    const std::string how = with_bf16 ? " (with bf16 g, u)" : " (without bf16 g, u)";
    for (auto* b : {&gc, &uc}) b->poison();
    for (auto* b : {&gs, &us}) b->poison();
    gemm::reset_nonfinite(gu_rec.ptr, nullptr);
    a.g = with_bf16 ? reinterpret_cast<bf16*>(g.ptr) : nullptr;
    a.u = with_bf16 ? reinterpret_cast<bf16*>(u.ptr) : nullptr;
    Gemm1Fp8Out got = run(kGrids[1], false);
    gemm::check_nonfinite(gu_rec.ptr, I, "g or u", nullptr);
    expect_quantized_rows(first.g, gc.download(), gs.download(), "g" + how);
    expect_quantized_rows(first.u, uc.download(), us.download(), "u" + how);
    expect_bitwise_equal(got.codes, first.codes, "h codes" + how);
    expect_bitwise_equal(got.scales, first.scales, "h scales" + how);
    if (with_bf16) {
      expect_bitwise_equal(got.g, first.g, "g" + how);
      expect_bitwise_equal(got.u, first.u, "u" + how);
    } else {
      EXPECT_EQ(got.g, Bits(got.g.size(), 0xFFFFu)) << "g written without a bf16 g";
      EXPECT_EQ(got.u, Bits(got.u.size(), 0xFFFFu)) << "u written without a bf16 u";
    }
  }
  a.g = reinterpret_cast<bf16*>(g.ptr);
  a.u = reinterpret_cast<bf16*>(u.ptr);
  a.u_codes = nullptr;  // three of the four: refused, naming the missing one
  EXPECT_THROW(gemm::gemm1_swiglu_fp8(a, {0, d_err.ptr, 10.0, 0}, nullptr), mok::Error);
}

// Partial blocks along I (320) and H (192), an empty expert, a whole padding tile.
TEST(GemmFp8, Gemm1SwigluPartialBlocks) {
  SKIP_WITHOUT_GPU();
  test_gemm1_fp8({{70, 0, 129, 300}, {0, 0, 1, 0}, 192, 320}, 21);
}
TEST(GemmFp8, Gemm1SwigluLarger) { SKIP_WITHOUT_GPU(); test_gemm1_fp8({{200, 513, 0, 384}, {}, 512, 768}, 22); }
TEST(GemmFp8, Gemm1SwigluNonFiniteHIsReported) {
  SKIP_WITHOUT_GPU();
  test_gemm1_fp8({{70, 129}, {}, 128, 128}, 23, true);
}
TEST(GemmFp8, SanitizerSmallGemm1) { SKIP_WITHOUT_GPU(); test_gemm1_fp8({{70, 0, 129}, {0, 0, 1}, 128, 192}, 24); }

// ---- wgrad ------------------------------------------------------------------------------

// A row operand [buffer_rows, cols] (padding rows zero) transposed and quantized along the rows:
// codes [cols][buffer_rows], scales re-laid [buffer_rows / 128][cols] (the GPU layout).
struct QuantCols {
  ref::Fp8Tensor q;  // of the transpose [cols, buffer_rows], 1x128 blocks along the rows
  std::vector<float> scales_blockmajor;
  std::vector<float> exact;  // [buffer_rows, cols]
};

QuantCols make_cols(const SegmentLayout& l, int64_t cols, uint32_t seed) {
  QuantCols c;
  const Bits b = random_rows(l, cols, seed, 1.0f);
  c.exact = to_float(b);
  const int64_t R = l.buffer_rows;
  Bits t(static_cast<size_t>(cols * R));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < cols; ++j) t[j * R + r] = b[r * cols + j];
  c.q = ref::quantize_rows_1x128(t.data(), cols, R, "a^T");
  const int64_t kb = R / 128;
  c.scales_blockmajor.resize(static_cast<size_t>(kb * cols));
  for (int64_t j = 0; j < cols; ++j)
    for (int64_t k = 0; k < kb; ++k) c.scales_blockmajor[k * cols + j] = c.q.scales[j * kb + k];
  return c;
}

void test_wgrad_fp8(const Shape& s, uint32_t seed) {
  const SegmentLayout l = make_layout(s.rows, s.extra);
  const int E = static_cast<int>(s.rows.size());
  const int64_t R = l.buffer_rows, kb = R / 128;
  // dW_down = dy^T hs (M = H, N = I), dW_gate = dg^T x (M = I, N = H).
  const int64_t ms[2] = {s.H, s.I}, ns[2] = {s.I, s.H};
  std::vector<QuantCols> a, b;
  for (int q = 0; q < 2; ++q) {
    a.push_back(make_cols(l, ms[q], seed + 10 * q));
    b.push_back(make_cols(l, ns[q], seed + 10 * q + 1));
  }
  // Reference: per expert, the two-level dot over the segment's rows in 128-row blocks.
  std::vector<std::vector<float>> ref(2), exact(2);
  for (int q = 0; q < 2; ++q) {
    const int64_t M = ms[q], N = ns[q];
    ref[q].assign(E * M * N, 0.0f);
    exact[q].assign(E * M * N, 0.0f);
    // (expert, m) pairs on all hardware threads: each writes its own output row, sums sequential.
    ref::detail::parallel_for(E * M, 0, [&](int64_t em) {
      const int e = static_cast<int>(em / M);
      const int64_t m = em % M, off = l.offsets[e], len = l.seg_len(e);
      if (len == 0) return;
      for (int64_t n = 0; n < N; ++n) {
        ref[q][(e * M + m) * N + n] =
            ref::dot_fp8(a[q].q.data.data() + m * R + off, a[q].q.scales.data() + m * kb + off / 128,
                         b[q].q.data.data() + n * R + off, b[q].q.scales.data() + n * kb + off / 128, len);
        double d = 0;
        for (int64_t r = off; r < off + len; ++r) d += double(a[q].exact[r * M + m]) * b[q].exact[r * N + n];
        exact[q][(e * M + m) * N + n] = static_cast<float>(d);
      }
    });
  }
  DeviceBuffer<int32_t> d_off = device(l.offsets), d_rows = device(l.rows);
  DeviceBuffer<uint32_t> d_err(1);
  cudaMemset(d_err.ptr, 0, sizeof(uint32_t));
  std::vector<DeviceBuffer<uint8_t>> ac, bc;
  std::vector<DeviceBuffer<float>> as, bs, out;
  for (int q = 0; q < 2; ++q) {
    ac.push_back(device(a[q].q.data));
    bc.push_back(device(b[q].q.data));
    as.push_back(device(a[q].scales_blockmajor));
    bs.push_back(device(b[q].scales_blockmajor));
    out.emplace_back(static_cast<size_t>(E * ms[q] * ns[q]));
  }
  gemm::WgradFp8Args args;
  args.seg = {d_off.ptr, d_rows.ptr, E, R};
  args.num_problems = 2;
  for (int q = 0; q < 2; ++q) {
    args.problems[q].a = {ac[q].ptr, as[q].ptr};
    args.problems[q].b = {bc[q].ptr, bs[q].ptr};
    args.problems[q].m = ms[q];
    args.problems[q].n = ns[q];
    args.problems[q].out = out[q].ptr;
  }
  std::vector<float> first[2];
  for (int grid : kGrids) {
    for (auto& o : out) o.poison();
    args.mode = gemm::WgradOut::kPartialFp32;
    gemm::wgrad_fp8(args, {grid, d_err.ptr, 10.0, 0}, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(d_err.download()[0], 0u) << "kernel error flag";
    for (int q = 0; q < 2; ++q) {
      const auto got = out[q].download();
      if (grid == kGrids[0]) {
        const double err = rel_err(got, ref[q]), vs = rel_err(got, exact[q]);
        std::printf("wgrad_fp8 problem %d (M=%lld N=%lld): rel err vs reference %.3g, vs the bf16-input sums %.3g\n", q,
                    static_cast<long long>(ms[q]), static_cast<long long>(ns[q]), err, vs);
        EXPECT_LE(err, kTol);
        EXPECT_LE(vs, 0.1);
        first[q] = got;
      } else {
        expect_bitwise_equal(got, first[q], "wgrad_fp8 problem " + std::to_string(q) + ", grid " + std::to_string(grid));
      }
    }
  }
  // Main grads: out += sums (one fp32 add per element), from a random start.
  std::vector<float> init[2];
  for (int q = 0; q < 2; ++q) {
    init[q].resize(out[q].count);
    for (size_t i = 0; i < init[q].size(); ++i) init[q][i] = static_cast<float>((i * 2654435761u) % 1000) / 500.0f - 1.0f;
    out[q].upload(init[q]);
  }
  args.mode = gemm::WgradOut::kAccumulateFp32;
  gemm::wgrad_fp8(args, {0, d_err.ptr, 10.0, 0}, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int q = 0; q < 2; ++q) {
    std::vector<float> want(first[q].size());
    for (size_t i = 0; i < want.size(); ++i) want[i] = init[q][i] + first[q][i];
    expect_bitwise_equal(out[q].download(), want, "wgrad_fp8 accumulate problem " + std::to_string(q));
  }
  // bf16 output (TMA stores) with an expert stride of m*n + 64 elements: bf16(sums) in each expert's
  // block, the 64 elements between the blocks untouched.
  std::vector<DeviceBuffer<uint16_t>> out16;
  for (int q = 0; q < 2; ++q) {
    out16.emplace_back(static_cast<size_t>(E * (ms[q] * ns[q] + 64)));
    out16[q].poison();
    args.problems[q].out = out16[q].ptr;
    args.problems[q].out_stride = ms[q] * ns[q] + 64;
  }
  args.mode = gemm::WgradOut::kWriteBf16;
  gemm::wgrad_fp8(args, {0, d_err.ptr, 10.0, 0}, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int q = 0; q < 2; ++q) {
    const int64_t mn = ms[q] * ns[q], stride = mn + 64;
    std::vector<uint16_t> want(static_cast<size_t>(E * stride), 0xFFFF);
    for (int e = 0; e < E; ++e)
      for (int64_t i = 0; i < mn; ++i) want[e * stride + i] = to_bf16(first[q][e * mn + i]);
    const std::vector<uint16_t> got = out16[q].download();
    size_t bad = 0, first_bad = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      if (got[i] != want[i] && bad++ == 0) first_bad = i;
    }
    EXPECT_EQ(bad, 0u) << "wgrad_fp8 bf16 problem " << q << ": first difference at element " << first_bad << " (got 0x"
                       << std::hex << got[first_bad] << ", want 0x" << want[first_bad] << ")";
  }
}

TEST(GemmFp8, WgradPartialBlocks) { SKIP_WITHOUT_GPU(); test_wgrad_fp8({{70, 0, 129, 300}, {0, 0, 1, 0}, 192, 320}, 51); }
TEST(GemmFp8, WgradLarger) { SKIP_WITHOUT_GPU(); test_wgrad_fp8({{200, 513, 0, 384}, {}, 512, 256}, 52); }

TEST(GemmFp8, RejectsBadArguments) {
  gemm::Gemm2Fp8Args a;
  int32_t dummy[4] = {};
  alignas(16) static uint8_t buf[256];
  a.seg = {dummy, dummy, 1, 128};
  a.hidden = 128;
  a.intermediate = 128;
  a.h = {buf, reinterpret_cast<const float*>(buf)};
  a.w_down = {buf, reinterpret_cast<const float*>(buf)};
  a.out = reinterpret_cast<bf16*>(buf);
  auto expect_named = [&](const gemm::Launch& launch, const char* name) {
    try {
      gemm::gemm2_fp8(a, launch, nullptr);
      ADD_FAILURE() << "no error for a bad " << name;
    } catch (const mok::Error& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  };
  a.hidden = 100;
  expect_named({}, "hidden");
  a.hidden = 128;
  a.h.scales = nullptr;
  expect_named({}, "h.scales");
  a.h.scales = reinterpret_cast<const float*>(buf);
  expect_named({0, nullptr, 10.0, 2}, "launch.cluster");
  gemm::WgradFp8Args w;
  w.seg = a.seg;
  try {
    gemm::wgrad_fp8(w, {}, nullptr);  // no problem
    ADD_FAILURE() << "no error for num_problems = 0";
  } catch (const mok::Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_problems"), std::string::npos) << e.what();
  }
  w.num_problems = 1;
  w.problems[0] = {{buf, reinterpret_cast<const float*>(buf)}, {buf, reinterpret_cast<const float*>(buf)}, 100, 128,
                   buf};
  try {
    gemm::wgrad_fp8(w, {}, nullptr);  // m not a multiple of 64
    ADD_FAILURE() << "no error for m = 100";
  } catch (const mok::Error& e) {
    EXPECT_NE(std::string(e.what()).find("problems[0].m"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace mok::gemm_test
