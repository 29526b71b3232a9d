// The bulk copy engines (CopyEngine::kHybrid, kBulk) of the communication roles: bulk async
// copies (TMA, cp.async.bulk) through shared-memory stages, and dispatch_pull / combine_push with
// shared memory, which run the engine the role asks for (kWarp: roles.cuh). Split out of
// roles.cuh (file size); opt-in, measured slower than kWarp (docs/comm.md).
#pragma once

#include "comm/roles.cuh"

namespace mok::comm {

// ---- bulk async copies (TMA) -----------------------------------------------------------------
// One lane of warp 0 issues them. A load's completion is tracked by its stage's mbarrier
// (transaction bytes), stores by the lane's bulk async-groups. The completion of a bulk copy
// includes a generic-async proxy fence, so a release by the issuing lane after wait_group
// publishes the bytes; data acquired through the generic proxy (x after the barrier, GEMM rows
// after out_ready) needs fence.proxy.async before a bulk copy reads it.
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void bulk_store(void* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait() {  // all but the N most recent groups complete (writes done)
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait_read() {  // ... have finished reading shared memory
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// mbarrier phase wait with the clock-based timeout every wait of mok has (wait_geq's rules).
__device__ inline bool mbar_wait(uint32_t bar, uint32_t parity, WaitSite site, const WaitContext& ctx) {
  if (mbar_try_wait(bar, parity)) return true;
  const uint64_t start = global_time_ns();
  for (uint32_t spin = 0;; ++spin) {
    if (mbar_try_wait(bar, parity)) return true;
    if ((spin & 15u) == 15u) {
      if (timed_out_elsewhere(ctx.error)) return false;
      if (global_time_ns() - start > ctx.timeout_ns) {
        record_error(ctx.error, static_cast<int32_t>(Status::kTimeout), static_cast<int32_t>(site), ctx.rank, 1, 0);
        return false;
      }
    }
  }
}

// The engine's shared memory (make_bulk_layout), base aligned to 128 bytes.
struct BulkSmem {
  BulkLayout lay;
  char* base = nullptr;
  __device__ uint32_t bar(uint32_t s) const { return smem_addr(base + lay.bars) + 8 * s; }
  __device__ uint2* meta() const { return reinterpret_cast<uint2*>(base + lay.meta); }  // {bytes, zero | nfan << 8}
  __device__ char** dst(uint32_t s) const { return reinterpret_cast<char**>(base + lay.dsts) + s * lay.fan; }
  __device__ int32_t* rowid(uint32_t s) const { return reinterpret_cast<int32_t*>(base + lay.rowids) + s * lay.fan; }
  __device__ RowEntry* entries() const { return reinterpret_cast<RowEntry*>(base + lay.entries); }
  __device__ int32_t* fans() const { return reinterpret_cast<int32_t*>(base + lay.fans); }
  __device__ uint32_t zero() const { return smem_addr(base + lay.zero); }
  __device__ uint32_t stage(uint32_t s) const { return smem_addr(base + lay.stage) + s * lay.stride; }
};

// Every thread of the CTA: mbarriers, zero chunk, then a CTA barrier.
__device__ inline BulkSmem bulk_setup(char* smem, const BulkLayout& lay) {
  BulkSmem sm;
  sm.lay = lay;
  sm.base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem) + 127) & ~uintptr_t{127});
  if (threadIdx.x == 0) {
    for (uint32_t s = 0; s < lay.stages; ++s) mbar_init(sm.bar(s), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  int4* z = reinterpret_cast<int4*>(sm.base + lay.zero);
  for (uint32_t i = threadIdx.x; i < lay.stride / 16; i += blockDim.x) z[i] = make_int4(0, 0, 0, 0);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // NOTE: zero chunk before bulk stores read it
  __syncthreads();
  return sm;
}

// Rows landed per row tile (DispatchRole::tile_done); whoever completes a tile (kRowTile rows)
// raises its minibatch's ready counter. Per lane; counts are aggregated per tile run and the
// atomic's result is looked at one step later, so the issuing loop never waits for it.
struct TileRowCounter {
  uint32_t* tile_rows = nullptr;
  uint32_t* ready = nullptr;
  int64_t tiles_per_minibatch = 1;
  int64_t run_tile = -1, pend_tile = -1;
  uint32_t run_n = 0, pend_n = 0, pend_old = 0;

  __device__ void resolve() {
    if (pend_tile >= 0 && pend_old + pend_n == static_cast<uint32_t>(kRowTile)) {
      __threadfence();  // NOTE: acquire the other writers' counts (relaxed RMW + fence), release the tile
      fetch_add_release<Scope::kGpu>(ready + pend_tile / tiles_per_minibatch, 1u);
    }
    pend_tile = -1;
  }
  __device__ void flush() {
    if (run_n == 0) return;
    resolve();
    __threadfence();  // NOTE: the rows (complete, observed by this warp) before their count
    pend_old = atomicAdd(tile_rows + run_tile, run_n);
    pend_tile = run_tile;
    pend_n = run_n;
    run_n = 0;
  }
  __device__ void add(int64_t tile, uint32_t n) {
    if (tile != run_tile) flush();
    run_tile = tile;
    run_n += n;
  }
  __device__ void finish() {
    flush();
    resolve();
  }
};

// One job of the bulk engine: `bytes` from `src` (nullptr: zeros) to the destination of every
// lane with `valid` (a dedup fan-out has several); `row` is counted once its last chunk landed.
struct BulkJob {
  const char* src = nullptr;  // warp-uniform
  uint32_t bytes = 0;         // warp-uniform, a multiple of 16
  bool valid = false;         // per lane
  char* dst = nullptr;        // per lane
  int32_t row = -1;           // per lane; -1: nothing to count
};

__device__ inline void bulk_count_piece(const BulkSmem& sm, uint32_t s, int lane, TileRowCounter& c) {
  c.resolve();
  const uint32_t nfan = sm.meta()[s].y >> 8;
  if (static_cast<uint32_t>(lane) < nfan) {
    const int32_t row = sm.rowid(s)[lane];
    if (row >= 0) c.add(row / kRowTile, 1);
  }
}

// The whole warp runs it (warp-uniform control flow); lane 0 issues the copies. Jobs come from
// `source.next(job)` in order and are cut into chunks; `issued - consumed` loads are in flight
// (at most stages - 1 - kStoreLag), and kStoreLag store groups. kCount: stages are reused after
// the stores completed, and landed rows are counted (dispatch); otherwise after they were read.
template <bool kCount, class Source>
__device__ bool bulk_engine(Source& source, const BulkSmem& sm, TileRowCounter& counter, WaitSite site,
                            const WaitContext& ctx) {
  constexpr uint32_t D = BulkConfig::kStoreLag;
  const int lane = threadIdx.x & 31;
  const uint32_t S = sm.lay.stages, F = sm.lay.fan, L = S - 1 - D;
  BulkJob job;
  bool have = source.next(job);
  uint32_t off = 0, issued = 0, consumed = 0, phases = 0;
  int ok = 1;
  if (lane == 0) fence_proxy_async_global();  // NOTE: sources acquired through the generic proxy
  for (;;) {
    while (have && issued - consumed < L) {
      __syncwarp();  // NOTE: earlier reads of this slot's destinations (counting) before rewriting them
      const uint32_t s = issued % S;
      const uint32_t n = min(sm.lay.chunk, job.bytes - off);
      const bool last = off + n == job.bytes;
      const uint32_t valid = __ballot_sync(0xffffffffu, job.valid);
      const uint32_t pos = __popc(valid & ((1u << lane) - 1u));
      if (job.valid && pos < F) {
        sm.dst(s)[pos] = job.dst + off;
        sm.rowid(s)[pos] = last ? job.row : -1;
      }
      if (lane == 0) {
        const uint32_t nfan = min(static_cast<uint32_t>(__popc(valid)), F);
        sm.meta()[s] = make_uint2(n, (job.src == nullptr ? 1u : 0u) | nfan << 8);
        if (job.src != nullptr) {
          mbar_expect_tx(sm.bar(s), n);
          bulk_load(sm.stage(s), job.src + off, n, sm.bar(s));
        }
      }
      ++issued;
      off += n;
      if (last) {
        off = 0;
        have = source.next(job);
      }
    }
    if (consumed == issued) break;
    __syncwarp();  // NOTE: the lanes' destination writes before lane 0 reads them
    const uint32_t s = consumed % S;
    if (lane == 0) {
      const uint2 m = sm.meta()[s];
      const bool zero = (m.y & 1u) != 0;
      if (!zero) {
        ok = mbar_wait(sm.bar(s), (phases >> s) & 1u, site, ctx);
        phases ^= 1u << s;
      }
      if (ok) {
        const uint32_t from = zero ? sm.zero() : sm.stage(s);
        for (uint32_t j = 0; j < (m.y >> 8); ++j) bulk_store(sm.dst(s)[j], from, m.x);
      }
      bulk_commit();
      if constexpr (kCount) {
        bulk_wait<D>();
      } else {
        bulk_wait_read<D>();
      }
    }
    if (!__shfl_sync(0xffffffffu, ok, 0)) return false;
    ++consumed;
    if constexpr (kCount) {
      if (consumed > D) bulk_count_piece(sm, (consumed - 1 - D) % S, lane, counter);
    }
  }
  if (lane == 0) bulk_wait<0>();
  __syncwarp();
  if constexpr (kCount) {
    for (uint32_t p = consumed > D ? consumed - D : 0; p < consumed; ++p) bulk_count_piece(sm, p % S, lane, counter);
    counter.finish();
  }
  return true;
}

// Which rows of a tile a bulk source hands out.
enum class RowPick : int {
  kDispatchAll,    // every row (padding: zeros)
  kDispatchOwn,    // rows from this rank, and padding (kHybrid: warps take the others)
  kDispatchFirst,  // each token's first row on this rank, and padding (dedup fan-out)
  kCombineAll,     // every real row
  kCombineOwn,     // real rows of this rank's own tokens (kHybrid)
};

__device__ __forceinline__ bool row_picked(RowPick pick, const RowEntry& e, int rank) {
  switch (pick) {
    case RowPick::kDispatchAll: return true;
    case RowPick::kDispatchOwn: return e.src_rank < 0 || e.src_rank == rank;
    case RowPick::kDispatchFirst: return e.src_rank < 0 || e.copy_from < 0;
    case RowPick::kCombineAll: return e.src_rank >= 0;
    default: return e.src_rank == rank;
  }
}

// Walks this CTA's row tiles (c, c+n, ...) for one warp: the tile's entries go to shared memory
// (prefetched one tile ahead into registers: lane l holds rows l, l+32, l+64, l+96), and the
// picked rows are handed out in increasing order.
struct TileWalk {
  const RowEntry* rows = nullptr;
  RowEntry* table = nullptr;  // shared [kRowTile]
  int64_t tile = 0, tiles = 0;
  int nctas = 1, rank = 0;
  RowPick pick = RowPick::kDispatchAll;
  uint32_t mask[4] = {0, 0, 0, 0};
  RowEntry pre[4];

  __device__ void prefetch(int64_t t) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int q = 0; q < 4; ++q) pre[q] = t < tiles ? rows[t * kRowTile + q * 32 + lane] : RowEntry{-1, -1, -1, -1};
  }
  __device__ void open() {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      table[q * 32 + lane] = pre[q];
      mask[q] = __ballot_sync(0xffffffffu, row_picked(pick, pre[q], rank));
    }
    prefetch(tile + nctas);
    __syncwarp();
  }
  __device__ int take() {  // next picked row of the open tile, -1 when none is left
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      if (mask[q] != 0) {
        const int b = __ffs(mask[q]) - 1;
        mask[q] &= mask[q] - 1;
        return q * 32 + b;
      }
    }
    return -1;
  }
};
static_assert(kRowTile == 128, "TileWalk holds a tile as 4 x 32 lanes");

