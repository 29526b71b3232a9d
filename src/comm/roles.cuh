// Communication roles as __device__ functions, run by `nctas` communication CTAs of any kernel
// (the standalone kernels in roles.cu, the fused megakernel through megakernel/fused_comm.cuh).
// Work is split in row tiles of kRowTile rows, handed out round-robin in increasing order (CTA
// c: tiles c, c+n, ...), so a wait on an earlier tile can never deadlock while the comm CTAs are
// co-resident. The roles are templates over the CTA's warp count and copy shape (WarpShape:
// dispatch_pull_warps, combine_push_warps).
//
//   dispatch_pull      rows of this rank's expert-major buffer <- owners' x (NVLink loads),
//                      padding rows zeroed, per-minibatch ready counters raised (release);
//                      dedup: each (token, rank) read once and stored to all its rows (fan-out)
//   combine_push       expert-output rows -> owner's slot (token, k) (NVLink stores); in place:
//                      only other ranks' rows, over the schedule's remote-row list (all warps)
//   topk_sum_epilogue  y[t] = bf16(fmaf chain over k of topk_w * slot (or the own expert_out
//                      row), from the shared output or 0)
//
// Copies are 16-byte vectors through registers (WarpShape: rows at once x vectors per row in
// flight per lane), each warp fetching its rows' entries in one batched load. (Bulk async
// copies issued by one lane per CTA moved 13-22 GB/s per CTA and lost: docs/experiments.md.)
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "comm/barrier.cuh"
#include "comm/peer_map.hpp"
#include "comm/role_types.hpp"
#include "comm/schedule.hpp"
#include "comm/wait.cuh"

namespace mok::comm {

// ---- 16-byte vector memory ops -------------------------------------------------------------
// Read-only data written before the phase barrier (staged x): non-coherent path, no L1 fill.
__device__ __forceinline__ int4 load_stable(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
// Data another CTA of this kernel may have just written (dedup source rows, GEMM outputs,
// slots after a barrier): cache-global, L1 bypassed, so never a stale L1 line.
__device__ __forceinline__ int4 load_fresh(const int4* p) {
  int4 v;
  asm volatile("ld.global.cg.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void store_vec(int4* p, int4 v) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};"
               :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

struct StableLoad {
  __device__ int4 operator()(const int4* p) const { return load_stable(p); }
};
struct FreshLoad {
  __device__ int4 operator()(const int4* p) const { return load_fresh(p); }
};

// One warp copies `vecs` 16-byte vectors, U in flight per lane.
template <int U = CommCtaConfig::kUnroll, class Load>
__device__ __forceinline__ void warp_copy(int4* dst, const int4* src, int64_t vecs, int lane, Load load) {
  for (int64_t base = lane; base < vecs; base += 32 * U) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + u * 32 < vecs) v[u] = load(src + base + u * 32);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + u * 32 < vecs) store_vec(dst + base + u * 32, v[u]);
    }
  }
}

__device__ __forceinline__ void warp_zero(int4* dst, int64_t vecs, int lane) {
  for (int64_t i = lane; i < vecs; i += 32) store_vec(dst + i, make_int4(0, 0, 0, 0));
}

// ---- the warp copies, generic over the CTA's warp count -------------------------------------
// Shape of a comm CTA: Warps warps; a warp copies RowsAtOnce rows at a time with VecsPerRow
// 16-byte vectors of each per lane in flight. The standalone kernels use StandaloneWarps (16
// warps, one row at a time, 16 vectors: 128 KiB in flight per CTA under the 128-register cap of
// 512 threads); the fused kernel's 12-warp CTAs use 3 rows x 8 vectors (144 KiB: short rows such
// as Qwen3's 8 vectors per lane still keep the link busy). Same bytes for any shape.
template <int Warps, int RowsAtOnce, int VecsPerRow>
struct WarpShape {
  static constexpr int kWarps = Warps;
  static constexpr int kRowsAtOnce = RowsAtOnce;
  static constexpr int kVecsPerRow = VecsPerRow;
  static constexpr int kRowsPerWarp = (kRowTile + Warps - 1) / Warps;  // at most, of one tile
  static_assert(kRowsPerWarp <= 32, "one lane per row entry");
};
using StandaloneWarps = WarpShape<CommCtaConfig::kWarps, 1, CommCtaConfig::kUnroll>;

struct RowCopy {
  const int4* src = nullptr;  // nullptr: zero-fill
  int4* dst = nullptr;        // nullptr: nothing to do
};

