// Bad routing inputs and argument sizes reach the reference layer's forward/backward (and the
// schedule) as mok::Error with the right Status and a message naming the argument: expert id
// out of range (negative, >= E), an expert twice in one token's top-k, non-finite router
// weights (NaN, +inf), different T across ranks, wrong vector sizes, capacity overflow.
#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "mok/error.hpp"
#include "reference/bf16.hpp"
#include "reference/layer.hpp"

namespace mok::ref {
namespace {

constexpr int64_t kT = 8, kH = 64, kI = 64, kE = 4;
constexpr int kK = 2, kEp = 2;

LayerShape test_shape() {
  LayerShape s;
  s.tokens = kT;
  s.hidden = kH;
  s.intermediate = kI;
  s.shared_intermediate = 64;
  s.experts = kE;
  s.topk = kK;
  s.ep = kEp;
  return s;
}

struct Case {
  LayerShape shape = test_shape();
  Config config;
  LayerWeights w;
  LayerInputs in;
  std::vector<std::vector<uint16_t>> dy;
};

// A valid problem; each test breaks one thing. Values are arbitrary non-zero bf16.
Case valid_case() {
  Case c;
  c.w.gate.assign(kE * kI * kH, to_bf16(0.01f));
  c.w.up.assign(kE * kI * kH, to_bf16(0.02f));
  c.w.down.assign(kE * kH * kI, to_bf16(-0.01f));
  c.w.shared_gate.assign(64 * kH, to_bf16(0.01f));
  c.w.shared_up.assign(64 * kH, to_bf16(0.03f));
  c.w.shared_down.assign(kH * 64, to_bf16(0.02f));
  for (int r = 0; r < kEp; ++r) {
    c.in.x.emplace_back(kT * kH, to_bf16(0.5f));
    c.dy.emplace_back(kT * kH, to_bf16(-0.25f));
    std::vector<int32_t> idx;
    for (int64_t t = 0; t < kT; ++t) {
      idx.push_back(static_cast<int32_t>(t % kE));
      idx.push_back(static_cast<int32_t>((t + 1) % kE));
    }
    c.in.topk_idx.push_back(idx);
    c.in.topk_w.emplace_back(kT * kK, 0.5f);
  }
  return c;
}

void run_forward(const Case& c) { forward(c.shape, c.config, c.w, c.in, 1); }
void run_backward(const Case& c) { backward(c.shape, c.config, c.w, c.in, c.dy, nullptr, 1); }

// Expects `fn` to throw mok::Error with `status` and every string of `needles` in its message.
void expect_error(const std::function<void()>& fn, Status status,
                  const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "expected mok::Error(" << status_name(status) << ")";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), status) << e.what();
    for (const auto& n : needles) {
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "message \"" << e.what() << "\" lacks \"" << n << "\"";
    }
  }
}

void expect_both_passes(const Case& c, Status status, const std::vector<std::string>& needles) {
  expect_error([&] { run_forward(c); }, status, needles);
  expect_error([&] { run_backward(c); }, status, needles);
}

TEST(RoutingValidation, ValidCasePasses) {
  const Case c = valid_case();
  EXPECT_NO_THROW(run_forward(c));
  EXPECT_NO_THROW(run_backward(c));
}

TEST(RoutingValidation, NegativeExpertId) {
  Case c = valid_case();
  c.in.topk_idx[1][2 * 3 + 1] = -1;  // rank 1, token 3, k 1
  expect_both_passes(c, Status::kInvalidArgument, {"topk_idx", "rank 1", "token 3", "k 1", "-1"});
  expect_error([&] { make_schedule(c.shape, c.config, c.in.topk_idx); }, Status::kInvalidArgument,
               {"topk_idx", "rank 1"});
}

TEST(RoutingValidation, ExpertIdTooLarge) {
  Case c = valid_case();
  c.in.topk_idx[0][0] = kE;
  expect_both_passes(c, Status::kInvalidArgument, {"topk_idx", "rank 0", "token 0", "4"});
}

TEST(RoutingValidation, DuplicateExpertInOneToken) {
  Case c = valid_case();
  c.in.topk_idx[1][2 * 5 + 1] = c.in.topk_idx[1][2 * 5];  // rank 1, token 5: the same expert twice
  expect_both_passes(c, Status::kInvalidArgument, {"topk_idx", "rank 1", "token 5"});
}

