// CPU reference of the whole MoE layer (docs/architecture.md, determinism.md, numerics.md), simulating `ep` expert-parallel ranks
// in one process. This is the oracle every GPU test compares against: it follows docs/numerics.md
// step by step (schedule -> dispatch -> per-expert SwiGLU MLP on the expert-major buffer ->
// combine into slots (t, k) -> fixed-order epilogue; backward mirrors it) and
// docs/numerics.md exactly (bf16 rounding points, fmaf in the y epilogue, sequential fp32
// sums). Every fp32 reduction runs in one fixed order; threads only split independent output
// elements, so results are bitwise identical for any thread count and any ep split of the
// same global batch (except the shared-expert weight gradients, per-rank partial sums).
//
// Two variants:
//   forward / backward           bf16 data (uint16_t bits), fp32 math, numerics.md rounding;
//   forward_f64 / backward_f64   double data and math, NO rounding anywhere: the layer is then
//                                a smooth function and backward its exact gradient
//                                (finite-difference tests).
//
// Layout: all per-rank vectors are indexed [rank][...] with rank in [0, ep); token t of rank s
// is global token s*T + t. Routed weights are the GLOBAL view [E, ...]: rank r owns experts
// [r*E_local, (r+1)*E_local). Shared weights are identical on every rank.
#pragma once

#include <cstdint>
#include <vector>

#include "mok/config.hpp"
#include "mok/shape.hpp"
#include "reference/schedule.hpp"

