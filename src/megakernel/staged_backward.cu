#include "megakernel/staged_backward.hpp"

#include <algorithm>
#include <string>

#include "comm/cuda_check.hpp"
#include "comm/roles.hpp"
#include "gemm/grouped_gemm.hpp"
#include "gemm/swiglu_math.cuh"
#include "megakernel/backward_rows.cuh"

namespace mok::megakernel {
namespace {

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
unsigned blocks_for(int64_t n, int threads, int64_t cap) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + threads - 1) / threads, cap)));
}

__device__ bool schedule_ok(const comm::ScheduleHeader* h) { return h->status == 0; }

// Each routed row's router weight, read from the token owner's staged topk_w (0 for padding
// rows and for every row of a poisoned schedule).
__global__ void gather_row_weights(const comm::ScheduleHeader* header, const comm::RowEntry* rows, int64_t buffer_rows,
                                   comm::PeerMap peers, size_t topk_w_offset, int topk, float* row_w) {
  const bool ok = schedule_ok(header);
  const int64_t padded = ok ? header->padded_rows : 0;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < buffer_rows; p += int64_t(gridDim.x) * blockDim.x) {
    float w = 0.0f;
    if (p < padded) {
      const comm::RowEntry e = rows[p];
      if (e.src_rank >= 0) {
        w = reinterpret_cast<const float*>(peers.base[e.src_rank] + topk_w_offset)[int64_t{e.token} * topk + e.k];
      }
    }
    row_w[p] = w;
  }
}

// Padding rows of the pulled row buffers are zero: the weight-gradient reduction runs over
// them (gemm/grouped_gemm.hpp's row buffer contract); the pulls write real rows only.
__global__ void zero_padding_rows(const comm::ScheduleHeader* header, const comm::RowEntry* rows, uint4* a, uint4* b,
                                  int64_t row_vecs) {
  if (!schedule_ok(header)) return;
  const int64_t padded = header->padded_rows;
  for (int64_t p = blockIdx.x; p < padded; p += gridDim.x) {
    if (rows[p].src_rank >= 0) continue;
    for (int64_t c = threadIdx.x; c < row_vecs; c += blockDim.x) {
      a[p * row_vecs + c] = make_uint4(0, 0, 0, 0);
      b[p * row_vecs + c] = make_uint4(0, 0, 0, 0);
    }
  }
}

// hs = bf16(w * h), h = bf16(silu(g) * u) rebuilt with the forward's bits (numerics.md Backward
// step 6): the operand of the W_down weight gradient against the unscaled dy rows. Routed:
// w = row_w[r], real rows = rows named by the schedule; shared (rows = nullptr): w = 1 (hs = h),
// real rows < real_rows.
__global__ void rebuild_hs(const comm::ScheduleHeader* header, const comm::RowEntry* rows, int64_t real_rows,
                           const float* row_w, const uint32_t* g, const uint32_t* u, uint32_t* hs, int64_t n_rows,
                           int64_t pairs_per_row) {
  const int64_t limit = rows != nullptr ? (schedule_ok(header) ? header->padded_rows : 0) : real_rows;
  const int64_t n = n_rows * pairs_per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / pairs_per_row;
    const bool real = r < limit && (rows == nullptr || rows[r].src_rank >= 0);
    uint32_t out = 0;
    if (real) {
      const float2 gv = gemm::unpack_bf16x2(g[i]), uv = gemm::unpack_bf16x2(u[i]);
      const float2 h = gemm::unpack_bf16x2(gemm::pack_bf16x2(gemm::swiglu_fwd(gv.x, uv.x), gemm::swiglu_fwd(gv.y, uv.y)));
      const float w = row_w != nullptr ? row_w[r] : 1.0f;
      out = row_w != nullptr ? gemm::pack_bf16x2(w * h.x, w * h.y) : gemm::pack_bf16x2(h.x, h.y);
    }
    hs[i] = out;
  }
}

