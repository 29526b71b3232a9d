// The row-grouped kinds (M = the rows of each expert segment): forward GEMM 1 + SwiGLU,
// forward GEMM 2, dgrad of GEMM 2 + SwiGLU backward, dgrad of GEMM 1. Each kind tells the
// generic kernel (sm90_grouped_gemm.cuh) what to load per K step and what to store.
//
// A kind provides: Cfg, Params, scheduler(p), tile(p, sched, t), producer_check(p, tile), k_steps(p, tile),
// load_stage(p, tile, k, smem_a, smem_b, full_bar), seed(p, tile, ctx, acc),
// epilogue(p, tile, ctx, acc), prefetch_descriptors(p).
#pragma once

#include <cuda.h>

#include "gemm/grouped_gemm.hpp"
#include "gemm/sm90_roles.cuh"
#include "gemm/swiglu_math.cuh"
#include "gemm/tile_scheduler.cuh"

namespace mok::gemm {

// Shared pieces of every row-grouped kind.
template <class Derived, class CfgT>
struct RowKindBase {
  using Cfg = CfgT;
  // Tile coordinates read the global offsets: the shared-memory copy (SegOffsets) measured
  // no gain for the row kinds (GEMM 2 -1.7 %, dx +2 % / -2 %, within noise; docs/gemm.md).
  static constexpr bool kSegTable = false;
  template <class P>
  __device__ static RowScheduler scheduler(const P& p) { return p.sched; }
  template <class P>
  __device__ static RowTile tile(const P&, const RowScheduler& s, int t, int rank, uint32_t seg_smem = 0) {
    return s.tile(t, rank, seg_smem);
  }
  template <class P>
  __device__ static void producer_check(const P&, const RowTile&) {}
  // Tiles made only of padding rows skip the K loop and store zeros (in a cluster only when
  // every CTA's tile is padding: the CTAs run their K loops in lockstep).
  template <class P>
  __device__ static int k_steps(const P& p, const RowTile& tile) { return tile.any_real ? p.k_steps : 0; }
  template <class P, class Acc>
  __device__ static void seed(const P&, const RowTile&, const EpiCtx&, Acc& acc) {
#pragma unroll
    for (int i = 0; i < cute::size(acc); ++i) acc(i) = 0.0f;
  }
};

// Stores fragment value pairs (bits of acc(i), already packed bf16x2) of column blocks
// J0..J0+15 into out[row0 + 64*wg .., col0 ..] through the staging boxes; columns at or past
// `cols` are clipped (TMA never writes outside the tensor, a fully outside box is skipped).
template <int J0, int Offset, int Round, class Acc>
__device__ inline void store_packed(const EpiCtx& ctx, const Acc& acc, const CUtensorMap* map, int col0,
                                    int cols, int row0) {
  store_round<J0, Round>(ctx, [&](int i) { return __float_as_uint(acc(i + Offset)); },
                         Box2dStore{map, col0, cols, row0 + 64 * ctx.wg});
}

// Rounds pairs (i, i+1) to packed bf16x2 in place (bits in acc(i)); padding rows get zeros.
template <class Acc>
__device__ inline void pack_rows_bf16(const EpiCtx& ctx, Acc& acc, int real_rows) {
#pragma unroll
  for (int i = 0; i < cute::size(acc); i += 2) {
    const bool real = ctx.row_in_tile((i / 2) % 2) < real_rows;
    acc(i) = __uint_as_float(real ? pack_bf16x2(acc(i), acc(i + 1)) : 0u);
  }
}

// ---- GEMM 1 + SwiGLU ---------------------------------------------------------------------
// Tile: 128 rows x (128 gate | 128 up) columns of the same intermediate indices: the B stage
// holds W_gate rows [128n, 128n+128) then W_up rows [128n, 128n+128) (two TMA boxes), so
// value i (gate column c) and value i+64 (up column c) sit in the same thread.
struct Gemm1SwigluParams {
  CUtensorMap x;               // [rows, H], box 64 x 128
  CUtensorMap w_gate, w_up;    // [E, I, H], box 64 x 128 x 1
  CUtensorMap h, g, u;         // [rows, I], box 64 x 64
  RowScheduler sched;          // n_tiles = ceil(I / 128)
  int k_steps;                 // H / 64
  int inter;                   // I
  ErrorSink err;
  // Deferred epilogue placement (the cluster-1 kernel): the g, u and h rounds and the next
  // tile's coordinates after these batches.
  int defer_round0 = 1, defer_next = 3, defer_round1 = 5, defer_round2 = 7;
  int defer_wg1_shift = kDeferWg1Shift;  // warpgroup 1's pieces this many batches later
};

template <int C>
struct Gemm1SwigluKind : RowKindBase<Gemm1SwigluKind<C>, TileConfig<256, kPipeStages, Major::kK, Major::kK, C>> {
  using Cfg = TileConfig<256, kPipeStages, Major::kK, Major::kK, C>;
  using Params = Gemm1SwigluParams;
  __device__ static void prefetch_descriptors(const Params& p) {
    cute::prefetch_tma_descriptor(&p.x);
    cute::prefetch_tma_descriptor(&p.w_gate);
    cute::prefetch_tma_descriptor(&p.w_up);
  }
  // B box 0 = W_gate rows, box 1 = W_up rows of the same intermediate indices.
  __device__ static void load_stage(const Params& p, const RowTile& t, int k, uint8_t* a, uint8_t* b, uint64_t* bar,
                                    int rank) {
    tma_load_2d(&p.x, bar, a, 64 * k, t.row0);
    load_b(p, t, k, b, bar, rank);
  }
  // B: the gate and up boxes of the same intermediate indices.
  __device__ static void load_b(const Params& p, const RowTile& t, int k, uint8_t* b, uint64_t* bar, int rank) {
    load_b_boxes<C, 2>(t.shared_b, rank, [&](int box, uint16_t mask) {
      tma_load_3d(box == 0 ? &p.w_gate : &p.w_up, bar, b + box * (Cfg::kBBytes / 2), 64 * k, 128 * t.n_tile,
                  t.expert, mask);
    });
  }
  // h for one bf16 pair of rounded g and the matching pair of u (padding rows give zeros).
  __device__ static uint32_t h_pair(uint32_t g_bits, uint32_t u_bits, bool real) {
    const float2 g = unpack_bf16x2(g_bits), u = unpack_bf16x2(u_bits);
    return real ? pack_bf16x2(swiglu_fwd(g.x, u.x), swiglu_fwd(g.y, u.y)) : 0u;
  }
  // h = silu(g) * u from the rounded g (acc(i), acc(i + 1)) and u (acc(i + 64), acc(i + 65)), i even < 64,
  // as bf16x2 into acc(i) (padding rows zero).
  template <class Acc>
  __device__ static void h_in_place(const RowTile& t, const EpiCtx& ctx, Acc& acc) {
    const bool real0 = ctx.row_in_tile(0) < t.real_rows, real1 = ctx.row_in_tile(1) < t.real_rows;
#pragma unroll
    for (int i = 0; i < 64; i += 2) {
      acc(i) = __uint_as_float(h_pair(pack_bf16x2(acc(i), acc(i + 1)), pack_bf16x2(acc(i + 64), acc(i + 65)),
                                      (i / 2) % 2 ? real1 : real0));
    }
  }
  // store_gu false: the g and u rounds issue no TMA store (zero-column boxes; their bulk groups
  // stay, empty, so the group accounting is unchanged): h alone is written. The fused forward's
  // macrobatch ring passes it for row tiles whose saved context the ring will not keep.
  // P: Gemm1SwigluParams or any params with the maps g, u, h and `inter` (the FP8 kind's).
  template <class P, class Acc>
  __device__ static void epilogue(const P& p, const RowTile& t, const EpiCtx& ctx, Acc& acc,
                                  bool store_gu = true, int h_cols = -1) {
    // Three rounds over the same 64 x 128 block: g (values i, i+1), u (i+64, i+65), then
    // h = silu(g) * u from the rounded g, u. The h math runs between the u round and the h
    // round, in place (bf16x2 h into acc(i)), so it overlaps the TMA store of the u round
    // instead of sitting behind the h round's barrier (computing everything before the first
    // round instead made ptxas spill ~200 bytes).
    const int col0 = 128 * t.n_tile;
    const bool real0 = ctx.row_in_tile(0) < t.real_rows, real1 = ctx.row_in_tile(1) < t.real_rows;
    auto real = [&](int i) { return (i / 2) % 2 ? real1 : real0; };
    auto issue = [&](const CUtensorMap* map, int cols) { return Box2dStore{map, col0, cols, t.row0 + 64 * ctx.wg}; };
    const int gu_cols = store_gu ? p.inter : 0;
    store_round<0, 0>(ctx, [&](int i) { return real(i) ? pack_bf16x2(acc(i), acc(i + 1)) : 0u; }, issue(&p.g, gu_cols));
    store_round<0, 1>(ctx, [&](int i) { return real(i) ? pack_bf16x2(acc(i + 64), acc(i + 65)) : 0u; },
                      issue(&p.u, gu_cols));
    h_in_place(t, ctx, acc);
    store_round<0, 2>(ctx, [&](int i) { return __float_as_uint(acc(i)); }, issue(&p.h, h_cols < 0 ? p.inter : h_cols));
  }

