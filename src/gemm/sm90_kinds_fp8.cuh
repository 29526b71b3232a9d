// The FP8 row-grouped kinds (docs/fp8.md): the bf16 kinds' tiles, scheduler and epilogues over
// e4m3 operands with block scales. A kind adds to the bf16 kinds' interface:
//   load_stage(p, tile, k, smem_a, smem_b, smem_a_scales, full_bar, rank)  the codes of K block k
//                                                      and the A tile's row scales of that block
//   b_scale(p, tile, k, c)                             the scale of the weight block under column
//                                                      block c (kMmaN columns) of the tile
// and runs mma_mainloop_fp8 (sm90_roles.cuh), chosen by its Fp8TileConfig.
#pragma once

#include <cuda.h>

#include <climits>

#include "gemm/fp8_math.cuh"
#include "gemm/grouped_gemm_fp8.hpp"
#include "gemm/sm90_kinds_rows.cuh"
#include "gemm/sm90_kinds_wgrad.cuh"

namespace mok::gemm {

// Stages of the FP8 tiles beside the two 16 KiB epilogue buffers: 5 x (16 + 16 + 0.5) KiB for
// 128-column tiles, 3 x (16 + 32 + 0.5) KiB for GEMM 1's 256 (4 exceed shared memory by 1 KiB).
inline constexpr int kFp8PipeStages = 5;
inline constexpr int kFp8Gemm1Stages = 3;

// The deferred bf16 epilogue of the FP8 wgrad (consumer_warpgroup): a tile's one store round runs
// after wgmma batch kFp8DeferRound of the next tile's K loop in warpgroup 0 and kFp8DeferWg1Shift
// batches later in warpgroup 1, the next tile's coordinates after batch kFp8DeferNext. An FP8 batch
// (one 128-deep K block of a 64 x 128 fragment, ~256 tensor-core cycles) is a quarter of a bf16
// batch pair's work and the loops are short (2 K blocks per tile at gpt-oss sizes), hence the early
// slots; hook_slot() clamps them to the loop. (GEMM 2 and dx measured no gain from the same
// deferral, docs/experiments.md.)
inline constexpr int kFp8DeferRound = 0, kFp8DeferNext = 1, kFp8DeferWg1Shift = 1;

// ---- Quantizing epilogues -----------------------------------------------------------------
// One 1x128 block per row of the warpgroup's 64 rows, from bf16 pairs in registers: bits(i) for
// even i in [0, 64) is the bf16x2 of columns col0 + ctx.col(i / 4) + {0, 1} of row
// ctx.row_in_tile((i / 2) % 2) (the fragment order, after an epilogue packed the pairs). amax
// over the row's four threads (a quad), the scale and codes with the quantizers' math
// (fp8_math.cuh), so the result is quantize_rows_1x128's bit for bit; codes [rows, cols] at
// columns < cols, the scale at scales[(col0 / 128) * scales_ld + row]. A non-finite value is
// recorded (index row * cols + col; the record turns into an error). cols: a multiple of 8 (the
// row kinds' intermediate sizes are multiples of 64), codes 8-byte aligned.
// Stores (the same bytes either way): kWideStores, 8 bytes a thread after a transpose within the
// quad; else 2 bytes a thread, a column pair as the fragment holds it. Measured per kind (1x H100,
// 2026-12-07, bench/profile_step.py): GEMM 1's epilogue gained with the wide stores (qwen3 1.36 ->
// 1.11 ms with g, u, h quantized), the dh kind, at its register limit, lost (its spills grew from
// 56 / 106 to 92 / 306 bytes; qwen3 1.09 -> 1.28 ms), so it keeps the narrow ones.
template <bool kWideStores = true, class Bits>
__device__ inline void quantize_row_block(const EpiCtx& ctx, Bits bits, int64_t row0, int col0, int cols,
                                          uint8_t* codes, float* scales, int64_t scales_ld, NonFiniteRecord* rec) {
  uint32_t amax[2] = {0u, 0u};
  int bad_col[2] = {INT_MAX, INT_MAX};  // the thread's first non-finite column of each row
#pragma unroll
  for (int i = 0; i < 64; i += 2) {
    const uint32_t b = bits(i);
    const int v1 = (i / 2) % 2, col = col0 + ctx.col(i / 4);
    const uint16_t lo = static_cast<uint16_t>(b), hi = static_cast<uint16_t>(b >> 16);
    if (!bf16_finite(lo)) bad_col[v1] = min(bad_col[v1], col);
    if (!bf16_finite(hi)) bad_col[v1] = min(bad_col[v1], col + 1);
    amax[v1] = max(amax[v1], max(abs_bits(lo), abs_bits(hi)));
  }
  float inv[2], scale[2];
#pragma unroll
  for (int v1 = 0; v1 < 2; ++v1) {
    // The row's 128 columns sit in the 4 threads of a quad (lanes 4q .. 4q + 3).
    amax[v1] = max(amax[v1], __shfl_xor_sync(0xffffffffu, amax[v1], 1));
    amax[v1] = max(amax[v1], __shfl_xor_sync(0xffffffffu, amax[v1], 2));
    if (bad_col[v1] != INT_MAX) {
      atomicMin(&rec->first, static_cast<unsigned long long>((row0 + ctx.row_in_tile(v1)) * cols + bad_col[v1]));
    }
    const int k = scale_exponent_bits(amax[v1]);
    inv[v1] = pow2_bits(-k);
    scale[v1] = pow2_bits(k);
  }
  if constexpr (!kWideStores) {  // each code pair where the fragment holds it
#pragma unroll
    for (int i = 0; i < 64; i += 2) {
      const int v1 = (i / 2) % 2, col = col0 + ctx.col(i / 4);
      if (col < cols) {
        const uint32_t b = bits(i);
        const uint16_t q = encode2(static_cast<uint16_t>(b), static_cast<uint16_t>(b >> 16), inv[v1]);
        *reinterpret_cast<uint16_t*>(codes + (row0 + ctx.row_in_tile(v1)) * cols + col) = q;
      }
    }
  } else {
    // 8 bytes a thread: the quad's 4 lanes hold the 4 column pairs of each 8-column block j (lane q:
    // columns 8j + 2q, 8j + 2q + 1), so lane q gathers blocks j = 4m + q (m = 0..3) from the quad (a
    // 4 x 4 transpose of both rows' code pairs, 3 shuffles per m) and stores each row's 8 codes at once:
    // a warp's store covers 32 contiguous bytes of 8 rows, with a quarter of the narrow path's stores.
    const int quad_lane = ctx.tid % 4;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      uint32_t w[4];  // w[t]: this lane's code pair of block 4m + t, row half 0 (low 16 bits) and 1
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const uint32_t b0 = bits(4 * (4 * m + t)), b1 = bits(4 * (4 * m + t) + 2);
        const uint32_t q0 = encode2(static_cast<uint16_t>(b0), static_cast<uint16_t>(b0 >> 16), inv[0]);
        const uint32_t q1 = encode2(static_cast<uint16_t>(b1), static_cast<uint16_t>(b1 >> 16), inv[1]);
        w[t] = q0 | (q1 << 16);
      }
      uint64_t row_codes[2] = {0, 0};  // block 4m + quad_lane: the 8 codes of each row half
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int t = quad_lane ^ k;  // what lane quad_lane ^ k wants from this one, and the pair it sends back
        const uint32_t send = t == 0 ? w[0] : t == 1 ? w[1] : t == 2 ? w[2] : w[3];
        const uint32_t got = k == 0 ? send : __shfl_xor_sync(0xffffffffu, send, k);
        row_codes[0] |= static_cast<uint64_t>(got & 0xFFFFu) << (16 * t);
        row_codes[1] |= static_cast<uint64_t>(got >> 16) << (16 * t);
      }
      const int col = col0 + 8 * (4 * m + quad_lane);
      if (col < cols) {  // (cols: a multiple of 8, so an 8-column block is whole or absent)
#pragma unroll
        for (int v1 = 0; v1 < 2; ++v1) {
          *reinterpret_cast<uint64_t*>(codes + (row0 + ctx.row_in_tile(v1)) * cols + col) = row_codes[v1];
        }
      }
    }
  }
  if (ctx.tid % 4 == 0) {
#pragma unroll
    for (int v1 = 0; v1 < 2; ++v1) scales[(col0 / 128) * scales_ld + row0 + ctx.row_in_tile(v1)] = scale[v1];
  }
}