// The load phase of the warp row copies: vectors base + 32u (u < V) of every job's source row
// into v (zeros past the row's end and for rows without a source).
template <int R, int V, class Job, class Load>
__device__ __forceinline__ void load_row_vectors(int4 (&v)[R][V], const Job (&job)[R], int64_t base, int64_t vecs,
                                                 Load load) {
#pragma unroll
  for (int q = 0; q < R; ++q) {
#pragma unroll
    for (int u = 0; u < V; ++u) {
      v[q][u] = make_int4(0, 0, 0, 0);
      if (job[q].src != nullptr && base + u * 32 < vecs) v[q][u] = load(job[q].src + base + u * 32);
    }
  }
}

// One warp copies up to R rows of `vecs` vectors at once (loads of every row, then the stores).
template <int R, int V, class Load>
__device__ __forceinline__ void warp_copy_rows(const RowCopy (&job)[R], int64_t vecs, int lane, Load load) {
  for (int64_t base = lane; base < vecs; base += 32 * V) {
    int4 v[R][V];
    load_row_vectors(v, job, base, vecs, load);
#pragma unroll
    for (int q = 0; q < R; ++q) {
#pragma unroll
      for (int u = 0; u < V; ++u) {
        if (job[q].dst != nullptr && base + u * 32 < vecs) store_vec(job[q].dst + base + u * 32, v[q][u]);
      }
    }
  }
}

__device__ __forceinline__ RowEntry shfl_entry(const RowEntry& mine, int j) {
  return RowEntry{__shfl_sync(0xffffffffu, mine.src_rank, j), __shfl_sync(0xffffffffu, mine.token, j),
                  __shfl_sync(0xffffffffu, mine.k, j), __shfl_sync(0xffffffffu, mine.copy_from, j)};
}

// Rows a dedup (fan-out) dispatch starts from: padding, and each token's first row on this rank.
__device__ __forceinline__ bool is_fan_source(const RowEntry& e) { return e.src_rank < 0 || e.copy_from < 0; }

// A warp's rows of one tile: lane j holds the warp's j-th row (entry, row within the tile),
// `count` (warp-uniform) of them. The picked rows of the tile in increasing order go round-robin
// to the warps (picked row p -> warp p mod Warps): with kAll (every row) that is row w, w + Warps, ...
struct WarpRows {
  RowEntry e{-1, -1, -1, -1};
  int row = -1;
  int count = 0;
};

// kAll: one batched load of the warp's rows, and with a warp count that divides kRowTile a
// compile-time row count (the loops then compile as the original). !kAll: only the fan-out
// sources (is_fan_source).
template <class Shape, bool kAll>
__device__ inline WarpRows warp_tile_rows(const RowEntry* rows, int64_t tile, int warp, int lane) {
  constexpr int W = Shape::kWarps;
  WarpRows w;
  if constexpr (kAll) {
    const int r = warp + lane * W;
    if (lane < Shape::kRowsPerWarp && r < kRowTile) {
      w.e = rows[tile * kRowTile + r];
      w.row = r;
    }
    w.count = kRowTile % W == 0 ? kRowTile / W : (kRowTile - warp + W - 1) / W;
    return w;
  }
  static_assert(kRowTile == 128, "a tile is 4 x 32 entries");
  RowEntry ent[4];  // lane l: rows l, l + 32, l + 64, l + 96
  uint32_t mask[4];
  int before[5] = {0, 0, 0, 0, 0};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    ent[q] = rows[tile * kRowTile + q * 32 + lane];
    mask[q] = __ballot_sync(0xffffffffu, is_fan_source(ent[q]));
    before[q + 1] = before[q] + __popc(mask[q]);
  }
  const int picked = before[4];
  w.count = picked > warp ? (picked - warp + W - 1) / W : 0;
  const int p = warp + lane * W;  // this lane's picked index
  int quarter = -1, bit = 0;
  if (lane < w.count) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      if (quarter < 0 && p < before[q + 1]) quarter = q;
    }
    uint32_t m = 0;
    int first = 0;
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // (selects, not a dynamically indexed register array)
      if (quarter == q) m = mask[q], first = before[q];
    }
    for (int i = first; i < p; ++i) m &= m - 1;  // drop the earlier picked rows
    bit = __ffs(m) - 1;
  }
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const RowEntry e = shfl_entry(ent[q], bit);
    if (quarter == q) {
      w.e = e;
      w.row = q * 32 + bit;
    }
  }
  return w;
}

// The CTAs of a role: CTA c takes every row of tiles c, c + n, ...
struct CtaGroup {
  int cta = 0, nctas = 1;
};

