// Developer trace of the fused forward (build with -DMOK_FORWARD_TRACE; the product build
// compiles none of it: MOK_FWD_TRACE(...) expands to nothing). Every CTA writes %globaltimer
// stamps (ns, one clock for all SMs) of its phases into a device buffer that
// megakernel::forward_trace_dump() writes to a file after the pass; scripts/forward_trace.py
// reads it. Layout (uint64 words), for a grid of G CTAs of which C communicate:
//   comm CTA c:       comm[c * kCommFields + f], f = CommField
//   GEMM CTA g (g < G - C), or comm CTA c that joined the GEMM work (g = G - C + c), its j-th task:
//                     gemm[(g * kMaxTasks + j) * kTaskFields + f], f = TaskField
//   fused top-k sum, the u-th token of the schedule's token order:
//                     tokens[u * kTokenFields + f], f = TokenField
// The stamps are taken by one thread per role (producer thread, thread 0 of consumer
// warpgroup 0, thread 0 of a comm CTA); globaltimer ticks in ~32 ns steps on H100/H200, enough
// for tiles of 10-100 us.
#pragma once

#include <cstdint>

#ifdef MOK_FORWARD_TRACE
#define MOK_FWD_TRACE(...) __VA_ARGS__
#else
#define MOK_FWD_TRACE(...)
#endif

namespace mok::megakernel::trace {

enum CommField : int { kCommStart, kCommBarrier1, kCommDispatchEnd, kCommCombineEnd, kCommBarrier2, kCommFields };
enum TaskField : int {
  kTaskWaitBegin,    // producer: before waiting for the task's inputs
  kTaskWaitEnd,      // producer: inputs complete (acquired)
  kTaskTileBegin,    // consumer warpgroup 0: before seed (the previous tile's epilogue is done)
  kTaskMainloopEnd,  // consumer warpgroup 0: K loop done (it includes the wait for the first stage)
  kTaskEpilogueEnd,  // consumer warpgroup 0: stores issued, previous tile published
  kTaskDesc,         // kind | minibatch << 8 | n_tile << 24 | row_tile << 40 | real_rows << 56
  kTaskFields
};
inline constexpr int kMaxTasks = 4096;  // per GEMM CTA (the fused backward with its weight gradients: ~3.4 K at dsv3); beyond: not recorded
enum TokenField : int {
  kTokenClaim,  // lane 0 took the token from the counter
  kTokenReady,  // its rows were final (the waits returned)
  kTokenDone,   // its y row was stored
  kTokenWho,    // blockIdx.x of the summing warp (< comm CTAs: a comm CTA)
  kTokenFields
};

struct Sink {
  uint64_t* comm = nullptr;
  uint64_t* gemm = nullptr;
  uint64_t* tokens = nullptr;  // [T * kTokenFields] with the fused top-k sum, else nullptr
};

#if defined(MOK_FORWARD_TRACE) && defined(__CUDACC__)
__device__ __forceinline__ uint64_t now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void comm_stamp(const Sink& s, int cta, CommField f) {
  if (threadIdx.x == 0) s.comm[cta * kCommFields + f] = now();
}
__device__ __forceinline__ void task_stamp(const Sink& s, int cta, int j, TaskField f) {
  if (j < kMaxTasks && s.gemm != nullptr) s.gemm[(static_cast<int64_t>(cta) * kMaxTasks + j) * kTaskFields + f] = now();
}
__device__ __forceinline__ void token_stamp(uint64_t* tokens, uint32_t u, TokenField f, uint64_t v) {
  if (tokens != nullptr) tokens[static_cast<int64_t>(u) * kTokenFields + f] = v;
}
// (row_tile < 2^16 and real_rows <= 128 fit their fields)
__device__ __forceinline__ void task_desc(const Sink& s, int cta, int j, int kind, int minibatch, int n_tile,
                                          int row_tile, int real_rows) {
  if (j < kMaxTasks && s.gemm != nullptr) {
    s.gemm[(static_cast<int64_t>(cta) * kMaxTasks + j) * kTaskFields + kTaskDesc] =
        static_cast<uint64_t>(kind) | static_cast<uint64_t>(minibatch) << 8 | static_cast<uint64_t>(n_tile) << 24 |
        static_cast<uint64_t>(row_tile & 0xFFFF) << 40 | static_cast<uint64_t>(real_rows & 0xFF) << 56;
  }
}
#endif

}  // namespace mok::megakernel::trace

#ifdef MOK_FORWARD_TRACE
#include <cuda_runtime_api.h>
namespace mok::megakernel {
// The current host thread's trace buffers (fused_forward.cu): zeroed and the first event
// recorded; a fused kernel records into the returned sink, trace_event(1..3) marks the phases
// (kernel start, kernel end, pass end) and forward_trace_dump writes the last pass traced on
// this thread, the fused forward's or the fused backward's (the same file layout).
trace::Sink trace_begin(int grid, int comm_ctas, int64_t sum_tokens, cudaStream_t stream);
void trace_event(int i, cudaStream_t stream);
}  // namespace mok::megakernel
#endif
