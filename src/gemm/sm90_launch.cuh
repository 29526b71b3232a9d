// Host-side launch of one kind of the sm_90a grouped GEMM (nvcc translation units only).
#pragma once

#include <algorithm>
#include <type_traits>

#include "gemm/gemm_host.hpp"
#include "gemm/sm90_grouped_gemm.cuh"
#include "gemm/tile_scheduler.cuh"

namespace mok::gemm::host {

template <class Kind>
void launch_kind(const typename Kind::Params& p, const Launch& launch, cudaStream_t stream) {
  using Cfg = typename Kind::Cfg;
  static_assert(sizeof(SharedStorage<Cfg>) + 1023 <= Cfg::kSmemBytes, "shared storage exceeds the allocation");
  auto* kernel = &sm90_grouped_gemm_kernel<Kind>;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes),
             "cudaFuncSetAttribute(max dynamic shared memory)");
  // Whole clusters only: a grid that is not a multiple of the cluster size is rounded down.
  const int grid = std::max(resolve_grid(launch) / Cfg::kClusterM, 1) * Cfg::kClusterM;
  // Single CTAs launch plainly: a cluster-dimension attribute of 1 measured 4-17% slower
  // (docs/gemm.md v3).
  if (Cfg::kClusterM == 1) {
    kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
    check_cuda(cudaGetLastError(), "grouped GEMM launch");
    return;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(Cfg::kThreads);
  config.dynamicSmemBytes = Cfg::kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = Cfg::kClusterM;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  check_cuda(cudaLaunchKernelEx(&config, kernel, p), "grouped GEMM launch");
}

// Calls fn(std::integral_constant<int, C>) with the cluster size of the launch (default 1:
// measured faster on H200 than 2-CTA clusters with B multicast, docs/gemm.md v3).
template <class Fn>
void with_cluster(const Launch& launch, Fn fn) {
  if (launch.cluster == 2) fn(std::integral_constant<int, 2>{});
  else fn(std::integral_constant<int, 1>{});
}

inline RowScheduler row_scheduler(const Segments& seg, int64_t cols, int tile_cols, int group_m) {
  RowScheduler s;
  s.offsets = seg.offsets;
  s.rows = seg.rows;
  s.experts = seg.experts;
  s.n_tiles = static_cast<int>((cols + tile_cols - 1) / tile_cols);
  s.group_m = group_m;
  s.cluster = 1;  // set by the launcher
  return s;
}

inline ErrorSink error_sink(const Launch& launch) {
  ErrorSink sink{launch.error_flag, timeout_ns(launch)};
#ifdef MOK_GEMM_TRACE
  sink.trace = trace_buffer();
#endif
  return sink;
}

// Checks every row-grouped GEMM (forward, dgrad) makes before it encodes its operands.
inline void check_row_problem(const Segments& seg, const Launch& launch, int64_t hidden, int64_t intermediate) {
  check_segments(seg);
  check_launch(launch);
  check_multiple("hidden", hidden, 64);
  check_multiple("intermediate", intermediate, 64);
}

// Launches a row-grouped kind with the launch's cluster size and error sink.
template <template <int> class Kind, class Params>
void launch_row_kind(Params& p, const Launch& launch, cudaStream_t stream) {
  p.err = error_sink(launch);
  with_cluster(launch, [&](auto c) {
    p.sched.cluster = c;
    launch_kind<Kind<c>>(p, launch, stream);
  });
}

}  // namespace mok::gemm::host
