// The GPU forward (mok::schedule + mok::forward) against the CPU reference, on 1 and 2 GPUs:
// accuracy within the numerics tolerance on fresh random inputs with y poisoned first, and
// the determinism contract bitwise: D1 (repeats), D2 (knobs), D3 (ep = 1 vs 2), plus the
// error paths (capacity overflow, bad expert id) that must poison y and raise mok::Error.
// mok::forward runs the fused engine (Config::forward_engine's default); FusedVsStaged asserts
// that the staged engine gives the same bits in y and in the saved context (g, u of every routed
// and shared row), every case at every EP size.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <random>

#include "test_comm_harness.cuh"
#include "test_problem.cuh"
#include "megakernel/fused_forward.hpp"
#include "reference/layer.hpp"

namespace mok::test {
namespace {

// Runs `repeats` forwards per config on every rank; returns y [config][repeat][rank] (bf16 bits).
// y is poisoned (0xFF = NaN) before every pass, so an unwritten element cannot pass.
using Outputs = std::vector<std::vector<std::vector<std::vector<uint16_t>>>>;
Outputs run_gpu(const Problem& p, const std::vector<Config>& configs, int repeats,
                std::optional<ForwardEngine> path = std::nullopt) {
  const LayerShape& s = p.shape;
  Outputs out(configs.size(), std::vector<std::vector<std::vector<uint16_t>>>(repeats, std::vector<std::vector<uint16_t>>(s.ep)));
  RankPool::get(s.ep).run([&](bootstrap::LocalRank& r) {
    RankData d = upload_rank(p, r.rank);
    cudaStream_t stream = rank_stream();
    const ExpertWeights ew = d.weights();
    // This rank's passes so far: when each was launched, when the host calls returned and when
    // it was checked (ms on the harness clock). A failure prints them, which tells a host call
    // that blocked (enqueued late) from kernels that did not start (checked late).
    std::string passes;
    auto stamp = [](double ms) {
      char b[32];
      std::snprintf(b, sizeof b, "%.1f", ms);
      return std::string(b);
    };
    for (size_t c = 0; c < configs.size(); ++c) {
      Config cfg = configs[c];
      if (path) cfg.forward_engine = *path;
      auto ws = create_workspace(s, cfg, r);
      for (int i = 0; i < repeats; ++i) {
        MOK_CUDA_CHECK(cudaMemsetAsync(d.y.get(), 0xFF, d.y.bytes(), stream));
        const double launched = harness_ms();
        schedule(*ws, d.idx.get(), stream);
        forward(*ws, ForwardArgs{d.x.get(), d.w.get(), d.y.get()}, ew, stream);
        const double enqueued = harness_ms();
        passes += " [config " + std::to_string(c) + " pass " + std::to_string(i) + ": launched " + stamp(launched) +
                  ", enqueued " + stamp(enqueued);
        try {
          ws->check();
        } catch (const Error& e) {
          throw Error(e.status(), "config " + std::to_string(c) + ", pass " + std::to_string(i) + ": " + e.what() +
                                      "; this rank's passes (ms):" + passes + ", failed " + stamp(harness_ms()) + "]");
        }
        passes += ", checked " + stamp(harness_ms()) + "]";
        auto& y = out[c][i][r.rank];
        y.resize(d.y.size());
        MOK_CUDA_CHECK(cudaMemcpy(y.data(), d.y.get(), d.y.bytes(), cudaMemcpyDeviceToHost));
      }
    }
  });
  return out;
}

double rel_norm(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = ref::from_bf16(a[i]), y = ref::from_bf16(b[i]);
    if (!std::isfinite(x)) return INFINITY;  // NaN / unwritten never passes
    num += (x - y) * (x - y);
    den += y * y;
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

::testing::AssertionResult same_bits(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes " << a.size() << " vs " << b.size();
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) {
      return ::testing::AssertionFailure() << "first mismatch at element " << i << ": 0x" << std::hex << a[i]
                                           << " vs 0x" << b[i];
    }
  }
  return ::testing::AssertionSuccess();
}

Config default_config(const LayerShape& s) {
  Config c;
  c.capacity = s.ep;  // skewed patterns may send everything to one rank
  return c;
}

struct Case {
  const char* name;
  LayerShape shape;  // ep filled in per test
  Pattern pattern;
};

const std::vector<Case>& cases() {
  static const std::vector<Case> v{
      {"uniform_shared", {300, 256, 128, 128, 8, 2, 1}, Pattern::kUniform},
      {"topk1_no_shared", {200, 128, 192, 0, 4, 1, 1}, Pattern::kUniform},
      {"topk8", {130, 192, 64, 64, 16, 8, 1}, Pattern::kUniform},
      {"one_expert_per_rank", {257, 128, 128, 64, 2, 1, 1}, Pattern::kUniform},
      {"all_to_one_expert", {200, 128, 128, 0, 8, 2, 1}, Pattern::kOneExpert},
      {"empty_experts", {256, 128, 128, 64, 16, 2, 1}, Pattern::kFewExperts},
      // Tails of <= 64 real rows next to full tiles at every ep (~150 x ep rows per expert), three
      // GEMM 1 and two GEMM 2 column blocks, each kind with a partial block (I 320, H 448).
      {"tails_blocks", {300, 448, 320, 128, 8, 4, 1}, Pattern::kUniform},
  };
  return v;
}

// Case `which` on `ep` ranks (E grows with ep where it must stay a multiple of it).
Case case_at(int which, int ep) {
  Case c = cases()[which];
  c.shape.ep = ep;
  if (c.shape.experts % ep) c.shape.experts *= ep;
  return c;
}

class ForwardVsReference : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(ForwardVsReference, MatchesWithinToleranceAndRepeatsBitwise) {
  const auto [ep, which] = GetParam();
  MOK_REQUIRE_RANKS(ep);
  const Case c = case_at(which, ep);
  const Problem p = make_problem(c.shape, c.pattern, 1000 + which * 10 + ep);
  const Config cfg = default_config(c.shape);
  const ref::ForwardResult expect = ref::forward(c.shape, cfg, p.weights, p.inputs);
  const Outputs got = run_gpu(p, {cfg}, 3);
  double total = 0;
  for (int r = 0; r < ep; ++r) {
    const double err = rel_norm(got[0][0][r], expect.y[r]);
    EXPECT_LT(err, 1e-2) << c.name << " rank " << r;
    total += err;
    for (int i = 1; i < 3; ++i) EXPECT_TRUE(same_bits(got[0][i][r], got[0][0][r])) << "D1, repeat " << i;
  }
  // GPU and CPU add in different orders, so some element differs somewhere; one rank's small y
  // (top-1, H 128) can match bit for bit by chance (seen at ep 4 and 8), the whole batch cannot.
  EXPECT_GT(total, 0.0) << c.name << ": GPU y equals the CPU reference bit for bit on every rank (suspicious)";
}

INSTANTIATE_TEST_SUITE_P(Ep, ForwardVsReference,
                         ::testing::Combine(::testing::Values(1, 2, 4, 8), ::testing::Range(0, 7)),
                         [](const auto& info) {
                           return std::string(cases()[std::get<1>(info.param)].name) + "_ep" +
                                  std::to_string(std::get<0>(info.param));
                         });

class ForwardDeterminism : public ::testing::TestWithParam<int> {};

// D1 at length (100 repeats) and D2: comm CTAs, minibatch, macrobatch (the fused forward's ring;
// the staged path keeps every row) and grid size.
TEST_P(ForwardDeterminism, KnobsAndRepeatsGiveIdenticalBits) {
  const int ep = GetParam();
  MOK_REQUIRE_RANKS(ep);
  const LayerShape s{1000, 256, 128, 128, 8, 4, ep};
  const Problem p = make_problem(s, Pattern::kUniform, 77);
  std::vector<Config> configs;
  for (int comm : {8, 16, 32}) {
    Config c = default_config(s);
    c.comm_sms_forward = comm;
    configs.push_back(c);
  }
  Config mb = default_config(s);
  mb.minibatch = 128;
  mb.macrobatch = 256;
  configs.push_back(mb);
  Config grid = default_config(s);
  grid.grid_sms = 40;
  configs.push_back(grid);
  for (int g : {17, 4}) {  // automatic comm SMs fitted to a small grid (4: 6 automatic -> 3)
    Config small = default_config(s);
    small.grid_sms = g;
    configs.push_back(small);
  }
  Config tiny = default_config(s);  // one comm CTA and one GEMM CTA: every wait is on another CTA
  tiny.comm_sms_forward = tiny.comm_sms_backward = 1;
  tiny.grid_sms = 2;
  tiny.minibatch = 256;
  configs.push_back(tiny);
  Config tiny_ring = tiny;  // the same with the macrobatch ring of two minibatches: its waits too
  tiny_ring.minibatch = 128;
  tiny_ring.macrobatch = 256;
  configs.push_back(tiny_ring);
  Config ring3 = default_config(s);  // a ring of three minibatches over the whole grid
  ring3.minibatch = 256;
  ring3.macrobatch = 768;
  configs.push_back(ring3);
  const Outputs base = run_gpu(p, {configs[0]}, 100);
  const Outputs knobs = run_gpu(p, configs, 1);
  for (int r = 0; r < ep; ++r) {
    for (int i = 1; i < 100; ++i) ASSERT_TRUE(same_bits(base[0][i][r], base[0][0][r])) << "D1 repeat " << i;
    for (size_t c = 0; c < configs.size(); ++c) {
      EXPECT_TRUE(same_bits(knobs[c][0][r], base[0][0][r])) << "D2 config " << configs[c].to_string();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ep, ForwardDeterminism, ::testing::Values(1, 2, 4, 8));

// D3: the same global batch (1000 tokens) on ep = 1 and on ep = 2, 4, 8 gives the same y bits.
class ForwardEpInvariance : public ::testing::TestWithParam<int> {};

TEST_P(ForwardEpInvariance, SameGlobalBatchGivesIdenticalBitsAsEp1) {
  const int ep = GetParam();
  MOK_REQUIRE_RANKS(ep);
  const LayerShape s{1000 / ep, 256, 128, 128, 8, 4, ep};
  const Problem p = make_problem(s, Pattern::kUniform, 99);
  const Problem p1 = resplit(p, 1);
  const Outputs y = run_gpu(p, {default_config(p.shape)}, 1);
  const Outputs y1 = run_gpu(p1, {default_config(p1.shape)}, 1);
  std::vector<uint16_t> joined;
  for (int r = 0; r < ep; ++r) joined.insert(joined.end(), y[0][0][r].begin(), y[0][0][r].end());
  EXPECT_TRUE(same_bits(joined, y1[0][0][0]));
}

INSTANTIATE_TEST_SUITE_P(Ep, ForwardEpInvariance, ::testing::Values(2, 4, 8));

// ---- fused == staged, bit for bit, in y and in the saved forward context ------------------------
struct PassBits {
  // g, u: the schedule's padded rows only, or with the macrobatch ring its slots (every slot)
  std::vector<uint16_t> y, g, u, shared_g, shared_u;
  int64_t padded_rows = 0;
  std::vector<int64_t> resident;  // per routed row tile: its row tile in g, u, or -1 (megakernel::resident_tile)
  std::vector<uint16_t> slots;  // [T * K, H]: every (t, k) row, when no row is read in place (the ring)
};

// The fused forward's undecided choices (FusedForwardOptions; all give the same bits):
//   kDefault     the defaults
//   kFusedSum    the top-k sum inside the fused kernel (fused_topk_sum)
//   kNoJoin      no comm CTA takes GEMM tasks (join_gemm = 0; the default joins them all at EP 1)
//   kJoinMost    every comm CTA but one takes GEMM tasks after its dispatch share
//   kPush        GEMM 2's epilogues push the combine's rows (epilogue_push)
//   kPushSum     kPush with the fused top-k sum (a comm CTA counts the pushed rows per token)
//   kRingSum     with the macrobatch ring: the fused top-k sum (every row pushed and counted)
enum class CopyModes { kDefault, kFusedSum, kNoJoin, kJoinMost, kPush, kPushSum, kRingSum };

std::vector<PassBits> run_path(const Problem& p, const Config& cfg, ForwardEngine path,
                               CopyModes modes = CopyModes::kDefault) {
  const LayerShape& s = p.shape;
  std::vector<PassBits> out(s.ep);
  RankPool::get(s.ep).run([&](bootstrap::LocalRank& r) {
    RankData d = upload_rank(p, r.rank);
    Config engine_cfg = cfg;
    engine_cfg.forward_engine = path;  // at creation: a staged workspace keeps every routed row
    auto ws = create_workspace(s, engine_cfg, r);
    megakernel::FusedForwardOptions& fo = ws->impl().fused;
    if (modes == CopyModes::kPush || modes == CopyModes::kPushSum) fo.epilogue_push = 1;
    fo.fused_topk_sum = modes == CopyModes::kFusedSum || modes == CopyModes::kPushSum || modes == CopyModes::kRingSum;
    if (modes == CopyModes::kNoJoin) fo.join_gemm = 0;
    if (modes == CopyModes::kJoinMost) fo.join_gemm = ws->config().effective_comm_sms_forward(s) - 1;
    megakernel::ForwardBuffers& fb = *ws->impl().forward;
    Context::Impl& ctx = ws->impl().own_context->impl();
    for (auto* b : {&fb.g, &fb.u}) {  // the ring's
      if (b->bytes()) MOK_CUDA_CHECK(cudaMemsetAsync(b->get(), 0xFF, b->bytes(), rank_stream()));  // unwritten context cannot pass
    }
    // the saved context (g, u, shared g, u) and the recompute scratch, poisoned: an unwritten one cannot pass
    MOK_CUDA_CHECK(cudaMemsetAsync(ctx.base + ctx.layout.g, 0xFF, ctx.layout.total - ctx.layout.g, rank_stream()));
    for (auto* b : {&ws->impl().backward->shared_g, &ws->impl().backward->shared_u}) {
      if (b->bytes()) MOK_CUDA_CHECK(cudaMemsetAsync(b->get(), 0xFF, b->bytes(), rank_stream()));
    }
    MOK_CUDA_CHECK(cudaMemsetAsync(d.y.get(), 0xFF, d.y.bytes(), rank_stream()));
    const bool all_slots = fb.ring();  // every row pushed into its slot
    const size_t slot_elems = size_t(s.tokens) * s.topk * s.hidden;
    // NOTE: peers write into these slots only after this rank's kernel (after the memset, same
    // stream) opened the pass's first barrier.
    if (all_slots) {
      MOK_CUDA_CHECK(cudaMemsetAsync(const_cast<bf16*>(ws->impl().state->slots()), 0xFF, slot_elems * 2, rank_stream()));
    }
    const ExpertWeights ew = d.weights();
    schedule(*ws, d.idx.get(), rank_stream());
    forward(*ws, ForwardArgs{d.x.get(), d.w.get(), d.y.get()}, ew, rank_stream());
    ws->check();
    comm::ScheduleHeader h{};
    MOK_CUDA_CHECK(cudaMemcpy(&h, ws->impl().state->view().header, sizeof(h), cudaMemcpyDeviceToHost));
    auto get = [](const bf16* src, size_t n) {
      std::vector<uint16_t> v(n);
      if (n) MOK_CUDA_CHECK(cudaMemcpy(v.data(), src, n * 2, cudaMemcpyDeviceToHost));
      return v;
    };
    PassBits& o = out[r.rank];
    o.y = get(d.y.get(), d.y.size());
    const size_t rows = fb.ring() ? size_t(fb.resident_rows) : size_t(h.padded_rows);
    o.padded_rows = h.padded_rows;
    for (int64_t t = 0; t < h.padded_rows / kRowTile; ++t) o.resident.push_back(megakernel::resident_tile(fb, t, h.padded_rows));
    o.g = get(fb.ring() ? fb.g.get() : ctx.saved.g, rows * s.intermediate);
    o.u = get(fb.ring() ? fb.u.get() : ctx.saved.u, rows * s.intermediate);
    // with the ring the context keeps only the routing table: the shared g, u went to the
    // backward's recompute scratch (poisoned below too)
    const bf16* sg = fb.ring() ? ws->impl().backward->shared_g.get() : ctx.saved.shared_g;
    const bf16* su = fb.ring() ? ws->impl().backward->shared_u.get() : ctx.saved.shared_u;
    o.shared_g = get(sg, size_t(s.tokens) * s.shared_intermediate);
    o.shared_u = get(su, size_t(s.tokens) * s.shared_intermediate);
    if (all_slots) o.slots = get(ws->impl().state->slots(), slot_elems);
  });
  return out;
}

class FusedVsStaged : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(FusedVsStaged, SameBitsInOutputAndSavedContext) {
  const auto [ep, which] = GetParam();
  MOK_REQUIRE_RANKS(ep);
  const Case c = case_at(which, ep);
  const Problem p = make_problem(c.shape, c.pattern, 3000 + which * 10 + ep);
  Config cfg = default_config(c.shape);
  cfg.minibatch = 128;  // many minibatches: GEMM2 of one overlaps GEMM1 of the next
  const auto staged = run_path(p, cfg, ForwardEngine::kStaged);
  const auto fused = run_path(p, cfg, ForwardEngine::kFused);
  const auto fused_sum = run_path(p, cfg, ForwardEngine::kFused, CopyModes::kFusedSum);
  const auto fused_no_join = run_path(p, cfg, ForwardEngine::kFused, CopyModes::kNoJoin);
  const auto fused_join_most = run_path(p, cfg, ForwardEngine::kFused, CopyModes::kJoinMost);
  const auto fused_push = run_path(p, cfg, ForwardEngine::kFused, CopyModes::kPush);
  const auto fused_push_sum = run_path(p, cfg, ForwardEngine::kFused, CopyModes::kPushSum);
  // Raster groups aligned to experts: with minibatches of 8 row tiles groups would span experts.
  Config wide_mb = cfg;
  wide_mb.minibatch = 8 * kRowTile;
  const auto fused_wide = run_path(p, wide_mb, ForwardEngine::kFused);
  for (int r = 0; r < ep; ++r) {
    EXPECT_TRUE(same_bits(fused_wide[r].y, staged[r].y)) << c.name << " rank " << r << ": y, 8-tile minibatches";
    EXPECT_TRUE(same_bits(fused_wide[r].g, staged[r].g)) << c.name << " rank " << r << ": saved g, 8-tile minibatches";
    EXPECT_TRUE(same_bits(fused_push_sum[r].y, fused[r].y)) << c.name << " rank " << r << ": y, push + fused sum";
    EXPECT_TRUE(same_bits(fused_push[r].y, fused[r].y)) << c.name << " rank " << r << ": y, GEMM 2 epilogue push";
    EXPECT_TRUE(same_bits(fused_push[r].g, fused[r].g)) << c.name << " rank " << r << ": saved g, push";
    EXPECT_TRUE(same_bits(fused_no_join[r].y, fused[r].y)) << c.name << " rank " << r << ": y, no comm CTA joining";
    EXPECT_TRUE(same_bits(fused_join_most[r].y, fused[r].y)) << c.name << " rank " << r << ": y, all but one joining";
    EXPECT_TRUE(same_bits(fused_join_most[r].g, fused[r].g)) << c.name << " rank " << r << ": saved g, joining";
    EXPECT_TRUE(same_bits(fused_sum[r].y, fused[r].y)) << c.name << " rank " << r << ": y, top-k sum in the fused kernel";
    EXPECT_TRUE(same_bits(fused[r].y, staged[r].y)) << c.name << " rank " << r << ": y";
    EXPECT_TRUE(same_bits(fused[r].g, staged[r].g)) << c.name << " rank " << r << ": saved g";
    EXPECT_TRUE(same_bits(fused[r].u, staged[r].u)) << c.name << " rank " << r << ": saved u";
    EXPECT_TRUE(same_bits(fused[r].shared_g, staged[r].shared_g)) << c.name << " rank " << r << ": shared g";
    EXPECT_TRUE(same_bits(fused[r].shared_u, staged[r].shared_u)) << c.name << " rank " << r << ": shared u";
    bool finite = true;
    for (uint16_t v : fused[r].y) finite &= std::isfinite(ref::from_bf16(v));
    EXPECT_TRUE(finite) << "y holds NaN/Inf";
  }
}

INSTANTIATE_TEST_SUITE_P(Ep, FusedVsStaged, ::testing::Combine(::testing::Values(1, 2, 4, 8), ::testing::Range(0, 7)),
                         [](const auto& info) {
                           return std::string(cases()[std::get<1>(info.param)].name) + "_ep" +
                                  std::to_string(std::get<0>(info.param));
                         });

// Macrobatch (Config::macrobatch below the routed buffer): the fused forward runs its routed
// rows through a ring of that many rows. y keeps its bits, and afterwards the ring holds the
// saved g, u of the last row tiles, bit for bit those of the pass with every row resident. Rings
// of two and three minibatches of one row tile: most tiles reuse a slot, so every ring wait and
// every slot's reuse is exercised.
class ForwardMacrobatch : public ::testing::TestWithParam<std::tuple<int, int>> {};


TEST_P(ForwardMacrobatch, RingGivesTheSameBitsAndKeepsTheLastRowTiles) {
  const auto [ep, which] = GetParam();
  MOK_REQUIRE_RANKS(ep);
  const Case c = case_at(which, ep);
  const Problem p = make_problem(c.shape, c.pattern, 5000 + which * 10 + ep);
  Config cfg = default_config(c.shape);
  cfg.minibatch = 128;
  const auto full = run_path(p, cfg, ForwardEngine::kFused);
  const size_t I = c.shape.intermediate, tile = size_t(kRowTile) * I;
  for (int64_t slots : {2, 3}) {
    Config ring_cfg = cfg;
    ring_cfg.macrobatch = slots * kRowTile;
    ASSERT_LT(ring_cfg.resident_routed_rows(c.shape), cfg.buffer_rows_per_rank(c.shape)) << "no ring: " << c.name;
    const auto ring = run_path(p, ring_cfg, ForwardEngine::kFused);
    // The fused top-k sum on the ring (every row pushed, counted per token by a comm CTA).
    const auto ring_sum = run_path(p, ring_cfg, ForwardEngine::kFused, CopyModes::kRingSum);
    for (int r = 0; r < ep; ++r) {
      const std::string what = std::string(c.name) + " rank " + std::to_string(r) + ", ring of " +
                               std::to_string(slots) + " row tiles";
      EXPECT_TRUE(same_bits(ring[r].y, full[r].y)) << what << ": y";
      EXPECT_TRUE(same_bits(ring_sum[r].slots, ring[r].slots)) << what << ": slots, fused top-k sum";
      EXPECT_FALSE(ring[r].slots.empty()) << what << ": the ring's slots hold every (t, k) row";
      EXPECT_TRUE(same_bits(ring_sum[r].y, full[r].y)) << what << ": y, fused top-k sum";
      EXPECT_TRUE(same_bits(ring_sum[r].g, ring[r].g)) << what << ": saved g, fused top-k sum";
      EXPECT_TRUE(same_bits(ring[r].shared_g, full[r].shared_g)) << what << ": shared g";
      ASSERT_EQ(ring[r].g.size(), size_t(slots) * tile) << what << ": the ring's g holds its slots only";
      const int64_t tiles = full[r].padded_rows / kRowTile;
      ASSERT_EQ(ring[r].resident.size(), size_t(tiles)) << what;
      int resident = 0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t slot = ring[r].resident[t];
        if (slot < 0) continue;  // the ring no longer holds it
        ASSERT_EQ(slot, t % slots) << what << ": row tile " << t;
        ASSERT_GE(t, tiles - slots) << what << ": row tile " << t << " kept although a later tile took its slot";
        const size_t at = size_t(slot) * tile, from = size_t(t) * tile;
        const std::vector<uint16_t> rg(ring[r].g.begin() + at, ring[r].g.begin() + at + tile);
        const std::vector<uint16_t> ru(ring[r].u.begin() + at, ring[r].u.begin() + at + tile);
        const std::vector<uint16_t> fg(full[r].g.begin() + from, full[r].g.begin() + from + tile);
        const std::vector<uint16_t> fu(full[r].u.begin() + from, full[r].u.begin() + from + tile);
        EXPECT_TRUE(same_bits(rg, fg)) << what << ": saved g of row tile " << t;
        EXPECT_TRUE(same_bits(ru, fu)) << what << ": saved u of row tile " << t;
        ++resident;
      }
      EXPECT_EQ(resident, std::min<int64_t>(tiles, slots)) << what;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ep, ForwardMacrobatch,
                         ::testing::Combine(::testing::Values(1, 2, 4, 8), ::testing::Range(0, 7)),
                         [](const auto& info) {
                           return std::string(cases()[std::get<1>(info.param)].name) + "_ep" +
                                  std::to_string(std::get<0>(info.param));
                         });

// The fused forward refuses the workspace's options with kInvalidArgument naming `option`
// (`what`: the value, for the failure message).
void expect_forward_refused(Workspace& ws, const RankData& d, const ExpertWeights& ew, const char* option,
                            const std::string& what) {
  try {
    forward(ws, ForwardArgs{d.x.get(), d.w.get(), d.y.get()}, ew, rank_stream());
    ADD_FAILURE() << "expected mok::Error for " << what;
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(option), std::string::npos) << e.what();
  }
}

// Runs check(ws, d, ew, cfg, s) on one rank with a scheduled fused workspace of a small shape
// (the option-refusal tests below: bad options throw before anything is enqueued). grid_sms:
// Config::grid_sms (0: the default).
template <class Check>
void with_small_fused_workspace(uint64_t seed, Check check, int grid_sms = 0) {
  const LayerShape s{256, 128, 128, 64, 8, 2, 1};
  const Problem p = make_problem(s, Pattern::kUniform, seed);
  Config cfg = default_config(s);
  cfg.grid_sms = grid_sms;
  RankPool::get(1).run([&](bootstrap::LocalRank& r) {
    RankData d = upload_rank(p, r.rank);
    auto ws = create_workspace(s, cfg, r);
    ws->impl().config.forward_engine = ForwardEngine::kFused;
    const ExpertWeights ew = d.weights();
    schedule(*ws, d.idx.get(), rank_stream());
    check(*ws, d, ew, cfg, s);
    ws->check();
  });
}

// A grid the fused kernel cannot keep resident is refused before anything runs.
TEST(FusedForward, RefusesAGridLargerThanTheDevice) {
  MOK_REQUIRE_GPUS(1);
  int sms = 0;
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  with_small_fused_workspace(
      8,
      [](Workspace& ws, const RankData& d, const ExpertWeights& ew, const Config& cfg, const LayerShape&) {
        expect_forward_refused(ws, d, ew, "grid_sms", "grid_sms = " + std::to_string(cfg.grid_sms));
      },
      sms + 1);
}

// A join_gemm beyond the comm CTAs is refused before anything runs, naming the option.
TEST(FusedForward, RefusesAJoinCountBeyondTheCommCtas) {
  MOK_REQUIRE_GPUS(1);
  with_small_fused_workspace(9, [](Workspace& ws, const RankData& d, const ExpertWeights& ew, const Config& cfg,
                                   const LayerShape& s) {
    for (int join : {cfg.effective_comm_sms_forward(s) + 1, -2}) {
      ws.impl().fused.join_gemm = join;
      expect_forward_refused(ws, d, ew, "join_gemm", "join_gemm = " + std::to_string(join));
    }
  });
}

// epilogue_push outside -1..1 is refused before anything runs, naming the option.
TEST(FusedForward, RefusesBadEpiloguePushOptions) {
  MOK_REQUIRE_GPUS(1);
  with_small_fused_workspace(10, [](Workspace& ws, const RankData& d, const ExpertWeights& ew, const Config&,
                                    const LayerShape&) {
    for (int v : {2, -2}) {
      ws.impl().fused.epilogue_push = v;
      expect_forward_refused(ws, d, ew, "epilogue_push", "epilogue_push = " + std::to_string(v));
    }
  });
}

// With the macrobatch ring the options that need every row resident are refused, naming
// them: the staged path, the push switched off; and with the fused top-k sum one comm CTA must
// stay to count the pushed rows (every comm CTA joining is refused).
TEST(FusedForward, MacrobatchRefusesWhatNeedsEveryRow) {
  MOK_REQUIRE_GPUS(1);
  const LayerShape s{1000, 128, 128, 64, 8, 2, 1};
  const Problem p = make_problem(s, Pattern::kUniform, 11);
  Config cfg = default_config(s);
  cfg.minibatch = 128;
  cfg.macrobatch = 256;
  RankPool::get(1).run([&](bootstrap::LocalRank& r) {
    RankData d = upload_rank(p, r.rank);
    auto ws = create_workspace(s, cfg, r);
    ASSERT_TRUE(ws->impl().forward->ring());
    const ExpertWeights ew = d.weights();
    schedule(*ws, d.idx.get(), rank_stream());
    ws->impl().config.forward_engine = ForwardEngine::kStaged;
    expect_forward_refused(*ws, d, ew, "Config.macrobatch", "the staged path on a ring");
    ws->impl().config.forward_engine = ForwardEngine::kFused;
    megakernel::FusedForwardOptions& fo = ws->impl().fused;
    fo.epilogue_push = 0;
    expect_forward_refused(*ws, d, ew, "epilogue_push", "epilogue_push 0 on a ring");
    fo.epilogue_push = -1;
    fo.fused_topk_sum = true;
    fo.join_gemm = cfg.effective_comm_sms_forward(s);
    expect_forward_refused(*ws, d, ew, "join_gemm", "every comm CTA joining with pushed rows to count");
    fo = megakernel::FusedForwardOptions{};
    MOK_CUDA_CHECK(cudaMemsetAsync(d.y.get(), 0xFF, d.y.bytes(), rank_stream()));
    forward(*ws, ForwardArgs{d.x.get(), d.w.get(), d.y.get()}, ew, rank_stream());  // the defaults run
    ws->check();
  });
}

// Errors: the workspace raises mok::Error at check() and y is NaN, never silently wrong.
void expect_forward_error(const Problem& p, const Config& cfg, Status status, const char* fragment) {
  RankPool::get(p.shape.ep).run([&](bootstrap::LocalRank& r) {
    RankData d = upload_rank(p, r.rank);
    auto ws = create_workspace(p.shape, cfg, r);
    const ExpertWeights ew = d.weights();
    schedule(*ws, d.idx.get(), rank_stream());
    forward(*ws, ForwardArgs{d.x.get(), d.w.get(), d.y.get()}, ew, rank_stream());
    try {
      ws->check();
      ADD_FAILURE() << "expected mok::Error containing '" << fragment << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), status) << e.what();
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
    std::vector<uint16_t> y(d.y.size());
    MOK_CUDA_CHECK(cudaMemcpy(y.data(), d.y.get(), d.y.bytes(), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < y.size(); ++i) ASSERT_TRUE(std::isnan(ref::from_bf16(y[i]))) << "y[" << i << "] not poisoned";
  });
}

// At ep = 1 a rank always receives exactly T*K rows, so overflow needs two ranks: every token
// of both ranks routed to rank 0's experts gives rank 0 twice its capacity of 1.0 * T*K.
TEST(ForwardErrors, CapacityOverflowIsAnErrorAndPoisonsY) {
  MOK_REQUIRE_RANKS(2);
  const LayerShape s{256, 128, 128, 0, 8, 2, 2};
  const Problem p = make_problem(s, Pattern::kOneRank, 5);
  Config cfg;
  cfg.capacity = 1.0;
  expect_forward_error(p, cfg, Status::kCapacityOverflow, "capacity");
}

TEST(ForwardErrors, BadExpertIdIsAnErrorAndPoisonsY) {
  MOK_REQUIRE_GPUS(1);
  const LayerShape s{256, 128, 128, 64, 8, 2, 1};
  Problem p = make_problem(s, Pattern::kUniform, 6);
  p.inputs.topk_idx[0][17] = 8;  // E = 8: ids are 0..7
  expect_forward_error(p, default_config(s), Status::kInvalidArgument, "expert");
}

// Non-finite router weights are bad input too (as a bad expert id): kInvalidArgument naming the
// first bad entry, y NaN-poisoned, on both paths; a later pass with finite weights is clean.
TEST(ForwardErrors, NonFiniteRouterWeightIsAnErrorAndPoisonsY) {
  MOK_REQUIRE_GPUS(1);
  const LayerShape s{256, 128, 128, 64, 8, 2, 1};
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    Problem p = make_problem(s, Pattern::kUniform, 12);
    p.inputs.topk_w[0][2 * 3 + 1] = bad;      // token 3, k 1: the one reported
    p.inputs.topk_w[0][2 * 200 + 0] = bad;    // a later one
    expect_forward_error(p, default_config(s), Status::kInvalidArgument, "topk_w[token 3, k 1]");
  }
  Problem p = make_problem(s, Pattern::kUniform, 13);
  p.inputs.topk_w[0][5] = std::numeric_limits<float>::quiet_NaN();
  RankPool::get(1).run([&](bootstrap::LocalRank& r) {
    RankData d = upload_rank(p, r.rank);
    auto ws = create_workspace(s, default_config(s), r);
    const ExpertWeights ew = d.weights();
    for (auto path : {ForwardEngine::kStaged, ForwardEngine::kFused}) {
      ws->impl().config.forward_engine = path;
      schedule(*ws, d.idx.get(), rank_stream());
      forward(*ws, ForwardArgs{d.x.get(), d.w.get(), d.y.get()}, ew, rank_stream());
      EXPECT_THROW(ws->check(), Error) << to_string(path);
    }
    std::vector<float> w = p.inputs.topk_w[0];
    w[5] = 0.25f;  // finite again: the next pass reports nothing and y is finite
    MOK_CUDA_CHECK(cudaMemcpy(d.w.get(), w.data(), w.size() * 4, cudaMemcpyHostToDevice));
    schedule(*ws, d.idx.get(), rank_stream());
    forward(*ws, ForwardArgs{d.x.get(), d.w.get(), d.y.get()}, ew, rank_stream());
    EXPECT_NO_THROW(ws->check());
    std::vector<uint16_t> y(d.y.size());
    MOK_CUDA_CHECK(cudaMemcpy(y.data(), d.y.get(), d.y.bytes(), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < y.size(); ++i) ASSERT_TRUE(std::isfinite(ref::from_bf16(y[i]))) << "y[" << i << "]";
  });
}

}  // namespace
}  // namespace mok::test