// ---- dispatch ------------------------------------------------------------------------------

// DispatchRole::remote_bytes: lane 0 counts one row read from another rank.
__device__ __forceinline__ void count_remote_row(const DispatchRole& r, int src_rank, int lane) {
  if (r.remote_bytes != nullptr && lane == 0 && src_rank != r.peers.rank) {
    atomicAdd(r.remote_bytes, static_cast<unsigned long long>(r.row_bytes));
  }
}

// The warp's rows of `tile` (plain pull: every row is loaded from its source rank's x, padding
// rows zeroed). Row loops have compile-time bounds (guards inside), so that the standalone shape
// (one row at a time) compiles to the original unrolled loop: a runtime bound cost the 16-warp
// dispatch ~1.7x (measured, v3 run 1).
template <class Shape>
__device__ inline void dispatch_rows(const DispatchRole& r, int64_t tile, const WarpRows& mine, int lane) {
  constexpr int R = Shape::kRowsAtOnce, V = Shape::kVecsPerRow;
  const int64_t vecs = r.row_bytes / 16;
  if (r.ring_tiles > 0) tile %= r.ring_tiles;  // the macrobatch ring's slot (the rows' source stays `mine`)
  if constexpr (R == 1) {
    for (int j = 0; j < Shape::kRowsPerWarp; ++j) {
      if (j >= mine.count) break;  // warp-uniform
      const RowEntry e = shfl_entry(mine.e, j);
      const int in_tile = __shfl_sync(0xffffffffu, mine.row, j);
      int4* dst = reinterpret_cast<int4*>(r.row_buffer + (tile * kRowTile + in_tile) * r.row_bytes);
      if (e.src_rank < 0) {
        warp_zero(dst, vecs, lane);
      } else {
        const char* src = dispatch_source(r, e.src_rank, e.token);
        warp_copy<V>(dst, reinterpret_cast<const int4*>(src), vecs, lane, StableLoad{});
        count_remote_row(r, e.src_rank, lane);
      }
    }
  } else {
    for (int j0 = 0; j0 < Shape::kRowsPerWarp; j0 += R) {
      RowCopy job[R];
#pragma unroll
      for (int q = 0; q < R; ++q) {
        const int j = j0 + q;
        const RowEntry e = shfl_entry(mine.e, j % 32);
        const int in_tile = __shfl_sync(0xffffffffu, mine.row, j % 32);
        if (j < mine.count) {  // warp-uniform
          job[q].dst = reinterpret_cast<int4*>(r.row_buffer + (tile * kRowTile + in_tile) * r.row_bytes);
          if (e.src_rank >= 0) {  // padding rows stay nullptr: zeroed
            job[q].src = reinterpret_cast<const int4*>(dispatch_source(r, e.src_rank, e.token));
            count_remote_row(r, e.src_rank, lane);
          }
        }
      }
      warp_copy_rows<R, V>(job, vecs, lane, StableLoad{});
    }
  }
}

// Thread 0, after the CTA barrier that follows its rows of `tile`: +1 on its minibatch's ready
// counter.
__device__ inline void publish_dispatch_tile(const DispatchRole& r, int64_t tile) {
  __threadfence();  // NOTE: the CTA's row stores (ordered by bar.sync) before the counter
  fetch_add_release<Scope::kGpu>(r.ready + tile / r.tiles_per_minibatch, 1u);
}

// Plain pull of tiles first, first + step, ... below end (this CTA's share).
template <class Shape, bool kAll>
__device__ inline void dispatch_tile_range(const DispatchRole& r, const CtaGroup& g, int64_t first, int64_t end,
                                           int64_t step) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t tile = first; tile < end; tile += step) {
    const WarpRows mine = warp_tile_rows<Shape, kAll>(r.rows, tile, warp, lane);
    if (r.ring_tiles > 0 && tile >= r.ring_tiles) {
      // The slot's previous tile must be read by every GEMM 1 column block first (its TMA
      // loads completed before the counter's release). A timeout is recorded; the copy then
      // goes ahead (y is poisoned after the kernel) so that the kernel still ends.
      if (threadIdx.x == 0) {
        wait_geq<Scope::kGpu>(r.ring_free + (tile - r.ring_tiles), r.ring_free_target, WaitSite::kRingSlot, r.wait);
      }
      __syncthreads();  // NOTE: every warp's stores of the slot after thread 0's acquire
    }
    dispatch_rows<Shape>(r, tile, mine, lane);
    __syncthreads();
    if (threadIdx.x == 0) publish_dispatch_tile(r, tile);
  }
}