template <bool kFan>  // kFan: RowPick::kDispatchFirst with the fan-out table
struct DispatchRowSource {
  static constexpr bool fan = kFan;
  const DispatchRole* r;
  BulkSmem sm;
  TileWalk walk;
  bool opened = false;

  __device__ DispatchRowSource(const DispatchRole& role, const BulkSmem& s, int cta, int nctas, RowPick pick)
      : r(&role), sm(s) {
    walk.rows = role.rows;
    walk.table = s.entries();
    walk.tile = cta;
    walk.tiles = role.header->padded_rows / kRowTile;
    walk.nctas = nctas;
    walk.rank = role.peers.rank;
    walk.pick = pick;
    walk.prefetch(cta);
  }
  // Fan-out table of the open tile: the K dest_row entries of each first row (-1 elsewhere),
  // 32 independent loads per lane per round.
  __device__ void load_fans() {
    const int lane = threadIdx.x & 31;
    const int K = r->topk;
    const int total = static_cast<int>(kRowTile) * K;
    int32_t* fans = sm.fans();
    for (int base = 0; base < total; base += 32 * 32) {
      int32_t v[32];
#pragma unroll
      for (int u = 0; u < 32; ++u) {
        const int p = base + u * 32 + lane;
        v[u] = -1;
        if (p < total) {
          const RowEntry e = walk.table[p / K];
          if (e.src_rank >= 0 && e.copy_from < 0) {
            v[u] = r->dest_row[(static_cast<int64_t>(e.src_rank) * r->tokens + e.token) * K + p % K];
          }
        }
      }
#pragma unroll
      for (int u = 0; u < 32; ++u) {
        const int p = base + u * 32 + lane;
        if (p < total) fans[p] = v[u];
      }
    }
    __syncwarp();
  }
  __device__ bool next(BulkJob& job) {
    const int lane = threadIdx.x & 31;
    for (;;) {
      if (walk.tile >= walk.tiles) return false;
      if (!opened) {
        walk.open();
        if constexpr (kFan) load_fans();
        opened = true;
      }
      const int i = walk.take();
      if (i < 0) {
        walk.tile += walk.nctas;
        opened = false;
        continue;
      }
      const RowEntry e = walk.table[i];
      const int64_t row = walk.tile * kRowTile + i;
      job.bytes = static_cast<uint32_t>(r->row_bytes);
      job.src = e.src_rank < 0 ? nullptr
                               : dispatch_source(*r, e.src_rank, e.token);
      if (kFan && e.src_rank >= 0) {
        const int32_t d = lane < r->topk ? sm.fans()[i * r->topk + lane] : -1;
        job.valid = d >= 0;
        job.row = d;
      } else {
        job.valid = lane == 0;
        job.row = static_cast<int32_t>(row);
      }
      job.dst = r->row_buffer + static_cast<int64_t>(job.row < 0 ? 0 : job.row) * r->row_bytes;
      return true;
    }
  }
};

