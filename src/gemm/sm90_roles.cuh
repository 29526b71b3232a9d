// Warp roles of the sm_90 grouped GEMM as small device functions over a `Kind` (what to
// load, how to seed the accumulators, what the epilogue writes; see gemm_kinds.cuh):
//   tma_producer    one thread: wait empty stage -> expect_tx -> TMA loads of A and B
//   mma_mainloop    one consumer warpgroup: wait full stage -> wgmma 64xBNx64 -> release
//   store_round     epilogue: registers -> swizzled smem box pair -> TMA store
// The same functions are meant to be reused by the fused kernel.
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

#include <type_traits>

#include "gemm/gemm_config.hpp"
#include "gemm/sm90_pipeline.cuh"

namespace mok::gemm {

using cute::_1;
using cute::_2;
using cute::_3;

inline constexpr uint64_t kCacheNormal = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);

// ---- Shared memory -----------------------------------------------------------------------

// FP8 tiles: stage s also holds the 128 fp32 scales of the A tile's rows for its K block
// (TMA-loaded with the codes, counted in the stage's expect_tx). Empty for bf16 tiles.
template <class Cfg, bool = Cfg::kFp8>
struct AScaleRing {};
template <class Cfg>
struct AScaleRing<Cfg, true> {
  alignas(128) float sa[Cfg::kStages][Cfg::kBM];
  alignas(128) float sb[Cfg::kStages][Cfg::kBScaleCols];  // column scales (kColScales), else unused
};

template <class Cfg>
struct alignas(1024) SharedStorage {
  // Stage s: A tile [128 x 64] then B tile [BN x 64], each in the 128B-swizzled layout that
  // the TMA boxes of the kind write (K-major: 128-byte rows of K; MN-major: 64x64 boxes).
  alignas(1024) uint8_t a[Cfg::kStages][Cfg::kABytes];
  alignas(1024) uint8_t b[Cfg::kStages][Cfg::kBBytes];
  alignas(1024) uint8_t epi[Cfg::kConsumerWGs][Cfg::kEpiBytesPerWG];
  [[no_unique_address]] AScaleRing<Cfg> scales;  // FP8 tiles only: the A row scales of each stage
  StageBarriers<Cfg::kStages> bars;
  // The segment offsets (experts + 1 entries) when they fit in the rest of the barrier block
  // (tile_scheduler.cuh, SegOffsets).
  static constexpr int kSegTableCap = (Cfg::kBarrierBytes - static_cast<int>(sizeof(StageBarriers<Cfg::kStages>))) / 4;
  int32_t seg_offsets[kSegTableCap];
};

// Copies the scheduler's segment offsets into shared memory when they fit; returns the copy's
// 32-bit shared address (never 0: it sits behind the stage ring) or 0 to read the device
// array. The scheduler stays a parameter-space constant. All threads take part; the caller
// synchronises after.
template <class Cfg, class Scheduler>
__device__ inline uint32_t cache_segment_offsets(SharedStorage<Cfg>& ss, const Scheduler& sched) {
  const int n = sched.experts + 1;
  if (n > SharedStorage<Cfg>::kSegTableCap) return 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) ss.seg_offsets[i] = __ldg(sched.offsets + i);
  return static_cast<uint32_t>(__cvta_generic_to_shared(ss.seg_offsets));
}

// CuTe view of the operand ring: (rows, 64, stages). MN-major tiles are laid out as TMA
// writes them: 64-wide boxes of the contiguous dimension, each holding all 64 K.
// FP8 tiles: e4m3 with 128-deep K (one 128-byte swizzle row), K-major only.
template <class Cfg>
using OperandT = std::conditional_t<Cfg::kFp8, cute::float_e4m3_t, cute::bfloat16_t>;

template <Major M, int Rows, int Stages, class T = cute::bfloat16_t, int BK = 64>
__device__ inline auto smem_operand_layout() {
  auto shape = cute::make_shape(cute::Int<Rows>{}, cute::Int<BK>{}, cute::Int<Stages>{});
  if constexpr (M == Major::kK) {
    return cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<T>{}, shape);
  } else {
    return cute::tile_to_shape(cute::GMMA::Layout_MN_SW128_Atom<T>{}, shape, cute::Step<_2, _1, _3>{});
  }
}

