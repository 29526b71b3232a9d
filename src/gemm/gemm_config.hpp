// Compile-time shapes of the Hopper grouped GEMM engine (tile, pipeline, roles, registers).
// Only these are template parameters; tokens, experts, H and I are runtime values.
#pragma once

#include <cstdint>

namespace mok::gemm {

// Which dimension of an operand tile is contiguous in global memory (and therefore in the
// 128-byte swizzled shared-memory tile that TMA writes and wgmma reads).
enum class Major { kK, kMN };

inline constexpr int kWarpGroupThreads = 128;
inline constexpr int kMaxSmemPerBlock = 232448;  // sm_90: 227 KiB of opt-in dynamic shared memory
inline constexpr int kSwizzleBytes = 128;        // TMA SWIZZLE_128B == GMMA Layout_*_SW128_Atom
inline constexpr int kBoxInner = kSwizzleBytes / 2;  // 64 bf16: widest TMA box row under SW128
// Tile raster (tile_scheduler.cuh): groups of kGroupM row tiles, row tiles fastest inside a
// group, so the CTAs running at the same time share B (weight) tiles and a few A row tiles.
// 8 global row tiles: 4 and 8 measured equal, 2/16/64 slower, expert-aligned no faster (docs/gemm.md).
inline constexpr int kGroupM = 8;

// Epilogue staging buffers per consumer warpgroup. 1: a store round waits until the TMA store
// of the previous round has read the buffer (4 pipeline stages fit); 2: rounds alternate two
// buffers and wait only for the round before the previous one (the pipeline then has 3 stages:
// 3 x 48 + 2 x 2 x 16 KiB). Build-time choice (-DMOK_GEMM_EPI_BUFFERS=2) for A/B builds.
// 1: two buffers cost the stage more than the waits on random segments (GEMM 1 -1.8 %, docs/gemm.md).
#ifndef MOK_GEMM_EPI_BUFFERS
#define MOK_GEMM_EPI_BUFFERS 1
#endif
inline constexpr int kEpiBuffers = MOK_GEMM_EPI_BUFFERS;
static_assert(kEpiBuffers == 1 || kEpiBuffers == 2, "one or two epilogue staging buffers");
inline constexpr int kPipeStages = kEpiBuffers == 2 ? 3 : 4;  // the kinds' TileConfig stages

// Deferred epilogues (standalone cluster-1 kernels): consumer warpgroup 1 stores its pieces
// this many wgmma batches after warpgroup 0, so the two do not pause their wgmma issue at the
// same time.
// 2: +0.5-2 % against 0 in steady state (docs/gemm.md, 2026-11-30, b52dcab).
inline constexpr int kDeferWg1Shift = 2;

// What every tile of the engine shares, bf16 or FP8: 128 rows, one producer warpgroup (a single
// TMA-issuing thread) and two consumer warpgroups of 64 rows each, their registers, the epilogue
// staging and the barrier block.
struct CtaShape {
  static constexpr int kBM = 128;
  static constexpr int kConsumerWGs = 2;
  static constexpr int kWGRows = kBM / kConsumerWGs;  // 64: one wgmma M per warpgroup
  static constexpr int kThreads = kWarpGroupThreads * (1 + kConsumerWGs);
  static constexpr int kConsumerThreads = kWarpGroupThreads * kConsumerWGs;

  // setmaxnreg: the producer keeps 40 registers, the consumers get the rest
  // (40*128 + 232*256 = 64512 <= 65536). A 64x256 fp32 accumulator is 128 registers.
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static_assert(kProducerRegs * kWarpGroupThreads + kConsumerRegs * kConsumerThreads <= 65536,
                "register budget of one SM exceeded");

  // Epilogue staging: per consumer warpgroup 64 rows x 128 bf16 columns = two 64x64 SW128
  // TMA-store boxes (16 KiB). Outputs wider than 128 columns are stored in rounds.
  static constexpr int kEpiBoxBytes = 64 * kBoxInner * 2;
  static constexpr int kEpiBoxes = 2;
  static constexpr int kEpiCols = kEpiBoxes * kBoxInner;
  static constexpr int kEpiBufferBytes = kEpiBoxes * kEpiBoxBytes;
  static constexpr int kEpiBytesPerWG = kEpiBuffers * kEpiBufferBytes;

