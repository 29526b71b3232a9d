// The FP8 recipe on the whole reference layer (ref::forward_fp8 / backward_fp8, docs/fp8.md):
//   - against the bf16 layer on the same inputs: every output and gradient close (e4m3's few
//     percent) but not equal (the FP8 path really runs), with the figures printed;
//   - D3 in FP8: the same global batch over ep = 1, 2, 4 gives identical y, dx, d topk_w and
//     routed weight gradients, bit for bit (the quantization blocks are per token row, and
//     along the tokens from each expert's first row in canonical order);
//   - D1: run to run, threads, backward from the saved context vs recomputed;
//   - fp8_wgrad = false keeps the weight gradients as the bf16 layer's sums over the same
//     FP8-path dg, du, hs: the same dx as with FP8 weight gradients;
//   - a non-finite activation is an error naming the tensor.
// Shapes with H and I not multiples of 128 (partial blocks) and experts without tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "mok/error.hpp"
#include "reference/bf16.hpp"
#include "reference/layer.hpp"
#include "reference_batch.hpp"

namespace mok::ref {
namespace {

using namespace layer_test;

// T 128, H 320, I 192 (partial 128-blocks), I_shared 64, E 8 of which 6 get tokens.
GlobalBatch make_fp8_batch(uint64_t seed) {
  GlobalBatch dims;
  dims.tokens = 128;
  dims.hidden = 320;
  dims.inter = 192;
  dims.shared_inter = 64;
  dims.experts = 8;
  dims.routed_experts = 6;
  return make_batch(seed, dims);
}

// precision: 0 bf16, 1 fp8 with FP8 weight gradients, 2 fp8 with bf16 weight gradients.
LayerRun run_layer(const GlobalBatch& b, int ep, int precision, int threads = 0, bool recompute = false) {
  const LayerShape s = shape_for(b, ep);
  Config c;
  c.capacity = ep;
  LayerInputs in{split(b.x, ep), split(b.topk_idx, ep), split(b.topk_w, ep)};
  LayerRun r;
  if (precision == 0) {
    r.fwd = forward(s, c, b.w, in, threads);
    r.grads = backward(s, c, b.w, in, split(b.dy, ep), &r.fwd.ctx, threads);
  } else {
    Fp8Recipe recipe;
    recipe.fp8_wgrad = precision == 1;
    r.fwd = forward_fp8(s, c, b.w, in, recipe, threads);
    r.grads = backward_fp8(s, c, b.w, in, split(b.dy, ep), recompute ? nullptr : &r.fwd.ctx, recipe, threads);
  }
  return r;
}

std::vector<float> floats(const Bits& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = from_bf16(v[i]);
  return f;
}

double rel(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

TEST(ReferenceFp8Layer, CloseToBf16ButNotEqual) {
  const GlobalBatch b = make_fp8_batch(1);
  const LayerRun bf = run_layer(b, 1, 0), f8 = run_layer(b, 1, 1);
  struct Item {
    const char* name;
    double err;
  };
  const Item items[] = {
      {"y", rel(floats(concat(f8.fwd.y)), floats(concat(bf.fwd.y)))},
      {"dx", rel(floats(concat(f8.grads.dx)), floats(concat(bf.grads.dx)))},
      {"dtopk_w", rel(concat(f8.grads.dtopk_w), concat(bf.grads.dtopk_w))},
      {"dgate", rel(f8.grads.dgate, bf.grads.dgate)},
      {"dup", rel(f8.grads.dup, bf.grads.dup)},
      {"ddown", rel(f8.grads.ddown, bf.grads.ddown)},
      {"shared_dgate", rel(f8.grads.shared_dgate[0], bf.grads.shared_dgate[0])},
      {"shared_ddown", rel(f8.grads.shared_ddown[0], bf.grads.shared_ddown[0])},
  };
  for (const Item& it : items) {
    std::printf("fp8 vs bf16 reference layer: %-13s rel err %.4f\n", it.name, it.err);
    EXPECT_GT(it.err, 1e-4) << it.name << ": the FP8 path changed nothing";
    EXPECT_LT(it.err, 0.15) << it.name;
  }
}

TEST(ReferenceFp8Layer, EpInvariantBitwise) {
  const GlobalBatch b = make_fp8_batch(2);
  const LayerRun r1 = run_layer(b, 1, 1);
  for (int ep : {2, 4}) expect_same_ep_invariant(r1, run_layer(b, ep, 1), "ep " + std::to_string(ep));
}

TEST(ReferenceFp8Layer, RunToRunThreadsAndRecomputeBitwise) {
  const GlobalBatch b = make_fp8_batch(3);
  const LayerRun a = run_layer(b, 2, 1, 1);
  expect_same_ep_invariant(a, run_layer(b, 2, 1, 3), "threads 3");
  expect_same_ep_invariant(a, run_layer(b, 2, 1, 1, true), "recomputed context");
  const LayerRun c = run_layer(b, 2, 1, 1);
  for (size_t r = 0; r < a.grads.shared_dgate.size(); ++r) {
    expect_same_bits(a.grads.shared_dgate[r], c.grads.shared_dgate[r], "shared_dgate run to run");
  }
}

TEST(ReferenceFp8Layer, Bf16WeightGradientsOption) {
  const GlobalBatch b = make_fp8_batch(4);
  const LayerRun f8 = run_layer(b, 1, 1), mixed = run_layer(b, 1, 2), bf = run_layer(b, 1, 0);
  // Same forward and dgrad chain, different weight-gradient GEMMs.
  expect_same_bits(concat(mixed.fwd.y), concat(f8.fwd.y), "y");
  expect_same_bits(concat(mixed.grads.dx), concat(f8.grads.dx), "dx");
  const double e_fp8 = rel(f8.grads.dgate, bf.grads.dgate), e_mixed = rel(mixed.grads.dgate, bf.grads.dgate);
  std::printf("dgate vs the bf16 layer: fp8 weight gradients %.4f, bf16 weight gradients %.4f\n", e_fp8, e_mixed);
  EXPECT_GT(e_mixed, 0.0);
  EXPECT_LT(e_mixed, e_fp8) << "bf16 weight-gradient GEMMs should be closer to the bf16 layer";
}

TEST(ReferenceFp8Layer, NonFiniteActivationIsAnErrorNamingIt) {
  GlobalBatch b = make_fp8_batch(5);
  b.x[7 * b.hidden + 33] = 0x7FC0;  // NaN
  try {
    run_layer(b, 1, 1);
    ADD_FAILURE() << "no error for a NaN in x";
  } catch (const mok::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("x[row"), std::string::npos) << m;
    EXPECT_NE(m.find("finite"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace mok::ref
