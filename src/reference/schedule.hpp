// The routing schedule of one pass (docs/comm.md), computed on the CPU for all `ep` simulated
// ranks at once. It is the reference for the GPU schedule: same canonical order, same padding,
// same placement by prefix sums.
//
// Canonical order: destination rank d owns experts [d*E_local, (d+1)*E_local). Its receive
// buffer is expert-major: the segment of local expert le holds every (source rank s, token t,
// slot k) with topk_idx_s[t,k] = d*E_local + le, sorted by global token id s*T + t ascending
// (a token lists an expert at most once, so k is then determined), followed by padding rows up
// to the next multiple of kRowTile. Segments of consecutive local experts are placed back to
// back (offsets are prefix sums of the padded counts); an expert with no rows has an empty
// segment.
#pragma once

#include <cstdint>
#include <vector>

#include "mok/config.hpp"
#include "mok/shape.hpp"

namespace mok::ref {

// One row of a receive buffer. Padding rows: src_rank = token = k = -1.
struct RowRef {
  int32_t src_rank = -1;
  int32_t token = -1;
  int32_t k = -1;
  bool is_padding() const { return src_rank < 0; }
  friend bool operator==(const RowRef&, const RowRef&) = default;
};

// The expert-major receive buffer of one destination rank.
struct RankSchedule {
  std::vector<int64_t> expert_offset;  // [E_local + 1] padded row offsets; segment e = [off[e], off[e+1])
  std::vector<int64_t> expert_rows;    // [E_local] real rows of each local expert (at the segment start)
  std::vector<RowRef> rows;            // [padded_rows] which (source rank, token, k) each row holds
  int64_t real_rows = 0;
  int64_t padded_rows = 0;
};

struct Schedule {
  std::vector<RankSchedule> ranks;             // [ep]
  std::vector<std::vector<int64_t>> dest_row;  // [ep][T*K]: row, in the owner rank's buffer, of (t, k) of source rank s
};

// Validates `topk_idx` ([ep][T*K], global expert ids) with mok::check_topk_idx for every rank
// and builds the schedule. Throws mok::Error(kInvalidArgument) for bad routing inputs and
// mok::Error(kCapacityOverflow) when a rank would receive more real rows than
// Config::max_rows_per_rank(shape).
Schedule make_schedule(const LayerShape& shape, const Config& config,
                       const std::vector<std::vector<int32_t>>& topk_idx);

// The global token ids (s*T + t) of the rows of global expert `expert`, in buffer order
// (real rows only). Lets tests compare schedules across different ep splits.
std::vector<int64_t> expert_global_tokens(const LayerShape& shape, const Schedule& schedule,
                                          int64_t expert);

}  // namespace mok::ref