  // The standalone cluster-1 kernel defers the epilogue (consumer_warpgroup): the finished
  // tile's rounded g and u wait in 64 registers of bf16 pairs (padding rows zero) and are
  // stored in three rounds inside the next tile's K loop, g, u, then h = silu(g) * u computed
  // there from the same rounded g, u: the bits of `epilogue` above (which the fused forward
  // keeps), without the ~6k-cycle pause of the tensor cores per tile (docs/gemm.md).
  static constexpr bool kDeferredEpilogue = C == 1;
  static constexpr int kDeferredPieces = 3;  // the g, u and h rounds

  struct Packed {
    uint32_t v[64];  // v[k] = g pair of fragment values (2k, 2k+1); v[32 + k] = the u pair
  };
  struct Pending {
    int row0, n_tile, real_rows;
  };
  __device__ static Pending pending_of(const RowTile& t) { return {t.row0, t.n_tile, t.real_rows}; }
  template <class Acc>
  __device__ static void pack(const Params&, const RowTile& t, const EpiCtx& ctx, const Acc& acc, Packed& out) {
    const bool real0 = ctx.row_in_tile(0) < t.real_rows, real1 = ctx.row_in_tile(1) < t.real_rows;
#pragma unroll
    for (int k = 0; k < 32; ++k) {
      const bool real = k % 2 ? real1 : real0;  // fragment value 2k sits in row (2k / 2) % 2
      out.v[k] = real ? pack_bf16x2(acc(2 * k), acc(2 * k + 1)) : 0u;
      out.v[32 + k] = real ? pack_bf16x2(acc(2 * k + 64), acc(2 * k + 65)) : 0u;
    }
  }
  __device__ static int piece_batch(const Params& p, int piece) {
    return piece == 0 ? p.defer_round0 : piece == 1 ? p.defer_round1 : p.defer_round2;
  }
  // Round 0 stores g, 1 stores u, 2 computes and stores h.
  template <int Round>
  __device__ static void store_piece(const Params& p, const Pending& t, const EpiCtx& ctx, const Packed& pk) {
    const CUtensorMap* map = Round == 0 ? &p.g : Round == 1 ? &p.u : &p.h;
    const int col0 = 128 * t.n_tile;
    const bool real0 = ctx.row_in_tile(0) < t.real_rows, real1 = ctx.row_in_tile(1) < t.real_rows;
    store_round<0, Round>(
        ctx,
        [&](int i) {
          if constexpr (Round < 2) {
            return pk.v[32 * Round + i / 2];
          } else {
            return h_pair(pk.v[i / 2], pk.v[32 + i / 2], (i / 2) % 2 ? real1 : real0);
          }
        },
        Box2dStore{map, col0, p.inter, t.row0 + 64 * ctx.wg});
  }
};

// ---- GEMM 2 and dgrad of GEMM 1 (plain bf16 output, 128 x 256 tiles) --------------------
template <class Acc>
__device__ inline void store_bf16_256(const EpiCtx& ctx, Acc& acc, const CUtensorMap* map, const RowTile& t,
                                      int cols) {
  pack_rows_bf16(ctx, acc, t.real_rows);
  store_packed<0, 0, 0>(ctx, acc, map, 256 * t.n_tile, cols, t.row0);
  store_packed<16, 0, 1>(ctx, acc, map, 256 * t.n_tile + 128, cols, t.row0);
}

// The standalone GEMM 2 and dx kernels defer this epilogue (consumer_warpgroup, kDeferredEpilogue): the
// finished tile is rounded into 64 registers of bf16 pairs (padding rows zero) and stored in
// two rounds inside the next tile's K loop. Derived supplies out_map(p) and out_cols(p).
// On = false keeps the plain epilogue (the 2-CTA cluster kernels: 16 bytes spilled with it).
template <class Derived, bool On>
struct DeferredBf16x256 {
  static constexpr bool kDeferredEpilogue = On;
  struct Packed {
    uint32_t v[64];  // v[i / 2] = bf16x2 of fragment values (i, i + 1)
  };
  struct Pending {
    int row0, n_tile;
  };
  __device__ static Pending pending_of(const RowTile& t) { return {t.row0, t.n_tile}; }
  template <class P, class Acc>
  __device__ static void pack(const P&, const RowTile& t, const EpiCtx& ctx, const Acc& acc, Packed& out) {
    const bool real0 = ctx.row_in_tile(0) < t.real_rows, real1 = ctx.row_in_tile(1) < t.real_rows;
#pragma unroll
    for (int i = 0; i < 64; ++i) out.v[i] = (i % 2 ? real1 : real0) ? pack_bf16x2(acc(2 * i), acc(2 * i + 1)) : 0u;
  }
  template <class P>
  __device__ static int piece_batch(const P& p, int piece) { return piece == 0 ? p.defer_round0 : p.defer_round1; }
  template <int Half, class P>
  __device__ static void store_piece(const P& p, const Pending& t, const EpiCtx& ctx, const Packed& pk) {
    const CUtensorMap* map = Derived::out_map(p);
    const int col0 = 256 * t.n_tile + 128 * Half, cols = Derived::out_cols(p);
    store_round<16 * Half, Half>(ctx, [&](int i) { return pk.v[i / 2]; },
                                 Box2dStore{map, col0, cols, t.row0 + 64 * ctx.wg});
  }
};

struct Gemm2Params {
  CUtensorMap h;       // [rows, I], box 64 x 128
  CUtensorMap w_down;  // [E, H, I], box 64 x 128 x 1 (two boxes per 256-row B tile)
  CUtensorMap out;     // [rows, H], box 64 x 64
  RowScheduler sched;  // n_tiles = ceil(H / 256)
  int k_steps;         // I / 64
  int hidden;
  ErrorSink err;
  int defer_round0 = 1, defer_next = 3, defer_round1 = 5;  // deferred epilogue placement
  int defer_wg1_shift = kDeferWg1Shift;  // warpgroup 1's pieces this many batches later
};

template <int C>
struct Gemm2Kind : RowKindBase<Gemm2Kind<C>, TileConfig<256, kPipeStages, Major::kK, Major::kK, C>>,
                   DeferredBf16x256<Gemm2Kind<C>, C == 1> {
  using Cfg = TileConfig<256, kPipeStages, Major::kK, Major::kK, C>;
  using Params = Gemm2Params;
  __device__ static const CUtensorMap* out_map(const Params& p) { return &p.out; }
  __device__ static int out_cols(const Params& p) { return p.hidden; }
  __device__ static void prefetch_descriptors(const Params& p) {
    cute::prefetch_tma_descriptor(&p.h);
    cute::prefetch_tma_descriptor(&p.w_down);
  }
  __device__ static void load_stage(const Params& p, const RowTile& t, int k, uint8_t* a, uint8_t* b, uint64_t* bar,
                                    int rank) {
    tma_load_2d(&p.h, bar, a, 64 * k, t.row0);
    load_b_boxes<C, 2>(t.shared_b, rank, [&](int box, uint16_t mask) {
      tma_load_3d(&p.w_down, bar, b + box * (Cfg::kBBytes / 2), 64 * k, 256 * t.n_tile + 128 * box, t.expert, mask);
    });
  }
  template <class Acc>
  __device__ static void epilogue(const Params& p, const RowTile& t, const EpiCtx& ctx, Acc& acc) {
    store_bf16_256(ctx, acc, &p.out, t, p.hidden);
  }
};

// dx = [dg | du] x [W_gate ; W_up]: K steps 0..I/64-1 read (dg, W_gate), the rest (du, W_up).
// B is MN-major: W_gate[e] is [I, H] with H (= N) contiguous, loaded as four 64x64 boxes.
struct DgradInputParams {
  CUtensorMap dg, du;          // [rows, I], box 64 x 128
  CUtensorMap w_gate, w_up;    // [E, I, H], box 64 x 64 x 1
  CUtensorMap dx;              // [rows, H], box 64 x 64
  RowScheduler sched;          // n_tiles = ceil(H / 256)
  int k_steps;                 // 2I / 64
  int hidden;
  ErrorSink err;
  int defer_round0 = 1, defer_next = 3, defer_round1 = 5;  // deferred epilogue placement
  int defer_wg1_shift = kDeferWg1Shift;  // warpgroup 1's pieces this many batches later
};

template <int C>
struct DgradInputKind : RowKindBase<DgradInputKind<C>, TileConfig<256, kPipeStages, Major::kK, Major::kMN, C>>,
                        DeferredBf16x256<DgradInputKind<C>, C == 1> {
  using Cfg = TileConfig<256, kPipeStages, Major::kK, Major::kMN, C>;
  using Params = DgradInputParams;
  __device__ static const CUtensorMap* out_map(const Params& p) { return &p.dx; }
  __device__ static int out_cols(const Params& p) { return p.hidden; }
  __device__ static void prefetch_descriptors(const Params& p) {
    cute::prefetch_tma_descriptor(&p.dg);
    cute::prefetch_tma_descriptor(&p.du);
    cute::prefetch_tma_descriptor(&p.w_gate);
    cute::prefetch_tma_descriptor(&p.w_up);
  }
  __device__ static void load_stage(const Params& p, const RowTile& t, int k, uint8_t* a, uint8_t* b, uint64_t* bar,
                                    int rank) {
    const int half = p.k_steps / 2;
    const bool up = k >= half;
    const int kk = up ? k - half : k;
    tma_load_2d(up ? &p.du : &p.dg, bar, a, 64 * kk, t.row0);
    const CUtensorMap* w = up ? &p.w_up : &p.w_gate;
    load_b_boxes<C, 4>(t.shared_b, rank, [&](int box, uint16_t mask) {
      tma_load_3d(w, bar, b + box * 8192, 256 * t.n_tile + 64 * box, 64 * kk, t.expert, mask);
    });
  }
  template <class Acc>
  __device__ static void epilogue(const Params& p, const RowTile& t, const EpiCtx& ctx, Acc& acc) {
    store_bf16_256(ctx, acc, &p.dx, t, p.hidden);
  }
};

// ---- dgrad of GEMM 2 + SwiGLU backward -----------------------------------------------------
// dh = dys x W_down[e] (B MN-major: W_down[e] is [H, I], I = N contiguous). The epilogue takes
// the saved g, u of the tile through the stage ring (epilogue stages, sm90_roles.cuh) and
// writes dg, du.
struct DgradHiddenParams {
  CUtensorMap dys;     // [rows, H], box 64 x 128
  CUtensorMap w_down;  // [E, H, I], box 64 x 64 x 1
  CUtensorMap dg, du;  // [rows, I], box 64 x 64
  CUtensorMap g, u;    // the saved g, u [rows, I], box 64 x 128: one epilogue stage per 64 columns
  const float* row_w;  // [rows] router weight of each row (DgradHiddenRoutedKind)
  float* dw_part;      // [rows, col_tiles] d topk_w parts (DgradHiddenRoutedKind)
  int col_tiles;       // ceil(I / 256)
  RowScheduler sched;  // n_tiles = ceil(I / 256)
  int k_steps;         // H / 64
  int inter;
  ErrorSink err;
};

template <int C>
struct DgradHiddenKind : RowKindBase<DgradHiddenKind<C>, TileConfig<256, kPipeStages, Major::kK, Major::kMN, C>> {
  using Cfg = TileConfig<256, kPipeStages, Major::kK, Major::kMN, C>;
  using Params = DgradHiddenParams;
  __device__ static void prefetch_descriptors(const Params& p) {
    cute::prefetch_tma_descriptor(&p.dys);
    cute::prefetch_tma_descriptor(&p.w_down);
    cute::prefetch_tma_descriptor(&p.g);
    cute::prefetch_tma_descriptor(&p.u);
  }
  __device__ static void load_stage(const Params& p, const RowTile& t, int k, uint8_t* a, uint8_t* b, uint64_t* bar,
                                    int rank) {
    tma_load_2d(&p.dys, bar, a, 64 * k, t.row0);
    load_b_boxes<C, 4>(t.shared_b, rank, [&](int box, uint16_t mask) {
      tma_load_3d(&p.w_down, bar, b + box * 8192, 256 * t.n_tile + 64 * box, 64 * k, t.expert, mask);
    });
  }