// d topk_w of each real row: its column-tile parts summed in tile order, stored into the
// token owner's landing slot (t, k) of the window.
__global__ void push_dtopk(const comm::ScheduleHeader* header, const comm::RowEntry* rows, const float* parts,
                           int col_tiles, comm::PeerMap peers, size_t dtopk_offset, int topk) {
  if (!schedule_ok(header)) return;
  const int64_t padded = header->padded_rows;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < padded; p += int64_t(gridDim.x) * blockDim.x) {
    const comm::RowEntry e = rows[p];
    if (e.src_rank >= 0) push_dtopk_row(e, p, parts, col_tiles, peers, dtopk_offset, topk);
  }
}

// dx and d topk_w are NaN whenever the saved schedule was poisoned, a router weight was not
// finite or a wait timed out: never silently wrong (Workspace::check() throws the reason).
__global__ void poison_backward(const comm::ScheduleHeader* header, const comm::DeviceErrorRecord* error, uint4* dx,
                                int64_t dx_vecs, float* dtopk, int64_t dtopk_n) {
  if (header->status == 0 && *reinterpret_cast<const volatile int32_t*>(&error->code) == 0 &&
      *reinterpret_cast<const volatile unsigned long long*>(&error->weight_key) == comm::kNoWeightError) {
    return;
  }
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < dx_vecs; i += stride) {
    dx[i] = make_uint4(~0u, ~0u, ~0u, ~0u);
  }
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < dtopk_n; i += stride) {
    dtopk[i] = __int_as_float(0x7fffffff);
  }
}

__global__ void fill_ones(float* v, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) v[i] = 1.0f;
}

// Where the backward's x rows are: the forward's row buffer, or (macrobatch ring) rows of its own.
bf16* x_rows_of(comm::CommState& state, BackwardBuffers& bwd) {
  return bwd.x_rows.size() > 0 ? bwd.x_rows.get() : state.row_buffer();
}

gemm::WgradOut wgrad_out(GradMode mode) {
  return mode == GradMode::kWriteBf16 ? gemm::WgradOut::kWriteBf16 : gemm::WgradOut::kAccumulateFp32;
}

}  // namespace

bool pulls_read_in_place(const LayerShape& s, const BackwardArgs& args) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return s.ep == 1 && aligned(args.x) && aligned(args.dy);
}

void check_grads(const LayerShape& s, const WeightGrads& g) {
  if (g.mode != GradMode::kWriteBf16 && g.mode != GradMode::kAccumulateFp32) {
    throw_invalid("WeightGrads.mode", "GradMode::kWriteBf16 or GradMode::kAccumulateFp32",
                  std::to_string(static_cast<int>(g.mode)));
  }
  if (g.gate == nullptr || g.up == nullptr || g.down == nullptr) {
    throw_invalid("WeightGrads.gate/up/down", "device pointers to the routed experts' weight gradients", "nullptr");
  }
  if (s.has_shared() && (g.shared_gate == nullptr || g.shared_up == nullptr || g.shared_down == nullptr)) {
    throw_invalid("WeightGrads.shared_*", "device pointers (LayerShape.shared_intermediate > 0)", "nullptr");
  }
  const int64_t IH = s.intermediate * s.hidden;
  const std::pair<const char*, int64_t> strides[] = {{"WeightGrads.gate_expert_stride", g.gate_expert_stride},
                                                     {"WeightGrads.up_expert_stride", g.up_expert_stride},
                                                     {"WeightGrads.down_expert_stride", g.down_expert_stride}};
  for (const auto& [argument, stride] : strides) {
    if (stride != 0 && (stride < IH || stride % 8 != 0)) {
      throw_invalid(argument, "0 (dense) or a multiple of 8 elements >= " + std::to_string(IH), std::to_string(stride));
    }
  }
}

