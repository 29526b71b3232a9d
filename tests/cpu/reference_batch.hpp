// One global batch for the reference layer's determinism tests (test_reference_ep_invariance.cpp,
// test_reference_fp8_layer.cpp): random bf16 weights and inputs, top-k routing, split over ep
// ranks on demand, and bitwise comparisons of what D3 makes equal across ep.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "reference/bf16.hpp"
#include "reference/layer.hpp"

namespace mok::ref::layer_test {

using Bits = std::vector<uint16_t>;

// One global batch of `tokens` tokens. Tokens route to distinct experts among the first
// `routed_experts` (0 = all): the others get no token.
struct GlobalBatch {
  int64_t tokens = 512, hidden = 256, inter = 128, shared_inter = 128, experts = 8;
  int topk = 2;
  int64_t routed_experts = 0;
  LayerWeights w;
  Bits x, dy;
  std::vector<int32_t> topk_idx;
  std::vector<float> topk_w;
};

inline Bits random_bits(std::mt19937_64& rng, int64_t n, float scale) {
  std::uniform_real_distribution<float> u(-scale, scale);
  Bits out(n);
  for (auto& b : out) b = to_bf16(u(rng));
  return out;
}

// Fills b's weights, inputs and routing (its dimensions as given) from `seed`.
inline GlobalBatch make_batch(uint64_t seed, GlobalBatch b = {}) {
  std::mt19937_64 rng(seed);
  const int64_t E = b.experts, H = b.hidden, I = b.inter, S = b.shared_inter;
  const int64_t routed = b.routed_experts > 0 ? b.routed_experts : E;
  b.w.gate = random_bits(rng, E * I * H, 0.1f);
  b.w.up = random_bits(rng, E * I * H, 0.1f);
  b.w.down = random_bits(rng, E * H * I, 0.15f);
  b.w.shared_gate = random_bits(rng, S * H, 0.1f);
  b.w.shared_up = random_bits(rng, S * H, 0.1f);
  b.w.shared_down = random_bits(rng, H * S, 0.15f);
  b.x = random_bits(rng, b.tokens * H, 1.0f);
  b.dy = random_bits(rng, b.tokens * H, 1.0f);
  std::uniform_real_distribution<float> weight(0.05f, 1.0f);
  std::vector<int32_t> ids(routed);
  for (int64_t t = 0; t < b.tokens; ++t) {
    std::iota(ids.begin(), ids.end(), 0);
    for (int k = 0; k < b.topk; ++k) {
      std::uniform_int_distribution<int64_t> pick(k, routed - 1);
      std::swap(ids[k], ids[pick(rng)]);
      b.topk_idx.push_back(ids[k]);
      b.topk_w.push_back(weight(rng));
    }
  }
  return b;
}

inline LayerShape shape_for(const GlobalBatch& b, int ep) {
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

// What D3 makes equal across ep: y, dx, d topk_w and the routed weight gradients.
inline void expect_same_ep_invariant(const LayerRun& a, const LayerRun& b, const std::string& what) {
  expect_same_bits(concat(a.fwd.y), concat(b.fwd.y), what + " y");
  expect_same_bits(concat(a.grads.dx), concat(b.grads.dx), what + " dx");
  expect_same_bits(concat(a.grads.dtopk_w), concat(b.grads.dtopk_w), what + " dtopk_w");
  expect_same_bits(a.grads.dgate, b.grads.dgate, what + " dgate");
  expect_same_bits(a.grads.dup, b.grads.dup, what + " dup");
  expect_same_bits(a.grads.ddown, b.grads.ddown, what + " ddown");
}

}  // namespace mok::ref::layer_test