// The A stage of a row kind: K block k of the tile's 128 rows (codes, box 128 x 128) and their
// scales of that block (box 128 x 1 of the K-block-major scales).
__device__ inline void load_a_fp8(const CUtensorMap* codes, const CUtensorMap* scales, uint64_t* bar, uint8_t* a,
                                  float* sa, int k, int row0) {
  tma_load_2d(codes, bar, a, 128 * k, row0);
  tma_load_2d(scales, bar, sa, row0, k);
}

// ---- GEMM 2 ------------------------------------------------------------------------------
// Tile: 128 rows x 128 output columns (one weight block row); K blocks of 128.
struct Gemm2Fp8Params {
  CUtensorMap h;          // codes [rows, I], box 128 x 128
  CUtensorMap h_scales;   // fp32 [ceil(I / 128), rows], box 128 x 1
  CUtensorMap w_down;     // codes [E, H, I], box 128 x 128 x 1
  const float* w_scales;  // [E][ceil(H / 128)][ceil(I / 128)]
  CUtensorMap out;        // bf16 [rows, H], box 64 x 64
  RowScheduler sched;     // n_tiles = ceil(H / 128)
  int k_steps;            // ceil(I / 128)
  int hidden;
  ErrorSink err;
};

template <int C>
struct Gemm2Fp8Kind : RowKindBase<Gemm2Fp8Kind<C>, Fp8TileConfig<128, kFp8PipeStages, C>> {
  using Cfg = Fp8TileConfig<128, kFp8PipeStages, C>;
  using Params = Gemm2Fp8Params;
  __device__ static void prefetch_descriptors(const Params& p) {
    cute::prefetch_tma_descriptor(&p.h);
    cute::prefetch_tma_descriptor(&p.h_scales);
    cute::prefetch_tma_descriptor(&p.w_down);
  }
  __device__ static void load_stage(const Params& p, const RowTile& t, int k, uint8_t* a, uint8_t* b, float* sa, float*,
                                    uint64_t* bar, int) {
    load_a_fp8(&p.h, &p.h_scales, bar, a, sa, k, t.row0);
    tma_load_3d(&p.w_down, bar, b, 128 * k, 128 * t.n_tile, t.expert);
  }
  __device__ static float b_scale(const Params& p, const RowTile& t, int k, int) {
    return __ldg(p.w_scales + (int64_t{t.expert} * p.sched.n_tiles + t.n_tile) * p.k_steps + k);
  }
  template <class Acc>
  __device__ static void epilogue(const Params& p, const RowTile& t, const EpiCtx& ctx, Acc& acc) {
    pack_rows_bf16(ctx, acc, t.real_rows);
    store_packed<0, 0, 0>(ctx, acc, &p.out, 128 * t.n_tile, p.hidden, t.row0);
  }
};

