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

}  // namespace
