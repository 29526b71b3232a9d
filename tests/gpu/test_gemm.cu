// GPU tests of the Hopper grouped GEMM engine (src/gemm): every kind against the CPU
// reference (docs/numerics.md), padding rows zero, bitwise determinism across repeats and
// grid sizes, and wgrad split over several calls == one call.
#include <gtest/gtest.h>

#include <climits>
#include <functional>
#include <string>

#include "gemm/grouped_gemm.hpp"
#include "mok/error.hpp"
#include "test_gemm_util.hpp"

namespace mok::gemm_test {
namespace {

using gemm::bf16;
constexpr double kTol = 1e-2;
// Launch variants that must give identical bits: grid sizes (0 = one CTA per SM; odd grids
// round down to whole clusters) and cluster sizes (0 = default 1; 2 = B multicast in pairs).
struct Variant {
  int grid, cluster;
};
const Variant kVariants[] = {{0, 0}, {132, 0}, {66, 0}, {7, 0}, {0, 2}, {7, 2}};

#define SKIP_WITHOUT_GPU() \
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount reports none)"

struct Shape {
  std::vector<int> rows, extra;
  int64_t H, I;
};

// Device copies of one problem's inputs; every output poisoned before each run.
struct Problem {
  SegmentLayout l;
  int64_t H, I;
  int E;
  DeviceBuffer<int32_t> d_off, d_rows;
  DeviceBuffer<uint32_t> d_err{1};

