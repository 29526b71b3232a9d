// The fixed-order top-k sum inside the fused kernel (FusedForwardOptions::fused_topk_sum).
//
// The separate epilogue kernel (comm::topk_sum_epilogue) ran after the fused kernel and read
// every (token, k) row at full HBM speed: 0.17-0.27 ms at EP 2, with every SM idle for the
// GEMMs. Here warps of the fused kernel sum a token as soon as its rows exist:
//   - own rows in place: GEMM 2 published the row's tile (g2_done);
//   - rows pushed into the slots (other ranks' experts): arrivals[t] counts them, raised by the
//     pushing warps with a system-scope release (CombineRole::count_arrivals);
//   - the shared expert's row: its GEMM 2 tile (s2_done).
// Who sums: the comm CTAs that combine, after their combine, and the consumer warps of the
// GEMM CTAs (and of comm CTAs that joined the GEMM work, FusedForwardOptions::join_gemm) after
// their last task; each warp takes the next token from one counter,
// in the schedule's token order (ScheduleView::token_order: by the largest local expert index
// of the token). Every rank walks its local experts in order, so tokens come in about the order
// they become complete, and a warp rarely waits long. (The GEMM CTAs' idle producer warps were
// tried too: with 40 registers one vector in flight, they held tokens for ~60 us each and slowed
// the GEMM's task hand-off; docs/megakernel.md.)
//
// Bits: each output element is the same fmaf chain as topk_sum_epilogue (shared row or 0, then
// k = 0..K-1 in order, one rounding); who computes it and when does not change it.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "comm/role_types.hpp"
#include "comm/roles.cuh"
#include "comm/wait.cuh"
#include "megakernel/forward_trace.cuh"

