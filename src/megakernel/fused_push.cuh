// The combine pushed from GEMM 2's epilogue (FusedForwardOptions::epilogue_push): a routed
// GEMM 2 tile's consumer warps copy the rows of other ranks' tokens (and, without the own rows
// in place, their own rank's too) from the epilogue's staging buffer straight into slot
// (token, k) of the token's rank, while the TMA unit stores the tile into expert_out as usual.
// So no comm CTA has a combine to run: at EP >= 2 all but one of them take GEMM tasks after
// their dispatch share (the one left waits for every routed tile and opens the barrier of all
// ranks before the epilogue kernel), as all of them do at EP 1.
//
// The bytes are the staged tile's bytes (the bf16 pairs TMA stores), so the slots hold exactly
// what the comm CTAs' combine copies from expert_out: same bits.
//
// Memory ordering: a warp's NVLink stores, then the warpgroup's named barrier at the end of the
// epilogue, then thread 0 publishes the tile with its release on g2_done (GPU scope, as every
// tile); the comm CTA acquires every g2_done (GPU scope), then opens the barrier of all ranks
// (__threadfence_system, system-scope flags); the epilogue kernel reads the slots after that
// barrier. The pushes precede the barrier's system-scope release in causality order (PTX memory
// model: bar.sync, then release/acquire pairs, each morally strong; the order is transitive and
// the fences cumulative), so the peer's epilogue kernel sees them.
#pragma once

#include <cstdint>

#include "comm/peer_map.hpp"
#include "comm/schedule.hpp"
#include "gemm/sm90_roles.cuh"

namespace mok::megakernel {

struct EpiloguePush {
  bool on = false;
  const comm::RowEntry* rows = nullptr;  // ScheduleView::rows: (source rank, token, k) of each routed row
  comm::PeerMap peers;                   // each rank's window base
  size_t slots_offset = 0;               // SymmetricLayout::slots
  int64_t row_bytes = 0;                 // H * 2
  int topk = 1;
  // Also the own rank's rows (the macrobatch ring, where expert_out is a single row tile): the
  // slots then hold every (t, k) row and nothing reads expert_out, so the tile is not
  // TMA-stored there (a second write of the tile cost 4-5 % at EP 1, docs/megakernel.md).
  bool own_rows = false;
  __device__ bool store_out() const { return !own_rows; }
};

// The slot base address of each of a warp's 16 tile rows (lane l holds row l % 16's; nullptr:
// padding, or a row the epilogue kernel reads in place). A warp's rows in the warpgroup's 64:
// [16 * warp, 16 * warp + 16), the rows its lanes wrote into the staging buffer. Called before
// the tile's K loop, so that the entry's load latency hides behind it; branch-free (every lane
// loads, a select picks), since lane-divergent code before the K loop can make ptxas serialise
// the wgmma (C7518). Every row of a tile has an entry (padding rows: src_rank -1).
// row0: the tile's first row in the schedule's expert-major order (not its macrobatch ring slot).
__device__ inline const char* push_row_dst(const EpiloguePush& p, int row0, int real_rows, const gemm::EpiCtx& ctx) {
  const int r = 16 * (ctx.tid / 32) + (ctx.tid & 15);
  const comm::RowEntry e = p.rows[row0 + 64 * ctx.wg + r];
  const bool push = 64 * ctx.wg + r < real_rows && e.src_rank >= 0 && (p.own_rows || e.src_rank != p.peers.rank);
  const int64_t slot = static_cast<int64_t>(e.token) * p.topk + e.k;
  return push ? p.peers.base[max(e.src_rank, 0)] + p.slots_offset + slot * p.row_bytes : nullptr;
}

// store_round's `after`: copies the warp's 16 rows x 128 columns [col0, col0 + 128) of the
// round from the staging buffer (two 64x64 boxes, TMA 128B swizzle: 16-byte chunk c of row r
// at r * 128 + ((c ^ r % 8) * 16), box 1 at +8192) to their slots. Lane l takes chunk l % 16 of
// rows 2i + l / 16: each instruction moves two whole 256-byte row pieces. Chunks at or past
// `hidden` (a partial last column block) are skipped.
struct PushStaged {
  const char* dst;  // push_row_dst of this lane (rows of lanes 0..15)
  int warp, col0, hidden;
  __device__ void operator()(uint32_t stage_saddr) const {
    const int lane = threadIdx.x % 32;
    const int c16 = lane & 15, half = lane >> 4;
    const bool col_ok = col0 + 8 * c16 < hidden;
    const uint32_t chunk_base = stage_saddr + (c16 >> 3) * 8192;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = 2 * i + half;
      const char* d = reinterpret_cast<const char*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(dst), r));
      if (d != nullptr && col_ok) {
        const int row = 16 * warp + r;
        const uint32_t src = chunk_base + row * 128 + (((c16 & 7) ^ (row & 7)) << 4);
        int4 v;
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(src));
        *reinterpret_cast<int4*>(const_cast<char*>(d) + 2 * static_cast<int64_t>(col0) + 16 * c16) = v;
      }
    }
  }
};

// GEMM 2's epilogue (gemm::store_bf16_256: the same packing, the same two store rounds) with
// the push after each round's staging. `dst`: push_row_dst of this thread. Without store_out
// the rounds issue no TMA store (a zero-column box; their bulk groups stay, empty, so the
// consumers' group accounting is unchanged).
template <class Acc>
__device__ inline void gemm2_epilogue_push(const gemm::Gemm2Params& p2, const gemm::RowTile& t,
                                           const gemm::EpiCtx& ctx, const char* dst, bool store_out, Acc& acc) {
  const int warp = ctx.tid / 32;
  const int col0 = 256 * t.n_tile;
  const int store_cols = store_out ? p2.hidden : 0;
  gemm::pack_rows_bf16(ctx, acc, t.real_rows);
  const int row0 = t.row0 + 64 * ctx.wg;
  gemm::store_round<0, 0>(ctx, [&](int i) { return __float_as_uint(acc(i)); },
                          gemm::Box2dStore{&p2.out, col0, store_cols, row0}, PushStaged{dst, warp, col0, p2.hidden});
  gemm::store_round<16, 1>(ctx, [&](int i) { return __float_as_uint(acc(i)); },
                           gemm::Box2dStore{&p2.out, col0 + 128, store_cols, row0},
                           PushStaged{dst, warp, col0 + 128, p2.hidden});
  // NOTE: orders every warp's pushes of the tile before thread 0, which may publish the tile
  // (its release on g2_done) before the warpgroup meets at another barrier (publish_all).
  gemm::named_barrier_sync(ctx.barrier_id(), gemm::kWarpGroupThreads);
}

}  // namespace mok::megakernel