namespace {


// GEMM 1 + SwiGLU of the forward (shared, then routed) on the x rows into out's g, u; h goes to
// the hs scratch (rebuilt later). The shared expert reads fwd.shared_x (x, padding rows zero).
void run_gemm1(comm::CommState& state, ForwardBuffers& fwd, BackwardBuffers& bwd, const SavedContext& out,
               const bf16* x_rows, const ExpertWeights& w, const StagedBackwardOptions& o, cudaStream_t stream) {
  const LayerShape& s = state.shape();
  const gemm::Launch launch = gemm_launch(fwd, o.gemm_grid, o.timeout_s);
  if (o.fp8 != nullptr) {
    const gemm::Segments seg{out.seg_offsets, out.seg_rows, static_cast<int>(s.local_experts()), bwd.buffer_rows};
    if (s.has_shared()) forward_gemms_fp8(s, fwd, seg, nullptr, nullptr, *o.fp8, out, launch, true, false, stream);
    forward_gemms_fp8(s, fwd, seg, x_rows, &out.schedule.header->padded_rows, *o.fp8, out, launch, false, false,
                      stream);
    return;
  }
  if (s.has_shared()) {
    const gemm::Segments seg{fwd.shared_offsets.get(), fwd.shared_rows_dev.get(), 1, fwd.shared_rows};
    gemm::gemm1_swiglu({seg, s.hidden, s.shared_intermediate, fwd.shared_x.get(), w.shared_gate, w.shared_up,
                        bwd.shared_hs.get(), out.shared_g, out.shared_u},
                       launch, stream);
  }
  const gemm::Segments seg{out.seg_offsets, out.seg_rows, static_cast<int>(s.local_experts()), bwd.buffer_rows};
  gemm::gemm1_swiglu({seg, s.hidden, s.intermediate, x_rows, w.gate, w.up, bwd.hs.get(), out.g, out.u,
                      w.gate_expert_stride, w.up_expert_stride},
                     launch, stream);
}

}  // namespace

void recompute_activations(comm::CommState& state, ForwardBuffers& fwd, BackwardBuffers& bwd, const SavedContext& saved,
                           const bf16* x, const ExpertWeights& w, const SavedContext& out,
                           const StagedBackwardOptions& o, cudaStream_t stream) {
  const LayerShape& s = state.shape();
  const comm::ScheduleView& v = saved.schedule;
  state.stage_x(x, v.tokens, stream);
  if (s.has_shared()) stage_shared_rows(fwd, v.tokens, s.hidden, {{fwd.shared_x.get(), x}}, stream);
  bf16* const x_rows = x_rows_of(state, bwd);
  comm::launch_dispatch(state.dispatch_launch(o.comm_ctas, /*dedup=*/true, v, state.layout().x, x_rows), stream);
  run_gemm1(state, fwd, bwd, out, x_rows, w, o, stream);
}

BackwardBuffers::BackwardBuffers(const LayerShape& s, int64_t rows, bool x_rows_too, bool fp8_scratch)
    : buffer_rows(rows),
      shared_rows(round_up(s.tokens, kRowTile)),
      col_tiles(gemm::dgrad_hidden_col_tiles(s.intermediate)),
      x_rows(x_rows_too ? rows * s.hidden : 0),
      dy_rows(rows * s.hidden),
      dx_rows(rows * s.hidden),
      dg(rows * s.intermediate),
      du(rows * s.intermediate),
      hs(rows * s.intermediate),
      row_w(rows),
      dw_part(rows * col_tiles),
      shared_dy(s.has_shared() ? shared_rows * s.hidden : 0),
      shared_dg(shared_rows * s.shared_intermediate),
      shared_du(shared_rows * s.shared_intermediate),
      shared_hs(shared_rows * s.shared_intermediate),
      shared_dx(s.has_shared() ? shared_rows * s.hidden : 0),
      ones(s.tokens * s.topk),
      g(rows * s.intermediate),
      u(rows * s.intermediate),
      shared_g(shared_rows * s.shared_intermediate),
      shared_u(shared_rows * s.shared_intermediate) {
  if (s.has_shared()) MOK_CUDA_CHECK(cudaMemset(shared_dy.get(), 0, shared_dy.bytes()));  // padding rows stay 0
  fill_ones<<<blocks_for(ones.size(), 256, 1024), 256>>>(ones.get(), static_cast<int64_t>(ones.size()));
  MOK_CUDA_CHECK(cudaGetLastError());
  if (fp8_scratch) fp8 = std::make_unique<Fp8BackwardScratch>(s, rows, shared_rows);
}

size_t BackwardBuffers::bytes() const {
  return x_rows.bytes() + dy_rows.bytes() + dx_rows.bytes() + dg.bytes() + du.bytes() + hs.bytes() + row_w.bytes() +
         dw_part.bytes() + shared_dy.bytes() + shared_dg.bytes() + shared_du.bytes() + shared_hs.bytes() +
         shared_dx.bytes() + ones.bytes() + g.bytes() + u.bytes() + shared_g.bytes() + shared_u.bytes() +
         (fp8 ? fp8->bytes() : 0);
}

