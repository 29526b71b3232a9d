// The staged GPU backward (docs/numerics.md Backward): the steps of the backward
// pass as consecutive stream-ordered launches over a layer's saved forward context, no host
// synchronisation and no new routing exchange:
//   stage x, dy, topk_w in the window -> pull x rows and dy rows (the forward's dedup dispatch
//   over the saved routing table) -> each row's router weight -> shared expert: dh + SwiGLU
//   backward, dx, weight gradients -> routed: dh + SwiGLU backward with the d topk_w parts,
//   hs = bf16(w h), dx rows, weight gradients -> d topk_w to the owner -> dx rows to the owners'
//   slots (the forward's in-place combine) -> fixed-order dx sum.
// It is the oracle of the fused backward (the same GEMM kinds and roles, the same bits).
#pragma once

#include <cuda_runtime_api.h>

#include <memory>

#include "comm/comm_state.hpp"
#include "comm/device_buffer.hpp"
#include "gemm/grouped_gemm.hpp"
#include "megakernel/context.hpp"
#include "megakernel/staged_forward.hpp"
#include "mok/api.hpp"

namespace mok::megakernel {

// The backward's scratch, sized once per workspace (every layer's backward reuses it).
struct BackwardBuffers {
  // x_rows_too: the row buffer of the forward is the macrobatch ring, so the backward pulls x
  // into rows of its own (x_rows).
  // fp8: Config::precision kFp8Block (the quantized operands of the FP8 backward, fp8_steps.hpp).
  BackwardBuffers(const LayerShape& shape, int64_t buffer_rows, bool x_rows_too, bool fp8 = false);
  int64_t buffer_rows = 0, shared_rows = 0, col_tiles = 0;
  comm::DeviceBuffer<bf16> x_rows;       // [buffer_rows, H] with x_rows_too, else empty (the row buffer)
  comm::DeviceBuffer<bf16> dy_rows;      // [buffer_rows, H] pulled dy rows (unscaled)
  comm::DeviceBuffer<bf16> dx_rows;      // [buffer_rows, H] dx of each routed row
  comm::DeviceBuffer<bf16> dg, du, hs;   // [buffer_rows, I]
  comm::DeviceBuffer<float> row_w;       // [buffer_rows] each row's router weight (0: padding)
  comm::DeviceBuffer<float> dw_part;     // [buffer_rows, col_tiles] d topk_w parts
  comm::DeviceBuffer<bf16> shared_dy;    // [shared_rows, H], padding rows zero
  comm::DeviceBuffer<bf16> shared_dg, shared_du, shared_hs;  // [shared_rows, I_shared]
  comm::DeviceBuffer<bf16> shared_dx;    // [shared_rows, H]
  comm::DeviceBuffer<float> ones;        // [T, K] 1.0f: the dx sum's weights
  // A context without the activations (routing only: ForwardArgs::save_activations false, the
  // macrobatch ring, Context::Keep::kRoutingOnly): the backward recomputes g, u here (GEMM 1 of
  // the forward on the pulled x rows, the same bits), h going to hs (rebuilt after).
  comm::DeviceBuffer<bf16> g, u;         // [buffer_rows, I]
  comm::DeviceBuffer<bf16> shared_g, shared_u;  // [shared_rows, I_shared]
  std::unique_ptr<Fp8BackwardScratch> fp8;
  size_t bytes() const;
  // `c` with its g, u (shared g, u) in the recompute scratch above: where a recompute writes them (and
  // where FP8 passes keep their bf16 g, u: GEMM 1's outputs, the dequantized context).
  SavedContext scratch_activations(SavedContext c) const;
};

// Where dg, du and hs (routed and shared) go: the backward's scratch, or (a deferring backward)
// the layer's context, dg and du in place of its g and u (each dh tile reads its g, u before it
// stores the same elements' dg, du; hs is rebuilt before the dh GEMM).
struct GradInputs {
  bf16 *dg = nullptr, *du = nullptr, *hs = nullptr, *shared_dg = nullptr, *shared_du = nullptr, *shared_hs = nullptr;
  static GradInputs scratch(BackwardBuffers& bwd);
};
struct StagedBackwardOptions {
  int comm_ctas = 16;   // pulls and the dx push
  int gemm_grid = 0;    // persistent GEMM CTAs; 0 = every SM
  double timeout_s = 10.0;
  // Non-null: the pass in FP8 (fp8_steps.hpp); its weights may be null for the deferred weight gradients.
  const Fp8Pass* fp8 = nullptr;
};

// One backward pass on `stream` over `saved` (a context a forward on this workspace filled).
// saved.g == nullptr: the context keeps only the routing table; g, u are recomputed first.
// Writes dx, dtopk_w and the weight gradients (grads.mode); dx and dtopk_w are NaN when the
// saved schedule was poisoned, a router weight was not finite or a wait timed out.
// defer (non-null): the weight gradients are not computed; dg, du, hs are left in *defer (the
// layer's context) for deferred_weight_grads.
void staged_backward(comm::CommState& state, ForwardBuffers& fwd, BackwardBuffers& bwd, const SavedContext& saved,
                     const BackwardArgs& args, const ExpertWeights& weights, const WeightGrads& grads,
                     const StagedBackwardOptions& options, cudaStream_t stream, const GradInputs* defer = nullptr);

// The staged backward's steps, also the fused backward's (fused_backward.cu) before and after its kernel:
// backward_prologue: the router weights checked; x, dy, topk_w staged; the x rows pulled (its
// start barrier: everything staged on every rank); with pull_dy the dy rows too; each row's
// router weight; padding rows zeroed; a routing-only context's g, u recomputed. Returns the
// context the GEMMs read (g, u from the recompute scratch for a routing-only one).
SavedContext backward_prologue(comm::CommState& state, ForwardBuffers& fwd, BackwardBuffers& bwd,
                               const SavedContext& saved, const BackwardArgs& args, const ExpertWeights& weights,
                               const StagedBackwardOptions& options, bool pull_dy, cudaStream_t stream);
// backward_finish: d topk_w to the owners (push_dtopk_rows), the dx rows to the owners' slots and
// the barrier of all ranks (combine), the fixed-order dx sum, d topk_w out of the landing slots,
// dx and d topk_w poisoned on any error.
void backward_finish(comm::CommState& state, BackwardBuffers& bwd, const comm::ScheduleView& v,
                     const BackwardArgs& args, const StagedBackwardOptions& options, bool push_dtopk_rows,
                     bool combine, cudaStream_t stream);
// Whether the x and dy pulls read the caller's x and dy in place (EP 1, 16-byte aligned: no
// peer reads the window, the staging copies are skipped) rather than the window's staged copies.
bool pulls_read_in_place(const LayerShape& shape, const BackwardArgs& args);
// Checks WeightGrads (mode, pointers, expert strides); throws kInvalidArgument naming the field.
void check_grads(const LayerShape& shape, const WeightGrads& grads);

// The weight gradients a deferring staged_backward left out (Megatron's backward_dw): x and dy
// pulled again over the saved routing table, then the K-grouped weight gradients from `in`
// (the context's dg, du, hs). Collective like the backward itself. The same bits as one call.
void deferred_weight_grads(comm::CommState& state, ForwardBuffers& fwd, BackwardBuffers& bwd,
                           const SavedContext& saved, const BackwardArgs& args, const WeightGrads& grads,
                           const GradInputs& in, const StagedBackwardOptions& options, cudaStream_t stream);

// Only the backward's GEMMs (shared then routed: dh + SwiGLU backward, dx, K-grouped weight
// gradients) on the rows already pulled (row buffer, dy rows, row weights): the "GEMMs alone"
// yardstick (with_hs false: without the elementwise hs rebuild) and the unfused baseline's GEMMs.
// `parts` (a mask of BackwardGemm bits) picks a subset: the benchmark's per-kind breakdown.
enum BackwardGemm : unsigned {
  kSharedDh = 1u, kSharedDx = 2u, kSharedWgrad = 4u, kRoutedDh = 8u, kRoutedDx = 16u, kRoutedWgrad = 32u,
  kAllBackwardGemms = 63u
};
void backward_gemms(comm::CommState& state, ForwardBuffers& fwd, BackwardBuffers& bwd, const SavedContext& saved,
                    const ExpertWeights& weights, const WeightGrads& grads, const StagedBackwardOptions& options,
                    bool with_hs, cudaStream_t stream, unsigned parts = kAllBackwardGemms,
                    const GradInputs* into = nullptr);

// The K-grouped weight-gradient launch of the shared expert (shared) or the routed experts over
// the rows already pulled: backward_gemms' launches and the fused backward's weight-gradient tasks.
gemm::WgradArgs backward_wgrad_args(comm::CommState& state, ForwardBuffers& fwd, BackwardBuffers& bwd,
                                    const SavedContext& saved, const WeightGrads& grads, const GradInputs& out,
                                    bool shared);

// Stream-ordered: the x rows over `saved`'s routing table, then GEMM 1 (shared and routed) into
// `out` (its g, u, shared g, u; h into the backward's hs scratch): the forward's saved
// activations, the same bits (recompute_forward_context, and the backward of a routing-only context).
void recompute_activations(comm::CommState& state, ForwardBuffers& fwd, BackwardBuffers& bwd, const SavedContext& saved,
                           const bf16* x, const ExpertWeights& weights, const SavedContext& out,
                           const StagedBackwardOptions& options, cudaStream_t stream);

}  // namespace mok::megakernel