// ---- dgrad of GEMM 1 -------------------------------------------------------------------
// dx = [dg | du] x [W_gate ; W_up]: K blocks 0 .. kg-1 read (dg, W_gate^T), the rest (du,
// W_up^T), kg = ceil(I / 128) (each half quantized on its own: its last block may be partial).
// FP8 wgmma reads B K-major, so B is the transposed weight copy W^T [E, H, I] (128x128 blocks:
// the weight's codes and scales transposed, fp8_quantize.hpp). Tile as GEMM 2's.
struct DgradInputFp8Params {
  CUtensorMap dg, du;              // codes [rows, I], box 128 x 128
  CUtensorMap dg_scales, du_scales;  // fp32 [ceil(I / 128), rows], box 128 x 1
  CUtensorMap wg_t, wu_t;          // codes [E, H, I], box 128 x 128 x 1
  const float* wg_t_scales;        // [E][ceil(H / 128)][ceil(I / 128)]
  const float* wu_t_scales;
  CUtensorMap dx;                  // bf16 [rows, H], box 64 x 64
  RowScheduler sched;              // n_tiles = ceil(H / 128)
  int k_steps;                     // 2 ceil(I / 128)
  int hidden;
  ErrorSink err;
};

template <int C>
struct DgradInputFp8Kind : RowKindBase<DgradInputFp8Kind<C>, Fp8TileConfig<128, kFp8PipeStages, C>> {
  using Cfg = Fp8TileConfig<128, kFp8PipeStages, C>;
  using Params = DgradInputFp8Params;
  __device__ static void prefetch_descriptors(const Params& p) {
    cute::prefetch_tma_descriptor(&p.dg);
    cute::prefetch_tma_descriptor(&p.du);
    cute::prefetch_tma_descriptor(&p.wg_t);
    cute::prefetch_tma_descriptor(&p.wu_t);
  }
  __device__ static void load_stage(const Params& p, const RowTile& t, int k, uint8_t* a, uint8_t* b, float* sa, float*,
                                    uint64_t* bar, int) {
    const int half = p.k_steps / 2;
    const bool up = k >= half;
    const int kk = up ? k - half : k;
    load_a_fp8(up ? &p.du : &p.dg, up ? &p.du_scales : &p.dg_scales, bar, a, sa, kk, t.row0);
    tma_load_3d(up ? &p.wu_t : &p.wg_t, bar, b, 128 * kk, 128 * t.n_tile, t.expert);
  }
  __device__ static float b_scale(const Params& p, const RowTile& t, int k, int) {
    const int half = p.k_steps / 2;
    const bool up = k >= half;
    return __ldg((up ? p.wu_t_scales : p.wg_t_scales) +
                 (int64_t{t.expert} * p.sched.n_tiles + t.n_tile) * half + (up ? k - half : k));
  }
  template <class Acc>
  __device__ static void epilogue(const Params& p, const RowTile& t, const EpiCtx& ctx, Acc& acc) {
    pack_rows_bf16(ctx, acc, t.real_rows);
    store_packed<0, 0, 0>(ctx, acc, &p.dx, 128 * t.n_tile, p.hidden, t.row0);
  }
};

