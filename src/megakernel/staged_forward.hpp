// The staged GPU forward: the steps of docs/architecture.md as consecutive stream-ordered launches
// (schedule -> dispatch -> shared expert -> GEMM1+SwiGLU -> GEMM2 -> combine -> top-k sum),
// no host synchronisation. It is the first correct GPU forward, the "GEMMs alone" yardstick
// of the fused kernel, and computes exactly what the fused kernel computes (same roles, same
// GEMM kernels), so its bits are the fused kernel's bits.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <utility>

#include "comm/comm_state.hpp"
#include "comm/device_buffer.hpp"
#include "gemm/grouped_gemm.hpp"
#include "megakernel/context.hpp"
#include "megakernel/fp8_steps.hpp"
#include "mok/api.hpp"

namespace mok::megakernel {

// Buffers of the forward pass beyond the communication layer's, sized once per workspace.
struct ForwardBuffers {
  // resident_rows: rows of h, g, u (and expert_out) kept; 0 or >= buffer_rows: every row. Fewer
  // (Config::resident_routed_rows) make them the fused forward's macrobatch ring, whose GEMM 2
  // pushes every row into its slot, so expert_out then holds one row tile (never written).
  ForwardBuffers(const LayerShape& shape, const Config& config, int64_t buffer_rows, int64_t resident_rows = 0);

  int64_t buffer_rows = 0;       // rows of the expert-major buffer (multiple of kRowTile)
  int64_t resident_rows = 0;     // rows of h, g, u: buffer_rows, or the macrobatch ring's rows
  int64_t shared_rows = 0;       // T rounded up to kRowTile (shared expert row buffer)
  bool ring() const { return resident_rows < buffer_rows; }
  size_t bytes() const {  // device memory of all the buffers below
    return seg_offsets.bytes() + seg_rows.bytes() + shared_offsets.bytes() + shared_rows_dev.bytes() + h.bytes() +
           g.bytes() + u.bytes() + expert_out.bytes() + shared_x.bytes() + shared_h.bytes() + shared_out.bytes() +
           gemm_error.bytes() + tile_counters.bytes() + (fp8 ? fp8->bytes() : 0);
  }
  comm::DeviceBuffer<int32_t> seg_offsets, seg_rows;        // [E_local + 1], [E_local] for the GEMMs
  comm::DeviceBuffer<int32_t> shared_offsets, shared_rows_dev;  // one segment of T rows
  // h [resident_rows, I]. g, u: the macrobatch ring's only (the saved g, u go to the layer's
  // context, SavedContext): routed row tile t (of the schedule's padded rows) lives in slot
  // t % (resident_rows / 128); after a pass the slots hold the last resident_rows / 128 row tiles
  // (see resident_tile). Without the ring they are empty.
  comm::DeviceBuffer<bf16> h, g, u;
  comm::DeviceBuffer<bf16> expert_out;                      // [buffer_rows, H] (ring: [128, H], unused)
  comm::DeviceBuffer<bf16> shared_x;                        // [shared_rows, H], padding rows zero
  comm::DeviceBuffer<bf16> shared_h;                        // [shared_rows, I_shared]
  comm::DeviceBuffer<bf16> shared_out;                      // [shared_rows, H]
  comm::DeviceBuffer<uint32_t> gemm_error;                  // GEMM error bits (gemm::ErrorBit)
  // Fused forward completion counters, zeroed before each pass: s1_done [shared_rows / 128],
  // g1_done and g2_done [buffer_rows / 128] each, s2_done [shared_rows / 128], then the top-k
  // sum's work counter and the task counter (src/megakernel/fused_roles.cuh, fused_topk_sum.cuh).
  comm::DeviceBuffer<uint32_t> tile_counters;
  // Config::precision kFp8Block: the quantized operands and the non-finite records (fp8_steps.hpp).
  std::unique_ptr<Fp8ForwardScratch> fp8;
};

struct StagedForwardOptions {
  int dispatch_ctas = 16;
  int combine_ctas = 16;
  int gemm_grid = 0;    // persistent GEMM CTAs; 0 = every SM
  double timeout_s = 10.0;
  // Non-null: the pass in FP8 (the GEMMs of fp8_steps.hpp on these weight copies).
  const Fp8Pass* fp8 = nullptr;
};

// One forward pass on `stream` after mok::schedule(): dedup dispatch, the expert GEMMs, the
// in-place combine (only other ranks' rows move), the top-k sum. Writes y, and g, u, shared g, u
// into `save` (the layer's context).
void staged_forward(comm::CommState& state, ForwardBuffers& buffers, const ForwardArgs& args,
                    const ExpertWeights& weights, const StagedForwardOptions& options, const SavedContext& save,
                    cudaStream_t stream);

// Only the expert GEMMs of the pass (shared + routed GEMM1 and GEMM2) on the rows already in
// the buffers: the "GEMMs alone" time of the benchmark.
void forward_gemms_only(comm::CommState& state, ForwardBuffers& buffers, const ExpertWeights& weights,
                        const StagedForwardOptions& options, const SavedContext& save, cudaStream_t stream);

// Where routed row tile `tile` of a pass with `padded_rows` rows sits in h, g, u afterwards: its
// row tile index there, or -1 when the macrobatch ring no longer holds it (backward recomputes
// it). Without a ring, the tile itself.
int64_t resident_tile(const ForwardBuffers& buffers, int64_t tile, int64_t padded_rows);

// Steps shared by the staged and the fused forward.
// The schedule's int64 segment table -> the GEMM engine's int32 one (empty when poisoned).
void convert_segments(comm::CommState& state, ForwardBuffers& buffers, cudaStream_t stream);
// Records the first non-finite entry of topk_w [T, K] in the error record (poison_y_on_error
// then poisons y; Workspace::check() throws kInvalidArgument naming it).
// The staged launches' GEMM launch: `grid` CTAs (0 = every SM), the workspace's GEMM error word.
gemm::Launch gemm_launch(ForwardBuffers& buffers, int grid, double timeout_s);
void check_router_weights(comm::CommState& state, const float* topk_w, int64_t tokens, cudaStream_t stream);
// The shared expert's operands for a call of `tokens` (<= T) tokens: its segment gets that many
// real rows, and each (dst, src) pair's row operand dst ([shared_rows, H]: ForwardBuffers::shared_x,
// BackwardBuffers::shared_dy) the rows of src [tokens, H] with zero rows after them (the zero
// padding rows the GEMMs expect). Only for layers with a shared expert.
void stage_shared_rows(ForwardBuffers& buffers, int64_t tokens, int64_t hidden,
                       std::initializer_list<std::pair<bf16*, const bf16*>> rows, cudaStream_t stream);
// y = NaN (0xFFFF) when the schedule was poisoned, a router weight was not finite or a wait of
// this rank timed out: never silently wrong (Workspace::check() throws the reason).
void poison_y_on_error(comm::CommState& state, bf16* y, int64_t tokens, cudaStream_t stream);

// Throws the first GEMM error recorded since the last call (after synchronising `stream`).
void check_gemm_errors(ForwardBuffers& buffers, cudaStream_t stream);

}  // namespace mok::megakernel
