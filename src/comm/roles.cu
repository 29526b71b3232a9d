#include "comm/roles.hpp"

#include <algorithm>
#include <string>

#include "comm/barrier.cuh"
#include "comm/cuda_check.hpp"
#include "comm/roles.cuh"

namespace mok::comm {
namespace {

using Cta = CommCtaConfig;

__global__ void __launch_bounds__(Cta::kThreads, 1) dispatch_kernel(const DispatchRole role, const GroupBarrier start) {
  if (!group_barrier(start, gridDim.x, role.peers, role.wait)) return;
  dispatch_pull(role, blockIdx.x, gridDim.x);
}

__global__ void __launch_bounds__(Cta::kThreads, 1) combine_kernel(const CombineRole role, const GroupBarrier done) {
  combine_push(role, blockIdx.x, gridDim.x);
  group_barrier(done, gridDim.x, role.peers, role.wait);
}

__global__ void __launch_bounds__(256) epilogue_kernel(const EpilogueRole role) {
  topk_sum_epilogue(role, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                    static_cast<int64_t>(gridDim.x) * blockDim.x);
}

__global__ void test_wait_kernel(const uint64_t* flag, uint64_t expected, const WaitContext ctx) {
  if (threadIdx.x == 0) wait_geq<Scope::kSystem>(flag, expected, WaitSite::kTest, ctx);
}

// SMs of the current device (cached per thread: launches stay cheap).
int device_sms() {
  thread_local int cached_device = -1, cached_sms = 0;
  int device = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&device));
  if (device != cached_device) {
    MOK_CUDA_CHECK(cudaDeviceGetAttribute(&cached_sms, cudaDevAttrMultiProcessorCount, device));
    cached_device = device;
  }
  return cached_sms;
}

void check_ctas(int ctas) {
  // The comm CTAs wait on each other (group barrier, dedup tiles): they must all be resident.
  // One 512-thread CTA per SM always fits, so at most one per SM.
  const int sms = device_sms();
  if (ctas < 1 || ctas > sms) {
    throw_invalid("communication CTAs", "a count in [1, " + std::to_string(sms) + "] (SMs of the device)",
                  std::to_string(ctas));
  }
}

}  // namespace

void launch_dispatch(const DispatchLaunch& l, cudaStream_t stream) {
  check_ctas(l.ctas);
  if (l.counter_words > 0) MOK_CUDA_CHECK(cudaMemsetAsync(l.counters, 0, l.counter_words * sizeof(uint32_t), stream));
  dispatch_kernel<<<l.ctas, Cta::kThreads, 0, stream>>>(l.role, l.start);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void launch_combine(const CombineLaunch& l, cudaStream_t stream) {
  check_ctas(l.ctas);
  combine_kernel<<<l.ctas, Cta::kThreads, 0, stream>>>(l.role, l.done);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void launch_epilogue(const EpilogueRole& role, cudaStream_t stream) {
  const int sms = device_sms();
  const int64_t work = role.tokens * (role.hidden / 8);
  const int64_t blocks = std::min<int64_t>((work + 255) / 256, static_cast<int64_t>(sms) * 8);
  epilogue_kernel<<<static_cast<unsigned>(std::max<int64_t>(blocks, 1)), 256, 0, stream>>>(role);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void launch_test_wait(const uint64_t* flag, uint64_t expected, const WaitContext& ctx, cudaStream_t stream) {
  test_wait_kernel<<<1, 32, 0, stream>>>(flag, expected, ctx);
  MOK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mok::comm
