#include "comm/roles.hpp"

#include <algorithm>
#include <string>

#include "comm/barrier.cuh"
#include "comm/cuda_check.hpp"
#include "comm/roles.cuh"

namespace mok::comm {
namespace {

using Cta = CommCtaConfig;

// One kernel per dispatch mode, so that each copy loop gets the whole 128-register budget of a
// 512-thread CTA (together they spill).
template <bool kDedup>
__global__ void __launch_bounds__(Cta::kThreads, 1)
    dispatch_kernel(const DispatchRole role, const GroupBarrier start) {
  if (!group_barrier(start, gridDim.x, role.peers, role.wait)) return;
  dispatch_pull<kDedup>(role, blockIdx.x, gridDim.x);
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

void launch_dispatch(const DispatchLaunch& l, cudaStream_t stream) {
  check_ctas(l.ctas);
  if (l.counter_words > 0) MOK_CUDA_CHECK(cudaMemsetAsync(l.counters, 0, l.counter_words * sizeof(uint32_t), stream));
  if (l.role.dedup) {
    dispatch_kernel<true><<<l.ctas, Cta::kThreads, 0, stream>>>(l.role, l.start);
  } else {
    dispatch_kernel<false><<<l.ctas, Cta::kThreads, 0, stream>>>(l.role, l.start);
  }
  MOK_CUDA_CHECK(cudaGetLastError());
}

void launch_combine(const CombineLaunch& l, cudaStream_t stream) {
  check_ctas(l.ctas);
  combine_kernel<<<l.ctas, Cta::kThreads, 0, stream>>>(l.role, l.done);
  MOK_CUDA_CHECK(cudaGetLastError());
}

// Resident epilogue blocks per SM (cached per thread, like device_sms).
int epilogue_blocks_per_sm() {
  thread_local int cached_device = -1, cached_blocks = 0;
  int device = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&device));
  if (device != cached_device) {
    MOK_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&cached_blocks, epilogue_kernel, 256, 0));
    cached_device = device;
  }
  return std::max(cached_blocks, 1);
}

void launch_epilogue(const EpilogueRole& role, cudaStream_t stream) {
  const int sms = device_sms();
  const int64_t work = role.tokens * (role.hidden / 8);
  // One wave of resident blocks; the grid-stride loop covers the rest. (A fixed 8 blocks per
  // SM was 1.33 waves at 38 registers per thread, 6 blocks per SM: the last third of the
  // blocks ran alone on part of the GPU.) Each output element is still one thread's fixed
  // fmaf chain over k, so the grid never changes a bit.
  const int64_t blocks =
      std::min<int64_t>((work + 255) / 256, static_cast<int64_t>(sms) * epilogue_blocks_per_sm());
  epilogue_kernel<<<static_cast<unsigned>(std::max<int64_t>(blocks, 1)), 256, 0, stream>>>(role);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void launch_test_wait(const uint64_t* flag, uint64_t expected, const WaitContext& ctx, cudaStream_t stream) {
  test_wait_kernel<<<1, 32, 0, stream>>>(flag, expected, ctx);
  MOK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mok::comm
