#include "comm/error_record.hpp"

#include <cmath>
#include <cstring>
#include <string>

namespace mok::comm {

const char* wait_site_name(WaitSite site) {
  switch (site) {
    case WaitSite::kNone: return "none";
    case WaitSite::kPhaseBarrier: return "phase barrier (a peer's epoch flag)";
    case WaitSite::kGroupArrive: return "group barrier of the communication CTAs";
    case WaitSite::kDispatchTile: return "dedup dispatch (an earlier row tile of this rank)";
    case WaitSite::kCombineSource: return "combine (an expert-output row tile)";
    case WaitSite::kReadyCounter: return "minibatch ready counter";
    case WaitSite::kTest: return "test flag";
    case WaitSite::kHiddenRowTile: return "GEMM 1 tiles of a hidden row tile (fused forward)";
    case WaitSite::kTokenArrivals: return "rows pushed into a token's combine slots (fused top-k sum)";
    case WaitSite::kRingSlot: return "macrobatch ring slot (the row tile that used it last, fused forward)";
  }
  return "unknown wait";
}

std::optional<Error> describe_device_error(const DeviceErrorRecord& rec, const LayerShape& shape, int rank) {
  const std::string on = "GPU schedule on rank " + std::to_string(rank) + ": ";
  if (rec.routing_key != kNoRoutingError) {
    const int64_t item = static_cast<int64_t>(rec.routing_key >> 34);
    const auto kind = static_cast<RoutingErrorKind>((rec.routing_key >> 32) & 3u);
    const int32_t value = static_cast<int32_t>(static_cast<uint32_t>(rec.routing_key & 0xffffffffu));
    const int64_t global_token = item / shape.topk;
    const std::string where = "topk_idx[rank " + std::to_string(global_token / shape.tokens) + ", token " +
                              std::to_string(global_token % shape.tokens) + ", k " +
                              std::to_string(item % shape.topk) + "]";
    if (kind == RoutingErrorKind::kTokenCount) {
      return Error(Status::kInvalidArgument,
                   on + "rank " + std::to_string(global_token / shape.tokens) +
                       " called mok::schedule with another token count than this rank: expected the same "
                       "tokens on every rank (T different across ranks; the schedule is poisoned until the next "
                       "mok::schedule)");
    }
    const std::string expected =
        kind == RoutingErrorKind::kBadId
            ? "an expert id in [0, " + std::to_string(shape.experts) + ")"
            : "distinct experts within one token (expert " + std::to_string(value) + " already appears at an earlier k)";
    return Error(Status::kInvalidArgument,
                 on + where + ": expected " + expected + ", got " + std::to_string(value) +
                     " (the schedule is poisoned until the next mok::schedule)");
  }
  if (rec.weight_key != kNoWeightError) {
    const int64_t item = static_cast<int64_t>(rec.weight_key >> 32);
    const uint32_t bits = static_cast<uint32_t>(rec.weight_key & 0xffffffffu);
    float w;
    std::memcpy(&w, &bits, sizeof(w));
    return Error(Status::kInvalidArgument,
                 "mok: rank " + std::to_string(rank) + ": topk_w[token " + std::to_string(item / shape.topk) + ", k " +
                     std::to_string(item % shape.topk) + "]: expected a finite router weight, got " +
                     (std::isnan(w) ? std::string("nan") : std::string(w > 0 ? "inf" : "-inf")) +
                     " (y is NaN-poisoned)");
  }
  switch (static_cast<Status>(rec.code)) {
    case Status::kOk: return std::nullopt;
    case Status::kCapacityOverflow:
      return Error(Status::kCapacityOverflow,
                   on + "capacity overflow: rank " + std::to_string(rec.rank) + " receives " +
                       std::to_string(rec.observed) + " routed rows, more than Config::max_rows_per_rank = " +
                       std::to_string(rec.expected) + " (T*K = " + std::to_string(shape.tokens * shape.topk) +
                       "); raise Config::capacity (values >= ep = " + std::to_string(shape.ep) +
                       " make overflow impossible). The schedule is poisoned until the next mok::schedule");
    case Status::kTimeout:
      return Error(Status::kTimeout,
                   "mok: wait timed out on rank " + std::to_string(rec.rank) + ", SM " + std::to_string(rec.sm) +
                       ", at the " + wait_site_name(static_cast<WaitSite>(rec.site)) + ": expected a value >= " +
                       std::to_string(rec.expected) + ", last saw " + std::to_string(rec.observed) +
                       " after Config::wait_timeout_s. A peer rank died, is stuck, or did not issue the same "
                       "sequence of mok calls; the workspace must be recreated");
    default:
      return Error(Status::kInternal, "mok: device error record holds unknown code " + std::to_string(rec.code));
  }
}

}  // namespace mok::comm