// The A and B stage rings as CuTe tensors (rows, 64, stages) in the kinds' layouts.
template <class Cfg>
__device__ inline auto smem_a(SharedStorage<Cfg>& ss) {
  using T = OperandT<Cfg>;
  return cute::make_tensor(cute::make_smem_ptr(reinterpret_cast<T*>(ss.a[0])),
                           smem_operand_layout<Cfg::kAMajor, Cfg::kBM, Cfg::kStages, T, Cfg::kBK>());
}
// B is viewed as (kMmaN, BK, stages * kBN / kMmaN): the K-major tile of kBN rows is kBN / kMmaN
// consecutive blocks of kMmaN rows, so block h of stage s is index s * kBN / kMmaN + h (bf16
// tiles: kMmaN == kBN, the plain stage ring).
template <class Cfg>
__device__ inline auto smem_b(SharedStorage<Cfg>& ss) {
  using T = OperandT<Cfg>;
  constexpr int kParts = Cfg::kBN / Cfg::kMmaN;
  static_assert(kParts == 1 || Cfg::kBMajor == Major::kK, "column blocks of a K-major B tile only");
  return cute::make_tensor(cute::make_smem_ptr(reinterpret_cast<T*>(ss.b[0])),
                           smem_operand_layout<Cfg::kBMajor, Cfg::kMmaN, Cfg::kStages * kParts, T, Cfg::kBK>());
}

template <Major M>
constexpr cute::GMMA::Major gmma_major() {
  return M == Major::kK ? cute::GMMA::Major::K : cute::GMMA::Major::MN;
}

// 64xBNx64 wgmma atoms over the two consumer warpgroups, stacked along M: consumer warpgroup w
// owns tile rows [64w, 64w+64).
template <class Cfg>
__device__ inline auto make_consumer_mma() {
  using T = OperandT<Cfg>;
  auto op = cute::GMMA::ss_op_selector<T, T, float, cute::Shape<cute::_64, cute::Int<Cfg::kMmaN>, cute::Int<Cfg::kBK>>,
                                       gmma_major<Cfg::kAMajor>(), gmma_major<Cfg::kBMajor>()>();
  return cute::make_tiled_mma(op, cute::Layout<cute::Shape<cute::Int<Cfg::kConsumerWGs>, _1, _1>>{});
}

// ---- Epilogue stages ---------------------------------------------------------------------
// A kind whose epilogue reads tile-sized inputs from global memory (the dh kind: the saved g,
// u) may send them through the stage ring instead (Kind::kEpilogueStages): after a tile's K
// stages the producer fills Kind::epilogue_stages(p, tile) more stages of
// Kind::kEpilogueStageBytes with Kind::load_epilogue_stage, and the epilogue takes them in
// order from an EpilogueRing. Their TMA loads then run up to a ring depth ahead, under the
// tile's last K steps, as any K stage does, and the epilogue reads shared memory instead of
// waiting on rounds of dependent global loads (docs/gemm.md, dh epilogue).
template <class Kind>
constexpr bool has_epilogue_stages() {
  if constexpr (requires { Kind::kEpilogueStages; }) {
    return Kind::kEpilogueStages;
  } else {
    return false;
  }
}

// The producer's side: the tile's epilogue stages, after its K stages. False on a timeout.
template <class Kind, class Cfg, class Tile>
__device__ inline bool load_epilogue_stages(const typename Kind::Params& p, const Tile& tile,
                                            SharedStorage<Cfg>& ss, PipeState<Cfg::kStages>& st) {
  if constexpr (has_epilogue_stages<Kind>()) {
    const int n = Kind::epilogue_stages(p, tile);
    for (int q = 0; q < n; ++q) {
      if (!wait_barrier(&ss.bars.empty[st.index], st.phase, p.err)) return false;
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.bars.full[st.index],
                                                                     Kind::kEpilogueStageBytes);
      Kind::load_epilogue_stage(p, tile, q, ss.a[st.index], ss.b[st.index], &ss.bars.full[st.index]);
      st.advance();
    }
  }
  return true;
}

