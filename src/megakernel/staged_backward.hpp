// The staged GPU backward (DESIGN §2, docs/numerics.md Backward): the steps of the backward
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

#include "comm/comm_state.hpp"
#include "comm/device_buffer.hpp"
#include "megakernel/context.hpp"
#include "megakernel/staged_forward.hpp"
#include "mok/api.hpp"

namespace mok::megakernel {

// The backward's scratch, sized once per workspace (every layer's backward reuses it).
struct BackwardBuffers {
  BackwardBuffers(const LayerShape& shape, int64_t buffer_rows);
  int64_t buffer_rows = 0, shared_rows = 0, col_tiles = 0;
  comm::DeviceBuffer<bf16> dy_rows;      // [buffer_rows, H] pulled dy rows (unscaled)
  comm::DeviceBuffer<bf16> dx_rows;      // [buffer_rows, H] dx of each routed row
  comm::DeviceBuffer<bf16> dg, du, hs;   // [buffer_rows, I]
  comm::DeviceBuffer<float> row_w;       // [buffer_rows] each row's router weight (0: padding)
  comm::DeviceBuffer<float> dw_part;     // [buffer_rows, col_tiles] d topk_w parts
  comm::DeviceBuffer<bf16> shared_dy;    // [shared_rows, H], padding rows zero
  comm::DeviceBuffer<bf16> shared_dg, shared_du, shared_hs;  // [shared_rows, I_shared]
  comm::DeviceBuffer<bf16> shared_dx;    // [shared_rows, H]
  comm::DeviceBuffer<float> ones;        // [T, K] 1.0f: the dx sum's weights
  size_t bytes() const;
};

struct StagedBackwardOptions {
  int comm_ctas = 16;   // pulls and the dx push
  int gemm_grid = 0;    // persistent GEMM CTAs; 0 = every SM
  double timeout_s = 10.0;
};

// One backward pass on `stream` over `saved` (a context a forward on this workspace filled).
// Writes dx, dtopk_w and the weight gradients (grads.mode); dx and dtopk_w are NaN when the
// saved schedule was poisoned, a router weight was not finite or a wait timed out.
void staged_backward(comm::CommState& state, ForwardBuffers& fwd, BackwardBuffers& bwd, const SavedContext& saved,
                     const BackwardArgs& args, const ExpertWeights& weights, const WeightGrads& grads,
                     const StagedBackwardOptions& options, cudaStream_t stream);

// Only the backward's GEMMs (shared then routed: dh + SwiGLU backward, dx, K-grouped weight
// gradients) on the rows already pulled (row buffer, dy rows, row weights): the "GEMMs alone"
// yardstick (with_hs false: without the elementwise hs rebuild) and the unfused baseline's GEMMs.
void backward_gemms(comm::CommState& state, ForwardBuffers& fwd, BackwardBuffers& bwd, const SavedContext& saved,
                    const ExpertWeights& weights, const WeightGrads& grads, const StagedBackwardOptions& options,
                    bool with_hs, cudaStream_t stream);

}  // namespace mok::megakernel
