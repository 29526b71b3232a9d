// The reference routing schedule (src/reference/schedule.hpp): hand-built cases with exact
// offsets, rows and dest_row; canonical order and padding on random routing; empty experts;
// every token on one expert; capacity overflow; the same per-expert row lists for ep = 1, 2, 4.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "mok/error.hpp"
#include "reference/schedule.hpp"

namespace mok::ref {
namespace {

using Routing = std::vector<std::vector<int32_t>>;

LayerShape small_shape(int64_t tokens, int64_t experts, int topk, int ep) {
  LayerShape s;
  s.tokens = tokens;
  s.hidden = 64;
  s.intermediate = 64;
  s.experts = experts;
  s.topk = topk;
  s.ep = ep;
  return s;
}

Config roomy_config(int ep) {
  Config c;
  c.capacity = ep;  // overflow impossible
  return c;
}

// Global routing of `tokens` tokens, K distinct random experts each.
std::vector<int32_t> random_routing(int64_t tokens, int64_t experts, int topk, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> out;
  std::vector<int32_t> ids(experts);
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(ids.begin(), ids.end(), 0);
    for (int k = 0; k < topk; ++k) {
      std::uniform_int_distribution<int64_t> pick(k, experts - 1);
      std::swap(ids[k], ids[pick(rng)]);
      out.push_back(ids[k]);
    }
  }
  return out;
}

Routing split(const std::vector<int32_t>& global, int ep) {
  const size_t per = global.size() / ep;
  Routing out(ep);
  for (int r = 0; r < ep; ++r) out[r].assign(global.begin() + r * per, global.begin() + (r + 1) * per);
  return out;
}

// Structural invariants every schedule must satisfy.
void expect_well_formed(const LayerShape& shape, const Routing& topk, const Schedule& s) {
  const int64_t e_local = shape.local_experts();
  ASSERT_EQ(s.ranks.size(), static_cast<size_t>(shape.ep));
  for (int d = 0; d < shape.ep; ++d) {
    const RankSchedule& rs = s.ranks[d];
    ASSERT_EQ(rs.expert_offset.size(), static_cast<size_t>(e_local + 1));
    EXPECT_EQ(rs.expert_offset[0], 0);
    int64_t real = 0;
    for (int64_t le = 0; le < e_local; ++le) {
      const int64_t off = rs.expert_offset[le], n = rs.expert_rows[le];
      const int64_t len = rs.expert_offset[le + 1] - off;
      EXPECT_EQ(len % kRowTile, 0);
      EXPECT_EQ(len, (n + kRowTile - 1) / kRowTile * kRowTile) << "rank " << d << " expert " << le;
      real += n;
      for (int64_t i = 0; i < len; ++i) {
        const RowRef& row = rs.rows[off + i];
        if (i >= n) {
          EXPECT_TRUE(row.is_padding()) << "rank " << d << " row " << off + i;
          EXPECT_EQ(row, (RowRef{-1, -1, -1}));
          continue;
        }
        ASSERT_FALSE(row.is_padding()) << "rank " << d << " row " << off + i;
        EXPECT_EQ(topk[row.src_rank][row.token * shape.topk + row.k], d * e_local + le);
        EXPECT_EQ(s.dest_row[row.src_rank][row.token * shape.topk + row.k], off + i);
        if (i > 0) {  // canonical order: global token id strictly ascending
          const RowRef& prev = rs.rows[off + i - 1];
          EXPECT_LT(int64_t{prev.src_rank} * shape.tokens + prev.token,
                    int64_t{row.src_rank} * shape.tokens + row.token);
        }
      }
    }
    EXPECT_EQ(rs.real_rows, real);
    EXPECT_EQ(rs.padded_rows, rs.expert_offset[e_local]);
    EXPECT_EQ(rs.rows.size(), static_cast<size_t>(rs.padded_rows));
  }
  // Every (s, t, k) lands on its expert's owner exactly once (dest_row is a bijection).
  for (int src = 0; src < shape.ep; ++src) {
    for (int64_t i = 0; i < shape.tokens * shape.topk; ++i) {
      const int d = shape.owner_rank(topk[src][i]);
      const int64_t row = s.dest_row[src][i];
      ASSERT_GE(row, 0);
      ASSERT_LT(row, s.ranks[d].padded_rows);
      EXPECT_EQ(s.ranks[d].rows[row],
                (RowRef{src, static_cast<int32_t>(i / shape.topk), static_cast<int32_t>(i % shape.topk)}));
    }
  }
}

TEST(ReferenceSchedule, HandBuiltTwoRanks) {
  const LayerShape shape = small_shape(4, 4, 2, 2);  // E_local = 2
  const Routing topk = {{1, 0, 3, 1, 0, 2, 1, 3},   // rank 0: t0 {1,0} t1 {3,1} t2 {0,2} t3 {1,3}
                        {2, 0, 1, 2, 0, 1, 3, 2}};  // rank 1: t0 {2,0} t1 {1,2} t2 {0,1} t3 {3,2}
  const Schedule s = make_schedule(shape, Config{}, topk);
  expect_well_formed(shape, topk, s);

  // Rank 0 holds experts 0 (4 rows) and 1 (5 rows); rank 1 experts 2 (4 rows) and 3 (3 rows).
  EXPECT_EQ(s.ranks[0].expert_offset, (std::vector<int64_t>{0, 128, 256}));
  EXPECT_EQ(s.ranks[0].expert_rows, (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(s.ranks[1].expert_offset, (std::vector<int64_t>{0, 128, 256}));
  EXPECT_EQ(s.ranks[1].expert_rows, (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(s.ranks[0].real_rows, 9);
  EXPECT_EQ(s.ranks[1].real_rows, 7);
  EXPECT_EQ(s.ranks[0].padded_rows, 256);

  const std::vector<RowRef> e0 = {{0, 0, 1}, {0, 2, 0}, {1, 0, 1}, {1, 2, 0}};
  const std::vector<RowRef> e1 = {{0, 0, 0}, {0, 1, 1}, {0, 3, 0}, {1, 1, 0}, {1, 2, 1}};
  const std::vector<RowRef> e2 = {{0, 2, 1}, {1, 0, 0}, {1, 1, 1}, {1, 3, 1}};
  const std::vector<RowRef> e3 = {{0, 1, 0}, {0, 3, 1}, {1, 3, 0}};
  auto segment = [&](int d, int64_t start, size_t n) {
    return std::vector<RowRef>(s.ranks[d].rows.begin() + start, s.ranks[d].rows.begin() + start + n);
  };
  EXPECT_EQ(segment(0, 0, 4), e0);
  EXPECT_EQ(segment(0, 128, 5), e1);
  EXPECT_EQ(segment(1, 0, 4), e2);
  EXPECT_EQ(segment(1, 128, 3), e3);
  EXPECT_TRUE(s.ranks[0].rows[4].is_padding());
  EXPECT_TRUE(s.ranks[1].rows[255].is_padding());

  EXPECT_EQ(s.dest_row[0], (std::vector<int64_t>{128, 0, 128, 129, 1, 0, 130, 129}));
  EXPECT_EQ(s.dest_row[1], (std::vector<int64_t>{1, 2, 131, 2, 3, 132, 130, 3}));
  EXPECT_EQ(expert_global_tokens(shape, s, 1), (std::vector<int64_t>{0, 1, 3, 5, 6}));
}

TEST(ReferenceSchedule, EmptyExpertsHaveEmptySegments) {
  const LayerShape shape = small_shape(4, 4, 2, 1);
  const Routing topk = {{0, 2, 2, 0, 0, 2, 2, 0}};  // experts 1 and 3 receive nothing
  const Schedule s = make_schedule(shape, Config{}, topk);
  expect_well_formed(shape, topk, s);
  EXPECT_EQ(s.ranks[0].expert_offset, (std::vector<int64_t>{0, 128, 128, 256, 256}));
  EXPECT_EQ(s.ranks[0].expert_rows, (std::vector<int64_t>{4, 0, 4, 0}));
  EXPECT_EQ(s.ranks[0].rows[0], (RowRef{0, 0, 0}));
  EXPECT_EQ(s.ranks[0].rows[1], (RowRef{0, 1, 1}));
  EXPECT_EQ(s.ranks[0].rows[128], (RowRef{0, 0, 1}));
  EXPECT_EQ(s.ranks[0].rows[129], (RowRef{0, 1, 0}));
}

TEST(ReferenceSchedule, AllTokensToOneExpert) {
  const LayerShape shape = small_shape(300, 2, 1, 2);  // T not a multiple of the row tile
  const Routing topk = {std::vector<int32_t>(300, 0), std::vector<int32_t>(300, 0)};
  const Schedule s = make_schedule(shape, roomy_config(2), topk);
  expect_well_formed(shape, topk, s);
  EXPECT_EQ(s.ranks[0].expert_offset, (std::vector<int64_t>{0, 640}));
  EXPECT_EQ(s.ranks[0].real_rows, 600);
  EXPECT_EQ(s.ranks[1].expert_offset, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(s.ranks[1].padded_rows, 0);
  for (int64_t i = 0; i < 600; ++i) {
    ASSERT_EQ(s.ranks[0].rows[i], (RowRef{static_cast<int32_t>(i / 300), static_cast<int32_t>(i % 300), 0}));
  }
  EXPECT_EQ(s.dest_row[1][7], 307);
}

TEST(ReferenceSchedule, RandomRoutingIsCanonicalAndPadded) {
  for (int ep : {1, 2, 4}) {
    const LayerShape shape = small_shape(333, 16, 4, ep);
    const Routing topk = split(random_routing(333 * ep, 16, 4, 7 + ep), ep);
    const Schedule s = make_schedule(shape, roomy_config(ep), topk);
    SCOPED_TRACE("ep " + std::to_string(ep));
    expect_well_formed(shape, topk, s);
  }
}

TEST(ReferenceSchedule, CapacityOverflowNamesRankAndCapacity) {
  const LayerShape shape = small_shape(128, 4, 2, 2);
  Config config;
  config.capacity = 1.0;  // at most T*K = 256 real rows per rank
  Routing topk(2);
  for (int r = 0; r < 2; ++r) {
    for (int64_t t = 0; t < 128; ++t) {
      topk[r].push_back(0);  // every token to experts 0 and 1, both on rank 0: 512 rows
      topk[r].push_back(1);
    }
  }
  try {
    make_schedule(shape, config, topk);
    FAIL() << "expected kCapacityOverflow";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kCapacityOverflow);
    const std::string msg = e.what();
    EXPECT_NE(msg.find("rank 0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("512"), std::string::npos) << msg;
    EXPECT_NE(msg.find("256"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Config::capacity"), std::string::npos) << msg;
  }
  config.capacity = 2.0;  // the same routing fits
  EXPECT_NO_THROW(make_schedule(shape, config, topk));

  // Exactly at the limit is allowed: rank 0 receives 256 rows with capacity 1.
  config.capacity = 1.0;
  for (int64_t t = 0; t < 128; ++t) {
    topk[1][2 * t] = 2;
    topk[1][2 * t + 1] = 3;
  }
  EXPECT_NO_THROW(make_schedule(shape, config, topk));
}

// Expert e's row list, as global token ids and k, is the same whatever the ep split.
TEST(ReferenceSchedule, SameRowListsForEp124) {
  const int64_t global_tokens = 256;
  const int64_t experts = 8;
  const int topk = 3;
  const std::vector<int32_t> routing = random_routing(global_tokens, experts, topk, 42);
  std::vector<std::vector<std::pair<int64_t, int32_t>>> reference;
  for (int ep : {1, 2, 4}) {
    const LayerShape shape = small_shape(global_tokens / ep, experts, topk, ep);
    const Routing per_rank = split(routing, ep);
    const Schedule s = make_schedule(shape, roomy_config(ep), per_rank);
    expect_well_formed(shape, per_rank, s);
    std::vector<std::vector<std::pair<int64_t, int32_t>>> lists(experts);
    for (int64_t e = 0; e < experts; ++e) {
      const int d = shape.owner_rank(e);
      const int64_t le = e - d * shape.local_experts();
      const RankSchedule& rs = s.ranks[d];
      for (int64_t i = 0; i < rs.expert_rows[le]; ++i) {
        const RowRef& row = rs.rows[rs.expert_offset[le] + i];
        lists[e].emplace_back(int64_t{row.src_rank} * shape.tokens + row.token, row.k);
      }
      EXPECT_EQ(expert_global_tokens(shape, s, e).size(), lists[e].size());
    }
    if (reference.empty()) {
      reference = lists;
    } else {
      for (int64_t e = 0; e < experts; ++e) EXPECT_EQ(lists[e], reference[e]) << "ep " << ep << " expert " << e;
    }
  }
}

TEST(ReferenceSchedule, RejectsBadRoutingInputs) {
  const LayerShape shape = small_shape(4, 4, 2, 2);
  Routing topk = {{1, 0, 3, 1, 0, 2, 1, 3}, {2, 0, 1, 2, 0, 1, 3, 2}};
  topk[1][5] = 4;  // out of range
  try {
    make_schedule(shape, Config{}, topk);
    FAIL() << "expected kInvalidArgument";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("topk_idx[rank 1"), std::string::npos) << e.what();
  }
  topk[1].pop_back();  // wrong size
  try {
    make_schedule(shape, Config{}, topk);
    FAIL() << "expected kInvalidArgument";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("topk_idx[rank 1]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(make_schedule(shape, Config{}, Routing(1)), Error);  // one vector for two ranks
}

}  // namespace
}  // namespace mok::ref
