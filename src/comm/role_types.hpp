// Parameters of the communication roles (host-compilable); the device code is in roles.cuh
// (kWarp, epilogue) and roles_bulk.cuh (kHybrid, kBulk).
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

// How the rows move. Every engine writes exactly the same bytes (pure data movement); they
// differ in who issues the copies and whether own-rank rows compete with NVLink rows.
//   kWarp    16-byte vectors through registers, all warps of the CTA on one row tile at a time,
//            then a CTA barrier (the original engine; no shared memory needed)
//   kHybrid  rows from other ranks by warps 1.. (registers, no CTA barriers), own-rank rows and
//            padding by warp 0 with bulk async copies (TMA) through shared-memory stages,
//            concurrently: the comm CTAs keep NVLink busy while the local copies run
//   kBulk    every row by bulk async copies (one issuing lane per CTA, ~200 KiB in flight)
// kHybrid and kBulk need dynamic shared memory (role_smem_bytes() in roles_bulk.cuh); the 3-argument
// device roles (no shared memory) fall back to kWarp. Measured on 2x H200 (docs/comm.md, "Copy
// engines: measured"): both are SLOWER than kWarp at 8-32 CTAs (one issuing lane per CTA moves
// 13-22 GB/s); kWarp stays the default.

enum class CopyEngine : int32_t { kWarp = 0, kHybrid = 1, kBulk = 2 };

// CTA split of the kWarp engine (`remote_ctas` of the roles): of n comm CTAs, CTAs [0, R) move
// the rows of other ranks (NVLink) and [R, n) the own rank's rows and padding (local HBM), each
// group over every row tile, so a CTA on a local tile never holds NVLink traffic back.
//   0                 no split: CTA c takes every row of tiles c, c + n, ... (the original)
//   kRemoteCtasAuto   R = n * (ep - 1) / ep rounded (the remote share of the rows), in [1, n - 1]
//   R > 0             R, clamped to [1, n - 1]
// EP = 1 or n = 1: never split. Same bytes in every case.
inline constexpr int32_t kRemoteCtasAuto = -1;
MOK_HD inline int resolve_remote_ctas(int requested, int ep, int nctas) {
  if (ep < 2 || nctas < 2 || requested == 0) return 0;
  const int r = requested > 0 ? requested : (nctas * (ep - 1) + ep / 2) / ep;
  return r < 1 ? 1 : (r > nctas - 1 ? nctas - 1 : r);
}

struct DispatchRole {
  PeerMap peers;
  size_t x_offset = 0;              // SymmetricLayout::x
  int64_t row_bytes = 0;            // H * 2, a multiple of 128
  const ScheduleHeader* header = nullptr;
  const RowEntry* rows = nullptr;
  char* row_buffer = nullptr;       // [buffer_rows, H] bf16, local
  uint32_t* ready = nullptr;        // [max_minibatches] +1 per finished row tile (zeroed before)
  uint32_t* tile_done = nullptr;    // [buffer_rows / kRowTile] (zeroed before): dedup and kHybrid/kBulk: rows
                                    // landed in the tile (published at kRowTile); kWarp split: groups done
  int64_t tiles_per_minibatch = 1;
  // Read each (token, rank) once (over NVLink for other ranks' tokens) and store it from
  // registers to every row of that token on this rank (kWarp: fan-out from the token's first
  // row, needs dest_row/tokens/topk below). Same bytes as the plain pull.
  bool dedup = false;
  WaitContext wait;
  // ---- added for the bulk engines (defaults keep the original behaviour) ----
  CopyEngine engine = CopyEngine::kWarp;
  // kBulk + dedup: each token's first row is pulled once into shared memory and stored from there
  // to every row of that token on this rank (its other rows are never read back from HBM).
  // Needs the schedule's dest_row; without it (nullptr) kBulk + dedup pulls every row (kWarp + dedup requires it).
  const int32_t* dest_row = nullptr;  // ScheduleView::dest_row [ep*T*K]
  int64_t tokens = 0;                 // T per rank
  int topk = 0;                       // K
  // kWarp: CTA split (kRemoteCtasAuto etc. above). Off by default: as a plain pull the link
  // needs ~16 CTAs, too many to leave enough for the local rows at <= 24 (docs/comm.md).
  // Without dedup the split completes a tile in two CTAs: tile_done counts them (zeroed before).
  int32_t remote_ctas = 0;
  // Token-major dispatch (the fused forward's gather path, docs/comm.md): each other rank's
  // token that this rank needs lands ONCE in `recv` ([ep * T, H], local) at row
  // src_rank * T + token, from the schedule's landing list (ScheduleView::land_rows; comm warp w
  // of all takes entries w, w + warps, ...); own tokens are not copied and row_buffer is not
  // written: GEMM 1 gathers its A rows from x and recv. ready[m] += 1 per landed entry whose
  // row lies in minibatch m (target ScheduleView::mb_land[m]). Overrides dedup.
  bool token_major = false;
  char* recv = nullptr;
  const int32_t* land_rows = nullptr;
  const int32_t* land_count = nullptr;
  int64_t minibatch_rows = 0;  // rows per minibatch (ScheduleView::minibatch)
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
  // reads the window there. 16-byte aligned.
  const char* own_x = nullptr;
};

// Token `token` of rank `src` as the dispatch reads it: the owner's staged x in the window, or
// the own rank's x itself (DispatchRole::own_x).
MOK_HD inline const char* dispatch_source(const DispatchRole& r, int src, int64_t token) {
  const char* x = src == r.peers.rank && r.own_x != nullptr ? r.own_x : r.peers.base[src] + r.x_offset;
  return x + token * r.row_bytes;
}

