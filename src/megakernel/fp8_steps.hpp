// The FP8 steps of the staged passes (Config::precision kFp8Block, docs/fp8.md "The FP8 layer"): the
// same launches as the bf16 staged forward and backward (staged_forward.hpp, staged_backward.hpp) with
// each expert GEMM replaced by its FP8 kind (gemm/grouped_gemm_fp8.hpp) and its operands quantized
// where the table of quantization points says: the dispatched x rows and dy rows 1x128 along H, h in
// GEMM 1's epilogue, dg and du in the dh GEMM's epilogue, the weight-gradient operands along the
// tokens, the weights 128x128 once per update (Fp8WeightViews, the memory of a mok::Fp8WeightCache).
// The bits are the FP8 reference's (ref::forward_fp8 / backward_fp8) up to the order of the sum
// inside each 128-wide K block, as for the GEMM kinds alone.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "comm/comm_state.hpp"
#include "gemm/grouped_gemm_fp8.hpp"
#include "megakernel/context.hpp"
#include "mok/api.hpp"

namespace mok::megakernel {

struct ForwardBuffers;
struct BackwardBuffers;
struct GradInputs;

// One stack of weight matrices in 128x128-block FP8: as is ([E, rows, cols]) and transposed
// ([E, cols, rows]), quantize_blocks_128x128's layouts.
struct Fp8Matrix {
  gemm::Fp8Weights w, w_t;
  int64_t batch = 0, rows = 0, cols = 0;
};

// The tensors an FP8 pass quantizes, in the order the workspace's non-finite records (and
// Workspace::check()) take them. The weights' come from the cache the pass read.
enum Fp8Tensor : int {
  kFp8X, kFp8H, kFp8SharedX, kFp8SharedH, kFp8Gu, kFp8SharedGu, kFp8Dy, kFp8DgDu, kFp8Hs, kFp8SharedDy, kFp8SharedDgDu, kFp8SharedHs,
  kFp8WeightGate, kFp8WeightUp, kFp8WeightDown, kFp8WeightSharedGate, kFp8WeightSharedUp, kFp8WeightSharedDown,
  kFp8Tensors
};
inline constexpr int kFp8Weights = 6;  // records kFp8WeightGate .. kFp8WeightSharedDown
// How check() names tensor t in its error ("mok fp8: non-finite value in <name> at row R, column C").
const char* fp8_tensor_name(int t);
// The columns of tensor t's row-major index (its record stores row * cols + col).
int64_t fp8_tensor_cols(int t, const LayerShape& shape);

// The FP8 copies of one layer's weights: gate, up, down, shared gate, up, down (the shared ones
// empty without a shared expert), and one non-finite record per matrix, in one memory block.
struct Fp8WeightViews {
  Fp8Matrix m[kFp8Weights];
  gemm::NonFiniteRecord* records = nullptr;  // [kFp8Weights]
  const Fp8Matrix& gate() const { return m[0]; }
  const Fp8Matrix& up() const { return m[1]; }
  const Fp8Matrix& down() const { return m[2]; }
  const Fp8Matrix& shared_gate() const { return m[3]; }
  const Fp8Matrix& shared_up() const { return m[4]; }
  const Fp8Matrix& shared_down() const { return m[5]; }
  // The block's bytes and the views into a block at `base` (256-byte aligned pieces).
  static size_t bytes(const LayerShape& shape);
  static Fp8WeightViews at(char* base, const LayerShape& shape);
};
// Quantizes `w` (both orientations) into `v`; the records are reset first. Stream-ordered.
void quantize_weights(const Fp8WeightViews& v, const ExpertWeights& w, cudaStream_t stream);

// An FP8 pass: the weights' copies and the recipe. The staged passes run in bf16 without one.
struct Fp8Pass {
  const Fp8WeightViews* weights = nullptr;
  bool fp8_wgrad = true;  // the weight-gradient GEMMs in FP8 (Config::fp8_weight_grads)
  // The forward dispatches x quantized (codes and scales: ~0.52x the bytes), else in bf16 and
  // quantizes the routed rows after it: the same bits (Workspace::Impl::fp8_dispatch, a testing knob).
  bool dispatch_fp8 = true;
};

// A dispatched FP8 row: x's H codes, then its ceil(H / 128) fp32 scales, padded to 16 bytes (the
// copies' vectors, TMA's row stride): H * (1 + 1/32) bytes, 0.516x a bf16 row for H >= 1024, and
// <= 2H for any H (a multiple of 64): it fits where a bf16 row goes, in the window and the routed buffer.
int64_t fp8_row_bytes(int64_t hidden);

// The forward's FP8 dispatch: x [tokens, H] quantized 1x128 (the record kFp8X indexes x itself)
// into packed rows in the window's dy staging area (free during a forward; the zero-copy x
// staging may hold x itself), then the dedup dispatch of those rows (fp8_row_bytes each) over the
// schedule into the routed buffer, then the scales of its live rows unpacked K-block major into
// fwd.fp8->x.scales (padding rows: scale 1, as the quantizer gives a zero row). Returns the routed
// x for forward_gemms_fp8 (codes in the routed buffer, row stride fp8_row_bytes).
gemm::Fp8Rows fp8_dispatch(comm::CommState& state, ForwardBuffers& fwd, const bf16* x, int64_t tokens, int ctas,
                           cudaStream_t stream);

// FP8 scratch of the passes (ForwardBuffers::fp8, BackwardBuffers::fp8), sized at workspace
// creation when the precision is FP8. Codes are e4m3 bytes, scales fp32 K-block major
// (gemm::Fp8Rows). The weight-gradient operands (transposed, quantized along the tokens) reuse
// the buffers of tensors dead by then: x^T those of x, hs^T those of h, dy^T those of dy, dg^T and
// du^T those of dg and du (each scale grid [rows / 128][cols] fits in the other's [ceil(cols / 128)][rows]).
struct Fp8Codes {
  comm::DeviceBuffer<uint8_t> codes;
  comm::DeviceBuffer<float> scales;
  Fp8Codes() = default;
  Fp8Codes(int64_t rows, int64_t cols);  // rows a multiple of 128
  gemm::Fp8Rows rows() const { return {codes.get(), scales.get()}; }
  Fp8Saved out() const { return {codes.get(), scales.get()}; }  // where a quantizer writes them
  size_t bytes() const { return codes.bytes() + scales.bytes(); }
};
struct Fp8ForwardScratch {
  Fp8ForwardScratch(const LayerShape& shape, int64_t buffer_rows, int64_t shared_rows);
  Fp8Codes x, h, shared_x, shared_h;
  comm::DeviceBuffer<gemm::NonFiniteRecord> records;  // [kFp8Tensors]; reset by check_fp8_records
  size_t bytes() const;
};
struct Fp8BackwardScratch {
  Fp8BackwardScratch(const LayerShape& shape, int64_t buffer_rows, int64_t shared_rows);
  Fp8Codes dy, dg, du, shared_dy, shared_dg, shared_du;
  size_t bytes() const;
};

// Stream-ordered: the weights' records of the pass's cache folded into the workspace's (a
// non-finite weight poisons every pass that reads the cache until check()).
void merge_weight_records(ForwardBuffers& fwd, const Fp8Pass& pass, cudaStream_t stream);
// Stream-ordered: `n` elements of `out` (bf16 pairs as 32-bit words, or fp32) set to NaN when any
// record is set (never finite wrong numbers; check() names the tensor).
void poison_on_nonfinite(const ForwardBuffers& fwd, void* out, int64_t words, cudaStream_t stream);
// Synchronises `stream`, then throws mok::Error(kInvalidArgument) for the first set record in
// Fp8Tensor order after resetting all of them (the workspace recovers).
void check_fp8_records(ForwardBuffers& fwd, const LayerShape& shape, cudaStream_t stream);

// The forward's expert GEMMs in FP8 for the shared expert (shared; its rows fwd.shared_x) or the
// routed experts (segments `seg` over x_rows, the first *live_rows rows live): x quantized (or,
// with `dispatched`, x as fp8_dispatch left it), GEMM 1 + SwiGLU into save's g, u (h quantized in its
// epilogue; with save's g8, u8 g and u are quantized there instead of stored in bf16: the FP8
// context's copies), with gemm2 GEMM 2 into the expert outputs (without: the backward's recompute).
void forward_gemms_fp8(const LayerShape& shape, ForwardBuffers& fwd, const gemm::Segments& seg, const bf16* x_rows,
                       const int64_t* live_rows, const Fp8Pass& pass, const SavedContext& save,
                       const gemm::Launch& launch, bool shared, bool gemm2, cudaStream_t stream,
                       const gemm::Fp8Rows* dispatched = nullptr);

// The FP8 context's g, u (SavedContext::g8, u8, shared ones; DeepSeek-V3's FP8-cached SwiGLU input),
// written by GEMM 1's epilogue (forward_gemms_fp8 with save's g8): load dequantizes them back into
// `into`'s bf16 g, u (exact: the bf16 values of the copies); round quantizes and dequantizes in place
// `gu`'s bf16 g, u (the backward's recompute of a routing-only context: the bits of a saved one).
// Routed rows: the schedule `v`'s live rows; shared: all of fwd.shared_rows.
void load_activations_fp8(const LayerShape& shape, const ForwardBuffers& fwd, const comm::ScheduleView& v,
                          const SavedContext& from, const SavedContext& into, cudaStream_t stream);
void round_activations_fp8(const LayerShape& shape, ForwardBuffers& fwd, const comm::ScheduleView& v,
                           const SavedContext& gu, cudaStream_t stream);

// The backward's dgrad chain in FP8 for the shared expert (shared) or the routed experts: dy rows
// quantized, dh + SwiGLU backward (with the d topk_w parts when routed) into out's dg, du, then dx.
// With dy_t_too (dh, and the FP8 weight gradients to follow in the same pass) the one pass over dy
// also writes dy^T (quantize_cols_128x1_transposed's row_codes), into x's FP8 buffer (free in a
// backward; x^T then goes into dy's): backward_wgrad_fp8 with dy_t_ready reads it there.
void backward_dgrad_fp8(const comm::CommState& state, ForwardBuffers& fwd, BackwardBuffers& bwd,
                        const SavedContext& saved, const Fp8Pass& pass, const GradInputs& out, bool shared,
                        bool dh, bool dx, const gemm::Launch& launch, cudaStream_t stream, bool dy_t_too = false);

// The K-grouped weight gradients in FP8 for the shared expert or the routed ones: each operand
// transposed and quantized along the tokens, then wgrad_fp8 (three problems, grads.mode); dy^T as
// backward_dgrad_fp8 left it with dy_t_too when dy_t_ready.
void backward_wgrad_fp8(const comm::CommState& state, ForwardBuffers& fwd, BackwardBuffers& bwd,
                        const SavedContext& saved, const bf16* x_rows, const WeightGrads& grads,
                        const GradInputs& in, bool shared, const gemm::Launch& launch, cudaStream_t stream,
                        bool dy_t_ready = false);

}  // namespace mok::megakernel
