// Roles of the fused forward kernel's GEMM CTAs, built from the GEMM engine's pieces
// (src/gemm: Kind::load_stage, mma_mainloop, Kind::seed/epilogue, the stage ring) so that
// every tile computes exactly what the standalone GEMM computes; only the tile ORDER differs
// (task_list.cuh), and with it the waits:
//
//   task_feeder     one thread: takes the next task of the list from one counter (so comm CTAs
//                   that finished their dispatch can join), finds its tile, waits for its
//                   inputs (acquire), hands it to the producer through a one-entry queue
//   gemm_producer   one thread: proxy fence, TMA loads of each task the feeder hands over; after
//                   the last task an end slot for the consumers
//   gemm_consumer   two warpgroups: K loop, epilogue (TMA stores), publish the tile (lazily,
//                   see PendingTile)
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
  // The GEMM kinds address the row buffer and h, g, u through row0: the ring's slot. (Task
  // keeps the global row tile: completion counters, the push's row entries.)
  return make_row_tile(e, p.ring_tiles > 0 ? t.row_tile % p.ring_tiles : t.row_tile, real, t.n_tile);
}

__device__ __forceinline__ const gemm::Gemm1SwigluParams& gemm1_params(const FusedForwardParams& p, TaskKind k) {
  return is_shared(k) ? p.shared1 : p.routed1;
}
__device__ __forceinline__ const gemm::Gemm2Params& gemm2_params(const FusedForwardParams& p, TaskKind k) {
  return is_shared(k) ? p.shared2 : p.routed2;
}

__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// ---- task hand-off: producer -> consumers -------------------------------------------------
// Finding a task's tile (the task list position, then the expert of its row tile: a search
// over the segment table in global memory) is a chain of dependent loads: ~1.3-1.6 us per task
// when the consumers did it themselves at every tile boundary (trace build, docs/megakernel.md,
// 2026-12-01, 581c042). The producer already knows the tile, ahead of the consumers: it writes it
// into the slot of the task's FIRST stage before that stage's arrive (mbarrier arrive releases
// at CTA scope), and the consumers read it after their wait on that stage (acquire). So every
// task has a first stage: a task without K steps sends one stage without loads.
struct TaskSlot {
  Task task;
  gemm::RowTile tile;
  int k_steps;  // kEndOfTasks: no task left, the consumers stop
};
inline constexpr int kEndOfTasks = -1;
// The slots live in the barrier block's segment-table space (SharedStorage::seg_offsets): the
// fused kernel reads the segment table from global memory and never caches it there, and its
// shared memory is at the 227 KiB limit.
static_assert(sizeof(TaskSlot) * Cfg::kStages <= sizeof(gemm::SharedStorage<Cfg>::seg_offsets),
              "one task slot per stage must fit in the barrier block");
__device__ __forceinline__ TaskSlot* task_slots(gemm::SharedStorage<Cfg>& ss) {
  return reinterpret_cast<TaskSlot*>(ss.seg_offsets);
}
// The feeder -> producer queue (one entry), behind the stage slots in the same space.
struct TaskQueue {
  TaskSlot slot;
  alignas(8) uint64_t full;   // the feeder's arrive: the slot is written and its inputs exist
  alignas(8) uint64_t empty;  // the producer's arrive: the slot was read
};
inline constexpr int kTaskQueueOffset = (sizeof(TaskSlot) * Cfg::kStages + 7) / 8 * 8;
static_assert(kTaskQueueOffset + sizeof(TaskQueue) <= sizeof(gemm::SharedStorage<Cfg>::seg_offsets),
              "the task queue must fit behind the stage slots");
