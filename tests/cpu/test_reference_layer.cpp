// The reference layer against an independent, naive re-implementation of docs/numerics.md
// written here (token by token, no schedule, no blocking, no threads): y, dx, d topk_w and the
// routed weight gradients must match BITWISE. Also: bf16 conversion, top-k 1 and 8, one
// expert per rank, T not a multiple of 128, shared expert on/off, bf16 vs fp64 closeness, and
// the moderate-size runtime.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "reference/bf16.hpp"
#include "reference/layer.hpp"

namespace mok::ref {
namespace {

using Bits = std::vector<uint16_t>;

// ---- independent bf16 rounding: pick the nearer of the two neighbouring bf16 values ----
float naive_bf16(float f) {
  if (std::isnan(f)) return f;
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t lo_bits = bits & 0xFFFF0000u;
  const uint32_t hi_bits = lo_bits + 0x10000u;  // next bf16 away from zero
  float lo, hi;
  std::memcpy(&lo, &lo_bits, 4);
  std::memcpy(&hi, &hi_bits, 4);
  if (std::isinf(f)) return f;
  const double dlo = std::fabs(double(f) - double(lo));
  const double dhi = std::isinf(hi) ? std::fabs(double(f) - 0x1p128 * (f < 0 ? -1 : 1))
                                    : std::fabs(double(hi) - double(f));
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return ((lo_bits >> 16) & 1u) ? hi : lo;  // tie: even mantissa
}

float bf(uint16_t b) { return from_bf16(b); }

TEST(ReferenceBf16, MatchesNaiveRoundingAndSpecials) {
  std::mt19937 rng(1);
  for (int i = 0; i < 1000000; ++i) {
    uint32_t bits = rng();
    float f;
    std::memcpy(&f, &bits, 4);
    if (std::isnan(f)) continue;
    const float want = naive_bf16(f);
    ASSERT_EQ(from_bf16(to_bf16(f)), want) << "bits 0x" << std::hex << bits;
    ASSERT_EQ(std::signbit(from_bf16(to_bf16(f))), std::signbit(want));
  }
  EXPECT_EQ(to_bf16(1.0f + 0x1p-8f), 0x3F80);   // tie -> even (down)
  EXPECT_EQ(to_bf16(1.0f + 3 * 0x1p-8f), 0x3F82);  // tie -> even (up)
  EXPECT_EQ(to_bf16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(to_bf16(std::numeric_limits<float>::max()), 0x7F80);  // rounds to +inf
  EXPECT_TRUE(std::isnan(from_bf16(to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  const uint32_t snan_low = 0x7F800001u;  // NaN whose payload is only in the dropped bits
  float f;
  std::memcpy(&f, &snan_low, 4);
  EXPECT_TRUE(std::isnan(from_bf16(to_bf16(f))));
  EXPECT_EQ(to_bf16(-0.0f), 0x8000);
}

// ---- problem generation ----
struct Problem {
  LayerShape shape;
  LayerWeights w;
  LayerInputs in;
  std::vector<Bits> dy;
};

Bits random_bits(std::mt19937_64& rng, int64_t n, float scale) {
  std::uniform_real_distribution<float> u(-scale, scale);
  Bits out(n);
  for (auto& b : out) b = to_bf16(u(rng));
  return out;
}

Problem make_problem(const LayerShape& shape, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t E = shape.experts, H = shape.hidden, I = shape.intermediate;
  const int64_t Ish = shape.shared_intermediate, T = shape.tokens;
  Problem p;
  p.shape = shape;
  const float sh = 2.0f / std::sqrt(float(H));
  p.w.gate = random_bits(rng, E * I * H, sh);
  p.w.up = random_bits(rng, E * I * H, sh);
  p.w.down = random_bits(rng, E * H * I, 2.0f / std::sqrt(float(I)));
  if (Ish > 0) {
    p.w.shared_gate = random_bits(rng, Ish * H, sh);
    p.w.shared_up = random_bits(rng, Ish * H, sh);
    p.w.shared_down = random_bits(rng, H * Ish, 2.0f / std::sqrt(float(Ish)));
  }
  std::uniform_real_distribution<float> weight(0.05f, 1.0f);
  std::vector<int32_t> ids(E);
  for (int r = 0; r < shape.ep; ++r) {
    p.in.x.push_back(random_bits(rng, T * H, 1.0f));
    p.dy.push_back(random_bits(rng, T * H, 1.0f));
    std::vector<int32_t> idx;
    std::vector<float> w;
    for (int64_t t = 0; t < T; ++t) {
      std::iota(ids.begin(), ids.end(), 0);
      for (int k = 0; k < shape.topk; ++k) {
        std::uniform_int_distribution<int64_t> pick(k, E - 1);
        std::swap(ids[k], ids[pick(rng)]);
        idx.push_back(ids[k]);
        w.push_back(weight(rng));
      }
    }
    p.in.topk_idx.push_back(idx);
    p.in.topk_w.push_back(w);
  }
  return p;
}

Config roomy(const LayerShape& s) {
  Config c;
  c.capacity = s.ep;
  return c;
}

// ---- the naive layer: numerics.md read literally, one token at a time ----
struct NaiveExpert {
  const uint16_t *gate, *up, *down;
  int64_t I, H;
};

float sigm(float g) { return 1.0f / (1.0f + std::exp(-g)); }

struct NaiveRow {  // one token through one expert
  std::vector<float> g, u, h, o;
};

NaiveRow naive_forward(const NaiveExpert& e, const uint16_t* v) {
  NaiveRow r;
  for (int64_t i = 0; i < e.I; ++i) {
    float ag = 0.0f, au = 0.0f;
    for (int64_t c = 0; c < e.H; ++c) {
      ag += bf(e.gate[i * e.H + c]) * bf(v[c]);
      au += bf(e.up[i * e.H + c]) * bf(v[c]);
    }
    r.g.push_back(naive_bf16(ag));
    r.u.push_back(naive_bf16(au));
    const float g = r.g.back(), u = r.u.back();
    r.h.push_back(naive_bf16(g * sigm(g) * u));
  }
  for (int64_t j = 0; j < e.H; ++j) {
    float a = 0.0f;
    for (int64_t i = 0; i < e.I; ++i) a += bf(e.down[j * e.I + i]) * r.h[i];
    r.o.push_back(naive_bf16(a));
  }
  return r;
}

struct NaiveRowGrad {
  std::vector<float> dg, du, dx, hs;
  float dtopk_w = 0.0f;
};

// Backward steps 2-6 of one row from the UNSCALED dy and the row's router weight w (1 for
// the shared expert, where numerics.md multiplies by nothing: 1 * v == v, bf16(1 * h) == h).
NaiveRowGrad naive_backward(const NaiveExpert& e, const NaiveRow& f, const std::vector<float>& dy,
                            float w) {
  NaiveRowGrad r;
  for (int64_t i = 0; i < e.I; ++i) {
    float dhr = 0.0f;
    for (int64_t j = 0; j < e.H; ++j) dhr += bf(e.down[j * e.I + i]) * dy[j];
    r.dtopk_w = std::fma(dhr, f.h[i], r.dtopk_w);
    const float dh = w * dhr;
    const float g = f.g[i], u = f.u[i], s = sigm(g);
    r.dg.push_back(naive_bf16(dh * u * s * (1.0f + g * (1.0f - s))));
    r.du.push_back(naive_bf16(dh * g * s));
    r.hs.push_back(naive_bf16(w * f.h[i]));
  }
  for (int64_t j = 0; j < e.H; ++j) {
    float a = 0.0f;
    for (int64_t i = 0; i < e.I; ++i) a += r.dg[i] * bf(e.gate[i * e.H + j]);
    for (int64_t i = 0; i < e.I; ++i) a += r.du[i] * bf(e.up[i * e.H + j]);
    r.dx.push_back(naive_bf16(a));
  }
  return r;
}

NaiveExpert routed(const Problem& p, int64_t e) {
  const int64_t I = p.shape.intermediate, H = p.shape.hidden;
  return {p.w.gate.data() + e * I * H, p.w.up.data() + e * I * H, p.w.down.data() + e * H * I, I, H};
}
NaiveExpert shared(const Problem& p) {
  return {p.w.shared_gate.data(), p.w.shared_up.data(), p.w.shared_down.data(),
          p.shape.shared_intermediate, p.shape.hidden};
}

template <class T>
void expect_bits_equal(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      FAIL() << what << ": first mismatch at index " << i << ": got " << +got[i] << ", want " << +want[i];
    }
  }
}

// Checks forward and backward of the reference against the naive layer on the tokens listed
// (every token when `tokens` is empty) and the routed weight gradients of every expert.
void check_against_naive(const Problem& p, const std::vector<int64_t>& tokens, bool check_wgrad,
                         int threads = 0) {
  const LayerShape& s = p.shape;
  const int64_t T = s.tokens, H = s.hidden, I = s.intermediate;
  const int K = s.topk;
  const ForwardResult fwd = forward(s, roomy(s), p.w, p.in, threads);
  const Gradients grads = backward(s, roomy(s), p.w, p.in, p.dy, &fwd.ctx, threads);

  std::vector<int64_t> list = tokens;
  if (list.empty()) {
    list.resize(s.global_tokens());
    std::iota(list.begin(), list.end(), 0);
  }
  for (int64_t gt : list) {
    const int r = static_cast<int>(gt / T);
    const int64_t t = gt % T;
    const uint16_t* v = p.in.x[r].data() + t * H;
    std::vector<float> dyf(H);
    for (int64_t j = 0; j < H; ++j) dyf[j] = bf(p.dy[r][t * H + j]);
    std::vector<float> y(H, 0.0f), dx(H, 0.0f);
    if (s.has_shared()) {
      const NaiveRow sh = naive_forward(shared(p), v);
      y = sh.o;
      dx = naive_backward(shared(p), sh, dyf, 1.0f).dx;
    }
    for (int k = 0; k < K; ++k) {
      const int64_t e = p.in.topk_idx[r][t * K + k];
      const float w = p.in.topk_w[r][t * K + k];
      const NaiveRow row = naive_forward(routed(p, e), v);
      for (int64_t j = 0; j < H; ++j) y[j] = std::fma(w, row.o[j], y[j]);
      const NaiveRowGrad rg = naive_backward(routed(p, e), row, dyf, w);
      const float dw = rg.dtopk_w;
      for (int64_t j = 0; j < H; ++j) dx[j] = dx[j] + rg.dx[j];
      ASSERT_EQ(std::memcmp(&dw, &grads.dtopk_w[r][t * K + k], 4), 0)
          << "dtopk_w rank " << r << " token " << t << " k " << k << ": " << dw << " vs "
          << grads.dtopk_w[r][t * K + k];
    }
    for (int64_t j = 0; j < H; ++j) {
      ASSERT_EQ(to_bf16(naive_bf16(y[j])), fwd.y[r][t * H + j]) << "y rank " << r << " token " << t << " col " << j;
      ASSERT_EQ(to_bf16(naive_bf16(dx[j])), grads.dx[r][t * H + j]) << "dx rank " << r << " token " << t << " col " << j;
    }
  }
  if (!check_wgrad) return;
  // Routed weight gradients: per expert, rows in global token order.
  for (int64_t e = 0; e < s.experts; ++e) {
    std::vector<float> dgate(I * H, 0.0f), dup(I * H, 0.0f), ddown(H * I, 0.0f);
    for (int64_t gt = 0; gt < s.global_tokens(); ++gt) {
      const int r = static_cast<int>(gt / T);
      const int64_t t = gt % T;
      int k = 0;
      while (k < K && p.in.topk_idx[r][t * K + k] != e) ++k;
      if (k == K) continue;
      const uint16_t* v = p.in.x[r].data() + t * H;
      const float w = p.in.topk_w[r][t * K + k];
      const NaiveRow row = naive_forward(routed(p, e), v);
      std::vector<float> dyf(H);
      for (int64_t j = 0; j < H; ++j) dyf[j] = bf(p.dy[r][t * H + j]);
      const NaiveRowGrad rg = naive_backward(routed(p, e), row, dyf, w);
      for (int64_t i = 0; i < I; ++i) {
        for (int64_t c = 0; c < H; ++c) {
          dgate[i * H + c] += rg.dg[i] * bf(v[c]);
          dup[i * H + c] += rg.du[i] * bf(v[c]);
          ddown[c * I + i] += dyf[c] * rg.hs[i];
        }
      }
    }
    auto slice = [&](const std::vector<float>& v, int64_t n) {
      return std::vector<float>(v.begin() + e * n, v.begin() + (e + 1) * n);
    };
    expect_bits_equal(slice(grads.dgate, I * H), dgate, "dgate expert " + std::to_string(e));
    expect_bits_equal(slice(grads.dup, I * H), dup, "dup expert " + std::to_string(e));
    expect_bits_equal(slice(grads.ddown, H * I), ddown, "ddown expert " + std::to_string(e));
  }
}

LayerShape make_shape(int64_t T, int64_t H, int64_t I, int64_t Ish, int64_t E, int K, int ep) {
  LayerShape s;
  s.tokens = T;
  s.hidden = H;
  s.intermediate = I;
  s.shared_intermediate = Ish;
  s.experts = E;
  s.topk = K;
  s.ep = ep;
  return s;
}

TEST(ReferenceLayer, MatchesNaiveWithShared) {
  check_against_naive(make_problem(make_shape(100, 128, 64, 128, 8, 2, 2), 11), {}, true);
}

TEST(ReferenceLayer, MatchesNaiveWithoutShared) {
  check_against_naive(make_problem(make_shape(100, 128, 64, 0, 8, 2, 2), 12), {}, true);
}

TEST(ReferenceLayer, MatchesNaiveTopK1) {
  check_against_naive(make_problem(make_shape(70, 64, 128, 64, 4, 1, 2), 13), {}, true);
}

TEST(ReferenceLayer, MatchesNaiveTopK8) {
  check_against_naive(make_problem(make_shape(40, 64, 64, 64, 16, 8, 2), 14), {}, true);
}

TEST(ReferenceLayer, MatchesNaiveOneExpertPerRank) {
  check_against_naive(make_problem(make_shape(50, 128, 64, 0, 4, 2, 4), 15), {}, true);
}

TEST(ReferenceLayer, MatchesNaiveTokenCountAboveRowTile) {  // 3 rows tiles, last one partial
  check_against_naive(make_problem(make_shape(300, 64, 64, 64, 2, 1, 1), 16), {0, 127, 128, 299}, true, 3);
}

// The dispatch alone (docs/comm.md): each buffer row is its owner's x row, padding rows are zero.
TEST(ReferenceLayer, DispatchCopiesOwnersRows) {
  const Problem p = make_problem(make_shape(60, 64, 64, 0, 4, 2, 2), 19);
  const Schedule sched = make_schedule(p.shape, roomy(p.shape), p.in.topk_idx);
  for (int d = 0; d < 2; ++d) {
    const Bits buf = dispatch_rows(p.shape, sched, d, p.in.x);
    ASSERT_EQ(buf.size(), static_cast<size_t>(sched.ranks[d].padded_rows * 64));
    for (int64_t row = 0; row < sched.ranks[d].padded_rows; ++row) {
      const RowRef& ref = sched.ranks[d].rows[row];
      const Bits got(buf.begin() + row * 64, buf.begin() + (row + 1) * 64);
      const Bits want = ref.is_padding()
                            ? Bits(64, 0)
                            : Bits(p.in.x[ref.src_rank].begin() + ref.token * 64,
                                   p.in.x[ref.src_rank].begin() + (ref.token + 1) * 64);
      ASSERT_EQ(got, want) << "rank " << d << " row " << row;
    }
  }
}

double rel_norm(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

template <class V>
std::vector<double> flat(const std::vector<V>& per_rank) {
  std::vector<double> out;
  for (const auto& r : per_rank) {
    for (auto v : r) {
      if constexpr (std::is_same_v<decltype(v), uint16_t>) out.push_back(bf(v));
      else out.push_back(double(v));
    }
  }
  return out;
}

std::vector<double> to_f64(const Bits& b) {
  std::vector<double> out(b.size());
  for (size_t i = 0; i < b.size(); ++i) out[i] = bf(b[i]);
  return out;
}

// The bf16 layer is a rounded version of the exact (fp64) one: relative norm of the difference
// well under the GPU tolerance.
TEST(ReferenceLayer, Bf16CloseToFp64) {
  const Problem p = make_problem(make_shape(100, 128, 64, 64, 8, 2, 2), 17);
  LayerWeightsF64 w{to_f64(p.w.gate), to_f64(p.w.up), to_f64(p.w.down),
                    to_f64(p.w.shared_gate), to_f64(p.w.shared_up), to_f64(p.w.shared_down)};
  LayerInputsF64 in;
  std::vector<std::vector<double>> dy;
  for (int r = 0; r < p.shape.ep; ++r) {
    in.x.push_back(to_f64(p.in.x[r]));
    in.topk_w.emplace_back(p.in.topk_w[r].begin(), p.in.topk_w[r].end());
    dy.push_back(to_f64(p.dy[r]));
  }
  in.topk_idx = p.in.topk_idx;
  const Config c = roomy(p.shape);
  const ForwardResult f32 = forward(p.shape, c, p.w, p.in);
  const ForwardResultF64 f64 = forward_f64(p.shape, c, w, in);
  const double ry = rel_norm(flat(f32.y), flat(f64.y));
  EXPECT_LT(ry, 1e-2);
  EXPECT_GT(ry, 0.0);  // the bf16 variant really rounds
  const Gradients g32 = backward(p.shape, c, p.w, p.in, p.dy, &f32.ctx);
  const GradientsF64 g64 = backward_f64(p.shape, c, w, in, dy, &f64.ctx);
  EXPECT_LT(rel_norm(flat(g32.dx), flat(g64.dx)), 1e-2);
  EXPECT_LT(rel_norm(flat(g32.dtopk_w), flat(g64.dtopk_w)), 1e-2);
  EXPECT_LT(rel_norm(flat(std::vector<std::vector<float>>{g32.dgate}), flat(std::vector<std::vector<double>>{g64.dgate})), 1e-2);
  EXPECT_LT(rel_norm(flat(std::vector<std::vector<float>>{g32.ddown}), flat(std::vector<std::vector<double>>{g64.ddown})), 1e-2);
  EXPECT_LT(rel_norm(flat(g32.shared_dup), flat(g64.shared_dup)), 1e-2);
  std::printf("bf16 vs fp64 relative norm: y %.2e dx %.2e dtopk_w %.2e\n", ry,
              rel_norm(flat(g32.dx), flat(g64.dx)), rel_norm(flat(g32.dtopk_w), flat(g64.dtopk_w)));
}

// The moderate size of the brief (T=512 per rank, H=1024, I=512, E=8, K=2, ep=2): forward +
// backward with every hardware thread, spot-checked against the naive layer on a few tokens.
TEST(ReferenceLayer, ModerateSizeRuntime) {
  const Problem p = make_problem(make_shape(512, 1024, 512, 0, 8, 2, 2), 18);
  const Config c = roomy(p.shape);
  const auto t0 = std::chrono::steady_clock::now();
  const ForwardResult fwd = forward(p.shape, c, p.w, p.in);
  const auto t1 = std::chrono::steady_clock::now();
  const Gradients g = backward(p.shape, c, p.w, p.in, p.dy, &fwd.ctx);
  const auto t2 = std::chrono::steady_clock::now();
  const double sf = std::chrono::duration<double>(t1 - t0).count();
  const double sb = std::chrono::duration<double>(t2 - t1).count();
  std::printf("moderate size (%s): forward %.2f s, backward %.2f s\n", p.shape.to_string().c_str(), sf, sb);
  EXPECT_LT(sf + sb, 30.0);
  check_against_naive(p, {0, 511, 700, 1023}, false);
}

}  // namespace
}  // namespace mok::ref