// Plain pull. Call after the phase barrier that follows the staging of x on every rank. Every
// thread of the CTA (Shape::kWarps warps). With the macrobatch ring and ring_ctas, the tiles
// past the first ring window go to the group's last ring_ctas CTAs only: those tiles wait for
// their slots anyway, and the other CTAs are free to join the GEMM work, or (the fused forward's
// first comm CTAs) to combine or count while the pass runs (each CTA's tiles still come in
// increasing order).
template <class Shape, bool kAll>
__device__ inline void dispatch_tiles(const DispatchRole& r, const CtaGroup& g) {
  const int64_t tiles = r.header->padded_rows / kRowTile;
  const bool narrow = r.ring_tiles > 0 && r.ring_ctas > 0 && r.ring_ctas < g.nctas;
  if (!narrow) return dispatch_tile_range<Shape, kAll>(r, g, g.cta, tiles, g.nctas);
  dispatch_tile_range<Shape, kAll>(r, g, g.cta, min(tiles, r.ring_tiles), g.nctas);
  const int first_ring_cta = g.nctas - r.ring_ctas;
  if (g.cta >= first_ring_cta) {
    dispatch_tile_range<Shape, kAll>(r, g, r.ring_tiles + (g.cta - first_ring_cta), tiles, r.ring_ctas);
  }
}

// ---- dedup dispatch: one read per (token, rank), fanned out to every row of the token ------

// A fan-out source row and its destinations. Padding: itself, zeroed. A token's first row on
// this rank: every row of that token here (dest_row of its K entries, itself included), so
// the token's row crosses NVLink (or is read from own x) once and is stored K_r times from
// registers; nothing is read back from HBM and no tile waits for another.
struct FanRow {
  const int4* src = nullptr;  // nullptr: zero row
  int32_t dest = -1;          // lane d: the d-th destination row in this rank's buffer, or -1
  uint32_t mask = 0;          // lanes holding a destination (warp-uniform)
};

__device__ inline FanRow fan_row(const DispatchRole& r, const RowEntry& e, int64_t row, int lane) {
  FanRow f;
  if (e.src_rank < 0) {
    f.dest = lane == 0 ? static_cast<int32_t>(row) : -1;
  } else {
    f.src = reinterpret_cast<const int4*>(dispatch_source(r, e.src_rank, e.token));
    if (lane < r.topk) f.dest = r.dest_row[(static_cast<int64_t>(e.src_rank) * r.tokens + e.token) * r.topk + lane];
    count_remote_row(r, e.src_rank, lane);
  }
  f.mask = __ballot_sync(0xffffffffu, f.dest >= 0);
  return f;
}

// One warp: R source rows at once, V vectors of each per lane in flight, each stored to all of
// its destinations. The chunk loop is warp-uniform (every lane runs every round, guards per
// vector): the destination rows travel by __shfl_sync inside it, which needs all 32 lanes (a
// lane-strided loop leaves lanes 16..31 out for 256-byte rows).
template <int R, int V, class Load>
__device__ __forceinline__ void warp_fanout_rows(const FanRow (&job)[R], char* buffer, int64_t row_bytes, int lane,
                                                 Load load) {
  const int64_t vecs = row_bytes / 16;
  for (int64_t base0 = 0; base0 < vecs; base0 += 32 * V) {
    const int64_t base = base0 + lane;
    int4 v[R][V];
    load_row_vectors(v, job, base, vecs, load);
#pragma unroll
    for (int q = 0; q < R; ++q) {
      for (uint32_t m = job[q].mask; m != 0; m &= m - 1) {  // warp-uniform
        const int32_t row = __shfl_sync(0xffffffffu, job[q].dest, __ffs(m) - 1);
        int4* dst = reinterpret_cast<int4*>(buffer + static_cast<int64_t>(row) * row_bytes);
#pragma unroll
        for (int u = 0; u < V; ++u) {
          if (base + u * 32 < vecs) store_vec(dst + base + u * 32, v[q][u]);
        }
      }
    }
  }
}

// The fan-out jobs of sources j0 .. j0 + R - 1 of the warp's rows of `tile` (sources past
// mine.count keep the empty job: no source, no destination). Warp-uniform.
template <int R>
__device__ __forceinline__ void fan_jobs(const DispatchRole& r, const WarpRows& mine, int64_t tile, int j0, int lane,
                                         FanRow (&job)[R]) {
#pragma unroll
  for (int q = 0; q < R; ++q) {
    const int j = j0 + q;
    const RowEntry e = shfl_entry(mine.e, j % 32);
    const int in_tile = __shfl_sync(0xffffffffu, mine.row, j % 32);
    if (j < mine.count) job[q] = fan_row(r, e, tile * kRowTile + in_tile, lane);  // warp-uniform
  }
}

