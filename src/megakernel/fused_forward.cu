// The fused forward kernel (entry: role dispatch only) and its host launcher.
#include "megakernel/fused_forward.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "comm/barrier.cuh"
#include "comm/cuda_check.hpp"
#include "gemm/gemm_host.hpp"
#include "megakernel/fused_comm.cuh"
#include "megakernel/fused_roles.cuh"
#include "megakernel/persistent_grid.hpp"

namespace mok::megakernel {
namespace {

// ---- kernel ---------------------------------------------------------------------------------

// Communication CTAs: dispatch (after the "x staged everywhere" barrier); then either combine
// (each row tile once GEMM 2 published it; with GEMM 2's epilogues pushing: wait for every tile,
// or with the fused sum count each pushed row per token) and the barrier after which every
// rank's slots hold every row (with the fused sum: sum tokens instead), or (the last
// comm_ctas - combine_ctas of them) return true: the CTA then takes GEMM tasks like a GEMM
// CTA. A failed barrier (timeout, recorded) skips the role; waiters give up at once.
__device__ bool comm_cta(const FusedForwardParams& p, int cta) {
  const uint32_t n = static_cast<uint32_t>(p.comm_ctas);
  MOK_FWD_TRACE(trace::comm_stamp(p.trace, cta, trace::kCommStart);)
  if (group_barrier_all(p.dispatch_start, n, p.dispatch.peers, p.wait)) {
    MOK_FWD_TRACE(trace::comm_stamp(p.trace, cta, trace::kCommBarrier1);)
    if (p.help_tiles > 0) {
      dispatch_rows_pull_helped<FusedCta::kWarps>(p.dispatch, p.help_tiles, cta, static_cast<int>(n),
                                                  static_cast<int>(gridDim.x));
    } else {
      dispatch_rows_pull<FusedCta::kWarps>(p.dispatch, cta, static_cast<int>(n));
    }
  }
  MOK_FWD_TRACE(__syncthreads(); trace::comm_stamp(p.trace, cta, trace::kCommDispatchEnd);)
  if (cta >= p.combine_ctas) return true;
  const uint32_t nc = static_cast<uint32_t>(p.combine_ctas);
  if (p.push.on && p.topk.on) {
    // GEMM 2's epilogues pushed the rows; the fused sum takes each token once they are counted.
    count_pushed_rows<FusedCta::kWarps>(p.combine, cta, static_cast<int>(nc));
  } else if (p.push.on) {
    wait_routed_tiles_final(p.combine);  // GEMM 2's epilogues pushed the rows (fused_push.cuh)
  } else {
    combine_rows_push<FusedCta::kWarps>(p.combine, cta, static_cast<int>(nc));
  }
  MOK_FWD_TRACE(__syncthreads(); trace::comm_stamp(p.trace, cta, trace::kCommCombineEnd);)
  if (p.topk.on) {
    // Each token is summed once its rows arrived (counted per token): no barrier of all ranks.
    topk_sum_warp<4>(p.topk, p.wait);
  } else {
    group_barrier_all(p.combine_done, nc, p.combine.peers, p.wait);
  }
  MOK_FWD_TRACE(__syncthreads(); trace::comm_stamp(p.trace, cta, trace::kCommBarrier2);)
  return false;
}

// A GEMM CTA's consumer warps take their share of the first row tiles of the dispatch
// (FusedForwardParams::help_tiles) once x is staged on every rank (the comm CTAs' first group
// barrier opened), then go to their tasks. Each warp waits for the barrier itself (lane 0's
// acquire, then __syncwarp, orders the warp's reads of x after it); no CTA barrier.
__device__ void gemm_cta_help_dispatch(const FusedForwardParams& p, int cta, int ctas) {
  constexpr int kConsumerWarps = Cfg::kConsumerThreads / 32;
  int ok = 1;
  if (threadIdx.x % 32 == 0) {
    ok = comm::wait_geq<comm::Scope::kGpu>(p.dispatch_start.open_flag, 1u, comm::WaitSite::kGroupArrive, p.wait);
  }
  if (__shfl_sync(0xffffffffu, ok, 0) == 0) return;  // recorded; y is poisoned, the tasks still end
  const int warp = (threadIdx.x - gemm::kWarpGroupThreads) / 32;
  dispatch_fanout_shared_start<kConsumerWarps>(p.dispatch, p.help_tiles, p.comm_ctas + cta, p.comm_ctas + ctas, warp);
}

// GEMM CTAs: warpgroup 0 produces (thread 0 the TMA loads, thread 32 feeds it the tasks), 1-2
// consume (as the standalone GEMM kernel). Each role is one branch, as setmaxnreg requires.
// cta / ctas: this GEMM CTA's index and the GEMM CTA count (the help dispatch; -1 for a comm CTA
// that joins, which has done its dispatch share); trace_cta: its trace row.
__device__ void gemm_cta(const FusedForwardParams& p, uint8_t* smem_raw, int cta, int ctas, int trace_cta, bool help) {
  auto* ss = reinterpret_cast<gemm::SharedStorage<Cfg>*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                                          ~uintptr_t(1023));
  if (threadIdx.x == 0) {
    ss->bars.init(gemm::empty_barrier_arrivals<Cfg>());
    init_task_queue(*ss);
    G1Kind::prefetch_descriptors(p.routed1);
    G2Kind::prefetch_descriptors(p.routed2);
  }
  __syncthreads();
  TaskList list = p.tasks;
  list.set_routed_rows(p.routed1.sched.offsets, p.experts);
  const int warpgroup = threadIdx.x / gemm::kWarpGroupThreads;
  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    if (threadIdx.x == 0) {
      gemm_producer(p, *ss);
    } else if (threadIdx.x == 32) {
      task_feeder(p, list, *ss, trace_cta);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
    if (help && p.help_tiles > 0) {
      gemm_cta_help_dispatch(p, cta, ctas);
      // NOTE: the warpgroup reconverges (its epilogue barrier) before any wgmma: without it
      // ptxas serialised every wgmma after the dispatch's lane-divergent code (C7518)
      gemm::named_barrier_sync(
          static_cast<uint32_t>(warpgroup == 1 ? gemm::NamedBarrier::kEpilogueWG0 : gemm::NamedBarrier::kEpilogueWG1),
          gemm::kWarpGroupThreads);
    }
    gemm_consumer(p, list, *ss, trace_cta);
    topk_sum_warp<8>(p.topk, p.wait);  // the tail of the pass: what is left of the sum
  }
}

__global__ void __launch_bounds__(FusedCta::kThreads, 1)
    fused_forward_kernel(const __grid_constant__ FusedForwardParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ uint8_t smem_raw[];
  const int cta = static_cast<int>(blockIdx.x);
  const int gemm_ctas = static_cast<int>(gridDim.x) - p.comm_ctas;
  bool gemm = cta >= p.comm_ctas;
  int g = cta - p.comm_ctas, trace_row = g;
  if (!gemm && comm_cta(p, cta)) {  // a comm CTA that joins the GEMM work
    // NOTE: the barrier ends this CTA's comm code (and its use of shared memory) in every
    // thread before the GEMM role initialises its barriers there.
    __syncthreads();
    gemm = true;
    g = -1;
    trace_row = gemm_ctas + cta;
  }
  // NOTE: one call site, so that gemm_cta is inlined: a call would cross the wgmma pipeline
  // (ptxas C7510 serialises every wgmma then).
  if (gemm) gemm_cta(p, smem_raw, g, gemm_ctas, trace_row, g >= 0);
#endif
}

// ---- host -----------------------------------------------------------------------------------

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

PersistentKernel forward_kernel() {
  return {reinterpret_cast<const void*>(fused_forward_kernel), FusedCta::kThreads, FusedCta::kSmemBytes,
          "fused forward"};
}

// What one pass runs, resolved from the options and the workspace before anything is enqueued
// (bad options throw first, naming the option).
struct Plan {
  FusedForwardOptions o;
  int grid = 0;
  bool dedup = true;               // the fan-out dispatch; the ring pulls every row (plain)
  bool own_rows_in_place = true;   // own rows stay in expert_out; the ring pushes every row
  bool push = false;               // GEMM 2's epilogues push the combine's rows
  int join = 0;                    // comm CTAs that take GEMM tasks after their dispatch share
  int ring_ctas = 0;               // ring: comm CTAs that dispatch past the first ring window
  int64_t help_rows = 0;           // dedup: rows of the first tiles the GEMM CTAs dispatch too
  bool x_in_place = false;         // EP 1: the dispatch reads the caller's x (no staging copy)
};

// Comm CTAs that take GEMM tasks after their dispatch share (FusedForwardOptions::join_gemm).
// The combine has rows to move unless every row is the own rank's and read in place, or GEMM 2's
// epilogues push them; otherwise at least one comm CTA must stay to combine. With the epilogue
// push at EP >= 2 one stays to wait for every routed tile and open the barrier of all ranks, or,
// with the fused top-k sum, to count the pushed rows per token (comm::count_pushed_rows; at EP 1
// too when the own rows are pushed).
int resolve_join_gemm(const Plan& plan, const LayerShape& s) {
  const FusedForwardOptions& o = plan.o;
  const bool combine_idle = s.ep == 1 && (plan.own_rows_in_place || (plan.push && !o.fused_topk_sum));
  const int most = combine_idle ? o.comm_ctas : o.comm_ctas - 1;
  if (o.join_gemm < -1 || o.join_gemm > most) {
    throw_invalid("FusedForwardOptions.join_gemm",
                  "-1 (automatic), 0 (none) or up to " + std::to_string(most) + " of the " +
                      std::to_string(o.comm_ctas) + " comm CTAs" +
                      (combine_idle ? std::string() : std::string(" (at least one must combine or count the pushed rows)")),
                  std::to_string(o.join_gemm));
  }
  if (o.join_gemm >= 0) return o.join_gemm;
  if (combine_idle) return o.comm_ctas;
  return plan.push ? most : 0;  // EP >= 2 without the push: joining measured slower (docs/megakernel.md)
}

gemm::Gemm1SwigluParams gemm1_params_for(const bf16* x, int64_t x_rows, const bf16* gate, const bf16* up,
                                         int64_t experts, bf16* h, bf16* g, bf16* u, int64_t out_rows, int64_t H,
                                         int64_t I, const gemm::ErrorSink& err, int64_t gate_stride = 0,
                                         int64_t up_stride = 0) {
  using gemm::host::map_bf16;
  gemm::Gemm1SwigluParams p{};
  p.x = map_bf16(x, 0, x_rows, H, 64, 128, "x");
  p.w_gate = map_bf16(gate, experts, I, H, 64, 128, "w_gate", gate_stride);
  p.w_up = map_bf16(up, experts, I, H, 64, 128, "w_up", up_stride);
  p.h = map_bf16(h, 0, out_rows, I, 64, 64, "h");
  p.g = map_bf16(g, 0, out_rows, I, 64, 64, "g");
  p.u = map_bf16(u, 0, out_rows, I, 64, 64, "u");
  p.k_steps = static_cast<int>(H / 64);
  p.inter = static_cast<int>(I);
  p.err = err;
  return p;
}

gemm::Gemm2Params gemm2_params_for(const bf16* h, int64_t h_rows, const bf16* down, int64_t experts, bf16* out,
                                   int64_t out_rows, int64_t H, int64_t I, const gemm::ErrorSink& err,
                                   int64_t down_stride = 0) {
  using gemm::host::map_bf16;
  gemm::Gemm2Params p{};
  p.h = map_bf16(h, 0, h_rows, I, 64, 128, "h");
  p.w_down = map_bf16(down, experts, H, I, 64, 128, "w_down", down_stride);
  p.out = map_bf16(out, 0, out_rows, H, 64, 64, "out");
  p.k_steps = static_cast<int>(I / 64);
  p.hidden = static_cast<int>(H);
  p.err = err;
  return p;
}

// The pass's plan. The macrobatch ring (the workspace's routed buffers hold fewer rows than the
// schedule's buffer, Config::macrobatch) fixes the copy modes that keep a row tile's bytes in its
// slot only while the slot is its own: the plain pull (the fan-out stores a token's rows of later
// minibatches with its first one), no help from the GEMM CTAs (they fan out), and GEMM 2's
// epilogue pushing every row into its slot (the top-k sum reads no row in place, and expert_out
// is not written).
Plan make_plan(const comm::CommState& state, const ForwardBuffers& b, const ForwardArgs& args,
               const FusedForwardOptions& o) {
  const LayerShape& s = state.shape();
  if (b.resident_rows != state.row_buffer_rows()) {
    throw_invalid("ForwardBuffers.resident_rows", "the rows of the comm state's row buffer (" +
                                                      std::to_string(state.row_buffer_rows()) + ")",
                  std::to_string(b.resident_rows));
  }
  if (!(o.timeout_s > 0)) throw_invalid("FusedForwardOptions.timeout_s", "> 0", std::to_string(o.timeout_s));
  if (o.epilogue_push < -1 || o.epilogue_push > 1) {
    throw_invalid("FusedForwardOptions.epilogue_push", "-1 (automatic), 0 (off) or 1 (on)",
                  std::to_string(o.epilogue_push));
  }
  Plan plan;
  plan.o = o;
  plan.grid = resolve_persistent_grid(forward_kernel(), o.grid, o.comm_ctas, "Config.comm_sms_forward");
  plan.push = o.epilogue_push == 1;  // automatic: off until measured at EP >= 2 (docs/megakernel.md)
  if (b.ring()) {  // the macrobatch ring (Config::macrobatch below the routed buffer)
    if (o.epilogue_push == 0) {
      throw_invalid("FusedForwardOptions.epilogue_push",
                    "-1 or 1 with the macrobatch ring (Config.macrobatch = " +
                        std::to_string(state.config().macrobatch) + " rows)",
                    "0");
    }
    plan.dedup = false;
    plan.own_rows_in_place = false;
    plan.push = true;
    // Past the first window the dispatch is paced by GEMM 1 (each tile waits for its slot), so a
    // few CTAs keep up and the others join the GEMM work. The CTAs that move the routed rows at
    // the rate GEMM 1 takes them (~600 TFLOP/s), at ~23 GB/s each (the plain pull of a fused
    // comm CTA, from qwen3 at EP 1: 8 CTAs too few, 16 enough), with 20 % headroom: dsv3 5,
    // gptoss 4, qwen3 14 (measured at EP 1 with 16 comm CTAs: dsv3 +1.8 % over the default at
    // 4, +3.5 % at 8, +11.5 % at all 16; gptoss -0.7 / +2.7 / +5 %; qwen3 needs ~16).
    const double row_bytes = static_cast<double>(s.tokens) * s.topk * s.hidden * 2.0;
    const double bytes_per_s = row_bytes / (s.forward_flops() / 600e12);
    plan.ring_ctas = std::clamp(static_cast<int>(std::ceil(1.2 * bytes_per_s / 23e9)), 1, o.comm_ctas);
  } else {
    // The fan-out's front-loaded first quarter of the routed rows is also dispatched by the GEMM
    // CTAs when no shared expert hides the first minibatch's dispatch (they have nothing else to
    // do until it landed), else nothing.
    plan.help_rows = s.has_shared() ? 0 : state.view().tokens * s.topk / 4;
  }
  plan.join = resolve_join_gemm(plan, s);
  // At EP 1 no peer reads the window's copy of x: the dispatch reads the caller's x itself
  // (DispatchRole::own_x) and the staging copy is skipped (qwen3: 64 MB, ~0.02-0.04 ms in front
  // of the kernel). Needs 16-byte rows (the dispatch's vector loads); otherwise x is staged.
  plan.x_in_place = s.ep == 1 && reinterpret_cast<uintptr_t>(args.x) % 16 == 0;
  return plan;
}

FusedForwardParams make_params(comm::CommState& state, ForwardBuffers& b, const ForwardArgs& args,
                               const ExpertWeights& w, const SavedContext& save, const Plan& plan) {
  const FusedForwardOptions& o = plan.o;
  const LayerShape& s = state.shape();
  const int64_t H = s.hidden, I = s.intermediate, S = s.shared_intermediate, E = s.local_experts();
  const int64_t R = b.buffer_rows, resident = b.resident_rows;
  const gemm::ErrorSink err{b.gemm_error.get(), static_cast<uint64_t>(o.timeout_s * 1e9)};
  FusedForwardParams p{};
  // g, u into the layer's context; with the ring into the ring's slots (backward recomputes the rest)
  bf16* const g = b.ring() ? b.g.get() : save.g;
  bf16* const u = b.ring() ? b.u.get() : save.u;
  p.routed1 = gemm1_params_for(state.row_buffer(), resident, w.gate, w.up, E, b.h.get(), g, u, resident, H, I, err,
                               w.gate_expert_stride, w.up_expert_stride);
  // (with the ring expert_out is one row tile that no store reaches: every row is pushed)
  p.routed2 = gemm2_params_for(b.h.get(), resident, w.down, E, b.expert_out.get(), b.ring() ? kRowTile : R, H, I, err,
                               w.down_expert_stride);
  p.ring_tiles = b.ring() ? static_cast<int>(resident / kRowTile) : 0;
  p.routed1.sched.offsets = b.seg_offsets.get();  // expert_of / real rows of a routed row tile
  p.routed1.sched.rows = b.seg_rows.get();
  p.routed1.sched.experts = static_cast<int>(E);
  p.routed1.sched.n_tiles = static_cast<int>(ceil_div(I, 128));
  p.routed1.sched.group_m = gemm::kGroupM;
  p.routed1.sched.cluster = 1;
  if (s.has_shared()) {
    gemm::host::check_pointer("ForwardArgs.x", args.x);
    // x itself is the shared expert's row operand: TMA reads rows past this call's T as zeros,
    // exactly the zero padding rows of the staged forward's copy.
    p.shared1 = gemm1_params_for(args.x, state.view().tokens, w.shared_gate, w.shared_up, 1, b.shared_h.get(), save.shared_g,
                                 save.shared_u, b.shared_rows, H, S, err);
    p.shared2 = gemm2_params_for(b.shared_h.get(), b.shared_rows, w.shared_down, 1, b.shared_out.get(), b.shared_rows,
                                 H, S, err);
  }
  p.tasks.shared_row_tiles = s.has_shared() ? static_cast<int>(b.shared_rows / kRowTile) : 0;
  p.tasks.shared_n1 = static_cast<int>(ceil_div(S, 128));
  p.tasks.n1 = static_cast<int>(ceil_div(I, 128));
  p.tasks.n2 = static_cast<int>(ceil_div(H, 256));
  p.tasks.tiles_per_minibatch = static_cast<int>(state.view().minibatch / kRowTile);
  p.tasks.group_m = gemm::kGroupM;
  p.shared_tokens = static_cast<int>(state.view().tokens);
  p.experts = static_cast<int>(E);
  const int64_t shared_tiles = b.shared_rows / kRowTile, routed_tiles = R / kRowTile;
  p.s1_done = b.tile_counters.get();
  p.g1_done = p.s1_done + shared_tiles;
  p.g2_done = p.g1_done + routed_tiles;
  p.s2_done = p.g2_done + routed_tiles;
  p.ready = state.ready_counters();
  p.view = state.view();
  p.wait = state.wait_context();
  p.comm_ctas = o.comm_ctas;
  p.next_task = p.s2_done + shared_tiles + 1;  // after the top-k sum's counter (ForwardBuffers::tile_counters)
  p.combine_ctas = o.comm_ctas - plan.join;

  // The fan-out dedup never waits on other tiles, so it is safe beside the GEMM CTAs.
  p.dispatch = state.dispatch_role(plan.dedup);
  if (plan.x_in_place) p.dispatch.own_x = reinterpret_cast<const char*>(args.x);
  if (p.ring_tiles > 0) {  // make_plan: plain pull, no help
    p.dispatch.ring_tiles = p.ring_tiles;
    p.dispatch.ring_free = p.g1_done;
    p.dispatch.ring_free_target = 2u * static_cast<uint32_t>(p.tasks.n1);
    p.dispatch.ring_ctas = plan.ring_ctas;
  }
  p.help_tiles = ceil_div(plan.help_rows, kRowTile);
  comm::CombineRole& c = p.combine;  // gated per row tile by GEMM 2
  c = state.combine_role(b.expert_out.get(), plan.own_rows_in_place);
  c.out_ready = p.g2_done;
  c.out_ready_target = 2u * static_cast<uint32_t>(p.tasks.n2);
  if (plan.push) {
    EpiloguePush& e = p.push;
    e.on = true;
    e.rows = p.view.rows;
    e.peers = c.peers;
    e.slots_offset = c.slots_offset;
    e.row_bytes = c.row_bytes;
    e.topk = static_cast<int>(s.topk);
    e.own_rows = !plan.own_rows_in_place;
  }
  if (o.fused_topk_sum) {
    c.count_arrivals = true;
    TopkSumParams& t = p.topk;
    t.on = true;
    t.header = p.view.header;
    t.token_order = p.view.token_order;
    t.tokens = state.view().tokens;  // token_order puts the absent tokens of a shorter call last
    t.hidden = H;
    t.topk = static_cast<int>(s.topk);
    t.topk_w = args.topk_w;
    t.slots = reinterpret_cast<const char*>(state.slots());
    t.arrivals = state.arrivals();
    if (plan.own_rows_in_place) {
      t.own_dest_row = state.own_dest_row();
      t.expert_out = reinterpret_cast<const char*>(b.expert_out.get());
    }
    t.g2_done = p.g2_done;
    t.g2_target = 2u * static_cast<uint32_t>(p.tasks.n2);
    if (s.has_shared()) {
      t.shared_out = reinterpret_cast<const char*>(b.shared_out.get());
      t.s2_done = p.s2_done;
      t.s2_target = 2u * static_cast<uint32_t>(p.tasks.n2);
    }
    t.y = reinterpret_cast<char*>(args.y);
    t.next_unit = p.s2_done + shared_tiles;
  }
  // The GEMM CTAs that help the dispatch wait for the start barrier without taking part: its
  // open flag (zeroed with the ready counters before the kernel) tells them.
  p.dispatch_start = state.barrier(comm::SyncSite::kFusedDispatchStart);
  p.dispatch_start.open_flag = state.pass_open_flag();
  if (!o.fused_topk_sum && p.combine_ctas > 0) p.combine_done = state.barrier(comm::SyncSite::kFusedCombineDone);
  return p;
}

}  // namespace

