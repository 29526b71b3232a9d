// Tile rasters of the grouped GEMMs and the fused forward's task list: which (row tile,
// column block) the l-th tile of a block is. Host-callable too, so the CPU tests can check
// that every raster is a permutation of its block.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MOK_GEMM_HD __host__ __device__
#else
#define MOK_GEMM_HD
#endif

namespace mok::gemm {

inline constexpr int kRowTileRows = 128;  // == mok::kRowTile: segment padding and tile M

MOK_GEMM_HD constexpr int imin(int a, int b) { return a < b ? a : b; }
MOK_GEMM_HD constexpr int imax(int a, int b) { return a < b ? b : a; }

// Read-only load of the device segment table (through the non-coherent cache on the GPU).
MOK_GEMM_HD inline int32_t load_ro(const int32_t* p) {
#if defined(__CUDA_ARCH__)
  return __ldg(p);
#else
  return *p;
#endif
}

// Local index l of a tile inside a block of m_tiles x n_tiles tiles -> (m, n), visiting
// groups of `group` row tiles and, inside a group, row tiles fastest: the CTAs working at
// the same time share their B (weight) column block and a small set of A row tiles in L2.
MOK_GEMM_HD inline void raster_group(int l, int m_tiles, int n_tiles, int group, int& m, int& n) {
  const int g = l / (group * n_tiles);
  const int rows_in_group = imin(group, m_tiles - g * group);
  const int r = l - g * group * n_tiles;
  n = r / rows_in_group;
  m = g * group + r % rows_in_group;
}

// Entry i of a segment-offsets table in memory (the kernels may pass other loaders, e.g. one
// reading a shared-memory copy: gemm::SegOffsets).
struct OffsetsPtr {
  const int32_t* p;
  MOK_GEMM_HD int32_t operator()(int i) const { return load_ro(p + i); }
};

// Last expert whose segment (offsets in rows, multiples of 128) starts at or before global
// row tile rt; empty segments are skipped because a later expert with the same start wins.
template <class Offsets>
MOK_GEMM_HD inline int expert_of_row_tile(const Offsets& off, int experts, int rt) {
  int lo = 0, hi = experts;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (off(mid) / kRowTileRows <= rt) lo = mid; else hi = mid;
  }
  return lo;
}
MOK_GEMM_HD inline int expert_of_row_tile(const int32_t* offsets, int experts, int rt) {
  return expert_of_row_tile(OffsetsPtr{offsets}, experts, rt);
}

// Expert-aligned raster over the global row tiles [first, first + count) of an expert-major
// buffer: like raster_group, but a group never spans two experts (an expert's row tiles in
// the range form groups of at most `group`). The CTAs working on a group at the same time
// then share one expert's weight column block, and a weight block streams from memory once
// per group, instead of once more for every expert that straddles a group boundary (with
// routed segment lengths most do). Group [g0, g0 + rows) holds tasks
// [(g0 - first) * n_tiles, (g0 - first + rows) * n_tiles), so first + l / n_tiles is a row
// tile of task l's group.
template <class Offsets>
MOK_GEMM_HD inline void raster_expert_groups(int l, int first, int count, int n_tiles, int group,
                                             const Offsets& off, int experts, int& rt, int& n) {
  const int q = first + l / n_tiles;
  const int e = expert_of_row_tile(off, experts, q);
  const int seg_lo = imax(first, off(e) / kRowTileRows);
  const int seg_hi = imin(first + count, off(e + 1) / kRowTileRows);
  const int g0 = seg_lo + (q - seg_lo) / group * group;
  const int rows = imin(group, seg_hi - g0);
  const int local = l - (g0 - first) * n_tiles;
  n = local / rows;
  rt = g0 + local % rows;
}
MOK_GEMM_HD inline void raster_expert_groups(int l, int first, int count, int n_tiles, int group,
                                             const int32_t* offsets, int experts, int& rt, int& n) {
  raster_expert_groups(l, first, count, n_tiles, group, OffsetsPtr{offsets}, experts, rt, n);
}

}  // namespace mok::gemm
