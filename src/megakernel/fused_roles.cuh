// Roles of the fused forward kernel's GEMM CTAs, built from the GEMM engine's pieces
// (src/gemm: Kind::load_stage, mma_mainloop, Kind::seed/epilogue, the stage ring) so that
// every tile computes exactly what the standalone GEMM computes; only the tile ORDER differs
// (task_list.cuh), and with it the waits:
//
//   gemm_producer   one thread: per task, wait for its inputs (acquire), proxy fence, TMA loads
//   gemm_consumer   two warpgroups: K loop, epilogue (TMA stores), publish the tile (lazily,
//                   see PendingTile)
//
// Completion counters (uint32, zeroed before the kernel; +1 per consumer warpgroup and tile):
//   s1_done[shared row tile]   shared GEMM1 column blocks written   (target 2 * shared_n1)
//   g1_done[routed row tile]   routed GEMM1 column blocks written   (target 2 * n1)
//   g2_done[routed row tile]   routed GEMM2 column blocks written   (target 2 * n2, read by combine)
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include <type_traits>

#include "comm/role_types.hpp"
#include "comm/roles.cuh"
#include "comm/wait.cuh"
#include "gemm/sm90_kinds_rows.cuh"
#include "megakernel/task_list.cuh"

namespace mok::megakernel {

using G1Kind = gemm::Gemm1SwigluKind<1>;
using G2Kind = gemm::Gemm2Kind<1>;
using Cfg = G1Kind::Cfg;
static_assert(std::is_same_v<Cfg, G2Kind::Cfg>, "one shared-memory layout serves both GEMM kinds");

// One CTA of the fused kernel has the standalone GEMM's shape: 3 warpgroups. GEMM CTAs:
// WG0 = TMA producer (one thread, 40 registers), WG1-2 = consumers (64 rows of the 128-row
// tile each, 232 registers). Communication CTAs: all 12 warps run fused_comm.cuh's roles.
// (512-thread CTAs, the comm layer's own shape, cap every thread at 128 registers: too few
// for the 64x256 fp32 accumulator of a consumer warpgroup.)
struct FusedCta {
  static constexpr int kThreads = Cfg::kThreads;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kSmemBytes = Cfg::kSmemBytes;
  static_assert(kThreads == 3 * gemm::kWarpGroupThreads, "producer + two consumer warpgroups");
};

struct FusedForwardParams {
  gemm::Gemm1SwigluParams shared1, routed1;  // routed1.sched: the expert segments (int32)
  gemm::Gemm2Params shared2, routed2;
  TaskList tasks;
  int shared_tokens = 0;  // T
  int experts = 0;        // E_local
  uint32_t* s1_done = nullptr;
  uint32_t* g1_done = nullptr;
  uint32_t* g2_done = nullptr;
  const uint32_t* ready = nullptr;  // dispatch's per-minibatch counters
  comm::ScheduleView view;
  comm::DispatchRole dispatch;
  comm::CombineRole combine;  // combine.out_ready = g2_done
  comm::GroupBarrier dispatch_start, combine_done;
  comm::WaitContext wait;
  int comm_ctas = 0;
};

// ---- tiles ----------------------------------------------------------------------------------

__device__ __forceinline__ gemm::RowTile make_row_tile(int expert, int row_tile, int real_rows, int n_tile) {
  gemm::RowTile t{};
  t.expert = expert;
  t.row0 = row_tile * gemm::kRowTileRows;
  t.real_rows = real_rows;
  t.n_tile = n_tile;
  t.phantom = false;
  t.shared_b = false;
  t.any_real = real_rows > 0;
  return t;
}

// The RowTile the standalone GEMM would build for this (row tile, column block): same expert,
// same real rows, so the same loads, K loop and masked stores.
__device__ inline gemm::RowTile tile_of(const FusedForwardParams& p, const Task& t) {
  if (is_shared(t.kind)) {
    const int real = min(max(p.shared_tokens - t.row_tile * gemm::kRowTileRows, 0), gemm::kRowTileRows);
    return make_row_tile(0, t.row_tile, real, t.n_tile);
  }
  const gemm::RowScheduler& s = p.routed1.sched;
  const int e = s.expert_of(t.row_tile);
  const int real = min(max(__ldg(s.rows + e) - (t.row_tile * gemm::kRowTileRows - __ldg(s.offsets + e)), 0),
                       gemm::kRowTileRows);
  return make_row_tile(e, t.row_tile, real, t.n_tile);
}

__device__ __forceinline__ const gemm::Gemm1SwigluParams& gemm1_params(const FusedForwardParams& p, TaskKind k) {
  return is_shared(k) ? p.shared1 : p.routed1;
}
__device__ __forceinline__ const gemm::Gemm2Params& gemm2_params(const FusedForwardParams& p, TaskKind k) {
  return is_shared(k) ? p.shared2 : p.routed2;
}

__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// ---- producer -------------------------------------------------------------------------------

// Waits (one thread) until the task's input rows exist. A timed-out wait is already in the
// error record (Workspace::check throws it, y is poisoned): the task then runs on whatever is
// there, so the kernel still ends instead of hanging; every later wait gives up at once.
__device__ inline void wait_for_inputs(const FusedForwardParams& p, const Task& t) {
  using comm::Scope;
  switch (t.kind) {
    case TaskKind::kSharedGemm1:
      return;  // x is an input of the pass
    case TaskKind::kSharedGemm2:
      comm::wait_geq<Scope::kGpu>(p.s1_done + t.row_tile, 2u * p.tasks.shared_n1, comm::WaitSite::kHiddenRowTile,
                                  p.wait);
      break;
    case TaskKind::kGemm1:
      comm::wait_minibatch_ready(p.ready, p.view, t.minibatch, p.wait);
      break;
    case TaskKind::kGemm2:
      comm::wait_geq<Scope::kGpu>(p.g1_done + t.row_tile, 2u * p.tasks.n1, comm::WaitSite::kHiddenRowTile, p.wait);
      break;
  }
  // NOTE: the rows were written by other CTAs (generic stores of dispatch, or TMA stores
  // published after a proxy fence); our TMA loads (async proxy) must come after the acquire.
  fence_proxy_async_global();
}

// All K stages of one tile into the ring (the loop body of gemm::tma_producer).
template <class Kind>
__device__ inline bool produce_tile(const typename Kind::Params& p, const gemm::RowTile& tile,
                                    gemm::SharedStorage<Cfg>& ss, gemm::PipeState<Cfg::kStages>& st) {
  const int k_steps = Kind::k_steps(p, tile);
  for (int k = 0; k < k_steps; ++k) {
    if (!gemm::wait_barrier(&ss.bars.empty[st.index], st.phase, p.err)) return false;
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.bars.full[st.index], Cfg::kStageBytes);
    Kind::load_stage(p, tile, k, ss.a[st.index], ss.b[st.index], &ss.bars.full[st.index], 0);
    st.advance();
  }
  return true;
}