template <class Cfg>
__device__ inline void release_stage(SharedStorage<Cfg>& ss, int s, int tid_in_wg);

// The consumers' side: the next stage of the ring, waited for, read, then released (every
// thread of both warpgroups, as a K stage; the release orders this thread's reads before the
// producer's next TMA write into the stage). A timed-out acquire records nothing: the epilogue
// returns false and the consumer reports it after its tile loop (wait_barrier_quiet).
template <class Cfg>
struct EpilogueRing {
  SharedStorage<Cfg>& ss;
  PipeState<Cfg::kStages>& st;
  const ErrorSink& err;
  int tid_in_wg;
  __device__ bool acquire() const { return wait_barrier_quiet(&ss.bars.full[st.index], st.phase, err.timeout_ns); }
  // Shared-window addresses of the stage's A and B slots.
  __device__ uint32_t a_saddr() const { return static_cast<uint32_t>(__cvta_generic_to_shared(ss.a[st.index])); }
  __device__ uint32_t b_saddr() const { return static_cast<uint32_t>(__cvta_generic_to_shared(ss.b[st.index])); }
  __device__ void release() const {
    release_stage(ss, st.index, tid_in_wg);
    st.advance();
  }
  // A tile whose epilogue does not run (a phantom tile of a cluster) still takes its stages.
  __device__ bool skip(int n) const {
    for (int q = 0; q < n; ++q) {
      if (!acquire()) return false;
      release();
    }
    return true;
  }
};

// ---- Producer ----------------------------------------------------------------------------

// One thread issues every TMA load of the CTA. Returns early only on a timeout.
template <class Kind, class Cfg, class Scheduler>
__device__ void tma_producer(const typename Kind::Params& p, SharedStorage<Cfg>& ss,
                             const Scheduler& sched, uint32_t seg, int cluster_id, int clusters, int rank) {
  PipeState<Cfg::kStages> st;
  st.phase = 1;  // fresh empty barriers count as released: the first round does not wait
  const int tiles = sched.num_tiles();
  for (int t = cluster_id, local = 0; t < tiles; t += clusters, ++local) {
    MOK_GEMM_MARK(p.err, local, 5, clock64());
    const auto tile = Kind::tile(p, sched, t, rank, seg);
    Kind::producer_check(p, tile);
    const int k_steps = Kind::k_steps(p, tile);
    MOK_GEMM_MARK(p.err, local, 7, k_steps);
    MOK_GEMM_MARK(p.err, local, 8, clock64());
    (void)local;
    for (int k = 0; k < k_steps; ++k) {
      // With clusters the stage is free only once the consumers of every CTA released it
      // (our multicast writes into the peers' copies of the stage).
      if (!wait_barrier(&ss.bars.empty[st.index], st.phase, p.err)) return;
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.bars.full[st.index],
                                                                     Cfg::kStageBytes);
      if constexpr (Cfg::kFp8) {
        Kind::load_stage(p, tile, k, ss.a[st.index], ss.b[st.index], ss.scales.sa[st.index], ss.scales.sb[st.index],
                         &ss.bars.full[st.index], rank);
      } else {
        Kind::load_stage(p, tile, k, ss.a[st.index], ss.b[st.index], &ss.bars.full[st.index], rank);
      }
      if (k == 0) MOK_GEMM_MARK(p.err, local, 9, clock64());
      st.advance();
    }
    if (!load_epilogue_stages<Kind>(p, tile, ss, st)) return;
    MOK_GEMM_MARK(p.err, local, 6, clock64());
  }
}

