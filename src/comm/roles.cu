#include "comm/roles.hpp"

#include <algorithm>
#include <string>

#include "comm/barrier.cuh"
#include "comm/cuda_check.hpp"
#include "comm/roles_bulk.cuh"

namespace mok::comm {
namespace {

using Cta = CommCtaConfig;

// One kernel per engine, so that each gets its own register allocation (the kWarp copy loop
// keeps its 16 vectors per lane without spills). smem_bytes: dynamic shared memory of the bulk
// engines (role_smem_bytes), 0 for kWarp.
template <CopyEngine E, bool kDedup = false>
__global__ void __launch_bounds__(Cta::kThreads, 1)
    dispatch_kernel(const DispatchRole role, const GroupBarrier start, uint32_t smem_bytes) {
  extern __shared__ __align__(128) char smem[];
  if (!group_barrier(start, gridDim.x, role.peers, role.wait)) return;
  if constexpr (E == CopyEngine::kWarp) {
    dispatch_pull<kDedup>(role, blockIdx.x, gridDim.x);
  } else {
    dispatch_pull_bulk<E>(role, blockIdx.x, gridDim.x, smem, smem_bytes);
  }
}

// Token-major dispatch (DispatchRole::token_major): its own kernel, for the same reason.
__global__ void __launch_bounds__(Cta::kThreads, 1)
    dispatch_land_kernel(const DispatchRole role, const GroupBarrier start) {
  if (!group_barrier(start, gridDim.x, role.peers, role.wait)) return;
  if (role.header->status != static_cast<int32_t>(Status::kOk)) return;
  dispatch_land_warps<StandaloneWarps>(role, blockIdx.x, gridDim.x);
}

template <CopyEngine E>
__global__ void __launch_bounds__(Cta::kThreads, 1)
    combine_kernel(const CombineRole role, const GroupBarrier done, uint32_t smem_bytes) {
  extern __shared__ __align__(128) char smem[];
  if constexpr (E == CopyEngine::kWarp) {
    combine_push(role, blockIdx.x, gridDim.x);
  } else {
    combine_push_bulk<E>(role, blockIdx.x, gridDim.x, smem, smem_bytes);
  }
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

// Dynamic shared memory for a bulk engine: 0 for kWarp (or when the layout does not fit, which
// makes the device role fall back to kWarp); sets the kernel's limit once per thread and device.
template <class Kernel>
uint32_t bulk_smem(CopyEngine engine, const BulkLayout& layout, Kernel kernel, int slot) {
  const uint32_t bytes = role_smem_bytes(engine);
  if (bytes == 0 || layout.bytes == 0) return 0;
  if (layout.bytes > bulk_usable(bytes)) {
    throw Error(Status::kInternal, "mok: bulk-copy shared-memory layout exceeds its budget");
  }
  thread_local int configured[4] = {-1, -1, -1, -1};
  int device = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&device));
  if (configured[slot] != device) {
    MOK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
    configured[slot] = device;
  }
  return bytes;
}

}  // namespace

void launch_dispatch(const DispatchLaunch& l, cudaStream_t stream) {
  check_ctas(l.ctas);
  if (l.counter_words > 0) MOK_CUDA_CHECK(cudaMemsetAsync(l.counters, 0, l.counter_words * sizeof(uint32_t), stream));
  if (l.role.token_major) {
    if (l.role.recv == nullptr || l.role.land_rows == nullptr || l.role.minibatch_rows <= 0) {
      throw Error(Status::kInternal, "mok: token-major dispatch without its receive buffer or landing list");
    }
    dispatch_land_kernel<<<l.ctas, Cta::kThreads, 0, stream>>>(l.role, l.start);
    MOK_CUDA_CHECK(cudaGetLastError());
    return;
  }
  const BulkLayout layout = dispatch_bulk_layout(l.role, bulk_usable(role_smem_bytes(l.role.engine)));
  switch (l.role.engine) {
    case CopyEngine::kHybrid: {
      const uint32_t smem = bulk_smem(l.role.engine, layout, dispatch_kernel<CopyEngine::kHybrid>, 0);
      dispatch_kernel<CopyEngine::kHybrid><<<l.ctas, Cta::kThreads, smem, stream>>>(l.role, l.start, smem);
      break;
    }
    case CopyEngine::kBulk: {
      const uint32_t smem = bulk_smem(l.role.engine, layout, dispatch_kernel<CopyEngine::kBulk>, 1);
      dispatch_kernel<CopyEngine::kBulk><<<l.ctas, Cta::kThreads, smem, stream>>>(l.role, l.start, smem);
      break;
    }
    default:
      if (l.role.dedup) {
        dispatch_kernel<CopyEngine::kWarp, true><<<l.ctas, Cta::kThreads, 0, stream>>>(l.role, l.start, 0);
      } else {
        dispatch_kernel<CopyEngine::kWarp, false><<<l.ctas, Cta::kThreads, 0, stream>>>(l.role, l.start, 0);
      }
  }
  MOK_CUDA_CHECK(cudaGetLastError());
}

void launch_combine(const CombineLaunch& l, cudaStream_t stream) {
  check_ctas(l.ctas);
  const BulkLayout layout = combine_bulk_layout(l.role, bulk_usable(role_smem_bytes(l.role.engine)));
  switch (l.role.engine) {
    case CopyEngine::kHybrid: {
      const uint32_t smem = bulk_smem(l.role.engine, layout, combine_kernel<CopyEngine::kHybrid>, 2);
      combine_kernel<CopyEngine::kHybrid><<<l.ctas, Cta::kThreads, smem, stream>>>(l.role, l.done, smem);
      break;
    }
    case CopyEngine::kBulk: {
      const uint32_t smem = bulk_smem(l.role.engine, layout, combine_kernel<CopyEngine::kBulk>, 3);
      combine_kernel<CopyEngine::kBulk><<<l.ctas, Cta::kThreads, smem, stream>>>(l.role, l.done, smem);
      break;
    }
    default: combine_kernel<CopyEngine::kWarp><<<l.ctas, Cta::kThreads, 0, stream>>>(l.role, l.done, 0);
  }
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
