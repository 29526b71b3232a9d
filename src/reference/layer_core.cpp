// The layer pass by pass, as docs/architecture.md describes it, over all simulated ranks:
//   forward:  dispatch -> routed MLP per local expert -> combine into the owners' slots
//             -> shared expert -> fixed-order y epilogue (fmaf, k = 0..K-1). The slots live
//             only for y: the context keeps g, u (and shared g, u) and the schedule.
//   backward: unscaled dy rows pulled like x -> dgrad (dhr), d topk_w from dhr and the
//             rebuilt h, SwiGLU backward of w * dhr -> dx rows and d topk_w pushed to slot
//             (t, k) -> wgrad per expert in canonical row order (dy against hs = bf16(w * h))
//             -> shared expert (weight 1) -> fixed-order dx epilogue.
// Ranks and experts run one after the other; the GEMMs inside split over threads.
#include <cmath>

#include "reference/dense.hpp"
#include "reference/layer_core.hpp"

namespace mok::ref::detail {
namespace {

inline float load_value(uint16_t bits) { return from_bf16(bits); }
inline double load_value(double v) { return v; }

// One expert's weights converted to Real (an owning copy; view() points into it).
template <class Real>
struct ExpertCopy {
  std::vector<Real> gate, up, down;
  int64_t inter = 0, hidden = 0;
  const Fp8Recipe* fp8 = nullptr;
  MlpWeights<Real> view() const { return {gate.data(), up.data(), down.data(), inter, hidden, fp8}; }
};

template <class Real, class Elem>
std::vector<Real> load_slice(const std::vector<Elem>& v, int64_t offset, int64_t n) {
  std::vector<Real> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = load_value(v[offset + i]);
  return out;
}

template <class Real>
ExpertCopy<Real> routed_expert(const LayerShape& shape, const CoreWeights<Real>& w, int64_t e) {
  const int64_t n = shape.intermediate * shape.hidden;
  return {load_slice<Real>(w.src->gate, e * n, n), load_slice<Real>(w.src->up, e * n, n),
          load_slice<Real>(w.src->down, e * n, n), shape.intermediate, shape.hidden, w.fp8};
}

template <class Real>
ExpertCopy<Real> shared_expert(const LayerShape& shape, const CoreWeights<Real>& w) {
  const int64_t n = shape.shared_intermediate * shape.hidden;
  return {load_slice<Real>(w.src->shared_gate, 0, n), load_slice<Real>(w.src->shared_up, 0, n),
          load_slice<Real>(w.src->shared_down, 0, n), shape.shared_intermediate, shape.hidden, w.fp8};
}

// fmaf in fp32 (one rounding), fma in the double variant.
template <class Real>
Real fused_multiply_add(Real a, Real b, Real c) {
  return std::fma(a, b, c);
}

}  // namespace

template <class Real>
BasicForwardResult<Real> forward_core(const LayerShape& shape, const CoreWeights<Real>& w,
                                      const CoreInputs<Real>& in, Schedule schedule, int threads) {
  const int ep = shape.ep;
  const int64_t T = shape.tokens, H = shape.hidden, I = shape.intermediate;
  const int64_t Ish = shape.shared_intermediate, e_local = shape.local_experts();
  const int K = shape.topk;

  BasicForwardResult<Real> result;
  auto& ctx = result.ctx;
  ctx.schedule = std::move(schedule);
  ctx.ranks.resize(ep);
  for (int r = 0; r < ep; ++r) {
    ctx.ranks[r].g.assign(ctx.schedule.ranks[r].padded_rows * I, Real(0));
    ctx.ranks[r].u.assign(ctx.schedule.ranks[r].padded_rows * I, Real(0));
  }
  // The combine slots of every source rank, o[(t*K + k)*H + j]: read by the y epilogue only.
  std::vector<std::vector<Real>> slots(ep, std::vector<Real>(T * K * H, Real(0)));

  // Routed experts, destination rank by destination rank.
  for (int d = 0; d < ep; ++d) {
    const RankSchedule& rs = ctx.schedule.ranks[d];
    const std::vector<Real> buf = dispatch(shape, rs, in.x);  // §2.2
    for (int64_t le = 0; le < e_local; ++le) {                // §2.4-2.5
      const int64_t off = rs.expert_offset[le], n = rs.expert_rows[le];
      std::vector<Real> o(static_cast<size_t>(n * H));
      if (n == 0) continue;  // empty segment: nothing to compute or push
      const ExpertCopy<Real> expert = routed_expert(shape, w, d * e_local + le);
      mlp_forward(expert.view(), buf.data() + off * H, n,
                  ctx.ranks[d].g.data() + off * I, ctx.ranks[d].u.data() + off * I, o.data(),
                  threads);
      for (int64_t r = 0; r < n; ++r) {  // §2.6 combine: push to the owner's slot (t, k)
        const RowRef& row = rs.rows[off + r];
        Real* slot = slots[row.src_rank].data() + (row.token * K + row.k) * H;
        std::copy(o.begin() + r * H, o.begin() + (r + 1) * H, slot);
      }
    }
  }

  // Shared expert and the y epilogue, per rank over its own tokens (§2.3, §2.7).
  result.y.resize(ep);
  for (int s = 0; s < ep; ++s) {
    std::vector<Real> sh;
    if (Ish > 0) {
      ctx.ranks[s].shared_g.assign(T * Ish, Real(0));
      ctx.ranks[s].shared_u.assign(T * Ish, Real(0));
      sh.assign(T * H, Real(0));
      const ExpertCopy<Real> sw = shared_expert(shape, w);
      mlp_forward(sw.view(), in.x[s].data(), T, ctx.ranks[s].shared_g.data(),
                  ctx.ranks[s].shared_u.data(), sh.data(), threads);
    }
    const std::vector<Real>& o = slots[s];
    const std::vector<Real>& tw = in.topk_w[s];
    std::vector<Real>& y = result.y[s];
    y.assign(T * H, Real(0));
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < H; ++j) {
        Real acc = Ish > 0 ? sh[t * H + j] : Real(0);
        for (int k = 0; k < K; ++k) {
          acc = fused_multiply_add(tw[t * K + k], o[(t * K + k) * H + j], acc);
        }
        y[t * H + j] = act(acc);
      }
    }
  }
  return result;
}

