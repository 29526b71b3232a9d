// Config: the knobs of a layer. Knobs change speed and memory, never results (D2,
// docs/determinism.md): every engine and count below gives the same bits.
#pragma once

#include <cstdint>
#include <string>

#include "mok/shape.hpp"

namespace mok {

// Which kernels run a pass. The fused engines are one persistent kernel per pass (communication
// and GEMMs overlapped); the staged engines are the same roles as separate launches, the tests'
// oracle for the fused ones (bitwise equal). docs/megakernel.md says how each works.
enum class ForwardEngine : int32_t {
  kFused = 0,   // default
  kStaged = 1,  // no macrobatch ring: the routed buffers keep every row
};
enum class BackwardEngine : int32_t {
  kAuto = 0,  // the faster engine for the call's gradient mode (auto_backward_engine)
  kFused = 1,
  kStaged = 2,
};
// The arithmetic of the expert GEMMs (docs/fp8.md). kFp8Block: DeepSeek-V3's block-scaled FP8 on
// Hopper: e4m3 operands (activations and gradients in 1x128 blocks along the reduction, weights
// in 128x128 blocks), power-of-two fp32 block scales, fp32 accumulation promoted every 128 of K.
// Inputs, outputs, router weights and gradients keep their dtypes; only the GEMMs' operands are
// quantized. Unlike the knobs below, the precision changes results (the FP8 layer's bits are the
// FP8 reference's, ref::forward_fp8); D1-D3 hold within each precision.
enum class Precision : int32_t {
  kBf16 = 0,      // default
  kFp8Block = 1,
};
const char* to_string(ForwardEngine engine);
const char* to_string(BackwardEngine engine);
const char* to_string(Precision precision);
// The engine BackwardEngine::kAuto runs: fp32_main_grads is WeightGrads::mode == kAccumulateFp32. The
// rule and the run it comes from are in docs/megakernel.md ("Choosing the backward engine").
BackwardEngine auto_backward_engine(bool fp32_main_grads);

struct Config {
  // SMs of the persistent grid that run communication roles (dispatch/combine).
  // comm_sms_forward 0 = automatic (effective_comm_sms_forward): at EP >= 2 enough CTAs to move
  // the pass's token rows in about the time its GEMMs take on the other SMs; at EP 1 (no
  // combine; the comm CTAs join the GEMM work after their dispatch share) at least one per
  // 60 MB of routed rows, up to 16; the staged forward (and every FP8 forward) at EP 1 the whole
  // grid, since its launches run alone (effective_comm_sms_staged_forward). comm_sms_backward 0 = automatic: the staged backward's
  // communication launches (and the fused backward's x pull before its kernel) at EP 1 the
  // whole grid (grid_sms, else every SM), since they run alone on the stream, at EP >= 2 16
  // (fitted to grid_sms); the fused backward's kernel at EP 1 every SM but one, at EP >= 2 the
  // forward's count (effective_comm_sms_fused_backward). With
  // grid_sms set, the forward's automatic count is fitted to leave at least one GEMM SM; an
  // explicit one must be below grid_sms. Any count gives the same bits.
  int comm_sms_forward = 0;
  int comm_sms_backward = 0;
  // Routed rows per overlap step (GEMMs on a minibatch start once its rows arrived).
  // 0 = automatic (chosen from the shape). Otherwise a positive multiple of kRowTile.
  int64_t minibatch = 0;
  // Routed rows kept resident (rows of the expert-major buffer): 0 = all of them. Otherwise a
  // positive multiple of the minibatch; below buffer_rows_per_rank it must hold at least two
  // minibatches, and the fused forward then runs its routed rows through a ring of that many
  // rows (dispatched rows, hidden rows, the saved g and u; docs/megakernel.md "The macrobatch ring"),
  // so the workspace's routed buffers shrink to it; after the pass the ring holds the saved
  // context of the last macrobatch of row tiles (backward recomputes the others). Speed and
  // memory only: the same bits (D2).
  int64_t macrobatch = 0;
  // Worst-case share of all routed rows that may land on one rank, as a multiple of the
  // balanced share T*K. Sizes the receive buffers; exceeding it is a kCapacityOverflow
  // error, never a silent drop. Values above ep are the same as ep (overflow impossible).
  double capacity = 2.0;
  // Persistent grid size in SMs; 0 = every SM of the device, else at least 2.
  int grid_sms = 0;
  // Largest time one in-kernel wait may spin before it reports kTimeout.
  double wait_timeout_s = 10.0;
  // The engines (above). Speed only: the same bits (D2).
  ForwardEngine forward_engine = ForwardEngine::kFused;
  BackwardEngine backward_engine = BackwardEngine::kAuto;
  // The precision (above) and, with kFp8Block, whether the weight-gradient GEMMs run in FP8 too
  // (true, the default) or in bf16 over the same dg, du, hs (ref::Fp8Recipe::fp8_wgrad).
  // Today kFp8Block runs the staged engines' launches with the FP8 GEMM kinds whatever
  // forward_engine / backward_engine say (the fused FP8 passes are to come), so it needs every
  // routed row resident (no macrobatch ring).
  Precision precision = Precision::kBf16;
  bool fp8_weight_grads = true;

  // Throws mok::Error(kInvalidArgument) naming the first bad knob.
  void validate(const LayerShape& shape) const;
  std::string to_string() const;

  // Real (unpadded) routed rows one rank may receive: ceil(min(capacity, ep) * T * K).
  int64_t max_rows_per_rank(const LayerShape& shape) const;
  // Rows of the expert-major receive buffer: the rows above plus per-expert padding to kRowTile.
  int64_t buffer_rows_per_rank(const LayerShape& shape) const;
  // The minibatch actually used (resolves 0 = automatic).
  int64_t effective_minibatch(const LayerShape& shape) const;
  // Rows of the routed buffers the fused forward keeps: macrobatch when it is set and below
  // buffer_rows_per_rank (a ring), else buffer_rows_per_rank (every row).
  int64_t resident_routed_rows(const LayerShape& shape) const;
  // The communication CTAs of the forward / backward actually used (resolves 0 = automatic).
  int effective_comm_sms_forward(const LayerShape& shape) const;
  // The staged forward's dispatch and combine launches (ForwardEngine::kStaged, and every FP8 forward):
  // comm_sms_forward, or (automatic) at EP 1 the whole grid (device_sms when grid_sms is 0; 0 = unknown:
  // 16), since they run alone on the stream, at EP >= 2 the fused forward's count.
  int effective_comm_sms_staged_forward(const LayerShape& shape, int device_sms) const;
  // device_sms: the SMs of the device the backward runs on (used when grid_sms is 0; 0 = unknown: 16).
  // The staged backward's communication launches (and the fused backward's x pull before its kernel).
  int effective_comm_sms_backward(const LayerShape& shape, int device_sms) const;
  // The fused backward kernel's communication CTAs (BackwardEngine::kFused): comm_sms_backward,
  // or (automatic) at EP 1 every CTA of the grid but one (all pull the local dy rows, then take
  // GEMM tasks; 16 with device_sms unknown), at EP >= 2 the forward's count (the same rows move).
  int effective_comm_sms_fused_backward(const LayerShape& shape, int device_sms) const;
  // The backward engine a call runs (resolves kAuto by the gradient mode).
  BackwardEngine effective_backward_engine(bool fp32_main_grads) const;
};

}  // namespace mok