SavedContext BackwardBuffers::scratch_activations(SavedContext c) const {
  c.g = g.get();
  c.u = u.get();
  c.shared_g = shared_g.get();  // nullptr without a shared expert (an empty buffer)
  c.shared_u = shared_u.get();
  return c;
}

GradInputs GradInputs::scratch(BackwardBuffers& bwd) {
  GradInputs g;
  g.dg = bwd.dg.get();
  g.du = bwd.du.get();
  g.hs = bwd.hs.get();
  g.shared_dg = bwd.shared_dg.get();
  g.shared_du = bwd.shared_du.get();
  g.shared_hs = bwd.shared_hs.get();
  return g;
}

void backward_gemms(comm::CommState& state, ForwardBuffers& fwd, BackwardBuffers& bwd, const SavedContext& saved,
                    const ExpertWeights& w, const WeightGrads& grads, const StagedBackwardOptions& o, bool with_hs,
                    cudaStream_t stream, unsigned parts, const GradInputs* into) {
  const LayerShape& s = state.shape();
  if (parts & (kSharedWgrad | kRoutedWgrad)) check_grads(s, grads);
  const GradInputs out = into != nullptr ? *into : GradInputs::scratch(bwd);
  const comm::ScheduleView& v = saved.schedule;
  const int64_t T = v.tokens, H = s.hidden, I = s.intermediate, S = s.shared_intermediate;  // this call's T
  const int64_t R = bwd.buffer_rows;
  const gemm::Launch launch = gemm_launch(fwd, o.gemm_grid, o.timeout_s);
  // The K-grouped weight gradients of the shared or the routed experts, in FP8 or bf16.
  // FP8 weight gradients after the dh GEMM in this pass: dh's quantization of dy writes dy^T too
  // (one read of the dy rows for both orientations; backward_dgrad_fp8's dy_t_too).
  const bool fp8_wgrad = o.fp8 != nullptr && o.fp8->fp8_wgrad;
  const bool dy_t_shared = fp8_wgrad && (parts & kSharedDh) && (parts & kSharedWgrad);
  const bool dy_t_routed = fp8_wgrad && (parts & kRoutedDh) && (parts & kRoutedWgrad);
  auto weight_grads = [&](bool shared) {
    if (fp8_wgrad) {
      backward_wgrad_fp8(state, fwd, bwd, saved, x_rows_of(state, bwd), grads, out, shared, launch, stream,
                         shared ? dy_t_shared : dy_t_routed);
    } else {
      gemm::wgrad(backward_wgrad_args(state, fwd, bwd, saved, grads, out, shared), launch, stream);
    }
  };

  // Shared expert: dy unscaled, its weight gradients over this rank's tokens. hs first: dg, du
  // may overwrite g, u (a deferring backward keeps them in the context in place of g, u).
  if (s.has_shared()) {
    const gemm::Segments seg{fwd.shared_offsets.get(), fwd.shared_rows_dev.get(), 1, fwd.shared_rows};
    if (with_hs) {
      rebuild_hs<<<blocks_for(fwd.shared_rows * S / 2, 256, 4096), 256, 0, stream>>>(
          nullptr, nullptr, T, nullptr, reinterpret_cast<const uint32_t*>(saved.shared_g),
          reinterpret_cast<const uint32_t*>(saved.shared_u), reinterpret_cast<uint32_t*>(out.shared_hs),
          fwd.shared_rows, S / 2);
      MOK_CUDA_CHECK(cudaGetLastError());
    }
    if (o.fp8 != nullptr) {
      if (parts & (kSharedDh | kSharedDx)) {
        backward_dgrad_fp8(state, fwd, bwd, saved, *o.fp8, out, true, parts & kSharedDh, parts & kSharedDx, launch,
                           stream, dy_t_shared);
      }
    } else {
      if (parts & kSharedDh) {
        gemm::dgrad_hidden_swiglu({seg, H, S, bwd.shared_dy.get(), w.shared_down, saved.shared_g, saved.shared_u,
                                   out.shared_dg, out.shared_du},
                                  launch, stream);
      }
      if (parts & kSharedDx) {
        gemm::dgrad_input({seg, H, S, out.shared_dg, out.shared_du, w.shared_gate, w.shared_up, bwd.shared_dx.get()},
                          launch, stream);
      }
    }
    if (parts & kSharedWgrad) weight_grads(true);
  }

  // Routed experts (hs first, as above).
  const gemm::Segments seg{saved.seg_offsets, saved.seg_rows, static_cast<int>(s.local_experts()), R};
  if (with_hs) {
    rebuild_hs<<<blocks_for(R * I / 2, 256, 8192), 256, 0, stream>>>(
        v.header, v.rows, 0, bwd.row_w.get(), reinterpret_cast<const uint32_t*>(saved.g),
        reinterpret_cast<const uint32_t*>(saved.u), reinterpret_cast<uint32_t*>(out.hs), R, I / 2);
    MOK_CUDA_CHECK(cudaGetLastError());
  }
  if (o.fp8 != nullptr) {
    if (parts & (kRoutedDh | kRoutedDx)) {
      backward_dgrad_fp8(state, fwd, bwd, saved, *o.fp8, out, false, parts & kRoutedDh, parts & kRoutedDx, launch,
                         stream, dy_t_routed);
    }
  } else {
    gemm::DgradHiddenArgs dh{seg, H, I, bwd.dy_rows.get(), w.down, saved.g, saved.u, out.dg, out.du};
    dh.w_down_stride = w.down_expert_stride;
    dh.row_w = bwd.row_w.get();
    dh.dw_part = bwd.dw_part.get();
    if (parts & kRoutedDh) gemm::dgrad_hidden_swiglu(dh, launch, stream);
    if (parts & kRoutedDx) {
      gemm::dgrad_input({seg, H, I, out.dg, out.du, w.gate, w.up, bwd.dx_rows.get(), w.gate_expert_stride,
                         w.up_expert_stride},
                        launch, stream);
    }
  }
  if (parts & kRoutedWgrad) weight_grads(false);
}

