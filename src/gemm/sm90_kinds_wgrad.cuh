// The K-grouped wgrad kind: dW[e] [M, N] = sum over the expert's rows of a[r]^T b[r].
// Both operands are MN-major (rows of the buffer are the K dimension): A tiles are two
// 64x64 boxes of a [rows, M], B tiles four 64x64 boxes of b [rows, N]. Up to three problems
// (dW_down; dW_gate, dW_up) share one launch; tiles are (problem, expert, m, n).
#pragma once

#include <cuda.h>

#include <utility>

#include "gemm/sm90_roles.cuh"
#include "gemm/swiglu_math.cuh"
#include "gemm/tile_scheduler.cuh"

namespace mok::gemm {

enum WgradMode : int { kWgradPartialFp32 = 0, kWgradWriteBf16 = 1, kWgradAccumulateFp32 = 2 };  // == WgradOut

struct WgradProblemParams {
  CUtensorMap a;    // [rows, M], box 64 x 64
  CUtensorMap b;    // [rows, N], box 64 x 64
  CUtensorMap out;  // bf16 [E, M, N], box 64 x 64 x 1 (kWriteBf16); fp32, box 32 x 64 x 1 (kAccumulateFp32)
  int m, n;
  const float* partial_in;  // or nullptr: start from zeros
  void* out_ptr;
};
struct WgradParams {
  WgradProblemParams problems[kMaxWgradProblems];
  KGroupedScheduler sched;
  ErrorSink err;
  // Deferred bf16 epilogue: after which wgmma batch of the next tile's K loop the previous
  // tile's store rounds 0 and 1 and the next tile's coordinates run (hook_slot).
  int defer_round0 = 1, defer_next = 3, defer_round1 = 5;
  int defer_wg1_shift = kDeferWg1Shift;  // warpgroup 1's pieces this many batches later
};

// The deferred bf16 store of a wgrad tile of kCols columns (the bf16 kind's 256, the FP8 kind's 128;
// consumer_warpgroup, kDeferredEpilogue): the finished tile is rounded into kCols / 4 registers of bf16
// pairs right after its K loop and stored in kCols / 128 rounds (staging + TMA) inside the next tile's
// K loop, after batches Params::defer_round0 (and defer_round1). Derived supplies out_map(problem), the
// bf16 [E, M, N] output's tensor map (box 64 x 64 x 1).
template <class Derived, int kCols>
struct DeferredWgradBf16 {
  static_assert(kCols == 128 || kCols == 256, "one or two 128-column store rounds");
  static constexpr int kDeferredPieces = kCols / 128;
  struct Packed {
    uint32_t v[kCols / 4];  // v[i / 2] = bf16x2 of fragment values (i, i + 1)
  };
  struct Pending {  // what the deferred store needs of a tile
    int problem, expert, m_tile, n_tile;
  };
  __device__ static Pending pending_of(const KTile& t) { return {t.problem, t.expert, t.m_tile, t.n_tile}; }
  template <class P, class Acc>
  __device__ static void pack(const P&, const KTile&, const EpiCtx&, const Acc& acc, Packed& out) {
#pragma unroll
    for (int i = 0; i < kCols / 4; ++i) out.v[i] = pack_bf16x2(acc(2 * i), acc(2 * i + 1));
  }
  template <class P>
  __device__ static int piece_batch(const P& p, int piece) {
    if constexpr (kDeferredPieces == 1) {
      return p.defer_round0;
    } else {
      return piece == 0 ? p.defer_round0 : p.defer_round1;
    }
  }
  // Columns [128 * Half, 128 * Half + 128) of the tile: one store round.
  template <int Half, class P>
  __device__ static void store_piece(const P& p, const Pending& t, const EpiCtx& ctx, const Packed& pk) {
    const auto& pr = p.problems[t.problem];
    const CUtensorMap* map = Derived::out_map(pr);
    const int col0 = kCols * t.n_tile + 128 * Half, row0 = 128 * t.m_tile + 64 * ctx.wg;
    store_round<16 * Half, Half>(ctx, [&](int i) { return pk.v[i / 2]; },
                                 Box3dStore{map, col0, pr.n, row0, pr.m, t.expert});
  }
};

// The output mode is a template parameter: a runtime branch around the accumulator reads
// makes ptxas serialise every wgmma (C7518). So is whether any problem of the launch carries
// an fp32 partial to continue: without one (the common case) the seed is plain zeros instead
// of 64 predicated-off loads with their address arithmetic per thread and tile, which at
// 8 K steps per tile (DeepSeek-V3 sizes) sit on the critical path before every K loop.
template <int Mode, int C, bool Seeded = true>
struct WgradKind : DeferredWgradBf16<WgradKind<Mode, C, Seeded>, 256> {
  using Cfg = TileConfig<256, kPipeStages, Major::kMN, Major::kMN, C>;

