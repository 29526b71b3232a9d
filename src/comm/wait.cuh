// Flags and the ONE wait helper of mok (STYLE §5). Every spin-wait across CTAs or GPUs goes
// through wait_geq(): it gives up after a clock-based timeout, records rank, SM, site,
// expected and observed value in the rank's DeviceErrorRecord and returns false. It never hangs.
#pragma once

#include <cuda/atomic>

#include <cstdint>

#include "comm/error_record.hpp"
#include "comm/sync_types.hpp"

namespace mok::comm {

enum class Scope { kGpu, kSystem };

template <Scope S>
struct CudaScope;
template <>
struct CudaScope<Scope::kGpu> {
  static constexpr cuda::thread_scope value = cuda::thread_scope_device;
};
template <>
struct CudaScope<Scope::kSystem> {
  static constexpr cuda::thread_scope value = cuda::thread_scope_system;
};

template <Scope S, class T>
__device__ __forceinline__ T load_acquire(const T* p) {
  cuda::atomic_ref<T, CudaScope<S>::value> ref(*const_cast<T*>(p));
  return ref.load(cuda::memory_order_acquire);
}

template <Scope S, class T>
__device__ __forceinline__ void store_release(T* p, T v) {
  cuda::atomic_ref<T, CudaScope<S>::value> ref(*p);
  ref.store(v, cuda::memory_order_release);
}

template <Scope S, class T>
__device__ __forceinline__ T fetch_add_release(T* p, T v) {
  cuda::atomic_ref<T, CudaScope<S>::value> ref(*p);
  return ref.fetch_add(v, cuda::memory_order_release);
}

template <Scope S, class T>
__device__ __forceinline__ T fetch_add_acq_rel(T* p, T v) {
  cuda::atomic_ref<T, CudaScope<S>::value> ref(*p);
  return ref.fetch_add(v, cuda::memory_order_acq_rel);
}

__device__ __forceinline__ uint64_t global_time_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ int sm_id() {
  int id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

// First error wins (CAS on code); the winner fills in the details.
__device__ __forceinline__ void record_error(DeviceErrorRecord* rec, int32_t code, int32_t site, int rank,
                                             int64_t expected, int64_t observed) {
  if (atomicCAS(&rec->code, 0, code) != 0) return;
  rec->site = site;
  rec->rank = rank;
  rec->sm = sm_id();
  rec->expected = expected;
  rec->observed = observed;
  __threadfence_system();
}

__device__ __forceinline__ bool timed_out_elsewhere(const DeviceErrorRecord* rec) {
  return load_acquire<Scope::kGpu>(&rec->code) == static_cast<int32_t>(Status::kTimeout);
}

// Spins until *flag >= expected (acquire at scope S). Returns false after ctx.timeout_ns, or
// early when another wait of this rank already timed out (one dead peer must not cost one
// full timeout per waiter). Called by ONE thread; the caller broadcasts the result.
// sleep_ns: the back-off between polls after the first 1024 (waiters that are many and in no
// hurry, such as the fused top-k sum's, poll less often).
template <Scope S, class T>
__device__ bool wait_geq(const T* flag, T expected, WaitSite site, const WaitContext& ctx, uint32_t sleep_ns = 64) {
  T seen = load_acquire<S>(flag);
  if (seen >= expected) return true;
  const uint64_t start = global_time_ns();
  for (uint32_t spin = 0;; ++spin) {
    seen = load_acquire<S>(flag);
    if (seen >= expected) return true;
    if ((spin & 63u) == 63u) {
      if (timed_out_elsewhere(ctx.error)) return false;
      if (global_time_ns() - start > ctx.timeout_ns) {
        record_error(ctx.error, static_cast<int32_t>(Status::kTimeout), static_cast<int32_t>(site), ctx.rank,
                     static_cast<int64_t>(expected), static_cast<int64_t>(seen));
        return false;
      }
    }
    if (spin > 1024) __nanosleep(sleep_ns);
  }
}

}  // namespace mok::comm