struct CombineRowSource {
  const CombineRole* r;
  TileWalk walk;
  bool opened = false, failed = false;

  __device__ CombineRowSource(const CombineRole& role, const BulkSmem& s, int cta, int nctas, RowPick pick) : r(&role) {
    walk.rows = role.rows;
    walk.table = s.entries();
    walk.tile = cta;
    walk.tiles = role.header->padded_rows / kRowTile;
    walk.nctas = nctas;
    walk.rank = role.peers.rank;
    walk.pick = pick;
    walk.prefetch(cta);
  }
  __device__ bool next(BulkJob& job) {
    const int lane = threadIdx.x & 31;
    for (;;) {
      if (walk.tile >= walk.tiles) return false;
      if (!opened) {
        if (r->out_ready != nullptr) {
          int ok = 1;
          if (lane == 0) {
            ok = wait_geq<Scope::kGpu>(r->out_ready + walk.tile, r->out_ready_target, WaitSite::kCombineSource, r->wait);
            fence_proxy_async_global();  // NOTE: GEMM rows (acquired) before the bulk loads read them
          }
          if (!__shfl_sync(0xffffffffu, ok, 0)) {
            failed = true;
            return false;
          }
        }
        walk.open();
        opened = true;
      }
      const int i = walk.take();
      if (i < 0) {
        walk.tile += walk.nctas;
        opened = false;
        continue;
      }
      const RowEntry e = walk.table[i];
      const int64_t row = walk.tile * kRowTile + i;
      const int64_t slot = static_cast<int64_t>(e.token) * r->topk + e.k;
      job.src = r->expert_out + row * r->row_bytes;
      job.bytes = static_cast<uint32_t>(r->row_bytes);
      job.valid = lane == 0;
      job.dst = r->peers.base[e.src_rank] + r->slots_offset + slot * r->row_bytes;
      job.row = -1;
      return true;
    }
  }
};

