// The fused backward's second phase: the K-grouped weight gradients as tasks of the kernel
// (fused_backward.cu). After every dgrad task of the list come the shared expert's weight-gradient
// tiles, then the routed experts' (task_list.cuh: kSharedWgrad, kWgrad), each exactly a tile of
// the standalone wgrad launch (gemm/sm90_kinds_wgrad.cuh: same tensor maps from
// gemm/wgrad_params.cuh, same K range and order, same epilogue arithmetic), so the weight
// gradients have the bits of the launches after the kernel:
//   - the feeder waits for what a tile reads: the shared dg, du (every S1 row tile) or the
//     expert's dg, du and dy rows (its G1 row tiles, its minibatches' pull counters); x, hs and
//     the shared dy exist before the kernel;
//   - the producer loads its K stages (MN-major 64 x 64 boxes of both operands) and, with fp32
//     main grads, the main-grad block as four epilogue stages (WgradKind's stage ring);
//   - the consumers leave the dgrad loop at the first such task (gemm_consumer, ConsumerExit:
//     everything published) and run this loop with the MN-major MMA over the same stage ring.
//     The bf16 epilogue is deferred as in the standalone kind: a tile's result is packed after its
//     K loop and stored in two pieces during the next tile's K loop (WgradParams::defer_round0 /
//     defer_round1, warpgroup 1 kDeferWg1Shift batches later); the fp32 one takes its main-grad
//     stages from the ring right after the K loop.
// Nothing in the kernel waits on a weight-gradient tile: their stores only have to land before
// the kernel ends.
#pragma once

#include "gemm/sm90_kinds_wgrad.cuh"
#include "megakernel/task_roles.cuh"

