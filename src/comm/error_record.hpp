// Device-side error record of one rank: the GPU schedule and every wait write into it, the
// host turns it into mok::Error at the next synchronising call (Workspace::check).
#pragma once

#include <cstdint>
#include <optional>

#include "mok/error.hpp"
#include "mok/shape.hpp"

namespace mok::comm {

// Which wait timed out (recorded with the rank, SM, expected and observed value).
enum class WaitSite : int32_t {
  kNone = 0,
  kPhaseBarrier = 1,   // a peer's epoch in this rank's flag slot (cross-GPU)
  kGroupArrive = 2,    // comm CTAs of this rank waiting for the group barrier to open
  kDispatchTile = 3,   // (unused since the fan-out dedup dispatch, which never waits; value kept stable)
  kCombineSource = 4,  // combine waiting for an expert-output row tile (GEMM 2)
  kReadyCounter = 5,   // a consumer waiting for a minibatch ready counter
  kTest = 6,           // tests that prove the timeout path
  kHiddenRowTile = 7,  // a GEMM 2 task waiting for every GEMM 1 column tile of its row tile
  // 8: a bulk-copy stage of the removed bulk copy engines (value kept free)
  kTokenArrivals = 9,  // the fused top-k sum waiting for the rows pushed into a token's slots
  kRingSlot = 10,      // macrobatch ring: a row tile waiting for the tile that last used its slot
};
const char* wait_site_name(WaitSite site);

// Routing errors are ordered by a 64-bit key so the reported one is the first bad entry of
// the global table, whatever the thread timing: key = item << 33 | kind << 32 | uint32(value),
// item = (src_rank * T + token) * K + k (< 2^30 by LayerShape::validate).
// kTokenCount: another rank's call carries a different number of tokens.
enum class RoutingErrorKind : uint32_t { kBadId = 0, kDuplicate = 1, kTokenCount = 2 };
inline constexpr unsigned long long kNoRoutingError = ~0ull;
// A non-finite router weight: key = (t * K + k) << 32 | the float's bits, the smallest entry of
// this rank's topk_w [T, K] reported (atomicMin), whatever the thread timing.
inline constexpr unsigned long long kNoWeightError = ~0ull;

struct DeviceErrorRecord {
  unsigned long long routing_key;  // kNoRoutingError, or the smallest bad entry's key: item << 34 | kind << 32 | value
  int32_t code;                    // mok::Status of the first other error (0 = none); CAS from 0
  int32_t site;                    // WaitSite for kTimeout
  int32_t rank;
  int32_t sm;
  int64_t expected;                // timeout: awaited value; overflow: Config::max_rows_per_rank
  int64_t observed;                // timeout: last value seen; overflow: real rows
  unsigned long long weight_key;   // kNoWeightError, or the first non-finite topk_w entry's key
};

// The record as it is right after reset (host memcpy source).
inline DeviceErrorRecord clean_error_record() {
  return DeviceErrorRecord{kNoRoutingError, 0, 0, -1, -1, 0, 0, kNoWeightError};
}

// Host: the mok::Error a record describes, or nothing when it is clean.
std::optional<Error> describe_device_error(const DeviceErrorRecord& rec, const LayerShape& shape,
                                           int rank);

}  // namespace mok::comm
