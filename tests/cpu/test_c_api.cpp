// The C API mirrors the C++ API: status codes and mok_last_error() text.
#include <gtest/gtest.h>

#include <string>

#include "mok/c_api.h"

namespace {

TEST(CApi, DefaultsAndValidation) {
  mok_config_t cfg;
  ASSERT_EQ(mok_config_default(&cfg), MOK_OK);
  EXPECT_EQ(cfg.comm_sms_forward, 0);  // automatic
  EXPECT_DOUBLE_EQ(cfg.capacity, 2.0);
  mok_layer_shape_t shape{512, 1024, 512, 0, 16, 4, 2};
  EXPECT_EQ(mok_validate(&shape, &cfg), MOK_OK) << mok_last_error();
  shape.hidden = 1000;
  EXPECT_EQ(mok_validate(&shape, &cfg), MOK_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mok_last_error()).find("LayerShape.hidden"), std::string::npos) << mok_last_error();
  EXPECT_STREQ(mok_status_string(MOK_CAPACITY_OVERFLOW), "capacity overflow");
  EXPECT_STREQ(mok_version(), "0.1.0");
}

TEST(CApi, EnginesDefaultAndAreValidated) {
  mok_config_t cfg;
  ASSERT_EQ(mok_config_default(&cfg), MOK_OK);
  EXPECT_EQ(cfg.forward_engine, 0);   // fused
  EXPECT_EQ(cfg.backward_engine, 0);  // auto
  mok_layer_shape_t shape{512, 1024, 512, 0, 16, 4, 2};
  cfg.backward_engine = 2;  // staged
  EXPECT_EQ(mok_validate(&shape, &cfg), MOK_OK) << mok_last_error();
  cfg.backward_engine = 3;
  EXPECT_EQ(mok_validate(&shape, &cfg), MOK_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mok_last_error()).find("Config.backward_engine"), std::string::npos) << mok_last_error();
  cfg.backward_engine = 0;
  cfg.forward_engine = -1;
  EXPECT_EQ(mok_validate(&shape, &cfg), MOK_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mok_last_error()).find("Config.forward_engine"), std::string::npos) << mok_last_error();
}

// The precision knobs mirror mok::Config: defaults, the range check naming the knob, and the value
// reaching Config::validate (fp8_block refuses a macrobatch ring, naming Config.macrobatch).
TEST(CApi, PrecisionDefaultsAndIsValidated) {
  mok_config_t cfg;
  ASSERT_EQ(mok_config_default(&cfg), MOK_OK);
  EXPECT_EQ(cfg.precision, 0);         // bf16
  EXPECT_EQ(cfg.fp8_weight_grads, 1);  // with fp8_block, the weight-gradient GEMMs in FP8
  mok_layer_shape_t shape{512, 1024, 512, 256, 16, 4, 2};
  cfg.precision = 1;  // fp8_block
  EXPECT_EQ(mok_validate(&shape, &cfg), MOK_OK) << mok_last_error();
  cfg.fp8_weight_grads = 0;
  EXPECT_EQ(mok_validate(&shape, &cfg), MOK_OK) << mok_last_error();
  cfg.fp8_weight_grads = 2;
  EXPECT_EQ(mok_validate(&shape, &cfg), MOK_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mok_last_error()).find("Config.fp8_weight_grads"), std::string::npos) << mok_last_error();
  cfg.fp8_weight_grads = 1;
  cfg.precision = 2;
  EXPECT_EQ(mok_validate(&shape, &cfg), MOK_INVALID_ARGUMENT);
  const std::string text = mok_last_error();
  EXPECT_NE(text.find("Config.precision"), std::string::npos) << text;
  EXPECT_NE(text.find("0 (bf16) or 1 (fp8_block)"), std::string::npos) << text;
  cfg.precision = 1;
  cfg.minibatch = 256;
  cfg.macrobatch = 512;  // a ring of 512 of the 5120 routed rows: fine in bf16, not with fp8_block
  EXPECT_EQ(mok_validate(&shape, &cfg), MOK_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mok_last_error()).find("Config.macrobatch"), std::string::npos) << mok_last_error();
  cfg.precision = 0;
  EXPECT_EQ(mok_validate(&shape, &cfg), MOK_OK) << mok_last_error();
}

