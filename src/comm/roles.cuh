// Communication roles as __device__ functions, run by `nctas` communication CTAs of any kernel
// (the standalone kernels in roles.cu, later the fused megakernel). Work is split in row
// tiles of kRowTile rows, handed out round-robin in increasing order (CTA c: tiles c, c+n, ...),
// so a wait on an earlier tile can never deadlock while the comm CTAs are co-resident.
//
//   dispatch_pull      rows of this rank's expert-major buffer <- owners' x (NVLink loads),
//                      padding rows zeroed, per-minibatch ready counters raised (release)
//   combine_push       expert-output rows -> owner's slot (token, k) (NVLink stores)
//   topk_sum_epilogue  y[t] = bf16(fmaf chain over k of topk_w * slot, from the shared output or 0)
//
// All copies are 16-byte vectors, kUnroll of them in flight per lane to cover NVLink latency;
// each warp fetches the row entries of its rows in a tile with one batched load.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "comm/barrier.cuh"
#include "comm/peer_map.hpp"
#include "comm/role_types.hpp"
#include "comm/schedule.hpp"
#include "comm/wait.cuh"

namespace mok::comm {

static_assert(kRowTile % CommCtaConfig::kWarps == 0, "rows of a tile split evenly over the warps");

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

// One warp copies `vecs` 16-byte vectors.
template <class Load>
__device__ __forceinline__ void warp_copy(int4* dst, const int4* src, int64_t vecs, int lane, Load load) {
  constexpr int U = CommCtaConfig::kUnroll;
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

// ---- dispatch ------------------------------------------------------------------------------

// The kRowTile / kWarps row entries a warp handles in a tile, fetched in one batch (lane j holds
// the entry of the warp's j-th row) instead of one dependent load per row.
constexpr int kRowsPerWarp = kRowTile / CommCtaConfig::kWarps;
static_assert(kRowsPerWarp <= 32, "one lane per row entry");

__device__ __forceinline__ RowEntry warp_row_entries(const RowEntry* rows, int64_t tile, int warp, int lane) {
  RowEntry e{-1, -1, -1, -1};
  if (lane < kRowsPerWarp) e = rows[tile * kRowTile + warp + lane * CommCtaConfig::kWarps];
  return e;
}

__device__ __forceinline__ RowEntry shfl_entry(const RowEntry& mine, int j) {
  return RowEntry{__shfl_sync(0xffffffffu, mine.src_rank, j), __shfl_sync(0xffffffffu, mine.token, j),
                  __shfl_sync(0xffffffffu, mine.k, j), __shfl_sync(0xffffffffu, mine.copy_from, j)};
}

// Rows of `tile` this warp handles in one pass. first_pass: padding, and every row (plain) or
// the first-occurrence rows (dedup); otherwise the dedup copies of earlier rows.
__device__ inline void dispatch_rows(const DispatchRole& r, int64_t tile, const RowEntry& entries, bool first_pass,
                                     int warp, int lane) {
  const int64_t vecs = r.row_bytes / 16;
  for (int j = 0; j < kRowsPerWarp; ++j) {
    const int64_t row = tile * kRowTile + warp + j * CommCtaConfig::kWarps;
    const RowEntry e = shfl_entry(entries, j);
    int4* dst = reinterpret_cast<int4*>(r.row_buffer + row * r.row_bytes);
    const bool local_copy = r.dedup && e.copy_from >= 0;
    if (first_pass) {
      if (e.src_rank < 0) {
        warp_zero(dst, vecs, lane);
      } else if (!local_copy) {
        const char* src = r.peers.base[e.src_rank] + r.x_offset + static_cast<int64_t>(e.token) * r.row_bytes;
        warp_copy(dst, reinterpret_cast<const int4*>(src), vecs, lane, StableLoad{});
      }
    } else if (local_copy) {
      const int64_t src_tile = e.copy_from / kRowTile;
      bool ok = true;
      if (src_tile != tile) {  // same tile: the first pass and the bar.sync already ordered it
        if (lane == 0) ok = wait_geq<Scope::kGpu>(r.tile_done + src_tile, 1u, WaitSite::kDispatchTile, r.wait);
        ok = __shfl_sync(0xffffffffu, ok, 0);
        __syncwarp();  // NOTE: orders the other lanes' loads after lane 0's acquire
      }
      if (ok) {
        const char* src = r.row_buffer + static_cast<int64_t>(e.copy_from) * r.row_bytes;
        warp_copy(dst, reinterpret_cast<const int4*>(src), vecs, lane, FreshLoad{});
      }
    }
  }
}

// Call after the phase barrier that follows the staging of x on every rank.
__device__ inline void dispatch_pull(const DispatchRole& r, int cta, int nctas) {
  if (r.header->status != static_cast<int32_t>(Status::kOk)) return;  // poisoned schedule
  const int64_t tiles = r.header->padded_rows / kRowTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t tile = cta; tile < tiles; tile += nctas) {
    const RowEntry entries = warp_row_entries(r.rows, tile, warp, lane);
    dispatch_rows(r, tile, entries, true, warp, lane);
    __syncthreads();
    if (r.dedup) {
      if (threadIdx.x == 0) {
        __threadfence();  // NOTE: the CTA's row stores (ordered by bar.sync) before the flag
        store_release<Scope::kGpu>(r.tile_done + tile, 1u);
      }
      dispatch_rows(r, tile, entries, false, warp, lane);
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      __threadfence();
      fetch_add_release<Scope::kGpu>(r.ready + tile / r.tiles_per_minibatch, 1u);
    }
  }
}

// GEMM side: thread 0 of a consumer CTA waits for minibatch m's rows; true when they landed.
__device__ inline bool wait_minibatch_ready(const uint32_t* ready, const ScheduleView& v, int64_t m,
                                            const WaitContext& ctx) {
  const uint32_t tiles = static_cast<uint32_t>((v.mb_end[m] - v.mb_begin[m]) / kRowTile);
  return wait_geq<Scope::kGpu>(ready + m, tiles, WaitSite::kReadyCounter, ctx);
}

// ---- combine -------------------------------------------------------------------------------

// Pushes every real row to slot (token, k) of its source rank. The slots may be read only
// after a phase barrier that follows this role on every rank.
__device__ inline void combine_push(const CombineRole& r, int cta, int nctas) {
  if (r.header->status != static_cast<int32_t>(Status::kOk)) return;
  const int64_t tiles = r.header->padded_rows / kRowTile;
  const int64_t vecs = r.row_bytes / 16;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __shared__ int tile_ok;
  for (int64_t tile = cta; tile < tiles; tile += nctas) {
    if (r.out_ready != nullptr) {
      __syncthreads();
      if (threadIdx.x == 0) {
        tile_ok = wait_geq<Scope::kGpu>(r.out_ready + tile, r.out_ready_target, WaitSite::kCombineSource, r.wait);
      }
      __syncthreads();
      if (!tile_ok) return;
    }
    const RowEntry entries = warp_row_entries(r.rows, tile, warp, lane);
    for (int j = 0; j < kRowsPerWarp; ++j) {
      const int64_t row = tile * kRowTile + warp + j * CommCtaConfig::kWarps;
      const RowEntry e = shfl_entry(entries, j);
      if (e.src_rank < 0) continue;
      const int64_t slot = static_cast<int64_t>(e.token) * r.topk + e.k;
      char* dst = r.peers.base[e.src_rank] + r.slots_offset + slot * r.row_bytes;
      warp_copy(reinterpret_cast<int4*>(dst), reinterpret_cast<const int4*>(r.expert_out + row * r.row_bytes),
                vecs, lane, FreshLoad{});
    }
  }
}

// ---- epilogue (docs/numerics.md, combine epilogue) -----------------------------------------

// Any number of CTAs/threads: one thread per 8 columns of one token.
__device__ inline void topk_sum_epilogue(const EpilogueRole& r, int64_t first_thread, int64_t nthreads) {
  const int64_t groups = r.hidden / 8;
  const int64_t row_vecs = r.hidden / 8;  // 16-byte vectors per [H] row
  for (int64_t g = first_thread; g < r.tokens * groups; g += nthreads) {
    const int64_t t = g / groups, c = g % groups;
    float acc[8];
    if (r.shared_out != nullptr) {
      const int4 s = load_fresh(reinterpret_cast<const int4*>(r.shared_out) + t * row_vecs + c);
      const __nv_bfloat16* sb = reinterpret_cast<const __nv_bfloat16*>(&s);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = __bfloat162float(sb[j]);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
    }
    for (int k = 0; k < r.topk; ++k) {  // fixed order 0..K-1 (numerics contract)
      const float w = r.topk_w[t * r.topk + k];
      const int4 v = load_fresh(reinterpret_cast<const int4*>(r.slots) + (t * r.topk + k) * row_vecs + c);
      const __nv_bfloat16* vb = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = __fmaf_rn(w, __bfloat162float(vb[j]), acc[j]);
    }
    int4 out;
    __nv_bfloat16* ob = reinterpret_cast<__nv_bfloat16*>(&out);
#pragma unroll
    for (int j = 0; j < 8; ++j) ob[j] = __float2bfloat16_rn(acc[j]);
    reinterpret_cast<int4*>(r.y)[t * row_vecs + c] = out;
  }
}

}  // namespace mok::comm
