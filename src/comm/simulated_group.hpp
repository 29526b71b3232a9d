// Simulated ranks: `ep` EP ranks driven by `ep` host threads on ONE GPU, each with its own
// symmetric window (plain cudaMalloc) and its own streams, peers reached by plain pointers on
// the same device. No NCCL communicator is involved. This exists so the EP >= 2 code paths
// (schedule exchange, dispatch, combine, the fused kernel's cross-rank waits, D3) can be run
// and checked bitwise on a 1-GPU machine; it says nothing about NVLink performance.
//
// Rules the callers must keep (tests/gpu/test_comm_harness.cuh does; docs/comm.md,
// "Simulated ranks"): every rank's grid fits on the GPU beside the others' (the sum of the
// co-waiting CTAs below the SM count); each rank uses its own non-blocking stream (the legacy
// default stream is shared by every thread of the context and would serialise one rank's
// launch behind another's spinning kernel); nothing device-wide (cudaDeviceSynchronize,
// cudaFree) between a rank's launches of one pass. Workspace creation and destruction are
// collective over the group (a host barrier), which keeps their device-wide syncs safe. And
// CUDA_MODULE_LOADING=EAGER and CUDA_DEVICE_MAX_CONNECTIONS=32 before the first CUDA call
// (both checked here): a lazily loaded kernel's first launch may wait for the whole context,
// and streams that share a hardware queue serialise, so a rank's launch could wait behind a
// peer's kernel that spins on it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "comm/peer_map.hpp"

namespace mok::comm {

// A reusable barrier of `n` host threads that gives up after a timeout (a thread that failed
// never arrives). Shared by SimulatedGroup and the test RankPool.
class HostBarrier {
 public:
  explicit HostBarrier(int n) : n_(n) {}
  // False when the others did not all arrive within `timeout_s` (this arrival is withdrawn).
  bool arrive_and_wait(double timeout_s);

 private:
  int n_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t round_ = 0;
};

class SimulatedGroup {
 public:
  // `device`: the GPU every rank runs on. `timeout_s`: how long a host collective waits for the
  // other ranks before it throws Error(kTimeout) (a rank that failed never arrives).
  SimulatedGroup(int ep, int device, double timeout_s = 120.0);
  SimulatedGroup(const SimulatedGroup&) = delete;
  SimulatedGroup& operator=(const SimulatedGroup&) = delete;

  int ep() const { return ep_; }
  int device() const { return device_; }

  // Host barrier of the ep rank threads. `what` names the call site in the timeout error.
  void barrier(int rank, const std::string& what);
  // Collective: every rank publishes its window base; returns every rank's base (self included).
  PeerMap exchange(int rank, char* base);
  // Throws kInvalidArgument unless 0 <= rank < ep.
  void check_rank(int rank) const;

 private:
  int ep_;
  int device_;
  double timeout_s_;
  HostBarrier barrier_;
  std::mutex mu_;  // bases_
  std::vector<char*> bases_;
};

}  // namespace mok::comm