  Problem(const Shape& s) : l(make_layout(s.rows, s.extra)), H(s.H), I(s.I), E(static_cast<int>(s.rows.size())),
                            d_off(E + 1), d_rows(E) {
    d_off.upload(l.offsets);
    d_rows.upload(l.rows);
    cudaMemset(d_err.ptr, 0, sizeof(uint32_t));
  }
  gemm::Segments seg() const { return {d_off.ptr, d_rows.ptr, E, l.buffer_rows}; }
  gemm::Launch launch(Variant v) const { return {v.grid, d_err.ptr, 10.0, v.cluster}; }
  void expect_no_error() {
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(d_err.download()[0], 0u) << "kernel error flag";
  }
};

DeviceBuffer<uint16_t> device_bits(const Bits& b) {
  DeviceBuffer<uint16_t> d(b.size());
  d.upload(b);
  return d;
}
bf16* bf(DeviceBuffer<uint16_t>& d) { return reinterpret_cast<bf16*>(d.ptr); }

// Runs `run(variant)` for every launch variant, twice; outputs are poisoned before each run
// and must come back bitwise identical. Returns the outputs of the first run.
std::vector<Bits> run_all_grids(Problem& pb, std::vector<DeviceBuffer<uint16_t>*> outs,
                                const std::function<void(Variant)>& run, const char* what) {
  std::vector<Bits> first;
  for (int rep = 0; rep < 2; ++rep) {
    for (Variant v : kVariants) {
      for (auto* o : outs) o->poison();
      run(v);
      pb.expect_no_error();
      for (size_t k = 0; k < outs.size(); ++k) {
        Bits got = outs[k]->download();
        if (first.size() < outs.size()) {
          first.push_back(std::move(got));
        } else {
          expect_bitwise_equal(first[k], got, std::string(what) + " output " + std::to_string(k) + " grid " +
                                                  std::to_string(v.grid) + " cluster " + std::to_string(v.cluster) +
                                                  " rep " + std::to_string(rep));
        }
      }
    }
  }
  return first;
}

void check_rows_output(const Problem& pb, const Bits& got, const std::vector<float>& ref, int64_t cols, const char* what) {
  const double err = rel_err(real_rows_of(pb.l, to_float(got), cols), real_rows_of(pb.l, ref, cols));
  EXPECT_LT(err, kTol) << what << " relative error";
  EXPECT_FALSE(std::isnan(err)) << what;
  expect_padding_zero(pb.l, got, cols, what);
}

// ---- forward ----------------------------------------------------------------------------

void test_forward(const Shape& s, uint32_t seed) {
  Problem pb(s);
  const int64_t R = pb.l.buffer_rows, H = pb.H, I = pb.I;
  const Bits x = random_rows(pb.l, H, seed, 1.0f);
  const Bits wg = random_bits(pb.E * I * H, seed + 1, 0.1f), wu = random_bits(pb.E * I * H, seed + 2, 0.1f);
  const Bits wd = random_bits(pb.E * H * I, seed + 3, 0.1f);
  auto dx = device_bits(x), dwg = device_bits(wg), dwu = device_bits(wu), dwd = device_bits(wd);
  DeviceBuffer<uint16_t> h(R * I), g(R * I), u(R * I), out(R * H);

  const auto fx = to_float(x), fwg = to_float(wg), fwu = to_float(wu), fwd = to_float(wd);
  const Gemm1Ref ref1 = ref_gemm1(pb.l, fx, fwg, fwu, H, I);
  auto got1 = run_all_grids(pb, {&h, &g, &u}, [&](Variant grid) {
    gemm::gemm1_swiglu({pb.seg(), H, I, bf(dx), bf(dwg), bf(dwu), bf(h), bf(g), bf(u)}, pb.launch(grid), nullptr);
  }, "gemm1_swiglu");
  check_rows_output(pb, got1[0], ref1.h, I, "gemm1 h");
  check_rows_output(pb, got1[1], ref1.g, I, "gemm1 g");
  check_rows_output(pb, got1[2], ref1.u, I, "gemm1 u");

  // GEMM 2 on a fresh random hidden (padding rows zero).
  const Bits hid = random_rows(pb.l, I, seed + 4, 1.0f);
  auto dhid = device_bits(hid);
  const auto fhid = to_float(hid), wdt = transpose_experts(fwd, pb.E, H, I);  // [E, I, H]
  const auto ref2 = ref_rows_gemm(pb.l, {&fhid}, {&wdt}, I, H);
  auto got2 = run_all_grids(pb, {&out}, [&](Variant grid) {
    gemm::gemm2({pb.seg(), H, I, bf(dhid), bf(dwd), bf(out)}, pb.launch(grid), nullptr);
  }, "gemm2");
  check_rows_output(pb, got2[0], ref2, H, "gemm2 out");
}

// ---- dgrad ------------------------------------------------------------------------------

void test_dgrad(const Shape& s, uint32_t seed) {
  Problem pb(s);
  const int64_t R = pb.l.buffer_rows, H = pb.H, I = pb.I;
  const Bits dys = random_rows(pb.l, H, seed, 1.0f);
  const Bits g = random_rows(pb.l, I, seed + 1, 2.0f), u = random_rows(pb.l, I, seed + 2, 2.0f);
  const Bits wg = random_bits(pb.E * I * H, seed + 3, 0.1f), wu = random_bits(pb.E * I * H, seed + 4, 0.1f);
  const Bits wd = random_bits(pb.E * H * I, seed + 5, 0.1f);
  auto ddys = device_bits(dys), dg_in = device_bits(g), du_in = device_bits(u);
  auto dwg = device_bits(wg), dwu = device_bits(wu), dwd = device_bits(wd);
  DeviceBuffer<uint16_t> dg(R * I), du(R * I), dx(R * H);

  // dh = dys . W_down[e] ([H, I] = K x N already) then the SwiGLU backward, fp32.
  const auto fdys = to_float(dys), fg = to_float(g), fu = to_float(u), fwd = to_float(wd);
  std::vector<float> ref_dg(R * I, 0.0f), ref_du(R * I, 0.0f);
  {
    std::vector<float> acc(I);
    for (int e = 0; e < pb.E; ++e) {
      for (int r = pb.l.offsets[e]; r < pb.l.offsets[e] + pb.l.rows[e]; ++r) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t k = 0; k < H; ++k)
          for (int64_t i = 0; i < I; ++i) acc[i] += fdys[r * H + k] * fwd[(e * H + k) * I + i];
        for (int64_t i = 0; i < I; ++i) {
          const float gg = fg[r * I + i], uu = fu[r * I + i], sg = sigmoid_ref(gg);
          ref_dg[r * I + i] = round_bf16(acc[i] * uu * sg * (1.0f + gg * (1.0f - sg)));
          ref_du[r * I + i] = round_bf16(acc[i] * gg * sg);
        }
      }
    }
  }
  auto got_h = run_all_grids(pb, {&dg, &du}, [&](Variant grid) {
    gemm::dgrad_hidden_swiglu({pb.seg(), H, I, bf(ddys), bf(dwd), bf(dg_in), bf(du_in), bf(dg), bf(du)},
                              pb.launch(grid), nullptr);
  }, "dgrad_hidden_swiglu");
  check_rows_output(pb, got_h[0], ref_dg, I, "dgrad dg");
  check_rows_output(pb, got_h[1], ref_du, I, "dgrad du");

  // dx from fresh random dg, du: one fp32 sum over [dg | du] . [W_gate ; W_up].
  const Bits rdg = random_rows(pb.l, I, seed + 6, 1.0f), rdu = random_rows(pb.l, I, seed + 7, 1.0f);
  auto drdg = device_bits(rdg), drdu = device_bits(rdu);
  const auto frdg = to_float(rdg), frdu = to_float(rdu), fwg = to_float(wg), fwu = to_float(wu);
  // W_gate[e] is [I, H] = K x N: one combined K loop over the two parts.
  const auto ref_dx = ref_rows_gemm(pb.l, {&frdg, &frdu}, {&fwg, &fwu}, I, H);
  auto got_x = run_all_grids(pb, {&dx}, [&](Variant grid) {
    gemm::dgrad_input({pb.seg(), H, I, bf(drdg), bf(drdu), bf(dwg), bf(dwu), bf(dx)}, pb.launch(grid), nullptr);
  }, "dgrad_input");
  check_rows_output(pb, got_x[0], ref_dx, H, "dgrad dx");
}

