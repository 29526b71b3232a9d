// One expert's SwiGLU MLP on a block of rows, forward, backward and weight gradients, in the
// exact steps of docs/numerics.md. Every matrix product is a gemm_nt (one sequential chain per
// output element); the per-row d topk_w is one fma chain over i; rounding happens only where
// numerics.md says bf16(...).
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "reference/dense.hpp"
#include "reference/layer_core.hpp"

namespace mok::ref::detail {
namespace {

template <class Real>
void round_all(std::vector<Real>& v) {
  for (Real& e : v) e = act(e);
}

}  // namespace

template <class Real>
void mlp_forward(const MlpWeights<Real>& w, const Real* x, int64_t n, Real* g, Real* u, Real* o,
                 int threads) {
  const int64_t H = w.hidden, I = w.inter;
  if (n == 0) return;
  if constexpr (std::is_same_v<Real, float>) {
    if (w.fp8 != nullptr) return mlp_forward_fp8(w, x, n, g, u, o, threads);
  }
  // Step 1: g = bf16(dot(W_gate[i], v)), u = bf16(dot(W_up[i], v)).
  std::vector<Real> acc(static_cast<size_t>(n * I));
  gemm_nt<Real>({x, H, false}, w.gate, H, acc.data(), I, n, I, H, threads);
  round_all(acc);
  std::copy(acc.begin(), acc.end(), g);
  gemm_nt<Real>({x, H, false}, w.up, H, acc.data(), I, n, I, H, threads);
  round_all(acc);
  std::copy(acc.begin(), acc.end(), u);
  // Step 2: h = bf16(silu(g) * u).
  std::vector<Real> h(static_cast<size_t>(n * I));
  for (int64_t e = 0; e < n * I; ++e) h[e] = swiglu(g[e], u[e]);
  // Step 3: o = bf16(dot(W_down[j], h)).
  gemm_nt<Real>({h.data(), I, false}, w.down, I, o, H, n, H, I, threads);
  for (int64_t e = 0; e < n * H; ++e) o[e] = act(o[e]);
}

template <class Real>
void swiglu_backward_rows(const Real* dhr, const Real* row_w, const Real* g, const Real* u, int64_t n, int64_t I,
                          Real* dgu, Real* hs, Real* dtopk_w) {
  for (int64_t r = 0; r < n; ++r) {
    const Real weight = row_w != nullptr ? row_w[r] : Real(1);
    Real dw = Real(0);
    for (int64_t i = 0; i < I; ++i) {
      const int64_t e = r * I + i;
      // Step 3: h rebuilt bit-exactly; d topk_w = sum_i dhr[i] * h[i] = dot(dy, W_down h).
      const Real h = swiglu(g[e], u[e]);
      dw = std::fma(dhr[e], h, dw);
      // Step 4: dh = weight * dhr (one multiply; the shared expert's weight 1 needs none),
      // then the SwiGLU backward from the saved g, u.
      const Real dh = row_w != nullptr ? weight * dhr[e] : dhr[e];
      swiglu_backward(dh, g[e], u[e], dgu[r * 2 * I + i], dgu[r * 2 * I + I + i]);
      // Step 6: hs = bf16(weight * h), the W_down wgrad operand (bf16(1 * h) == h).
      hs[e] = row_w != nullptr ? act(weight * h) : h;
    }
    if (dtopk_w != nullptr) dtopk_w[r] = dw;
  }
}

template <class Real>
void mlp_backward(const MlpWeights<Real>& w, const Real* dy, const Real* row_w, const Real* g,
                  const Real* u, int64_t n, Real* dgu, Real* hs, Real* dx, Real* dtopk_w,
                  int threads) {
  const int64_t H = w.hidden, I = w.inter;
  if (n == 0) return;
  if constexpr (std::is_same_v<Real, float>) {
    if (w.fp8 != nullptr) return mlp_backward_fp8(w, dy, row_w, g, u, n, dgu, hs, dx, dtopk_w, threads);
  }
  // Step 2: dhr[i] = dot(W_down[:, i], dy), j ascending: rows of W_down^T [I, H]. dy is
  // unscaled, so dhr is the gradient of the expert output o before the router weight.
  const std::vector<Real> down_t = transpose(w.down, H, I, I);
  std::vector<Real> dhr(static_cast<size_t>(n * I));
  gemm_nt<Real>({dy, H, false}, down_t.data(), H, dhr.data(), I, n, I, H, threads);
  swiglu_backward_rows(dhr.data(), row_w, g, u, n, I, dgu, hs, dtopk_w);
  // Step 5: dx[j] = bf16(one sum over [dg | du] against [W_gate[:, j] ; W_up[:, j]]).
  std::vector<Real> gate_up_t(static_cast<size_t>(H * 2 * I));
  for (int64_t i = 0; i < I; ++i) {
    for (int64_t j = 0; j < H; ++j) {
      gate_up_t[j * 2 * I + i] = w.gate[i * H + j];
      gate_up_t[j * 2 * I + I + i] = w.up[i * H + j];
    }
  }
  gemm_nt<Real>({dgu, 2 * I, false}, gate_up_t.data(), 2 * I, dx, H, n, H, 2 * I, threads);
  for (int64_t e = 0; e < n * H; ++e) dx[e] = act(dx[e]);
}

template <class Real>
void mlp_wgrad(const MlpWeights<Real>& w, const Real* x, const Real* dy, const Real* dgu,
               const Real* hs, int64_t n, Real* dgate, Real* dup, Real* ddown, int threads) {
  const int64_t H = w.hidden, I = w.inter;
  if (n == 0) {  // an expert without rows has zero gradients
    std::fill(dgate, dgate + I * H, Real(0));
    std::fill(dup, dup + I * H, Real(0));
    std::fill(ddown, ddown + H * I, Real(0));
    return;
  }
  if constexpr (std::is_same_v<Real, float>) {
    if (w.fp8 != nullptr && w.fp8->fp8_wgrad) return mlp_wgrad_fp8(w, x, dy, dgu, hs, n, dgate, dup, ddown, threads);
  }
  // The reduction index is the row r, in the order the rows are given (canonical order).
  const std::vector<Real> x_t = transpose(x, n, H, H);     // [H, n]
  const std::vector<Real> hs_t = transpose(hs, n, I, I);   // [I, n]
  // dW_gate[i][c] = sum_r dg_r[i] * x_r[c]: A(i, r) = dgu[r*2I + i].
  gemm_nt<Real>({dgu, 2 * I, true}, x_t.data(), n, dgate, H, I, H, n, threads);
  gemm_nt<Real>({dgu + I, 2 * I, true}, x_t.data(), n, dup, H, I, H, n, threads);
  // dW_down[j][i] = sum_r dy_r[j] * hs_r[i]: A(j, r) = dy[r*H + j] (unscaled; w is in hs).
  gemm_nt<Real>({dy, H, true}, hs_t.data(), n, ddown, I, H, I, n, threads);
}

#define MOK_REF_INSTANTIATE(Real)                                                              \
  template void mlp_forward<Real>(const MlpWeights<Real>&, const Real*, int64_t, Real*, Real*,  \
                                  Real*, int);                                                 \
  template void mlp_backward<Real>(const MlpWeights<Real>&, const Real*, const Real*,          \
                                   const Real*, const Real*, int64_t, Real*, Real*, Real*,     \
                                   Real*, int);                                                \
  template void swiglu_backward_rows<Real>(const Real*, const Real*, const Real*, const Real*, int64_t, int64_t, \
                                           Real*, Real*, Real*);                                       \
  template void mlp_wgrad<Real>(const MlpWeights<Real>&, const Real*, const Real*, const Real*, \
                                const Real*, int64_t, Real*, Real*, Real*, int);
MOK_REF_INSTANTIATE(float)
MOK_REF_INSTANTIATE(double)
#undef MOK_REF_INSTANTIATE

}  // namespace mok::ref::detail
