// The FP8 layer (Config::precision kFp8Block, docs/fp8.md "The FP8 layer") on the GPU against the FP8
// CPU reference (ref::forward_fp8 / backward_fp8): every output and gradient within the FP8 layer's
// numerics contract, 2e-2 relative norm (docs/fp8.md, "Accuracy"), and D1-D3 bit for bit. Each
// expert GEMM alone matches the reference within 2e-3 (test_gemm_fp8.cu, 9e-5 to 1.4e-3); the layer sits
// further off because the engines' sums inside a 128-wide K block differ in order, which moves some
// bf16 intermediates (g, u, h, dg, du, hs) by an ulp, and requantizing such a value to e4m3 (3
// mantissa bits) can move its code by a whole e4m3 step (6-12 % of the value). Measured on an H100
// (2026-12-07): 2.6e-3 to 8.8e-3 over every case, tensor and EP, 1.05e-2 once (a shared expert's
// bf16 weight gradient); the bf16 layer sits at ~3e-3 of its reference under a 1e-2 bound. Every
// case prints its largest distance per tensor. Outputs are poisoned before each pass
// (test_layer_run.cuh).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <string>

#include "test_layer_run.cuh"

namespace mok::test {
namespace {

constexpr double kTol = 2e-2;

Config fp8_config(const LayerShape& s, bool fp8_wgrad = true) {
  Config c = bwd_config(s);
  c.precision = Precision::kFp8Block;
  c.fp8_weight_grads = fp8_wgrad;
  return c;
}

void expect_matches_fp8_reference(const std::string& name, const Problem& p,
                                   const std::vector<std::vector<uint16_t>>& dy, const std::vector<RankGrads>& got,
                                   bool fp8_wgrad) {
  const LayerShape& s = p.shape;
  const Config cfg = fp8_config(s, fp8_wgrad);
  ref::Fp8Recipe recipe;
  recipe.fp8_wgrad = fp8_wgrad;
  const ref::ForwardResult fwd = ref::forward_fp8(s, cfg, p.weights, p.inputs, recipe);
  const ref::Gradients expect = ref::backward_fp8(s, cfg, p.weights, p.inputs, dy, &fwd.ctx, recipe);
  double y = 0;
  for (int r = 0; r < s.ep; ++r) {
    const double v = rel_norm_bits(got[r].y, fwd.y[r]);
    EXPECT_LT(v, kTol) << name << " rank " << r << " y";
    y = std::max(y, v);
  }
  const GradDistances d = expect_grads_within(name, s, expect, got, kTol);
  // One line per case: the largest distance over the ranks (the figures docs/fp8.md quotes).
  std::printf("[ DISTANCE ] %s ep %d vs the FP8 reference: y %.2e dx %.2e dtopk_w %.2e dW %.2e shared dW %.2e\n",
              name.c_str(), s.ep, y, d.dx, d.dtopk_w, d.dw, d.shared_dw);
}

// Every case of the backward tests (T not a multiple of 128, H = 2880 with a partial 128-block,
// I = 192, empty experts, skew, top-1 and top-8, shared expert on and off), EP 1 and 2, both
// gradient modes, the weights through a cache or quantized per call.
class Fp8LayerVsReference : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(Fp8LayerVsReference, MatchesWithinToleranceAndRepeatsBitwise) {
  const auto [ep, which, mode] = GetParam();
  MOK_REQUIRE_RANKS(ep);
  const BwdCase& c = bwd_cases()[which];
  const LayerShape s = with_ep(c.shape, ep);
  const Problem p = make_problem(s, c.pattern, 15000 + which * 10 + ep);
  const auto dy = make_dy(s, 1077 + which);
  RunOptions ro;
  ro.mode = mode == 0 ? GradMode::kAccumulateFp32 : GradMode::kWriteBf16;
  ro.repeats = 2;
  ro.fp8_cache = which % 2 == 0;
  const auto got = run_backward(p, dy, fp8_config(s), ro);
  expect_matches_fp8_reference(c.name, p, dy, got[0], true);
  expect_same_bits(got[1], got[0], std::string(c.name) + " D1");
}

INSTANTIATE_TEST_SUITE_P(Shapes, Fp8LayerVsReference,
                         ::testing::Combine(::testing::Values(1, 2), ::testing::Range(0, 6), ::testing::Values(0, 1)),
                         [](const auto& info) {
                           return std::string(bwd_cases()[std::get<1>(info.param)].name) + "_ep" +
                                  std::to_string(std::get<0>(info.param)) +
                                  (std::get<2>(info.param) == 0 ? "_fp32acc" : "_bf16");
                         });

// Config::fp8_weight_grads false: the weight gradients in bf16 over the FP8 pass's dg, du, hs.
TEST(Fp8Layer, Bf16WeightGradsMatchTheReference) {
  MOK_REQUIRE_RANKS(1);
  for (int which : {0, 2}) {
    const BwdCase& c = bwd_cases()[which];
    const LayerShape s = with_ep(c.shape, 1);
    const Problem p = make_problem(s, c.pattern, 16000 + which);
    const auto dy = make_dy(s, 1600 + which);
    const auto got = run_backward(p, dy, fp8_config(s, false), {});
    expect_matches_fp8_reference(std::string(c.name) + " bf16 wgrad", p, dy, got[0], false);
  }
}

// The cache and the per-call quantization give the same bits; so do the Hugging Face layout
// (expert strides), a routing-only context, an explicit recompute and the deferred weight gradients.
TEST(Fp8Layer, CacheStridesRecomputeAndDeferralGiveTheSameBits) {
  MOK_REQUIRE_RANKS(1);
  for (int ep : {1, 2}) {
    if (!can_run_ep(ep)) continue;
    const BwdCase& c = bwd_cases()[0];
    const LayerShape s = with_ep(c.shape, ep);
    const Problem p = make_problem(s, c.pattern, 16100 + ep);
    const auto dy = make_dy(s, 16200 + ep);
    const auto want = run_backward(p, dy, fp8_config(s), {});
    const std::string at = "ep " + std::to_string(ep);
    RunOptions cache;
    cache.fp8_cache = true;
    expect_same_bits(run_backward(p, dy, fp8_config(s), cache)[0], want[0], at + " cache");
    RunOptions strided;
    strided.strided_experts = true;
    strided.fp8_cache = true;
    expect_same_bits(run_backward(p, dy, fp8_config(s), strided)[0], want[0], at + " expert strides");
    RunOptions routing_only;
    routing_only.keep = Context::Keep::kRoutingOnly;
    expect_same_bits(run_backward(p, dy, fp8_config(s), routing_only)[0], want[0], at + " routing-only context");
    RunOptions recompute;
    recompute.save_activations = false;
    recompute.recompute_call = true;
    expect_same_bits(run_backward(p, dy, fp8_config(s), recompute)[0], want[0], at + " recompute");
    RunOptions defer;
    defer.defer = true;
    expect_same_bits(run_backward(p, dy, fp8_config(s), defer)[0], want[0], at + " deferred weight gradients");
    const Problem second = make_problem(s, Pattern::kUniform, 16300 + ep);
    RunOptions two;
    two.second = &second;
    expect_same_bits(run_backward(p, dy, fp8_config(s), two)[0], want[0], at + " a second layer in between");
  }
}

// D3 in FP8: the same global batch over ep 1, 2, 4, 8 gives the same y, dx, d topk_w and routed
// weight gradients.
TEST(Fp8Layer, D3EpSplitGivesTheSameBits) {
  MOK_REQUIRE_RANKS(1);
  const LayerShape s8 = with_ep(LayerShape{512, 320, 192, 64, 16, 4, 1}, 8);
  expect_ep_split_same_bits(make_problem(s8, Pattern::kUniform, 16400), 16401,
                            [](const LayerShape& s) { return fp8_config(s); });
}

// A non-finite value in a tensor FP8 quantizes: check() names it, the pass's outputs are NaN, and
// the workspace recovers (the next clean pass gives the clean bits).
TEST(Fp8Layer, NonFiniteInputsAreNamedErrorsAndTheWorkspaceRecovers) {
  MOK_REQUIRE_RANKS(1);
  const BwdCase& c = bwd_cases()[0];
  const LayerShape s = with_ep(c.shape, 1);
  const Problem p = make_problem(s, c.pattern, 16500);
  const auto dy = make_dy(s, 16501);
  RunOptions write_bf16;
  write_bf16.mode = GradMode::kWriteBf16;
  const RankGrads clean = run_backward(p, dy, fp8_config(s), write_bf16)[0][0];
  RankPool::get(1).run([&](bootstrap::LocalRank& r) {
    RankData d = upload_rank(p, r.rank);
    comm::DeviceBuffer<bf16> ddy = upload_bf16(dy[0].data(), dy[0].size());
    comm::DeviceBuffer<bf16> dx(size_t(s.tokens) * s.hidden);
    comm::DeviceBuffer<float> dtopk(size_t(s.tokens) * s.topk);
    std::vector<uint16_t> bad_x = p.inputs.x[0];
    bad_x[7 * s.hidden + 3] = 0x7FC0;  // NaN
    comm::DeviceBuffer<bf16> dbad_x = upload_bf16(bad_x.data(), bad_x.size());
    std::vector<uint16_t> bad_dy = dy[0];
    bad_dy[2 * s.hidden + 1] = 0x7F80;  // +inf
    comm::DeviceBuffer<bf16> dbad_dy = upload_bf16(bad_dy.data(), bad_dy.size());
    std::vector<uint16_t> bad_gate = p.weights.gate;
    bad_gate[s.hidden + 5] = 0xFF80;  // -inf in expert 0, row 1
    comm::DeviceBuffer<bf16> dbad_gate = upload_bf16(bad_gate.data(), bad_gate.size());
    cudaStream_t st = rank_stream();
    auto ws = create_workspace(s, fp8_config(s), r);
    GradBuffers gb(s, GradMode::kWriteBf16);
    auto expect_error = [&](const char* needle) {
      try {
        ws->check();
        ADD_FAILURE() << "expected kInvalidArgument naming " << needle;
      } catch (const Error& e) {
        EXPECT_EQ(e.status(), Status::kInvalidArgument);
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
    };
    auto all_nan = [](const std::vector<uint16_t>& v) {
      for (uint16_t b : v)
        if (!std::isnan(ref::from_bf16(b))) return false;
      return true;
    };
    ExpertWeights ew = d.weights();
    // x: the forward's y is NaN, check() names x.
    schedule(*ws, d.idx.get(), st);
    forward(*ws, ForwardArgs{dbad_x.get(), d.w.get(), d.y.get()}, ew, st);
    expect_error("non-finite value in x");
    EXPECT_TRUE(all_nan(get_bits(d.y.get(), d.y.size()))) << "y after a NaN in x";
    // dy: dx and d topk_w are NaN, check() names dy.
    schedule(*ws, d.idx.get(), st);
    forward(*ws, ForwardArgs{d.x.get(), d.w.get(), d.y.get()}, ew, st);
    ws->check();
    backward(*ws, BackwardArgs{d.x.get(), d.w.get(), dbad_dy.get(), dx.get(), dtopk.get()}, ew, gb.grads(), st);
    expect_error("non-finite value in dy");
    EXPECT_TRUE(all_nan(get_bits(dx.get(), dx.size()))) << "dx after an infinite dy";
    // A weight, through a cache: check() names the matrix; every pass reading the cache is NaN
    // until it is updated with finite weights.
    auto cache = Fp8WeightCache::create(*ws, st);
    ExpertWeights bad = ew;
    bad.gate = dbad_gate.get();
    cache->update(bad, st);
    ExpertWeights cached = ew;
    cached.fp8 = cache.get();
    schedule(*ws, d.idx.get(), st);
    forward(*ws, ForwardArgs{d.x.get(), d.w.get(), d.y.get()}, cached, st);
    expect_error("ExpertWeights.gate");
    EXPECT_TRUE(all_nan(get_bits(d.y.get(), d.y.size()))) << "y after an infinite weight";
    // Recovery: a clean pass (cache updated) gives the clean bits.
    cache->update(ew, st);
    gb.poison(st);
    schedule(*ws, d.idx.get(), st);
    forward(*ws, ForwardArgs{d.x.get(), d.w.get(), d.y.get()}, cached, st);
    backward(*ws, BackwardArgs{d.x.get(), d.w.get(), ddy.get(), dx.get(), dtopk.get()}, cached, gb.grads(), st);
    ws->check();
    EXPECT_TRUE(same_grads(read_pass(d, dx, dtopk, gb), clean)) << "a clean pass after the errors";
  });
}

// The FP8 dispatch: x moves as codes and scales, 0.52x the bytes of the bf16 dispatch (H 1024:
// 1056 bytes a row against 2048), counted on the device over every rank's reads from other
// ranks (simulated ranks), with the bits of the bf16 dispatch followed by quantizing the rows.
TEST(Fp8Layer, Fp8DispatchMovesAboutHalfTheBytesWithTheSameBits) {
  MOK_REQUIRE_RANKS(1);
  for (int ep : {2, 4}) {
    if (!can_run_ep(ep)) continue;
    const LayerShape s = with_ep(LayerShape{192, 1024, 256, 128, 16, 4, 1}, ep);
    const Problem p = make_problem(s, Pattern::kUniform, 16700 + ep);
    std::mutex mu;
    uint64_t bytes[2] = {0, 0};
    std::vector<std::vector<uint16_t>> y[2];
    for (auto& v : y) v.resize(ep);
    RankPool::get(ep).run([&](bootstrap::LocalRank& r) {
      RankData d = upload_rank(p, r.rank);
      cudaStream_t st = rank_stream();
      auto ws = create_workspace(s, fp8_config(s), r);
      ws->impl().state->count_dispatch_bytes(true);
      for (int fp8 : {1, 0}) {
        ws->impl().fp8_dispatch = fp8 == 1;
        MOK_CUDA_CHECK(cudaMemsetAsync(d.y.get(), 0xFF, d.y.bytes(), st));
        schedule(*ws, d.idx.get(), st);
        forward(*ws, ForwardArgs{d.x.get(), d.w.get(), d.y.get()}, d.weights(), st);
        ws->check();
        const uint64_t n = ws->impl().state->take_dispatch_bytes(st);
        std::lock_guard<std::mutex> lock(mu);
        bytes[fp8] += n;
        y[fp8][r.rank] = get_bits(d.y.get(), d.y.size());
      }
    });
    EXPECT_EQ(y[1], y[0]) << "ep " << ep << ": y with the FP8 dispatch against the bf16 one";
    ASSERT_GT(bytes[0], 0u) << "ep " << ep;
    const double ratio = double(bytes[1]) / double(bytes[0]);
    EXPECT_DOUBLE_EQ(ratio, 1056.0 / 2048.0) << "ep " << ep << ": " << bytes[1] << " / " << bytes[0] << " bytes";
    EXPECT_LE(ratio, 0.55);
  }
}

TEST(Fp8Layer, MisusedCachesGetClearErrors) {
  MOK_REQUIRE_RANKS(1);
  const LayerShape s = with_ep(bwd_cases()[1].shape, 1);
  RankPool::get(1).run([&](bootstrap::LocalRank& r) {
    cudaStream_t st = rank_stream();
    auto bf16_ws = create_workspace(s, bwd_config(s), r);
    try {
      Fp8WeightCache::create(*bf16_ws, st);
      ADD_FAILURE() << "a cache of a bf16 workspace";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("fp8_block"), std::string::npos) << e.what();
    }
    auto ws = create_workspace(s, fp8_config(s), r);
    const Problem p = make_problem(s, Pattern::kUniform, 16600);
    RankData d = upload_rank(p, r.rank);
    auto never_updated = Fp8WeightCache::create(*ws, st);
    ExpertWeights ew = d.weights();
    ew.fp8 = never_updated.get();
    schedule(*ws, d.idx.get(), st);
    try {
      forward(*ws, ForwardArgs{d.x.get(), d.w.get(), d.y.get()}, ew, st);
      ADD_FAILURE() << "a cache never updated";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("ExpertWeights.fp8"), std::string::npos) << e.what();
    }
    EXPECT_GE(Fp8WeightCache::bytes(s), size_t(2 * 3 * s.local_experts() * s.intermediate * s.hidden));
  });
}

// The workspace's own weight copies (passes given no Fp8WeightCache) are made by its first such pass,
// not at creation, and not while the stream is being captured: a clear error, and the workspace
// works afterwards.
TEST(Fp8Layer, OwnWeightCopiesAreMadeByTheFirstPassWithoutACacheNeverWhileCapturing) {
  MOK_REQUIRE_RANKS(1);
  const LayerShape s = with_ep(bwd_cases()[1].shape, 1);
  RankPool::get(1).run([&](bootstrap::LocalRank& r) {
    cudaStream_t st = rank_stream();
    auto ws = create_workspace(s, fp8_config(s), r);
    const size_t before = ws->device_bytes();
    const Problem p = make_problem(s, Pattern::kUniform, 16700);
    RankData d = upload_rank(p, r.rank);
    const ExpertWeights ew = d.weights();  // fp8 nullptr: the workspace's own copies
    schedule(*ws, d.idx.get(), st);
    MOK_CUDA_CHECK(cudaStreamSynchronize(st));
    cudaStream_t cs;
    MOK_CUDA_CHECK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
    MOK_CUDA_CHECK(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal));
    try {
      forward(*ws, ForwardArgs{d.x.get(), d.w.get(), d.y.get()}, ew, cs);
      ADD_FAILURE() << "a first pass without a cache, captured";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("being captured"), std::string::npos) << e.what();
    }
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(cs, &g);  // the capture may be invalidated: either way nothing runs
    if (g != nullptr) cudaGraphDestroy(g);
    cudaGetLastError();
    EXPECT_EQ(ws->device_bytes(), before) << "no copies yet";
    schedule(*ws, d.idx.get(), st);
    forward(*ws, ForwardArgs{d.x.get(), d.w.get(), d.y.get()}, ew, st);
    ws->check();
    EXPECT_EQ(ws->device_bytes(), before + Fp8WeightCache::bytes(s)) << "the first pass made them";
    MOK_CUDA_CHECK(cudaStreamDestroy(cs));
  });
}

}  // namespace
}  // namespace mok::test
