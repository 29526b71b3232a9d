// The task roles of the fused kernels' GEMM CTAs (the forward, fused_forward.cu; the backward,
// fused_backward.cu), built from the GEMM engine's pieces (src/gemm: Kind::load_stage,
// mma_mainloop, Kind::seed/epilogue, the stage ring) so that every tile computes exactly what
// the standalone GEMM computes; only the tile ORDER differs (task_list.cuh), and with it the waits:
//
//   task_feeder     one thread: takes the next task of the list from one counter (so comm CTAs
//                   that finished their dispatch can join), finds its tile, waits for its
//                   inputs (acquire), hands it to the producer through a one-entry queue
//   gemm_producer   one thread: proxy fence, TMA loads of each task the feeder hands over; after
//                   the last task an end slot for the consumers
//   gemm_consumer   two warpgroups: K loop, epilogue (TMA stores), publish the tile (lazily,
//                   see PendingTile)
//
// A pass's parameter struct P (FusedForwardParams, FusedBackwardParams) names its shared-memory
// layout (P::Cfg: every GEMM kind of the pass has it), the hand-out counter (P::next_task), and
// provides, found by argument-dependent lookup:
//   pass_err(p)                                   the GEMM error sink of the pass
//   task_slot(p, task)                            the task's tile and K steps
//   wait_for_inputs(p, slot)                      feeder: acquire what the task (slot.task, its tile
//                                                 as task_slot found it) reads
//   produce_task(p, slot, ss, st)                 producer: the task's TMA loads (produce_tile<Kind>)
//   seed_task(p, slot, ctx, acc)                  consumers: the accumulators' start
//   prepare_epilogue(p, slot, ctx)                consumers, before the K loop: what the epilogue needs
//   epilogue_task(p, list, slot, ctx, acc, prep, ring)
//                                                 consumers: the kind's epilogue (ring: the stage
//                                                 ring, for kinds with epilogue stages); false
//                                                 on a timed-out wait
//   done_counter(p, task)                         the tile's completion counter (or nullptr)
//   wait_stores_but_last(p, kind)                 thread 0: every bulk-store group but the last
//                                                 epilogue's (that of a task of `kind`) landed
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "comm/wait.cuh"
#include "gemm/sm90_roles.cuh"
#include "megakernel/forward_trace.cuh"
#include "megakernel/task_list.cuh"

namespace mok::megakernel {

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
  gemm::RowTile tile;   // the row kinds' tile
  gemm::KTile ktile;    // a weight-gradient task's tile (the fused backward's second phase)
  int k_steps;  // kEndOfTasks: no task left, the consumers stop
};
inline constexpr int kEndOfTasks = -1;
// The slots live in the barrier block's segment-table space (SharedStorage::seg_offsets): the
// fused kernel reads the segment table from global memory and never caches it there, and its
// shared memory is at the 227 KiB limit.
template <class C>
__device__ __forceinline__ TaskSlot* task_slots(gemm::SharedStorage<C>& ss) {
  static_assert(sizeof(TaskSlot) * C::kStages <= sizeof(gemm::SharedStorage<C>::seg_offsets),
                "one task slot per stage must fit in the barrier block");
  return reinterpret_cast<TaskSlot*>(ss.seg_offsets);
}
// The feeder -> producer queue (one entry), behind the stage slots in the same space.
struct TaskQueue {
  TaskSlot slot;
  alignas(8) uint64_t full;   // the feeder's arrive: the slot is written and its inputs exist
  alignas(8) uint64_t empty;  // the producer's arrive: the slot was read
};
template <class C>
inline constexpr int kTaskQueueOffset = (sizeof(TaskSlot) * C::kStages + 7) / 8 * 8;
template <class C>
__device__ __forceinline__ TaskQueue& task_queue(gemm::SharedStorage<C>& ss) {
  static_assert(kTaskQueueOffset<C> + sizeof(TaskQueue) <= sizeof(gemm::SharedStorage<C>::seg_offsets),
                "the task queue must fit behind the stage slots");
  return *reinterpret_cast<TaskQueue*>(reinterpret_cast<uint8_t*>(ss.seg_offsets) + kTaskQueueOffset<C>);
}
template <class C>
__device__ inline void init_task_queue(gemm::SharedStorage<C>& ss) {
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

// All K stages of one tile into the ring (the loop body of gemm::tma_producer), then the
// kind's epilogue stages (gemm::load_epilogue_stages). The slot goes with the first stage (see
// TaskSlot); a task without K steps sends one stage without loads.
template <class Kind, class Tile>
__device__ inline bool produce_tile_of(const typename Kind::Params& p, const TaskSlot& slot, const Tile& tile,
                                       gemm::SharedStorage<typename Kind::Cfg>& ss,
                                       gemm::PipeState<Kind::Cfg::kStages>& st) {
  using Cfg = typename Kind::Cfg;
  for (int k = 0; k < max(slot.k_steps, 1); ++k) {
    if (!gemm::wait_barrier(&ss.bars.empty[st.index], st.phase, p.err)) return false;
    if (k == 0) task_slots(ss)[st.index] = slot;
    if (slot.k_steps == 0) {
      cutlass::arch::ClusterBarrier::arrive(&ss.bars.full[st.index]);
    } else {
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.bars.full[st.index], Cfg::kStageBytes);
      Kind::load_stage(p, tile, k, ss.a[st.index], ss.b[st.index], &ss.bars.full[st.index], 0);
    }
    st.advance();
  }
  return gemm::load_epilogue_stages<Kind>(p, tile, ss, st);  // (the dh kinds' g, u; fp32 wgrad's main grad)
}
template <class Kind>
__device__ inline bool produce_tile(const typename Kind::Params& p, const TaskSlot& slot,
                                    gemm::SharedStorage<typename Kind::Cfg>& ss,
                                    gemm::PipeState<Kind::Cfg::kStages>& st) {
  return produce_tile_of<Kind>(p, slot, slot.tile, ss, st);
}