namespace mok::megakernel {

// The kind a weight-gradient task runs: zeros seed (a backward never continues a partial).
template <int Mode>
using WgradTaskKind = gemm::WgradKind<Mode, 1, /*Seeded=*/false>;

// The second phase reads and writes the same shared memory as the dgrad tasks: only the MMA's
// view of the operand tiles differs (MN-major A).
template <class RowCfg, class WCfg>
constexpr bool same_storage() {
  return RowCfg::kStages == WCfg::kStages && RowCfg::kABytes == WCfg::kABytes && RowCfg::kBBytes == WCfg::kBBytes &&
         RowCfg::kEpiBytesPerWG == WCfg::kEpiBytesPerWG && RowCfg::kConsumerWGs == WCfg::kConsumerWGs &&
         RowCfg::kBarrierBytes == WCfg::kBarrierBytes && RowCfg::kClusterM == WCfg::kClusterM &&
         sizeof(gemm::SharedStorage<RowCfg>) == sizeof(gemm::SharedStorage<WCfg>);
}
template <class WCfg, class RowCfg>
__device__ __forceinline__ gemm::SharedStorage<WCfg>& wgrad_storage(gemm::SharedStorage<RowCfg>& ss) {
  static_assert(same_storage<RowCfg, WCfg>(), "the weight-gradient tasks use the dgrad tasks' shared memory");
  return reinterpret_cast<gemm::SharedStorage<WCfg>&>(ss);
}

// A weight-gradient task's slot as the consumers use it: every field from lane 0 (read_task_slot).
__device__ __forceinline__ TaskSlot read_wgrad_slot(const TaskSlot& in) {
  auto u = [](int v) { return __shfl_sync(0xffffffffu, v, 0); };
  TaskSlot s;
  s.task = Task{static_cast<TaskKind>(u(static_cast<int>(in.task.kind))), 0, u(in.task.n_tile), 0};
  s.ktile.problem = u(in.ktile.problem);
  s.ktile.expert = u(in.ktile.expert);
  s.ktile.m_tile = u(in.ktile.m_tile);
  s.ktile.n_tile = u(in.ktile.n_tile);
  s.ktile.row0 = u(in.ktile.row0);
  s.ktile.k_steps = u(in.ktile.k_steps);
  s.ktile.phantom = false;  // no clusters
  s.ktile.shared_b = false;
  s.k_steps = u(in.k_steps);
  return s;
}

// The consumers' second phase: weight-gradient tasks from where the dgrad loop stopped
// (`exit.st`: the first one's stage, already waited for) until the end slot. P (the fused
// backward's parameters) has shared_wgrad, routed_wgrad and the trace. A timed-out wait is
// recorded; the loop ends (the stores still land).
template <int Mode, class P, class RowCfg>
__device__ inline void wgrad_consumer(const P& p, gemm::SharedStorage<RowCfg>& rss, ConsumerExit<RowCfg::kStages> exit,
                                      int n, int trace_cta) {
  using Kind = WgradTaskKind<Mode>;
  using WCfg = typename Kind::Cfg;
  (void)trace_cta;
  gemm::SharedStorage<WCfg>& ss = wgrad_storage<WCfg>(rss);
  const gemm::ErrorSink& err = pass_err(p);
  const int ctid = threadIdx.x - gemm::kWarpGroupThreads;
  auto mma = gemm::make_consumer_mma<WCfg>();
  auto thr = mma.get_thread_slice(ctid);
  auto tCrA = thr.make_fragment_A(thr.partition_A(gemm::smem_a(ss)));
  auto tCrB = thr.make_fragment_B(thr.partition_B(gemm::smem_b(ss)));
  auto acc = cute::partition_fragment_C(mma, cute::make_shape(cute::Int<WCfg::kBM>{}, cute::Int<WCfg::kBN>{}));
  const gemm::EpiCtx ctx = gemm::make_epi_ctx(ss, ctid / gemm::kWarpGroupThreads, ctid % gemm::kWarpGroupThreads);
  gemm::PipeState<WCfg::kStages> st = exit.st;
  const TaskSlot* slots = task_slots(ss);
  bool epilogue_timeout = false, ok = true;
  // bf16: the tile whose store waits for the next K loop (its params: shared or routed).
  constexpr bool kDeferred = Mode == gemm::kWgradWriteBf16;
  struct Waiting {
    typename Kind::Packed packed;
    typename Kind::Pending where;
    bool on = false, shared = false;
  };
  [[maybe_unused]] Waiting waiting;
  // Warp-uniform (shuffled): a threadIdx-derived value near wgmma serialises it (C7518).
  [[maybe_unused]] const int wg1_shift = __shfl_sync(0xffffffffu, ctx.wg == 1 ? p.routed_wgrad.defer_wg1_shift : 0, 0);
  auto store_piece = [&]<int P>(std::integral_constant<int, P>) {
    if constexpr (kDeferred) {
      const gemm::WgradParams& wp = waiting.shared ? p.shared_wgrad : p.routed_wgrad;
      Kind::template store_piece<P>(wp, waiting.where, ctx, waiting.packed);
    }
  };
  // NOTE: bounded by the list, as gemm_consumer's loop (C7518 otherwise).
  for (int j = exit.tasks; j < n; ++j) {
    MOK_FWD_TRACE(const bool stamp = ctid == 0; if (stamp) trace::task_stamp(p.trace, trace_cta, j, trace::kTaskTileBegin);)
    if (!gemm::wait_barrier(&ss.bars.full[st.index], st.phase, err)) {
      ok = false;  // (recorded)
      break;
    }
    const TaskSlot slot = read_wgrad_slot(slots[st.index]);
    if (slot.k_steps == kEndOfTasks) break;
    // NOTE: by reference (grid-constant parameter space), never by value.
    const gemm::WgradParams& wp = slot.task.kind == TaskKind::kSharedWgrad ? p.shared_wgrad : p.routed_wgrad;
    const gemm::KTile& t = slot.ktile;
    Kind::seed(wp, t, ctx, acc);  // zeros
    if (slot.k_steps == 0) {  // the stage carried only the task (an expert without rows)
      gemm::release_stage(ss, st.index, ctx.tid);
      st.advance();
    }
    const int slot0 = gemm::hook_slot(p.routed_wgrad.defer_round0 + wg1_shift, slot.k_steps);
    const int slot1 = gemm::hook_slot(p.routed_wgrad.defer_round1 + wg1_shift, slot.k_steps);
    auto during_k_loop = [&](int k) {  // the waiting tile's two store pieces
      if constexpr (kDeferred) {
        if (waiting.on && k == slot0) store_piece(std::integral_constant<int, 0>{});
        if (waiting.on && k == slot1) store_piece(std::integral_constant<int, 1>{});
      }
    };
    if (!gemm::mma_mainloop<WCfg>(ss, st, slot.k_steps, mma, tCrA, tCrB, acc, err, ctx.tid, -1, during_k_loop)) {
      ok = false;
      break;
    }
    MOK_FWD_TRACE(if (stamp) trace::task_stamp(p.trace, trace_cta, j, trace::kTaskMainloopEnd);)
    if constexpr (Mode == gemm::kWgradAccumulateFp32) {
      if (!Kind::epilogue(wp, t, ctx, acc, gemm::EpilogueRing<WCfg>{ss, st, err, ctx.tid})) {
        epilogue_timeout = true;
        break;
      }
    } else {
      static_assert(Mode == gemm::kWgradWriteBf16, "weight gradients are added into fp32 or written bf16");
      Kind::pack(wp, t, ctx, acc, waiting.packed);
      waiting.where = Kind::pending_of(t);
      waiting.shared = slot.task.kind == TaskKind::kSharedWgrad;
      waiting.on = true;
    }
    MOK_FWD_TRACE(if (stamp) trace::task_stamp(p.trace, trace_cta, j, trace::kTaskEpilogueEnd);)
  }
  if constexpr (kDeferred) {
    if (ok && waiting.on) {
      store_piece(std::integral_constant<int, 0>{});
      store_piece(std::integral_constant<int, 1>{});
    }
  }
  if (epilogue_timeout) gemm::report_timeout_no_trap(err);
  if (ctx.tid == 0) gemm::tma_store_wait_all_complete();  // the shared memory outlives the stores' reads
}

}  // namespace mok::megakernel