__device__ __forceinline__ TaskQueue& task_queue(gemm::SharedStorage<Cfg>& ss) {
  return *reinterpret_cast<TaskQueue*>(reinterpret_cast<uint8_t*>(ss.seg_offsets) + kTaskQueueOffset);
}
__device__ inline void init_task_queue(gemm::SharedStorage<Cfg>& ss) {
  cutlass::arch::ClusterBarrier::init(&task_queue(ss).full, 1);
  cutlass::arch::ClusterBarrier::init(&task_queue(ss).empty, 1);
  cutlass::arch::fence_barrier_init();
}
// A slot as the consumers use it: every field from lane 0. NOTE: values loaded from shared
// memory are not provably warp-uniform, and branches on them around the K loop make ptxas
// serialise every wgmma (C7518); shuffled from one lane they are uniform.
__device__ __forceinline__ TaskSlot read_task_slot(const TaskSlot& in) {
  auto u = [](int v) { return __shfl_sync(0xffffffffu, v, 0); };
  TaskSlot s;
  s.task = Task{static_cast<TaskKind>(u(static_cast<int>(in.task.kind))), u(in.task.row_tile), u(in.task.n_tile),
                u(in.task.minibatch)};
  s.tile.expert = u(in.tile.expert);
  s.tile.row0 = u(in.tile.row0);
  s.tile.real_rows = u(in.tile.real_rows);
  s.tile.n_tile = u(in.tile.n_tile);
  s.tile.phantom = u(in.tile.phantom) != 0;
  s.tile.shared_b = u(in.tile.shared_b) != 0;
  s.tile.any_real = u(in.tile.any_real) != 0;
  s.k_steps = u(in.k_steps);
  return s;
}

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
  }
  // NOTE: the rows were written by other CTAs (generic stores of dispatch, or TMA stores
  // published after a proxy fence); our TMA loads (async proxy) must come after the acquire.
  fence_proxy_async_global();
}

// All K stages of one tile into the ring (the loop body of gemm::tma_producer).
// The slot goes with the first stage (see TaskSlot); a task without K steps sends one stage
// without loads.
template <class Kind>
__device__ inline bool produce_tile(const typename Kind::Params& p, const TaskSlot& slot,
                                    gemm::SharedStorage<Cfg>& ss, gemm::PipeState<Cfg::kStages>& st) {
  for (int k = 0; k < max(slot.k_steps, 1); ++k) {
    if (!gemm::wait_barrier(&ss.bars.empty[st.index], st.phase, p.err)) return false;
    if (k == 0) task_slots(ss)[st.index] = slot;
    if (slot.k_steps == 0) {
      cutlass::arch::ClusterBarrier::arrive(&ss.bars.full[st.index]);
    } else {
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.bars.full[st.index], Cfg::kStageBytes);
      Kind::load_stage(p, slot.tile, k, ss.a[st.index], ss.b[st.index], &ss.bars.full[st.index], 0);
    }
    st.advance();
  }
  return true;
}

__device__ inline TaskSlot task_slot(const FusedForwardParams& p, const Task& t) {
  TaskSlot s;
  s.task = t;
  s.tile = tile_of(p, t);
  s.k_steps = is_gemm1(t.kind) ? G1Kind::k_steps(gemm1_params(p, t.kind), s.tile)
                               : G2Kind::k_steps(gemm2_params(p, t.kind), s.tile);
  return s;
}

// After the last task: one stage without loads whose slot tells the consumers to stop. Every
// thread that arrives on a full barrier arrives (`arrive`: this thread does).
__device__ inline bool send_end_of_tasks(gemm::SharedStorage<Cfg>& ss, gemm::PipeState<Cfg::kStages>& st,
                                         const gemm::ErrorSink& err, bool write_slot, bool arrive) {
  if (write_slot) {
    if (!gemm::wait_barrier(&ss.bars.empty[st.index], st.phase, err)) return false;
    TaskSlot end{};
    end.k_steps = kEndOfTasks;
    task_slots(ss)[st.index] = end;
  }
  if (arrive) cutlass::arch::ClusterBarrier::arrive(&ss.bars.full[st.index]);
  return true;
}

// The task hand-out (DESIGN §6, task_list.cuh): tasks in list order from one counter, so a task
// only waits on tasks handed out before it, and any CTA (a comm CTA done with its dispatch too)
// may take the next one. The counter's round trip, the tile's segment search (dependent global
// loads) and the wait for the task's inputs run here, one task ahead of the producer, so that
// none of them delays the stage ring (on the producer's path they cost 2-11 % at EP 1,
// docs/megakernel.md). `trace_cta`: this CTA's trace row.
__device__ inline void task_feeder(const FusedForwardParams& p, const TaskList& list, gemm::SharedStorage<Cfg>& ss,
                                   int trace_cta) {
  (void)trace_cta;
  TaskQueue& q = task_queue(ss);
  const uint32_t n = static_cast<uint32_t>(list.size());
  uint32_t phase = 1;  // a fresh empty barrier counts as released
  for (int j = 0;; ++j) {
    if (!gemm::wait_barrier(&q.empty, phase, p.routed1.err)) return;
    phase ^= 1u;
    const uint32_t i = atomicAdd(p.next_task, 1u);
    TaskSlot slot{};
    slot.k_steps = kEndOfTasks;
    if (i < n) {
      const Task t = list.at(static_cast<int>(i));
      slot = task_slot(p, t);
      MOK_FWD_TRACE(trace::task_stamp(p.trace, trace_cta, j, trace::kTaskWaitBegin);)
      wait_for_inputs(p, t);
      MOK_FWD_TRACE(trace::task_stamp(p.trace, trace_cta, j, trace::kTaskWaitEnd);
                    trace::task_desc(p.trace, trace_cta, j, static_cast<int>(t.kind), t.minibatch, t.n_tile,
                                     t.row_tile, slot.tile.real_rows);)
    }
    q.slot = slot;
    cutlass::arch::ClusterBarrier::arrive(&q.full);  // release (CTA scope): the slot and the acquire above
    if (i >= n) return;
  }
}

