// The GEMM engine's developer knobs are read from the environment at launch; a malformed value
// is an error that names the knob and the expected value, never a silent default.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <string>

#include "gemm/gemm_config.hpp"
#include "gemm/gemm_host.hpp"
#include "mok/error.hpp"

namespace {

// Sets (or, for nullptr, unsets) an environment variable for the scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    if (value != nullptr) setenv(name, value, 1);
    else unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_, old_.c_str(), 1);
    else unsetenv(name_);
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

TEST(GemmKnobs, DeferStaggerDefaultsAndParses) {
  {
    ScopedEnv env("MOK_GEMM_DEFER_STAGGER", nullptr);
    EXPECT_EQ(mok::gemm::host::defer_wg1_shift(), mok::gemm::kDeferWg1Shift);
  }
  for (int v : {0, 1, 3, 64}) {
    ScopedEnv env("MOK_GEMM_DEFER_STAGGER", std::to_string(v).c_str());
    EXPECT_EQ(mok::gemm::host::defer_wg1_shift(), v);
  }
}

TEST(GemmKnobs, DeferStaggerRejectsMalformedValues) {
  for (const char* bad : {"", "abc", "-1", "65", "2x", "1.5"}) {
    ScopedEnv env("MOK_GEMM_DEFER_STAGGER", bad);
    try {
      mok::gemm::host::defer_wg1_shift();
      FAIL() << "accepted MOK_GEMM_DEFER_STAGGER='" << bad << "'";
    } catch (const mok::Error& e) {
      EXPECT_EQ(e.status(), mok::Status::kInvalidArgument);
      const std::string what = e.what();
      EXPECT_NE(what.find("MOK_GEMM_DEFER_STAGGER"), std::string::npos) << what;
      EXPECT_NE(what.find("[0, 64]"), std::string::npos) << what;
    }
  }
}

// The other integer knobs go through the same parser (host::env_int).
TEST(GemmKnobs, IntegerKnobsDefaultParseAndReject) {
  using mok::gemm::host::dh_prefetch_ahead;
  using mok::gemm::host::group_m_override;
  {
    ScopedEnv a("MOK_GEMM_DH_PREFETCH", nullptr), b("MOK_GEMM_GROUP_M", nullptr);
    EXPECT_EQ(dh_prefetch_ahead(), 2);
    EXPECT_EQ(group_m_override(8), 8);
  }
  {
    ScopedEnv a("MOK_GEMM_DH_PREFETCH", "0"), b("MOK_GEMM_GROUP_M", "16");
    EXPECT_EQ(dh_prefetch_ahead(), 0);
    EXPECT_EQ(group_m_override(8), 16);
  }
  struct Bad {
    const char* name;
    const char* value;
    int (*read)();
  };
  const Bad bad[] = {
      {"MOK_GEMM_DH_PREFETCH", "-1", [] { return dh_prefetch_ahead(); }},
      {"MOK_GEMM_DH_PREFETCH", "two", [] { return dh_prefetch_ahead(); }},
      {"MOK_GEMM_GROUP_M", "0", [] { return group_m_override(8); }},
      {"MOK_GEMM_GROUP_M", "8x", [] { return group_m_override(8); }},
      {"MOK_GEMM_GROUP_M", "", [] { return group_m_override(8); }},
  };
  for (const Bad& c : bad) {
    ScopedEnv env(c.name, c.value);
    try {
      c.read();
      FAIL() << "accepted " << c.name << "='" << c.value << "'";
    } catch (const mok::Error& e) {
      EXPECT_EQ(e.status(), mok::Status::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(c.name), std::string::npos) << e.what();
    }
  }
}

TEST(GemmKnobs, EnvIsMatchesExactly) {
  {
    ScopedEnv env("MOK_GEMM_TEST_FLAG", nullptr);
    EXPECT_FALSE(mok::gemm::host::env_is("MOK_GEMM_TEST_FLAG", "1"));
  }
  {
    ScopedEnv env("MOK_GEMM_TEST_FLAG", "1");
    EXPECT_TRUE(mok::gemm::host::env_is("MOK_GEMM_TEST_FLAG", "1"));
  }
  for (const char* other : {"", "0", "10", "1 "}) {
    ScopedEnv env("MOK_GEMM_TEST_FLAG", other);
    EXPECT_FALSE(mok::gemm::host::env_is("MOK_GEMM_TEST_FLAG", "1")) << "'" << other << "'";
  }
}

TEST(GemmKnobs, RasterKnob) {
  {
    ScopedEnv env("MOK_GEMM_RASTER", nullptr);
    EXPECT_FALSE(mok::gemm::host::expert_raster_groups());
  }
  {
    ScopedEnv env("MOK_GEMM_RASTER", "expert");
    EXPECT_TRUE(mok::gemm::host::expert_raster_groups());
  }
}

}  // namespace