// ---- GEMM 1 + SwiGLU, h quantized for GEMM 2 --------------------------------------------
// Tile: 128 rows x (128 gate | 128 up) columns of the same intermediate indices (the bf16
// kind's tile), two 128-column wgmma batches per K block. The epilogue is the bf16 kind's (g,
// u, h rounds: the same bits from the same accumulators), then h's 128 columns of each row,
// one 1x128 block of GEMM 2's operand, are quantized from the rounded h in registers:
// amax over the row's four threads, the power-of-two scale, the e4m3 codes (fp8_math.cuh,
// the quantizers' math), codes and scale stored to global memory.
struct Gemm1SwigluFp8Params {
  CUtensorMap x;                 // codes [rows, H], box 128 x 128
  CUtensorMap x_scales;          // fp32 [ceil(H / 128), rows], box 128 x 1
  CUtensorMap w_gate, w_up;      // codes [E, I, H], box 128 x 128 x 1
  const float* wg_scales;        // [E][ceil(I / 128)][ceil(H / 128)]
  const float* wu_scales;
  CUtensorMap h, g, u;           // bf16 [rows, I], box 64 x 64
  int h_cols;                    // I, or 0 when h (bf16) is not wanted (its rounds store nothing)
  int gu_cols;                   // I, or 0 when g, u (bf16) are not wanted
  uint8_t* h_codes;              // [rows, I]
  float* h_scales;               // [ceil(I / 128)][rows]
  int64_t rows;                  // buffer rows (h_scales' row stride)
  NonFiniteRecord* nonfinite;    // the first non-finite h (index row * I + col)
  // g, u quantized too (the FP8 context's copies, h's layout), or g_codes nullptr: not wanted.
  uint8_t *g_codes, *u_codes;
  float *g_scales, *u_scales;
  NonFiniteRecord* gu_nonfinite;  // the first non-finite g, else u (index row * I + col)
  RowScheduler sched;            // n_tiles = ceil(I / 128)
  int k_steps;                   // ceil(H / 128)
  int inter;                     // I
  ErrorSink err;
};

