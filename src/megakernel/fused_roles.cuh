// The fused forward's GEMM CTAs: its parameters and its hooks of the task roles
// (task_roles.cuh: task_feeder, gemm_producer, gemm_consumer over FusedForwardParams). GEMM 1
// + SwiGLU and GEMM 2 tiles, waits on the dispatch's ready counters and GEMM 1's row tiles.
//
// Completion counters (uint32, zeroed before the kernel; +1 per consumer warpgroup and tile):
//   s1_done[shared row tile]   shared GEMM1 column blocks written   (target 2 * shared_n1)
//   g1_done[routed row tile]   routed GEMM1 column blocks written   (target 2 * n1)
//   g2_done[routed row tile]   routed GEMM2 column blocks written   (target 2 * n2, read by combine)
//   s2_done[shared row tile]   shared GEMM2 column blocks written   (target 2 * n2; only with the fused top-k sum)
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include <type_traits>

#include "comm/role_types.hpp"
#include "comm/roles.cuh"
#include "comm/wait.cuh"
#include "gemm/sm90_kinds_rows.cuh"
#include "megakernel/forward_trace.cuh"
#include "megakernel/fused_push.cuh"
#include "megakernel/fused_topk_sum.cuh"
#include "megakernel/task_list.cuh"
#include "megakernel/task_roles.cuh"

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
  static_assert(kSmemBytes <= gemm::kMaxSmemPerBlock, "GEMM shared memory exceeds the SM");
  static_assert(kThreads == 3 * gemm::kWarpGroupThreads, "producer + two consumer warpgroups");
};