// ---- developer trace (-DMOK_FORWARD_TRACE, forward_trace.cuh) ---------------------------------
#ifdef MOK_FORWARD_TRACE
namespace {
// Per host thread (bench_forward runs one rank per thread): the buffers of the current device
// and the events around the last pass's phases.
struct TraceState {
  int device = -1, grid = 0, comm_ctas = 0;
  uint64_t* comm = nullptr;
  uint64_t* gemm = nullptr;
  uint64_t* tokens = nullptr;  // fused top-k sum stamps (forward_trace.cuh), grown on demand
  size_t comm_words = 0, gemm_words = 0, token_words = 0, token_cap = 0;
  cudaEvent_t ev[4] = {};
  bool recorded = false;
};
thread_local TraceState g_trace;
}  // namespace

trace::Sink trace_begin(int grid, int comm_ctas, int64_t sum_tokens, cudaStream_t stream) {
  TraceState& t = g_trace;
  int device = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&device));
  if (t.device != device) {
    const int sms = persistent_kernel_sms(forward_kernel());
    t.comm_words = static_cast<size_t>(sms) * trace::kCommFields;
    t.gemm_words = static_cast<size_t>(sms) * trace::kMaxTasks * trace::kTaskFields;
    MOK_CUDA_CHECK(cudaMalloc(&t.comm, t.comm_words * 8));
    MOK_CUDA_CHECK(cudaMalloc(&t.gemm, t.gemm_words * 8));
    for (cudaEvent_t& e : t.ev) MOK_CUDA_CHECK(cudaEventCreate(&e));
    t.device = device;
  }
  t.token_words = static_cast<size_t>(sum_tokens) * trace::kTokenFields;
  if (t.token_words > t.token_cap) {
    if (t.tokens != nullptr) MOK_CUDA_CHECK(cudaFree(t.tokens));
    MOK_CUDA_CHECK(cudaMalloc(&t.tokens, t.token_words * 8));
    t.token_cap = t.token_words;
  }
  t.grid = grid;
  t.comm_ctas = comm_ctas;
  t.recorded = true;
  MOK_CUDA_CHECK(cudaMemsetAsync(t.comm, 0, t.comm_words * 8, stream));
  MOK_CUDA_CHECK(cudaMemsetAsync(t.gemm, 0, t.gemm_words * 8, stream));
  if (t.token_words > 0) MOK_CUDA_CHECK(cudaMemsetAsync(t.tokens, 0, t.token_words * 8, stream));
  MOK_CUDA_CHECK(cudaEventRecord(t.ev[0], stream));
  return trace::Sink{t.comm, t.gemm, t.token_words > 0 ? t.tokens : nullptr};
}
void trace_event(int i, cudaStream_t stream) { MOK_CUDA_CHECK(cudaEventRecord(g_trace.ev[i], stream)); }
#endif