// ---- wgrad ------------------------------------------------------------------------------

struct WgradData {
  Bits a[3], b[3];
  int64_t m[3], n[3];
};

void test_wgrad(const Shape& s, uint32_t seed) {
  Problem pb(s);
  const int64_t H = pb.H, I = pb.I;
  const int E = pb.E;
  // Three problems of one layer: dW_down = dys^T h, dW_gate = dg^T x, dW_up = du^T x.
  WgradData w;
  const int64_t ms[3] = {H, I, I}, ns[3] = {I, H, H};
  std::vector<DeviceBuffer<uint16_t>> da, db;
  std::vector<std::vector<float>> ref;
  for (int q = 0; q < 3; ++q) {
    w.m[q] = ms[q];
    w.n[q] = ns[q];
    w.a[q] = random_rows(pb.l, ms[q], seed + 10 * q, 1.0f);
    w.b[q] = random_rows(pb.l, ns[q], seed + 10 * q + 1, 1.0f);
    da.push_back(device_bits(w.a[q]));
    db.push_back(device_bits(w.b[q]));
    ref.push_back(ref_wgrad(pb.l, to_float(w.a[q]), to_float(w.b[q]), ms[q], ns[q]));
  }
  std::vector<DeviceBuffer<uint16_t>> out_bf;
  std::vector<DeviceBuffer<float>> out_f, partial, main_grad;
  std::vector<std::vector<float>> main_init;
  for (int q = 0; q < 3; ++q) {
    const size_t n = static_cast<size_t>(E) * ms[q] * ns[q];
    out_bf.emplace_back(n);
    out_f.emplace_back(n);
    partial.emplace_back(n);
    main_grad.emplace_back(n);
    std::vector<float> init(n);
    const Bits ib = random_bits(n, seed + 100 + q, 1.0f);
    for (size_t i = 0; i < n; ++i) init[i] = from_bf16(ib[i]);
    main_init.push_back(init);
  }
  auto args = [&](gemm::WgradOut mode, const int32_t* begin, const int32_t* end, bool seeded, int which) {
    gemm::WgradArgs a;
    a.seg = pb.seg();
    a.row_begin = begin;
    a.row_end = end;
    a.mode = mode;
    a.num_problems = 3;
    for (int q = 0; q < 3; ++q) {
      void* out = mode == gemm::WgradOut::kWriteBf16 ? static_cast<void*>(out_bf[q].ptr)
                  : mode == gemm::WgradOut::kPartialFp32 ? static_cast<void*>(which ? partial[q].ptr : out_f[q].ptr)
                                                          : static_cast<void*>(main_grad[q].ptr);
      a.problems[q] = {bf(da[q]), bf(db[q]), ms[q], ns[q], seeded ? partial[q].ptr : nullptr, out};
    }
    return a;
  };

  // One call per mode, every grid size: against the reference and bitwise across grids.
  std::vector<float> first_f[3];
  Bits first_bf[3];
  std::vector<float> first_acc[3];
  for (int gi = 0; gi < 6; ++gi) {
    const Variant grid = kVariants[gi];
    for (int q = 0; q < 3; ++q) {
      out_bf[q].poison();
      out_f[q].poison();
      main_grad[q].upload(main_init[q]);
    }
    gemm::wgrad(args(gemm::WgradOut::kWriteBf16, nullptr, nullptr, false, 0), pb.launch(grid), nullptr);
    gemm::wgrad(args(gemm::WgradOut::kPartialFp32, nullptr, nullptr, false, 0), pb.launch(grid), nullptr);
    gemm::wgrad(args(gemm::WgradOut::kAccumulateFp32, nullptr, nullptr, false, 0), pb.launch(grid), nullptr);
    pb.expect_no_error();
    for (int q = 0; q < 3; ++q) {
      const Bits gb = out_bf[q].download();
      const auto gf = out_f[q].download(), ga = main_grad[q].download();
      if (gi == 0) {
        first_bf[q] = gb;
        first_f[q] = gf;
        first_acc[q] = ga;
        EXPECT_LT(rel_err(to_float(gb), ref[q]), kTol) << "wgrad bf16 problem " << q;
        EXPECT_LT(rel_err(gf, ref[q]), 1e-4) << "wgrad fp32 problem " << q;
        std::vector<float> want(ga.size());
        for (size_t i = 0; i < want.size(); ++i) want[i] = main_init[q][i] + ref[q][i];
        EXPECT_LT(rel_err(ga, want), 1e-4) << "wgrad accumulate problem " << q;
      } else {
        const std::string tag = " problem " + std::to_string(q) + " grid " + std::to_string(grid.grid) + " cluster " +
                                std::to_string(grid.cluster);
        expect_bitwise_equal(first_bf[q], gb, "wgrad bf16" + tag);
        expect_bitwise_equal(first_f[q], gf, "wgrad fp32" + tag);
        expect_bitwise_equal(first_acc[q], ga, "wgrad accumulate" + tag);
      }
    }
  }

  // Split over three calls (rows [0,128), [128,256), [256, end) of every segment) with the
  // fp32 partial carried in between == one call, for the bf16 and the accumulate outputs.
  const std::vector<int32_t> b1(E, 0), e1(E, 128), b2(E, 128), e2(E, 256), b3(E, 256);
  DeviceBuffer<int32_t> db1(E), de1(E), db2(E), de2(E), db3(E);
  db1.upload(b1); de1.upload(e1); db2.upload(b2); de2.upload(e2); db3.upload(b3);
  for (Variant grid : {Variant{0, 0}, Variant{7, 2}, Variant{7, 0}}) {
    for (int q = 0; q < 3; ++q) {
      partial[q].poison();
      out_bf[q].poison();
      main_grad[q].upload(main_init[q]);
    }
    const auto L = pb.launch(grid);
    gemm::wgrad(args(gemm::WgradOut::kPartialFp32, db1.ptr, de1.ptr, false, 1), L, nullptr);
    gemm::wgrad(args(gemm::WgradOut::kPartialFp32, db2.ptr, de2.ptr, true, 1), L, nullptr);
    gemm::wgrad(args(gemm::WgradOut::kWriteBf16, db3.ptr, nullptr, true, 1), L, nullptr);
    gemm::wgrad(args(gemm::WgradOut::kAccumulateFp32, db3.ptr, nullptr, true, 1), L, nullptr);
    pb.expect_no_error();
    for (int q = 0; q < 3; ++q) {
      const std::string tag = " problem " + std::to_string(q) + " grid " + std::to_string(grid.grid) + " cluster " +
                              std::to_string(grid.cluster);
      expect_bitwise_equal(first_bf[q], out_bf[q].download(), "wgrad split bf16" + tag);
      expect_bitwise_equal(first_acc[q], main_grad[q].download(), "wgrad split accumulate" + tag);
    }
  }
}