  // SharedStorage (sm90_roles.cuh) is 1024-aligned: its barriers occupy one 1 KiB block,
  // and the dynamic allocation carries 1 KiB of slack to align its base.
  static constexpr int kBarrierBytes = 1024;
};

// One CTA: a 128 x kBN output tile, K consumed in 64-deep stages (one 128-byte swizzle row of
// bf16), one producer warpgroup (a single TMA-issuing thread) and two consumer warpgroups,
// each owning 64 rows of the tile with a 64 x kBN fp32 accumulator in registers.
// Clusters of kClusterM CTAs work on vertically adjacent tiles that share their B tile: each
// CTA loads 1/kClusterM of it and multicasts it to the cluster (halves the L2->SM traffic of B).
// wgrad too runs these cooperative 128 x 256 tiles: ping-pong consumers with 128 x 128 tiles
// measured 0.93x (docs/gemm.md, 2026-11-30; the kind is at 0b38498).
template <int BN, int Stages, Major AMajor, Major BMajor, int ClusterM>
struct TileConfig : CtaShape {
  static constexpr int kBN = BN;
  static constexpr int kBK = 64;
  static constexpr int kStages = Stages;
  static constexpr Major kAMajor = AMajor;
  static constexpr Major kBMajor = BMajor;
  static constexpr int kClusterM = ClusterM;
  static constexpr bool kFp8 = false;  // bf16 operands, accumulated by wgmma in place
  static constexpr int kAScaleBytes = 0;
  static constexpr int kMmaN = BN;  // one wgmma covers the tile's columns
  static_assert(ClusterM == 1 || ClusterM == 2, "clusters of 1 or 2 CTAs along M");
  static_assert(kBN % 64 == 0 && kBN <= 256, "wgmma N is at most 256 and boxes are 64 wide");

  static constexpr int kABytes = kBM * kBK * 2;
  static constexpr int kBBytes = kBN * kBK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;  // expect_tx of one stage

  static constexpr int kSmemBytes =
      kStages * kStageBytes + kConsumerWGs * kEpiBytesPerWG + kBarrierBytes + 1024 /*align*/;
  static_assert(kSmemBytes <= kMaxSmemPerBlock, "pipeline + epilogue staging exceed shared memory");
};

// The FP8 (e4m3) tile: 128 x kBN outputs, K consumed in 128-deep stages (one 128-byte swizzle
// row of e4m3, and one scale block of the FP8 recipe, docs/fp8.md), both operands K-major (FP8
// wgmma reads no other layout). Each stage also carries the A tile's 128 row scales of its K
// block (fp32, loaded by TMA with the codes). The consumers' wgmma batch of a stage accumulates
// into a second fp32 fragment that is promoted into the main one with the block scales after
// the batch (sm90_roles.cuh, mma_mainloop_fp8): two 64 x kBN fragments per thread, so kBN is
// at most 128 (2 x 64 registers beside the epilogue's). A tile of more columns (GEMM 1: 128
// gate | 128 up) runs kBN / kMmaN wgmma batches of kMmaN columns per stage, one after the
// other, through the same promotion fragment (kBN + kMmaN fp32 registers).
// ColScales: the B operand's scales vary per output column too (the weight gradients, whose
// operands are both quantized along the tokens): each stage then also carries the B tile's
// kBN column scales, and the promotion takes sa[row] * sb[col] per value.
template <int BN, int Stages, int ClusterM, int MmaN = BN, bool ColScales = false>
struct Fp8TileConfig : CtaShape {
  static constexpr bool kColScales = ColScales;
  static constexpr int kBN = BN;
  static constexpr int kMmaN = MmaN;
  static constexpr int kBK = 128;
  static constexpr int kStages = Stages;
  static constexpr Major kAMajor = Major::kK;
  static constexpr Major kBMajor = Major::kK;
  static constexpr int kClusterM = ClusterM;
  static constexpr bool kFp8 = true;
  static_assert(ClusterM == 1, "FP8 tiles run without clusters for now");
  static_assert(kMmaN % 64 == 0 && kMmaN <= 128 && kBN % kMmaN == 0 && kBN <= 256,
                "a 64 x kBN fragment and a 64 x kMmaN promotion fragment per thread");

  static constexpr int kABytes = kBM * kBK;  // e4m3: one byte an element
  static constexpr int kBBytes = kBN * kBK;
  static constexpr int kAScaleBytes = kBM * 4;
  static constexpr int kBScaleCols = ColScales ? kBN : 1;  // floats of the stage's B scale slot
  static constexpr int kBScaleBytes = ColScales ? kBN * 4 : 0;
  static constexpr int kStageBytes = kABytes + kBBytes + kAScaleBytes + kBScaleBytes;  // expect_tx of one stage

  // The scale ring sits behind the 1024-aligned tiles; the storage rounds up to 1 KiB.
  static constexpr int kSmemBytes = kStages * (kABytes + kBBytes) +
                                    (kStages * (kAScaleBytes + kBScaleCols * 4) + 128 + 1023) / 1024 * 1024 +
                                    kConsumerWGs * kEpiBytesPerWG + kBarrierBytes + 1024 /*align*/;
  static_assert(kSmemBytes <= kMaxSmemPerBlock, "pipeline + epilogue staging exceed shared memory");
};

}  // namespace mok::gemm