gemm::WgradArgs backward_wgrad_args(comm::CommState& state, ForwardBuffers& fwd, BackwardBuffers& bwd,
                                    const SavedContext& saved, const WeightGrads& grads, const GradInputs& out,
                                    bool shared) {
  const LayerShape& s = state.shape();
  const int64_t H = s.hidden, I = s.intermediate, S = s.shared_intermediate;
  gemm::WgradArgs wa;
  wa.mode = wgrad_out(grads.mode);
  wa.num_problems = 3;
  if (shared) {  // dy unscaled, over this rank's tokens
    wa.seg = gemm::Segments{fwd.shared_offsets.get(), fwd.shared_rows_dev.get(), 1, fwd.shared_rows};
    wa.problems[0] = {bwd.shared_dy.get(), out.shared_hs, H, S, nullptr, grads.shared_down};
    wa.problems[1] = {out.shared_dg, fwd.shared_x.get(), S, H, nullptr, grads.shared_gate};
    wa.problems[2] = {out.shared_du, fwd.shared_x.get(), S, H, nullptr, grads.shared_up};
    return wa;
  }
  wa.seg = gemm::Segments{saved.seg_offsets, saved.seg_rows, static_cast<int>(s.local_experts()), bwd.buffer_rows};
  wa.problems[0] = {bwd.dy_rows.get(), out.hs, H, I, nullptr, grads.down, grads.down_expert_stride};
  bf16* const x_rows = x_rows_of(state, bwd);
  wa.problems[1] = {out.dg, x_rows, I, H, nullptr, grads.gate, grads.gate_expert_stride};
  wa.problems[2] = {out.du, x_rows, I, H, nullptr, grads.up, grads.up_expert_stride};
  return wa;
}