__device__ inline void gemm_producer(const FusedForwardParams& p, gemm::SharedStorage<Cfg>& ss) {
  TaskQueue& q = task_queue(ss);
  gemm::PipeState<Cfg::kStages> st;
  st.phase = 1;  // fresh empty barriers count as released
  for (uint32_t phase = 0;; phase ^= 1u) {
    if (!gemm::wait_barrier(&q.full, phase, p.routed1.err)) return;
    const TaskSlot slot = q.slot;
    cutlass::arch::ClusterBarrier::arrive(&q.empty);
    if (slot.k_steps == kEndOfTasks) break;
    // NOTE: the feeder acquired the inputs; the queue's barrier orders that before this
    // thread's proxy fence and its TMA loads (async proxy).
    fence_proxy_async_global();
    const TaskKind kind = slot.task.kind;
    const bool ok = is_gemm1(kind) ? produce_tile<G1Kind>(gemm1_params(p, kind), slot, ss, st)
                                   : produce_tile<G2Kind>(gemm2_params(p, kind), slot, ss, st);
    if (!ok) return;
  }
  send_end_of_tasks(ss, st, p.routed1.err, true, true);
}

// ---- consumers ------------------------------------------------------------------------------

// Completion of a tile is published lazily, so that a consumer warpgroup does not stall on
// the write-back of its TMA stores after every tile: its thread 0 (which issued and committed
// the warpgroup's stores) keeps the tile "pending" and publishes it
//   - after the first wgmma batch of the task after the NEXT one, inside its K loop (the older
//     bulk groups have long landed: wait_group N with N = the groups of the last epilogue
//     returns at once; and the release's GPU-scope fence then overlaps the tensor cores instead
//     of holding back warp 0, hence the warpgroup's first wgmma), or
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
    // Only the fused top-k sum reads s2_done: without it the tile is not published (nullptr).
    case TaskKind::kSharedGemm2: return p.topk.on ? p.s2_done + t.row_tile : nullptr;
  }
  return nullptr;
}