// TMA loads: mask == 0 loads into this CTA only; otherwise the box is multicast to the CTAs
// of the mask (same shared-memory offset, same mbarrier offset in each).
__device__ inline void tma_load_2d(const CUtensorMap* map, uint64_t* bar, void* smem, int c0, int c1,
                                   uint16_t mask = 0) {
  if (mask == 0) {
    cute::SM90_TMA_LOAD_2D::copy(map, bar, kCacheNormal, smem, c0, c1);
  } else {
    cute::SM90_TMA_LOAD_MULTICAST_2D::copy(map, bar, mask, kCacheNormal, smem, c0, c1);
  }
}
__device__ inline void tma_load_3d(const CUtensorMap* map, uint64_t* bar, void* smem, int c0, int c1, int c2,
                                   uint16_t mask = 0) {
  if (mask == 0) {
    cute::SM90_TMA_LOAD_3D::copy(map, bar, kCacheNormal, smem, c0, c1, c2);
  } else {
    cute::SM90_TMA_LOAD_MULTICAST_3D::copy(map, bar, mask, kCacheNormal, smem, c0, c1, c2);
  }
}

// The B tile is `Boxes` boxes. Alone (or when the cluster's CTAs need different B tiles)
// a CTA loads all of them; in a cluster sharing B, CTA `rank` loads its 1/C share and
// multicasts it. load(box, mask) issues one box.
template <int C, int Boxes, class LoadFn>
__device__ inline void load_b_boxes(bool shared, int rank, LoadFn load) {
  if (C > 1 && shared) {
#pragma unroll
    for (int b = 0; b < Boxes / C; ++b) load(rank * (Boxes / C) + b, static_cast<uint16_t>((1u << C) - 1));
  } else {
#pragma unroll
    for (int b = 0; b < Boxes; ++b) load(b, static_cast<uint16_t>(0));
  }
}

// ---- Consumer mainloop -------------------------------------------------------------------

// K loop of one tile for one consumer warpgroup: one wgmma batch (4 x k16) per stage, one
// batch kept in flight, the previous stage released as soon as its batch retired. The
// accumulators keep their content (zeros or a seed): the K order is fixed, 0..k_steps-1.
// Releases stage s. Alone: every consumer thread arrives (count 256). In a cluster: two
// threads per warpgroup arrive, one on each CTA's barrier (count 2 warpgroups x 2 CTAs);
// a warpgroup's wgmma completes as a whole, so one thread may speak for it.
template <class Cfg>
__device__ inline void release_stage(SharedStorage<Cfg>& ss, int s, int tid_in_wg) {
  if constexpr (Cfg::kClusterM == 1) {
    cutlass::arch::ClusterBarrier::arrive(&ss.bars.empty[s]);
  } else {
    constexpr int kSpacing = kWarpGroupThreads / Cfg::kClusterM;
    cutlass::arch::ClusterBarrier::arrive(&ss.bars.empty[s], tid_in_wg / kSpacing, tid_in_wg % kSpacing == 0);
  }
}
template <class Cfg>
constexpr int empty_barrier_arrivals() {
  return Cfg::kClusterM == 1 ? Cfg::kConsumerThreads : Cfg::kConsumerWGs * Cfg::kClusterM;
}

// The batch after which hook work wanted after batch `want` runs in a K loop of k_steps
// batches: `want`, or the last batch of a shorter loop (-1 without batches, see mma_mainloop).
__device__ inline int hook_slot(int want, int k_steps) { return k_steps > want ? want : k_steps - 1; }

struct NoHook {
  __device__ void operator()(int) const {}
};

