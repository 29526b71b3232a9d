// GPU backward (src/megakernel/staged_backward.hpp) against the CPU reference, plus the
// forward-context contract (include/mok/api.hpp: Context) and determinism (D1-D3).
// Every output is poisoned before each pass (NaN bits, or a random fp32 main grad that the
// pass must add to), so an unwritten element cannot pass.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <string>

#include "test_layer_run.cuh"
#include "megakernel/fused_backward.hpp"
#include "megakernel/fused_forward.hpp"
#include "reference/layer.hpp"

namespace mok::test {
namespace {

void expect_matches_reference(const BwdCase& c, const Problem& p, const std::vector<std::vector<uint16_t>>& dy,
                              const std::vector<RankGrads>& got) {
  const LayerShape& s = p.shape;
  expect_grads_within(c.name, s, ref::backward(s, bwd_config(s), p.weights, p.inputs, dy, nullptr), got, 1e-2);
}

// Every case against the CPU reference on both engines (the fused one and its staged oracle),
// each with both gradient modes, EP 1 and 2.
class BackwardVsReference : public ::testing::TestWithParam<std::tuple<int, int, int, BackwardEngine>> {};

TEST_P(BackwardVsReference, MatchesWithinToleranceAndRepeatsBitwise) {
  const auto [ep, which, mode, engine] = GetParam();
  MOK_REQUIRE_RANKS(ep);
  const BwdCase& c = bwd_cases()[which];
  const LayerShape s = with_ep(c.shape, ep);
  const Problem p = make_problem(s, c.pattern, 5000 + which * 10 + ep);
  const auto dy = make_dy(s, 77 + which);
  RunOptions ro;
  ro.mode = mode == 0 ? GradMode::kAccumulateFp32 : GradMode::kWriteBf16;
  ro.repeats = 2;
  Config cfg = bwd_config(s);
  cfg.backward_engine = engine;
  const auto got = run_backward(p, dy, cfg, ro);
  expect_matches_reference(c, p, dy, got[0]);
  expect_same_bits(got[1], got[0], std::string(c.name) + " D1");
}

INSTANTIATE_TEST_SUITE_P(Shapes, BackwardVsReference,
                         ::testing::Combine(::testing::Values(1, 2), ::testing::Range(0, 6), ::testing::Values(0, 1),
                                            ::testing::Values(BackwardEngine::kStaged, BackwardEngine::kFused)),
                         [](const auto& info) {
                           return std::string(bwd_cases()[std::get<1>(info.param)].name) + "_ep" +
                                  std::to_string(std::get<0>(info.param)) +
                                  (std::get<2>(info.param) == 0 ? "_fp32acc_" : "_bf16_") +
                                  to_string(std::get<3>(info.param));
                         });

// The fused backward against the staged one, its oracle: every output and weight gradient bit
// for bit, every case, EP 1 and 2, both GradModes, the weight gradients as the kernel's second
// phase (the fused default) and as launches after it, a deferring call too.
class BackwardFusedVsStaged : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(BackwardFusedVsStaged, SameBits) {
  const auto [ep, which] = GetParam();
  MOK_REQUIRE_RANKS(ep);
  const BwdCase& c = bwd_cases()[which];
  const LayerShape s = with_ep(c.shape, ep);
  const Problem p = make_problem(s, c.pattern, 7000 + which * 10 + ep);
  const auto dy = make_dy(s, 7100 + which);
  for (GradMode mode : {GradMode::kAccumulateFp32, GradMode::kWriteBf16}) {
    RunOptions fused;
    fused.mode = mode;
    fused.configure = [](Workspace& ws) { ws.impl().config.backward_engine = BackwardEngine::kFused; };
    RunOptions staged = fused;
    staged.configure = [](Workspace& ws) { ws.impl().config.backward_engine = BackwardEngine::kStaged; };
    const std::string what = std::string(c.name) + " ep " + std::to_string(ep) + " mode " + std::to_string(int(mode));
    const auto want = run_backward(p, dy, bwd_config(s), staged);
    expect_same_bits(run_backward(p, dy, bwd_config(s), fused)[0], want[0], what);
    RunOptions after = fused;
    after.configure = [](Workspace& ws) {
      ws.impl().config.backward_engine = BackwardEngine::kFused;
      ws.impl().fused_wgrad_in_kernel = false;
    };
    expect_same_bits(run_backward(p, dy, bwd_config(s), after)[0], want[0], what + " weight gradients after the kernel");
    if (which == 0) {  // the deferred weight gradients after a fused backward
      RunOptions split = fused;
      split.defer = true;
      expect_same_bits(run_backward(p, dy, bwd_config(s), split)[0], want[0], what + " deferred");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, BackwardFusedVsStaged,
                         ::testing::Combine(::testing::Values(1, 2), ::testing::Range(0, 6)), [](const auto& info) {
                           return std::string(bwd_cases()[std::get<1>(info.param)].name) + "_ep" +
                                  std::to_string(std::get<0>(info.param));
                         });

// D1: many repeats, every output and weight gradient bitwise equal (MOK_TEST_D1_REPEATS, default 100).
TEST(BackwardDeterminism, D1RepeatsBitwise) {
  MOK_REQUIRE_RANKS(1);
  const int repeats = env_int_or("MOK_TEST_D1_REPEATS", 100);
  const BwdCase& c = bwd_cases()[0];
  const LayerShape s = with_ep(c.shape, 1);
  const Problem p = make_problem(s, c.pattern, 91);
  const auto dy = make_dy(s, 92);
  RunOptions ro;
  ro.repeats = repeats;
  const auto got = run_backward(p, dy, bwd_config(s), ro);
  for (int i = 1; i < repeats; ++i) ASSERT_TRUE(same_grads(got[i][0], got[0][0])) << "repeat " << i;
}

// D2: communication CTAs, minibatch and grid change speed only.
TEST(BackwardDeterminism, D2KnobsGiveTheSameBits) {
  MOK_REQUIRE_RANKS(1);
  const BwdCase& c = bwd_cases()[2];
  const LayerShape s = with_ep(c.shape, 1);
  const Problem p = make_problem(s, c.pattern, 93);
  const auto dy = make_dy(s, 94);
  const Config base = bwd_config(s);
  const auto ref_bits = run_backward(p, dy, base, {});
  std::vector<Config> knobs;
  for (int comm : {1, 3}) {
    Config k = base;
    k.comm_sms_backward = comm;
    knobs.push_back(k);
  }
  {
    Config k = base;
    k.minibatch = 128;
    knobs.push_back(k);
  }
  for (int grid : {4, 17}) {
    Config k = base;
    k.grid_sms = grid;
    knobs.push_back(k);
  }
  for (size_t i = 0; i < knobs.size(); ++i) {
    const auto got = run_backward(p, dy, knobs[i], {});
    EXPECT_TRUE(same_grads(got[0][0], ref_bits[0][0])) << "knob set " << i << ": " << knobs[i].to_string();
  }
}

// D3: the same global batch over ep 1, 2, 4, 8 gives the same y, dx, d topk_w and routed weight
// gradients (the shared expert's are per-rank partial sums).
TEST(BackwardDeterminism, D3EpSplitGivesTheSameBits) {
  MOK_REQUIRE_RANKS(1);
  const LayerShape s8 = with_ep(LayerShape{512, 128, 128, 64, 16, 4, 1}, 8);
  expect_ep_split_same_bits(make_problem(s8, bwd_cases()[2].pattern, 95), 96, bwd_config);
}

// Two layers whose forwards both run before either backward: each backward gives the bits of
// its layer run alone.
TEST(BackwardContext, TwoLayersInterleavedGiveTheSameBits) {
  MOK_REQUIRE_RANKS(1);
  for (int ep : {1, 2}) {
    if (!can_run_ep(ep)) continue;
    const BwdCase& c = bwd_cases()[0];
    const LayerShape s = with_ep(c.shape, ep);
    const Problem p = make_problem(s, c.pattern, 97);
    const auto dy = make_dy(s, 98);
    const auto alone = run_backward(p, dy, bwd_config(s), {});
    const Problem other = make_problem(s, Pattern::kOneExpert, 197);
    RunOptions ro;
    ro.second = &other;
    const auto interleaved = run_backward(p, dy, bwd_config(s), ro);
    expect_same_bits(interleaved[0], alone[0], "ep " + std::to_string(ep));
  }
}

// Saved or recomputed: a context that keeps only the routing table (Keep::kRoutingOnly, or
// ForwardArgs::save_activations false, or the macrobatch ring), with or without
// recompute_forward_context, gives the bits of one that keeps everything.
TEST(BackwardRecompute, RoutingOnlyContextsGiveTheSameBits) {
  MOK_REQUIRE_RANKS(1);
  for (int ep : {1, 2}) {
    if (!can_run_ep(ep)) continue;
    const BwdCase& c = bwd_cases()[0];  // T 200, shared expert
    const LayerShape s = with_ep(c.shape, ep);
    const Problem p = make_problem(s, c.pattern, 301);
    const auto dy = make_dy(s, 302);
    const auto kept = run_backward(p, dy, bwd_config(s), {});
    RunOptions routing_only;
    routing_only.keep = Context::Keep::kRoutingOnly;
    RunOptions not_saved;
    not_saved.save_activations = false;
    RunOptions refilled = not_saved;
    refilled.recompute_call = true;
    int which = 0;
    for (const RunOptions* ro : {&routing_only, &not_saved, &refilled}) {
      const auto got = run_backward(p, dy, bwd_config(s), *ro);
      expect_same_bits(got[0], kept[0], "ep " + std::to_string(ep) + " variant " + std::to_string(which));
      ++which;
    }
  }
}

TEST(BackwardRecompute, MacrobatchRingGivesTheSameBits) {
  MOK_REQUIRE_RANKS(1);
  for (int ep : {1, 2}) {
    if (!can_run_ep(ep)) continue;
    const BwdCase& c = bwd_cases()[2];  // top-8, E 16, shared expert
    const LayerShape s = with_ep(c.shape, ep);
    const Problem p = make_problem(s, c.pattern, 303);
    const auto dy = make_dy(s, 304);
    Config base = bwd_config(s);
    base.minibatch = 128;
    const auto kept = run_backward(p, dy, base, {});
    Config ring = base;
    ring.macrobatch = 256;  // two minibatches: below the routed buffer, so a ring
    ASSERT_LT(ring.resident_routed_rows(s), ring.buffer_rows_per_rank(s));
    const auto got = run_backward(p, dy, ring, {});
    expect_same_bits(got[0], kept[0], "ep " + std::to_string(ep));
  }
}

// The deferred weight-gradient call (Megatron's backward_dw): dx and d topk_w first, another
// layer's whole forward and backward in between, then the weight gradients: the bits of one call.
TEST(BackwardDeferredWgrad, SplitCallGivesTheSameBits) {
  MOK_REQUIRE_RANKS(1);
  for (int ep : {1, 2}) {
    if (!can_run_ep(ep)) continue;
    for (int which : {0, 2}) {  // shared expert on; top-8
      const BwdCase& c = bwd_cases()[which];
      const LayerShape s = with_ep(c.shape, ep);
      const Problem p = make_problem(s, c.pattern, 401 + which);
      const Problem other = make_problem(s, Pattern::kOneExpert, 411 + which);
      const auto dy = make_dy(s, 402 + which);
      for (GradMode mode : {GradMode::kAccumulateFp32, GradMode::kWriteBf16}) {
        RunOptions one;
        one.mode = mode;
        const auto expect = run_backward(p, dy, bwd_config(s), one);
        RunOptions split = one;
        split.defer = true;
        split.second = &other;
        const auto got = run_backward(p, dy, bwd_config(s), split);
        expect_same_bits(got[0], expect[0], std::string(c.name) + " ep " + std::to_string(ep) + " mode " + std::to_string(int(mode)));
      }
    }
  }
}

// Hugging Face's expert layout without a copy: gate_up_proj [E, 2I, H] (gate and up through
// expert strides of 2IH) and a padded down stride, for the weights and the weight gradients:
// the bits of the dense layout, forward and backward, at EP 1 and 2.
TEST(BackwardExpertStrides, HuggingFaceLayoutGivesTheDenseBits) {
  MOK_REQUIRE_RANKS(1);
  for (int ep : {1, 2}) {
    if (!can_run_ep(ep)) continue;
    const BwdCase& c = bwd_cases()[0];
    const LayerShape s = with_ep(c.shape, ep);
    const Problem p = make_problem(s, c.pattern, 431);
    const auto dy = make_dy(s, 432);
    for (GradMode mode : {GradMode::kAccumulateFp32, GradMode::kWriteBf16}) {
      RunOptions dense;
      dense.mode = mode;
      const auto expect = run_backward(p, dy, bwd_config(s), dense);
      RunOptions hf = dense;
      hf.strided_experts = true;
      const auto got = run_backward(p, dy, bwd_config(s), hf);
      expect_same_bits(got[0], expect[0], std::string(c.name) + " ep " + std::to_string(ep) + " mode " + std::to_string(int(mode)));
    }
  }
}

// Calls with fewer tokens than the workspace was sized for (the last batch of an epoch, packed
// sequences): the bits of a workspace sized exactly, forward (y) and backward, and within the
// reference's tolerance; a second layer of yet another T runs between the forward and the backward.
TEST(BackwardShortCalls, FewerTokensThanTheWorkspaceGiveTheExactWorkspaceBits) {
  MOK_REQUIRE_RANKS(1);
  for (int ep : {1, 2}) {
    if (!can_run_ep(ep)) continue;
    for (int which : {0, 2}) {  // shared expert on; top-8
      const BwdCase& c = bwd_cases()[which];
      const LayerShape s = with_ep(c.shape, ep);
      const Problem p = make_problem(s, c.pattern, 441 + which);
      LayerShape s2 = s;
      s2.tokens = s.tokens / 2 + 3;
      const Problem other = make_problem(s2, Pattern::kOneExpert, 451 + which);
      const auto dy = make_dy(s, 442 + which);
      for (GradMode mode : {GradMode::kAccumulateFp32, GradMode::kWriteBf16}) {
        RunOptions exact;
        exact.mode = mode;
        const auto expect = run_backward(p, dy, bwd_config(s), exact);
        for (int64_t ws_tokens : {s.tokens + 77, 3 * s.tokens}) {
          RunOptions shorter = exact;
          shorter.workspace_tokens = ws_tokens;
          shorter.second = &other;
          LayerShape big = s;
          big.tokens = ws_tokens;
          const auto got = run_backward(p, dy, bwd_config(big), shorter);
          expect_same_bits(got[0], expect[0], std::string(c.name) + " ep " + std::to_string(ep) + " mode " +
                                                  std::to_string(int(mode)) + " workspace T " + std::to_string(ws_tokens));
          if (mode == GradMode::kAccumulateFp32 && ws_tokens == 3 * s.tokens) expect_matches_reference(c, p, dy, got[0]);
        }
      }
    }
  }
}

// The context contract: a backward needs a filled, unconsumed context of its own workspace.
TEST(BackwardContext, MisusedContextsGetClearErrors) {
  MOK_REQUIRE_RANKS(1);
  const BwdCase& c = bwd_cases()[1];
  const LayerShape s = with_ep(c.shape, 1);
  const Problem p = make_problem(s, c.pattern, 99);
  const auto dy = make_dy(s, 100);
  RankPool::get(1).run([&](bootstrap::LocalRank& r) {
    RankData d = upload_rank(p, r.rank);
    comm::DeviceBuffer<bf16> ddy = upload_bf16(dy[0].data(), dy[0].size());
    comm::DeviceBuffer<bf16> dx(size_t(s.tokens) * s.hidden);
    comm::DeviceBuffer<float> dtopk(size_t(s.tokens) * s.topk);
    cudaStream_t st = rank_stream();
    auto ws = create_workspace(s, bwd_config(s), r);
    auto other = create_workspace(s, bwd_config(s), r);
    GradBuffers gb(s, GradMode::kWriteBf16);
    const ExpertWeights ew = d.weights();
    auto ctx = Context::create(*ws, st);
    auto foreign = Context::create(*other, st);
    EXPECT_FALSE(ctx->saved());
    auto expect_invalid = [&](Context* cx, const char* needle) {
      try {
        backward(*ws, BackwardArgs{d.x.get(), d.w.get(), ddy.get(), dx.get(), dtopk.get(), cx}, ew, gb.grads(), st);
        ADD_FAILURE() << "expected kInvalidArgument containing '" << needle << "'";
      } catch (const Error& e) {
        EXPECT_EQ(e.status(), Status::kInvalidArgument);
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
    };
    expect_invalid(ctx.get(), "no forward filled");
    expect_invalid(foreign.get(), "another workspace");
    schedule(*ws, d.idx.get(), st);
    forward(*ws, ForwardArgs{d.x.get(), d.w.get(), d.y.get(), ctx.get()}, ew, st);
    EXPECT_TRUE(ctx->saved());
    backward(*ws, BackwardArgs{d.x.get(), d.w.get(), ddy.get(), dx.get(), dtopk.get(), ctx.get()}, ew, gb.grads(), st);
    ws->check();
    EXPECT_FALSE(ctx->saved());
    expect_invalid(ctx.get(), "already consumed");
    // deferring needs a kDeferredWgrad context; backward_weight_grads a deferred backward
    {
      schedule(*ws, d.idx.get(), st);
      forward(*ws, ForwardArgs{d.x.get(), d.w.get(), d.y.get(), ctx.get()}, ew, st);
      BackwardArgs ba{d.x.get(), d.w.get(), ddy.get(), dx.get(), dtopk.get(), ctx.get()};
      ba.defer_weight_grads = true;
      EXPECT_THROW(backward(*ws, ba, ew, gb.grads(), st), Error);
      EXPECT_THROW(backward_weight_grads(*ws, ba, gb.grads(), st), Error);
      ba.defer_weight_grads = false;
      backward(*ws, ba, ew, gb.grads(), st);
      ws->check();
    }
    // recompute_forward_context needs room for the activations
    auto routing = Context::create(*ws, st, Context::Keep::kRoutingOnly);
    EXPECT_LT(routing->bytes(), ctx->bytes());
    schedule(*ws, d.idx.get(), st);
    forward(*ws, ForwardArgs{d.x.get(), d.w.get(), d.y.get(), routing.get()}, ew, st);
    EXPECT_FALSE(routing->has_activations());
    EXPECT_THROW(recompute_forward_context(*ws, ForwardArgs{d.x.get(), d.w.get(), nullptr, routing.get()}, ew, st),
                 Error);
    backward(*ws, BackwardArgs{d.x.get(), d.w.get(), ddy.get(), dx.get(), dtopk.get(), routing.get()}, ew, gb.grads(),
             st);
    ws->check();
    // caller memory: too small and misaligned are refused, enough is taken
    comm::DeviceBuffer<char> mem(Context::bytes(s, bwd_config(s)) + 256);
    EXPECT_THROW(Context::create(*ws, mem.get(), Context::bytes(s, bwd_config(s)) - 1), Error);
    EXPECT_THROW(Context::create(*ws, mem.get() + 16, Context::bytes(s, bwd_config(s))), Error);
    auto external = Context::create(*ws, mem.get(), mem.bytes());
    EXPECT_EQ(external->bytes(), Context::bytes(s, bwd_config(s)));
  });
}

// Non-finite router weights are bad input in the backward too: a clear error, NaN dx.
TEST(BackwardErrors, NonFiniteRouterWeightIsAnErrorAndPoisonsDx) {
  MOK_REQUIRE_RANKS(1);
  const BwdCase& c = bwd_cases()[1];
  const LayerShape s = with_ep(c.shape, 1);
  Problem p = make_problem(s, c.pattern, 101);
  const auto dy = make_dy(s, 102);
  RankPool::get(1).run([&](bootstrap::LocalRank& r) {
    RankData d = upload_rank(p, r.rank);
    comm::DeviceBuffer<bf16> ddy = upload_bf16(dy[0].data(), dy[0].size());
    comm::DeviceBuffer<bf16> dx(size_t(s.tokens) * s.hidden);
    comm::DeviceBuffer<float> dtopk(size_t(s.tokens) * s.topk);
    std::vector<float> bad = p.inputs.topk_w[0];
    bad[5 * s.topk] = NAN;
    comm::DeviceBuffer<float> dbad = upload(bad.data(), bad.size());
    cudaStream_t st = rank_stream();
    auto ws = create_workspace(s, bwd_config(s), r);
    GradBuffers gb(s, GradMode::kWriteBf16);
    const ExpertWeights ew = d.weights();
    schedule(*ws, d.idx.get(), st);
    forward(*ws, ForwardArgs{d.x.get(), d.w.get(), d.y.get()}, ew, st);
    ws->check();
    backward(*ws, BackwardArgs{d.x.get(), dbad.get(), ddy.get(), dx.get(), dtopk.get()}, ew, gb.grads(), st);
    try {
      ws->check();
      ADD_FAILURE() << "expected kInvalidArgument for the NaN router weight";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("topk_w[token 5, k 0]"), std::string::npos) << e.what();
    }
    const auto got = get_bits(dx.get(), dx.size());
    for (size_t i = 0; i < got.size(); ++i) ASSERT_TRUE(std::isnan(ref::from_bf16(got[i]))) << "dx[" << i << "]";
  });
}

// A training step (schedule, forward, backward) captured in a CUDA graph replays with the bits of
// eager calls, at EP 1 and 2, with new inputs copied into the captured buffers before each replay
// (inputs A, B, A, B) and rank 1 held back before each replay: a barrier must wait anew on every
// replay (its rounds are counted on the device). Were a barrier's epoch fixed at capture, rank 0
// would pass it at once from the second replay on and pull rank 1's stale x and routing table.
__global__ void spin_for_ns(uint64_t ns) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

TEST(BackwardGraphReplay, CapturedStepReplaysWithTheEagerBits) {
  MOK_REQUIRE_RANKS(1);
  for (int ep : {1, 2}) {
    if (!can_run_ep(ep)) continue;
    const LayerShape s = with_ep(bwd_cases()[0].shape, ep);
    const Problem a = make_problem(s, Pattern::kUniform, 301);
    Problem b = make_problem(s, Pattern::kOneExpert, 401);
    b.weights = a.weights;  // the captured weights stay; the inputs and routing change
    const auto dy_a = make_dy(s, 302), dy_b = make_dy(s, 402);
    RunOptions ro;
    ro.mode = GradMode::kWriteBf16;
    const auto expect_a = run_backward(a, dy_a, bwd_config(s), ro);
    const auto expect_b = run_backward(b, dy_b, bwd_config(s), ro);
    constexpr int kReplays = 4;
    std::vector<std::vector<RankGrads>> got(kReplays, std::vector<RankGrads>(s.ep));
    RankPool::get(s.ep).run([&](bootstrap::LocalRank& r) {
      RankData d = upload_rank(a, r.rank);
      comm::DeviceBuffer<bf16> ddy = upload_bf16(dy_a[r.rank].data(), dy_a[r.rank].size());
      comm::DeviceBuffer<bf16> dx(size_t(s.tokens) * s.hidden);
      comm::DeviceBuffer<float> dtopk(size_t(s.tokens) * s.topk);
      cudaStream_t st = rank_stream();
      auto ws = create_workspace(s, bwd_config(s), r);
      auto ctx = Context::create(*ws, st);
      GradBuffers gb(s, GradMode::kWriteBf16, r.rank);
      const ExpertWeights ew = d.weights();
      auto step = [&] {
        gb.poison(st);
        MOK_CUDA_CHECK(cudaMemsetAsync(d.y.get(), 0xFF, d.y.bytes(), st));
        MOK_CUDA_CHECK(cudaMemsetAsync(dx.get(), 0xFF, dx.bytes(), st));
        MOK_CUDA_CHECK(cudaMemsetAsync(dtopk.get(), 0xFF, dtopk.bytes(), st));
        schedule(*ws, d.idx.get(), s.tokens, st);
        forward(*ws, ForwardArgs{d.x.get(), d.w.get(), d.y.get(), ctx.get()}, ew, st);
        backward(*ws, BackwardArgs{d.x.get(), d.w.get(), ddy.get(), dx.get(), dtopk.get(), ctx.get()}, ew,
                 gb.grads(), st);
      };
      step();  // eager warm-up (as every capture needs)
      ws->check();
      cudaGraph_t graph = nullptr;
      MOK_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      step();
      MOK_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
      cudaGraphExec_t exec = nullptr;
      MOK_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      for (int i = 0; i < kReplays; ++i) {
        const Problem& p = i % 2 == 0 ? a : b;
        const auto& dy = i % 2 == 0 ? dy_a : dy_b;
        MOK_CUDA_CHECK(cudaMemcpy(d.x.get(), p.inputs.x[r.rank].data(), d.x.bytes(), cudaMemcpyHostToDevice));
        MOK_CUDA_CHECK(cudaMemcpy(d.idx.get(), p.inputs.topk_idx[r.rank].data(), d.idx.bytes(), cudaMemcpyHostToDevice));
        MOK_CUDA_CHECK(cudaMemcpy(d.w.get(), p.inputs.topk_w[r.rank].data(), d.w.bytes(), cudaMemcpyHostToDevice));
        MOK_CUDA_CHECK(cudaMemcpy(ddy.get(), dy[r.rank].data(), ddy.bytes(), cudaMemcpyHostToDevice));
        RankPool::get(s.ep).barrier();  // every rank's inputs are in place
        if (r.rank == 1) spin_for_ns<<<1, 1, 0, st>>>(50'000'000ull);  // rank 0 reaches each barrier first
        MOK_CUDA_CHECK(cudaGraphLaunch(exec, st));
        MOK_CUDA_CHECK(cudaStreamSynchronize(st));
        ws->check();
        got[i][r.rank] = read_pass(d, dx, dtopk, gb);
        RankPool::get(s.ep).barrier();  // nobody overwrites inputs a slow peer still pulls
      }
      MOK_CUDA_CHECK(cudaGraphExecDestroy(exec));
      MOK_CUDA_CHECK(cudaGraphDestroy(graph));
    });
    for (int i = 0; i < kReplays; ++i) {
      expect_same_bits(got[i], (i % 2 == 0 ? expect_a : expect_b)[0],
                       "ep " + std::to_string(ep) + " replay " + std::to_string(i));
    }
  }
}

}  // namespace
}  // namespace mok::test
