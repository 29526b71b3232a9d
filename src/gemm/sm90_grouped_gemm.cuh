// The persistent, warp-specialised sm_90a grouped GEMM kernel. The entry only sets up shared
// memory and barriers and dispatches roles (sm90_roles.cuh); a `Kind` (sm90_kinds_*.cuh)
// supplies the operands, the K range of a tile, the accumulator seed and the epilogue.
//
//   warpgroup 0 (40 regs)   thread 0: tma_producer  (other threads idle)
//   warpgroups 1, 2 (232)   mma_mainloop + Kind::epilogue on rows [0,64) / [64,128) of a tile
#pragma once

#include <cute/arch/cluster_sm90.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include <type_traits>
#include <utility>

#include "gemm/sm90_roles.cuh"

namespace mok::gemm {

template <class Kind>
constexpr bool deferred_epilogue() {
  if constexpr (requires { Kind::kDeferredEpilogue; }) {
    return Kind::kDeferredEpilogue;
  } else {
    return false;
  }
}

// A deferred epilogue is stored in pieces (Kind::kDeferredPieces, default 2: the two
// 128-column store rounds), piece P by Kind::store_piece<P> after wgmma batch
// Kind::piece_batch(p, P) of the next tile's K loop.
template <class Kind>
constexpr int deferred_pieces() {
  if constexpr (requires { Kind::kDeferredPieces; }) {
    return Kind::kDeferredPieces;
  } else {
    return 2;
  }
}

// A deferred epilogue's tile in waiting: its bf16 bits and where they go (empty for kinds
// that store at once).
template <class Kind, bool = deferred_epilogue<Kind>()>
struct PendingStore {};
template <class Kind>
struct PendingStore<Kind, true> {
  typename Kind::Packed packed;
  typename Kind::Pending where{};
  bool waiting = false;
};

// Consumer warpgroups: operand views, descriptors and the accumulator of this thread; then
// per tile: seed, K loop, epilogue (phantom tiles of a cluster are computed, never stored).
// The next tile's coordinates (a few dependent loads of the segment table, ~1-3k cycles) are
// computed inside the K loop, under the wgmma batches in flight (mma_mainloop's hook).
// Kinds with a deferred epilogue (Kind::kDeferredEpilogue) only round a finished tile into
// registers (Kind::pack); its stores (staging, barriers, TMA) run inside the next tile's K
// loop, after some of its batches (Params::defer_*), where they overlap the tensor cores; the
// last tile is stored after the loop.
template <class Kind, class Cfg, class Scheduler>
__device__ void consumer_warpgroup(const typename Kind::Params& p, SharedStorage<Cfg>& ss, const Scheduler& sched,
                                   uint32_t seg, int cluster_id, int clusters, int rank) {
  constexpr bool kDeferred = deferred_epilogue<Kind>();
  const int ctid = threadIdx.x - kWarpGroupThreads;
  auto mma = make_consumer_mma<Cfg>();
  auto thr = mma.get_thread_slice(ctid);
  auto tCrA = thr.make_fragment_A(thr.partition_A(smem_a(ss)));
  auto tCrB = thr.make_fragment_B(thr.partition_B(smem_b(ss)));
  auto acc = cute::partition_fragment_C(mma, cute::make_shape(cute::Int<Cfg::kBM>{}, cute::Int<Cfg::kBN>{}));
  static_assert(decltype(cute::size(acc))::value == Cfg::kBN / 2, "64xBN fragment per thread");
  // FP8 tiles: the fragment each stage's wgmma batch sums into before its promotion.
  [[maybe_unused]] auto part = cute::partition_fragment_C(mma, cute::make_shape(cute::Int<Cfg::kBM>{}, cute::Int<Cfg::kMmaN>{}));

  const EpiCtx ctx = make_epi_ctx(ss, ctid / kWarpGroupThreads, ctid % kWarpGroupThreads);

  PipeState<Cfg::kStages> st;
  const int tiles = sched.num_tiles();
  // Trace marks (developer build only) come from thread 0 of consumer warpgroup 0.
  const bool marks = ctx.wg == 0 && ctx.tid == 0;
  (void)marks;
  [[maybe_unused]] PendingStore<Kind> pending;
  // Warpgroup 1 may store its deferred pieces some batches after warpgroup 0
  // (Params::defer_wg1_shift), so the two never pause their wgmma issue together. Made
  // warp-uniform through a shuffle: a threadIdx-derived value near wgmma serialises it.
  [[maybe_unused]] int wg1_shift = 0;
  if constexpr (kDeferred) wg1_shift = __shfl_sync(0xffffffffu, ctx.wg == 1 ? p.defer_wg1_shift : 0, 0);
  bool ok = true, epilogue_timeout = false;
  if (marks) {
    MOK_GEMM_CTA_MARK(p.err, 0, smid());
    MOK_GEMM_CTA_MARK(p.err, 1, global_timer_ns());
    MOK_GEMM_CTA_MARK(p.err, 2, clock64());
  }
  int local_tiles = 0;
  (void)local_tiles;
  auto tile = Kind::tile(p, sched, cluster_id < tiles ? cluster_id : 0, rank, seg);
  for (int t = cluster_id, local = 0; t < tiles; t += clusters, ++local) {
    local_tiles = local + 1;
    const int mark_tile = marks ? local : -1;
    (void)mark_tile;
    MOK_GEMM_MARK(p.err, mark_tile, 0, clock64());
    Kind::seed(p, tile, ctx, acc);
    MOK_GEMM_MARK(p.err, mark_tile, 1, clock64());
    auto next = tile;
    const int k_steps = Kind::k_steps(p, tile);
    // The batches after which the hook's work runs. The next tile's coordinates: after the
    // second batch (two batches, ~2k cycles, cover their ~1-3k cycles). Deferred epilogues:
    // the previous tile's store pieces and the next tile's coordinates each after their own
    // batch (Kind::piece_batch, Params::defer_*; for the two-round kinds batches 1, 3, 5
    // measured best of 0-1-2, 1-2-3, 1-2-4, 1-3-5, 2-4-6), so each piece (~1k cycles) is
    // covered by the batches in flight.
    constexpr int kPieces = kDeferred ? deferred_pieces<Kind>() : 1;
    int piece_slot[kPieces], next_at;
    if constexpr (kDeferred) {
#pragma unroll
      for (int q = 0; q < kPieces; ++q) piece_slot[q] = hook_slot(Kind::piece_batch(p, q) + wg1_shift, k_steps);
      next_at = hook_slot(p.defer_next, k_steps);
    } else {
      next_at = hook_slot(1, k_steps);
    }
    // Piece P of the waiting tile, if batch k is its slot.
    auto piece_at = [&]<int P>(std::integral_constant<int, P>, int k) {
      if constexpr (kDeferred) {
        if (pending.waiting && k == piece_slot[P]) Kind::template store_piece<P>(p, pending.where, ctx, pending.packed);
      }
    };
    auto during_k_loop = [&](int k) {
      piece_at(std::integral_constant<int, 0>{}, k);
      if (k == next_at && t + clusters < tiles) next = Kind::tile(p, sched, t + clusters, rank, seg);
      [&]<int... P>(std::integer_sequence<int, P...>) {
        (piece_at(std::integral_constant<int, P + 1>{}, k), ...);
      }(std::make_integer_sequence<int, kPieces - 1>{});
    };
    if constexpr (Cfg::kFp8) {
      ok = mma_mainloop_fp8<Kind>(p, tile, ss, st, k_steps, mma, tCrA, tCrB, acc, part, ctx, mark_tile, during_k_loop);
    } else {
      ok = mma_mainloop<Cfg>(ss, st, k_steps, mma, tCrA, tCrB, acc, p.err, ctx.tid, mark_tile, during_k_loop);
    }
    if (!ok) break;
    MOK_GEMM_MARK(p.err, mark_tile, 3, clock64());
    if constexpr (kDeferred) {
      Kind::pack(p, tile, ctx, acc, pending.packed);
      pending.where = Kind::pending_of(tile);
      pending.waiting = !tile.phantom;
    } else if constexpr (has_epilogue_stages<Kind>()) {
      // The epilogue takes the tile's epilogue stages from the ring (a phantom tile skips them).
      const EpilogueRing<Cfg> ring{ss, st, p.err, ctx.tid};
      ok = tile.phantom ? ring.skip(Kind::epilogue_stages(p, tile)) : Kind::epilogue(p, tile, ctx, acc, ring);
      if (!ok) {
        epilogue_timeout = true;  // reported after the loop
        break;
      }
    } else {
      if (!tile.phantom) Kind::epilogue(p, tile, ctx, acc);
    }
    MOK_GEMM_MARK(p.err, mark_tile, 4, clock64());
    tile = next;
  }
  if constexpr (kDeferred) {
    if (ok && pending.waiting) {
      [&]<int... P>(std::integer_sequence<int, P...>) {
        (Kind::template store_piece<P>(p, pending.where, ctx, pending.packed), ...);
      }(std::make_integer_sequence<int, deferred_pieces<Kind>()>{});
    }
  }
  // NOTE: a timed-out epilogue stage is reported here, outside the tile loop (report_timeout_no_trap).
  if (epilogue_timeout) report_timeout_no_trap(p.err);
  if (ctx.tid == 0) tma_store_wait_all_complete();
  if (marks) {
    MOK_GEMM_CTA_MARK(p.err, 3, global_timer_ns());
    MOK_GEMM_CTA_MARK(p.err, 4, clock64());
    MOK_GEMM_CTA_MARK(p.err, 5, local_tiles);
  }
}

template <class Kind>
__global__ void __launch_bounds__(Kind::Cfg::kThreads, 1)
    sm90_grouped_gemm_kernel(const __grid_constant__ typename Kind::Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Cfg = typename Kind::Cfg;
  constexpr int C = Cfg::kClusterM;
  extern __shared__ uint8_t smem_raw[];
  // TMA SWIZZLE_128B and the GMMA descriptors need 1024-byte aligned tiles. The offset is the
  // same in every CTA, so multicast writes land at matching addresses.
  auto* ss = reinterpret_cast<SharedStorage<Cfg>*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int warpgroup = threadIdx.x / kWarpGroupThreads;
  const int rank = C > 1 ? static_cast<int>(cute::block_rank_in_cluster()) : 0;
  const int cluster_id = blockIdx.x / C, clusters = gridDim.x / C;

  if (threadIdx.x == 0) {
    ss->bars.init(empty_barrier_arrivals<Cfg>());
    Kind::prefetch_descriptors(p);
  }
  const auto sched = Kind::scheduler(p);
  const uint32_t seg = Kind::kSegTable ? cache_segment_offsets(*ss, sched) : 0u;
  // Barriers of every CTA of the cluster are initialised (and the segment table copied)
  // before anyone multicasts, arrives or schedules.
  if constexpr (C > 1) cute::cluster_sync(); else __syncthreads();

  // NOTE: no CTA of a cluster may exit while a peer can still multicast into its shared
  // memory or arrive on its barriers: every thread ends with a cluster barrier. It is called
  // inside each role's branch: a common exit path shared by the 40- and the 232-register
  // roles makes ptxas serialise wgmma (C7512).
  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    if (threadIdx.x == 0) tma_producer<Kind>(p, *ss, sched, seg, cluster_id, clusters, rank);
    if constexpr (C > 1) cute::cluster_sync();
  } else {
    cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
    consumer_warpgroup<Kind>(p, *ss, sched, seg, cluster_id, clusters, rank);
    if constexpr (C > 1) cute::cluster_sync();
  }
#endif
}

}  // namespace mok::gemm
