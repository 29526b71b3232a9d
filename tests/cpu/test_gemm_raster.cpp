// The GEMM tile rasters (src/gemm/raster.hpp) are permutations of their block: every tile is
// computed exactly once, whatever the segment table. The expert-aligned raster additionally
// keeps each group inside one expert and visits the row tiles of a group fastest.
#include <gtest/gtest.h>

#include <random>
#include <set>
#include <vector>

#include "gemm/raster.hpp"

namespace {

using mok::gemm::kRowTileRows;

// Offsets (rows, multiples of 128) for per-expert row-tile counts.
std::vector<int32_t> offsets_of(const std::vector<int>& tiles) {
  std::vector<int32_t> off{0};
  for (int t : tiles) off.push_back(off.back() + t * kRowTileRows);
  return off;
}

void check_expert_groups(const std::vector<int>& tiles, int first, int count, int n_tiles, int group) {
  const std::vector<int32_t> off = offsets_of(tiles);
  const int experts = static_cast<int>(tiles.size());
  std::set<std::pair<int, int>> seen;
  int prev_rt = -1, prev_n = -1;
  for (int l = 0; l < count * n_tiles; ++l) {
    int rt = -1, n = -1;
    mok::gemm::raster_expert_groups(l, first, count, n_tiles, group, off.data(), experts, rt, n);
    ASSERT_GE(rt, first) << "l=" << l;
    ASSERT_LT(rt, first + count) << "l=" << l;
    ASSERT_GE(n, 0);
    ASSERT_LT(n, n_tiles);
    ASSERT_TRUE(seen.insert({rt, n}).second) << "tile (" << rt << ", " << n << ") twice, l=" << l;
    if (n_tiles == 1) EXPECT_EQ(rt, first + l);  // one column block: the row tiles in order
    if (l > 0 && n_tiles > 1 && n == prev_n) {
      // Same column block twice in a row happens only inside a group, stepping through the
      // row tiles of one expert.
      const int e0 = mok::gemm::expert_of_row_tile(off.data(), experts, prev_rt);
      const int e1 = mok::gemm::expert_of_row_tile(off.data(), experts, rt);
      EXPECT_EQ(e0, e1) << "group spans experts at l=" << l;
      EXPECT_EQ(rt, prev_rt + 1) << "l=" << l;
    }
    prev_rt = rt;
    prev_n = n;
  }
  EXPECT_EQ(static_cast<int>(seen.size()), count * n_tiles);
}

TEST(GemmRaster, GlobalGroupsArePermutations) {
  for (int m_tiles : {1, 5, 8, 13, 64}) {
    for (int n_tiles : {1, 3, 16}) {
      for (int group : {1, 4, 8}) {
        std::set<std::pair<int, int>> seen;
        for (int l = 0; l < m_tiles * n_tiles; ++l) {
          int m, n;
          mok::gemm::raster_group(l, m_tiles, n_tiles, group, m, n);
          ASSERT_TRUE(m >= 0 && m < m_tiles && n >= 0 && n < n_tiles);
          ASSERT_TRUE(seen.insert({m, n}).second);
        }
      }
    }
  }
}

TEST(GemmRaster, ExpertGroupsUniformSegments) { check_expert_groups({4, 4, 4, 4}, 0, 16, 16, 8); }

TEST(GemmRaster, ExpertGroupsEmptyAndHugeExperts) {
  check_expert_groups({0, 3, 0, 0, 1, 21, 0, 2, 0}, 0, 27, 5, 8);
  check_expert_groups({0, 0, 1}, 0, 1, 28, 8);
  check_expert_groups({30}, 0, 30, 3, 8);
}

TEST(GemmRaster, ExpertGroupsMinibatchWindows) {
  // The fused forward's minibatches are windows of global row tiles that cut experts.
  const std::vector<int> tiles{5, 4, 0, 6, 3, 5, 4, 9, 1};
  const int total = 37;
  for (int mb : {1, 3, 4, 8, 16}) {
    for (int first = 0; first < total; first += mb) check_expert_groups(tiles, first, std::min(mb, total - first), 7, 8);
  }
}

TEST(GemmRaster, ExpertGroupsRandomTables) {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 200; ++trial) {
    const int experts = 1 + static_cast<int>(rng() % 40);
    std::vector<int> tiles(experts);
    int total = 0;
    for (int& t : tiles) {
      t = rng() % 4 == 0 ? 0 : static_cast<int>(rng() % 12);
      total += t;
    }
    if (total == 0) continue;
    const int group = 1 + static_cast<int>(rng() % 10);
    const int n_tiles = 1 + static_cast<int>(rng() % 20);
    const int first = static_cast<int>(rng() % total);
    const int count = 1 + static_cast<int>(rng() % (total - first));
    check_expert_groups(tiles, first, count, n_tiles, group);
  }
}

}  // namespace
