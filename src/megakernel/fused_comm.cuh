// Communication roles of the fused kernel. Its CTAs have the GEMM's shape (3 warpgroups, 12
// warps: a 128x256 fp32 wgmma accumulator needs more than the 128 registers a 512-thread
// CTA could give each thread), while comm/roles.cuh is written for 16-warp CTAs. These are
// the same roles for any warp count, built from the same primitives (vector copies, row entries,
// wait_geq, release counters) and the same work split (row tile t -> CTA t mod n, in
// increasing order), so they move exactly the same bytes with the same memory ordering.
//
//   dispatch_rows_pull   row buffer <- owners' x over NVLink, padding rows zeroed, ready[m] += 1 per tile
//   combine_rows_push    each real row -> slot (token, k) of its source rank, once GEMM 2 published the tile
#pragma once

#include <cstdint>

#include "comm/barrier.cuh"
#include "comm/roles.cuh"

namespace mok::megakernel {

// comm::group_barrier without its static shared-memory word: the fused kernel's GEMM CTAs
// need all 227 KiB of shared memory, and static shared memory is reserved in every CTA.
__device__ inline bool group_barrier_all(const comm::GroupBarrier& gb, uint32_t nctas, const comm::PeerMap& peers,
                                         const comm::WaitContext& ctx) {
  __syncthreads();
  int ok = 1;
  if (threadIdx.x == 0) {
    __threadfence_system();  // NOTE: this CTA's writes (ordered by the bar.sync above) before arrival
    const uint32_t before = comm::fetch_add_acq_rel<comm::Scope::kGpu>(&gb.sync->arrived, 1u);
    if (before == nctas - 1) {
      gb.sync->arrived = 0;  // nobody touches the counter again before `opened` moves
      ok = comm::phase_barrier(peers, gb.flags_offset, gb.epoch, ctx);
      if (ok) comm::store_release<comm::Scope::kGpu>(&gb.sync->opened, gb.epoch);
    } else {
      ok = comm::wait_geq<comm::Scope::kGpu>(&gb.sync->opened, gb.epoch, comm::WaitSite::kGroupArrive, ctx);
    }
  }
  return __syncthreads_and(ok) != 0;
}

template <int Warps>
struct CommSplit {
  static constexpr int kRowsPerWarp = (kRowTile + Warps - 1) / Warps;  // warp w: rows w, w+Warps, ...
  static_assert(kRowsPerWarp <= 32, "one lane per row entry");
};

// The row entries of this warp's rows of `tile` (lane j: its j-th row), in one batched load.
template <int Warps>
__device__ __forceinline__ comm::RowEntry warp_entries(const comm::RowEntry* rows, int64_t tile, int warp, int lane) {
  comm::RowEntry e{-1, -1, -1, -1};
  const int r = warp + lane * Warps;
  if (lane < CommSplit<Warps>::kRowsPerWarp && r < kRowTile) e = rows[tile * kRowTile + r];
  return e;
}

// A warp copies kRowsAtOnce rows at a time, kVecsPerRow 16-byte vectors of each per lane in
// flight: with short rows (Qwen3: H = 2048, 8 vectors per lane) one row at a time would keep
// only 4 KiB per warp in flight against the NVLink latency. 3 x 8 x 16 B x 32 lanes x 12 warps
// = 144 KiB per CTA for any row length (4 rows at once spill registers under the 168 cap).
inline constexpr int kRowsAtOnce = 3;
inline constexpr int kVecsPerRow = 8;

struct RowCopy {
  const int4* src;  // nullptr: zero-fill
  int4* dst;        // nullptr: nothing to do
};

template <class Load>
__device__ __forceinline__ void warp_copy_rows(const RowCopy (&job)[kRowsAtOnce], int64_t vecs, int lane, Load load) {
  for (int64_t base = lane; base < vecs; base += 32 * kVecsPerRow) {
    int4 v[kRowsAtOnce][kVecsPerRow];
#pragma unroll
    for (int r = 0; r < kRowsAtOnce; ++r) {
#pragma unroll
      for (int u = 0; u < kVecsPerRow; ++u) {
        v[r][u] = make_int4(0, 0, 0, 0);
        if (job[r].src != nullptr && base + u * 32 < vecs) v[r][u] = load(job[r].src + base + u * 32);
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsAtOnce; ++r) {
#pragma unroll
      for (int u = 0; u < kVecsPerRow; ++u) {
        if (job[r].dst != nullptr && base + u * 32 < vecs) comm::store_vec(job[r].dst + base + u * 32, v[r][u]);
      }
    }
  }
}

// Plain pull dispatch (comm::dispatch_pull without dedup). Call after the group barrier that
// follows the staging of x on every rank.
template <int Warps>
__device__ void dispatch_rows_pull(const comm::DispatchRole& r, int cta, int nctas) {
  if (r.header->status != static_cast<int32_t>(Status::kOk)) return;  // poisoned schedule
  const int64_t tiles = r.header->padded_rows / kRowTile;
  const int64_t vecs = r.row_bytes / 16;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t tile = cta; tile < tiles; tile += nctas) {
    const comm::RowEntry entries = warp_entries<Warps>(r.rows, tile, warp, lane);
    for (int j0 = 0; j0 < CommSplit<Warps>::kRowsPerWarp; j0 += kRowsAtOnce) {
      RowCopy job[kRowsAtOnce];
#pragma unroll
      for (int q = 0; q < kRowsAtOnce; ++q) {
        const int j = j0 + q, in_tile = warp + j * Warps;
        const comm::RowEntry e = comm::shfl_entry(entries, j % 32);
        const bool row = j < CommSplit<Warps>::kRowsPerWarp && in_tile < kRowTile;  // uniform over the warp
        job[q].dst = row ? reinterpret_cast<int4*>(r.row_buffer + (tile * kRowTile + in_tile) * r.row_bytes) : nullptr;
        job[q].src = row && e.src_rank >= 0
                         ? reinterpret_cast<const int4*>(r.peers.base[e.src_rank] + r.x_offset +
                                                         static_cast<int64_t>(e.token) * r.row_bytes)
                         : nullptr;  // padding rows are zeroed
      }
      warp_copy_rows(job, vecs, lane, comm::StableLoad{});
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();  // NOTE: the CTA's row stores (ordered by bar.sync) before the counter
      comm::fetch_add_release<comm::Scope::kGpu>(r.ready + tile / r.tiles_per_minibatch, 1u);
    }
  }
}

// Push combine (comm::combine_push), each row tile after out_ready[tile] >= out_ready_target.
// The slots may be read only after a group barrier that follows this role on every rank.
template <int Warps>
__device__ void combine_rows_push(const comm::CombineRole& r, int cta, int nctas) {
  if (r.header->status != static_cast<int32_t>(Status::kOk)) return;
  const int64_t tiles = r.header->padded_rows / kRowTile;
  const int64_t vecs = r.row_bytes / 16;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t tile = cta; tile < tiles; tile += nctas) {
    int ok = 1;
    if (threadIdx.x == 0) {
      ok = comm::wait_geq<comm::Scope::kGpu>(r.out_ready + tile, r.out_ready_target, comm::WaitSite::kCombineSource,
                                             r.wait);
    }
    // NOTE: the barrier orders every thread's loads after thread 0's acquire (and the previous
    // tile's loads before the next wait).
    if (!__syncthreads_and(ok)) return;
    const comm::RowEntry entries = warp_entries<Warps>(r.rows, tile, warp, lane);
    for (int j0 = 0; j0 < CommSplit<Warps>::kRowsPerWarp; j0 += kRowsAtOnce) {
      RowCopy job[kRowsAtOnce];
#pragma unroll
      for (int q = 0; q < kRowsAtOnce; ++q) {
        const int j = j0 + q, in_tile = warp + j * Warps;
        const comm::RowEntry e = comm::shfl_entry(entries, j % 32);
        const bool row = j < CommSplit<Warps>::kRowsPerWarp && in_tile < kRowTile && e.src_rank >= 0;
        const int64_t slot = static_cast<int64_t>(e.token) * r.topk + e.k;
        job[q].dst = row ? reinterpret_cast<int4*>(r.peers.base[e.src_rank] + r.slots_offset + slot * r.row_bytes)
                         : nullptr;  // padding rows go nowhere
        job[q].src = row ? reinterpret_cast<const int4*>(r.expert_out + (tile * kRowTile + in_tile) * r.row_bytes)
                         : nullptr;
      }
      warp_copy_rows(job, vecs, lane, comm::FreshLoad{});
    }
  }
}

}  // namespace mok::megakernel
