// The layer-run harness of the backward GPU tests (test_backward.cu, test_fp8_layer.cu): small
// shapes, per-rank dy, weight-gradient buffers poisoned before each pass (NaN bits, or a random
// fp32 main grad the pass must add to), schedule + forward + backward on every rank (simulated
// ranks where GPUs are fewer), the outputs read back, bitwise comparisons.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <string>

#include "test_comm_harness.cuh"
#include "test_problem.cuh"
#include "reference/layer.hpp"

namespace mok::test {
namespace {

struct BwdCase {
  const char* name;
  LayerShape shape;  // ep filled in per test
  Pattern pattern;
};

// Small shapes that cover: T not a multiple of 128, top-k 1 and 8, E_local 1, H = 2880, skewed
// routing, empty experts, shared expert on and off.
const std::vector<BwdCase>& bwd_cases() {
  static const std::vector<BwdCase> c = {
      {"T200_top2_shared", LayerShape{200, 256, 128, 128, 8, 2, 1}, Pattern::kUniform},
      {"top1_noshared", LayerShape{256, 128, 128, 0, 8, 1, 1}, Pattern::kUniform},
      {"top8_E16_shared", LayerShape{192, 128, 192, 64, 16, 8, 1}, Pattern::kUniform},
      {"H2880_top4", LayerShape{136, 2880, 256, 0, 8, 4, 1}, Pattern::kUniform},
      {"one_expert_skew", LayerShape{256, 256, 128, 128, 8, 2, 1}, Pattern::kOneExpert},
      {"empty_experts", LayerShape{160, 128, 256, 0, 16, 2, 1}, Pattern::kFewExperts},
  };
  return c;
}

int env_int_or(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

LayerShape with_ep(LayerShape s, int ep) {
  s.ep = ep;
  return s;
}

Config bwd_config(const LayerShape& s) {
  Config c;
  c.capacity = s.ep;  // skewed patterns may send everything to one rank
  return c;
}

// dy of every rank, O(1) values.
std::vector<std::vector<uint16_t>> make_dy(const LayerShape& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<uint16_t>> dy;
  for (int r = 0; r < s.ep; ++r) dy.push_back(randn_bf16(size_t(s.tokens) * s.hidden, 1.0, rng));
  return dy;
}

// One rank's backward outputs as host vectors.
struct RankGrads {
  std::vector<uint16_t> y;  // the forward's output
  std::vector<uint16_t> dx;
  std::vector<float> dtopk_w;
  // routed [E_local, ...] and shared; accumulate mode: the buffer minus its starting value (a
  // function of the element's global index, so equal sums give equal bits at any EP); write
  // mode: the bf16 values widened to float
  std::vector<float> dgate, dup, ddown, sdgate, sdup, sddown;
};

std::vector<float> get_f32(const float* p, size_t n) {
  std::vector<float> v(n);
  if (n) MOK_CUDA_CHECK(cudaMemcpy(v.data(), p, n * 4, cudaMemcpyDeviceToHost));
  return v;
}
std::vector<uint16_t> get_bits(const void* p, size_t n) {
  std::vector<uint16_t> v(n);
  if (n) MOK_CUDA_CHECK(cudaMemcpy(v.data(), p, n * 2, cudaMemcpyDeviceToHost));
  return v;
}

// Weight-gradient buffers of one rank in `mode`. Accumulate mode starts from `base` (a
// deterministic random fp32 value per element, re-uploaded before each pass); write mode from NaN bits.
struct GradBuffers {
  GradMode mode;
  size_t n_routed = 0, n_shared = 0;
  comm::DeviceBuffer<char> gate, up, down, sgate, sup, sdown;
  size_t first = 0;  // global index of this rank's first routed element (the base is a function of it)
  GradBuffers(const LayerShape& s, GradMode m, int rank = 0) : mode(m) {
    const size_t el = size_t(m == GradMode::kWriteBf16 ? 2 : 4);
    n_routed = size_t(s.local_experts()) * s.intermediate * s.hidden;
    n_shared = size_t(s.shared_intermediate) * s.hidden;
    first = size_t(rank) * n_routed;
    for (auto* b : {&gate, &up, &down}) *b = comm::DeviceBuffer<char>(n_routed * el);
    for (auto* b : {&sgate, &sup, &sdown}) *b = comm::DeviceBuffer<char>(n_shared * el);
  }
  static float base_value(size_t i, int which) {
    uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull + which * 0xD1B54A32D192ED03ull;
    h ^= h >> 29;
    return static_cast<float>(static_cast<int64_t>(h % 2001) - 1000) * 1e-4f;
  }
  void poison(cudaStream_t st) {
    int which = 0;
    for (auto* b : {&gate, &up, &down, &sgate, &sup, &sdown}) {
      if (b->bytes() == 0) { ++which; continue; }
      if (mode == GradMode::kWriteBf16) {
        MOK_CUDA_CHECK(cudaMemsetAsync(b->get(), 0xFF, b->bytes(), st));
      } else {
        std::vector<float> v(b->bytes() / 4);
        for (size_t i = 0; i < v.size(); ++i) v[i] = base_value(i + (which < 3 ? first : 0), which);
        MOK_CUDA_CHECK(cudaMemcpyAsync(b->get(), v.data(), b->bytes(), cudaMemcpyHostToDevice, st));
        MOK_CUDA_CHECK(cudaStreamSynchronize(st));
      }
      ++which;
    }
  }
  WeightGrads grads() {
    WeightGrads g{mode, gate.get(), up.get(), down.get(), sgate.bytes() ? sgate.get() : nullptr,
                  sup.bytes() ? sup.get() : nullptr, sdown.bytes() ? sdown.get() : nullptr};
    if (strided) {
      g.gate = gate_up.get();
      g.up = gate_up.get() + per * el();
      g.down = down_padded.get();
      g.gate_expert_stride = g.up_expert_stride = int64_t(2 * per);
      g.down_expert_stride = int64_t(per + kDownPad);
    }
    return g;
  }
  // Hugging Face's layout for the routed gradients: gate and up interleaved per expert in one
  // [E, 2I, H] buffer, down with a padded expert stride. The dense buffers stay the test's view:
  // to_strided() copies them in before the pass, from_strided() back after it.
  static constexpr size_t kDownPad = 64;
  bool strided = false;
  size_t per = 0, experts = 0;
  comm::DeviceBuffer<char> gate_up, down_padded;
  size_t el() const { return mode == GradMode::kWriteBf16 ? 2 : 4; }
  void use_strided(const LayerShape& s) {
    strided = true;
    per = size_t(s.intermediate) * s.hidden;
    experts = size_t(s.local_experts());
    gate_up = comm::DeviceBuffer<char>(experts * 2 * per * el());
    down_padded = comm::DeviceBuffer<char>(experts * (per + kDownPad) * el());
    MOK_CUDA_CHECK(cudaMemset(gate_up.get(), 0xFF, gate_up.bytes()));
    MOK_CUDA_CHECK(cudaMemset(down_padded.get(), 0xFF, down_padded.bytes()));
  }
  void copy_layout(bool in, cudaStream_t st) {
    if (!strided) return;
    const size_t w = per * el();
    auto copy = [&](char* strided_p, size_t pitch, char* dense_p) {
      if (in) {
        MOK_CUDA_CHECK(cudaMemcpy2DAsync(strided_p, pitch, dense_p, w, w, experts, cudaMemcpyDeviceToDevice, st));
      } else {
        MOK_CUDA_CHECK(cudaMemcpy2DAsync(dense_p, w, strided_p, pitch, w, experts, cudaMemcpyDeviceToDevice, st));
      }
    };
    copy(gate_up.get(), 2 * w, gate.get());
    copy(gate_up.get() + w, 2 * w, up.get());
    copy(down_padded.get(), (per + kDownPad) * el(), down.get());
    MOK_CUDA_CHECK(cudaStreamSynchronize(st));
  }
  // The pass's gradient: write mode: the bf16 values; accumulate mode: buffer - base (the added sums
  // up to one fp32 rounding of the add, exact where |base| is small against the sum).
  std::vector<float> read(const comm::DeviceBuffer<char>& b, int which) const {
    const size_t n = b.bytes() / (mode == GradMode::kWriteBf16 ? 2 : 4);
    std::vector<float> out(n);
    if (mode == GradMode::kWriteBf16) {
      const auto bits = get_bits(b.get(), n);
      for (size_t i = 0; i < n; ++i) out[i] = ref::from_bf16(bits[i]);
    } else {
      const auto v = get_f32(reinterpret_cast<const float*>(b.get()), n);
      for (size_t i = 0; i < n; ++i) out[i] = v[i] - base_value(i + (which < 3 ? first : 0), which);
    }
    return out;
  }
  void read_into(RankGrads& g) const {
    g.dgate = read(gate, 0);
    g.dup = read(up, 1);
    g.ddown = read(down, 2);
    g.sdgate = read(sgate, 3);
    g.sdup = read(sup, 4);
    g.sddown = read(sdown, 5);
  }
};

double rel_norm_f(const std::vector<float>& a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}
double rel_norm_bits(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = ref::from_bf16(a[i]), y = ref::from_bf16(b[i]);
    if (!std::isfinite(x)) return INFINITY;
    num += (x - y) * (x - y);
    den += y * y;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

bool same_f32(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
}
bool same_grads(const RankGrads& a, const RankGrads& b) {
  return a.y == b.y && a.dx == b.dx && same_f32(a.dtopk_w, b.dtopk_w) && same_f32(a.dgate, b.dgate) && same_f32(a.dup, b.dup) &&
         same_f32(a.ddown, b.ddown) && same_f32(a.sdgate, b.sdgate) && same_f32(a.sdup, b.sdup) &&
         same_f32(a.sddown, b.sddown);
}

// Every rank's outputs of `got` equal `expect`'s bit for bit (`what` names the case).
void expect_same_bits(const std::vector<RankGrads>& got, const std::vector<RankGrads>& expect, const std::string& what) {
  ASSERT_EQ(got.size(), expect.size()) << what;
  for (size_t r = 0; r < got.size(); ++r) EXPECT_TRUE(same_grads(got[r], expect[r])) << what << " rank " << r;
}
// EP sizes beyond the visible GPUs run as simulated ranks, unless those are switched off.
bool can_run_ep(int ep) { return ep == 1 || simulating_ranks(ep) || gpu_count() >= ep; }

struct RunOptions {
  GradMode mode = GradMode::kAccumulateFp32;
  int repeats = 1;
  // A second layer (other inputs and routing, same shape): its schedule and forward run between
  // this layer's forward and backward, and its backward first.
  const Problem* second = nullptr;
  Context::Keep keep = Context::Keep::kActivations;  // of this layer's context
  bool save_activations = true;                      // ForwardArgs::save_activations
  bool recompute_call = false;                       // recompute_forward_context before the backward
  bool defer = false;  // BackwardArgs::defer_weight_grads, then (after the second layer's backward) backward_weight_grads
  std::function<void(Workspace&)> configure;  // workspace knobs (fused options)
  // Routed weights and their gradients in Hugging Face's layout (gate_up_proj [E, 2I, H]; down
  // with a padded expert stride), through ExpertWeights / WeightGrads expert strides.
  bool strided_experts = false;
  // A workspace sized for more tokens than the problem's (0: the same): every call carries
  // fewer tokens than the workspace (mok::schedule's tokens argument).
  int64_t workspace_tokens = 0;
  // Config::precision kFp8Block: the weights through an Fp8WeightCache updated once before the
  // passes (false: the workspace quantizes them in every call; the same bits).
  bool fp8_cache = false;
};

// One rank's routed weights in the strided layout of RunOptions::strided_experts.
struct StridedWeights {
  comm::DeviceBuffer<bf16> gate_up, down;
  static constexpr size_t kDownPad = 64;
  StridedWeights(const RankData& d, const LayerShape& s) {
    const size_t per = size_t(s.intermediate) * s.hidden, E = size_t(s.local_experts()), w = per * 2;
    gate_up = comm::DeviceBuffer<bf16>(E * 2 * per);
    down = comm::DeviceBuffer<bf16>(E * (per + kDownPad));
    MOK_CUDA_CHECK(cudaMemset(down.get(), 0xFF, down.bytes()));
    MOK_CUDA_CHECK(cudaMemcpy2D(gate_up.get(), 2 * w, d.gate.get(), w, w, E, cudaMemcpyDeviceToDevice));
    MOK_CUDA_CHECK(cudaMemcpy2D(gate_up.get() + per, 2 * w, d.up.get(), w, w, E, cudaMemcpyDeviceToDevice));
    MOK_CUDA_CHECK(cudaMemcpy2D(down.get(), (per + kDownPad) * 2, d.down.get(), w, w, E, cudaMemcpyDeviceToDevice));
  }
  ExpertWeights apply(ExpertWeights ew, const LayerShape& s) const {
    const int64_t per = s.intermediate * s.hidden;
    ew.gate = gate_up.get();
    ew.up = gate_up.get() + per;
    ew.down = down.get();
    ew.gate_expert_stride = ew.up_expert_stride = 2 * per;
    ew.down_expert_stride = per + int64_t(kDownPad);
    return ew;
  }
};

// One rank's outputs of a pass: y, dx, d topk_w and the weight gradients (GradBuffers::read_into).
RankGrads read_pass(const RankData& d, const comm::DeviceBuffer<bf16>& dx, const comm::DeviceBuffer<float>& dtopk,
                    const GradBuffers& gb) {
  RankGrads g;
  g.y = get_bits(d.y.get(), d.y.size());
  g.dx = get_bits(dx.get(), dx.size());
  g.dtopk_w = get_f32(dtopk.get(), dtopk.size());
  gb.read_into(g);
  return g;
}

// Runs schedule + forward + backward `repeats` times per rank; returns [repeat][rank].
std::vector<std::vector<RankGrads>> run_backward(const Problem& p, const std::vector<std::vector<uint16_t>>& dy,
                                                 const Config& cfg, const RunOptions& ro) {
  const LayerShape& s = p.shape;
  std::vector<std::vector<RankGrads>> out(ro.repeats, std::vector<RankGrads>(s.ep));
  RankPool::get(s.ep).run([&](bootstrap::LocalRank& r) {
    RankData d = upload_rank(p, r.rank);
    comm::DeviceBuffer<bf16> ddy = upload_bf16(dy[r.rank].data(), dy[r.rank].size());
    comm::DeviceBuffer<bf16> dx(size_t(s.tokens) * s.hidden);
    comm::DeviceBuffer<float> dtopk(size_t(s.tokens) * s.topk);
    cudaStream_t st = rank_stream();
    LayerShape ws_shape = s;
    if (ro.workspace_tokens > 0) ws_shape.tokens = ro.workspace_tokens;
    auto ws = create_workspace(ws_shape, cfg, r);
    if (ro.configure) ro.configure(*ws);
    GradBuffers gb(s, ro.mode, r.rank);
    if (ro.strided_experts) gb.use_strided(s);
    std::optional<StridedWeights> sw;
    if (ro.strided_experts) sw.emplace(d, s);
    ExpertWeights ew = sw ? sw->apply(d.weights(), s) : d.weights();
    std::unique_ptr<Fp8WeightCache> fp8_cache;
    if (ro.fp8_cache) {
      fp8_cache = Fp8WeightCache::create(*ws, st);
      fp8_cache->update(ew, st);
      ew.fp8 = fp8_cache.get();
    }
    auto ctx_a = Context::create(*ws, st, ro.defer ? Context::Keep::kDeferredWgrad : ro.keep);
    auto ctx_b = Context::create(*ws, st);
    // The second layer's inputs and outputs, allocated before the first pass: with simulated ranks
    // a cudaFree (or any device-wide synchronisation) on one rank's thread between two collective
    // launches waits for the other ranks' kernels, which wait for this rank's next launch: a hang
    // that the barriers' timeout turns into an error (docs/comm.md, simulated ranks).
    struct Second {
      RankData d;
      comm::DeviceBuffer<bf16> dx, ddy;
      comm::DeviceBuffer<float> dtopk;
      GradBuffers gb;
    };
    std::optional<Second> d2;
    if (ro.second != nullptr) {
      const LayerShape& s2 = ro.second->shape;  // its own T (<= the workspace's)
      const auto dy2 = make_dy(s2, 97);
      d2.emplace(Second{upload_rank(*ro.second, r.rank), comm::DeviceBuffer<bf16>(size_t(s2.tokens) * s2.hidden),
                        upload_bf16(dy2[r.rank].data(), dy2[r.rank].size()),
                        comm::DeviceBuffer<float>(size_t(s2.tokens) * s2.topk), GradBuffers(s2, GradMode::kWriteBf16)});
    }
    for (int i = 0; i < ro.repeats; ++i) {
      gb.poison(st);
      gb.copy_layout(true, st);
      MOK_CUDA_CHECK(cudaMemsetAsync(d.y.get(), 0xFF, d.y.bytes(), st));
      MOK_CUDA_CHECK(cudaMemsetAsync(dx.get(), 0xFF, dx.bytes(), st));
      MOK_CUDA_CHECK(cudaMemsetAsync(dtopk.get(), 0xFF, dtopk.bytes(), st));
      schedule(*ws, d.idx.get(), s.tokens, st);
      forward(*ws, ForwardArgs{d.x.get(), d.w.get(), d.y.get(), ctx_a.get(), ro.save_activations}, ew, st);
      if (ro.recompute_call) {
        ws->check();
        EXPECT_FALSE(ctx_a->has_activations());
        recompute_forward_context(*ws, ForwardArgs{d.x.get(), d.w.get(), nullptr, ctx_a.get()}, ew, st);
        EXPECT_TRUE(ctx_a->has_activations());
      }
      BackwardArgs ba{d.x.get(), d.w.get(), ddy.get(), dx.get(), dtopk.get(), ctx_a.get()};
      ba.defer_weight_grads = ro.defer;
      // the second layer: its schedule, forward and backward (every scratch buffer reused)
      auto run_second = [&] {
        if (d2) {
          const ExpertWeights ew2 = d2->d.weights();
          const int64_t t2 = ro.second->shape.tokens;
          schedule(*ws, d2->d.idx.get(), t2, st);
          forward(*ws, ForwardArgs{d2->d.x.get(), d2->d.w.get(), d2->d.y.get(), ctx_b.get()}, ew2, st);
          backward(*ws, BackwardArgs{d2->d.x.get(), d2->d.w.get(), d2->ddy.get(), d2->dx.get(), d2->dtopk.get(),
                                     ctx_b.get()},
                   ew2, d2->gb.grads(), st);
          ws->check();
        }
      };
      if (!ro.defer) run_second();  // between this layer's forward and its backward
      backward(*ws, ba, ew, gb.grads(), st);
      if (ro.defer) {
        ws->check();
        run_second();  // between the backward and its deferred weight gradients
        backward_weight_grads(*ws, ba, gb.grads(), st);
      }
      ws->check();
      gb.copy_layout(false, st);
      out[i][r.rank] = read_pass(d, dx, dtopk, gb);
    }
  });
  return out;
}

// The largest relative norm over the ranks of each gradient (routed and shared weight gradients:
// the largest of their three matrices), as expect_grads_within measured them.
struct GradDistances {
  double dx = 0, dtopk_w = 0, dw = 0, shared_dw = 0;
};

// Every rank's dx, d topk_w and weight gradients (routed: this rank's experts of the global view;
// shared: the rank's partial sums) within `tol` relative norm of `expect`'s; `name` starts the messages.
GradDistances expect_grads_within(const std::string& name, const LayerShape& s, const ref::Gradients& expect,
                                  const std::vector<RankGrads>& got, double tol) {
  const size_t per = size_t(s.intermediate) * s.hidden, el = size_t(s.local_experts());
  GradDistances d;
  auto within = [&](double v, double& worst, const std::string& what) {
    EXPECT_LT(v, tol) << name << " " << what;
    worst = std::max(worst, v);
  };
  for (int r = 0; r < s.ep; ++r) {
    const RankGrads& g = got[r];
    const std::string rank = " rank " + std::to_string(r);
    within(rel_norm_bits(g.dx, expect.dx[r]), d.dx, "dx" + rank);
    within(rel_norm_f(g.dtopk_w, expect.dtopk_w[r].data(), g.dtopk_w.size()), d.dtopk_w, "dtopk_w" + rank);
    const size_t first = r * el * per;
    within(rel_norm_f(g.dgate, expect.dgate.data() + first, el * per), d.dw, "dW_gate" + rank);
    within(rel_norm_f(g.dup, expect.dup.data() + first, el * per), d.dw, "dW_up" + rank);
    within(rel_norm_f(g.ddown, expect.ddown.data() + first, el * per), d.dw, "dW_down" + rank);
    if (s.has_shared()) {
      const size_t n = size_t(s.shared_intermediate) * s.hidden;
      within(rel_norm_f(g.sdgate, expect.shared_dgate[r].data(), n), d.shared_dw, "shared dW_gate" + rank);
      within(rel_norm_f(g.sdup, expect.shared_dup[r].data(), n), d.shared_dw, "shared dW_up" + rank);
      within(rel_norm_f(g.sddown, expect.shared_ddown[r].data(), n), d.shared_dw, "shared dW_down" + rank);
    }
  }
  return d;
}

// D3: the global batch of `p8` (an EP 8 problem) and dy from `dy_seed`, re-split over ep 1, 2, 4, 8
// (those that run here), gives y, dx, d topk_w and the routed weight gradients of ep 1 bit for bit
// (the shared expert's are per-rank partial sums, outside D3). `config` makes each EP's Config.
void expect_ep_split_same_bits(const Problem& p8, uint64_t dy_seed, Config (*config)(const LayerShape&)) {
  std::vector<uint16_t> dy_all;
  for (const auto& v : make_dy(p8.shape, dy_seed)) dy_all.insert(dy_all.end(), v.begin(), v.end());
  RankGrads one;
  for (int ep : {1, 2, 4, 8}) {
    if (!can_run_ep(ep)) continue;
    const Problem p = resplit(p8, ep);
    const LayerShape& s = p.shape;
    std::vector<std::vector<uint16_t>> dy(ep);
    const size_t per = size_t(s.tokens) * s.hidden;
    for (int r = 0; r < ep; ++r) dy[r].assign(dy_all.begin() + r * per, dy_all.begin() + (r + 1) * per);
    const auto got = run_backward(p, dy, config(s), {});
    RankGrads all;
    for (const RankGrads& g : got[0]) {
      all.y.insert(all.y.end(), g.y.begin(), g.y.end());
      all.dx.insert(all.dx.end(), g.dx.begin(), g.dx.end());
      all.dtopk_w.insert(all.dtopk_w.end(), g.dtopk_w.begin(), g.dtopk_w.end());
      all.dgate.insert(all.dgate.end(), g.dgate.begin(), g.dgate.end());
      all.dup.insert(all.dup.end(), g.dup.begin(), g.dup.end());
      all.ddown.insert(all.ddown.end(), g.ddown.begin(), g.ddown.end());
    }
    if (ep == 1) {
      one = all;
      continue;
    }
    EXPECT_EQ(all.y, one.y) << "y, ep " << ep;
    EXPECT_EQ(all.dx, one.dx) << "dx, ep " << ep;
    EXPECT_TRUE(same_f32(all.dtopk_w, one.dtopk_w)) << "d topk_w, ep " << ep;
    EXPECT_TRUE(same_f32(all.dgate, one.dgate)) << "dW_gate, ep " << ep;
    EXPECT_TRUE(same_f32(all.dup, one.dup)) << "dW_up, ep " << ep;
    EXPECT_TRUE(same_f32(all.ddown, one.ddown)) << "dW_down, ep " << ep;
  }
}

}  // namespace
}  // namespace mok::test
