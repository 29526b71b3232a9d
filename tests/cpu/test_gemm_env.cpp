// gemm::host::env_int, the strict integer parser of environment variables that the layers
// above use (the GEMM engine itself reads none; the GPU test harness reads
// MOK_TEST_SIMULATE_MAX_EP with it): a malformed value is an error that names the variable and
// the expected value, never a silent default.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <string>

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

constexpr const char* kVar = "MOK_TEST_ENV_VALUE";

TEST(GemmEnv, EnvIntDefaultsAndParses) {
  using mok::gemm::host::env_int;
  {
    ScopedEnv env(kVar, nullptr);
    EXPECT_EQ(env_int(kVar, 7, 1, 8, "an EP size"), 7);
  }
  for (int v : {1, 3, 8}) {
    ScopedEnv env(kVar, std::to_string(v).c_str());
    EXPECT_EQ(env_int(kVar, 7, 1, 8, "an EP size"), v);
  }
}

TEST(GemmEnv, EnvIntRejectsMalformedValues) {
  for (const char* bad : {"", "abc", "0", "9", "-1", "2x", "1.5"}) {
    ScopedEnv env(kVar, bad);
    try {
      mok::gemm::host::env_int(kVar, 7, 1, 8, "an EP size");
      FAIL() << "accepted " << kVar << "='" << bad << "'";
    } catch (const mok::Error& e) {
      EXPECT_EQ(e.status(), mok::Status::kInvalidArgument);
      const std::string what = e.what();
      EXPECT_NE(what.find(kVar), std::string::npos) << what;
      EXPECT_NE(what.find("an EP size in [1, 8]"), std::string::npos) << what;
    }
  }
}

}  // namespace
