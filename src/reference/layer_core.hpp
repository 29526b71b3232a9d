// Internal to the reference: the layer written once over Real = float (bf16 rounding at the
// points of docs/numerics.md) or Real = double (no rounding). Data are held as Real values;
// in the float variant every stored activation is a bf16 value held exactly in a float.
//
// NOTE on fp32 contraction: every GEMM of the float variant multiplies two bf16 values, whose
// product is exact in fp32, so a compiler that fuses `acc += a*b` into an FMA produces the
// same bits. The two sums whose products are not exact are written with std::fma (one
// rounding per step, whatever the compiler): the y epilogue and the d topk_w dot (fp32 dhr
// against bf16 h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "mok/config.hpp"
#include "mok/shape.hpp"
#include "reference/bf16.hpp"
#include "reference/layer.hpp"
#include "reference/schedule.hpp"

namespace mok::ref::detail {

// bf16(v) of numerics.md; the identity in the double variant.
inline float act(float v) { return round_bf16(v); }
inline double act(double v) { return v; }

template <class Real>
Real sigmoid(Real g) {
  return Real(1) / (Real(1) + std::exp(-g));
}

// Forward step 2: h = bf16(silu(g) * u), silu(g) = g * sigmoid(g). Backward rebuilds h with
// this same function, so the rebuilt h is bit-identical.
template <class Real>
Real swiglu(Real g, Real u) {
  return act(g * sigmoid(g) * u);
}

// Backward step 4 (SwiGLU backward from the saved g, u).
template <class Real>
void swiglu_backward(Real dh, Real g, Real u, Real& dg, Real& du) {
  const Real s = sigmoid(g);
  dg = act(dh * u * s * (Real(1) + g * (Real(1) - s)));
  du = act(dh * g * s);
}

// One expert's weights (routed or shared): gate/up [inter, hidden], down [hidden, inter].
template <class Real>
struct MlpWeights {
  const Real* gate = nullptr;
  const Real* up = nullptr;
  const Real* down = nullptr;
  int64_t inter = 0;
  int64_t hidden = 0;
  const Fp8Recipe* fp8 = nullptr;  // the FP8 recipe (float variant only), nullptr: bf16
};

// Forward steps 1-3 on n rows x [n, H]: writes g, u [n, I] (saved context) and o [n, H].
template <class Real>
void mlp_forward(const MlpWeights<Real>& w, const Real* x, int64_t n, Real* g, Real* u, Real* o,
                 int threads);

// Backward steps 2-6 on n rows, from the UNSCALED dy rows [n, H], the rows' router weights
// row_w [n] (nullptr for the shared expert: weight 1, no multiply) and the saved g, u [n, I]:
//   step 2  dhr = dy . W_down (fp32, the unscaled hidden gradient);
//   step 3  h rebuilt from g, u; dtopk_w[r] = sum_i dhr[i] * h[i] (fma, i ascending), written
//           only when dtopk_w is not null: the dgrad's own accumulator gives d topk_w, so no
//           expert output o and no second GEMM are needed;
//   step 4  dh = row_w[r] * dhr, SwiGLU backward -> dgu [n, 2I] (dg | du, bf16);
//   step 5  dx [n, H] = bf16([dg | du] . [W_gate ; W_up]);
//   step 6  hs [n, I] = bf16(row_w[r] * h) (= h without weights), the W_down wgrad operand.
template <class Real>
void mlp_backward(const MlpWeights<Real>& w, const Real* dy, const Real* row_w, const Real* g,
                  const Real* u, int64_t n, Real* dgu, Real* hs, Real* dx, Real* dtopk_w,
                  int threads);

// Backward steps 3, 4 and 6 of mlp_backward on n rows from the hidden gradient dhr [n, I] (step 2's,
// whatever GEMM made it): d topk_w (when dtopk_w is not null), dgu [n, 2I], hs [n, I].
template <class Real>
void swiglu_backward_rows(const Real* dhr, const Real* row_w, const Real* g, const Real* u, int64_t n, int64_t I,
                          Real* dgu, Real* hs, Real* dtopk_w);

// Weight gradients over the n rows in the given (canonical) order, from mlp_backward's dgu
// and hs: dgate/dup [I, H] = sum_r dg_r/du_r (x) x_r, ddown [H, I] = sum_r dy_r (x) hs_r
// (dy unscaled: the router weight is in hs).
template <class Real>
void mlp_wgrad(const MlpWeights<Real>& w, const Real* x, const Real* dy, const Real* dgu,
               const Real* hs, int64_t n, Real* dgate, Real* dup, Real* ddown, int threads);

// The FP8 recipe's versions of the three (layer_fp8.cpp): the same steps with the expert GEMMs
// on e4m3 operands (docs/fp8.md); mlp_forward / mlp_backward / mlp_wgrad call them when w.fp8.
// threads: the parallel_for of dense.hpp over output rows (each element's sum is sequential: the bits
// do not depend on it).
void mlp_forward_fp8(const MlpWeights<float>& w, const float* x, int64_t n, float* g, float* u, float* o,
                     int threads);
void mlp_backward_fp8(const MlpWeights<float>& w, const float* dy, const float* row_w, const float* g,
                      const float* u, int64_t n, float* dgu, float* hs, float* dx, float* dtopk_w, int threads);
void mlp_wgrad_fp8(const MlpWeights<float>& w, const float* x, const float* dy, const float* dgu, const float* hs,
                   int64_t n, float* dgate, float* dup, float* ddown, int threads);

// The public element type of a Real variant: bf16 bits for float, double for double.
template <class Real>
using PublicElem = std::conditional_t<std::is_same_v<Real, float>, uint16_t, double>;

// The weights as the caller gave them (routed: global [E, ...] view). They are converted to
// Real one expert at a time, so the reference's memory does not scale with E*I*H in fp32.
template <class Real>
struct CoreWeights {
  const BasicLayerWeights<PublicElem<Real>>* src = nullptr;
  const Fp8Recipe* fp8 = nullptr;  // every expert GEMM in FP8 (float variant only)
};

// The inputs as Real values.
template <class Real>
struct CoreInputs {
  std::vector<std::vector<Real>> x;
  const std::vector<std::vector<int32_t>>* topk_idx = nullptr;
  std::vector<std::vector<Real>> topk_w;
};

template <class Real>
BasicForwardResult<Real> forward_core(const LayerShape& shape, const CoreWeights<Real>& w,
                                      const CoreInputs<Real>& in, Schedule schedule, int threads);

template <class Real>
BasicGradients<Real, Real> backward_core(const LayerShape& shape, const CoreWeights<Real>& w,
                                         const CoreInputs<Real>& in,
                                         const std::vector<std::vector<Real>>& dy,
                                         const BasicForwardContext<Real>& ctx, int threads);

// The dispatch (docs/comm.md): rows of schedule.ranks[rank] copied from their owners' x ([ep][T*H]) into an
// expert-major [padded_rows, H] buffer; padding rows are zero. Backward pulls dy the same way.
template <class Elem>
std::vector<Elem> dispatch(const LayerShape& shape, const RankSchedule& rs,
                           const std::vector<std::vector<Elem>>& x) {
  const int64_t H = shape.hidden;
  std::vector<Elem> buf(static_cast<size_t>(rs.padded_rows * H), Elem(0));
  for (int64_t p = 0; p < rs.padded_rows; ++p) {
    const RowRef& row = rs.rows[p];
    if (row.is_padding()) continue;
    const Elem* src = x[row.src_rank].data() + row.token * H;
    std::copy(src, src + H, buf.begin() + p * H);
  }
  return buf;
}

}  // namespace mok::ref::detail
