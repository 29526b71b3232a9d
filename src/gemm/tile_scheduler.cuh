// Deterministic persistent tile order over expert segments. Every role of every CTA walks the
// same list (tile t = blockIdx.x, blockIdx.x + gridDim.x, ...), so no tile is handed out
// twice and no output element is written twice. The list depends only on the segment
// offsets (read from device memory, so a GPU-computed schedule needs no host sync); the grid
// size only changes which CTA computes a tile, never how, so results are grid-invariant.
#pragma once

#include <cstdint>

#include "gemm/raster.hpp"
#include "gemm/sm90_pipeline.cuh"

namespace mok::gemm {

inline constexpr int kKStepRows = 64;     // wgrad K step (rows) == TileConfig::kBK

// The segment offsets as the GEMM kernels read them: from a shared-memory copy when the
// kernel made one (`smem` = its 32-bit shared address, cache_segment_offsets in
// sm90_roles.cuh), else from the device array. A tile's coordinates are a chain of dependent
// loads of this table (binary search); from global memory that took ~2.6k cycles per tile.
struct SegOffsets {
  const int32_t* global;
  uint32_t smem;  // 0: no copy
  __device__ int32_t operator()(int i) const {
    if (smem != 0) {
      int32_t v;
      asm("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(smem + 4u * static_cast<uint32_t>(i)));
      return v;
    }
    return __ldg(global + i);
  }
};

// ---- Row-grouped GEMMs (forward, dgrad): M = the rows of each segment. ----
// The list is over units of `cluster` consecutive global row tiles x column blocks; CTA
// `rank` of a cluster takes row tile unit*cluster + rank. The two CTAs share (multicast) their
// B tile when both row tiles belong to the same expert.
struct RowTile {
  int expert;
  int row0;       // first buffer row of the tile (multiple of 128)
  int real_rows;  // rows [row0, row0 + real_rows) hold data; the rest of the tile is padding
  int n_tile;
  bool phantom;   // past the last segment (odd tile count): computed in lockstep, never stored
  bool shared_b;  // every CTA of the cluster needs the same B tile
  bool any_real;  // some CTA of the cluster has real rows: run the K loop
};

struct RowScheduler {
  const int32_t* offsets;  // device [experts + 1], multiples of 128, nondecreasing
  const int32_t* rows;     // device [experts], real rows per segment
  int experts;
  int n_tiles;  // output column blocks per row tile
  int group_m;  // row tiles per raster group
  int cluster;  // CTAs per cluster (1 or 2)

  __device__ SegOffsets seg(uint32_t smem = 0) const { return {offsets, smem}; }
  __device__ int first_row_tile(uint32_t smem = 0) const { return seg(smem)(0) / kRowTileRows; }
  __device__ int row_tiles(uint32_t smem = 0) const {
    return seg(smem)(experts) / kRowTileRows - first_row_tile(smem);
  }
  __device__ int num_tiles() const { return (row_tiles() + cluster - 1) / cluster * n_tiles; }

  __device__ int expert_of(int rt) const { return expert_of_row_tile(offsets, experts, rt); }

  // seg_smem: the shared-memory copy of the offsets, or 0 (SegOffsets).
  __device__ RowTile tile(int t, int rank, uint32_t seg_smem = 0) const {
    const SegOffsets off = seg(seg_smem);
    const int first = first_row_tile(seg_smem), total = row_tiles(seg_smem);
    int unit, n;
    raster_group(t, (total + cluster - 1) / cluster, n_tiles, max(group_m / cluster, 1), unit, n);
    RowTile tile{};
    int experts_seen[2] = {-1, -1};
    int real_sum = 0;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      if (c >= cluster) break;
      const int rt = first + unit * cluster + c;
      const bool valid = rt - first < total;
      const int e = valid ? expert_of_row_tile(off, experts, rt) : 0;
      const int real = valid ? min(max(__ldg(rows + e) - (rt * kRowTileRows - off(e)), 0), kRowTileRows) : 0;
      experts_seen[c] = valid ? e : -1 - c;
      real_sum += real;
      if (c == rank) {
        tile.expert = e;
        tile.row0 = rt * kRowTileRows;
        tile.real_rows = real;
        tile.phantom = !valid;
      }
    }
    tile.n_tile = n;
    tile.shared_b = cluster > 1 && experts_seen[0] == experts_seen[1];
    tile.any_real = real_sum > 0;
    return tile;
  }
};

// ---- K-grouped GEMMs (wgrad): the reduction runs over each segment's rows. ----
inline constexpr int kMaxWgradProblems = 3;

struct KTile {
  int problem;
  int expert;
  int m_tile;
  int n_tile;
  int row0;      // first row of the reduction (segment start + row_begin)
  int k_steps;   // 64-row K steps, row-ordered from row0
  bool phantom;  // m tile past M (odd m-tile count in a cluster): computed, never stored
  bool shared_b;
};

// Units: (problem, expert, m-tile group of `cluster`, n); CTA `rank` takes m = unit_m*cluster
// + rank. Both CTAs of a cluster share the expert and the n tile, hence the B tile.
struct KGroupedScheduler {
  const int32_t* offsets;
  const int32_t* rows;
  const int32_t* row_begin;  // device [experts] relative to the segment start, or nullptr = 0
  const int32_t* row_end;    // device [experts], or nullptr = segment end
  int experts;
  int num_problems;
  int m_tiles[kMaxWgradProblems];
  int n_tiles[kMaxWgradProblems];
  int group_m;
  int cluster;

