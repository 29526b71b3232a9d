// CPU reference of the routing schedule (see schedule.hpp for the canonical order).
// Counting pass, prefix sums over padded counts, then a fill pass in global token order:
// placement never depends on anything but the routing table.
#include "reference/schedule.hpp"

#include <sstream>
#include <string>

#include "common/routing_checks.hpp"
#include "mok/error.hpp"

namespace mok::ref {
namespace {

int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

void check_topk_idx_sizes(const LayerShape& shape,
                          const std::vector<std::vector<int32_t>>& topk_idx) {
  if (topk_idx.size() != static_cast<size_t>(shape.ep)) {
    throw_invalid("topk_idx", "one vector per rank (ep = " + std::to_string(shape.ep) + ")",
                  std::to_string(topk_idx.size()) + " vectors");
  }
  const int64_t expected = shape.tokens * shape.topk;
  for (int r = 0; r < shape.ep; ++r) {
    const int64_t got = static_cast<int64_t>(topk_idx[r].size());
    if (got != expected) {
      throw_invalid("topk_idx[rank " + std::to_string(r) + "]",
                    "T*K = " + std::to_string(expected) + " elements",
                    std::to_string(got));
    }
  }
}

std::string format_number(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

// Real rows each destination rank receives; throws kCapacityOverflow past the capacity.
void check_capacity(const LayerShape& shape, const Config& config, const Schedule& schedule) {
  const int64_t allowed = config.max_rows_per_rank(shape);
  for (int d = 0; d < shape.ep; ++d) {
    const int64_t rows = schedule.ranks[d].real_rows;
    if (rows > allowed) {
      throw Error(Status::kCapacityOverflow,
                  "capacity overflow: rank " + std::to_string(d) + " receives " +
                      std::to_string(rows) + " routed rows, more than Config::max_rows_per_rank = " +
                      std::to_string(allowed) + " (capacity " + format_number(config.capacity) +
                      " x T*K = " + std::to_string(shape.tokens * shape.topk) +
                      "); raise Config::capacity (values >= ep = " + std::to_string(shape.ep) +
                      " make overflow impossible)");
    }
  }
}

}  // namespace

Schedule make_schedule(const LayerShape& shape, const Config& config,
                       const std::vector<std::vector<int32_t>>& topk_idx) {
  shape.validate();
  config.validate(shape);
  check_topk_idx_sizes(shape, topk_idx);
  for (int r = 0; r < shape.ep; ++r) {
    check_topk_idx(shape, r, std::span<const int32_t>(topk_idx[r]));
  }

  const int ep = shape.ep;
  const int64_t T = shape.tokens;
  const int K = shape.topk;
  const int64_t e_local = shape.local_experts();

  Schedule schedule;
  schedule.ranks.resize(ep);
  schedule.dest_row.assign(ep, std::vector<int64_t>(T * K, -1));

  // 1. Count the real rows of every expert.
  std::vector<int64_t> count(shape.experts, 0);
  for (int s = 0; s < ep; ++s) {
    for (int32_t e : topk_idx[s]) ++count[e];
  }
  // 2. Per destination rank: prefix sums over the padded counts.
  for (int d = 0; d < ep; ++d) {
    RankSchedule& rs = schedule.ranks[d];
    rs.expert_offset.assign(e_local + 1, 0);
    rs.expert_rows.assign(e_local, 0);
    for (int64_t le = 0; le < e_local; ++le) {
      const int64_t n = count[d * e_local + le];
      rs.expert_rows[le] = n;
      rs.real_rows += n;
      rs.expert_offset[le + 1] = rs.expert_offset[le] + round_up(n, kRowTile);
    }
    rs.padded_rows = rs.expert_offset[e_local];
  }
  check_capacity(shape, config, schedule);

  // 3. Fill in global token order; padding rows stay RowRef{} (all -1).
  for (int d = 0; d < ep; ++d) schedule.ranks[d].rows.assign(schedule.ranks[d].padded_rows, RowRef{});
  std::vector<int64_t> cursor(shape.experts, 0);
  for (int s = 0; s < ep; ++s) {
    for (int64_t t = 0; t < T; ++t) {
      for (int k = 0; k < K; ++k) {
        const int32_t e = topk_idx[s][t * K + k];
        const int d = shape.owner_rank(e);
        RankSchedule& rs = schedule.ranks[d];
        const int64_t row = rs.expert_offset[e - d * e_local] + cursor[e]++;
        rs.rows[row] = RowRef{s, static_cast<int32_t>(t), k};
        schedule.dest_row[s][t * K + k] = row;
      }
    }
  }

  // The padded buffer must fit the workspace the GPU engine allocates for this config.
  const int64_t buffer_rows = config.buffer_rows_per_rank(shape);
  for (int d = 0; d < ep; ++d) {
    if (schedule.ranks[d].padded_rows > buffer_rows) {
      throw Error(Status::kInternal,
                  "reference schedule: rank " + std::to_string(d) + " needs " +
                      std::to_string(schedule.ranks[d].padded_rows) +
                      " padded rows but Config::buffer_rows_per_rank = " +
                      std::to_string(buffer_rows));
    }
  }
  return schedule;
}

std::vector<int64_t> expert_global_tokens(const LayerShape& shape, const Schedule& schedule,
                                          int64_t expert) {
  const int d = shape.owner_rank(expert);
  const int64_t le = expert - d * shape.local_experts();
  const RankSchedule& rs = schedule.ranks.at(d);
  std::vector<int64_t> tokens;
  for (int64_t i = 0; i < rs.expert_rows[le]; ++i) {
    const RowRef& row = rs.rows[rs.expert_offset[le] + i];
    tokens.push_back(static_cast<int64_t>(row.src_rank) * shape.tokens + row.token);
  }
  return tokens;
}

}  // namespace mok::ref