// Consumer warpgroups (the body of gemm::consumer_warpgroup over the tasks the producer hands
// over, until its end slot). `trace_cta`: this CTA's trace row.
__device__ inline void gemm_consumer(const FusedForwardParams& p, const TaskList& list, gemm::SharedStorage<Cfg>& ss,
                                     int trace_cta) {
  (void)trace_cta;
  const int ctid = threadIdx.x - gemm::kWarpGroupThreads;
  auto mma = gemm::make_consumer_mma<Cfg>();
  auto thr = mma.get_thread_slice(ctid);
  auto tCrA = thr.make_fragment_A(thr.partition_A(gemm::smem_a(ss)));
  auto tCrB = thr.make_fragment_B(thr.partition_B(gemm::smem_b(ss)));
  auto acc = cute::partition_fragment_C(mma, cute::make_shape(cute::Int<Cfg::kBM>{}, cute::Int<Cfg::kBN>{}));

  const gemm::EpiCtx ctx = gemm::make_epi_ctx(ss, ctid / gemm::kWarpGroupThreads, ctid % gemm::kWarpGroupThreads);

  gemm::PipeState<Cfg::kStages> st;
  // Meaningful in thread 0 of the warpgroup only: `pending` = the tile before the last one
  // (its stores long issued), `fresh` = the last one (stores just issued). `pending` is
  // published after the NEXT task's first wgmma batch, inside its K loop, so that the release
  // (a GPU-scope fence and atomic, ~0.5 us) does not hold the warpgroup's first wgmma of the
  // task back (warp 0 carries it); then `fresh` becomes `pending`.
  PendingTile pending;
  uint32_t* fresh = nullptr;
  bool has_fresh = false, fresh_g1 = false;
  auto publish_all = [&] {  // thread 0: both tiles, after every store landed
    gemm::tma_store_wait_all_complete();
    pending.release();
    if (has_fresh) {
      pending.counter = fresh;
      pending.release();
      has_fresh = false;
    }
  };
  const TaskSlot* slots = task_slots(ss);
  // NOTE: bounded by the list (a CTA takes at most all of it; the end slot ends the loop): with
  // no bound (for (;;)) ptxas serialised every wgmma of the kernel (C7518).
  const int n = list.size();
  for (int j = 0; j < n; ++j) {
    MOK_FWD_TRACE(const bool stamp = ctid == 0; if (stamp) trace::task_stamp(p.trace, trace_cta, j, trace::kTaskTileBegin);)
    // The task arrives with its first stage (TaskSlot).
    if (ctx.tid == 0 && !cutlass::arch::ClusterBarrier::try_wait(&ss.bars.full[st.index], st.phase)) {
      publish_all();  // about to block on the producer: publish first
    }
    if (!gemm::wait_barrier(&ss.bars.full[st.index], st.phase, p.routed1.err)) break;
    const TaskSlot slot = read_task_slot(slots[st.index]);
    if (slot.k_steps == kEndOfTasks) break;  // (its TileBegin stamp alone: the trace reader skips it)
    const Task& t = slot.task;
    const gemm::RowTile& tile = slot.tile;
    const int k_steps = slot.k_steps;
    const bool g1 = is_gemm1(t.kind);
    const gemm::Gemm1SwigluParams& p1 = gemm1_params(p, t.kind);
    const gemm::Gemm2Params& p2 = gemm2_params(p, t.kind);
    if (g1) G1Kind::seed(p1, tile, ctx, acc); else G2Kind::seed(p2, tile, ctx, acc);
    if (k_steps == 0) {  // the stage carried only the task
      gemm::release_stage(ss, st.index, ctx.tid);
      st.advance();
    }
    const bool push = p.push.on && t.kind == TaskKind::kGemm2;
    // (loaded before the K loop; the task's global row tile names the rows' entries)
    const char* push_dst = push ? push_row_dst(p.push, t.row_tile * gemm::kRowTileRows, tile.real_rows, ctx) : nullptr;
    // After this task's first batch (or once, without K steps): publish `pending` (its stores
    // are older than the last epilogue's groups), `fresh` moves up.
    const int publish_at = gemm::hook_slot(0, k_steps);
    auto during_k_loop = [&](int k) {
      if (k == publish_at && ctx.tid == 0 && has_fresh) {
        if (pending.counter != nullptr) {
          if (fresh_g1) bulk_wait_all_but<kGemm1StoreGroups>(); else bulk_wait_all_but<kGemm2StoreGroups>();
          pending.release();
        }
        pending.counter = fresh;
        has_fresh = false;
      }
    };
    if (!gemm::mma_mainloop<Cfg>(ss, st, k_steps, mma, tCrA, tCrB, acc, p1.err, ctx.tid, -1,
                                 during_k_loop)) {
      break;
    }
    MOK_FWD_TRACE(if (stamp) trace::task_stamp(p.trace, trace_cta, j, trace::kTaskMainloopEnd);)
    if (g1) {
      // With the macrobatch ring only the last ring_tiles row tiles keep their saved g, u (the
      // slots of earlier ones are overwritten): the others store h alone.
      const bool keep_gu = p.ring_tiles == 0 || t.kind == TaskKind::kSharedGemm1 ||
                           t.row_tile >= list.routed_row_tiles - p.ring_tiles;
      G1Kind::epilogue(p1, tile, ctx, acc, keep_gu);
    } else if (push) {
      gemm2_epilogue_push(p2, tile, ctx, push_dst, p.push.store_out(), acc);
    } else {
      G2Kind::epilogue(p2, tile, ctx, acc);
    }
    if (ctx.tid == 0) {
      // (`pending` was published in this task's K loop, or at once when it had to block.)
      fresh = done_counter(p, t);
      has_fresh = true;
      fresh_g1 = g1;
    }
    MOK_FWD_TRACE(if (stamp) trace::task_stamp(p.trace, trace_cta, j, trace::kTaskEpilogueEnd);)
  }
  if (ctx.tid == 0) publish_all();
}

}  // namespace mok::megakernel
