// A random MoE layer problem over `ep` ranks (weights, inputs, routing) and its upload to one
// rank: shared by the forward and backward GPU tests.
#pragma once

#include <cmath>
#include <random>
#include <vector>

#include "test_comm_harness.cuh"
#include "reference/bf16.hpp"
#include "reference/layer.hpp"

namespace mok::test {

// Device copy of one rank's share of the layer.
struct RankData {
  comm::DeviceBuffer<bf16> x, y, gate, up, down, sgate, sup, sdown;
  comm::DeviceBuffer<int32_t> idx;
  comm::DeviceBuffer<float> w;
  ExpertWeights weights() const {
    return ExpertWeights{gate.get(), up.get(), down.get(), sgate.get(), sup.get(), sdown.get()};
  }
};

template <class T>
comm::DeviceBuffer<T> upload(const T* src, size_t n) {
  comm::DeviceBuffer<T> d(n);
  if (n) MOK_CUDA_CHECK(cudaMemcpy(d.get(), src, n * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
inline comm::DeviceBuffer<bf16> upload_bf16(const uint16_t* src, size_t n) {
  comm::DeviceBuffer<bf16> d(n);
  if (n) MOK_CUDA_CHECK(cudaMemcpy(d.get(), src, n * 2, cudaMemcpyHostToDevice));
  return d;
}

inline std::vector<uint16_t> randn_bf16(size_t n, double stddev, std::mt19937_64& rng) {
  std::normal_distribution<double> d(0.0, stddev);
  std::vector<uint16_t> v(n);
  for (auto& e : v) e = ref::to_bf16(static_cast<float>(d(rng)));
  return v;
}

struct Problem {
  LayerShape shape;
  ref::LayerWeights weights;
  ref::LayerInputs inputs;
};

// Global inputs over `ep` ranks: weights scaled so activations stay O(1).
inline Problem make_problem(const LayerShape& s, Pattern pattern, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Problem p{s, {}, {}};
  const size_t E = s.experts, H = s.hidden, I = s.intermediate, S = s.shared_intermediate;
  p.weights.gate = randn_bf16(E * I * H, 1.0 / std::sqrt(double(H)), rng);
  p.weights.up = randn_bf16(E * I * H, 1.0 / std::sqrt(double(H)), rng);
  p.weights.down = randn_bf16(E * H * I, 1.0 / std::sqrt(double(I)), rng);
  p.weights.shared_gate = randn_bf16(S * H, 1.0 / std::sqrt(double(H)), rng);
  p.weights.shared_up = randn_bf16(S * H, 1.0 / std::sqrt(double(H)), rng);
  p.weights.shared_down = randn_bf16(H * S, S ? 1.0 / std::sqrt(double(S)) : 0.0, rng);
  p.inputs.topk_idx = make_routing(s, pattern, seed + 1);
  std::uniform_real_distribution<float> wd(0.05f, 1.0f);
  for (int r = 0; r < s.ep; ++r) {
    p.inputs.x.push_back(randn_bf16(size_t(s.tokens) * H, 1.0, rng));
    std::vector<float> w(size_t(s.tokens) * s.topk);
    for (auto& v : w) v = wd(rng);
    p.inputs.topk_w.push_back(std::move(w));
  }
  return p;
}

// The same global batch re-split over another EP size (token order preserved).
inline Problem resplit(const Problem& p, int ep) {
  Problem q = p;
  q.shape.ep = ep;
  q.shape.tokens = p.shape.tokens * p.shape.ep / ep;
  const size_t H = p.shape.hidden, K = p.shape.topk, T = q.shape.tokens;
  std::vector<uint16_t> x;
  std::vector<int32_t> idx;
  std::vector<float> w;
  for (int r = 0; r < p.shape.ep; ++r) {
    x.insert(x.end(), p.inputs.x[r].begin(), p.inputs.x[r].end());
    idx.insert(idx.end(), p.inputs.topk_idx[r].begin(), p.inputs.topk_idx[r].end());
    w.insert(w.end(), p.inputs.topk_w[r].begin(), p.inputs.topk_w[r].end());
  }
  q.inputs = {};
  for (int r = 0; r < ep; ++r) {
    q.inputs.x.emplace_back(x.begin() + r * T * H, x.begin() + (r + 1) * T * H);
    q.inputs.topk_idx.emplace_back(idx.begin() + r * T * K, idx.begin() + (r + 1) * T * K);
    q.inputs.topk_w.emplace_back(w.begin() + r * T * K, w.begin() + (r + 1) * T * K);
  }
  return q;
}

inline RankData upload_rank(const Problem& p, int rank) {
  const LayerShape& s = p.shape;
  const size_t per = size_t(s.intermediate) * s.hidden, el = size_t(s.local_experts()), first = rank * el;
  RankData d;
  d.x = upload_bf16(p.inputs.x[rank].data(), p.inputs.x[rank].size());
  d.y = comm::DeviceBuffer<bf16>(size_t(s.tokens) * s.hidden);
  d.gate = upload_bf16(p.weights.gate.data() + first * per, el * per);
  d.up = upload_bf16(p.weights.up.data() + first * per, el * per);
  d.down = upload_bf16(p.weights.down.data() + first * per, el * per);
  d.sgate = upload_bf16(p.weights.shared_gate.data(), p.weights.shared_gate.size());
  d.sup = upload_bf16(p.weights.shared_up.data(), p.weights.shared_up.size());
  d.sdown = upload_bf16(p.weights.shared_down.data(), p.weights.shared_down.size());
  d.idx = upload(p.inputs.topk_idx[rank].data(), p.inputs.topk_idx[rank].size());
  d.w = upload(p.inputs.topk_w[rank].data(), p.inputs.topk_w[rank].size());
  uploads_done();
  return d;
}


}  // namespace mok::test