template <int C>
struct Gemm1SwigluFp8Kind
    : RowKindBase<Gemm1SwigluFp8Kind<C>, Fp8TileConfig<256, kFp8Gemm1Stages, C, 128>> {
  using Cfg = Fp8TileConfig<256, kFp8Gemm1Stages, C, 128>;
  using Params = Gemm1SwigluFp8Params;
  __device__ static void prefetch_descriptors(const Params& p) {
    cute::prefetch_tma_descriptor(&p.x);
    cute::prefetch_tma_descriptor(&p.x_scales);
    cute::prefetch_tma_descriptor(&p.w_gate);
    cute::prefetch_tma_descriptor(&p.w_up);
  }
  __device__ static void load_stage(const Params& p, const RowTile& t, int k, uint8_t* a, uint8_t* b, float* sa, float*,
                                    uint64_t* bar, int) {
    load_a_fp8(&p.x, &p.x_scales, bar, a, sa, k, t.row0);
    tma_load_3d(&p.w_gate, bar, b, 128 * k, 128 * t.n_tile, t.expert);
    tma_load_3d(&p.w_up, bar, b + Cfg::kBBytes / 2, 128 * k, 128 * t.n_tile, t.expert);
  }
  __device__ static float b_scale(const Params& p, const RowTile& t, int k, int c) {
    const float* s = c == 0 ? p.wg_scales : p.wu_scales;
    return __ldg(s + (int64_t{t.expert} * p.sched.n_tiles + t.n_tile) * p.k_steps + k);
  }
  template <class Acc>
  __device__ static void epilogue(const Params& p, const RowTile& t, const EpiCtx& ctx, Acc& acc) {
    if (p.g_codes != nullptr) quantize_gu(p, t, ctx, acc);  // (before the h math overwrites g's registers)
    if (p.gu_cols != 0 || p.h_cols != 0) {
      Gemm1SwigluKind<1>::epilogue(p, t, ctx, acc, p.gu_cols != 0, p.h_cols);
    } else {
      // No bf16 output (the FP8 forward): the epilogue's h math alone, none of its store rounds (each
      // would stage 64 x 128 values and pass two barriers to store nothing).
      Gemm1SwigluKind<1>::h_in_place(t, ctx, acc);
    }
    quantize_h(p, t, ctx, acc);
  }

  // Before the epilogue acc(i), acc(i + 1) (i even < 64) hold g of fragment values (i, i + 1) and
  // acc(i + 64), acc(i + 65) u's: rounded to bf16 (padding rows zero) as the epilogue's g and u
  // rounds store them, then quantized: the FP8 context's g, u without a pass over the bf16 copies.
  template <class Acc>
  __device__ static void quantize_gu(const Params& p, const RowTile& t, const EpiCtx& ctx, const Acc& acc) {
    const bool real0 = ctx.row_in_tile(0) < t.real_rows, real1 = ctx.row_in_tile(1) < t.real_rows;
    auto real = [&](int i) { return (i / 2) % 2 ? real1 : real0; };
    quantize_row_block(ctx, [&](int i) { return real(i) ? pack_bf16x2(acc(i), acc(i + 1)) : 0u; }, t.row0,
                       128 * t.n_tile, p.inter, p.g_codes, p.g_scales, p.rows, p.gu_nonfinite);
    quantize_row_block(ctx, [&](int i) { return real(i) ? pack_bf16x2(acc(i + 64), acc(i + 65)) : 0u; }, t.row0,
                       128 * t.n_tile, p.inter, p.u_codes, p.u_scales, p.rows, p.gu_nonfinite);
  }

  // After the epilogue acc(i), i even < 64, holds the bf16 pair of h of values (i, i + 1).
  template <class Acc>
  __device__ static void quantize_h(const Params& p, const RowTile& t, const EpiCtx& ctx, const Acc& acc) {
    quantize_row_block(ctx, [&](int i) { return __float_as_uint(acc(i)); }, t.row0, 128 * t.n_tile, p.inter,
                       p.h_codes, p.h_scales, p.rows, p.nonfinite);
  }
};