__device__ inline void gemm_producer(const FusedForwardParams& p, const TaskList& list, gemm::SharedStorage<Cfg>& ss,
                                     int cta, int ctas) {
  gemm::PipeState<Cfg::kStages> st;
  st.phase = 1;  // fresh empty barriers count as released
  const int n = list.size();
  for (int i = cta; i < n; i += ctas) {
    const Task t = list.at(i);
    const gemm::RowTile tile = tile_of(p, t);
    wait_for_inputs(p, t);
    const bool ok = is_gemm1(t.kind) ? produce_tile<G1Kind>(gemm1_params(p, t.kind), tile, ss, st)
                                     : produce_tile<G2Kind>(gemm2_params(p, t.kind), tile, ss, st);
    if (!ok) return;
  }
}

// ---- consumers ------------------------------------------------------------------------------

// Completion of a tile is published lazily, so that a consumer warpgroup does not stall on
// the write-back of its TMA stores after every tile: its thread 0 (which issued and committed
// the warpgroup's stores) keeps one tile "pending" and publishes it
//   - after the NEXT tile's epilogue (the older bulk groups have long landed: wait_group N
//     with N = the groups of the new tile returns at once), or
//   - before it could block: at the start of a tile whose first stage has not arrived yet
//     (the producer may be waiting on another CTA, which may be waiting on the pending tile),
//     and at the end.
// So a consumer never blocks on another CTA while holding an unpublished tile: the deadlock
// argument of task_list.cuh still holds (once a tile's first stage has arrived, the rest of
// its stages depend only on this CTA's own ring).
template <int Groups>
__device__ __forceinline__ void bulk_wait_all_but() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(Groups) : "memory");
}

struct PendingTile {
  uint32_t* counter = nullptr;

