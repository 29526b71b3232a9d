// Finite-difference checks of EVERY gradient of the fp64 reference (no rounding anywhere, so
// the layer is smooth and backward must be its exact gradient): dx, d topk_w, routed
// d gate/up/down and shared d gate/up/down (summed over ranks: the shared weights are one
// parameter used by every rank). Loss L = sum over ranks of sum(y * R) with random R, so
// dy = R. Central differences on a random sample of coordinates per tensor. Also: d topk_w
// (computed from the dgrad and the rebuilt h) equals dot(dy, o) of the forward's expert outputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "reference/layer.hpp"

namespace mok::ref {
namespace {

using Vec = std::vector<double>;

struct Problem {
  LayerShape shape;
  Config config;
  LayerWeightsF64 w;
  LayerInputsF64 in;
  std::vector<Vec> r;  // loss weights R = dy
};

Vec random_vec(std::mt19937_64& rng, int64_t n, double lo, double hi) {
  std::uniform_real_distribution<double> u(lo, hi);
  Vec v(n);
  for (auto& e : v) e = u(rng);
  return v;
}

Problem make_problem(int64_t shared_inter, uint64_t seed, int64_t tokens = 3, int64_t inter = 64) {
  Problem p;
  p.shape.tokens = tokens;
  p.shape.hidden = 64;
  p.shape.intermediate = inter;
  p.shape.shared_intermediate = shared_inter;
  p.shape.experts = 4;
  p.shape.topk = 2;
  p.shape.ep = 2;
  p.config.capacity = 2.0;
  std::mt19937_64 rng(seed);
  const int64_t T = tokens, H = 64, I = inter, E = 4, K = 2;
  // Scales keep the pre-activations O(1), where silu is far from linear.
  const double s = 2.0 / std::sqrt(double(H));
  p.w.gate = random_vec(rng, E * I * H, -s, s);
  p.w.up = random_vec(rng, E * I * H, -s, s);
  p.w.down = random_vec(rng, E * H * I, -s, s);
  if (shared_inter > 0) {
    p.w.shared_gate = random_vec(rng, shared_inter * H, -s, s);
    p.w.shared_up = random_vec(rng, shared_inter * H, -s, s);
    p.w.shared_down = random_vec(rng, H * shared_inter, -s, s);
  }
  for (int r = 0; r < 2; ++r) {
    p.in.x.push_back(random_vec(rng, T * H, -1.5, 1.5));
    p.in.topk_w.push_back(random_vec(rng, T * K, 0.1, 1.0));
    p.r.push_back(random_vec(rng, T * H, -1.0, 1.0));
    std::vector<int32_t> idx;
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> ids(E);
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      idx.insert(idx.end(), ids.begin(), ids.begin() + K);
    }
    p.in.topk_idx.push_back(idx);
  }
  return p;
}

double loss(const Problem& p) {
  const ForwardResultF64 f = forward_f64(p.shape, p.config, p.w, p.in, 1);
  double l = 0.0;
  for (int r = 0; r < p.shape.ep; ++r) {
    for (size_t i = 0; i < f.y[r].size(); ++i) l += f.y[r][i] * p.r[r][i];
  }
  return l;
}

// Checks `analytic` (the gradient of the loss w.r.t. the tensor reached by `param`) at
// `samples` random coordinates. The error is relative to |analytic|, floored at 1% of the
// tensor's largest gradient so that near-zero entries do not demand impossible precision.
void check_tensor(Problem p, const std::string& name, const std::function<Vec&(Problem&)>& param,
                  const Vec& analytic, uint64_t seed, int samples = 20) {
  const Vec& base = param(p);
  ASSERT_EQ(base.size(), analytic.size()) << name;
  double max_abs = 0.0;
  for (double g : analytic) max_abs = std::max(max_abs, std::fabs(g));
  ASSERT_GT(max_abs, 0.0) << name << ": gradient is identically zero";
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<size_t> pick(0, base.size() - 1);
  double worst = 0.0;
  for (int s = 0; s < samples; ++s) {
    const size_t i = pick(rng);
    const double v = param(p)[i];
    const double h = 1e-5 * std::max(1.0, std::fabs(v));
    param(p)[i] = v + h;
    const double lp = loss(p);
    param(p)[i] = v - h;
    const double lm = loss(p);
    param(p)[i] = v;
    const double fd = (lp - lm) / (2 * h);
    const double err = std::fabs(fd - analytic[i]) / std::max(std::fabs(analytic[i]), 1e-2 * max_abs);
    worst = std::max(worst, err);
    EXPECT_LT(err, 1e-6) << name << "[" << i << "]: finite difference " << fd << ", backward "
                         << analytic[i];
  }
  std::printf("%-14s worst relative error %.2e over %d samples\n", name.c_str(), worst, samples);
}

Vec concat(const std::vector<Vec>& per_rank) {
  Vec out;
  for (const auto& v : per_rank) out.insert(out.end(), v.begin(), v.end());
  return out;
}

Vec sum_ranks(const std::vector<Vec>& per_rank) {
  Vec out(per_rank.at(0).size(), 0.0);
  for (const auto& v : per_rank) {
    for (size_t i = 0; i < v.size(); ++i) out[i] += v[i];
  }
  return out;
}

// x and topk_w live per rank: check each rank's tensor separately.
void check_per_rank(const Problem& p, const std::string& name,
                    std::vector<Vec> LayerInputsF64::*member, const Vec& analytic, uint64_t seed) {
  const int64_t per = static_cast<int64_t>((p.in.*member)[0].size());
  for (int r = 0; r < p.shape.ep; ++r) {
    const Vec slice(analytic.begin() + r * per, analytic.begin() + (r + 1) * per);
    check_tensor(p, name + "[rank " + std::to_string(r) + "]",
                 [member, r](Problem& q) -> Vec& { return (q.in.*member)[r]; }, slice, seed + r);
  }
}

void check_all_gradients(int64_t shared_inter) {
  const Problem p = make_problem(shared_inter, 100 + shared_inter);
  const GradientsF64 g = backward_f64(p.shape, p.config, p.w, p.in, p.r, nullptr, 1);
  check_per_rank(p, "dx", &LayerInputsF64::x, concat(g.dx), 1);
  check_per_rank(p, "dtopk_w", &LayerInputsF64::topk_w, concat(g.dtopk_w), 2);
  check_tensor(p, "dgate", [](Problem& q) -> Vec& { return q.w.gate; }, g.dgate, 3);
  check_tensor(p, "dup", [](Problem& q) -> Vec& { return q.w.up; }, g.dup, 4);
  check_tensor(p, "ddown", [](Problem& q) -> Vec& { return q.w.down; }, g.ddown, 5);
  if (shared_inter > 0) {
    check_tensor(p, "shared_dgate", [](Problem& q) -> Vec& { return q.w.shared_gate; },
                 sum_ranks(g.shared_dgate), 6);
    check_tensor(p, "shared_dup", [](Problem& q) -> Vec& { return q.w.shared_up; },
                 sum_ranks(g.shared_dup), 7);
    check_tensor(p, "shared_ddown", [](Problem& q) -> Vec& { return q.w.shared_down; },
                 sum_ranks(g.shared_ddown), 8);
  } else {
    EXPECT_TRUE(g.shared_dgate.empty() && g.shared_dup.empty() && g.shared_ddown.empty());
  }
  // The saved-context path gives the same gradients as the recompute path.
  const ForwardResultF64 f = forward_f64(p.shape, p.config, p.w, p.in, 1);
  const GradientsF64 g2 = backward_f64(p.shape, p.config, p.w, p.in, p.r, &f.ctx, 1);
  EXPECT_EQ(g2.dx, g.dx);
  EXPECT_EQ(g2.dgate, g.dgate);
}

TEST(ReferenceGradients, FiniteDifferencesWithSharedExpert) { check_all_gradients(64); }

TEST(ReferenceGradients, FiniteDifferencesWithoutSharedExpert) { check_all_gradients(0); }

// d topk_w is computed without the expert outputs, as sum_i dhr[i] * h[i] with dhr = dy . W_down
// (docs/numerics.md "Backward", step 3). In fp64 it must equal dot(dy[t], o_(t,k)) with o_(t,k)
// the expert output of a forward. Without a shared expert and with router weights one-hot on
// slot k, a forward's y is exactly o_(t,k) (fma(1, o, 0) = o, fma(0, o', acc) = acc).
TEST(ReferenceGradients, DtopkWEqualsDotOfDyWithExpertOutput) {
  const Problem p = make_problem(0, 21, /*tokens=*/16, /*inter=*/128);
  const int64_t T = p.shape.tokens, H = p.shape.hidden;
  const int K = p.shape.topk;
  const GradientsF64 g = backward_f64(p.shape, p.config, p.w, p.in, p.r, nullptr, 1);
  double worst = 0.0;
  for (int k = 0; k < K; ++k) {
    LayerInputsF64 one_hot = p.in;
    for (Vec& w : one_hot.topk_w) {
      for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<int>(i % K) == k ? 1.0 : 0.0;
    }
    const ForwardResultF64 f = forward_f64(p.shape, p.config, p.w, one_hot, 1);  // y = o_(t,k)
    for (int r = 0; r < p.shape.ep; ++r) {
      for (int64_t t = 0; t < T; ++t) {
        double want = 0.0;
        for (int64_t j = 0; j < H; ++j) want += p.r[r][t * H + j] * f.y[r][t * H + j];
        const double got = g.dtopk_w[r][t * K + k];
        ASSERT_NE(want, 0.0);
        const double rel = std::fabs(got - want) / std::fabs(want);
        worst = std::max(worst, rel);
        EXPECT_LT(rel, 1e-12) << "rank " << r << " token " << t << " k " << k << ": backward "
                              << got << ", dot(dy, o) " << want;
      }
    }
  }
  std::printf("d topk_w vs dot(dy, o): worst relative difference %.2e\n", worst);
}

// Routed weights of experts that receive no token have exactly zero gradient.
TEST(ReferenceGradients, UnusedExpertHasZeroGradient) {
  Problem p = make_problem(0, 7);
  for (auto& idx : p.in.topk_idx) {
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int32_t>(i % 2);  // experts 0, 1 only
  }
  const GradientsF64 g = backward_f64(p.shape, p.config, p.w, p.in, p.r, nullptr, 1);
  const int64_t n = 64 * 64;
  for (int64_t e = 2; e < 4; ++e) {
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(g.dgate[e * n + i], 0.0);
      ASSERT_EQ(g.ddown[e * n + i], 0.0);
    }
  }
  EXPECT_NE(g.dgate[0], 0.0);
}

}  // namespace
}  // namespace mok::ref
