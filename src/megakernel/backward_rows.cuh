// Per-row device steps of the backward shared by its two paths (staged_backward.cu's launches,
// fused_backward.cu's communication CTAs), so that both give the same bits.
#pragma once

#include <cstdint>

#include "comm/peer_map.hpp"
#include "comm/schedule.hpp"

namespace mok::megakernel {

// d topk_w of routed row `row` (a real row, entry e): its column-tile parts [row, col_tiles]
// summed in tile order, stored into the token owner's landing slot (t, k) of the window. The
// parts are read through L2 (ld.global.cg): the fused backward reads them right after the GEMM
// CTAs published the row's tile.
__device__ __forceinline__ void push_dtopk_row(const comm::RowEntry& e, int64_t row, const float* parts, int col_tiles,
                                               const comm::PeerMap& peers, size_t dtopk_offset, int topk) {
  float acc = 0.0f;
  for (int n = 0; n < col_tiles; ++n) acc += __ldcg(parts + row * col_tiles + n);
  reinterpret_cast<float*>(peers.base[e.src_rank] + dtopk_offset)[int64_t{e.token} * topk + e.k] = acc;
}

}  // namespace mok::megakernel
