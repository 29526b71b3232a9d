// Validation of LayerShape and Config: each bad value gives kInvalidArgument with a message
// that names the argument and the expected value.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <string>

#include "mok/api.hpp"
#include "mok/config.hpp"
#include "mok/error.hpp"
#include "mok/shape.hpp"

namespace {

mok::LayerShape good_shape() { return mok::LayerShape{512, 1024, 512, 256, 16, 4, 2}; }

// Runs f, expects mok::Error(kInvalidArgument) whose message contains every fragment.
template <typename F>
void expect_invalid(F&& f, std::initializer_list<const char*> fragments) {
  try {
    f();
    FAIL() << "expected mok::Error";
  } catch (const mok::Error& e) {
    EXPECT_EQ(e.status(), mok::Status::kInvalidArgument) << e.what();
    for (const char* frag : fragments) {
      EXPECT_NE(std::string(e.what()).find(frag), std::string::npos)
          << "message '" << e.what() << "' lacks '" << frag << "'";
    }
  }
}

TEST(ShapeValidation, AcceptsTheModelShapes) {
  for (int ep : {1, 2, 4, 8}) {
    EXPECT_NO_THROW(mok::dsv3_shape(ep).validate());
    EXPECT_NO_THROW(mok::qwen3_shape(ep).validate());
    EXPECT_NO_THROW(mok::gptoss_shape(ep).validate());  // H = I = 2880 = 45 * 64
  }
  EXPECT_NO_THROW(good_shape().validate());
}

TEST(ShapeValidation, HiddenAndIntermediateMultiplesOf64) {
  auto s = good_shape();
  s.hidden = 1000;
  expect_invalid([&] { s.validate(); }, {"LayerShape.hidden", "multiple of 64", "1000"});
  s = good_shape();
  s.hidden = 0;
  expect_invalid([&] { s.validate(); }, {"LayerShape.hidden", "0"});
  s = good_shape();
  s.intermediate = 96;
  expect_invalid([&] { s.validate(); }, {"LayerShape.intermediate", "multiple of 64", "96"});
  s = good_shape();
  s.shared_intermediate = 100;
  expect_invalid([&] { s.validate(); }, {"LayerShape.shared_intermediate", "multiple of 64", "100"});
  s.shared_intermediate = 0;  // no shared expert is fine
  EXPECT_NO_THROW(s.validate());
}

TEST(ShapeValidation, TopKAndExperts) {
  auto s = good_shape();
  s.topk = 17;  // K > E
  expect_invalid([&] { s.validate(); }, {"LayerShape.topk", "17"});
  s.topk = 0;
  expect_invalid([&] { s.validate(); }, {"LayerShape.topk", "0"});
  s = good_shape();
  s.experts = 15;  // E % ep != 0
  expect_invalid([&] { s.validate(); }, {"LayerShape.experts", "multiple of ep = 2", "15"});
  s = good_shape();
  s.ep = 0;
  expect_invalid([&] { s.validate(); }, {"LayerShape.ep", "0"});
  s = good_shape();
  s.tokens = 0;
  expect_invalid([&] { s.validate(); }, {"LayerShape.tokens", "0"});
  s = good_shape();
  s.tokens = int64_t(1) << 40;
  expect_invalid([&] { s.validate(); }, {"LayerShape.tokens", "routed rows"});
}

TEST(ConfigValidation, DefaultsAreValid) {
  mok::Config c;
  EXPECT_NO_THROW(c.validate(good_shape()));
  EXPECT_EQ(c.comm_sms_forward, 0);  // automatic
  EXPECT_EQ(c.comm_sms_backward, 0);  // automatic
  mok::LayerShape ep1 = good_shape();
  ep1.ep = 1;
  EXPECT_EQ(c.effective_comm_sms_backward(ep1, 132), 132);         // EP 1: the whole device
  EXPECT_EQ(c.effective_comm_sms_backward(ep1, 0), 16);            // device unknown
  EXPECT_EQ(c.effective_comm_sms_backward(good_shape(), 132), 16);  // EP 2
  EXPECT_EQ(c.capacity, 2.0);
  EXPECT_EQ(c.effective_minibatch(good_shape()) % mok::kRowTile, 0);
}

TEST(ConfigValidation, BadKnobsNameTheKnob) {
  const auto s = good_shape();
  mok::Config c;
  c.comm_sms_forward = -1;
  expect_invalid([&] { c.validate(s); }, {"Config.comm_sms_forward", "0 (automatic)", "[1, 128]", "-1"});
  c.comm_sms_forward = 129;
  expect_invalid([&] { c.validate(s); }, {"Config.comm_sms_forward", "129"});
  c = {};
  c.comm_sms_backward = -1;
  expect_invalid([&] { c.validate(s); }, {"Config.comm_sms_backward", "0 (automatic)", "[1, 128]", "-1"});
  c = {};
  c.comm_sms_backward = 500;
  expect_invalid([&] { c.validate(s); }, {"Config.comm_sms_backward", "500"});
  c = {};
  c.minibatch = 100;
  expect_invalid([&] { c.validate(s); }, {"Config.minibatch", "multiple of 128", "100"});
  c = {};
  c.minibatch = 256;
  c.macrobatch = 384;
  expect_invalid([&] { c.validate(s); }, {"Config.macrobatch", "multiple of the minibatch (256 rows)", "384"});
  c = {};
  c.capacity = 0.5;
  expect_invalid([&] { c.validate(s); }, {"Config.capacity", ">= 1.0", "0.5"});
  c.capacity = std::numeric_limits<double>::quiet_NaN();
  expect_invalid([&] { c.validate(s); }, {"Config.capacity", "nan"});
  c = {};
  c.grid_sms = 8;
  c.comm_sms_forward = 8;  // an explicit count must leave GEMM SMs
  expect_invalid([&] { c.validate(s); }, {"Config.comm_sms_forward", "fewer than Config.grid_sms = 8", "8"});
  c = {};
  c.grid_sms = 8;
  c.comm_sms_backward = 12;
  expect_invalid([&] { c.validate(s); }, {"Config.comm_sms_backward", "fewer than Config.grid_sms = 8", "12"});
  c = {};
  c.grid_sms = 1;
  expect_invalid([&] { c.validate(s); }, {"Config.grid_sms", "[2, 1024]", "1"});
  c = {};
  c.grid_sms = -1;
  expect_invalid([&] { c.validate(s); }, {"Config.grid_sms", "-1"});
  c = {};
  c.wait_timeout_s = 0;
  expect_invalid([&] { c.validate(s); }, {"Config.wait_timeout_s", "0"});
}

// The automatic comm-CTA count lands on the best points of the 2026-11-30 EP=2 sweeps after
// the fan-out dispatch (docs/perf-log.md, forward-v6..v8: dsv3 best at 4-8, qwen3 at 16,
// gptoss at 6-8); an explicit value wins.
TEST(ConfigValidation, EnginesNameTheKnobAndAutoFollowsTheGradientMode) {
  mok::Config c;
  EXPECT_EQ(c.forward_engine, mok::ForwardEngine::kFused);
  EXPECT_EQ(c.backward_engine, mok::BackwardEngine::kAuto);
  c.forward_engine = static_cast<mok::ForwardEngine>(2);
  expect_invalid([&] { c.validate(good_shape()); }, {"Config.forward_engine", "0 (fused) or 1 (staged)", "2"});
  c = mok::Config{};
  c.backward_engine = static_cast<mok::BackwardEngine>(-1);
  expect_invalid([&] { c.validate(good_shape()); }, {"Config.backward_engine", "0 (auto), 1 (fused) or 2 (staged)", "-1"});
  c = mok::Config{};
  for (bool fp32 : {true, false}) {
    EXPECT_EQ(c.effective_backward_engine(fp32), mok::auto_backward_engine(fp32));
    EXPECT_NE(c.effective_backward_engine(fp32), mok::BackwardEngine::kAuto);
    for (auto e : {mok::BackwardEngine::kFused, mok::BackwardEngine::kStaged}) {
      c.backward_engine = e;
      EXPECT_EQ(c.effective_backward_engine(fp32), e);  // an explicit engine is kept in both modes
    }
    c.backward_engine = mok::BackwardEngine::kAuto;
  }
  EXPECT_STREQ(mok::to_string(mok::BackwardEngine::kAuto), "auto");
  EXPECT_STREQ(mok::to_string(mok::ForwardEngine::kStaged), "staged");
  EXPECT_NE(c.to_string().find("forward_engine=fused backward_engine=auto"), std::string::npos) << c.to_string();
}

TEST(ConfigValidation, AutomaticCommSmsFollowBytesPerFlop) {
  mok::Config c;
  EXPECT_GE(c.effective_comm_sms_forward(mok::dsv3_shape(2)), 5);
  EXPECT_LE(c.effective_comm_sms_forward(mok::dsv3_shape(2)), 8);
  EXPECT_GE(c.effective_comm_sms_forward(mok::qwen3_shape(2)), 14);
  EXPECT_LE(c.effective_comm_sms_forward(mok::qwen3_shape(2)), 20);
  EXPECT_GE(c.effective_comm_sms_forward(mok::gptoss_shape(2)), 5);
  EXPECT_LE(c.effective_comm_sms_forward(mok::gptoss_shape(2)), 8);
  c.comm_sms_forward = 12;
  EXPECT_EQ(c.effective_comm_sms_forward(mok::dsv3_shape(2)), 12);
  EXPECT_EQ(c.effective_comm_sms_staged_forward(mok::dsv3_shape(1), 132), 12);  // the caller's count everywhere
}

// The staged forward (and every FP8 forward) at EP 1 with the grid unset: the device's SMs, 16 when unknown.
TEST(ConfigValidation, StagedForwardAtEp1TakesTheDevice) {
  mok::Config c;
  EXPECT_EQ(c.effective_comm_sms_staged_forward(mok::qwen3_shape(1), 132), 132);
  EXPECT_EQ(c.effective_comm_sms_staged_forward(mok::qwen3_shape(1), 0), 16);
  EXPECT_EQ(c.effective_comm_sms_staged_forward(mok::qwen3_shape(2), 132), c.effective_comm_sms_forward(mok::qwen3_shape(2)));
}

// A set grid smaller than an automatic count gets a count that fits it (one GEMM SM at least):
// Config{grid_sms = 17} with the automatic counts is valid, whatever the shape asks for.
TEST(ConfigValidation, AutomaticCommSmsFitTheGrid) {
  for (int ep : {1, 2}) {
    for (const mok::LayerShape& s : {mok::dsv3_shape(ep), mok::qwen3_shape(ep), mok::gptoss_shape(ep)}) {
      for (int grid : {2, 3, 7, 17}) {
        mok::Config c;
        c.grid_sms = grid;
        EXPECT_NO_THROW(c.validate(s)) << "grid_sms " << grid;
        EXPECT_GE(c.effective_comm_sms_forward(s), 1);
        EXPECT_LT(c.effective_comm_sms_forward(s), grid) << "grid_sms " << grid;
        // EP 1: the whole grid; EP >= 2: 16, fitted to the grid
        EXPECT_EQ(c.effective_comm_sms_backward(s, 132), ep == 1 ? grid : std::min(16, grid - 1)) << "grid_sms " << grid;
        // the staged forward: EP 1 the whole grid (its launches run alone), EP >= 2 the fused forward's count
        EXPECT_EQ(c.effective_comm_sms_staged_forward(s, 132), ep == 1 ? grid : c.effective_comm_sms_forward(s))
            << "grid_sms " << grid;
        EXPECT_EQ(c.effective_comm_sms_forward(s),
                  std::min(mok::Config{}.effective_comm_sms_forward(s), grid - 1));
      }
    }
  }
}

// EP 1 (every comm CTA joins the GEMM work after its dispatch share): at least one CTA per 60 MB
// of routed rows, up to 16 (docs/perf-log.md, forward-v64, v69: dsv3 best at 16, 3-6 % faster
// than at 6).
TEST(ConfigValidation, AutomaticCommSmsAtEp1CoverTheDispatchBytes) {
  mok::Config c;
  EXPECT_EQ(c.effective_comm_sms_forward(mok::dsv3_shape(1)), 16);   // 940 MB of rows
  EXPECT_EQ(c.effective_comm_sms_forward(mok::qwen3_shape(1)), 16);  // as at EP 2 (bytes per flop)
  EXPECT_EQ(c.effective_comm_sms_forward(mok::gptoss_shape(1)), 6);  // 189 MB: the floor
  c.comm_sms_forward = 9;
  EXPECT_EQ(c.effective_comm_sms_forward(mok::dsv3_shape(1)), 9);
  // With the macrobatch ring the comm CTAs dispatch all pass long (no joining): bytes per flop.
  mok::Config ring;
  ring.macrobatch = 4 * ring.effective_minibatch(mok::dsv3_shape(1));
  EXPECT_EQ(ring.effective_comm_sms_forward(mok::dsv3_shape(1)),
            mok::Config{}.effective_comm_sms_forward(mok::dsv3_shape(2)));
  EXPECT_LT(ring.effective_comm_sms_forward(mok::dsv3_shape(1)), 16);
}

TEST(ConfigValidation, CapacitySizesBuffers) {
  const auto s = good_shape();  // T*K = 2048 per rank, E_local = 8
  mok::Config c;
  c.capacity = 1.5;
  EXPECT_EQ(c.max_rows_per_rank(s), 3072);
  // each of the 8 local segments may waste up to 127 padding rows
  EXPECT_EQ(c.buffer_rows_per_rank(s), (3072 + 8 * 127 + 127) / 128 * 128);
  c.capacity = 100.0;  // above ep: every routed row of every rank fits, never more
  EXPECT_EQ(c.max_rows_per_rank(s), 2048 * 2);
}

// macrobatch: a ring of at least two minibatches below the routed buffer, every row otherwise.
TEST(ConfigValidation, PrecisionNamesTheKnobAndFp8KeepsEveryRoutedRow) {
  const auto s = good_shape();  // buffer_rows_per_rank 5120 at capacity 2
  mok::Config c;
  EXPECT_EQ(c.precision, mok::Precision::kBf16);
  EXPECT_TRUE(c.fp8_weight_grads);
  EXPECT_NE(c.to_string().find("precision=bf16"), std::string::npos) << c.to_string();
  EXPECT_EQ(c.to_string().find("fp8_weight_grads"), std::string::npos) << c.to_string();  // bf16: no FP8 knob
  c.precision = static_cast<mok::Precision>(2);
  expect_invalid([&] { c.validate(s); }, {"Config.precision", "0 (bf16) or 1 (fp8_block)", "2"});
  c.precision = static_cast<mok::Precision>(-1);
  expect_invalid([&] { c.validate(s); }, {"Config.precision", "-1"});
  c = mok::Config{};
  c.precision = mok::Precision::kFp8Block;
  EXPECT_NO_THROW(c.validate(s));
  c.fp8_weight_grads = false;
  EXPECT_NO_THROW(c.validate(s));
  EXPECT_NE(c.to_string().find("precision=fp8_block fp8_weight_grads=0"), std::string::npos) << c.to_string();
  // The FP8 passes are the staged launches: a macrobatch ring (fine in bf16) is refused, naming the knob.
  c.minibatch = 256;
  c.macrobatch = 512;
  expect_invalid([&] { c.validate(s); }, {"Config.macrobatch", "precision = fp8_block", "5120 rows", "512"});
  c.precision = mok::Precision::kBf16;
  EXPECT_NO_THROW(c.validate(s));
  c.precision = mok::Precision::kFp8Block;
  c.macrobatch = c.buffer_rows_per_rank(s);  // at least the buffer: every row resident, no ring
  EXPECT_NO_THROW(c.validate(s));
  EXPECT_STREQ(mok::to_string(mok::Precision::kBf16), "bf16");
  EXPECT_STREQ(mok::to_string(mok::Precision::kFp8Block), "fp8_block");
  EXPECT_STREQ(mok::to_string(static_cast<mok::Precision>(7)), "invalid");
}

TEST(ConfigValidation, MacrobatchSizesTheResidentRows) {
  const auto s = good_shape();  // buffer_rows_per_rank 5120 at capacity 2
  mok::Config c;
  c.minibatch = 256;
  const int64_t all = c.buffer_rows_per_rank(s);
  EXPECT_EQ(c.resident_routed_rows(s), all);  // 0: every row
  c.macrobatch = 512;
  EXPECT_NO_THROW(c.validate(s));
  EXPECT_EQ(c.resident_routed_rows(s), 512);
  c.macrobatch = 256;  // one minibatch: GEMM 1 of m would wait on GEMM 2 of m - 1 (handed out later)
  expect_invalid([&] { c.validate(s); }, {"Config.macrobatch", "at least two minibatches (512 rows)", "256"});
  c.macrobatch = (all / 256 + 1) * 256;  // at least the buffer: every row, no ring
  EXPECT_NO_THROW(c.validate(s));
  EXPECT_EQ(c.resident_routed_rows(s), all);
  c.minibatch = all;  // one minibatch holds the buffer: a macrobatch of it keeps every row
  c.macrobatch = all;
  EXPECT_NO_THROW(c.validate(s));
  EXPECT_EQ(c.resident_routed_rows(s), all);
}

}  // namespace

// The FP8 context keeps g, u in e4m3 (1x128 scales): at most 0.6x the bytes of the bf16 context on
// the benchmark shapes (#48), the same routing table, and a deferring context keeps bf16 room for dg, du.
TEST(ConfigValidation, Fp8ContextIsAtMostSixTenthsOfBf16s) {
  for (const mok::LayerShape& s : {mok::dsv3_shape(1), mok::qwen3_shape(1), mok::gptoss_shape(1), mok::dsv3_shape(8)}) {
    mok::Config bf16, fp8;
    fp8.precision = mok::Precision::kFp8Block;
    const double b = double(mok::Context::bytes(s, bf16)), f = double(mok::Context::bytes(s, fp8));
    EXPECT_LE(f / b, 0.6) << s.to_string() << ": " << f << " / " << b << " bytes";
    EXPECT_GT(f / b, 0.45) << s.to_string();
    EXPECT_EQ(mok::Context::bytes(s, fp8, mok::Context::Keep::kRoutingOnly),
              mok::Context::bytes(s, bf16, mok::Context::Keep::kRoutingOnly));
    EXPECT_GT(double(mok::Context::bytes(s, fp8, mok::Context::Keep::kDeferredWgrad)), b);  // + dg, du in bf16
  }
}