  __device__ int m_units(int p) const { return (m_tiles[p] + cluster - 1) / cluster; }
  __device__ int num_tiles() const {
    int total = 0;
#pragma unroll
    for (int p = 0; p < kMaxWgradProblems; ++p) total += p < num_problems ? experts * m_units(p) * n_tiles[p] : 0;
    return total;
  }

  // The row range [row0, row0 + 64*k_steps) of expert e: the caller's [begin, end) clipped
  // to the segment and to its real rows rounded up to the K step. The clip depends only on
  // the row index (padding rows are zero by contract), so splitting a range over several
  // calls visits exactly the same K steps in the same order as one call.
  __device__ void k_range(int e, int& row0, int& k_steps, uint32_t seg_smem = 0) const {
    const SegOffsets off{offsets, seg_smem};
    const int seg_begin = off(e);
    const int seg_len = off(e + 1) - seg_begin;
    const int begin = row_begin != nullptr ? __ldg(row_begin + e) : 0;
    int end = row_end != nullptr ? __ldg(row_end + e) : seg_len;
    const int real_end = (__ldg(rows + e) + kKStepRows - 1) / kKStepRows * kKStepRows;
    end = min(end, min(seg_len, real_end));
    row0 = seg_begin + begin;
    k_steps = end > begin ? (end - begin + kKStepRows - 1) / kKStepRows : 0;
  }

  // The caller's row range must step in whole 64-row blocks from the segment start (the
  // producer checks; a trap reachable from the consumer path makes ptxas serialise wgmma).
  __device__ void check_range(int e, const ErrorSink& err) const {
    const int seg_len = __ldg(offsets + e + 1) - __ldg(offsets + e);
    const int begin = row_begin != nullptr ? __ldg(row_begin + e) : 0;
    const int end = row_end != nullptr ? __ldg(row_end + e) : seg_len;
    const bool bad = begin < 0 || begin % kKStepRows != 0 || (end < seg_len && end % kKStepRows != 0);
    // Recorded only (no trap: see above); the results of such a call are unspecified.
    if (bad && err.flag != nullptr) atomicOr(err.flag, kErrorBadRowRange);
  }

  __device__ KTile tile(int t, int rank, uint32_t seg_smem = 0) const {
    // Static indices only (a dynamically indexed array would live in local memory).
    int p = 0, mu = m_units(0), mt = m_tiles[0], nt = n_tiles[0];
#pragma unroll
    for (int q = 0; q + 1 < kMaxWgradProblems; ++q) {
      const int count = experts * mu * nt;
      if (p == q && q + 1 < num_problems && t >= count) {
        t -= count;
        p = q + 1;
        mu = m_units(q + 1);
        mt = m_tiles[q + 1];
        nt = n_tiles[q + 1];
      }
    }
    const int per_expert = mu * nt;
    KTile tile;
    tile.problem = p;
    tile.expert = t / per_expert;
    int unit;
    raster_group(t - tile.expert * per_expert, mu, nt, max(group_m / cluster, 1), unit, tile.n_tile);
    tile.m_tile = unit * cluster + rank;
    tile.phantom = tile.m_tile >= mt;
    tile.shared_b = cluster > 1;
    k_range(tile.expert, tile.row0, tile.k_steps, seg_smem);
    return tile;
  }
};

}  // namespace mok::gemm