// Finished rows (lane d of job[q] holds the d-th destination row, or -1): tile_done counts the
// rows of each tile; whoever lands a tile's last row raises the minibatch's ready counter. Call
// after __threadfence() that follows the rows' stores (and a __syncwarp, which orders the other
// lanes' stores before that fence). All R adds are issued before any result is checked, so they
// are in flight together (one row at a time, a heavy tile's count was a chain of round trips).
template <int R>
__device__ inline void count_dispatched_rows(const DispatchRole& r, const FanRow (&job)[R]) {
  uint32_t before[R];
#pragma unroll
  for (int q = 0; q < R; ++q) {
    before[q] = job[q].dest >= 0 ? atomicAdd(r.tile_done + job[q].dest / kRowTile, 1u) : 0u;
  }
#pragma unroll
  for (int q = 0; q < R; ++q) {
    if (job[q].dest >= 0 && before[q] == static_cast<uint32_t>(kRowTile) - 1) {
      __threadfence();  // NOTE: acquire the other writers' counts (relaxed RMW + fence), then release the tile
      fetch_add_release<Scope::kGpu>(r.ready + job[q].dest / kRowTile / r.tiles_per_minibatch, 1u);
    }
  }
}

// Tiles in increasing order: a token's first row sits in its lowest local expert, so every row
// of minibatch m is written by a source in a tile of m or earlier and the minibatches still
// complete in order. No CTA barrier: each warp publishes its own rows once per tile.
// Tiles first, first + step, ... below end, by the Shape::kWarps warps of
// a group (this one is `warp`); each tile is done by one group, whoever it is (the fused forward
// lets its GEMM CTAs take a share of the first tiles: dispatch_fanout_shared_start).
template <class Shape>
__device__ inline void dispatch_fanout_range(const DispatchRole& r, int64_t first, int64_t end, int64_t step,
                                             int warp) {
  constexpr int R = Shape::kRowsAtOnce, V = Shape::kVecsPerRow;
  const int lane = threadIdx.x % 32;
  for (int64_t tile = first; tile < end; tile += step) {
    const WarpRows mine = warp_tile_rows<Shape, false>(r.rows, tile, warp, lane);
    for (int j0 = 0; j0 < Shape::kRowsPerWarp; j0 += R) {
      if (j0 >= mine.count) break;  // warp-uniform
      FanRow job[R];
      fan_jobs<R>(r, mine, tile, j0, lane, job);
      warp_fanout_rows<R, V>(job, r.row_buffer, r.row_bytes, lane, StableLoad{});
    }
    if (mine.count == 0) continue;
    __syncwarp();
    __threadfence();  // NOTE: every lane's row stores (ordered by the bar.warp.sync) before the counts
    // The same jobs again, R sources at a time, so that their destination loads and their
    // counter adds overlap (one source at a time, a heavy tile's count was a chain of two round
    // trips per source). Re-deriving them is cheaper than keeping every round's destinations
    // in registers.
    for (int j0 = 0; j0 < Shape::kRowsPerWarp; j0 += R) {
      if (j0 >= mine.count) break;  // warp-uniform
      FanRow job[R];
      fan_jobs<R>(r, mine, tile, j0, lane, job);
      count_dispatched_rows<R>(r, job);
    }
  }
}

template <class Shape>
__device__ inline void dispatch_fanout_tiles(const DispatchRole& r, const CtaGroup& g) {
  dispatch_fanout_range<Shape>(r, g.cta, r.header->padded_rows / kRowTile, g.nctas, threadIdx.x / 32);
}

// Plain (dedup off, the macrobatch ring's): every row is pulled from its source. Dedup:
// fan-out from each token's first row. Both give identical bytes and identical ready counters.
template <class Shape>
__device__ inline void dispatch_pull_warps(const DispatchRole& r, int cta, int nctas) {
  if (r.header->status != static_cast<int32_t>(Status::kOk)) return;  // poisoned schedule
  const CtaGroup g{cta, nctas};
  if (r.dedup) {
    dispatch_fanout_tiles<Shape>(r, g);
  } else {
    dispatch_tiles<Shape, true>(r, g);
  }
}