  // The stores of the pending tile have landed (caller waited): +1 on its counter.
  __device__ void release() {
    if (counter == nullptr) return;
    // NOTE: async-proxy (TMA) writes -> generic release; readers acquire, then fence again
    // before their own TMA loads (wait_for_inputs) or read with ld.global.cg (combine).
    fence_proxy_async_global();
    comm::fetch_add_release<comm::Scope::kGpu>(counter, 1u);
    counter = nullptr;
  }
  __device__ void flush() {
    if (counter == nullptr) return;
    gemm::tma_store_wait_all_complete();
    release();
  }
  // After a tile's epilogue that committed `Groups` bulk groups: publish the previous tile.
  template <int Groups>
  __device__ void rotate(uint32_t* next) {
    if (counter != nullptr) {
      bulk_wait_all_but<Groups>();
      release();
    }
    counter = next;
  }
};

// Bulk-store groups each epilogue commits (one per store_round): GEMM1+SwiGLU stores g, u, h;
// GEMM2 stores two 128-column halves.
inline constexpr int kGemm1StoreGroups = 3;
inline constexpr int kGemm2StoreGroups = 2;

__device__ __forceinline__ uint32_t* done_counter(const FusedForwardParams& p, const Task& t) {
  switch (t.kind) {
    case TaskKind::kSharedGemm1: return p.s1_done + t.row_tile;
    case TaskKind::kGemm1: return p.g1_done + t.row_tile;
    case TaskKind::kGemm2: return p.g2_done + t.row_tile;
    default: return nullptr;  // shared GEMM2: read by the epilogue kernel after this one
  }
}

// Consumer warpgroups (the body of gemm::consumer_warpgroup over the task list).
__device__ inline void gemm_consumer(const FusedForwardParams& p, const TaskList& list, gemm::SharedStorage<Cfg>& ss,
                                     int cta, int ctas) {
  const int ctid = threadIdx.x - gemm::kWarpGroupThreads;
  auto mma = gemm::make_consumer_mma<Cfg>();
  auto thr = mma.get_thread_slice(ctid);
  auto sA = cute::make_tensor(cute::make_smem_ptr(reinterpret_cast<cute::bfloat16_t*>(ss.a[0])),
                              gemm::smem_operand_layout<Cfg::kAMajor, Cfg::kBM, Cfg::kStages>());
  auto sB = cute::make_tensor(cute::make_smem_ptr(reinterpret_cast<cute::bfloat16_t*>(ss.b[0])),
                              gemm::smem_operand_layout<Cfg::kBMajor, Cfg::kBN, Cfg::kStages>());
  auto tCrA = thr.make_fragment_A(thr.partition_A(sA));
  auto tCrB = thr.make_fragment_B(thr.partition_B(sB));
  auto acc = cute::partition_fragment_C(mma, cute::make_shape(cute::Int<Cfg::kBM>{}, cute::Int<Cfg::kBN>{}));

  gemm::EpiCtx ctx;
  ctx.wg = ctid / gemm::kWarpGroupThreads;
  ctx.tid = ctid % gemm::kWarpGroupThreads;
  ctx.stage = ss.epi[ctx.wg];
  ctx.stage_saddr = static_cast<uint32_t>(__cvta_generic_to_shared(ctx.stage));

  gemm::PipeState<Cfg::kStages> st;
  PendingTile pending;  // meaningful in thread 0 of the warpgroup only
  const int n = list.size();
  for (int i = cta; i < n; i += ctas) {
    const Task t = list.at(i);
    const gemm::RowTile tile = tile_of(p, t);
    const bool g1 = is_gemm1(t.kind);
    const gemm::Gemm1SwigluParams& p1 = gemm1_params(p, t.kind);
    const gemm::Gemm2Params& p2 = gemm2_params(p, t.kind);
    if (g1) G1Kind::seed(p1, tile, ctx, acc); else G2Kind::seed(p2, tile, ctx, acc);
    const int k_steps = g1 ? G1Kind::k_steps(p1, tile) : G2Kind::k_steps(p2, tile);
    if (ctx.tid == 0 && k_steps > 0 && !cutlass::arch::ClusterBarrier::try_wait(&ss.bars.full[st.index], st.phase)) {
      pending.flush();  // about to block on the producer: publish first
    }
    if (!gemm::mma_mainloop<Cfg>(ss, st, k_steps, mma, tCrA, tCrB, acc, p1.err, ctx.tid)) break;
    if (g1) G1Kind::epilogue(p1, tile, ctx, acc); else G2Kind::epilogue(p2, tile, ctx, acc);
    if (ctx.tid == 0) {
      if (g1) pending.rotate<kGemm1StoreGroups>(done_counter(p, t));
      else pending.rotate<kGemm2StoreGroups>(done_counter(p, t));
    }
  }
  if (ctx.tid == 0) {
    gemm::tma_store_wait_all_complete();
    pending.release();
  }
}

}  // namespace mok::megakernel