namespace {

// Stage x and dy (and the router weights) in the window and the shared expert's padded rows,
// then pull the x rows and the dy rows over the saved routing table; padding rows zeroed. At EP 1
// no peer reads the window: the pulls read the caller's x and dy in place (DispatchRole::own_x),
// as the fused forward does, and the two staging copies are skipped.
void stage_and_pull(comm::CommState& state, ForwardBuffers& fwd, BackwardBuffers& bwd, const comm::ScheduleView& v,
                    const BackwardArgs& args, const StagedBackwardOptions& o, bool weights, cudaStream_t stream,
                    bool pull_dy = true) {
  const LayerShape& s = state.shape();
  const comm::SymmetricLayout& layout = state.layout();
  const int64_t T = v.tokens, H = s.hidden, K = s.topk, R = bwd.buffer_rows;  // this call's T
  const bool in_place = pulls_read_in_place(s, args);
  if (!in_place) {
    state.stage_x(args.x, T, stream);
    MOK_CUDA_CHECK(cudaMemcpyAsync(state.dy_staging(), args.dy, T * H * sizeof(bf16), cudaMemcpyDeviceToDevice,
                                   stream));
  }
  if (weights) {
    MOK_CUDA_CHECK(cudaMemcpyAsync(state.topk_w_staging(), args.topk_w, T * K * sizeof(float),
                                   cudaMemcpyDeviceToDevice, stream));
  }
  // The shared expert's segment: T real rows (set per call: another layer may have run another T).
  if (s.has_shared()) {
    stage_shared_rows(fwd, T, H, {{fwd.shared_x.get(), args.x}, {bwd.shared_dy.get(), args.dy}}, stream);
  }
  bf16* const x_rows = x_rows_of(state, bwd);
  comm::DispatchLaunch pull_x = state.dispatch_launch(o.comm_ctas, /*dedup=*/true, v, layout.x, x_rows);
  comm::DispatchLaunch dy_launch = state.dispatch_launch(o.comm_ctas, /*dedup=*/true, v, layout.dy, bwd.dy_rows.get());
  if (in_place) {
    pull_x.role.own_x = reinterpret_cast<const char*>(args.x);
    dy_launch.role.own_x = reinterpret_cast<const char*>(args.dy);
  }
  comm::launch_dispatch(pull_x, stream);  // its start barrier: x, dy, topk_w staged on every rank
  if (pull_dy) comm::launch_dispatch(dy_launch, stream);
  if (weights) {
    gather_row_weights<<<blocks_for(R, 256, 1024), 256, 0, stream>>>(v.header, v.rows, R, state.peers(),
                                                                     layout.topk_w, static_cast<int>(K),
                                                                     bwd.row_w.get());
    MOK_CUDA_CHECK(cudaGetLastError());
  }
  zero_padding_rows<<<1024, 256, 0, stream>>>(v.header, v.rows, reinterpret_cast<uint4*>(x_rows),
                                              reinterpret_cast<uint4*>(bwd.dy_rows.get()), H * 2 / 16);
  MOK_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void deferred_weight_grads(comm::CommState& state, ForwardBuffers& fwd, BackwardBuffers& bwd,
                           const SavedContext& saved, const BackwardArgs& args, const WeightGrads& grads,
                           const GradInputs& in, const StagedBackwardOptions& o, cudaStream_t stream) {
  check_grads(state.shape(), grads);
  stage_and_pull(state, fwd, bwd, saved.schedule, args, o, /*weights=*/false, stream);
  backward_gemms(state, fwd, bwd, saved, ExpertWeights{}, grads, o, /*with_hs=*/false, stream,
                 kSharedWgrad | kRoutedWgrad, &in);
}

SavedContext backward_prologue(comm::CommState& state, ForwardBuffers& fwd, BackwardBuffers& bwd,
                               const SavedContext& saved, const BackwardArgs& args, const ExpertWeights& w,
                               const StagedBackwardOptions& o, bool pull_dy, cudaStream_t stream) {
  const LayerShape& s = state.shape();
  const comm::ScheduleView& v = saved.schedule;
  // Stage x, dy and the router weights where the rows' holders read them; pull the x rows (for
  // the gate/up weight gradients) and dy rows over the forward's routing table.
  check_router_weights(state, args.topk_w, v.tokens, stream);
  stage_and_pull(state, fwd, bwd, v, args, o, /*weights=*/true, stream, pull_dy);
  // The GEMMs read g, u (shared g, u) from the context, or from the recompute scratch: a routing-only
  // context's again from the x rows (GEMM 1 of the forward; in FP8 then rounded through FP8, the bits
  // of a context that kept them), an FP8 context's dequantized.
  if (o.fp8 == nullptr && saved.g != nullptr) return saved;
  const SavedContext used = bwd.scratch_activations(saved);
  if (saved.g8.codes != nullptr) {
    load_activations_fp8(s, fwd, v, saved, used, stream);
  } else {
    run_gemm1(state, fwd, bwd, used, x_rows_of(state, bwd), w, o, stream);
    if (o.fp8 != nullptr) round_activations_fp8(s, fwd, v, used, stream);
  }
  return used;
}

void backward_finish(comm::CommState& state, BackwardBuffers& bwd, const comm::ScheduleView& v,
                     const BackwardArgs& args, const StagedBackwardOptions& o, bool push_dtopk_rows, bool combine,
                     cudaStream_t stream) {
  const LayerShape& s = state.shape();
  const comm::SymmetricLayout& layout = state.layout();
  const int64_t T = v.tokens, H = s.hidden, K = s.topk;  // this call's T (the forward's)
  const int64_t R = bwd.buffer_rows;
  // d topk_w to the owners, dx rows to the owners' slots (the combine's barrier covers both).
  if (push_dtopk_rows) {
    push_dtopk<<<blocks_for(R, 256, 1024), 256, 0, stream>>>(v.header, v.rows, bwd.dw_part.get(),
                                                             static_cast<int>(bwd.col_tiles), state.peers(),
                                                             layout.dtopk, static_cast<int>(K));
    MOK_CUDA_CHECK(cudaGetLastError());
  }
  if (combine) {
    comm::launch_combine(state.combine_launch(bwd.dx_rows.get(), o.comm_ctas, /*own_rows_in_place=*/true, v), stream);
  }
  state.epilogue(bwd.ones.get(), s.has_shared() ? bwd.shared_dx.get() : nullptr, bwd.dx_rows.get(), args.dx, v, stream);
  MOK_CUDA_CHECK(cudaMemcpyAsync(args.dtopk_w, state.dtopk_landing(), T * K * sizeof(float), cudaMemcpyDeviceToDevice,
                                 stream));
  poison_backward<<<blocks_for(T * H * 2 / 16, 256, 1024), 256, 0, stream>>>(
      v.header, state.error_record(), reinterpret_cast<uint4*>(args.dx), T * H * 2 / 16, args.dtopk_w, T * K);
  MOK_CUDA_CHECK(cudaGetLastError());
}

namespace {

// An FP8 backward's outputs are NaN when a tensor it quantized held a non-finite value.
void poison_fp8_outputs(ForwardBuffers& fwd, const LayerShape& s, const BackwardArgs& args, int64_t T,
                        cudaStream_t stream) {
  poison_on_nonfinite(fwd, args.dx, T * s.hidden / 2, stream);
  poison_on_nonfinite(fwd, args.dtopk_w, T * s.topk, stream);
}

}  // namespace

void staged_backward(comm::CommState& state, ForwardBuffers& fwd, BackwardBuffers& bwd, const SavedContext& saved,
                     const BackwardArgs& args, const ExpertWeights& w, const WeightGrads& grads,
                     const StagedBackwardOptions& o, cudaStream_t stream, const GradInputs* defer) {
  if (defer == nullptr) check_grads(state.shape(), grads);  // before anything is enqueued
  if (o.fp8 != nullptr) merge_weight_records(fwd, *o.fp8, stream);
  const SavedContext used = backward_prologue(state, fwd, bwd, saved, args, w, o, /*pull_dy=*/true, stream);
  if (defer != nullptr) {  // no weight gradients now: dg, du, hs stay in the context
    backward_gemms(state, fwd, bwd, used, w, WeightGrads{}, o, /*with_hs=*/true, stream,
                   kAllBackwardGemms & ~(kSharedWgrad | kRoutedWgrad), defer);
  } else {
    backward_gemms(state, fwd, bwd, used, w, grads, o, /*with_hs=*/true, stream);
  }
  backward_finish(state, bwd, saved.schedule, args, o, /*push_dtopk_rows=*/true, /*combine=*/true, stream);
  if (o.fp8 != nullptr) poison_fp8_outputs(fwd, state.shape(), args, saved.schedule.tokens, stream);
}

}  // namespace mok::megakernel
