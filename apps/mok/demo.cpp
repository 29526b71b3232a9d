// `mok demo`: a student mok layer learns a fixed random teacher layer (same routing) on
// synthetic tokens with Adam, then the whole training is repeated and compared bit for bit.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <random>

#include "cli.hpp"
#include "gpu_layer.hpp"
#include "mok/api.hpp"
#include "reference/bf16.hpp"
#include "reference/layer.hpp"

namespace mok::cli {
namespace {

using ref::from_bf16;
using ref::to_bf16;

// fp32 master copy of every trainable tensor of the layer, in a fixed order.
struct Params {
  std::vector<std::vector<float>> tensors;  // gate, up, down, shared_gate, shared_up, shared_down
};

std::vector<uint16_t> to_bf16_vec(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = to_bf16(v[i]);
  return out;
}

ref::LayerWeights to_weights(const Params& p) {
  ref::LayerWeights w;
  w.gate = to_bf16_vec(p.tensors[0]);
  w.up = to_bf16_vec(p.tensors[1]);
  w.down = to_bf16_vec(p.tensors[2]);
  w.shared_gate = to_bf16_vec(p.tensors[3]);
  w.shared_up = to_bf16_vec(p.tensors[4]);
  w.shared_down = to_bf16_vec(p.tensors[5]);
  return w;
}

std::vector<float> randn(std::mt19937_64& rng, size_t n, double stddev) {
  std::normal_distribution<double> d(0.0, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(d(rng));
  return v;
}

Params random_params(const LayerShape& s, std::mt19937_64& rng, double scale) {
  const double sh = scale / std::sqrt(double(s.hidden)), si = scale / std::sqrt(double(s.intermediate));
  const double ss = s.has_shared() ? scale / std::sqrt(double(s.shared_intermediate)) : 0.0;
  const size_t E = s.experts, H = s.hidden, I = s.intermediate, S = s.shared_intermediate;
  return Params{{randn(rng, E * I * H, sh), randn(rng, E * I * H, sh), randn(rng, E * H * I, si),
                 randn(rng, S * H, sh), randn(rng, S * H, sh), randn(rng, H * S, ss)}};
}

// The router stays in the user's model: here a fixed random linear router with softmax over
// the top-k logits (ties to the lower expert id).
ref::LayerInputs make_batch(const LayerShape& s, const std::vector<float>& router, std::mt19937_64& rng) {
  ref::LayerInputs in;
  const int64_t T = s.tokens, H = s.hidden, E = s.experts, K = s.topk;
  for (int r = 0; r < s.ep; ++r) {
    std::vector<float> x = randn(rng, T * H, 1.0);
    std::vector<int32_t> idx(T * K);
    std::vector<float> w(T * K);
    std::vector<float> logits(E);
    std::vector<int32_t> order(E);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e) {
        double acc = 0;
        for (int64_t h = 0; h < H; ++h) acc += double(router[e * H + h]) * from_bf16(to_bf16(x[t * H + h]));
        logits[e] = float(acc);
      }
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
      double z = 0;
      for (int64_t k = 0; k < K; ++k) z += std::exp(double(logits[order[k]] - logits[order[0]]));
      for (int64_t k = 0; k < K; ++k) {
        idx[t * K + k] = order[k];
        w[t * K + k] = float(std::exp(double(logits[order[k]] - logits[order[0]])) / z);
      }
    }
    in.x.push_back(to_bf16_vec(x));
    in.topk_idx.push_back(std::move(idx));
    in.topk_w.push_back(std::move(w));
  }
  return in;
}

struct Adam {
  double lr, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  std::vector<std::vector<float>> m, v;
  int64_t step = 0;
  void update(Params& p, const std::vector<const std::vector<float>*>& g) {
    if (m.empty()) {
      for (auto& t : p.tensors) m.emplace_back(t.size(), 0.f), v.emplace_back(t.size(), 0.f);
    }
    ++step;
    const double c1 = 1 - std::pow(b1, double(step)), c2 = 1 - std::pow(b2, double(step));
    for (size_t i = 0; i < p.tensors.size(); ++i) {
      for (size_t j = 0; j < p.tensors[i].size(); ++j) {
        const double gj = (*g[i])[j];
        m[i][j] = float(b1 * m[i][j] + (1 - b1) * gj);
        v[i][j] = float(b2 * v[i][j] + (1 - b2) * gj * gj);
        p.tensors[i][j] -= float(lr * (m[i][j] / c1) / (std::sqrt(v[i][j] / c2) + eps));
      }
    }
  }
};

// Data-parallel all-reduce of the shared-expert weight gradients, in rank order.
std::vector<float> sum_over_ranks(const std::vector<std::vector<float>>& parts) {
  std::vector<float> s(parts.empty() ? 0 : parts[0].size(), 0.f);
  for (const auto& p : parts)
    for (size_t i = 0; i < s.size(); ++i) s[i] += p[i];
  return s;
}

struct RunResult {
  std::vector<double> losses;
  Params student;
};

// One training run. With `gpu`, the forward and the backward run on the GPUs (mok::forward,
// mok::backward over the forward's saved context); without, on the CPU reference.
RunResult train(const LayerShape& shape, const Config& cfg, int64_t steps, int64_t log_every, double lr,
                uint64_t seed, bool gpu, bool verbose) {
  std::unique_ptr<GpuLayer> gpu_layer;
  if (gpu) gpu_layer = std::make_unique<GpuLayer>(shape, cfg);
  std::mt19937_64 rng(seed);
  const Params teacher = random_params(shape, rng, 1.0);
  const ref::LayerWeights teacher_w = to_weights(teacher);
  const std::vector<float> router = randn(rng, shape.experts * shape.hidden, 1.0 / std::sqrt(double(shape.hidden)));
  RunResult run{{}, random_params(shape, rng, 0.5)};
  Adam adam{lr};
  const double n_out = double(shape.global_tokens()) * double(shape.hidden);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t step = 1; step <= steps; ++step) {
    const ref::LayerInputs batch = make_batch(shape, router, rng);
    const ref::LayerWeights w = to_weights(run.student);
    const ref::ForwardResult target = ref::forward(shape, cfg, teacher_w, batch);
    std::optional<ref::ForwardResult> cpu_out;
    std::vector<std::vector<uint16_t>> y;
    if (gpu_layer) {
      y = gpu_layer->forward(w, batch);
    } else {
      cpu_out = ref::forward(shape, cfg, w, batch);
      y = cpu_out->y;
    }
    // loss = mean squared error over every output element of every rank.
    double loss = 0;
    std::vector<std::vector<uint16_t>> dy(shape.ep);
    for (int r = 0; r < shape.ep; ++r) {
      dy[r].resize(y[r].size());
      for (size_t i = 0; i < y[r].size(); ++i) {
        const double d = double(from_bf16(y[r][i])) - double(from_bf16(target.y[r][i]));
        loss += d * d;
        dy[r][i] = to_bf16(float(2.0 * d / n_out));
      }
    }
    loss /= n_out;
    run.losses.push_back(loss);
    const ref::Gradients g =
        gpu_layer ? gpu_layer->backward(dy) : ref::backward(shape, cfg, w, batch, dy, &cpu_out->ctx);
    const std::vector<float> sg = sum_over_ranks(g.shared_dgate), su = sum_over_ranks(g.shared_dup),
                             sd = sum_over_ranks(g.shared_ddown);
    adam.update(run.student, {&g.dgate, &g.dup, &g.ddown, &sg, &su, &sd});
    if (verbose && (step % log_every == 0 || step == 1 || step == steps)) {
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("  step %5lld/%lld  loss %.6f  (%.1f s)\n", static_cast<long long>(step),
                  static_cast<long long>(steps), loss, secs);
      std::fflush(stdout);
    }
  }
  return run;
}

