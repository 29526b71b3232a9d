// Plain (host-compilable) types of the synchronisation layer; the device code is in wait.cuh
// and barrier.cuh.
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm/error_record.hpp"

namespace mok::comm {

// What a wait needs to report a timeout.
struct WaitContext {
  DeviceErrorRecord* error = nullptr;
  uint64_t timeout_ns = 10'000'000'000ull;
  int rank = 0;
};

// Barrier sites (comm::SyncSite): each has its own GroupSync and its own flag array in the
// window, so each counts its own rounds.
inline constexpr int kBarrierSites = 8;

// Local (device memory, not symmetric) state of one group-barrier site.
struct GroupSync {
  uint32_t arrived;  // CTAs that reached the barrier in the current round (reset by the last one)
  uint32_t unused;
  uint64_t opened;   // the last round of this site that passed the cross-rank barrier (0: none)
};

// What a kernel needs to run a group barrier. No epoch: a barrier's round is read on the device
// (GroupSync::opened + 1, barrier.cuh), so a kernel captured in a CUDA graph waits anew on
// every replay. `open_flag` (optional): a word zeroed before the launch that the opener sets to
// 1, for CTAs of the same kernel that wait for the barrier without taking part in it.
struct GroupBarrier {
  GroupSync* sync = nullptr;
  size_t flags_offset = 0;  // SymmetricLayout::site_flags(site)
  uint32_t* open_flag = nullptr;
};

}  // namespace mok::comm