// kHybrid, warps 1..nw: the rows of this CTA's tiles that come from (dispatch) or go to (combine)
// other ranks, through registers, without CTA barriers. The j-th such row in CTA order goes to
// warp j mod nw. Dispatch: each warp counts its landed rows per tile (TileRowCounter).
template <bool kCombine, class Role>
__device__ inline bool remote_rows_by_warps(const Role& r, int cta, int nctas, int w, int nw) {
  const int lane = threadIdx.x & 31;
  const int64_t tiles = r.header->padded_rows / kRowTile;
  const int64_t vecs = r.row_bytes / 16;
  const int rank = r.peers.rank;
  TileRowCounter counter;
  if constexpr (!kCombine) counter = TileRowCounter{r.tile_done, r.ready, r.tiles_per_minibatch};
  uint32_t seen = 0;
  for (int64_t tile = cta; tile < tiles; tile += nctas) {
    RowEntry ent[4];  // one batch per tile (no prefetch: the copy loop needs the registers)
#pragma unroll
    for (int q = 0; q < 4; ++q) ent[q] = r.rows[tile * kRowTile + q * 32 + lane];
    if constexpr (kCombine) {
      if (r.out_ready != nullptr) {
        int ok = 1;
        if (lane == 0) ok = wait_geq<Scope::kGpu>(r.out_ready + tile, r.out_ready_target, WaitSite::kCombineSource, r.wait);
        if (!__shfl_sync(0xffffffffu, ok, 0)) return false;  // NOTE: the shuffle orders the lanes after the acquire
      }
    }
    uint32_t mine = 0;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint32_t m = __ballot_sync(0xffffffffu, ent[q].src_rank >= 0 && ent[q].src_rank != rank);
      while (m != 0) {
        const int b = __ffs(m) - 1;
        m &= m - 1;
        if (static_cast<int>(seen++ % static_cast<uint32_t>(nw)) != w) continue;
        const RowEntry e = shfl_entry(ent[q], b);
        const int64_t row = tile * kRowTile + q * 32 + b;
        if constexpr (kCombine) {
          const int64_t slot = static_cast<int64_t>(e.token) * r.topk + e.k;
          char* dst = r.peers.base[e.src_rank] + r.slots_offset + slot * r.row_bytes;
          warp_copy(reinterpret_cast<int4*>(dst), reinterpret_cast<const int4*>(r.expert_out + row * r.row_bytes), vecs,
                    lane, FreshLoad{});
        } else {
          const char* src = dispatch_source(r, e.src_rank, e.token);
          warp_copy(reinterpret_cast<int4*>(r.row_buffer + row * r.row_bytes), reinterpret_cast<const int4*>(src), vecs,
                    lane, StableLoad{});
        }
        ++mine;
        if constexpr (!kCombine) {
          if (lane == 0) counter.resolve();  // the previous tile's count has returned by now
        }
      }
    }
    if constexpr (!kCombine) {
      __syncwarp();  // NOTE: the lanes' row stores before lane 0's release (flush)
      if (lane == 0 && mine > 0) {
        counter.add(tile, mine);
        counter.flush();
      }
    }
  }
  if constexpr (!kCombine) {
    if (lane == 0) counter.finish();
  }
  return true;
}