bool forward_trace_enabled() {
#ifdef MOK_FORWARD_TRACE
  return true;
#else
  return false;
#endif
}

void forward_trace_dump(const std::string& path) {
#ifdef MOK_FORWARD_TRACE
  TraceState& t = g_trace;
  if (!t.recorded) throw_invalid("forward_trace_dump", "a fused_forward() call on this thread first", "none");
  MOK_CUDA_CHECK(cudaEventSynchronize(t.ev[3]));
  std::vector<uint64_t> comm(t.comm_words), gemm(t.gemm_words), tokens(t.token_words);
  MOK_CUDA_CHECK(cudaMemcpy(comm.data(), t.comm, comm.size() * 8, cudaMemcpyDeviceToHost));
  MOK_CUDA_CHECK(cudaMemcpy(gemm.data(), t.gemm, gemm.size() * 8, cudaMemcpyDeviceToHost));
  if (!tokens.empty()) MOK_CUDA_CHECK(cudaMemcpy(tokens.data(), t.tokens, tokens.size() * 8, cudaMemcpyDeviceToHost));
  float ms[3] = {};
  for (int i = 0; i < 3; ++i) MOK_CUDA_CHECK(cudaEventElapsedTime(&ms[i], t.ev[i], t.ev[i + 1]));
  // Header: magic, version, grid, comm CTAs, max tasks, comm fields, task fields, then the
  // host-event phases in ns: before the kernel (segments, x staging, memsets), the kernel,
  // after it (top-k sum epilogue, poison check). Version 2 appended the fused top-k sum's
  // token count (0 without it) and its per-token stamps; version 3 writes a task row for every
  // CTA: the GEMM CTAs', then the comm CTAs' (the tasks of those that joined the GEMM work).
  const int64_t header[10] = {0x52544457464b4f4dLL, 3, t.grid, t.comm_ctas, trace::kMaxTasks, trace::kCommFields,
                              trace::kTaskFields, int64_t(ms[0] * 1e6), int64_t(ms[1] * 1e6), int64_t(ms[2] * 1e6)};
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) throw_invalid("forward_trace_dump path", "a writable file", path);
  std::fwrite(header, sizeof(header), 1, f);
  std::fwrite(comm.data(), 8, static_cast<size_t>(t.comm_ctas) * trace::kCommFields, f);
  std::fwrite(gemm.data(), 8, static_cast<size_t>(t.grid) * trace::kMaxTasks * trace::kTaskFields, f);
  const int64_t token_count = static_cast<int64_t>(t.token_words / trace::kTokenFields);
  std::fwrite(&token_count, 8, 1, f);
  std::fwrite(tokens.data(), 8, tokens.size(), f);
  const bool ok = std::fclose(f) == 0;
  if (!ok) throw_invalid("forward_trace_dump path", "a writable file", path);
