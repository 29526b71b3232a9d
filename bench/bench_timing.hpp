// Timing shared by the benchmarks: CUDA events around each run, every rank starting each run
// together (host barrier), warm-up runs dropped, the median reported.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <barrier>
#include <vector>

#include "comm/cuda_check.hpp"

namespace mok::bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Options: any struct with `warmup` and `iters`.
template <class Options, class Op>
double time_ms(const Options& o, std::barrier<>& sync, cudaStream_t stream, Op op) {
  cudaEvent_t a, b;
  MOK_CUDA_CHECK(cudaEventCreate(&a));
  MOK_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> ms;
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
    sync.arrive_and_wait();  // every rank starts the iteration together
    MOK_CUDA_CHECK(cudaEventRecord(a, stream));
    op();
    MOK_CUDA_CHECK(cudaEventRecord(b, stream));
    MOK_CUDA_CHECK(cudaEventSynchronize(b));
    float x = 0;
    MOK_CUDA_CHECK(cudaEventElapsedTime(&x, a, b));
    if (i >= o.warmup) ms.push_back(x);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(ms);
}

}  // namespace mok::bench