// during_k_loop(k) runs right after wgmma batch k was issued, for every k (once with k = -1
// when there is no K step). Up to two batches (~2k cycles of tensor work) are then in flight,
// so work placed there (the next tile's coordinates, a deferred epilogue) overlaps the tensor
// cores instead of delaying the next tile's first wgmma. It must not touch `acc`. Use
// hook_slot() to pick the batch after which a piece of work runs.
template <class Cfg, class Mma, class FragA, class FragB, class Acc, class Hook = NoHook>
__device__ bool mma_mainloop(SharedStorage<Cfg>& ss, PipeState<Cfg::kStages>& st, int k_steps,
                             Mma& mma, const FragA& tCrA, const FragB& tCrB, Acc& acc,
                             const ErrorSink& err, int tid_in_wg, int trace_tile = -1,
                             Hook during_k_loop = {}) {
  using cute::_;
  int prev = -1;
  (void)trace_tile;
  if (k_steps <= 0) during_k_loop(-1);
  for (int k = 0; k < k_steps; ++k) {
    if (!wait_barrier(&ss.bars.full[st.index], st.phase, err)) return false;
    if (k == 0) MOK_GEMM_MARK(err, trace_tile, 2, clock64());
    cute::warpgroup_fence_operand(acc);
    cute::warpgroup_arrive();
    cute::gemm(mma, tCrA(_, _, _, st.index), tCrB(_, _, _, st.index), acc);
    cute::warpgroup_commit_batch();
    during_k_loop(k);
    cute::warpgroup_wait<1>();
    cute::warpgroup_fence_operand(acc);
    if (prev >= 0) release_stage(ss, prev, tid_in_wg);
    prev = st.index;
    st.advance();
  }
  cute::warpgroup_wait<0>();
  cute::warpgroup_fence_operand(acc);
  if (prev >= 0) release_stage(ss, prev, tid_in_wg);
  return true;
}

// ---- Epilogue ----------------------------------------------------------------------------

// Where one consumer thread's accumulator values sit. wgmma m64nN fragment, value i:
// row = 16*warp + lane/4 + 8*((i/2)%2), col = 8*(i/4) + 2*(lane%4) + i%2 (PTX ISA, D layout).
struct EpiCtx {
  int wg;      // consumer warpgroup: tile rows [64*wg, 64*wg + 64)
  int tid;     // thread in the warpgroup
  uint8_t* stage;  // this warpgroup's staging: kEpiBuffers x 16 KiB (two 64x64 SW128 boxes each)
  uint32_t stage_saddr;  // its shared-window address

  __device__ int lane() const { return tid % 32; }
  __device__ int row_in_wg(int v1) const { return 16 * (tid / 32) + (tid % 32) / 4 + 8 * v1; }
  __device__ int row_in_tile(int v1) const { return 64 * wg + row_in_wg(v1); }
  __device__ int col(int j) const { return 8 * j + 2 * (tid % 4); }  // first of a column pair
  __device__ uint32_t barrier_id() const {
    return static_cast<uint32_t>(wg == 0 ? NamedBarrier::kEpilogueWG0 : NamedBarrier::kEpilogueWG1);
  }
};

// The context of consumer thread `tid` (0..127) of warpgroup `wg`: its staging buffers.
template <class Cfg>
__device__ inline EpiCtx make_epi_ctx(SharedStorage<Cfg>& ss, int wg, int tid) {
  EpiCtx ctx;
  ctx.wg = wg;
  ctx.tid = tid;
  ctx.stage = ss.epi[wg];
  ctx.stage_saddr = static_cast<uint32_t>(__cvta_generic_to_shared(ctx.stage));
  return ctx;
}

// Byte offset in the staging box pair of this thread's column pair in fragment block jj
// (0..15) and row half v1: element (r, c) of two 64x64 bf16 boxes with the TMA 128B swizzle
// (16-byte chunk index XOR row mod 8). For a thread r mod 8 = lane/4 and the byte within the
// chunk is 4*(lane%4), so only the chunk XOR depends on jj; writes of a warp hit 32 banks.
__device__ inline uint32_t staged_offset(const EpiCtx& ctx, int jj, int v1) {
  const int lane = ctx.tid % 32;
  const uint32_t base = (16 * (ctx.tid / 32) + lane / 4) * 128 + 4 * (lane % 4);
  const uint32_t chunk = ((jj % 8) << 4) ^ ((lane / 4) << 4);
  return (jj / 8) * 8192 + v1 * 1024 + base + chunk;
}