// ---- dgrad of GEMM 2 + SwiGLU backward, dg and du quantized for dgrad of GEMM 1 -------------
// dh = dys x W_down[e]: FP8 wgmma reads B K-major, so B is the transposed copy W_down^T
// [E, I, H] (128x128). Tile: 128 rows x 256 intermediate columns as the bf16 dh kind (whose
// epilogue, with the saved g, u through four epilogue stages, the routed rows' router weights
// and d topk_w parts, runs unchanged on the promoted fp32 accumulators), two 128-column wgmma
// batches per K block. Then dg's and du's two 1x128 blocks of each row are quantized from the
// rounded bf16 pairs in registers (quantize_row_block): dgrad of GEMM 1's operands.
struct DgradHiddenFp8Params {
  CUtensorMap dys;          // codes [rows, H], box 128 x 128
  CUtensorMap dys_scales;   // fp32 [ceil(H / 128), rows], box 128 x 1
  CUtensorMap w_down_t;     // codes [E, I, H], box 128 x 128 x 1
  const float* wd_t_scales; // [E][ceil(I / 128)][ceil(H / 128)]
  int i_blocks;             // ceil(I / 128)
  CUtensorMap dg, du;       // bf16 [rows, I], box 64 x 64
  CUtensorMap g, u;         // the saved g, u [rows, I], box 64 x 128: one epilogue stage per 64 columns
  const float* row_w;       // [rows] router weight of each row (the routed kind)
  float* dw_part;           // [rows, col_tiles] d topk_w parts (the routed kind)
  int col_tiles;            // ceil(I / 256)
  uint8_t* dg_codes;        // [rows, I]
  uint8_t* du_codes;
  float* dg_scales;         // [ceil(I / 128)][rows]
  float* du_scales;
  int64_t rows;             // buffer rows
  NonFiniteRecord* nonfinite;  // the first non-finite dg (index row * I + col), else du's
  RowScheduler sched;       // n_tiles = ceil(I / 256)
  int k_steps;              // ceil(H / 128)
  int inter;
  ErrorSink err;
};