template <class Real>
BasicGradients<Real, Real> backward_core(const LayerShape& shape, const CoreWeights<Real>& w,
                                         const CoreInputs<Real>& in,
                                         const std::vector<std::vector<Real>>& dy,
                                         const BasicForwardContext<Real>& ctx, int threads) {
  const int ep = shape.ep;
  const int64_t T = shape.tokens, H = shape.hidden, I = shape.intermediate;
  const int64_t Ish = shape.shared_intermediate, e_local = shape.local_experts();
  const int K = shape.topk;

  BasicGradients<Real, Real> grads;
  grads.dgate.assign(shape.experts * I * H, Real(0));
  grads.dup.assign(shape.experts * I * H, Real(0));
  grads.ddown.assign(shape.experts * H * I, Real(0));
  // dx slots (t, k) of every source rank, filled by the rows' holders; d topk_w likewise.
  std::vector<std::vector<Real>> dx_slot(ep, std::vector<Real>(T * K * H, Real(0)));
  grads.dtopk_w.assign(ep, std::vector<Real>(T * K, Real(0)));

  for (int d = 0; d < ep; ++d) {
    const RankSchedule& rs = ctx.schedule.ranks[d];
    const std::vector<Real> buf = dispatch(shape, rs, in.x);  // x rows again, for wgrad
    // Step 1: the UNSCALED dy rows, pulled from the tokens' owners like x.
    const std::vector<Real> dy_buf = dispatch(shape, rs, dy);
    for (int64_t le = 0; le < e_local; ++le) {
      const int64_t e = d * e_local + le;
      const int64_t off = rs.expert_offset[le], n = rs.expert_rows[le];
      if (n == 0) continue;  // no rows: the expert's gradients stay zero
      std::vector<Real> row_w(static_cast<size_t>(n));
      for (int64_t r = 0; r < n; ++r) {
        const RowRef& row = rs.rows[off + r];
        row_w[r] = in.topk_w[row.src_rank][row.token * K + row.k];
      }
      // Steps 2-6, then push the dx rows and d topk_w to their slots (t, k).
      std::vector<Real> dgu(static_cast<size_t>(n * 2 * I)), hs(static_cast<size_t>(n * I));
      std::vector<Real> dx_rows(static_cast<size_t>(n * H)), dw(static_cast<size_t>(n));
      const ExpertCopy<Real> expert = routed_expert(shape, w, e);
      const MlpWeights<Real> mw = expert.view();
      const Real* dy_rows = dy_buf.data() + off * H;
      mlp_backward(mw, dy_rows, row_w.data(), ctx.ranks[d].g.data() + off * I,
                   ctx.ranks[d].u.data() + off * I, n, dgu.data(), hs.data(), dx_rows.data(),
                   dw.data(), threads);
      for (int64_t r = 0; r < n; ++r) {
        const RowRef& row = rs.rows[off + r];
        Real* slot = dx_slot[row.src_rank].data() + (row.token * K + row.k) * H;
        std::copy(dx_rows.begin() + r * H, dx_rows.begin() + (r + 1) * H, slot);
        grads.dtopk_w[row.src_rank][row.token * K + row.k] = dw[r];
      }
      // Weight gradients over the expert's rows in canonical (buffer) order.
      mlp_wgrad(mw, buf.data() + off * H, dy_rows, dgu.data(), hs.data(), n,
                grads.dgate.data() + e * I * H, grads.dup.data() + e * I * H,
                grads.ddown.data() + e * H * I, threads);
    }
  }

  grads.dx.resize(ep);
  if (Ish > 0) {
    grads.shared_dgate.resize(ep);
    grads.shared_dup.resize(ep);
    grads.shared_ddown.resize(ep);
  }
  for (int s = 0; s < ep; ++s) {
    // Shared expert: weight 1 (dh = dhr, hs = h), no d topk_w; its weight gradients are this
    // rank's partial sums.
    std::vector<Real> dx_sh;
    if (Ish > 0) {
      const ExpertCopy<Real> shared_copy = shared_expert(shape, w);
      const MlpWeights<Real> sw = shared_copy.view();
      std::vector<Real> dgu(static_cast<size_t>(T * 2 * Ish)), hs(static_cast<size_t>(T * Ish));
      dx_sh.assign(T * H, Real(0));
      mlp_backward(sw, dy[s].data(), static_cast<const Real*>(nullptr),
                   ctx.ranks[s].shared_g.data(), ctx.ranks[s].shared_u.data(), T, dgu.data(),
                   hs.data(), dx_sh.data(), static_cast<Real*>(nullptr), threads);
      grads.shared_dgate[s].assign(Ish * H, Real(0));
      grads.shared_dup[s].assign(Ish * H, Real(0));
      grads.shared_ddown[s].assign(H * Ish, Real(0));
      mlp_wgrad(sw, in.x[s].data(), dy[s].data(), dgu.data(), hs.data(), T,
                grads.shared_dgate[s].data(), grads.shared_dup[s].data(),
                grads.shared_ddown[s].data(), threads);
    }
    // dx epilogue: shared dx, then slots k = 0..K-1, one rounding.
    grads.dx[s].assign(T * H, Real(0));
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < H; ++j) {
        Real acc = Ish > 0 ? dx_sh[t * H + j] : Real(0);
        for (int k = 0; k < K; ++k) acc = acc + dx_slot[s][(t * K + k) * H + j];
        grads.dx[s][t * H + j] = act(acc);
      }
    }
  }
  return grads;
}

template BasicForwardResult<float> forward_core<float>(const LayerShape&,
                                                       const CoreWeights<float>&,
                                                       const CoreInputs<float>&, Schedule, int);
template BasicForwardResult<double> forward_core<double>(const LayerShape&,
                                                         const CoreWeights<double>&,
                                                         const CoreInputs<double>&, Schedule,
                                                         int);
template BasicGradients<float, float> backward_core<float>(
    const LayerShape&, const CoreWeights<float>&, const CoreInputs<float>&,
    const std::vector<std::vector<float>>&, const BasicForwardContext<float>&, int);
template BasicGradients<double, double> backward_core<double>(
    const LayerShape&, const CoreWeights<double>&, const CoreInputs<double>&,
    const std::vector<std::vector<double>>&, const BasicForwardContext<double>&, int);

}  // namespace mok::ref::detail
