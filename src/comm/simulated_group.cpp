#include "comm/simulated_group.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "mok/error.hpp"

namespace mok::comm {

SimulatedGroup::SimulatedGroup(int ep, int device, double timeout_s)
    : ep_(ep), device_(device), timeout_s_(timeout_s), barrier_(ep), bases_(static_cast<size_t>(ep > 0 ? ep : 0), nullptr) {
  if (ep < 1 || ep > kMaxEp) throw_invalid("SimulatedGroup ep", "1.." + std::to_string(kMaxEp), std::to_string(ep));
  if (device < 0) throw_invalid("SimulatedGroup device", "a CUDA device index >= 0", std::to_string(device));
  if (!(timeout_s > 0)) throw_invalid("SimulatedGroup timeout_s", "> 0 seconds", std::to_string(timeout_s));
  // Lazy loading (the default since CUDA 12.2) loads a kernel at its first launch, and loading
  // may wait for the whole context: with every rank in one context that is a peer's kernel
  // spinning on this rank, which never comes (seen as 10 s wait timeouts and garbage tables).
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  if (loading == nullptr || std::string(loading) != "EAGER") {
    throw_invalid("environment variable CUDA_MODULE_LOADING",
                  "EAGER for simulated ranks (set before the first CUDA call: a lazily loaded kernel's first "
                  "launch may wait for the peers' spinning kernels in the shared context)",
                  loading == nullptr ? "unset (LAZY)" : loading);
  }
  // Streams share CUDA_DEVICE_MAX_CONNECTIONS hardware queues (default 8): a rank's launch can
  // queue behind a peer's kernel that spins on it (seen at ep 8 as 10 s timeouts at the very
  // first barrier). Every rank's stream needs its own queue, with room for the others.
  const char* conn = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const int need = ep <= 2 ? 8 : std::min(32, 4 * ep);
  const int have = conn == nullptr ? 8 : std::atoi(conn);
  if (have < need) {
    throw_invalid("environment variable CUDA_DEVICE_MAX_CONNECTIONS",
                  ">= " + std::to_string(need) + " for " + std::to_string(ep) +
                      " simulated ranks (set before the first CUDA call; 32 is the maximum): with fewer "
                      "hardware queues a rank's kernel can wait behind a peer's spinning kernel",
                  conn == nullptr ? "unset (8)" : conn);
  }
}

void SimulatedGroup::check_rank(int rank) const {
  if (rank < 0 || rank >= ep_) {
    throw_invalid("simulated rank", "0.." + std::to_string(ep_ - 1), std::to_string(rank));
  }
}

bool HostBarrier::arrive_and_wait(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t round = round_;
  if (++arrived_ == n_) {
    arrived_ = 0;
    ++round_;
    cv_.notify_all();
    return true;
  }
  if (cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return round_ != round; })) return true;
  --arrived_;  // leave the round consistent for whoever inspects it
  return false;
}

void SimulatedGroup::barrier(int rank, const std::string& what) {
  check_rank(rank);
  if (!barrier_.arrive_and_wait(timeout_s_)) {
    char secs[32];
    std::snprintf(secs, sizeof(secs), "%g", timeout_s_);
    throw Error(Status::kTimeout, "simulated ranks: rank " + std::to_string(rank) + " waited " + secs + " s at " + what +
                                      " for the other ranks (one of them failed or never called it)");
  }
}

PeerMap SimulatedGroup::exchange(int rank, char* base) {
  check_rank(rank);
  {
    std::lock_guard<std::mutex> lock(mu_);
    bases_[rank] = base;
  }
  barrier(rank, "the window exchange");
  PeerMap peers;
  peers.rank = rank;
  peers.ep = ep_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int p = 0; p < ep_; ++p) peers.base[p] = bases_[p];
  }
  barrier(rank, "the window exchange (read back)");  // nobody overwrites bases_ before all read them
  return peers;
}

}  // namespace mok::comm