// FP8 weight copies: their size needs no GPU (the codes twice, as is and transposed, one byte per
// weight element each, and two fp32 scales per 128x128 block, for the six matrices; alignment padding
// well under 1 %), and the handle calls refuse NULL like the others.
TEST(CApi, Fp8WeightsBytesAndNullArguments) {
  mok_layer_shape_t shape{512, 1024, 512, 256, 16, 4, 2};  // E_local 8
  uint64_t bytes = 0;
  ASSERT_EQ(mok_fp8_weights_bytes(&shape, &bytes), MOK_OK) << mok_last_error();
  const uint64_t routed = 3ull * 8 * 512 * 1024, shared = 3ull * 256 * 1024;  // weight elements
  const uint64_t routed_blocks = 3ull * 8 * (512 / 128) * (1024 / 128), shared_blocks = 3ull * 2 * (1024 / 128);
  const uint64_t minimum = 2 * (routed + shared) + 2 * 4 * (routed_blocks + shared_blocks);
  EXPECT_GE(bytes, minimum);
  EXPECT_LE(bytes, minimum + minimum / 100);
  EXPECT_EQ(mok_fp8_weights_bytes(&shape, nullptr), MOK_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mok_last_error()).find("bytes"), std::string::npos) << mok_last_error();
  EXPECT_EQ(mok_fp8_weights_bytes(nullptr, &bytes), MOK_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mok_last_error()).find("shape"), std::string::npos) << mok_last_error();
  mok_fp8_weights_t fp8 = nullptr;
  EXPECT_EQ(mok_fp8_weights_create_in(nullptr, nullptr, bytes, &fp8), MOK_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mok_last_error()).find("workspace"), std::string::npos) << mok_last_error();
  EXPECT_EQ(fp8, nullptr);
  mok_expert_weights_t weights{};
  EXPECT_EQ(weights.fp8, nullptr);  // zero-initialised: the pass quantizes per call
  EXPECT_EQ(mok_fp8_weights_update(nullptr, &weights, nullptr), MOK_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mok_last_error()).find("fp8"), std::string::npos) << mok_last_error();
  EXPECT_EQ(mok_fp8_weights_destroy(nullptr), MOK_OK);  // like free(NULL)
}

TEST(CApi, NullArgumentsAreInvalidNotCrashes) {
  EXPECT_EQ(mok_config_default(nullptr), MOK_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mok_last_error()).find("config"), std::string::npos);
  EXPECT_EQ(mok_workspace_check(nullptr), MOK_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mok_last_error()).find("workspace"), std::string::npos);
  mok_layer_shape_t shape{512, 1024, 512, 0, 16, 4, 2};
  mok_config_t cfg;
  mok_config_default(&cfg);
  EXPECT_EQ(mok_workspace_create(&shape, &cfg, nullptr, 0, nullptr), MOK_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mok_last_error()).find("out"), std::string::npos);
}

// Context sizes need no GPU: the routing table alone, or with room for g, u (numbers from the
// layout: 2 x buffer_rows x I bf16 beside a routing table of a few hundred kB here).
TEST(CApi, ContextBytes) {
  mok_layer_shape_t shape{512, 1024, 512, 256, 16, 4, 2};
  mok_config_t cfg;
  mok_config_default(&cfg);
  uint64_t full = 0, routing = 0;
  ASSERT_EQ(mok_context_bytes(&shape, &cfg, 0, &full), MOK_OK) << mok_last_error();
  ASSERT_EQ(mok_context_bytes(&shape, &cfg, 1, &routing), MOK_OK) << mok_last_error();
  EXPECT_GT(routing, 0u);
  // buffer rows = round_up(ceil(2 * T * K) + E_local * 127, 128) = round_up(4096 + 1016, 128) = 5120
  const uint64_t gu = 2ull * 5120 * 512 * 2, shared = 2ull * 512 * 256 * 2;
  EXPECT_EQ(full - routing, gu + shared);
  uint64_t deferred = 0;
  ASSERT_EQ(mok_context_bytes(&shape, &cfg, 2, &deferred), MOK_OK) << mok_last_error();
  EXPECT_EQ(deferred - full, gu / 2 + shared / 2);  // hs and shared hs beside g, u
  EXPECT_EQ(mok_context_bytes(&shape, &cfg, 3, &full), MOK_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mok_last_error()).find("keep"), std::string::npos) << mok_last_error();
  shape.topk = 0;
  EXPECT_EQ(mok_context_bytes(&shape, &cfg, 0, &full), MOK_INVALID_ARGUMENT);
  EXPECT_EQ(mok_context_bytes(&shape, &cfg, 0, nullptr), MOK_INVALID_ARGUMENT);
  EXPECT_EQ(mok_context_create(nullptr, nullptr, 0, nullptr), MOK_INVALID_ARGUMENT);
  EXPECT_EQ(mok_context_destroy(nullptr), MOK_OK);  // like free(NULL)
}

}  // namespace