// Row `token` of rank `src` in the token-major receive buffer.
MOK_HD inline int64_t recv_row(int src, int64_t token, int64_t tokens) { return src * tokens + token; }

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
  CopyEngine engine = CopyEngine::kWarp;  // added; see CopyEngine
  int32_t remote_ctas = kRemoteCtasAuto;  // kWarp: CTA split (see kRemoteCtasAuto); 0 = off
  // kWarp: push only the rows of other ranks' tokens (every CTA, no split); the own rank's
  // (token, k) rows stay in expert_out and the epilogue reads them there (EpilogueRole::
  // own_dest_row): the same bytes reach y, 472 MB less copying at DeepSeek-V3 EP=2.
  bool own_rows_in_place = false;
  // With own_rows_in_place: the schedule's list of this rank's rows of other ranks' tokens
  // (ScheduleView::remote_rows/remote_count). Comm warp w of all of them takes list entries
  // w, w + warps, ...: an even, fixed split (row tiles per CTA leave a tile's worth of tail).
  // nullptr: row tiles per CTA.
  const int32_t* remote_rows = nullptr;
  const int32_t* remote_count = nullptr;
  // kWarp: after each warp's batch of rows landed, +1 (release, system scope) per row on
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

// ---- shared memory of the bulk engines ------------------------------------------------------
// One issuing lane runs a ring of `stages` buffers of `chunk` bytes: a bulk load (global ->
// shared, completion on the stage's mbarrier) then one bulk store per destination (shared ->
// global, bulk async-groups). Per stage: the mbarrier, the piece's size/flags and up to `fan`
// destinations. Plus the current row tile's entries, the dedup fan-out table and a zero chunk
// (source of the padding rows).
struct BulkConfig {
  static constexpr uint32_t kMaxChunk = 16384;     // bytes per stage (a DeepSeek-V3 row is 14336)
  static constexpr uint32_t kMaxStages = 32;       // phase bits of the stages fit one word
  static constexpr uint32_t kStoreLag = 4;         // store groups left in flight per step
  static constexpr uint32_t kSmemBytes = 220 * 1024;  // what the standalone kernels request
};

struct BulkLayout {
  uint32_t chunk = 0, stride = 0, stages = 0, fan = 1;
  uint32_t bars = 0, meta = 0, dsts = 0, rowids = 0, entries = 0, fans = 0, zero = 0, stage = 0;
  uint32_t bytes = 0;  // total; 0 = does not fit (too little shared memory)
};

MOK_HD constexpr uint32_t bulk_align(uint32_t v, uint32_t a) { return (v + a - 1) / a * a; }

// job_bytes: bytes of one row (a multiple of 16); fan: destinations per piece (1, or K for the
// dedup fan-out); fan_rows: rows of the fan-out table (kRowTile with the fan-out, else 0).
MOK_HD inline BulkLayout make_bulk_layout(int64_t job_bytes, int fan, int fan_rows, uint32_t smem_bytes) {
  BulkLayout l;
  l.chunk = static_cast<uint32_t>(job_bytes < BulkConfig::kMaxChunk ? job_bytes : BulkConfig::kMaxChunk);
  l.stride = bulk_align(l.chunk, 128);
  l.fan = static_cast<uint32_t>(fan < 1 ? 1 : fan);
  const uint32_t per_stage = 8 + 8 + 8 * l.fan + 4 * l.fan;  // mbarrier, meta, destinations, row ids
  const uint32_t fixed = 4 * 128 + static_cast<uint32_t>(kRowTile) * 16  // alignment slack, entries
                         + bulk_align(static_cast<uint32_t>(fan_rows) * 4 * l.fan, 16) + l.stride;  // fan table, zero chunk
  if (l.chunk == 0 || smem_bytes < fixed + BulkConfig::kStoreLag + 2) return l;
  uint32_t s = (smem_bytes - fixed) / (l.stride + per_stage);
  if (s > BulkConfig::kMaxStages) s = BulkConfig::kMaxStages;
  if (s < BulkConfig::kStoreLag + 2) return l;  // at least one load in flight
  l.stages = s;
  uint32_t at = 0;
  l.bars = at;    at = bulk_align(at + 8 * s, 16);
  l.meta = at;    at = bulk_align(at + 8 * s, 16);
  l.dsts = at;    at = bulk_align(at + 8 * s * l.fan, 16);
  l.rowids = at;  at = bulk_align(at + 4 * s * l.fan, 16);
  l.entries = at; at = bulk_align(at + static_cast<uint32_t>(kRowTile) * 16, 16);
  l.fans = at;    at = bulk_align(at + static_cast<uint32_t>(fan_rows) * 4 * l.fan, 128);
  l.zero = at;    at = bulk_align(at + l.stride, 128);
  l.stage = at;   at += s * l.stride;
  l.bytes = at;
  return l;
}

// Layout of a role (identical on host and device).
MOK_HD inline bool dispatch_fans_out(const DispatchRole& r) {
  return r.engine == CopyEngine::kBulk && r.dedup && r.dest_row != nullptr && r.topk >= 1 && r.topk <= kMaxTopK;
}
MOK_HD inline BulkLayout dispatch_bulk_layout(const DispatchRole& r, uint32_t smem_bytes) {
  const bool fan = dispatch_fans_out(r);
  return make_bulk_layout(r.row_bytes, fan ? r.topk : 1, fan ? static_cast<int>(kRowTile) : 0, smem_bytes);
}
MOK_HD inline BulkLayout combine_bulk_layout(const CombineRole& r, uint32_t smem_bytes) {
  return make_bulk_layout(r.row_bytes, 1, 0, smem_bytes);
}

}  // namespace mok::comm
