// Communication roles of the fused kernel. Its CTAs have the GEMM's shape (3 warpgroups, 12
// warps: a 128x256 fp32 wgmma accumulator needs more than the 128 registers a 512-thread
// CTA could give each thread). The roles are comm/roles.cuh's kWarp roles, which are generic
// over the warp count (comm::WarpShape): same code, bytes and memory ordering as the standalone
// kernels; only the copy shape differs.
//
//   dispatch_rows_pull   row buffer <- owners' x over NVLink (dedup: once per (token, rank), fanned
//                        out to the token's rows), padding rows zeroed, ready[m] += 1 per tile
//   combine_rows_push    each real row (own_rows_in_place: of another rank's token) -> slot (token, k)
//                        of its source rank, once GEMM 2 published the tile
//   count_pushed_rows    with GEMM 2's epilogues pushing (and the fused top-k sum): only the
//                        per-token arrival counts of the pushed rows, once GEMM 2 published the tile
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
  if (threadIdx.x == 0) ok = comm::group_arrive_and_wait(gb, nctas, peers, ctx) ? 1 : 0;
  return __syncthreads_and(ok) != 0;
}

// The comm roles of comm/roles.cuh with the fused CTA's warp count: a warp copies 3 rows at a
// time, 8 vectors of each per lane in flight (3 x 8 x 16 B x 32 lanes x 12 warps = 144 KiB per
// CTA for any row length; with short rows such as Qwen3's, H = 2048 = 8 vectors per lane, one
// row at a time would keep only 4 KiB per warp in flight; 4 rows spill under the 168 cap).
template <int Warps>
using FusedWarps = comm::WarpShape<Warps, 3, 8>;

// Pull dispatch (plain, or dedup fan-out: role.dedup). Call after the group barrier that follows
// the staging of x on every rank; ready[m] += 1 per finished row tile.
template <int Warps>
__device__ inline void dispatch_rows_pull(const comm::DispatchRole& r, int cta, int nctas) {
  comm::dispatch_pull_warps<FusedWarps<Warps>>(r, cta, nctas);
}

// The dedup dispatch with the GEMM CTAs' help at the start (FusedForwardParams::help_tiles):
// the first `help_tiles` row tiles go round-robin over every CTA of the grid (worker = its index
// in the grid), the rest over the comm CTAs (worker = its comm index). The fan-out stores all
// rows of a token when its first row's tile is processed, so the first tiles carry most of the
// stores, while the GEMM CTAs of a layer without a shared expert have nothing to do until the
// first minibatch landed. A group of Warps warps, this one `warp`; no CTA barrier inside.
template <int Warps>
__device__ inline void dispatch_fanout_shared_start(const comm::DispatchRole& r, int64_t help_tiles, int worker,
                                                    int workers, int warp) {
  if (r.header->status != static_cast<int32_t>(Status::kOk)) return;  // poisoned schedule
  const int64_t tiles = r.header->padded_rows / kRowTile;
  comm::dispatch_fanout_range<FusedWarps<Warps>>(r, worker, min(help_tiles, tiles), workers, warp);
}
template <int Warps>
__device__ inline void dispatch_rows_pull_helped(const comm::DispatchRole& r, int64_t help_tiles, int cta, int nctas,
                                                 int grid) {
  if (r.header->status != static_cast<int32_t>(Status::kOk)) return;
  const int64_t tiles = r.header->padded_rows / kRowTile;
  const int warp = threadIdx.x / 32;
  comm::dispatch_fanout_range<FusedWarps<Warps>>(r, cta, min(help_tiles, tiles), grid, warp);
  comm::dispatch_fanout_range<FusedWarps<Warps>>(r, help_tiles + cta, tiles, nctas, warp);
}

// Push combine, each row tile after out_ready[tile] (GEMM 2) >= out_ready_target. The slots may
// be read only after a group barrier that follows this role on every rank.
template <int Warps>
__device__ inline void combine_rows_push(const comm::CombineRole& r, int cta, int nctas) {
  comm::combine_push_warps<FusedWarps<Warps>>(r, cta, nctas);
}

// With the combine pushed from GEMM 2's epilogue and the fused top-k sum: the pushed rows'
// arrivals counted per token once their tiles are published (comm::count_pushed_rows).
template <int Warps>
__device__ inline void count_pushed_rows(const comm::CombineRole& r, int cta, int nctas) {
  comm::count_pushed_rows<FusedWarps<Warps>>(r, cta, nctas);
}

// With the combine pushed from GEMM 2's epilogue (fused_push.cuh): thread 0 acquires every
// routed row tile's completion (each published at system scope after its pushes), so the
// barrier of all ranks that follows covers every row this rank pushed. A timed-out wait is
// recorded (y is poisoned) and ends the waiting.
__device__ inline void wait_routed_tiles_final(const comm::CombineRole& r) {
  if (threadIdx.x != 0 || r.header->status != static_cast<int32_t>(Status::kOk)) return;
  const int64_t tiles = r.header->padded_rows / kRowTile;
  for (int64_t t = 0; t < tiles; ++t) {
    if (!comm::wait_geq<comm::Scope::kGpu>(r.out_ready + t, r.out_ready_target, comm::WaitSite::kCombineSource,
                                           r.wait)) {
      return;
    }
  }
}

}  // namespace mok::megakernel
