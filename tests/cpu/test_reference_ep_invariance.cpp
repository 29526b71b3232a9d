// Determinism of the reference (docs/determinism.md), asserted bitwise with memcmp:
//   D3  the same global batch split over ep = 1, 2, 4, 8 ranks gives identical y, dx,
//       d topk_w and routed weight gradients;
//   D1  run to run; thread counts 1, 2, 3; backward from the saved context vs recomputed;
//   D2  knobs (minibatch, macrobatch, capacity) do not change a bit.
// The shared-expert weight gradients are per-rank partial sums (the caller all-reduces them),
// so their sum over ranks is NOT required to match bitwise across ep: it is only checked to
// be close.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "reference/layer.hpp"
#include "reference_batch.hpp"

namespace mok::ref {
namespace {

using namespace layer_test;

LayerRun run_layer(const GlobalBatch& b, int ep, int threads, const Config& base = Config{}, bool recompute = false) {
  const LayerShape s = shape_for(b, ep);
  Config c = base;
  c.capacity = ep;
  LayerInputs in{split(b.x, ep), split(b.topk_idx, ep), split(b.topk_w, ep)};
  LayerRun r;
  r.fwd = forward(s, c, b.w, in, threads);
  r.grads = backward(s, c, b.w, in, split(b.dy, ep), recompute ? nullptr : &r.fwd.ctx, threads);
  return r;
}

// Same ep: everything must match, including the shared partial sums and the saved context.
void expect_same_everything(const LayerRun& a, const LayerRun& b, const std::string& what) {
  expect_same_ep_invariant(a, b, what);
  for (size_t r = 0; r < a.grads.shared_dgate.size(); ++r) {
    expect_same_bits(a.grads.shared_dgate[r], b.grads.shared_dgate[r], what + " shared_dgate");
    expect_same_bits(a.grads.shared_dup[r], b.grads.shared_dup[r], what + " shared_dup");
    expect_same_bits(a.grads.shared_ddown[r], b.grads.shared_ddown[r], what + " shared_ddown");
  }
  ASSERT_EQ(a.fwd.ctx.ranks.size(), b.fwd.ctx.ranks.size());
  for (size_t r = 0; r < a.fwd.ctx.ranks.size(); ++r) {
    expect_same_bits(a.fwd.ctx.ranks[r].g, b.fwd.ctx.ranks[r].g, what + " saved g");
    expect_same_bits(a.fwd.ctx.ranks[r].u, b.fwd.ctx.ranks[r].u, what + " saved u");
    expect_same_bits(a.fwd.ctx.ranks[r].shared_g, b.fwd.ctx.ranks[r].shared_g, what + " saved shared_g");
    expect_same_bits(a.fwd.ctx.ranks[r].shared_u, b.fwd.ctx.ranks[r].shared_u, what + " saved shared_u");
  }
}

std::vector<double> summed(const std::vector<std::vector<float>>& per_rank) {
  std::vector<double> out(per_rank.at(0).size(), 0.0);
  for (const auto& v : per_rank) {
    for (size_t i = 0; i < v.size(); ++i) out[i] += v[i];
  }
  return out;
}

double rel_norm(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / den);
}

TEST(ReferenceDeterminism, EpInvariantBits) {
  const GlobalBatch b = make_batch(1);
  const LayerRun base = run_layer(b, 1, 0);
  for (int ep : {2, 4, 8}) {
    const LayerRun other = run_layer(b, ep, 0);
    expect_same_ep_invariant(other, base, "ep " + std::to_string(ep) + " vs ep 1:");
    // Shared weight gradients: partial sums per rank, equal only up to fp32 rounding.
    EXPECT_LT(rel_norm(summed(other.grads.shared_dgate), summed(base.grads.shared_dgate)), 1e-5);
    EXPECT_LT(rel_norm(summed(other.grads.shared_ddown), summed(base.grads.shared_ddown)), 1e-5);
  }
}

TEST(ReferenceDeterminism, RunToRunAndThreadCountBits) {
  const GlobalBatch b = make_batch(2);
  const LayerRun one = run_layer(b, 2, 1);
  expect_same_everything(run_layer(b, 2, 1), one, "threads 1 run 2 vs run 1:");
  expect_same_everything(run_layer(b, 2, 2), one, "threads 2 vs 1:");
  expect_same_everything(run_layer(b, 2, 3), one, "threads 3 vs 1:");
}

TEST(ReferenceDeterminism, RecomputeEqualsSavedContextBits) {
  const GlobalBatch b = make_batch(3);
  for (int ep : {1, 4}) {
    const LayerRun saved = run_layer(b, ep, 0);
    const LayerRun recomputed = run_layer(b, ep, 0, Config{}, /*recompute=*/true);
    expect_same_everything(recomputed, saved, "ep " + std::to_string(ep) + " recompute vs saved:");
  }
}

TEST(ReferenceDeterminism, KnobsDoNotChangeBits) {
  const GlobalBatch b = make_batch(4);
  const LayerRun base = run_layer(b, 2, 0);
  Config knobs;
  knobs.minibatch = 128;
  knobs.macrobatch = 256;
  knobs.comm_sms_forward = 4;
  knobs.comm_sms_backward = 24;
  expect_same_everything(run_layer(b, 2, 0, knobs), base, "knobs vs defaults:");
}

}  // namespace
}  // namespace mok::ref