  // Epilogue stages: quarter q (columns 256 n + 64 q) of the tile's g in the A slot and of its
  // u in the B slot, 128 rows x 64 columns each (SW128), four per tile, also for a tile without
  // real rows or a quarter outside I (TMA fills zeros there): the epilogue then has no branch
  // on them (a data-dependent branch around the stage waits and reads spilled ~700 bytes beside
  // the accumulators, as did the error atomic of a timed-out wait: EpilogueRing). Before (2026-12-04) the epilogue read g, u with rounds of dependent
  // global loads after the K loop, ~22-24 us per tile with the tensor cores idle (trace,
  // docs/gemm.md).
  static constexpr bool kEpilogueStages = true;
  static constexpr int kEpilogueStageBytes = 2 * 128 * 64 * 2;
  static_assert(128 * 64 * 2 <= Cfg::kABytes && 128 * 64 * 2 <= Cfg::kBBytes,
                "a quarter of g fits the A slot and one of u the B slot");
  __device__ static int epilogue_stages(const Params&, const RowTile&) { return 4; }
  __device__ static void load_epilogue_stage(const Params& p, const RowTile& t, int q, uint8_t* a, uint8_t* b,
                                             uint64_t* bar) {
    tma_load_2d(&p.g, bar, a, 256 * t.n_tile + 64 * q, t.row0);
    tma_load_2d(&p.u, bar, b, 256 * t.n_tile + 64 * q, t.row0);
  }