template <int C, bool kRouted>
struct DgradHiddenFp8KindT
    : RowKindBase<DgradHiddenFp8KindT<C, kRouted>, Fp8TileConfig<256, kFp8Gemm1Stages, C, 128>> {
  using Cfg = Fp8TileConfig<256, kFp8Gemm1Stages, C, 128>;
  using Params = DgradHiddenFp8Params;
  __device__ static void prefetch_descriptors(const Params& p) {
    cute::prefetch_tma_descriptor(&p.dys);
    cute::prefetch_tma_descriptor(&p.dys_scales);
    cute::prefetch_tma_descriptor(&p.w_down_t);
    cute::prefetch_tma_descriptor(&p.g);
    cute::prefetch_tma_descriptor(&p.u);
  }
  __device__ static void load_stage(const Params& p, const RowTile& t, int k, uint8_t* a, uint8_t* b, float* sa, float*,
                                    uint64_t* bar, int) {
    load_a_fp8(&p.dys, &p.dys_scales, bar, a, sa, k, t.row0);
    tma_load_3d(&p.w_down_t, bar, b, 128 * k, 256 * t.n_tile, t.expert);
    tma_load_3d(&p.w_down_t, bar, b + Cfg::kBBytes / 2, 128 * k, 256 * t.n_tile + 128, t.expert);
  }
  // Column block 2 n + c of I; past I (the last tile of an I with an odd number of blocks) the
  // codes are TMA's zeros and the scale is never read.
  __device__ static float b_scale(const Params& p, const RowTile& t, int k, int c) {
    const int blk = 2 * t.n_tile + c;
    return blk < p.i_blocks ? __ldg(p.wd_t_scales + (int64_t{t.expert} * p.i_blocks + blk) * p.k_steps + k) : 0.0f;
  }

  // The bf16 kind's epilogue stages: quarter q of the tile's g (A slot) and u (B slot).
  using Bf16 = DgradHiddenKind<1>;
  static constexpr bool kEpilogueStages = true;
  static constexpr int kEpilogueStageBytes = Bf16::kEpilogueStageBytes;
  static_assert(128 * 64 * 2 <= Cfg::kABytes && 128 * 64 * 2 <= Cfg::kBBytes,
                "a quarter of g fits the A slot and one of u the B slot");
  __device__ static int epilogue_stages(const Params&, const RowTile&) { return 4; }
  __device__ static void load_epilogue_stage(const Params& p, const RowTile& t, int q, uint8_t* a, uint8_t* b,
                                             uint64_t* bar) {
    tma_load_2d(&p.g, bar, a, 256 * t.n_tile + 64 * q, t.row0);
    tma_load_2d(&p.u, bar, b, 256 * t.n_tile + 64 * q, t.row0);
  }

  template <class Acc, class Ring>
  __device__ static bool epilogue(const Params& p, const RowTile& t, const EpiCtx& ctx, Acc& acc, const Ring& ring) {
    const bool ok = Bf16::template epilogue_as<kRouted>(p, t, ctx, acc, ring);
    // acc(i), i even: the dg pair of fragment values (i, i + 1); acc(i + 1): the du pair.
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int col0 = 256 * t.n_tile + 128 * b;
      if (col0 < p.inter) {
        // (narrow stores: see quantize_row_block)
        quantize_row_block<false>(ctx, [&](int i) { return __float_as_uint(acc(64 * b + i)); }, t.row0, col0,
                                  p.inter, p.dg_codes, p.dg_scales, p.rows, p.nonfinite);
        quantize_row_block<false>(ctx, [&](int i) { return __float_as_uint(acc(64 * b + i + 1)); }, t.row0, col0,
                                  p.inter, p.du_codes, p.du_scales, p.rows, p.nonfinite);
      }
    }
    return ok;
  }
};
template <int C>
using DgradHiddenFp8Kind = DgradHiddenFp8KindT<C, false>;
template <int C>
using DgradHiddenRoutedFp8Kind = DgradHiddenFp8KindT<C, true>;

// ---- wgrad, K-grouped ---------------------------------------------------------------------
// dW[e] [M, N] = sum over the expert's rows r of a[r]^T b[r], the rows being the reduction:
// both operands arrive transposed and quantized along the tokens (quantize_cols_128x1_transposed:
// a^T codes [M, buffer_rows], scales [buffer_rows / 128][M]), so each K step of 128 rows is one
// scale block of both, and B's scales vary per output column (Fp8TileConfig<.., ColScales>).
// Tile 128 x 128 over (problem, expert, m, n) as the bf16 wgrad's scheduler; the K range is the
// expert's segment rows in 128-row steps from its start (its real rows rounded up: padding rows
// are zero codes). Epilogue: bf16 output through the staging boxes and TMA stores (as the row
// kinds; the store of a tile overlaps the next tile's loads and wgmmas: at DeepSeek-V3 sizes an
// expert has 2 K steps of 128 rows per tile, so predicated per-thread global stores made the kind
// 1.7x slower than the bf16 wgrad, bench_gemm 2026-12-07); fp32 sums and fp32 main grad += sums
// by predicated global stores per fragment pair.
struct WgradFp8ProblemParams {
  CUtensorMap a, b;                // codes [M or N, rows], box 128 x 128
  CUtensorMap a_scales, b_scales;  // fp32 [rows / 128, M or N], box 128 x 1
  int m, n;
  void* out;                       // [E, M, N]: fp32 (sums / main grad) or bf16
  int64_t out_stride;              // elements from expert e's [M, N] block to e+1's
  CUtensorMap out_map;             // bf16 output: out as [E, M, N], box 64 x 64 x 1 (TMA stores)
};
struct WgradFp8Params {
  WgradFp8ProblemParams problems[kMaxWgradProblems];
  KGroupedScheduler sched;  // m_tiles = ceil(M / 128), n_tiles = ceil(N / 128)
  ErrorSink err;
  // The bf16 output's deferred store (kFp8DeferRound above).
  int defer_round0 = kFp8DeferRound, defer_next = kFp8DeferNext, defer_wg1_shift = kFp8DeferWg1Shift;
};

