// Timing shared by the benchmarks: CUDA events around each run, every rank starting each run
// together (host barrier), warm-up runs dropped, the median reported.
//
// Steady state: an H200 runs these kernels at its ~700 W power cap, and the first launches after
// a lighter phase run at a higher clock (docs/gemm.md, fifth session). Options with a `warm_ms`
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
template <class Options, class Op>
double time_ms(const Options& o, std::barrier<>& sync, cudaStream_t stream, Op op) {
  cudaEvent_t a, b;
  MOK_CUDA_CHECK(cudaEventCreate(&a));
  MOK_CUDA_CHECK(cudaEventCreate(&b));
  auto run_once = [&] {
    MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
    sync.arrive_and_wait();  // every rank starts the iteration together
    MOK_CUDA_CHECK(cudaEventRecord(a, stream));
    op();
    MOK_CUDA_CHECK(cudaEventRecord(b, stream));
    MOK_CUDA_CHECK(cudaEventSynchronize(b));
    float x = 0;
    MOK_CUDA_CHECK(cudaEventElapsedTime(&x, a, b));
    return static_cast<double>(x);
  };
  double last = 0;
  for (int i = 0; i < o.warmup; ++i) last = run_once();
  if constexpr (requires { o.warm_ms; }) {
    if (o.warm_ms > 0) {
      const int mine = last > 0 ? static_cast<int>(std::ceil(o.warm_ms / last)) : 1;
      sync.arrive_and_wait();
      int expected = 0;
      g_warm_iters.compare_exchange_strong(expected, std::max(mine, 1));
      sync.arrive_and_wait();
      const int n = g_warm_iters.load();
      sync.arrive_and_wait();  // every rank has read the count before anyone resets it
      g_warm_iters.store(0);
      for (int i = 0; i < n; ++i) run_once();
    }
  }
  std::vector<double> ms;
  for (int i = 0; i < o.iters; ++i) ms.push_back(run_once());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(ms);
}

}  // namespace mok::bench
