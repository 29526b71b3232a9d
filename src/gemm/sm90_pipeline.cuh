// Synchronisation objects of the sm_90 grouped GEMM: the TMA -> wgmma stage ring (full/empty
// mbarriers with a stage/phase state), named barriers, and the one wait helper with a
// clock-based timeout that every spin-wait uses.
#pragma once

#include <cstdint>

#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

namespace mok::gemm {

// Bits of the error word (GemmLaunch::error_flag). The host reads it after the kernel.
enum ErrorBit : uint32_t {
  kErrorPipelineTimeout = 1u,  // an mbarrier wait exceeded the timeout (a bug, never expected)
  kErrorBadRowRange = 2u,      // wgrad row_begin not a multiple of the K step (64 rows)
};

struct ErrorSink {
  uint32_t* flag;       // device word or nullptr (then a timeout traps)
  uint64_t timeout_ns;  // longest single wait
#ifdef MOK_GEMM_TRACE
  unsigned long long* trace = nullptr;  // per-tile phase clocks (developer build, see below)
#endif
};

// Developer build -DMOK_GEMM_TRACE: the first kTraceCtas CTAs record SM clocks at the phase
// boundaries of each of their tiles (consumer warpgroup 0 and the producer), so a benchmark
// can tell where a tile's time goes. Slots per tile: 0 consumer tile start, 1 seed done,
// 2 first stage acquired, 3 K loop done, 4 epilogue done, 5 producer tile start, 6 producer
// issued the last stage, 7 K steps, 8 producer has the tile's coordinates, 9 producer issued
// the first stage. Without the macro every mark compiles to nothing.
inline constexpr int kTraceCtas = 8, kTraceTiles = 4096, kTraceSlots = 10;
#ifdef MOK_GEMM_TRACE
__device__ inline void trace_mark(const ErrorSink& e, int local_tile, int slot, long long v) {
  if (e.trace != nullptr && blockIdx.x < kTraceCtas && local_tile >= 0 && local_tile < kTraceTiles) {
    e.trace[(static_cast<int>(blockIdx.x) * kTraceTiles + local_tile) * kTraceSlots + slot] =
        static_cast<unsigned long long>(v);
  }
}
#define MOK_GEMM_MARK(err, tile, slot, value) ::mok::gemm::trace_mark((err), (tile), (slot), (value))
// Per-CTA record after the per-tile slots (every CTA, up to kTraceMaxCtas): SM id, global
// time and SM clock at the consumers' start and end, tiles run. It shows whether some SMs
// finish later than others (a static tile list waits for the slowest CTA).
inline constexpr int kTraceMaxCtas = 1024, kTraceCtaSlots = 6;
__device__ inline unsigned smid() {
  unsigned v;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(v));
  return v;
}
__device__ inline void trace_cta(const ErrorSink& e, int slot, unsigned long long v) {
  if (e.trace != nullptr && blockIdx.x < kTraceMaxCtas) {
    e.trace[size_t(kTraceCtas) * kTraceTiles * kTraceSlots + blockIdx.x * kTraceCtaSlots + slot] = v;
  }
}
#define MOK_GEMM_CTA_MARK(err, slot, value) ::mok::gemm::trace_cta((err), (slot), (value))
#else
#define MOK_GEMM_MARK(err, tile, slot, value) ((void)0)
#define MOK_GEMM_CTA_MARK(err, slot, value) ((void)0)
#endif

// NOTE: no printf here: any function call in the kernel makes ptxas serialise wgmma.
__device__ inline void report_error(const ErrorSink& sink, uint32_t bit, const char* /*what*/) {
  if (sink.flag != nullptr) {
    atomicOr(sink.flag, bit);  // integer atomic: signalling only
  } else {
    __trap();
  }
}

__device__ inline uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A timed-out epilogue stage wait (EpilogueRing), reported by the consumer after its tile loop.
// NOTE: no __trap here: the trap of report_error anywhere in the consumer spilled ~700 bytes of
// the dh kind's accumulators (2026-12-04). Without an error flag this wait alone does not trap;
// a stage that never arrives also stops the producer, whose own wait then traps.
__device__ inline void report_timeout_no_trap(const ErrorSink& sink) {
  if (sink.flag != nullptr) atomicOr(sink.flag, kErrorPipelineTimeout);
}

// Waits until the mbarrier phase with parity `phase` completed. Returns false (and records
// kErrorPipelineTimeout) after sink.timeout_ns; the caller then abandons its role so the
// kernel ends instead of hanging. The quiet wait records nothing: its caller reports the
// timeout (report_timeout_no_trap).
__device__ inline bool wait_barrier_quiet(const uint64_t* bar, uint32_t phase, uint64_t timeout_ns) {
  using Barrier = cutlass::arch::ClusterBarrier;
  if (Barrier::try_wait(bar, phase)) return true;
  const uint64_t start = global_timer_ns();
  while (!Barrier::try_wait(bar, phase)) {
    if (global_timer_ns() - start > timeout_ns) return false;
  }
  return true;
}
__device__ inline bool wait_barrier(const uint64_t* bar, uint32_t phase, const ErrorSink& sink) {
  if (wait_barrier_quiet(bar, phase, sink.timeout_ns)) return true;
  report_error(sink, kErrorPipelineTimeout, "pipeline mbarrier wait timed out");
  return false;
}

// Position in the stage ring: stage index and the parity of the current round.
template <int Stages>
struct PipeState {
  int index = 0;
  uint32_t phase = 0;
  __device__ void advance() {
    if (++index == Stages) {
      index = 0;
      phase ^= 1u;
    }
  }
};

// Stage ring barriers. full[s]: the producer's expect_tx plus the TMA bytes complete it.
// empty[s]: every consumer thread arrives once it no longer reads stage s.
template <int Stages>
struct StageBarriers {
  alignas(8) uint64_t full[Stages];
  alignas(8) uint64_t empty[Stages];

  __device__ void init(int consumer_threads) {
    for (int s = 0; s < Stages; ++s) {
      cutlass::arch::ClusterTransactionBarrier::init(&full[s], 1);
      cutlass::arch::ClusterBarrier::init(&empty[s], consumer_threads);
    }
    cutlass::arch::fence_barrier_init();
  }
};

// Named barriers (id 0 is __syncthreads). One per consumer warpgroup for its epilogue.
enum class NamedBarrier : uint32_t { kEpilogueWG0 = 1, kEpilogueWG1 = 2 };

__device__ inline void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Waits until every bulk (TMA) store committed by this thread has fully completed
// (global writes done, not only the shared-memory reads).
__device__ inline void tma_store_wait_all_complete() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

}  // namespace mok::gemm