// After the last task: one stage without loads whose slot tells the consumers to stop. Every
// thread that arrives on a full barrier arrives (`arrive`: this thread does).
template <class C>
__device__ inline bool send_end_of_tasks(gemm::SharedStorage<C>& ss, gemm::PipeState<C::kStages>& st,
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

// The task hand-out (docs/megakernel.md, task_list.cuh): tasks in list order from one counter, so a task
// only waits on tasks handed out before it, and any CTA (a comm CTA done with its dispatch too)
// may take the next one. The counter's round trip, the tile's segment search (dependent global
// loads) and the wait for the task's inputs run here, one task ahead of the producer, so that
// none of them delays the stage ring (on the producer's path they cost 2-11 % at EP 1,
// docs/megakernel.md). `trace_cta`: this CTA's trace row.
template <class P>
__device__ inline void task_feeder(const P& p, const TaskList& list, gemm::SharedStorage<typename P::Cfg>& ss,
                                   int trace_cta) {
  (void)trace_cta;
  TaskQueue& q = task_queue(ss);
  const uint32_t n = static_cast<uint32_t>(list.size());
  uint32_t phase = 1;  // a fresh empty barrier counts as released
  for (int j = 0;; ++j) {
    if (!gemm::wait_barrier(&q.empty, phase, pass_err(p))) return;
    phase ^= 1u;
    const uint32_t i = atomicAdd(p.next_task, 1u);
    TaskSlot slot{};
    slot.k_steps = kEndOfTasks;
    if (i < n) {
      const Task t = list.at(static_cast<int>(i));
      slot = task_slot(p, t);
      MOK_FWD_TRACE(trace::task_stamp(p.trace, trace_cta, j, trace::kTaskWaitBegin);)
      wait_for_inputs(p, slot);
      MOK_FWD_TRACE(trace::task_stamp(p.trace, trace_cta, j, trace::kTaskWaitEnd);
                    trace::task_desc(p.trace, trace_cta, j, static_cast<int>(t.kind), t.minibatch, t.n_tile,
                                     t.row_tile, slot.tile.real_rows);)
    }
    q.slot = slot;
    cutlass::arch::ClusterBarrier::arrive(&q.full);  // release (CTA scope): the slot and the acquire above
    if (i >= n) return;
  }
}

template <class P>
__device__ inline void gemm_producer(const P& p, gemm::SharedStorage<typename P::Cfg>& ss) {
  TaskQueue& q = task_queue(ss);
  gemm::PipeState<P::Cfg::kStages> st;
  st.phase = 1;  // fresh empty barriers count as released
  for (uint32_t phase = 0;; phase ^= 1u) {
    if (!gemm::wait_barrier(&q.full, phase, pass_err(p))) return;
    const TaskSlot slot = q.slot;
    cutlass::arch::ClusterBarrier::arrive(&q.empty);
    if (slot.k_steps == kEndOfTasks) break;
    // NOTE: the feeder acquired the inputs; the queue's barrier orders that before this
    // thread's proxy fence and its TMA loads (async proxy).
    fence_proxy_async_global();
    if (!produce_task(p, slot, ss, st)) return;
  }
  send_end_of_tasks(ss, st, pass_err(p), true, true);
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

// A pass with a second phase of tasks of another MMA (the fused backward's weight gradients,
// P::kSecondPhase: tasks for which is_wgrad(kind), all after the first phase's in the list).
template <class P>
constexpr bool has_second_phase() {
  if constexpr (requires { P::kSecondPhase; }) {
    return P::kSecondPhase;
  } else {
    return false;
  }
}

// Where a consumer stopped its first phase: at the end slot, or (second_phase) at the first
// task of the second phase, its stage waited for but not consumed; `st` and `tasks` (the
// tasks this CTA ran, the trace's row index) continue there.
template <int Stages>
struct ConsumerExit {
  gemm::PipeState<Stages> st;
  int tasks = 0;
  bool second_phase = false;
};

// Consumer warpgroups (the body of gemm::consumer_warpgroup over the tasks the producer hands
// over, until its end slot or the first second-phase task; everything published at the end).
// `trace_cta`: this CTA's trace row.
template <class P>
__device__ inline ConsumerExit<P::Cfg::kStages> gemm_consumer(const P& p, const TaskList& list,
                                                              gemm::SharedStorage<typename P::Cfg>& ss,
                                                              int trace_cta) {
  using Cfg = typename P::Cfg;
  (void)trace_cta;
  ConsumerExit<Cfg::kStages> exit;
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
  bool has_fresh = false;
  TaskKind fresh_kind = TaskKind::kSharedGemm1;
  auto publish_all = [&] {  // thread 0: both tiles, after every store landed
    gemm::tma_store_wait_all_complete();
    pending.release();
    if (has_fresh) {
      pending.counter = fresh;
      pending.release();
      has_fresh = false;
    }
  };
  bool epilogue_timeout = false;
  const TaskSlot* slots = task_slots(ss);
  // NOTE: bounded by the list (a CTA takes at most all of it; the end slot ends the loop): with
  // no bound (for (;;)) ptxas serialised every wgmma of the kernel (C7518).
  const int n = list.size();
  int j = 0;
  for (; j < n; ++j) {
    MOK_FWD_TRACE(const bool stamp = ctid == 0; if (stamp) trace::task_stamp(p.trace, trace_cta, j, trace::kTaskTileBegin);)
    // The task arrives with its first stage (TaskSlot).
    if (ctx.tid == 0 && !cutlass::arch::ClusterBarrier::try_wait(&ss.bars.full[st.index], st.phase)) {
      publish_all();  // about to block on the producer: publish first
    }
    if (!gemm::wait_barrier(&ss.bars.full[st.index], st.phase, pass_err(p))) break;
    const TaskSlot slot = read_task_slot(slots[st.index]);
    if (slot.k_steps == kEndOfTasks) break;  // (its TileBegin stamp alone: the trace reader skips it)
    if constexpr (has_second_phase<P>()) {
      if (is_wgrad(slot.task.kind)) {  // (uniform: read_task_slot)
        exit.second_phase = true;
        break;
      }
    }
    const Task& t = slot.task;
    const int k_steps = slot.k_steps;
    seed_task(p, slot, ctx, acc);
    if (k_steps == 0) {  // the stage carried only the task
      gemm::release_stage(ss, st.index, ctx.tid);
      st.advance();
    }
    const auto prep = prepare_epilogue(p, slot, ctx);  // (before the K loop)
    // After this task's first batch (or once, without K steps): publish `pending` (its stores
    // are older than the last epilogue's groups), `fresh` moves up.
    const int publish_at = gemm::hook_slot(0, k_steps);
    auto during_k_loop = [&](int k) {
      if (k == publish_at && ctx.tid == 0 && has_fresh) {
        if (pending.counter != nullptr) {
          wait_stores_but_last(p, fresh_kind);
          pending.release();
        }
        pending.counter = fresh;
        has_fresh = false;
      }
    };
    if (!gemm::mma_mainloop<Cfg>(ss, st, k_steps, mma, tCrA, tCrB, acc, pass_err(p), ctx.tid, -1,
                                 during_k_loop)) {
      break;
    }
    MOK_FWD_TRACE(if (stamp) trace::task_stamp(p.trace, trace_cta, j, trace::kTaskMainloopEnd);)
    // (the kinds with epilogue stages take them from the ring)
    if (!epilogue_task(p, list, slot, ctx, acc, prep, gemm::EpilogueRing<Cfg>{ss, st, pass_err(p), ctx.tid})) {
      epilogue_timeout = true;  // reported after the loop (gemm::EpilogueRing)
      break;
    }
    if (ctx.tid == 0) {
      // (`pending` was published in this task's K loop, or at once when it had to block.)
      fresh = done_counter(p, t);
      has_fresh = true;
      fresh_kind = t.kind;
    }
    MOK_FWD_TRACE(if (stamp) trace::task_stamp(p.trace, trace_cta, j, trace::kTaskEpilogueEnd);)
  }
  if (epilogue_timeout) gemm::report_timeout_no_trap(pass_err(p));
  if (ctx.tid == 0) publish_all();  // (before a second phase too: its tasks may wait on other CTAs)
  exit.st = st;
  exit.tasks = j;
  return exit;
}

}  // namespace mok::megakernel