// The standalone shape (512-thread CTAs); kDedup must equal r.dedup. One kernel per mode, so
// that each copy loop gets the whole 128-register budget (together they spill).
template <bool kDedup>
__device__ inline void dispatch_pull(const DispatchRole& r, int cta, int nctas) {
  if (r.header->status != static_cast<int32_t>(Status::kOk)) return;
  const CtaGroup g{cta, nctas};
  if constexpr (kDedup) {
    dispatch_fanout_tiles<StandaloneWarps>(r, g);
  } else {
    dispatch_tiles<StandaloneWarps, true>(r, g);
  }
}

// GEMM side: thread 0 of a consumer CTA waits for minibatch m's rows; true when they landed.
__device__ inline bool wait_minibatch_ready(const uint32_t* ready, const ScheduleView& v, int64_t m,
                                            const WaitContext& ctx) {
  const uint32_t tiles = static_cast<uint32_t>((v.mb_end[m] - v.mb_begin[m]) / kRowTile);
  return wait_geq<Scope::kGpu>(ready + m, tiles, WaitSite::kReadyCounter, ctx);
}

// ---- combine -------------------------------------------------------------------------------

// Arrival counting (CombineRole::count_arrivals): the word of the row's (token) on its source rank.
__device__ __forceinline__ uint32_t* arrivals_word(const CombineRole& r, const RowEntry& e) {
  return reinterpret_cast<uint32_t*>(r.peers.base[e.src_rank] + r.arrivals_offset) + e.token;
}
// After a warp's batch of rows: lane q (holding job q's word) adds 1 with release semantics at
// system scope. NOTE: the __syncwarp orders every lane's stores of the batch before the
// releasing lanes' adds (the release is cumulative), so a reader that acquires the count sees
// the whole rows.
__device__ __forceinline__ void count_arrival(uint32_t* word) {
  __syncwarp();
  if (word != nullptr) fetch_add_release<Scope::kSystem>(word, 1u);
}

// Every real row of this CTA's tiles (tiles cta, cta + n, ...): the combine of every (t, k) row.
template <class Shape>
__device__ inline void combine_tiles(const CombineRole& r, int cta, int nctas) {
  constexpr int R = Shape::kRowsAtOnce, V = Shape::kVecsPerRow;
  const int64_t tiles = r.header->padded_rows / kRowTile;
  const int64_t vecs = r.row_bytes / 16;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t tile = cta; tile < tiles; tile += nctas) {
    if (r.out_ready != nullptr) {
      int ok = 1;
      if (threadIdx.x == 0) {
        ok = wait_geq<Scope::kGpu>(r.out_ready + tile, r.out_ready_target, WaitSite::kCombineSource, r.wait);
      }
      // NOTE: the barrier orders every thread's loads after thread 0's acquire (and the previous
      // tile's loads before the next wait).
      if (!__syncthreads_and(ok)) return;
    }
    WarpRows mine = warp_tile_rows<Shape, true>(r.rows, tile, warp, lane);
    mine.count = (kRowTile - warp + Shape::kWarps - 1) / Shape::kWarps;  // NOTE: a run-time count keeps the registers
    for (int j0 = 0; j0 < mine.count; j0 += R) {
      RowCopy job[R];
      uint32_t* arrive = nullptr;  // lane q < R: the arrivals word of job q (count_arrivals)
#pragma unroll
      for (int q = 0; q < R; ++q) {
        const int j = j0 + q;
        const RowEntry e = shfl_entry(mine.e, j % 32);
        const int in_tile = __shfl_sync(0xffffffffu, mine.row, j % 32);
        if (j < mine.count && e.src_rank >= 0) {  // warp-uniform; padding rows go nowhere
          const int64_t slot = static_cast<int64_t>(e.token) * r.topk + e.k;
          job[q].dst = reinterpret_cast<int4*>(r.peers.base[e.src_rank] + r.slots_offset + slot * r.row_bytes);
          job[q].src = reinterpret_cast<const int4*>(r.expert_out + (tile * kRowTile + in_tile) * r.row_bytes);
          if (lane == q) arrive = arrivals_word(r, e);
        }
      }
      warp_copy_rows<R, V>(job, vecs, lane, FreshLoad{});
      if (r.count_arrivals) count_arrival(arrive);
    }
  }
}

