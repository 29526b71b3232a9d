// Timing shared by the benchmarks: CUDA events around each run, every rank starting each run
// together (host barrier), warm-up runs dropped, the median reported.
//
// Steady state: an H200 runs these kernels at its ~700 W power cap, and the first launches after
// a lighter phase run at a higher clock (docs/gemm.md, 2026-12-01). Options with a `warm_ms`
// member > 0 (bench_forward's --warm-ms) run the op for about that long after the `warmup` runs,
// before the timed ones, for every measurement alike (ours and cuBLAS), as bench_gemm does.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <vector>

#include "comm/cuda_check.hpp"

namespace mok::bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// The ranks (threads of one process) must run an op the same number of times: the op may wait
// on the other ranks. The steady-state run count is agreed through this slot: the first rank to
// get there proposes ceil(warm_ms / its last warm-up time), every rank reads it, then it is reset.
inline std::atomic<int> g_warm_iters{0};

// Options: any struct with `warmup` and `iters` (and optionally `warm_ms`).
// n variants of one op (op(j), j in [0, n)) compared with each other: their runs are
// interleaved, in A B .. then .. B A order on alternate rounds, after a common warm-up, so every
// variant sees the same clock and temperature. (Timing them one after the other read the second
// 2-10 % slow at the H200's power cap, whichever it was: docs/megakernel.md, 2026-12-01.)
// Returns the median per variant.
template <class Options, class Op>
std::vector<double> time_interleaved_ms(const Options& o, std::barrier<>& sync, cudaStream_t stream, int n, Op op) {
  cudaEvent_t a, b;
  MOK_CUDA_CHECK(cudaEventCreate(&a));
  MOK_CUDA_CHECK(cudaEventCreate(&b));
  auto run_once = [&](int j) {
    MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
    sync.arrive_and_wait();  // every rank starts the iteration together
    MOK_CUDA_CHECK(cudaEventRecord(a, stream));
    op(j);
    MOK_CUDA_CHECK(cudaEventRecord(b, stream));
    MOK_CUDA_CHECK(cudaEventSynchronize(b));
    float x = 0;
    MOK_CUDA_CHECK(cudaEventElapsedTime(&x, a, b));
    return static_cast<double>(x);
  };
  auto round = [&](int r, std::vector<std::vector<double>>* out) {
    for (int q = 0; q < n; ++q) {
      const int j = r % 2 == 0 ? q : n - 1 - q;
      const double x = run_once(j);
      if (out != nullptr) (*out)[j].push_back(x);
    }
  };
  std::vector<std::vector<double>> ms(n);
  for (int i = 0; i < o.warmup; ++i) round(i, i + 1 == o.warmup ? &ms : nullptr);
  if constexpr (requires { o.warm_ms; }) {
    if (o.warm_ms > 0) {
      double last = 0;  // one round's time
      for (const auto& v : ms) last += v.empty() ? 0.0 : v.back();
      const int mine = last > 0 ? static_cast<int>(std::ceil(o.warm_ms / last)) : 1;
      sync.arrive_and_wait();
      int expected = 0;
      g_warm_iters.compare_exchange_strong(expected, std::max(mine, 1));
      sync.arrive_and_wait();
      const int rounds = g_warm_iters.load();
      sync.arrive_and_wait();  // every rank has read the count before anyone resets it
      g_warm_iters.store(0);
      for (int i = 0; i < rounds; ++i) round(i, nullptr);
    }
  }
  for (auto& v : ms) v.clear();
  for (int i = 0; i < o.iters; ++i) round(i, &ms);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::vector<double> med;
  for (const auto& v : ms) med.push_back(median(v));
  return med;
}

// One op (time_interleaved_ms with a single variant): `warmup` runs, the steady-state runs, then
// the median of `iters` timed runs.
template <class Options, class Op>
double time_ms(const Options& o, std::barrier<>& sync, cudaStream_t stream, Op op) {
  return time_interleaved_ms(o, sync, stream, 1, [&](int) { op(); })[0];
}

}  // namespace mok::bench
