// `mok soak`: training steps of a mid-size layer on every local GPU (EP = the GPUs) with fresh
// random routing every step, cycling through uniform, Zipf-skewed (s = 1.2), all tokens to one
// expert, and empty experts (only every 4th expert routed to). Each step runs schedule + forward +
// backward twice on the same inputs, once on the fused forward and backward and once on the staged
// ones (Config::forward_engine / backward_engine), and compares
// y, dx, d topk_w and every weight gradient bit for bit. Every other cycle of the four patterns
// the call carries fewer tokens than the workspace (ragged T, drawn per step). Counts the steps with a mismatch and the
// errors (any mok::Error from Workspace::check()); exit status 1 when either is not zero.
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_record.hpp"
#include "cli.hpp"
#include "comm/cuda_check.hpp"
#include "comm/device_buffer.hpp"
#include "host/workspace_impl.hpp"
#include "support/bench_support.hpp"
#include "mok/api.hpp"
#include "mok/bootstrap.hpp"

namespace mok::cli {
namespace {

const char* kPatterns[] = {"uniform", "zipf", "one_expert", "empty_experts"};

// Routing of every rank for one step: K distinct experts per token drawn by `pattern`.
std::vector<std::vector<int32_t>> soak_routing(const LayerShape& s, int pattern, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> weight(s.experts, 1.0);
  if (pattern == 1) {
    for (int64_t e = 0; e < s.experts; ++e) weight[e] = 1.0 / std::pow(double(e + 1), 1.2);
    std::shuffle(weight.begin(), weight.end(), rng);  // the hot experts anywhere, any rank
  } else if (pattern == 3) {
    for (int64_t e = 0; e < s.experts; ++e) weight[e] = e % 4 == 0 ? 1.0 : 0.0;
  }
  std::vector<std::vector<int32_t>> idx(s.ep, std::vector<int32_t>(s.tokens * s.topk));
  for (int r = 0; r < s.ep; ++r) {
    for (int64_t t = 0; t < s.tokens; ++t) {
      std::vector<double> w = weight;
      int k = 0;
      if (pattern == 2) {  // expert 0 in every token
        idx[r][t * s.topk] = 0;
        w[0] = 0.0;
        k = 1;
      }
      for (; k < s.topk; ++k) {
        std::discrete_distribution<int> pick(w.begin(), w.end());
        const int e = pick(rng);
        idx[r][t * s.topk + k] = e;
        w[e] = 0.0;  // distinct within the token
      }
    }
  }
  return idx;
}

struct PassOut {
  comm::DeviceBuffer<bf16> y, dx;
  comm::DeviceBuffer<float> dtopk;
  comm::DeviceBuffer<bf16> gate, up, down, sgate, sup, sdown;  // weight gradients, written bf16
  PassOut(const LayerShape& s)
      : y(size_t(s.tokens) * s.hidden),
        dx(size_t(s.tokens) * s.hidden),
        dtopk(size_t(s.tokens) * s.topk),
        gate(size_t(s.local_experts()) * s.intermediate * s.hidden),
        up(gate.size()),
        down(gate.size()),
        sgate(size_t(s.shared_intermediate) * s.hidden),
        sup(sgate.size()),
        sdown(sgate.size()) {}
  WeightGrads grads() {
    return WeightGrads{GradMode::kWriteBf16, gate.get(), up.get(), down.get(), sgate.get(), sup.get(), sdown.get()};
  }
};

// Elements that differ between two passes' outputs (bitwise; d topk_w compared as 16-bit halves).
int64_t differences(PassOut& a, PassOut& b, cudaStream_t st) {
  int64_t n = 0;
  for (auto [x, y] : {std::pair{&a.y, &b.y}, {&a.dx, &b.dx}, {&a.gate, &b.gate}, {&a.up, &b.up}, {&a.down, &b.down},
                      {&a.sgate, &b.sgate}, {&a.sup, &b.sup}, {&a.sdown, &b.sdown}}) {
    if (x->size()) n += bench::count_mismatches(x->get(), y->get(), x->size(), st);
  }
  n += bench::count_mismatches(reinterpret_cast<const bf16*>(a.dtopk.get()),
                                    reinterpret_cast<const bf16*>(b.dtopk.get()), 2 * a.dtopk.size(), st);
  return n;
}

}  // namespace

int run_soak(const Options& opts) {
  const int64_t steps = opts.integer("steps", 1, 10000000);
  const int64_t log_every = opts.integer("log-every", 1, 10000000);
  const uint64_t seed = static_cast<uint64_t>(opts.integer("seed", 0, INT64_MAX));
  const std::string out = opts.str("out");
  const int gpus = bootstrap::local_device_count();
  if (gpus < 1) throw Error(Status::kCudaError, "mok soak: no CUDA GPU visible (it compares the GPU paths)");
  LayerShape shape{opts.integer("tokens", 128, 1 << 20), 1024, 512, 512, 32, 4, gpus};
  Config config;
  config.capacity = shape.ep;  // skewed routing may send every row to one rank: never an overflow
  config.validate(shape);
  std::printf("mok soak: %s, %lld steps, routing per step cycling %s / %s / %s / %s (fresh each step), fused vs "
              "staged forward and backward, every output compared bit for bit\n",
              shape.to_string().c_str(), static_cast<long long>(steps), kPatterns[0], kPatterns[1], kPatterns[2],
              kPatterns[3]);
  std::printf("  every other cycle of the patterns a ragged call: T drawn in [1, %lld] (the same on every rank, outputs poisoned first)\n",
              static_cast<long long>(shape.tokens));
  std::fflush(stdout);
  std::mutex mu;
  int64_t mismatches = 0, errors = 0;
  std::string first_error;
  std::barrier<> sync(gpus);
  bootstrap::run_local_ranks(bootstrap::all_local_devices(), [&](bootstrap::LocalRank& r) {
    auto ws = Workspace::create(shape, config, r.comm, r.device);
    auto ctx = Context::create(*ws, cudaStream_t{nullptr});
    const auto routing0 = soak_routing(shape, 0, seed);
    bench::RandomLayer layer(shape, r.rank, routing0[r.rank], static_cast<uint32_t>(seed) + 7);
    cudaStream_t st;
    MOK_CUDA_CHECK(cudaStreamCreate(&st));
    PassOut fused(shape), staged(shape);
    comm::DeviceBuffer<bf16> dy(size_t(shape.tokens) * shape.hidden);
    const ExpertWeights w = layer.weights();
    for (int64_t step = 0; step < steps; ++step) {
      const int pattern = static_cast<int>(step % 4);
      const auto routing = soak_routing(shape, pattern, seed * 1000003 + step);
      MOK_CUDA_CHECK(cudaMemcpyAsync(layer.topk_idx.get(), routing[r.rank].data(), routing[r.rank].size() * 4,
                                     cudaMemcpyHostToDevice, st));
      const uint32_t salt = static_cast<uint32_t>(step * 131 + r.rank);
      bench::fill_random_bf16(layer.x.get(), layer.x.size(), salt + 1, 1.0f, st);
      bench::fill_random_f32(layer.topk_w.get(), layer.topk_w.size(), salt + 2, 0.05f, 1.0f, st);
      bench::fill_random_bf16(dy.get(), dy.size(), salt + 3, 1e-2f, st);
      // Every other cycle of the patterns: a ragged call of T_call <= T tokens (the same draw on every rank).
      const int64_t call_tokens =
          (step / 4) % 2 == 1 ? 1 + static_cast<int64_t>((seed * 2654435761u + step * 40503u) % shape.tokens) : shape.tokens;
      for (PassOut* o : {&fused, &staged}) {
        for (auto* b : {&o->y, &o->dx}) MOK_CUDA_CHECK(cudaMemsetAsync(b->get(), 0xFF, b->bytes(), st));
        MOK_CUDA_CHECK(cudaMemsetAsync(o->dtopk.get(), 0xFF, o->dtopk.bytes(), st));
      }
      MOK_CUDA_CHECK(cudaStreamSynchronize(st));  // the host routing vector is a stack value
      bool failed = false;
      for (PassOut* o : {&fused, &staged}) {
        ws->impl().config.forward_engine = o == &fused ? ForwardEngine::kFused : ForwardEngine::kStaged;
        ws->impl().config.backward_engine = o == &fused ? BackwardEngine::kFused : BackwardEngine::kStaged;
        try {
          schedule(*ws, layer.topk_idx.get(), call_tokens, st);
          forward(*ws, ForwardArgs{layer.x.get(), layer.topk_w.get(), o->y.get(), ctx.get()}, w, st);
          backward(*ws, BackwardArgs{layer.x.get(), layer.topk_w.get(), dy.get(), o->dx.get(), o->dtopk.get(), ctx.get()},
                   w, o->grads(), st);
          ws->check();
        } catch (const Error& e) {
          failed = true;
          std::lock_guard<std::mutex> lock(mu);
          ++errors;
          if (first_error.empty()) first_error = "step " + std::to_string(step) + ", rank " + std::to_string(r.rank) + ": " + e.what();
        }
      }
      const int64_t diff = failed ? 0 : differences(fused, staged, st);
      {
        std::lock_guard<std::mutex> lock(mu);
        if (diff != 0) ++mismatches;
      }
      sync.arrive_and_wait();
      if (r.rank == 0 && ((step + 1) % log_every == 0 || step + 1 == steps)) {
        std::lock_guard<std::mutex> lock(mu);
        std::printf("  step %lld/%lld (%s): mismatches %lld, errors %lld\n", static_cast<long long>(step + 1),
                    static_cast<long long>(steps), kPatterns[pattern], static_cast<long long>(mismatches),
                    static_cast<long long>(errors));
        std::fflush(stdout);
      }
    }
    MOK_CUDA_CHECK(cudaStreamSynchronize(st));
    sync.arrive_and_wait();  // no rank frees its window while a peer may still read it
    ctx.reset();
    MOK_CUDA_CHECK(cudaStreamDestroy(st));
  });
  std::printf("soak: %lld steps, %lld mismatches, %lld errors%s%s\n", static_cast<long long>(steps),
              static_cast<long long>(mismatches), static_cast<long long>(errors), first_error.empty() ? "" : "; first: ",
              first_error.c_str());
  if (!out.empty()) {
    std::ofstream f(out);
    f << bench::record_envelope("mok soak --steps " + std::to_string(steps) + " --seed " + std::to_string(seed),
                                "[\n  {\"bench\": \"soak\", \"shape\": \"" + shape.to_string() + "\", \"ep\": " +
                                    std::to_string(shape.ep) + ", \"metrics\": {\"steps\": " + std::to_string(steps) +
                                    ", \"mismatches\": " + std::to_string(mismatches) +
                                    ", \"errors\": " + std::to_string(errors) + "}}\n]");
  }
  return mismatches == 0 && errors == 0 ? 0 : 1;
}

}  // namespace mok::cli