  using Problem = WgradProblemParams;
  using Params = WgradParams;

  // bf16 output: the epilogue is deferred (consumer_warpgroup, kDeferredEpilogue). A tile's result is
  // rounded into 64 registers of bf16 pairs right after its K loop, and stored (staging +
  // TMA, with its barriers and waits) while the next tile's first wgmma batches run. At
  // DeepSeek-V3 sizes a tile has only 8 K steps, so the ~2k-cycle store epilogue was ~18 %
  // of the tile with the tensor cores idle (docs/gemm.md, trace).
  static constexpr bool kDeferredEpilogue = Mode == kWgradWriteBf16;
  // Tile coordinates from a shared-memory copy of the offsets (SegOffsets) in the bf16 kernel
  // without a partial, where it measured +2-3 % (8 K steps per tile: every cycle outside the K
  // loop counts). Not in the others: the fp32 accumulate kernel measured 4-12 % slower with
  // it, and the seeding partial-output one spilled 4 bytes (docs/gemm.md).
  static constexpr bool kSegTable = Mode == kWgradWriteBf16 && !Seeded;
  __device__ static const CUtensorMap* out_map(const Problem& pr) { return &pr.out; }

  // NOTE: problems are reached through their address (grid-constant parameter space);
  // indexing the array by value would copy it to local memory.
  __device__ static const Problem& problem(const Params& p, const KTile& t) { return p.problems[t.problem]; }

  __device__ static void prefetch_descriptors(const Params& p) {
    for (int q = 0; q < p.sched.num_problems; ++q) {
      cute::prefetch_tma_descriptor(&p.problems[q].a);
      cute::prefetch_tma_descriptor(&p.problems[q].b);
    }
  }
  __device__ static KGroupedScheduler scheduler(const Params& p) { return p.sched; }
  __device__ static KTile tile(const Params&, const KGroupedScheduler& s, int t, int rank, uint32_t seg_smem = 0) {
    return s.tile(t, rank, seg_smem);
  }
  __device__ static void producer_check(const Params& p, const KTile& t) { p.sched.check_range(t.expert, p.err); }
  __device__ static int k_steps(const Params&, const KTile& t) { return t.k_steps; }

  __device__ static void load_stage(const Params& p, const KTile& t, int k, uint8_t* a, uint8_t* b, uint64_t* bar,
                                    int rank) {
    const Problem& pr = problem(p, t);
    const int row = t.row0 + kKStepRows * k;
#pragma unroll
    for (int box = 0; box < 2; ++box) tma_load_2d(&pr.a, bar, a + box * 8192, 128 * t.m_tile + 64 * box, row);
    load_b_boxes<C, 4>(t.shared_b, rank, [&](int box, uint16_t mask) {
      tma_load_2d(&pr.b, bar, b + box * 8192, 256 * t.n_tile + 64 * box, row, mask);
    });
  }

  // Element (m, n) of dW[e] held by fragment pair i of this thread, and whether it exists.
  struct Coord {
    int64_t offset;  // (e*M + m)*N + n
    bool in;
  };
  __device__ static Coord coord(const Problem& pr, const KTile& t, const EpiCtx& ctx, int i) {
    const int m = 128 * t.m_tile + ctx.row_in_tile((i / 2) % 2);
    const int n = 256 * t.n_tile + ctx.col(i / 4);
    return {(static_cast<int64_t>(t.expert) * pr.m + m) * pr.n + n, m < pr.m && n < pr.n};
  }