// The `issue` of a store round into a 2-D bf16 tensor: box b (64 columns) goes to columns
// col0 + 64 b of the warpgroup's 64 rows from row0; boxes starting at or past `cols` are
// skipped (TMA clips a partly outside box itself, a fully outside one would be an error).
struct Box2dStore {
  const CUtensorMap* map;
  int col0, cols, row0;
  __device__ void operator()(uint8_t* box, int b) const {
    if (col0 + 64 * b < cols) cute::SM90_TMA_STORE_2D::copy(map, box, col0 + 64 * b, row0);
  }
};

// The same into expert `expert` of a 3-D [experts, rows, cols] tensor (wgrad's weight
// gradients); a round whose 64 rows start at or past `rows` is skipped too.
struct Box3dStore {
  const CUtensorMap* map;
  int col0, cols, row0, rows, expert;
  __device__ void operator()(uint8_t* box, int b) const {
    if (col0 + 64 * b < cols && row0 < rows) cute::SM90_TMA_STORE_3D::copy(map, box, col0 + 64 * b, row0, expert);
  }
};

// One store round: the warpgroup writes 64 rows x 128 columns (column pairs of fragment
// blocks J0..J0+15, values from pair(i) = packed bf16x2 of fragment values i, i+1) into a
// staging buffer, then one thread stores it with `issue(box_smem, box)`. Round (0, 1, ... within
// the tile's epilogue, compile-time) picks the buffer, Round % kEpiBuffers. A buffer is reused
// only after the TMA reads of the round that last used it finished: with one buffer that is
// the previous round; with two the round before it, except in round 0, whose predecessor may
// be the previous tile's last round in the same buffer (its stores finished during this
// tile's K loop, so that wait costs nothing).
// `after(stage_saddr)` runs in every thread of the warpgroup once the staging buffer is complete
// (the fused forward's GEMM 2 also copies its rows of other ranks' tokens from it: fused_push.cuh);
// the default does nothing. Its reads of the buffer end before the buffer's next use (the next
// round's barrier).
struct NoAfterStaging {
  __device__ void operator()(uint32_t) const {}
};
template <int J0, int Round, class PairFn, class IssueFn, class AfterFn = NoAfterStaging>
__device__ inline void store_round(const EpiCtx& ctx, PairFn pair, IssueFn issue, AfterFn after = {}) {
  constexpr uint32_t kBufBytes = 2 * 64 * kBoxInner * 2;
  constexpr uint32_t kBuf = static_cast<uint32_t>(Round % kEpiBuffers);
  uint8_t* const stage = ctx.stage + kBuf * kBufBytes;
  const uint32_t stage_saddr = ctx.stage_saddr + kBuf * kBufBytes;
  if (ctx.tid == 0) cute::tma_store_wait<(Round == 0 ? 0 : kEpiBuffers - 1)>();
  named_barrier_sync(ctx.barrier_id(), kWarpGroupThreads);
#pragma unroll
  for (int jj = 0; jj < 16; ++jj) {
#pragma unroll
    for (int v1 = 0; v1 < 2; ++v1) {
      const int i = 4 * (J0 + jj) + 2 * v1;
      const uint32_t bits = pair(i);
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(stage_saddr + staged_offset(ctx, jj, v1)), "r"(bits));
    }
  }
  cute::tma_store_fence();  // make the generic-proxy smem writes visible to the TMA unit
  named_barrier_sync(ctx.barrier_id(), kWarpGroupThreads);
  if (ctx.tid == 0) {
    issue(stage, 0);
    issue(stage + 8192, 1);
    cute::tma_store_arrive();
  }
  after(stage_saddr);
}

// ---- FP8 consumer mainloop -------------------------------------------------------------

// K loop of one FP8 tile for one consumer warpgroup (the recipe's two-level accumulation,
// docs/fp8.md). For each column block c of kMmaN columns (kBN / kMmaN of them: GEMM 1's gate
// and up blocks), a wgmma batch (4 x k32) sums the stage's 128-deep K block into `part`
// (starting from zero); once it retired, its values are promoted into the block's values of
// `acc` (acc(64 c + i), the fragment order of the whole tile):
//   acc = fmaf(part, sa[row] * sb, acc)
// with sa the A row's scale of the K block (from the stage) and sb = Kind::b_scale(p, tile, k, c)
// the weight block's (uniform over a column block: kMmaN <= 128 columns of one 128-row block).
// The promotion needs the batch retired, so a warpgroup keeps none in flight across it; the two
// consumer warpgroups alternate on the tensor cores. The K order is fixed: bitwise reproducible.
// The stage is released once its last batch retired (its scales were read before).
template <class Kind, class Cfg, class Tile, class Mma, class FragA, class FragB, class Acc, class Part,
          class Hook = NoHook>
