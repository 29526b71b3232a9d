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
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "reference/bf16.hpp"
#include "reference/layer.hpp"

namespace mok::ref {
namespace {

using Bits = std::vector<uint16_t>;

// One global batch of G tokens, split over ranks on demand.
struct GlobalBatch {
  int64_t tokens = 512, hidden = 256, inter = 128, shared_inter = 128, experts = 8;
  int topk = 2;
  LayerWeights w;
  Bits x, dy;
  std::vector<int32_t> topk_idx;
  std::vector<float> topk_w;
};

Bits random_bits(std::mt19937_64& rng, int64_t n, float scale) {
  std::uniform_real_distribution<float> u(-scale, scale);
  Bits out(n);
  for (auto& b : out) b = to_bf16(u(rng));
  return out;
}

GlobalBatch make_batch(uint64_t seed) {
  GlobalBatch b;
  std::mt19937_64 rng(seed);
  const int64_t E = b.experts, H = b.hidden, I = b.inter, S = b.shared_inter;
  b.w.gate = random_bits(rng, E * I * H, 0.1f);
  b.w.up = random_bits(rng, E * I * H, 0.1f);
  b.w.down = random_bits(rng, E * H * I, 0.15f);
  b.w.shared_gate = random_bits(rng, S * H, 0.1f);
  b.w.shared_up = random_bits(rng, S * H, 0.1f);
  b.w.shared_down = random_bits(rng, H * S, 0.15f);
  b.x = random_bits(rng, b.tokens * H, 1.0f);
  b.dy = random_bits(rng, b.tokens * H, 1.0f);
  std::uniform_real_distribution<float> weight(0.05f, 1.0f);
  std::vector<int32_t> ids(E);
  for (int64_t t = 0; t < b.tokens; ++t) {
    std::iota(ids.begin(), ids.end(), 0);
    for (int k = 0; k < b.topk; ++k) {
      std::uniform_int_distribution<int64_t> pick(k, E - 1);
      std::swap(ids[k], ids[pick(rng)]);
      b.topk_idx.push_back(ids[k]);
      b.topk_w.push_back(weight(rng));
    }
  }
  return b;
}

LayerShape shape_for(const GlobalBatch& b, int ep) {
  LayerShape s;
  s.tokens = b.tokens / ep;
  s.hidden = b.hidden;
  s.intermediate = b.inter;
  s.shared_intermediate = b.shared_inter;
  s.experts = b.experts;
  s.topk = b.topk;
  s.ep = ep;
  return s;
}

template <class T>
std::vector<std::vector<T>> split(const std::vector<T>& v, int ep) {
  std::vector<std::vector<T>> out(ep);
  const size_t per = v.size() / ep;
  for (int r = 0; r < ep; ++r) out[r].assign(v.begin() + r * per, v.begin() + (r + 1) * per);
  return out;
}

template <class T>
std::vector<T> concat(const std::vector<std::vector<T>>& v) {
  std::vector<T> out;
  for (const auto& r : v) out.insert(out.end(), r.begin(), r.end());
  return out;
}

struct LayerRun {
  ForwardResult fwd;
  Gradients grads;
};

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

// memcmp with the first mismatching index in the failure message.
template <class T>
void expect_same_bits(const std::vector<T>& a, const std::vector<T>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  if (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0) return;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) {
      FAIL() << what << ": first mismatch at index " << i << " of " << a.size() << ": " << +a[i]
             << " vs " << +b[i];
    }
  }
}

void expect_same_ep_invariant(const LayerRun& a, const LayerRun& b, const std::string& what) {
  expect_same_bits(concat(a.fwd.y), concat(b.fwd.y), what + " y");
  expect_same_bits(concat(a.grads.dx), concat(b.grads.dx), what + " dx");
  expect_same_bits(concat(a.grads.dtopk_w), concat(b.grads.dtopk_w), what + " dtopk_w");
  expect_same_bits(a.grads.dgate, b.grads.dgate, what + " dgate");
  expect_same_bits(a.grads.dup, b.grads.dup, what + " dup");
  expect_same_bits(a.grads.ddown, b.grads.ddown, what + " ddown");
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
