// Parameters of the communication roles (host-compilable); the device code is in roles.cuh.
#pragma once

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

#include "comm/peer_map.hpp"
#include "comm/schedule.hpp"
#include "comm/sync_types.hpp"

namespace mok::comm {

// Shape of a communication CTA. 16 warps x 16 vectors x 16 B = 128 KiB in flight per CTA:
// NVLink loads take microseconds, and 16 CTAs must keep ~1 MB in flight to fill a link.
struct CommCtaConfig {
  static constexpr int kThreads = 512;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kUnroll = 16;
};

struct DispatchRole {
  PeerMap peers;
  size_t x_offset = 0;              // SymmetricLayout::x
  int64_t row_bytes = 0;            // H * 2, a multiple of 128
  const ScheduleHeader* header = nullptr;
  const RowEntry* rows = nullptr;
  char* row_buffer = nullptr;       // [buffer_rows, H] bf16, local
  uint32_t* ready = nullptr;        // [max_minibatches] +1 per finished row tile (zeroed before)
  uint32_t* tile_done = nullptr;    // [buffer_rows / kRowTile] (zeroed before): dedup: rows landed in the
                                    // tile (published at kRowTile)
  int64_t tiles_per_minibatch = 1;
  // Read each (token, rank) once (over NVLink for other ranks' tokens) and store it from
  // registers to every row of that token on this rank (fan-out from the token's first row,
  // needs dest_row/tokens/topk below). Same bytes as the plain pull (dedup off), which the
  // macrobatch ring uses: the fan-out writes a token's rows of later minibatches early.
  bool dedup = false;
  WaitContext wait;
  const int32_t* dest_row = nullptr;  // ScheduleView::dest_row [ep*T*K]
  int64_t tokens = 0;                 // T per rank
  int topk = 0;                       // K
  // Macrobatch ring (the fused forward, Config::macrobatch; plain kWarp pull only): row tile t
  // is written to slot t % ring_tiles of row_buffer, after ring_free[t - ring_tiles] (GEMM 1's
  // completion counter of the tile that used the slot last) reached ring_free_target.
  // 0: every row tile has its own rows.
  int64_t ring_tiles = 0;
  const uint32_t* ring_free = nullptr;
  uint32_t ring_free_target = 0;
  // With the ring: the tiles past the first window go to the last ring_ctas CTAs only (the
  // others end their dispatch after the first window). 0: every CTA all pass.
  int ring_ctas = 0;
  // This rank's tokens are read here instead of the window's staging copy (nullptr: the window).
  // The fused forward at EP 1 sets it to ForwardArgs::x and skips the staging copy: no peer
  // reads the window there (the staged backward's pulls likewise to its x and dy). 16-byte aligned.
  const char* own_x = nullptr;
  // Testing and accounting (CommState::count_dispatch_bytes): += row_bytes for every row read from
  // another rank's window (a dedup dispatch reads a (token, rank) once). nullptr: not counted.
  unsigned long long* remote_bytes = nullptr;
};

// Token `token` of rank `src` as the dispatch reads it: the owner's staged x in the window, or
// the own rank's x itself (DispatchRole::own_x).
MOK_HD inline const char* dispatch_source(const DispatchRole& r, int src, int64_t token) {
  const char* x = src == r.peers.rank && r.own_x != nullptr ? r.own_x : r.peers.base[src] + r.x_offset;
  return x + token * r.row_bytes;
}

struct CombineRole {
  PeerMap peers;
  size_t slots_offset = 0;          // SymmetricLayout::slots
  int64_t row_bytes = 0;
  int topk = 1;
  const ScheduleHeader* header = nullptr;
  const RowEntry* rows = nullptr;
  const char* expert_out = nullptr; // [buffer_rows, H] bf16, local (GEMM 2 output)
  const uint32_t* out_ready = nullptr;  // optional [tiles]: row tile t is final once >= out_ready_target
  uint32_t out_ready_target = 0;
  WaitContext wait;
  // Push only the rows of other ranks' tokens; the own rank's (token, k) rows stay in
  // expert_out and the epilogue reads them there (EpilogueRole::own_dest_row): the same bytes
  // reach y, 472 MB less copying at DeepSeek-V3 EP=2. Off: every real row moves (the
  // macrobatch ring, whose expert_out does not hold the rows).
  bool own_rows_in_place = false;
  // With own_rows_in_place: the schedule's list of this rank's rows of other ranks' tokens
  // (ScheduleView::remote_rows/remote_count). Comm warp w of all of them takes list entries
  // w, w + warps, ...: an even, fixed split (row tiles per CTA leave a tile's worth of tail).
  const int32_t* remote_rows = nullptr;
  const int32_t* remote_count = nullptr;
  // After each warp's batch of rows landed, +1 (release, system scope) per row on
  // arrivals[token] of the row's source rank (SymmetricLayout::arrivals), so a reader there can
  // take token t as soon as its slots are complete instead of after a barrier (the fused
  // forward's top-k sum). false: no counting (the standalone combine, which ends in a barrier).
  bool count_arrivals = false;
  size_t arrivals_offset = 0;
};

struct EpilogueRole {
  const char* slots = nullptr;             // this rank's [T, K, H] bf16 slots (after the barrier)
  const float* topk_w = nullptr;           // [T, K]
  const __nv_bfloat16* shared_out = nullptr;  // [T, H] shared-expert output, or nullptr (acc = 0)
  __nv_bfloat16* y = nullptr;              // [T, H]
  int64_t tokens = 0, hidden = 0;
  int topk = 1;
  // Combine with own_rows_in_place: entry (t, k) of a token whose expert this rank owns is read
  // from row own_dest_row[t*K+k] of expert_out instead of its slot (nullptr: every entry from
  // the slots).
  const int32_t* own_dest_row = nullptr;   // ScheduleView::dest_row + rank*T*K
  const char* expert_out = nullptr;        // [buffer_rows, H] bf16 (GEMM 2 output)
};

}  // namespace mok::comm