namespace mok::ref {

// Elem: uint16_t (bf16 bits) or double.
template <class Elem>
struct BasicLayerWeights {
  std::vector<Elem> gate, up;   // [E, I, H]
  std::vector<Elem> down;       // [E, H, I]
  std::vector<Elem> shared_gate, shared_up;  // [I_sh, H]; empty when I_sh = 0
  std::vector<Elem> shared_down;             // [H, I_sh]; empty when I_sh = 0
};

template <class Elem, class Weight>
struct BasicLayerInputs {
  std::vector<std::vector<Elem>> x;            // [ep][T*H]
  std::vector<std::vector<int32_t>> topk_idx;  // [ep][T*K] global expert ids
  std::vector<std::vector<Weight>> topk_w;     // [ep][T*K] router weights
};

// What backward needs from forward, per rank r (the saved forward context, docs/architecture.md):
//   g, u       [padded_rows(r), I]: bf16 gate/up pre-activations of every row of r's
//              expert-major receive buffer (schedule.ranks[r].rows says which (s, t, k) a row
//              is); padding rows are zero. h is rebuilt from them bit-exactly.
//   shared_g, shared_u [T, I_sh]: the shared expert's pre-activations of r's tokens (empty
//              without a shared expert).
// The expert outputs (combine slots) are not kept: d topk_w comes from the dgrad's hidden
// gradient and the rebuilt h (docs/numerics.md "Backward", step 3).
template <class Elem>
struct BasicRankContext {
  std::vector<Elem> g, u;
  std::vector<Elem> shared_g, shared_u;
};

template <class Elem>
struct BasicForwardContext {
  Schedule schedule;
  std::vector<BasicRankContext<Elem>> ranks;  // [ep]
};

template <class Elem>
struct BasicForwardResult {
  std::vector<std::vector<Elem>> y;  // [ep][T*H]
  BasicForwardContext<Elem> ctx;
};

// Elem: bf16 bits or double; Acc: fp32 or double.
template <class Elem, class Acc>
struct BasicGradients {
  std::vector<std::vector<Elem>> dx;       // [ep][T*H]
  std::vector<std::vector<Acc>> dtopk_w;   // [ep][T*K]
  std::vector<Acc> dgate, dup;             // [E, I, H] routed, global view, fp32 sums
  std::vector<Acc> ddown;                  // [E, H, I]
  // Per-rank partial sums over that rank's tokens ([ep][I_sh*H] / [ep][H*I_sh]); the caller
  // all-reduces them. Empty vectors without a shared expert.
  std::vector<std::vector<Acc>> shared_dgate, shared_dup, shared_ddown;
};

using LayerWeights = BasicLayerWeights<uint16_t>;
using LayerInputs = BasicLayerInputs<uint16_t, float>;
using RankContext = BasicRankContext<uint16_t>;
using ForwardContext = BasicForwardContext<uint16_t>;
using ForwardResult = BasicForwardResult<uint16_t>;
using Gradients = BasicGradients<uint16_t, float>;

using LayerWeightsF64 = BasicLayerWeights<double>;
using LayerInputsF64 = BasicLayerInputs<double, double>;
using ForwardContextF64 = BasicForwardContext<double>;
using ForwardResultF64 = BasicForwardResult<double>;
using GradientsF64 = BasicGradients<double, double>;

// y = shared(x) + sum_k topk_w[t,k] * expert_{topk_idx[t,k]}(x[t]) for every rank, plus the
// forward context. threads <= 0: one per hardware thread. Throws mok::Error: kInvalidArgument
// naming the bad argument (shape, config, vector sizes, routing), kCapacityOverflow.
ForwardResult forward(const LayerShape& shape, const Config& config, const LayerWeights& weights,
                      const LayerInputs& inputs, int threads = 0);

// dx, d topk_w and all weight gradients from dy ([ep][T*H] bf16). `saved` is the context of a
// forward on the same inputs; nullptr recomputes it first (bitwise the same result).
Gradients backward(const LayerShape& shape, const Config& config, const LayerWeights& weights,
                   const LayerInputs& inputs, const std::vector<std::vector<uint16_t>>& dy,
                   const ForwardContext* saved, int threads = 0);

// The FP8 training recipe of docs/fp8.md on the bf16 layer: every expert GEMM (routed and
// shared, forward and backward) takes e4m3 operands with power-of-two block scales (activations
// and gradients 1x128 along the reduction dimension, weights 128x128) and the two-level
// accumulation of ref::dot_fp8; every other step (schedule, dispatch, SwiGLU, bf16 roundings,
// combine, y and dx epilogues, d topk_w) is the bf16 layer's. Quantization points (docs/fp8.md):
// forward x, W_gate, W_up (G1), h, W_down (G2); backward dy, W_down^T (dh), dg, du, W_gate^T,
// W_up^T (dx); with fp8_wgrad the weight gradients' operands x^T, dg^T, du^T, dy^T, hs^T in 1x128
// blocks along the tokens of each expert, from its first row in canonical order (so D3 holds);
// without, the weight gradients are the bf16 layer's fp32 sums over the same dg, du, hs.
struct Fp8Recipe {
  bool fp8_wgrad = true;
};
ForwardResult forward_fp8(const LayerShape& shape, const Config& config, const LayerWeights& weights,
                          const LayerInputs& inputs, const Fp8Recipe& recipe = {}, int threads = 0);
Gradients backward_fp8(const LayerShape& shape, const Config& config, const LayerWeights& weights,
                       const LayerInputs& inputs, const std::vector<std::vector<uint16_t>>& dy,
                       const ForwardContext* saved, const Fp8Recipe& recipe = {}, int threads = 0);

// The same layer in double precision without any rounding (gradient checks).
ForwardResultF64 forward_f64(const LayerShape& shape, const Config& config,
                             const LayerWeightsF64& weights, const LayerInputsF64& inputs,
                             int threads = 0);
GradientsF64 backward_f64(const LayerShape& shape, const Config& config,
                          const LayerWeightsF64& weights, const LayerInputsF64& inputs,
                          const std::vector<std::vector<double>>& dy,
                          const ForwardContextF64* saved, int threads = 0);

// The dispatch alone (docs/comm.md): the expert-major receive buffer [padded_rows, H] (bf16) of `rank`, with
// the rows of schedule.ranks[rank] copied from their owners' x; padding rows are zero.
std::vector<uint16_t> dispatch_rows(const LayerShape& shape, const Schedule& schedule, int rank,
                                    const std::vector<std::vector<uint16_t>>& x);

}  // namespace mok::ref
