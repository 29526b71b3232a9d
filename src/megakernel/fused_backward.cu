// The fused backward kernel (entry: role dispatch only), its hooks of the task roles, and its
// host launcher (fused_backward.hpp says what runs where).
#include "megakernel/fused_backward.hpp"

#include <algorithm>
#include <string>

#include "comm/barrier.cuh"
#include "comm/cuda_check.hpp"
#include "comm/roles.hpp"
#include "gemm/dgrad_params.cuh"
#include "gemm/gemm_host.hpp"
#include "gemm/wgrad_params.cuh"
#include "megakernel/backward_rows.cuh"
#include "megakernel/backward_wgrad.cuh"
#include "megakernel/fused_comm.cuh"
#include "megakernel/fused_roles.cuh"
#include "megakernel/persistent_grid.hpp"
#include "megakernel/task_roles.cuh"

namespace mok::megakernel {
namespace {

// The backward's tasks on the forward's task list: kSharedGemm1 / kGemm1 = dh + SwiGLU backward
// (shared / routed: the routed one with the router weights and the d topk_w parts), kSharedGemm2
// / kGemm2 = dx. The routed dh loads exactly as the plain one (same load_stage, same Cfg).
using DhKind = gemm::DgradHiddenKind<1>;
using DhRoutedKind = gemm::DgradHiddenRoutedKind<1>;
using DxKind = gemm::DgradInputKind<1>;
using BwdCfg = DhKind::Cfg;
static_assert(std::is_same_v<BwdCfg, DxKind::Cfg>, "one shared-memory layout serves both dgrad kinds");
static_assert(BwdCfg::kThreads == FusedCta::kThreads && BwdCfg::kSmemBytes == FusedCta::kSmemBytes,
              "the backward's CTAs have the forward's shape");

// d topk_w of each real row, pushed by the communication CTAs at EP >= 2 once its row tile's dh
// is complete (push_dtopk_row, as the staged path's push_dtopk).
struct DtopkPush {
  const comm::ScheduleHeader* header = nullptr;
  const comm::RowEntry* rows = nullptr;
  const float* parts = nullptr;  // [buffer_rows, col_tiles]
  int col_tiles = 0;
  size_t dtopk_offset = 0;  // SymmetricLayout::dtopk
  int topk = 0;
  const uint32_t* dh_done = nullptr;  // g1_done
  uint32_t dh_target = 0;
};

struct FusedBackwardParams {
  using Cfg = BwdCfg;
  gemm::DgradHiddenParams shared_dh, routed_dh;  // routed_dh.sched: the expert segments
  gemm::DgradInputParams shared_dx, routed_dx;
  gemm::WgradParams shared_wgrad, routed_wgrad;  // the second phase's tiles (tasks.*wgrad_tiles; backward_wgrad.cuh)
  TaskList tasks;
  int shared_tokens = 0;  // T
  int experts = 0;        // E_local
  uint32_t* s1_done = nullptr;  // shared dh row tiles (target 2 * shared_n1)
  uint32_t* g1_done = nullptr;  // routed dh row tiles (target 2 * n1): dx, the d topk_w push
  uint32_t* g2_done = nullptr;  // routed dx row tiles (target 2 * n2): the dx push
  const uint32_t* ready = nullptr;  // the dy pull's per-minibatch counters
  comm::ScheduleView view;
  comm::DispatchRole pull_dy;
  comm::CombineRole combine;  // dx rows -> the owners' slots, gated by g2_done
  comm::GroupBarrier combine_done;
  DtopkPush dtopk;
  comm::WaitContext wait;
  int comm_ctas = 0;
  int combine_ctas = 0;  // comm CTAs [0, combine_ctas) push and meet the ranks; the others join the GEMM work
  uint32_t* next_task = nullptr;
  MOK_FWD_TRACE(trace::Sink trace;)  // the developer trace (fused_backward: trace_begin)
};

// The kernel's parameters with the weight gradients' output mode (gemm::WgradMode: fp32 main
// grads added, or bf16 written; a compile-time choice, see WgradKind): the second phase.
template <int Mode>
struct FusedBackwardParamsOf : FusedBackwardParams {
  static constexpr bool kSecondPhase = true;
};

// ---- the backward's hooks of the task roles (task_roles.cuh) --------------------------------

__device__ __forceinline__ const gemm::ErrorSink& pass_err(const FusedBackwardParams& p) { return p.routed_dh.err; }
__device__ __forceinline__ const gemm::DgradHiddenParams& dh_params(const FusedBackwardParams& p, TaskKind k) {
  return is_shared(k) ? p.shared_dh : p.routed_dh;
}
__device__ __forceinline__ const gemm::DgradInputParams& dx_params(const FusedBackwardParams& p, TaskKind k) {
  return is_shared(k) ? p.shared_dx : p.routed_dx;
}

__device__ __forceinline__ const gemm::WgradParams& wgrad_params(const FusedBackwardParams& p, TaskKind k) {
  return k == TaskKind::kSharedWgrad ? p.shared_wgrad : p.routed_wgrad;
}

__device__ inline TaskSlot task_slot(const FusedBackwardParams& p, const Task& t) {
  TaskSlot s;
  s.task = t;
  if (is_wgrad(t.kind)) {
    s.ktile = wgrad_params(p, t.kind).sched.tile(t.n_tile, 0);
    s.k_steps = s.ktile.k_steps;
    return s;
  }
  s.tile = row_tile_of(p.routed_dh.sched, p.shared_tokens, 0, t);
  s.k_steps = is_gemm1(t.kind) ? DhKind::k_steps(dh_params(p, t.kind), s.tile) : DxKind::k_steps(dx_params(p, t.kind), s.tile);
  return s;
}

// Waits (one thread) until the task's inputs exist; a timed-out wait is recorded (dx is
// poisoned) and the task runs on whatever is there, so the kernel still ends.
__device__ inline void wait_for_inputs(const FusedBackwardParams& p, const TaskSlot& slot) {
  using comm::Scope;
  const Task& t = slot.task;
  switch (t.kind) {
    case TaskKind::kSharedGemm1:
      return;  // the shared expert's dy rows were staged before the kernel
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
    case TaskKind::kSharedWgrad:  // the shared dg, du: every S1 row tile (dy, hs and x exist before the kernel)
      for (int r = 0; r < p.tasks.shared_row_tiles; ++r) {
        if (!comm::wait_geq<Scope::kGpu>(p.s1_done + r, 2u * p.tasks.shared_n1, comm::WaitSite::kHiddenRowTile, p.wait)) {
          break;
        }
      }
      break;
    case TaskKind::kWgrad: {  // the expert's dy rows and dg, du: its minibatches' pulls, its G1 row tiles
      const int e = slot.ktile.expert;  // (task_slot found the tile)
      const int r0 = __ldg(p.routed_wgrad.sched.offsets + e) / kRowTile;
      const int r1 = __ldg(p.routed_wgrad.sched.offsets + e + 1) / kRowTile;
      const int per = p.tasks.tiles_per_minibatch;
      for (int m = r0 / per; r1 > r0 && m <= (r1 - 1) / per; ++m) {
        if (!comm::wait_minibatch_ready(p.ready, p.view, m, p.wait)) break;
      }
      for (int r = r0; r < r1; ++r) {
        if (!comm::wait_geq<Scope::kGpu>(p.g1_done + r, 2u * p.tasks.n1, comm::WaitSite::kHiddenRowTile, p.wait)) break;
      }
      break;
    }
  }
  fence_proxy_async_global();  // NOTE: generic or TMA writes of other CTAs before our TMA loads
}

template <int Mode>
__device__ inline bool produce_task(const FusedBackwardParamsOf<Mode>& p, const TaskSlot& slot,
                                    gemm::SharedStorage<BwdCfg>& ss, gemm::PipeState<BwdCfg::kStages>& st) {
  const TaskKind kind = slot.task.kind;
  if (is_wgrad(kind)) {
    using WKind = WgradTaskKind<Mode>;
    return produce_tile_of<WKind>(wgrad_params(p, kind), slot, slot.ktile, wgrad_storage<typename WKind::Cfg>(ss), st);
  }
  return is_gemm1(kind) ? produce_tile<DhKind>(dh_params(p, kind), slot, ss, st)
                        : produce_tile<DxKind>(dx_params(p, kind), slot, ss, st);
}

template <class Acc>
__device__ __forceinline__ void seed_task(const FusedBackwardParams& p, const TaskSlot& slot, const gemm::EpiCtx& ctx,
                                          Acc& acc) {
  DhKind::seed(p.routed_dh, slot.tile, ctx, acc);  // zeros (every row kind)
}

struct NoEpiloguePrep {};
__device__ __forceinline__ NoEpiloguePrep prepare_epilogue(const FusedBackwardParams&, const TaskSlot&,
                                                           const gemm::EpiCtx&) {
  return {};
}

// The dh kinds take the tile's saved g, u from the ring (their epilogue stages, produced by
// produce_tile after the K stages).
template <class Acc, class Ring>
__device__ __forceinline__ bool epilogue_task(const FusedBackwardParams& p, const TaskList&, const TaskSlot& slot,
                                              const gemm::EpiCtx& ctx, Acc& acc, NoEpiloguePrep, const Ring& ring) {
  bool ok = true;
  switch (slot.task.kind) {
    case TaskKind::kSharedGemm1:
      ok = DhKind::epilogue(p.shared_dh, slot.tile, ctx, acc, ring);
      break;
    case TaskKind::kGemm1:
      ok = DhRoutedKind::epilogue(p.routed_dh, slot.tile, ctx, acc, ring);
      // NOTE: every thread's d topk_w parts (generic stores) before thread 0 publishes the tile
      // (the comm CTAs read them after acquiring g1_done).
      gemm::named_barrier_sync(ctx.barrier_id(), gemm::kWarpGroupThreads);
      break;
    default:
      DxKind::epilogue(dx_params(p, slot.task.kind), slot.tile, ctx, acc);
      break;
  }
  return ok;
}

// Bulk-store groups each epilogue commits (one per store_round): dh stores dg and du of two
// 128-column halves; dx two 128-column halves.
inline constexpr int kDhStoreGroups = 4;
inline constexpr int kDxStoreGroups = 2;
__device__ __forceinline__ void wait_stores_but_last(const FusedBackwardParams&, TaskKind last) {
  if (is_gemm1(last)) bulk_wait_all_but<kDhStoreGroups>(); else bulk_wait_all_but<kDxStoreGroups>();
}

__device__ __forceinline__ uint32_t* done_counter(const FusedBackwardParams& p, const Task& t) {
  switch (t.kind) {
    case TaskKind::kSharedGemm1: return p.s1_done + t.row_tile;
    case TaskKind::kGemm1: return p.g1_done + t.row_tile;
    case TaskKind::kGemm2: return p.g2_done + t.row_tile;
    case TaskKind::kSharedGemm2: return nullptr;  // read after the kernel only
    default: return nullptr;  // weight gradients (the second phase publishes nothing)
  }
  return nullptr;
}

// ---- communication CTAs ---------------------------------------------------------------------

// d topk_w of the rows of row tiles cta, cta + nctas, ... once each tile's dh is complete.
__device__ inline void push_dtopk_tiles(const FusedBackwardParams& p, int cta, int nctas) {
  const DtopkPush& d = p.dtopk;
  if (d.header->status != static_cast<int32_t>(Status::kOk)) return;  // poisoned schedule
  const int64_t tiles = d.header->padded_rows / kRowTile;
  for (int64_t t = cta; t < tiles; t += nctas) {
    int ok = 1;
    if (threadIdx.x == 0) {
      ok = comm::wait_geq<comm::Scope::kGpu>(d.dh_done + t, d.dh_target, comm::WaitSite::kHiddenRowTile, p.wait);
    }
    if (__syncthreads_and(ok) == 0) return;  // recorded; dx and d topk_w are poisoned
    for (int r = threadIdx.x; r < kRowTile; r += blockDim.x) {
      const int64_t row = t * kRowTile + r;
      const comm::RowEntry e = d.rows[row];
      if (e.src_rank >= 0) push_dtopk_row(e, row, d.parts, d.col_tiles, p.combine.peers, d.dtopk_offset, d.topk);
    }
  }
}

// Pull the dy rows; then (the first combine_ctas) push the dx rows and d topk_w to their owners
// and meet every rank at a barrier, or (the others) return true: the CTA then takes GEMM tasks.
// No start barrier: the x pull before the kernel met every rank after its staging.
__device__ bool backward_comm_cta(const FusedBackwardParams& p, int cta) {
  MOK_FWD_TRACE(trace::comm_stamp(p.trace, cta, trace::kCommStart);)
  dispatch_rows_pull<FusedCta::kWarps>(p.pull_dy, cta, p.comm_ctas);
  MOK_FWD_TRACE(__syncthreads(); trace::comm_stamp(p.trace, cta, trace::kCommDispatchEnd);)
  if (cta >= p.combine_ctas) return true;
  const int n = p.combine_ctas;
  combine_rows_push<FusedCta::kWarps>(p.combine, cta, n);
  push_dtopk_tiles(p, cta, n);
  MOK_FWD_TRACE(__syncthreads(); trace::comm_stamp(p.trace, cta, trace::kCommCombineEnd);)
  group_barrier_all(p.combine_done, static_cast<uint32_t>(n), p.combine.peers, p.wait);
  MOK_FWD_TRACE(trace::comm_stamp(p.trace, cta, trace::kCommBarrier2);)
  return false;
}

// ---- GEMM CTAs and the kernel ---------------------------------------------------------------

// trace_cta: this CTA's trace row (the developer trace build).
template <int Mode>
__device__ void backward_gemm_cta(const FusedBackwardParamsOf<Mode>& p, uint8_t* smem_raw, int trace_cta) {
  auto* ss = reinterpret_cast<gemm::SharedStorage<BwdCfg>*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                                             ~uintptr_t(1023));
  if (threadIdx.x == 0) {
    ss->bars.init(gemm::empty_barrier_arrivals<BwdCfg>());
    init_task_queue(*ss);
    DhKind::prefetch_descriptors(p.routed_dh);
    DxKind::prefetch_descriptors(p.routed_dx);
    if (p.tasks.shared_wgrad_tiles > 0) WgradTaskKind<Mode>::prefetch_descriptors(p.shared_wgrad);
    if (p.tasks.wgrad_tiles > 0) WgradTaskKind<Mode>::prefetch_descriptors(p.routed_wgrad);
  }
  __syncthreads();
  TaskList list = p.tasks;
  list.set_routed_rows(p.routed_dh.sched.offsets, p.experts);
  const int warpgroup = threadIdx.x / gemm::kWarpGroupThreads;
  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<BwdCfg::kProducerRegs>();
    if (threadIdx.x == 0) {
      gemm_producer(p, *ss);
    } else if (threadIdx.x == 32) {
      task_feeder(p, list, *ss, trace_cta);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<BwdCfg::kConsumerRegs>();
    const ConsumerExit<BwdCfg::kStages> exit = gemm_consumer(p, list, *ss, trace_cta);
    if (exit.second_phase) wgrad_consumer<Mode>(p, *ss, exit, list.size(), trace_cta);
  }
}

template <int Mode>
__global__ void __launch_bounds__(FusedCta::kThreads, 1)
    fused_backward_kernel(const __grid_constant__ FusedBackwardParamsOf<Mode> p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ uint8_t smem_raw[];
  const int cta = static_cast<int>(blockIdx.x);
  bool gemm = cta >= p.comm_ctas;
  int trace_row = cta - p.comm_ctas;  // GEMM CTAs first, then the comm CTAs that join (as the forward)
  if (!gemm && backward_comm_cta(p, cta)) {
    __syncthreads();  // NOTE: the comm code's end in every thread before the GEMM role's barriers
    gemm = true;
    trace_row = static_cast<int>(gridDim.x) - p.comm_ctas + cta;
  }
  if (gemm) backward_gemm_cta(p, smem_raw, trace_row);  // NOTE: one call site, inlined (ptxas C7510 otherwise)
#endif
}

// ---- host -----------------------------------------------------------------------------------

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <int Mode>
PersistentKernel persistent_kernel() {
  return PersistentKernel{reinterpret_cast<const void*>(fused_backward_kernel<Mode>), FusedCta::kThreads,
                          FusedCta::kSmemBytes, "fused backward"};
}

// The kernel instance of the weight gradients' mode (fp32 without weight-gradient tasks).
int wgrad_mode(const WeightGrads& g, bool tasks) {
  return tasks && g.mode == GradMode::kWriteBf16 ? gemm::kWgradWriteBf16 : gemm::kWgradAccumulateFp32;
}

int resolve_grid(const FusedBackwardOptions& o, int mode) {
  const PersistentKernel k = mode == gemm::kWgradWriteBf16 ? persistent_kernel<gemm::kWgradWriteBf16>()
                                                           : persistent_kernel<gemm::kWgradAccumulateFp32>();
  const int grid = resolve_persistent_grid(k, o.grid, o.comm_ctas, "Config.comm_sms_backward");
  if (!(o.timeout_s > 0)) throw_invalid("FusedBackwardOptions.timeout_s", "> 0", std::to_string(o.timeout_s));
  return grid;
}

// wgrad: the weight gradients as the kernel's second phase (nullptr: launches after it, or deferred).
FusedBackwardParams make_params(comm::CommState& state, ForwardBuffers& fwd, BackwardBuffers& bwd,
                                const SavedContext& used, const BackwardArgs& args, const ExpertWeights& w,
                                const GradInputs& out, const FusedBackwardOptions& o, int grid,
                                const WeightGrads* wgrad) {
  const LayerShape& s = state.shape();
  const comm::ScheduleView& v = used.schedule;
  const comm::SymmetricLayout& layout = state.layout();
  const int64_t H = s.hidden, I = s.intermediate, S = s.shared_intermediate, E = s.local_experts();
  const int64_t R = bwd.buffer_rows;
  const gemm::Launch launch = gemm_launch(fwd, grid, o.timeout_s);
  const gemm::ErrorSink err{fwd.gemm_error.get(), static_cast<uint64_t>(o.timeout_s * 1e9)};
  FusedBackwardParams p{};
  if (s.has_shared()) {
    const gemm::Segments seg{fwd.shared_offsets.get(), fwd.shared_rows_dev.get(), 1, fwd.shared_rows};
    p.shared_dh = gemm::dgrad_hidden_params(
        {seg, H, S, bwd.shared_dy.get(), w.shared_down, used.shared_g, used.shared_u, out.shared_dg, out.shared_du},
        launch);
    p.shared_dx = gemm::dgrad_input_params(
        {seg, H, S, out.shared_dg, out.shared_du, w.shared_gate, w.shared_up, bwd.shared_dx.get()}, launch);
    p.shared_dh.err = p.shared_dx.err = err;
  }
  const gemm::Segments seg{used.seg_offsets, used.seg_rows, static_cast<int>(E), R};
  gemm::DgradHiddenArgs dh{seg, H, I, bwd.dy_rows.get(), w.down, used.g, used.u, out.dg, out.du};
  dh.w_down_stride = w.down_expert_stride;
  dh.row_w = bwd.row_w.get();
  dh.dw_part = bwd.dw_part.get();
  p.routed_dh = gemm::dgrad_hidden_params(dh, launch);
  p.routed_dx = gemm::dgrad_input_params(
      {seg, H, I, out.dg, out.du, w.gate, w.up, bwd.dx_rows.get(), w.gate_expert_stride, w.up_expert_stride}, launch);
  p.routed_dh.err = p.routed_dx.err = err;

  const comm::DispatchRole pull = state.dispatch_role(/*dedup=*/true, v);
  p.tasks.shared_row_tiles = s.has_shared() ? static_cast<int>(fwd.shared_rows / kRowTile) : 0;
  p.tasks.shared_n1 = static_cast<int>(ceil_div(S, 256));
  p.tasks.n1 = static_cast<int>(ceil_div(I, 256));
  p.tasks.n2 = static_cast<int>(ceil_div(H, 256));
  p.tasks.tiles_per_minibatch = static_cast<int>(pull.tiles_per_minibatch);
  p.tasks.group_m = gemm::kGroupM;
  p.shared_tokens = static_cast<int>(v.tokens);
  p.experts = static_cast<int>(E);
  const int64_t shared_tiles = fwd.shared_rows / kRowTile, routed_tiles = R / kRowTile;
  if (static_cast<int64_t>(fwd.tile_counters.size()) < shared_tiles + 2 * routed_tiles + 1) {
    throw Error(Status::kInternal, "mok fused backward: the workspace's tile counters are too few for its row buffer");
  }
  p.s1_done = fwd.tile_counters.get();
  p.g1_done = p.s1_done + shared_tiles;
  p.g2_done = p.g1_done + routed_tiles;
  p.next_task = p.g2_done + routed_tiles;
  p.ready = pull.ready;
  p.view = v;
  p.wait = state.wait_context();
  p.comm_ctas = o.comm_ctas;
  // At EP 1 nothing moves after the pull (the own rows' dx is read in place by the sum, d topk_w
  // is pushed after the kernel): every comm CTA joins the GEMM work. At EP >= 2 all of them push.
  p.combine_ctas = s.ep == 1 ? 0 : o.comm_ctas;

  p.pull_dy = pull;
  p.pull_dy.x_offset = layout.dy;
  p.pull_dy.row_buffer = reinterpret_cast<char*>(bwd.dy_rows.get());
  if (pulls_read_in_place(s, args)) p.pull_dy.own_x = reinterpret_cast<const char*>(args.dy);  // as backward_prologue
  p.combine = state.combine_role(bwd.dx_rows.get(), /*own_rows_in_place=*/true, v);
  p.combine.out_ready = p.g2_done;
  p.combine.out_ready_target = 2u * static_cast<uint32_t>(p.tasks.n2);
  p.dtopk = DtopkPush{v.header, v.rows, bwd.dw_part.get(), static_cast<int>(bwd.col_tiles), layout.dtopk,
                      static_cast<int>(s.topk), p.g1_done, 2u * static_cast<uint32_t>(p.tasks.n1)};
  if (p.combine_ctas > 0) p.combine_done = state.barrier(comm::SyncSite::kCombineDone);
  if (wgrad != nullptr) {  // the launches' own parameters (backward_gemms: the same problems)
    int64_t tiles = 0;
    if (s.has_shared()) {
      p.shared_wgrad = gemm::wgrad_params(backward_wgrad_args(state, fwd, bwd, used, *wgrad, out, true), launch, &tiles);
      p.shared_wgrad.err = err;
      p.tasks.shared_wgrad_tiles = static_cast<int>(tiles);
    }
    p.routed_wgrad = gemm::wgrad_params(backward_wgrad_args(state, fwd, bwd, used, *wgrad, out, false), launch, &tiles);
    p.routed_wgrad.err = err;
    p.tasks.wgrad_tiles = static_cast<int>(tiles);
  }
  return p;
}

template <int Mode>
void launch_kernel(const FusedBackwardParams& base, int grid, cudaStream_t stream) {
  FusedBackwardParamsOf<Mode> p;
  static_cast<FusedBackwardParams&>(p) = base;
  fused_backward_kernel<Mode><<<grid, FusedCta::kThreads, FusedCta::kSmemBytes, stream>>>(p);
  MOK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void fused_backward(comm::CommState& state, ForwardBuffers& fwd, BackwardBuffers& bwd, const SavedContext& saved,
                    const BackwardArgs& args, const ExpertWeights& w, const WeightGrads& grads,
                    const FusedBackwardOptions& o, cudaStream_t stream, const GradInputs* defer) {
  const LayerShape& s = state.shape();
  if (defer == nullptr) check_grads(s, grads);  // bad arguments throw before anything is enqueued
  const bool wgrad_tasks = defer == nullptr && o.wgrad_in_kernel;
  const int mode = wgrad_mode(grads, wgrad_tasks);
  const int grid = resolve_grid(o, mode);
  MOK_FWD_TRACE(const trace::Sink sink = trace_begin(grid, o.comm_ctas, 0, stream);)
  StagedBackwardOptions steps;  // the launches before and after the kernel
  steps.comm_ctas = o.prologue_ctas;
  steps.gemm_grid = o.grid;
  steps.timeout_s = o.timeout_s;
  const SavedContext used = backward_prologue(state, fwd, bwd, saved, args, w, steps, /*pull_dy=*/false, stream);
  const GradInputs out = defer != nullptr ? *defer : GradInputs::scratch(bwd);
  // hs = bf16(w h) from g, u before dh may overwrite them (a deferring backward's dg, du go in place of g, u).
  backward_gemms(state, fwd, bwd, used, w, WeightGrads{}, steps, /*with_hs=*/true, stream, /*parts=*/0u, &out);
  FusedBackwardParams p = make_params(state, fwd, bwd, used, args, w, out, o, grid, wgrad_tasks ? &grads : nullptr);
  const comm::ScheduleBuffers& sb = state.schedule_buffers();
  const size_t ready_words = sb.max_minibatches + sb.buffer_rows / kRowTile + 1;
  MOK_CUDA_CHECK(cudaMemsetAsync(state.ready_counters(), 0, ready_words * sizeof(uint32_t), stream));
  MOK_CUDA_CHECK(cudaMemsetAsync(fwd.tile_counters.get(), 0, fwd.tile_counters.bytes(), stream));
  MOK_FWD_TRACE(p.trace = sink; trace_event(1, stream);)
  if (mode == gemm::kWgradWriteBf16) {
    launch_kernel<gemm::kWgradWriteBf16>(p, grid, stream);
  } else {
    launch_kernel<gemm::kWgradAccumulateFp32>(p, grid, stream);
  }
  MOK_FWD_TRACE(trace_event(2, stream);)
  if (defer == nullptr && !wgrad_tasks) {
    backward_gemms(state, fwd, bwd, used, w, grads, steps, /*with_hs=*/false, stream, kSharedWgrad | kRoutedWgrad,
                   &out);
  }
  backward_finish(state, bwd, used.schedule, args, steps, /*push_dtopk_rows=*/s.ep == 1, /*combine=*/false, stream);
  MOK_FWD_TRACE(trace_event(3, stream);)
}

}  // namespace mok::megakernel