// ---- cases ------------------------------------------------------------------------------

// Odd segment lengths, an empty expert, a segment with an extra all-padding tile; I = 320
// leaves half a gate/up tile (64 columns) and a quarter 256-wide tile.
const Shape kOdd{{130, 0, 1, 37, 300}, {0, 1, 0, 1, 0}, 192, 320};
// GPT-OSS-like remainder: H = 2880 = 45*64 (45 K steps; 11.25 tiles of 256 columns).
const Shape kRemainder{{200, 0, 77}, {}, 2880, 192};
// Tails of 37, 64, 1 and 72 real rows, H = 704 (2.75 tiles of 256 columns): several tail tiles
// of <= 64 rows per expert next to full ones (the case of the wide tail tiles tried on branch
// exp/wide-tail-tiles, 3141cd7, 2026-12-02, docs/gemm.md).
const Shape kTails{{37, 64, 129, 200, 1}, {}, 704, 192};
// One huge expert (24 row tiles: several raster groups) among empty ones and a tiny one.
const Shape kHuge{{3000, 0, 0, 5}, {}, 256, 256};

TEST(GemmGrouped, ForwardOdd) { SKIP_WITHOUT_GPU(); test_forward(kOdd, 11); }
TEST(GemmGrouped, ForwardRemainder) { SKIP_WITHOUT_GPU(); test_forward(kRemainder, 12); }
TEST(GemmGrouped, ForwardHugeExpert) { SKIP_WITHOUT_GPU(); test_forward(kHuge, 13); }
TEST(GemmGrouped, ForwardTails) { SKIP_WITHOUT_GPU(); test_forward(kTails, 14); }
TEST(GemmGrouped, DgradOdd) { SKIP_WITHOUT_GPU(); test_dgrad(kOdd, 21); }
TEST(GemmGrouped, DgradRemainder) { SKIP_WITHOUT_GPU(); test_dgrad(kRemainder, 22); }
TEST(GemmGrouped, DgradHugeExpert) { SKIP_WITHOUT_GPU(); test_dgrad(kHuge, 23); }
TEST(GemmGrouped, WgradOdd) { SKIP_WITHOUT_GPU(); test_wgrad(kOdd, 31); }
TEST(GemmGrouped, WgradRemainder) { SKIP_WITHOUT_GPU(); test_wgrad(kRemainder, 32); }
TEST(GemmGrouped, WgradHugeExpert) { SKIP_WITHOUT_GPU(); test_wgrad(kHuge, 33); }