// In-place combine over the schedule's remote-row list: comm warp gw (of all CTAs) takes list
// entries gw, gw + warps, ... (R at a time), so every warp moves the same number of rows, in
// increasing row order; with out_ready each row waits for its row tile (lane 0 acquires, the
// __syncwarp orders the other lanes' loads after it).
template <class Shape>
__device__ inline void combine_remote_list(const CombineRole& r, int cta, int nctas) {
  constexpr int R = Shape::kRowsAtOnce, V = Shape::kVecsPerRow;
  const int64_t vecs = r.row_bytes / 16;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t nw = static_cast<int64_t>(nctas) * Shape::kWarps;
  const int64_t gw = static_cast<int64_t>(cta) * Shape::kWarps + warp;
  const int64_t n = *r.remote_count;  // written by the schedule kernel, before this kernel
  for (int64_t i0 = gw; i0 < n; i0 += nw * R) {
    RowCopy job[R];
    uint32_t* arrive = nullptr;  // lane q < R: the arrivals word of job q (count_arrivals)
#pragma unroll
    for (int q = 0; q < R; ++q) {
      const int64_t i = i0 + q * nw;
      if (i >= n) break;  // warp-uniform
      const int64_t row = r.remote_rows[i];
      if (r.out_ready != nullptr) {
        bool ok = true;
        if (lane == 0) {
          ok = wait_geq<Scope::kGpu>(r.out_ready + row / kRowTile, r.out_ready_target, WaitSite::kCombineSource, r.wait);
        }
        ok = __shfl_sync(0xffffffffu, ok, 0);
        __syncwarp();  // NOTE: orders the other lanes' loads after lane 0's acquire
        if (!ok) return;
      }
      const RowEntry e = r.rows[row];
      const int64_t slot = static_cast<int64_t>(e.token) * r.topk + e.k;
      job[q].dst = reinterpret_cast<int4*>(r.peers.base[e.src_rank] + r.slots_offset + slot * r.row_bytes);
      job[q].src = reinterpret_cast<const int4*>(r.expert_out + row * r.row_bytes);
      if (lane == q) arrive = arrivals_word(r, e);
    }
    warp_copy_rows<R, V>(job, vecs, lane, FreshLoad{});
    if (r.count_arrivals) count_arrival(arrive);
  }
}

// Pushes every real row to slot (token, k) of its source rank, each row tile once
// out_ready[tile] >= out_ready_target (when out_ready is set). The slots may be read only after
// a phase barrier that follows this role on every rank. No static shared memory (the fused
// kernel's GEMM CTAs need all of it): the wait's result travels through __syncthreads_and.
template <class Shape>
__device__ inline void combine_push_warps(const CombineRole& r, int cta, int nctas) {
  if (r.header->status != static_cast<int32_t>(Status::kOk)) return;
  if (r.own_rows_in_place) {
    if (r.peers.ep > 1) combine_remote_list<Shape>(r, cta, nctas);
    return;
  }
  combine_tiles<Shape>(r, cta, nctas);
}

__device__ inline void combine_push(const CombineRole& r, int cta, int nctas) {
  combine_push_warps<StandaloneWarps>(r, cta, nctas);
}

// The counts without the copies: when the rows were pushed by someone else (the fused forward's
// GEMM 2 epilogues, which publish each tile on out_ready after its pushes), arrivals[token] still
// needs +1 per pushed row for a reader that takes each token once its slots are complete
// (count_arrivals' contract). Comm warp gw of all takes row tiles gw, gw + warps, ... in
// increasing order: lane 0 acquires the tile's out_ready (GPU scope), the __syncwarp orders the
// other lanes after it, then each lane adds 1 with a system-scope release for each pushed row
// among rows lane, lane + 32, ... of the tile (own_rows_in_place: the rows of other ranks'
// tokens; else every real row). The release is cumulative: the pushes, ordered before the
// tile's release on out_ready, are visible to whoever acquires the count. A timed-out wait is
// recorded and ends the counting (the readers then time out too; y is poisoned).
template <class Shape>
__device__ inline void count_pushed_rows(const CombineRole& r, int cta, int nctas) {
  if (r.header->status != static_cast<int32_t>(Status::kOk)) return;
  const int64_t tiles = r.header->padded_rows / kRowTile;
  const int lane = threadIdx.x % 32;
  const int64_t nw = static_cast<int64_t>(nctas) * Shape::kWarps;
  for (int64_t tile = static_cast<int64_t>(cta) * Shape::kWarps + threadIdx.x / 32; tile < tiles; tile += nw) {
    bool ok = true;
    if (lane == 0) ok = wait_geq<Scope::kGpu>(r.out_ready + tile, r.out_ready_target, WaitSite::kCombineSource, r.wait);
    ok = __shfl_sync(0xffffffffu, ok, 0);
    __syncwarp();  // NOTE: the other lanes' adds after lane 0's acquire
    if (!ok) return;
#pragma unroll
    for (int q = 0; q < kRowTile / 32; ++q) {
      const RowEntry e = r.rows[tile * kRowTile + 32 * q + lane];
      if (e.src_rank >= 0 && (!r.own_rows_in_place || e.src_rank != r.peers.rank)) {
        fetch_add_release<Scope::kSystem>(arrivals_word(r, e), 1u);
      }
    }
  }
}