  // Columns [64 Q, 64 Q + 64) of the tile from epilogue stage Q: acc(i) <- dg pair, acc(i+1)
  // <- du pair (padding rows zero). A quarter outside I reads g = u = 0 and its accumulators
  // are zeros (W_down's columns there are zero-filled). w[v1]: the router weight of the
  // thread's row v1 (1 without row_w); part[v1] += dhr * h over the thread's columns when
  // kScaled (the d topk_w part of the row), in column order. `ok` false after a timed-out stage
  // wait (recorded; the epilogue still runs to its end).
  template <int Q, bool kScaled, class P, class Acc, class Ring>
  __device__ static void swiglu_backward_quarter(const P& p, const RowTile& t, const EpiCtx& ctx, Acc& acc,
                                                 const float (&w)[2], float (&part)[2], const Ring& ring, bool& ok) {
    ok = ring.acquire() && ok;
    // Element (r, c) of a 128 x 64 SW128 box: byte 128 r + 16 ((c / 8) ^ (r % 8)) + 2 (c % 8);
    // for this thread r % 8 = lane / 4 and c = 8 jq + 2 (lane % 4).
    const int lane = ctx.lane();
    const uint32_t g_box = ring.a_saddr() + 4u * (lane % 4), u_box = ring.b_saddr() + 4u * (lane % 4);
#pragma unroll
    for (int jq = 0; jq < 8; ++jq) {
      const uint32_t chunk = static_cast<uint32_t>(jq ^ (lane / 4)) << 4;
#pragma unroll
      for (int v1 = 0; v1 < 2; ++v1) {
        const int i = 4 * (8 * Q + jq) + 2 * v1;
        const uint32_t off = 128u * ctx.row_in_tile(v1) + chunk;
        const bool real = ctx.row_in_tile(v1) < t.real_rows;
        uint32_t g2, u2;
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(g2) : "r"(g_box + off));
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(u2) : "r"(u_box + off));
        const float2 g = unpack_bf16x2(g2), u = unpack_bf16x2(u2);
        float dg0, du0, dg1, du1;
        if constexpr (kScaled) {
          // d topk_w part dhr . h (h rebuilt as the forward rounds it), then dh = w * dhr.
          float h0, h1;
          swiglu_bwd_routed(acc(i), w[v1], g.x, u.x, dg0, du0, h0);
          swiglu_bwd_routed(acc(i + 1), w[v1], g.y, u.y, dg1, du1, h1);
          part[v1] += acc(i) * h0;
          part[v1] += acc(i + 1) * h1;
        } else {
          swiglu_bwd(acc(i), g.x, u.x, dg0, du0);
          swiglu_bwd(acc(i + 1), g.y, u.y, dg1, du1);
        }
        acc(i) = __uint_as_float(real ? pack_bf16x2(dg0, dg1) : 0u);
        acc(i + 1) = __uint_as_float(real ? pack_bf16x2(du0, du1) : 0u);
      }
    }
    ring.release();
  }
  // Columns [128 Half, 128 Half + 128): quarters 2 Half, 2 Half + 1, then the half's dg and du
  // store rounds.
  template <int Half, bool kScaled, class P, class Acc, class Ring>
  __device__ static void swiglu_backward_half(const P& p, const RowTile& t, const EpiCtx& ctx, Acc& acc,
                                              const float (&w)[2], float (&part)[2], const Ring& ring, bool& ok) {
    swiglu_backward_quarter<2 * Half, kScaled>(p, t, ctx, acc, w, part, ring, ok);
    swiglu_backward_quarter<2 * Half + 1, kScaled>(p, t, ctx, acc, w, part, ring, ok);
    const int col0 = 256 * t.n_tile + 128 * Half;
    store_packed<16 * Half, 0, 2 * Half>(ctx, acc, &p.dg, col0, p.inter, t.row0);
    store_packed<16 * Half, 1, 2 * Half + 1>(ctx, acc, &p.du, col0, p.inter, t.row0);
  }

  // Two epilogues (compile-time, so each keeps only the registers it needs): this one, and
  // the routed one of DgradHiddenRoutedKind below (scaled dh and the d topk_w parts).
  // False on a timed-out stage wait (recorded in the error sink).
  template <class Acc, class Ring>
  __device__ static bool epilogue(const Params& p, const RowTile& t, const EpiCtx& ctx, Acc& acc, const Ring& ring) {
    return epilogue_as<false>(p, t, ctx, acc, ring);
  }
  // P: DgradHiddenParams or any params with its epilogue's fields (the FP8 kind's).
  template <bool kScaled, class P, class Acc, class Ring>
  __device__ static bool epilogue_as(const P& p, const RowTile& t, const EpiCtx& ctx, Acc& acc,
                                     const Ring& ring) {
    float w[2] = {1.0f, 1.0f}, part[2] = {0.0f, 0.0f};
    if constexpr (kScaled) {
#pragma unroll
      for (int v1 = 0; v1 < 2; ++v1) {
        const int r = ctx.row_in_tile(v1);
        w[v1] = r < t.real_rows ? __ldg(p.row_w + t.row0 + r) : 0.0f;
      }
    }
    bool ok = true;
    swiglu_backward_half<0, kScaled>(p, t, ctx, acc, w, part, ring, ok);
    swiglu_backward_half<1, kScaled>(p, t, ctx, acc, w, part, ring, ok);
    if constexpr (kScaled) {
      // The row's part over the tile: the thread's columns in fragment order, then the quad
      // (the 4 threads of a row) in a fixed butterfly: every lane ends with the same bits.
#pragma unroll
      for (int v1 = 0; v1 < 2; ++v1) {
        part[v1] += __shfl_xor_sync(0xffffffffu, part[v1], 1);
        part[v1] += __shfl_xor_sync(0xffffffffu, part[v1], 2);
        const int r = ctx.row_in_tile(v1);
        if (ctx.tid % 4 == 0 && r < t.real_rows) {
          p.dw_part[(t.row0 + r) * int64_t{p.col_tiles} + t.n_tile] = part[v1];
        }
      }
    }
    return ok;
  }
};

// The routed rows' dgrad (numerics.md Backward steps 2-4): dys are the unscaled dy rows, the
// epilogue scales dhr by the row's router weight and writes the d topk_w parts. A kind of its
// own so the plain epilogue above keeps its registers (the routed one spills 40 bytes at
// cluster 1: weights, parts and the rebuilt h beside the 128 accumulator registers).
template <int C>
struct DgradHiddenRoutedKind : DgradHiddenKind<C> {
  using Base = DgradHiddenKind<C>;
  template <class Acc, class Ring>
  __device__ static bool epilogue(const typename Base::Params& p, const RowTile& t, const EpiCtx& ctx, Acc& acc,
                                  const Ring& ring) {
    return Base::template epilogue_as<true>(p, t, ctx, acc, ring);
  }
};

}  // namespace mok::gemm