bool bitwise_equal(const RunResult& a, const RunResult& b) {
  if (a.losses.size() != b.losses.size() ||
      std::memcmp(a.losses.data(), b.losses.data(), a.losses.size() * sizeof(double)) != 0) {
    return false;
  }
  for (size_t i = 0; i < a.student.tensors.size(); ++i) {
    const auto &x = a.student.tensors[i], &y = b.student.tensors[i];
    if (x.size() != y.size() || std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) != 0) return false;
  }
  return true;
}

// Which engine computes the layer, and why (printed so the user always knows).
bool choose_gpu(const std::string& engine, std::string& why, int& gpus) {
  const EngineInfo info = engine_info();
  gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) {
    cudaGetLastError();
    gpus = 0;
  }
  const bool gpu_ok = gpus > 0 && info.gpu_forward && info.gpu_backward;
  if (engine == "cpu") {
    why = "CPU reference (--engine cpu)";
    return false;
  }
  if (engine == "gpu" && !gpu_ok) {
    throw Error(Status::kNotImplemented,
                std::string("--engine gpu: ") +
                    (gpus == 0 ? "no CUDA GPU is visible" : "this build has no GPU forward and backward") +
                    "; use --engine cpu or auto");
  }
  if (engine != "gpu" && engine != "auto") throw_invalid("--engine", "auto, cpu or gpu", engine);
  if (gpu_ok) {
    why = "GPU forward and backward (mok::forward, then mok::backward on the GPU over the forward's saved "
          "context: Config's default engines; one GPU per rank)";
    return true;
  }
  why = gpus == 0 ? "CPU reference (no CUDA GPU visible)"
                  : "CPU reference (this build has no GPU forward and backward; " + std::to_string(gpus) +
                        " GPU(s) visible)";
  return false;
}

}  // namespace