// Shared memory the standalone kernels give the bulk engines (0 for kWarp).
MOK_HD inline uint32_t role_smem_bytes(CopyEngine e) { return e == CopyEngine::kWarp ? 0u : BulkConfig::kSmemBytes; }
// Usable bytes after aligning the base to 128.
MOK_HD inline uint32_t bulk_usable(uint32_t smem_bytes) { return smem_bytes > 128 ? smem_bytes - 128 : 0; }

// The bulk engines of dispatch (kHybrid or kBulk). `smem` (smem_bytes, 128 of them for
// alignment) is the CTA's dynamic shared memory. Every thread of every comm CTA calls it.
template <CopyEngine E>
__device__ inline void dispatch_pull_bulk(const DispatchRole& r, int cta, int nctas, char* smem, uint32_t smem_bytes) {
  static_assert(E != CopyEngine::kWarp, "kWarp: dispatch_pull(role, cta, nctas)");
  const BulkLayout lay = dispatch_bulk_layout(r, bulk_usable(smem_bytes));
  if (smem == nullptr || lay.bytes == 0) {
    dispatch_pull_warps<StandaloneWarps>(r, cta, nctas);
    return;
  }
  if (r.header->status != static_cast<int32_t>(Status::kOk)) return;  // poisoned schedule (uniform)
  const BulkSmem sm = bulk_setup(smem, lay);
  const int warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  const bool hybrid = E == CopyEngine::kHybrid && nwarps >= 2;
  if (warp == 0) {
    TileRowCounter counter{r.tile_done, r.ready, r.tiles_per_minibatch};
    if (E == CopyEngine::kBulk && dispatch_fans_out(r)) {
      DispatchRowSource<E == CopyEngine::kBulk> source(r, sm, cta, nctas, RowPick::kDispatchFirst);
      bulk_engine<true>(source, sm, counter, WaitSite::kBulkCopy, r.wait);
    } else {
      DispatchRowSource<false> source(r, sm, cta, nctas, hybrid ? RowPick::kDispatchOwn : RowPick::kDispatchAll);
      bulk_engine<true>(source, sm, counter, WaitSite::kBulkCopy, r.wait);
    }
  } else if (hybrid) {
    remote_rows_by_warps<false>(r, cta, nctas, warp - 1, nwarps - 1);
  }
}

