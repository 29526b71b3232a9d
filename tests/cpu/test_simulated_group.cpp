// The host side of simulated ranks (comm/simulated_group.hpp): the barrier and the window-base
// exchange among rank threads, their timeouts, and the environment the group refuses to run
// without. No GPU needed (the GPU side runs in test_forward / test_comm with fewer GPUs than ranks).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "comm/simulated_group.hpp"
#include "mok/error.hpp"

namespace mok::comm {
namespace {

// Sets the two variables the group needs for the test's lifetime, restoring them afterwards.
class SimulatedEnv {
 public:
  SimulatedEnv(const char* loading, const char* connections) {
    save("CUDA_MODULE_LOADING", loading);
    save("CUDA_DEVICE_MAX_CONNECTIONS", connections);
  }
  ~SimulatedEnv() {
    for (auto& [name, value, had] : saved_) {
      if (had) setenv(name.c_str(), value.c_str(), 1); else unsetenv(name.c_str());
    }
  }

 private:
  void save(const char* name, const char* value) {
    const char* old = std::getenv(name);
    saved_.push_back({name, old ? old : "", old != nullptr});
    if (value) setenv(name, value, 1); else unsetenv(name);
  }
  struct Saved {
    std::string name, value;
    bool had;
  };
  std::vector<Saved> saved_;
};

TEST(SimulatedGroup, ExchangeGivesEveryRankEveryBaseInRankOrder) {
  SimulatedEnv env("EAGER", "32");
  for (int ep : {1, 2, 8}) {
    SimulatedGroup g(ep, 0, 10.0);
    std::vector<PeerMap> got(ep);
    std::vector<std::thread> ranks;
    for (int r = 0; r < ep; ++r) {
      ranks.emplace_back([&, r] {
        char* fake = reinterpret_cast<char*>(0x1000 * (r + 1));
        got[r] = g.exchange(r, fake);
        got[r] = g.exchange(r, fake + 8);  // a second window: the bases do not mix between rounds
      });
    }
    for (auto& t : ranks) t.join();
    for (int r = 0; r < ep; ++r) {
      EXPECT_EQ(got[r].rank, r);
      EXPECT_EQ(got[r].ep, ep);
      for (int p = 0; p < ep; ++p) EXPECT_EQ(got[r].base[p], reinterpret_cast<char*>(0x1000 * (p + 1) + 8)) << "ep " << ep;
    }
  }
}

TEST(SimulatedGroup, BarrierHoldsEveryRankUntilTheLastArrives) {
  SimulatedEnv env("EAGER", "32");
  constexpr int kEp = 4, kRounds = 50;
  SimulatedGroup g(kEp, 0, 10.0);
  std::atomic<int> arrived{0};
  std::atomic<bool> early{false};
  std::vector<std::thread> ranks;
  for (int r = 0; r < kEp; ++r) {
    ranks.emplace_back([&, r] {
      for (int i = 0; i < kRounds; ++i) {
        arrived.fetch_add(1);
        g.barrier(r, "test");
        if (arrived.load() < (i + 1) * kEp) early = true;  // someone left before all arrived
        g.barrier(r, "test, second");
      }
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_FALSE(early.load());
}

TEST(SimulatedGroup, AMissingRankIsATimeoutNamingTheSite) {
  SimulatedEnv env("EAGER", "32");
  SimulatedGroup g(2, 0, 0.2);
  try {
    g.barrier(0, "workspace creation");  // rank 1 never comes
    ADD_FAILURE() << "expected a timeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kTimeout);
    EXPECT_NE(std::string(e.what()).find("workspace creation"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 0"), std::string::npos) << e.what();
  }
}

TEST(SimulatedGroup, RefusesBadArgumentsAndTheWrongEnvironment) {
  auto expect_invalid = [](auto make, const char* fragment) {
    try {
      make();
      ADD_FAILURE() << "expected kInvalidArgument naming " << fragment;
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  {
    SimulatedEnv env("EAGER", "32");
    expect_invalid([] { SimulatedGroup g(0, 0); }, "ep");
    expect_invalid([] { SimulatedGroup g(kMaxEp + 1, 0); }, "ep");
    expect_invalid([] { SimulatedGroup g(2, -1); }, "device");
    expect_invalid([] { SimulatedGroup g(2, 0, 0.0); }, "timeout_s");
    SimulatedGroup g(2, 0);
    expect_invalid([&] { g.barrier(2, "x"); }, "simulated rank");
  }
  {
    SimulatedEnv env(nullptr, "32");  // lazy loading (the CUDA default)
    expect_invalid([] { SimulatedGroup g(2, 0); }, "CUDA_MODULE_LOADING");
  }
  {
    SimulatedEnv env("EAGER", nullptr);  // 8 hardware queues: enough for 2 ranks, not for 8
    SimulatedGroup ok(2, 0);
    expect_invalid([] { SimulatedGroup g(8, 0); }, "CUDA_DEVICE_MAX_CONNECTIONS");
  }
}

}  // namespace
}  // namespace mok::comm