__device__ bool mma_mainloop_fp8(const typename Kind::Params& p, const Tile& tile, SharedStorage<Cfg>& ss,
                                 PipeState<Cfg::kStages>& st, int k_steps, Mma& mma, const FragA& tCrA,
                                 const FragB& tCrB, Acc& acc, Part& part, const EpiCtx& ctx, int trace_tile = -1,
                                 Hook during_k_loop = {}) {
  using cute::_;
  constexpr int kParts = Cfg::kBN / Cfg::kMmaN;
  constexpr int kPartSize = decltype(cute::size(part))::value;
  static_assert(kPartSize * kParts == decltype(cute::size(acc))::value, "column blocks tile the fragment");
  (void)trace_tile;
  if (k_steps <= 0) during_k_loop(-1);
  const int r0 = ctx.row_in_tile(0), r1 = ctx.row_in_tile(1);
  for (int k = 0; k < k_steps; ++k) {
    float sb[kParts];
#pragma unroll
    for (int c = 0; c < kParts; ++c) sb[c] = Kind::b_scale(p, tile, k, c);
    if (!wait_barrier(&ss.bars.full[st.index], st.phase, p.err)) return false;
    if (k == 0) MOK_GEMM_MARK(p.err, trace_tile, 2, clock64());
    const float sa0 = ss.scales.sa[st.index][r0], sa1 = ss.scales.sa[st.index][r1];
#pragma unroll
    for (int c = 0; c < kParts; ++c) {
      cute::warpgroup_fence_operand(part);
      cute::warpgroup_arrive();
      mma.accumulate_ = cute::GMMA::ScaleOut::Zero;
#pragma unroll
      for (int kb = 0; kb < cute::size<2>(tCrA); ++kb) {
        cute::gemm(mma, tCrA(_, _, kb, st.index), tCrB(_, _, kb, st.index * kParts + c), part);
        mma.accumulate_ = cute::GMMA::ScaleOut::One;
      }
      cute::warpgroup_commit_batch();
      if (c == 0) during_k_loop(k);
      cute::warpgroup_wait<0>();
      cute::warpgroup_fence_operand(part);
      if constexpr (Cfg::kColScales) {
        // acc = fmaf(part, sa[row] * sb[col], acc), sb from the stage (read before its release).
        const float* sbc = ss.scales.sb[st.index] + Cfg::kMmaN * c;
#pragma unroll
        for (int i = 0; i < kPartSize; i += 2) {
          const float2 sbv = *reinterpret_cast<const float2*>(sbc + ctx.col(i / 4));
          const float sar = (i / 2) % 2 ? sa1 : sa0;
          acc(kPartSize * c + i) = fmaf(part(i), sar * sbv.x, acc(kPartSize * c + i));
          acc(kPartSize * c + i + 1) = fmaf(part(i + 1), sar * sbv.y, acc(kPartSize * c + i + 1));
        }
        if (c == kParts - 1) {
          release_stage(ss, st.index, ctx.tid);
          st.advance();
        }
      } else {
        if (c == kParts - 1) {
          release_stage(ss, st.index, ctx.tid);
          st.advance();
        }
        const float s0 = sa0 * sb[c], s1 = sa1 * sb[c];
#pragma unroll
        for (int i = 0; i < kPartSize; ++i) {
          acc(kPartSize * c + i) = fmaf(part(i), (i / 2) % 2 ? s1 : s0, acc(kPartSize * c + i));
        }
      }
    }
  }
  return true;
}

}  // namespace mok::gemm