struct FusedForwardParams {
  using Cfg = megakernel::Cfg;  // the shared-memory layout of both kinds
  gemm::Gemm1SwigluParams shared1, routed1;  // routed1.sched: the expert segments (int32)
  gemm::Gemm2Params shared2, routed2;
  TaskList tasks;
  int shared_tokens = 0;  // T
  int experts = 0;        // E_local
  uint32_t* s1_done = nullptr;
  uint32_t* g1_done = nullptr;
  uint32_t* g2_done = nullptr;
  uint32_t* s2_done = nullptr;      // shared GEMM 2 row tiles (read by the fused top-k sum)
  const uint32_t* ready = nullptr;  // dispatch's per-minibatch counters
  comm::ScheduleView view;
  comm::DispatchRole dispatch;
  comm::CombineRole combine;  // combine.out_ready = g2_done
  comm::GroupBarrier dispatch_start, combine_done;
  comm::WaitContext wait;
  int comm_ctas = 0;
  // Comm CTAs [0, combine_ctas) combine (and, with the fused sum, sum); [combine_ctas,
  // comm_ctas) take GEMM tasks after their dispatch share (FusedForwardOptions::join_gemm).
  int combine_ctas = 0;
  uint32_t* next_task = nullptr;  // the task hand-out counter (zeroed before the kernel)
  // Dedup fan-out: the first help_tiles row tiles are dispatched by every CTA (the GEMM CTAs'
  // consumer warps first, before their tasks), the rest by the comm CTAs. 0: comm CTAs only.
  int64_t help_tiles = 0;
  TopkSumParams topk;  // the fused top-k sum (fused_topk_sum.cuh); off: the epilogue kernel after this one
  EpiloguePush push;   // the combine from GEMM 2's epilogue (fused_push.cuh); off: the comm CTAs combine
  // Macrobatch ring (Config::macrobatch): routed row tile t reads and writes slot t % ring_tiles
  // of the row buffer and of h, g, u; GEMM 1 of t waits until GEMM 2 of t - ring_tiles read
  // its hidden rows, the dispatch of t until GEMM 1 of t - ring_tiles read its rows
  // (DispatchRole::ring_tiles). Needs the epilogue push of every row (expert_out is not
  // written). 0: every routed row tile has its own rows.
  int ring_tiles = 0;
  MOK_FWD_TRACE(trace::Sink trace;)
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

// The RowTile the standalone GEMM would build for task t (row tile, column block): same expert,
// same real rows, so the same loads, K loop and masked stores. Shared tasks: tiles of the rank's
// shared_tokens; routed: the expert segments of `s`. ring_tiles > 0: the routed row tile's slot
// in the macrobatch ring (the GEMM kinds address the row buffer and h, g, u through row0; Task
// keeps the global row tile: completion counters, the push's row entries). The fused backward
// builds its tiles the same way.
__device__ inline gemm::RowTile row_tile_of(const gemm::RowScheduler& s, int shared_tokens, int ring_tiles,
                                            const Task& t) {
  if (is_shared(t.kind)) {
    const int real = min(max(shared_tokens - t.row_tile * gemm::kRowTileRows, 0), gemm::kRowTileRows);
    return make_row_tile(0, t.row_tile, real, t.n_tile);
  }
  const int e = s.expert_of(t.row_tile);
  const int real = min(max(__ldg(s.rows + e) - (t.row_tile * gemm::kRowTileRows - __ldg(s.offsets + e)), 0),
                       gemm::kRowTileRows);
  return make_row_tile(e, ring_tiles > 0 ? t.row_tile % ring_tiles : t.row_tile, real, t.n_tile);
}
__device__ inline gemm::RowTile tile_of(const FusedForwardParams& p, const Task& t) {
  return row_tile_of(p.routed1.sched, p.shared_tokens, p.ring_tiles, t);
}

__device__ __forceinline__ const gemm::Gemm1SwigluParams& gemm1_params(const FusedForwardParams& p, TaskKind k) {
  return is_shared(k) ? p.shared1 : p.routed1;
}
__device__ __forceinline__ const gemm::Gemm2Params& gemm2_params(const FusedForwardParams& p, TaskKind k) {
  return is_shared(k) ? p.shared2 : p.routed2;
}

// ---- the forward's hooks of the task roles (task_roles.cuh) ------------------------------

__device__ __forceinline__ const gemm::ErrorSink& pass_err(const FusedForwardParams& p) { return p.routed1.err; }

// Waits (one thread) until the task's input rows exist. A timed-out wait is already in the
// error record (Workspace::check throws it, y is poisoned): the task then runs on whatever is
// there, so the kernel still ends instead of hanging; every later wait gives up at once.
__device__ inline void wait_for_inputs(const FusedForwardParams& p, const TaskSlot& slot) {
  using comm::Scope;
  const Task& t = slot.task;
  switch (t.kind) {
    case TaskKind::kSharedGemm1:
      return;  // x is an input of the pass
    case TaskKind::kSharedGemm2:
      comm::wait_geq<Scope::kGpu>(p.s1_done + t.row_tile, 2u * p.tasks.shared_n1, comm::WaitSite::kHiddenRowTile,
                                  p.wait);
      break;
    case TaskKind::kGemm1:
      comm::wait_minibatch_ready(p.ready, p.view, t.minibatch, p.wait);
      if (p.ring_tiles > 0 && t.row_tile >= p.ring_tiles) {
        // The ring slot's hidden rows (and saved g, u) belong to tile row_tile - ring_tiles until
        // GEMM 2 read them: every column block of it published (its TMA loads completed).
        // GEMM 2 of that tile is at least one minibatch earlier in the list (Config::macrobatch
        // >= two minibatches), so it was handed out before this task.
        comm::wait_geq<Scope::kGpu>(p.g2_done + (t.row_tile - p.ring_tiles), 2u * p.tasks.n2,
                                    comm::WaitSite::kRingSlot, p.wait);
      }
      break;
    case TaskKind::kGemm2:
      comm::wait_geq<Scope::kGpu>(p.g1_done + t.row_tile, 2u * p.tasks.n1, comm::WaitSite::kHiddenRowTile, p.wait);
      break;
    default:
      break;  // (the backward's weight-gradient kinds: not in the forward's list)
  }
  // NOTE: the rows were written by other CTAs (generic stores of dispatch, or TMA stores
  // published after a proxy fence); our TMA loads (async proxy) must come after the acquire.
  fence_proxy_async_global();
}

__device__ inline TaskSlot task_slot(const FusedForwardParams& p, const Task& t) {
  TaskSlot s;
  s.task = t;
  s.tile = tile_of(p, t);
  s.k_steps = is_gemm1(t.kind) ? G1Kind::k_steps(gemm1_params(p, t.kind), s.tile)
                               : G2Kind::k_steps(gemm2_params(p, t.kind), s.tile);
  return s;
}

__device__ inline bool produce_task(const FusedForwardParams& p, const TaskSlot& slot, gemm::SharedStorage<Cfg>& ss,
                                    gemm::PipeState<Cfg::kStages>& st) {
  const TaskKind kind = slot.task.kind;
  return is_gemm1(kind) ? produce_tile<G1Kind>(gemm1_params(p, kind), slot, ss, st)
                        : produce_tile<G2Kind>(gemm2_params(p, kind), slot, ss, st);
}

template <class Acc>
__device__ __forceinline__ void seed_task(const FusedForwardParams& p, const TaskSlot& slot, const gemm::EpiCtx& ctx,
                                          Acc& acc) {
  if (is_gemm1(slot.task.kind)) {
    G1Kind::seed(gemm1_params(p, slot.task.kind), slot.tile, ctx, acc);
  } else {
    G2Kind::seed(gemm2_params(p, slot.task.kind), slot.tile, ctx, acc);
  }
}

// With the epilogue push: where a routed GEMM 2 tile's rows go (loaded before the K loop; the
// task's global row tile names the rows' entries).
struct ForwardEpiloguePrep {
  bool push = false;
  const char* push_dst = nullptr;
};
__device__ __forceinline__ ForwardEpiloguePrep prepare_epilogue(const FusedForwardParams& p, const TaskSlot& slot,
                                                                const gemm::EpiCtx& ctx) {
  ForwardEpiloguePrep e;
  e.push = p.push.on && slot.task.kind == TaskKind::kGemm2;
  if (e.push) e.push_dst = push_row_dst(p.push, slot.task.row_tile * gemm::kRowTileRows, slot.tile.real_rows, ctx);
  return e;
}

// The forward's kinds have no epilogue stages (the ring is unused); never fails.
template <class Acc, class Ring>
__device__ __forceinline__ bool epilogue_task(const FusedForwardParams& p, const TaskList& list, const TaskSlot& slot,
                                              const gemm::EpiCtx& ctx, Acc& acc, const ForwardEpiloguePrep& e,
                                              const Ring&) {
  const Task& t = slot.task;
  if (is_gemm1(t.kind)) {
    // With the macrobatch ring only the last ring_tiles row tiles keep their saved g, u (the
    // slots of earlier ones are overwritten): the others store h alone.
    const bool keep_gu = p.ring_tiles == 0 || t.kind == TaskKind::kSharedGemm1 ||
                         t.row_tile >= list.routed_row_tiles - p.ring_tiles;
    G1Kind::epilogue(gemm1_params(p, t.kind), slot.tile, ctx, acc, keep_gu);
  } else if (e.push) {
    gemm2_epilogue_push(gemm2_params(p, t.kind), slot.tile, ctx, e.push_dst, p.push.store_out(), acc);
  } else {
    G2Kind::epilogue(gemm2_params(p, t.kind), slot.tile, ctx, acc);
  }
  return true;
}

// Bulk-store groups each epilogue commits (one per store_round): GEMM1+SwiGLU stores g, u, h;
// GEMM2 stores two 128-column halves.
inline constexpr int kGemm1StoreGroups = 3;
inline constexpr int kGemm2StoreGroups = 2;
__device__ __forceinline__ void wait_stores_but_last(const FusedForwardParams&, TaskKind last) {
  if (is_gemm1(last)) bulk_wait_all_but<kGemm1StoreGroups>(); else bulk_wait_all_but<kGemm2StoreGroups>();
}

__device__ __forceinline__ uint32_t* done_counter(const FusedForwardParams& p, const Task& t) {
  switch (t.kind) {
    case TaskKind::kSharedGemm1: return p.s1_done + t.row_tile;
    case TaskKind::kGemm1: return p.g1_done + t.row_tile;
    case TaskKind::kGemm2: return p.g2_done + t.row_tile;
    // Only the fused top-k sum reads s2_done: without it the tile is not published (nullptr).
    case TaskKind::kSharedGemm2: return p.topk.on ? p.s2_done + t.row_tile : nullptr;
    default: return nullptr;  // (the backward's weight-gradient kinds)
  }
  return nullptr;
}

}  // namespace mok::megakernel