#else
  throw_invalid("forward_trace_dump", "a build with -DMOK_FORWARD_TRACE (cmake -DMOK_FORWARD_TRACE=ON)", path);
#endif
}

void fused_forward(comm::CommState& state, ForwardBuffers& b, const ForwardArgs& args, const ExpertWeights& w,
                   const FusedForwardOptions& options, const SavedContext& save, cudaStream_t stream) {
  const Plan plan = make_plan(state, b, args, options);  // bad options throw before anything is enqueued
  const FusedForwardOptions& o = plan.o;
  const int grid = plan.grid;
  MOK_FWD_TRACE(const trace::Sink sink =
                    trace_begin(grid, o.comm_ctas, o.fused_topk_sum ? state.shape().tokens : 0, stream);)
  const comm::ScheduleBuffers& sb = state.schedule_buffers();
  const int64_t T = state.view().tokens;  // this call's tokens
  check_router_weights(state, args.topk_w, T, stream);
  convert_segments(state, b, stream);
  if (!plan.x_in_place) state.stage_x(args.x, T, stream);
  // ready counters, tile row counts and the dispatch start's open flag
  const size_t ready_words = sb.max_minibatches + sb.buffer_rows / kRowTile + 1;
  MOK_CUDA_CHECK(cudaMemsetAsync(state.ready_counters(), 0, ready_words * sizeof(uint32_t), stream));
  MOK_CUDA_CHECK(cudaMemsetAsync(b.tile_counters.get(), 0, b.tile_counters.bytes(), stream));
  if (o.fused_topk_sum) {
    // NOTE: peers add to these only after this pass's first group barrier, which this rank's
    // kernel (after this memset) opens; last pass's adds all came before its sum finished.
    MOK_CUDA_CHECK(cudaMemsetAsync(state.arrivals(), 0, state.shape().tokens * sizeof(uint32_t), stream));
  }
  FusedForwardParams p = make_params(state, b, args, w, save, plan);
  MOK_FWD_TRACE(p.trace = sink; p.topk.trace_tokens = sink.tokens; trace_event(1, stream);)
  fused_forward_kernel<<<grid, FusedCta::kThreads, FusedCta::kSmemBytes, stream>>>(p);
  MOK_CUDA_CHECK(cudaGetLastError());
  MOK_FWD_TRACE(trace_event(2, stream);)
  if (!o.fused_topk_sum) {
    const LayerShape& s = state.shape();
    state.epilogue(args.topk_w, s.has_shared() ? b.shared_out.get() : nullptr,
                   plan.own_rows_in_place ? b.expert_out.get() : nullptr, args.y, stream);
  }
  poison_y_on_error(state, args.y, T, stream);
  MOK_FWD_TRACE(trace_event(3, stream);)
}

}  // namespace mok::megakernel