// ---- epilogue (docs/numerics.md, combine epilogue) -----------------------------------------

// The sum's element math on 8 columns (one 16-byte vector of bf16), shared with the fused
// forward's sum (megakernel/fused_topk_sum.cuh), which must give the same bits: start from the
// shared expert's value (or 0), one fmaf per k in order, one rounding at the end.
__device__ __forceinline__ void topk_acc_init(float (&acc)[8], const int4& shared) {
  const __nv_bfloat16* sb = reinterpret_cast<const __nv_bfloat16*>(&shared);
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = __bfloat162float(sb[j]);
}
__device__ __forceinline__ void topk_acc_add(float (&acc)[8], float w, const int4& row) {
  const __nv_bfloat16* vb = reinterpret_cast<const __nv_bfloat16*>(&row);
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = __fmaf_rn(w, __bfloat162float(vb[j]), acc[j]);
}
__device__ __forceinline__ int4 topk_acc_round(const float (&acc)[8]) {
  int4 out;
  __nv_bfloat16* ob = reinterpret_cast<__nv_bfloat16*>(&out);
#pragma unroll
  for (int j = 0; j < 8; ++j) ob[j] = __float2bfloat16_rn(acc[j]);
  return out;
}

// Any number of CTAs/threads: one thread per 8 columns of one token. The rows of up to
// kEpilogueBatch k are loaded before the first of their fmaf (the row indices first, then the
// rows): with one k at a time each thread waited for two dependent loads per k (the row index,
// then the row) before its next load, and the kernel read ~3.5 TB/s. The sum is unchanged:
// one fmaf per k in the order 0..K-1.
inline constexpr int kEpilogueBatch = 8;
__device__ inline void topk_sum_epilogue(const EpilogueRole& r, int64_t first_thread, int64_t nthreads) {
  const int64_t groups = r.hidden / 8;
  const int64_t row_vecs = r.hidden / 8;  // 16-byte vectors per [H] row
  for (int64_t g = first_thread; g < r.tokens * groups; g += nthreads) {
    const int64_t t = g / groups, c = g % groups;
    float acc[8];
    if (r.shared_out != nullptr) {
      topk_acc_init(acc, load_fresh(reinterpret_cast<const int4*>(r.shared_out) + t * row_vecs + c));
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
    }
    for (int k0 = 0; k0 < r.topk; k0 += kEpilogueBatch) {
      const int64_t tk0 = t * r.topk + k0;
      const int n = min(kEpilogueBatch, r.topk - k0);
      const int4* src[kEpilogueBatch];
      float w[kEpilogueBatch];
#pragma unroll
      for (int i = 0; i < kEpilogueBatch; ++i) {
        src[i] = reinterpret_cast<const int4*>(r.slots) + (tk0 + i) * row_vecs + c;
        w[i] = i < n ? r.topk_w[tk0 + i] : 0.0f;
      }
      if (r.own_dest_row != nullptr) {
        int32_t row[kEpilogueBatch];
#pragma unroll
        for (int i = 0; i < kEpilogueBatch; ++i) row[i] = i < n ? r.own_dest_row[tk0 + i] : -1;
#pragma unroll
        for (int i = 0; i < kEpilogueBatch; ++i) {
          if (row[i] >= 0) src[i] = reinterpret_cast<const int4*>(r.expert_out) + row[i] * row_vecs + c;
        }
      }
      int4 v[kEpilogueBatch];
#pragma unroll
      for (int i = 0; i < kEpilogueBatch; ++i) {
        if (i < n) v[i] = load_fresh(src[i]);
      }
#pragma unroll
      for (int i = 0; i < kEpilogueBatch; ++i) {  // fixed order k0 + 0, 1, ... (numerics contract)
        if (i < n) topk_acc_add(acc, w[i], v[i]);
      }
    }
    reinterpret_cast<int4*>(r.y)[t * row_vecs + c] = topk_acc_round(acc);
  }
}

}  // namespace mok::comm