// dispatch_pull with the engine the role asks for (kWarp when smem is nullptr).
__device__ inline void dispatch_pull(const DispatchRole& r, int cta, int nctas, char* smem, uint32_t smem_bytes) {
  switch (r.engine) {
    case CopyEngine::kHybrid: dispatch_pull_bulk<CopyEngine::kHybrid>(r, cta, nctas, smem, smem_bytes); break;
    case CopyEngine::kBulk: dispatch_pull_bulk<CopyEngine::kBulk>(r, cta, nctas, smem, smem_bytes); break;
    default: dispatch_pull_warps<StandaloneWarps>(r, cta, nctas);
  }
}

// The bulk engines of combine (same contract as dispatch_pull_bulk). The slots may be read only
// after a phase barrier that follows this role on every rank.
template <CopyEngine E>
__device__ inline void combine_push_bulk(const CombineRole& r, int cta, int nctas, char* smem, uint32_t smem_bytes) {
  static_assert(E != CopyEngine::kWarp, "kWarp: combine_push(role, cta, nctas)");
  const BulkLayout lay = combine_bulk_layout(r, bulk_usable(smem_bytes));
  if (smem == nullptr || lay.bytes == 0) {
    combine_push(r, cta, nctas);
    return;
  }
  if (r.header->status != static_cast<int32_t>(Status::kOk)) return;
  const BulkSmem sm = bulk_setup(smem, lay);
  const int warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  const bool hybrid = E == CopyEngine::kHybrid && nwarps >= 2;
  if (warp == 0) {
    CombineRowSource source(r, sm, cta, nctas, hybrid ? RowPick::kCombineOwn : RowPick::kCombineAll);
    TileRowCounter unused;
    bulk_engine<false>(source, sm, unused, WaitSite::kBulkCopy, r.wait);
  } else if (hybrid) {
    remote_rows_by_warps<true>(r, cta, nctas, warp - 1, nwarps - 1);
  }
}

__device__ inline void combine_push(const CombineRole& r, int cta, int nctas, char* smem, uint32_t smem_bytes) {
  switch (r.engine) {
    case CopyEngine::kHybrid: combine_push_bulk<CopyEngine::kHybrid>(r, cta, nctas, smem, smem_bytes); break;
    case CopyEngine::kBulk: combine_push_bulk<CopyEngine::kBulk>(r, cta, nctas, smem, smem_bytes); break;
    default: combine_push(r, cta, nctas);
  }
}

}  // namespace mok::comm