  // Accumulators start from the fp32 partial of an earlier call (exact reload) or zeros;
  // coord_of(pr, i) places fragment pair i (the kind's own fragment layout). Without any
  // partial in the launch (Seeded = false) they are plain zeros.
  // NOTE: accumulator registers are only written by predicated instructions, never under a
  // branch: a divergent definition makes ptxas serialise every wgmma (C7518).
  template <class Acc, class CoordOf>
  __device__ static void seed_acc(const Params& p, const KTile& t, Acc& acc, CoordOf coord_of) {
    if constexpr (!Seeded) {
#pragma unroll
      for (int i = 0; i < cute::size(acc); ++i) acc(i) = 0.0f;
      return;
    }
    const Problem& pr = problem(p, t);
    const float* partial = pr.partial_in;
    const bool any = partial != nullptr;
#pragma unroll
    for (int i = 0; i < cute::size(acc); i += 2) {
      const Coord c = coord_of(pr, i);
      ld_f2_pred(partial + c.offset, any && c.in, acc(i), acc(i + 1));
    }
  }
  template <class Acc>
  __device__ static void seed(const Params& p, const KTile& t, const EpiCtx& ctx, Acc& acc) {
    seed_acc(p, t, acc, [&](const Problem& pr, int i) { return coord(pr, t, ctx, i); });
  }

  // kWgradPartialFp32 (the bf16 output goes through pack / store_piece, kWgradAccumulateFp32
  // through the epilogue stages below).
  template <class Acc>
  __device__ static void epilogue(const Params& p, const KTile& t, const EpiCtx& ctx, Acc& acc) {
    static_assert(Mode == kWgradPartialFp32, "the other modes have epilogues of their own");
    store_partial(p, t, ctx, acc);
  }