// Small case for compute-sanitizer runs (--gtest_filter=GemmGrouped.Sanitizer*).
const Shape kSmall{{70, 0, 129}, {0, 0, 1}, 128, 192};
TEST(GemmGrouped, SanitizerSmallForward) { SKIP_WITHOUT_GPU(); test_forward(kSmall, 41); }
TEST(GemmGrouped, SanitizerSmallDgrad) { SKIP_WITHOUT_GPU(); test_dgrad(kSmall, 42); }
TEST(GemmGrouped, SanitizerSmallWgrad) { SKIP_WITHOUT_GPU(); test_wgrad(kSmall, 43); }

TEST(GemmGrouped, RejectsBadArguments) {
  gemm::Gemm2Args a;
  a.seg.experts = 1;
  a.seg.buffer_rows = 128;
  int32_t dummy[4] = {};
  a.seg.offsets = dummy;
  a.seg.rows = dummy;
  a.hidden = 100;  // not a multiple of 64
  a.intermediate = 64;
  EXPECT_THROW(gemm::gemm2(a, {}, nullptr), mok::Error);
  try {
    gemm::gemm2(a, {}, nullptr);
  } catch (const mok::Error& e) {
    EXPECT_NE(std::string(e.what()).find("hidden"), std::string::npos) << e.what();
  }
  a.hidden = 128;
  a.seg.buffer_rows = 100;
  EXPECT_THROW(gemm::gemm2(a, {}, nullptr), mok::Error);
}

}  // namespace
}  // namespace mok::gemm_test