TEST(RoutingValidation, NanRouterWeight) {
  Case c = valid_case();
  c.in.topk_w[0][3] = std::numeric_limits<float>::quiet_NaN();
  expect_both_passes(c, Status::kInvalidArgument, {"topk_w", "rank 0", "finite"});
}

TEST(RoutingValidation, InfiniteRouterWeight) {
  Case c = valid_case();
  c.in.topk_w[1][0] = std::numeric_limits<float>::infinity();
  expect_both_passes(c, Status::kInvalidArgument, {"topk_w", "rank 1", "finite"});
}

TEST(RoutingValidation, DifferentTokenCountsAcrossRanks) {
  Case c = valid_case();
  // Rank 1 brings one token more than rank 0 (and than LayerShape.tokens).
  c.in.x[1].resize((kT + 1) * kH, to_bf16(0.5f));
  c.in.topk_idx[1].insert(c.in.topk_idx[1].end(), {0, 1});
  c.in.topk_w[1].insert(c.in.topk_w[1].end(), {0.5f, 0.5f});
  expect_both_passes(c, Status::kInvalidArgument, {"rank 1", "same T"});
}

TEST(RoutingValidation, WrongVectorSizesNameTheArgument) {
  {
    Case c = valid_case();
    c.in.x[1].resize(kT * kH - kH / 2);  // not even whole rows
    expect_both_passes(c, Status::kInvalidArgument, {"inputs.x[rank 1]"});
  }
  {
    Case c = valid_case();
    c.in.topk_idx[1].pop_back();
    expect_both_passes(c, Status::kInvalidArgument, {"inputs.topk_idx[rank 1]", "16"});
  }
  {
    Case c = valid_case();
    c.in.topk_w[0].push_back(0.5f);
    expect_both_passes(c, Status::kInvalidArgument, {"inputs.topk_w[rank 0]"});
  }
  {
    Case c = valid_case();
    c.in.x.pop_back();  // one rank's x for ep = 2
    expect_both_passes(c, Status::kInvalidArgument, {"inputs.x", "ep = 2"});
  }
  {
    Case c = valid_case();
    c.w.down.pop_back();
    expect_both_passes(c, Status::kInvalidArgument, {"weights.down", std::to_string(kE * kH * kI)});
  }
  {
    Case c = valid_case();
    c.w.shared_gate.clear();  // the shape has a shared expert
    expect_both_passes(c, Status::kInvalidArgument, {"weights.shared_gate"});
  }
  {
    Case c = valid_case();
    c.dy[1].resize(kT * kH - 1);
    expect_error([&] { run_backward(c); }, Status::kInvalidArgument, {"dy[rank 1]", std::to_string(kT * kH)});
  }
}

TEST(RoutingValidation, CapacityOverflow) {
  Case c = valid_case();
  c.config.capacity = 1.0;  // at most T*K = 16 routed rows per rank
  for (auto& idx : c.in.topk_idx) {
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int32_t>(i % 2);  // all on rank 0
  }
  expect_both_passes(c, Status::kCapacityOverflow, {"rank 0", "32", "16", "capacity"});
  c.config.capacity = 2.0;
  EXPECT_NO_THROW(run_forward(c));
}

TEST(RoutingValidation, SavedContextOfOtherRoutingIsRejected) {
  Case c = valid_case();
  const ForwardResult fwd = forward(c.shape, c.config, c.w, c.in, 1);
  std::swap(c.in.topk_idx[0][0], c.in.topk_idx[0][1]);  // same experts, other k order
  expect_error([&] { backward(c.shape, c.config, c.w, c.in, c.dy, &fwd.ctx, 1); },
               Status::kInvalidArgument, {"saved->schedule"});
}

TEST(RoutingValidation, BadShapeAndConfigAreRejected) {
  Case c = valid_case();
  c.shape.hidden = 100;
  expect_error([&] { run_forward(c); }, Status::kInvalidArgument, {"hidden"});
  c = valid_case();
  c.config.capacity = 0.5;
  expect_error([&] { run_forward(c); }, Status::kInvalidArgument, {"capacity"});
}

}  // namespace
}  // namespace mok::ref