int run_demo(const Options& opts) {
  const int64_t steps = opts.integer("steps", 1, 1000000);
  const int64_t log_every = opts.integer("log-every", 1, 1000000);
  const double lr = opts.real("lr", 1e-7, 1.0);
  const uint64_t seed = static_cast<uint64_t>(opts.integer("seed", 0, INT64_MAX));
  std::string why;
  int gpus = 0;
  const bool gpu = choose_gpu(opts.str("engine"), why, gpus);
  // ep: as asked; by default every GPU (one rank each) on the GPU engine, 2 simulated ranks on the CPU.
  int ep = static_cast<int>(opts.integer("ep", 0, kMaxEp));
  if (ep == 0) ep = gpu ? gpus : 2;
  if (gpu && ep > gpus) {
    throw_invalid("--ep", "at most the " + std::to_string(gpus) + " visible GPU(s) on the GPU engine", std::to_string(ep));
  }
  LayerShape shape{opts.integer("tokens", 1, 1 << 20), /*H*/ 128, /*I*/ 64, /*I_shared*/ 64, /*E*/ 8, /*K*/ 2, ep};
  if (shape.experts % shape.ep != 0) shape.experts = shape.ep * std::max<int64_t>(1, 8 / shape.ep);
  Config cfg;
  cfg.capacity = shape.ep;  // the demo's random router is unbalanced: never overflow
  cfg.validate(shape);
  std::printf("mok demo: student MoE layer regressing a fixed random teacher layer\n");
  std::printf("  layer  : %s\n", shape.to_string().c_str());
  std::printf("  engine : %s\n", why.c_str());
  std::printf("  run 1  : %lld steps, Adam lr %g, seed %llu\n", static_cast<long long>(steps), lr,
              static_cast<unsigned long long>(seed));
  const RunResult first = train(shape, cfg, steps, log_every, lr, seed, gpu, true);
  std::printf("  run 2  : same seed, same steps (checking determinism)\n");
  const RunResult second = train(shape, cfg, steps, log_every, lr, seed, gpu, false);
  const bool same = bitwise_equal(first, second);
  std::printf("final loss: %.6f (first step %.6f, %.1fx lower)\n", first.losses.back(), first.losses.front(),
              first.losses.front() / std::max(first.losses.back(), 1e-300));
  std::printf("bitwise identical: %s\n", same ? "yes" : "NO");
  return same ? 0 : 1;
}

}  // namespace mok::cli