template <int Mode>
struct WgradFp8Kind : DeferredWgradBf16<WgradFp8Kind<Mode>, 128> {
  using Cfg = Fp8TileConfig<128, kFp8PipeStages, 1, 128, true>;
  using Params = WgradFp8Params;
  using Problem = WgradFp8ProblemParams;
  static constexpr bool kSegTable = false;
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
  __device__ static void producer_check(const Params&, const KTile&) {}
  // The scheduler counts 64-row steps from the segment start; FP8 steps are 128 rows.
  __device__ static int k_steps(const Params&, const KTile& t) { return (t.k_steps + 1) / 2; }
  template <class Acc>
  __device__ static void seed(const Params&, const KTile&, const EpiCtx&, Acc& acc) {
#pragma unroll
    for (int i = 0; i < cute::size(acc); ++i) acc(i) = 0.0f;
  }
  __device__ static void load_stage(const Params& p, const KTile& t, int k, uint8_t* a, uint8_t* b, float* sa,
                                    float* sb, uint64_t* bar, int) {
    const Problem& pr = problem(p, t);
    const int row = t.row0 + 128 * k;
    tma_load_2d(&pr.a, bar, a, row, 128 * t.m_tile);
    tma_load_2d(&pr.a_scales, bar, sa, 128 * t.m_tile, row / 128);
    tma_load_2d(&pr.b, bar, b, row, 128 * t.n_tile);
    tma_load_2d(&pr.b_scales, bar, sb, 128 * t.n_tile, row / 128);
  }
  __device__ static float b_scale(const Params&, const KTile&, int, int) { return 1.0f; }  // per column instead
  // bf16 output: deferred as the bf16 wgrad's (DeferredWgradBf16, one 128-column round): at gpt-oss
  // sizes a tile has 2 K blocks, so a store at the end of each tile left the tensor cores idle for about
  // as long as its K loop.
  static constexpr bool kDeferredEpilogue = Mode == kWgradWriteBf16;
  __device__ static const CUtensorMap* out_map(const Problem& pr) { return &pr.out_map; }
  // The fp32 outputs (sums; main grad += sums).
  template <class Acc>
  __device__ static void epilogue(const Params& p, const KTile& t, const EpiCtx& ctx, Acc& acc) {
    static_assert(Mode != kWgradWriteBf16 || sizeof(Acc) == 0, "the bf16 output is stored by store_piece");
    const Problem& pr = problem(p, t);
#pragma unroll
    for (int i = 0; i < cute::size(acc); i += 2) {
      const int m = 128 * t.m_tile + ctx.row_in_tile((i / 2) % 2), n = 128 * t.n_tile + ctx.col(i / 4);
      if (m >= pr.m || n >= pr.n) continue;
      const int64_t off = int64_t{t.expert} * pr.out_stride + int64_t{m} * pr.n + n;
      {
        float2* o = reinterpret_cast<float2*>(static_cast<float*>(pr.out) + off);
        float2 v = make_float2(acc(i), acc(i + 1));
        if constexpr (Mode == kWgradAccumulateFp32) {
          const float2 old = *o;
          v = make_float2(old.x + v.x, old.y + v.y);
        }
        *o = v;
      }
    }
  }
};

}  // namespace mok::gemm
