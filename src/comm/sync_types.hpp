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

// Local (device memory, not symmetric) state of one group-barrier site.
struct GroupSync {
  uint32_t arrived;  // CTAs that reached the barrier in the current round (reset by the last one)
  uint32_t unused;
  uint64_t opened;   // epoch of the last round that passed the cross-rank barrier
};

// What a kernel needs to run a group barrier.
struct GroupBarrier {
  GroupSync* sync = nullptr;
  size_t flags_offset = 0;  // SymmetricLayout::flags
  uint64_t epoch = 0;
};

}  // namespace mok::comm