  // kWgradAccumulateFp32: main_grad += dW with the main grad read through the stage ring. After a
  // tile's K stages the producer loads its main-grad block as four epilogue stages (one per
  // 64-column quarter: warpgroup 0's 64 rows in the A slot, warpgroup 1's in the B slot, each two
  // 32 x 64 fp32 boxes in the 128-byte swizzle), so those loads run ahead under the K loop like any
  // K stage. The epilogue adds each quarter of the accumulator to it in registers, stages the sums
  // in the same layout, and stores them with plain TMA stores: one read and one write of the main
  // grad. It replaced a TMA bulk reduce-add (L2 doing the read-modify-write): -22-28 % at
  // DeepSeek-V3 and gpt-oss sizes, plain TMA loads and stores keeping DRAM at ~80 % of its peak
  // where the L2 reductions reached ~65 % (ncu, docs/gemm.md). One fp32 add (round to nearest)
  // per element, and no other tile of the launch touches the element, so the bits do not depend
  // on timing.
  static constexpr bool kEpilogueStages = Mode == kWgradAccumulateFp32;
  static constexpr int kEpilogueStageBytes = 128 * 64 * 4;
  static_assert(64 * 64 * 4 <= Cfg::kABytes && 64 * 64 * 4 <= Cfg::kBBytes,
                "a warpgroup's quarter of the main-grad block fits the A slot and the B slot");
  __device__ static int epilogue_stages(const Params&, const KTile&) { return 4; }
  // Also for rows or columns outside the matrix (TMA fills zeros; the stores skip them), so the
  // epilogue has no data-dependent branch around its stage waits.
  __device__ static void load_epilogue_stage(const Params& p, const KTile& t, int q, uint8_t* a, uint8_t* b,
                                             uint64_t* bar) {
    const Problem& pr = problem(p, t);
    const int col0 = 256 * t.n_tile + 64 * q, row0 = 128 * t.m_tile;
#pragma unroll
    for (int box = 0; box < 2; ++box) {
      tma_load_3d(&pr.out, bar, a + box * 8192, col0 + 32 * box, row0, t.expert);
      tma_load_3d(&pr.out, bar, b + box * 8192, col0 + 32 * box, row0 + 64, t.expert);
    }
  }
  // False after a timed-out stage wait (the consumer reports it after its tile loop).
  template <class Acc, class Ring>
  __device__ static bool epilogue(const Params& p, const KTile& t, const EpiCtx& ctx, Acc& acc, const Ring& ring) {
    bool ok = true;
    accumulate_rounds(p, t, ctx, acc, ring, ok, std::make_integer_sequence<int, 4>{});
    return ok;
  }
  template <class Acc, class Ring, int... R>
  __device__ static void accumulate_rounds(const Params& p, const KTile& t, const EpiCtx& ctx, Acc& acc,
                                           const Ring& ring, bool& ok, std::integer_sequence<int, R...>) {
    (accumulate_round<R>(p, t, ctx, acc, ring, ok), ...);
  }
  template <int R, class Acc, class Ring>
  __device__ static void accumulate_round(const Params& p, const KTile& t, const EpiCtx& ctx, Acc& acc,
                                          const Ring& ring, bool& ok) {
    const Problem& pr = problem(p, t);
    const int col0 = 256 * t.n_tile + 64 * R, row0 = 128 * t.m_tile + 64 * ctx.wg;
    ok = ring.acquire() && ok;
    const uint32_t grad = ctx.wg == 0 ? ring.a_saddr() : ring.b_saddr();
    // The staging buffer is free once the TMA unit read the previous round (or the previous
    // tile's last one).
    if (ctx.tid == 0) cute::tma_store_wait<0>();
    named_barrier_sync(ctx.barrier_id(), kWarpGroupThreads);
    const int lane = ctx.tid % 32;
    // Row r = 16 warp + lane/4 + 8 v1 of the box: 128 bytes per row, 16-byte chunk c of a row
    // stored at chunk c ^ (r mod 8) (SWIZZLE_128B; r mod 8 = lane / 4). Fragment block jj of the
    // round holds columns 8 jj + 2 (lane % 4) + {0, 1}: box jj / 4, chunk 2 (jj % 4) + (lane % 4) / 2.
    const uint32_t row_base = (16 * (ctx.tid / 32) + lane / 4) * 128 + 8 * (lane % 2);
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
#pragma unroll
      for (int v1 = 0; v1 < 2; ++v1) {
        const int i = 4 * (8 * R + jj) + 2 * v1;
        const uint32_t chunk = static_cast<uint32_t>(2 * (jj % 4) + (lane % 4) / 2) ^ static_cast<uint32_t>(lane / 4);
        const uint32_t off = (jj / 4) * 8192 + v1 * 1024 + row_base + (chunk << 4);
        float x, y;
        asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(x), "=f"(y) : "r"(grad + off));
        x += acc(i);
        y += acc(i + 1);
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(ctx.stage_saddr + off), "f"(x), "f"(y));
      }
    }
    ring.release();
    cute::tma_store_fence();  // the generic-proxy writes, visible to the TMA unit
    named_barrier_sync(ctx.barrier_id(), kWarpGroupThreads);
    if (ctx.tid == 0) {
      // A box that starts outside the matrix is not issued (m and n are multiples of 64).
      if (row0 < pr.m) {
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          if (col0 + 32 * b < pr.n) cute::SM90_TMA_STORE_3D::copy(&pr.out, ctx.stage + b * 8192, col0 + 32 * b, row0, t.expert);
        }
      }
      cute::tma_store_arrive();
    }
  }

  // kWgradPartialFp32: the raw fp32 partial, for a later call to continue (seed).
  template <class Acc>
  __device__ static void store_partial(const Params& p, const KTile& t, const EpiCtx& ctx, Acc& acc) {
    const Problem& pr = problem(p, t);
    float* out = static_cast<float*>(pr.out_ptr);
#pragma unroll
    for (int i = 0; i < cute::size(acc); i += 2) {
      const Coord c = coord(pr, t, ctx, i);
      st_f2_pred(out + c.offset, c.in, acc(i), acc(i + 1));
    }
  }

  // Predicated (branch-free) 8-byte global load (zeros when off) and store.
  __device__ static void ld_f2_pred(const float* ptr, bool on, float& x, float& y) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %3, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n"
        " @p ld.global.v2.f32 {%0, %1}, [%2];\n}\n"
        : "=f"(x), "=f"(y) : "l"(ptr), "r"(static_cast<int>(on)));
  }
  __device__ static void st_f2_pred(float* ptr, bool on, float x, float y) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %1, 0;\n @p st.global.v2.f32 [%0], {%2, %3};\n}\n"
        ::"l"(ptr), "r"(static_cast<int>(on)), "f"(x), "f"(y) : "memory");
  }
};

}  // namespace mok::gemm