namespace mok::megakernel {

struct TopkSumParams {
  bool on = false;
  const comm::ScheduleHeader* header = nullptr;
  const int32_t* token_order = nullptr;   // ScheduleView::token_order [T]
  int64_t tokens = 0, hidden = 0;
  int topk = 1;
  const float* topk_w = nullptr;          // [T, K]
  const char* slots = nullptr;            // this rank's window slots [T, K, H]
  const uint32_t* arrivals = nullptr;     // this rank's window [T] (zeroed before the kernel)
  const int32_t* own_dest_row = nullptr;  // ScheduleView::dest_row + rank*T*K; nullptr: every row from the slots
  const char* expert_out = nullptr;       // [buffer_rows, H] (GEMM 2 output)
  const uint32_t* g2_done = nullptr;      // routed GEMM 2 row tiles
  uint32_t g2_target = 0;
  const char* shared_out = nullptr;       // [T, H] shared expert output; nullptr: none
  const uint32_t* s2_done = nullptr;      // shared GEMM 2 row tiles
  uint32_t s2_target = 0;
  char* y = nullptr;                      // [T, H]
  uint32_t* next_unit = nullptr;          // work counter (zeroed before the kernel)
  MOK_FWD_TRACE(uint64_t* trace_tokens = nullptr;)  // trace build: per-token stamps (forward_trace.cuh)
};

// Poll interval of the sum's waits: a hundred warps or more may wait at once; they need not be quick.
inline constexpr uint32_t kTopkSleepNs = 512;

namespace detail {

// Waits until token t's rows are final. Lane k (< K) waits for its own row's GEMM 2 tile; lane 0
// then for the pushed rows (arrivals) and the shared row. The __syncwarp orders every lane's
// loads after the waiting lanes' acquires. Returns false after a timeout (recorded).
__device__ inline bool wait_token(const TopkSumParams& s, int64_t t, int lane, int32_t own_row,
                                  const comm::WaitContext& wait) {
  using comm::Scope;
  bool ok = true;
  if (own_row >= 0) {
    ok = comm::wait_geq<Scope::kGpu>(s.g2_done + own_row / kRowTile, s.g2_target, comm::WaitSite::kCombineSource,
                                     wait, kTopkSleepNs);
  }
  const uint32_t own = __popc(__ballot_sync(0xffffffffu, own_row >= 0));
  if (lane == 0) {
    const uint32_t pushed = static_cast<uint32_t>(s.topk) - own;
    if (ok && pushed > 0) {
      ok = comm::wait_geq<Scope::kSystem>(s.arrivals + t, pushed, comm::WaitSite::kTokenArrivals, wait, kTopkSleepNs);
    }
    if (ok && s.shared_out != nullptr) {
      ok = comm::wait_geq<Scope::kGpu>(s.s2_done + t / kRowTile, s.s2_target, comm::WaitSite::kCombineSource, wait,
                                       kTopkSleepNs);
    }
  }
  const bool all = __all_sync(0xffffffffu, ok);
  __syncwarp();  // NOTE: the other lanes' loads below come after the acquires above
  return all;
}

// y[t] = round(shared[t] (or 0) + sum_k w[t,k] * row(t,k)), k in order; U vectors of 8 columns
// per lane at a time.
template <int U>
__device__ inline void sum_token(const TopkSumParams& s, int64_t t, int lane, int32_t own_row) {
  const int vecs = static_cast<int>(s.hidden / 8);
  const int K = s.topk;
  // Lane k < K holds entry k's source as one 32-bit word (shuffled, not a 64-bit pointer):
  // >= 0 a row of expert_out, < 0 the slot -1 - word (T*K < 2^30: LayerShape::validate).
  int32_t where = 0;
  float w = 0.0f;
  if (lane < K) {
    where = own_row >= 0 ? own_row : -1 - static_cast<int32_t>(t * K + lane);
    w = s.topk_w[t * K + lane];
  }
  const int4* out_rows = reinterpret_cast<const int4*>(s.expert_out);
  const int4* slot_rows = reinterpret_cast<const int4*>(s.slots);
  const int4* shared = s.shared_out != nullptr ? reinterpret_cast<const int4*>(s.shared_out) + t * vecs : nullptr;
  int4* y = reinterpret_cast<int4*>(s.y) + t * vecs;
  // NOTE: a warp-uniform trip count (lanes past the row's end predicate their loads and
  // stores): the shuffles below need every lane (H = 128 has 16 vectors per row).
  for (int base = 0; base < vecs; base += 32 * U) {
    const int v0 = base + lane;
    float acc[U][8];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + 32 * u;
      if (shared != nullptr && v < vecs) {
        comm::topk_acc_init(acc[u], comm::load_fresh(shared + v));
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[u][j] = 0.0f;
      }
    }
#pragma unroll(U > 1 ? 4 : 1)
    for (int k = 0; k < K; ++k) {  // fixed order 0..K-1 (numerics contract)
      const int32_t wh = __shfl_sync(0xffffffffu, where, k);
      const float wk = __shfl_sync(0xffffffffu, w, k);
      const int4* row = wh >= 0 ? out_rows + static_cast<int64_t>(wh) * vecs : slot_rows + static_cast<int64_t>(-1 - wh) * vecs;
      int4 val[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        val[u] = v0 + 32 * u < vecs ? comm::load_fresh(row + v0 + 32 * u) : make_int4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) comm::topk_acc_add(acc[u], wk, val[u]);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + 32 * u;
      if (v < vecs) y[v] = comm::topk_acc_round(acc[u]);
    }
  }
}

}  // namespace detail

// One warp's share of the top-k sum: one token at a time, in the schedule's token order, until
// none is left (or a wait timed out). U: 16-byte vectors per lane in flight per row.
template <int U>
__device__ inline void topk_sum_warp(const TopkSumParams& s, const comm::WaitContext& wait) {
  if (!s.on || s.header->status != static_cast<int32_t>(Status::kOk)) return;
  const int lane = threadIdx.x % 32;
  for (;;) {
    uint32_t u = 0;
    if (lane == 0) u = atomicAdd(s.next_unit, 1u);
    u = __shfl_sync(0xffffffffu, u, 0);
    if (u >= s.tokens) return;
    MOK_FWD_TRACE(if (lane == 0) trace::token_stamp(s.trace_tokens, u, trace::kTokenClaim, trace::now());)
    const int64_t token = __ldg(s.token_order + u);
    const int32_t own_row = s.own_dest_row != nullptr && lane < s.topk ? s.own_dest_row[token * s.topk + lane] : -1;
    if (!detail::wait_token(s, token, lane, own_row, wait)) return;  // recorded; y is poisoned after the kernel
    MOK_FWD_TRACE(if (lane == 0) trace::token_stamp(s.trace_tokens, u, trace::kTokenReady, trace::now());)
    detail::sum_token<U>(s, token, lane, own_row);
    MOK_FWD_TRACE(if (lane == 0) {
      trace::token_stamp(s.trace_tokens, u, trace::kTokenDone, trace::now());
      trace::token_stamp(s.trace_tokens, u, trace::kTokenWho, blockIdx.x);
    })
  }
}

}  // namespace mok::megakernel
