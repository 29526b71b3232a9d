// Host API of the FP8 kinds of the Hopper grouped GEMM engine (the recipe of docs/fp8.md:
// e4m3 operands, fp32 block scales, two-level accumulation). Same row-buffer contract,
// segments, launch options and determinism as grouped_gemm.hpp; the operands arrive quantized
// (fp8_quantize.hpp writes these layouts).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "gemm/fp8_quantize.hpp"
#include "gemm/grouped_gemm.hpp"

namespace mok::gemm {

// A row operand quantized in 1x128 blocks along K: codes [buffer_rows, k] (e4m3 bytes, row
// stride k), and the scale of row r in K block b at scales[b * buffer_rows + r] ("K-block
// major": a tile's 128 row scales of one block are contiguous). Padding rows: codes 0.
struct Fp8Rows {
  const uint8_t* codes = nullptr;
  const float* scales = nullptr;
  int64_t ld = 0;  // bytes from one row of codes to the next; 0 = k (dense), else a multiple of 16 >= k
};

// A weight stack quantized in 128x128 blocks: codes [E, n, k] (dense), scales
// [E][ceil(n / 128)][ceil(k / 128)].
struct Fp8Weights {
  const uint8_t* codes = nullptr;
  const float* scales = nullptr;
};

// GEMM 2 in FP8 (forward): per row r of expert e and column n < H,
//   out[r][n] = bf16(acc),  acc = sum over K blocks b (in order) of
//               fmaf(h[r] . W_down[e][n] over block b, sh[r][b] * sw[e][n / 128][b], acc)
// (ref::dot_fp8; the sum inside a block is the tensor core's). h [buffer_rows, I] 1x128;
// W_down [E, H, I] 128x128; out [buffer_rows, H] bf16, padding rows zero.
// hidden and intermediate: positive multiples of 64 (partial 128-blocks allowed).
struct Gemm2Fp8Args {
  Segments seg;
  int64_t hidden = 0, intermediate = 0;
  Fp8Rows h;
  Fp8Weights w_down;
  bf16* out = nullptr;
};

// GEMM 1 + SwiGLU in FP8 (forward): per row r of expert e, i < I,
//   g = bf16(dot(x[r], W_gate[e][i])), u = bf16(dot(x[r], W_up[e][i])), h = bf16(silu(g) * u)
// with the FP8 dot of Gemm2Fp8Args, then h quantized in 1x128 blocks along I for GEMM 2:
// h_codes [buffer_rows, I] and h_scales [ceil(I / 128)][buffer_rows] (Fp8Rows' layout), bit
// for bit fp8_quantize.hpp's quantize_rows_1x128 of the bf16 h (padding rows: codes 0, scale 1).
// x [buffer_rows, H] 1x128; W_gate, W_up [E, I, H] 128x128; g, u [buffer_rows, I] bf16 (the
// saved context); h [buffer_rows, I] bf16 or nullptr (not written). A non-finite h is recorded
// in `nonfinite` (index row * I + col; required): check_nonfinite after the stream.
// With g8, u8 (codes and scales in h_codes' layout) g and u are quantized too, from the same
// rounded bf16 values: bit for bit quantize_rows_1x128 of the bf16 g, u (the FP8 context's
// copies, docs/fp8.md), a non-finite g or u recorded in gu_nonfinite (required then); g and u
// (bf16) may then be nullptr (not written). Without g8, u8 both bf16 g and u are required.
struct Gemm1SwigluFp8Args {
  Segments seg;
  int64_t hidden = 0, intermediate = 0;
  Fp8Rows x;
  Fp8Weights w_gate, w_up;
  bf16* g = nullptr;
  bf16* u = nullptr;
  bf16* h = nullptr;
  uint8_t* h_codes = nullptr;
  float* h_scales = nullptr;
  NonFiniteRecord* nonfinite = nullptr;
  uint8_t* g_codes = nullptr;
  float* g_scales = nullptr;
  uint8_t* u_codes = nullptr;
  float* u_scales = nullptr;
  NonFiniteRecord* gu_nonfinite = nullptr;
};

// dgrad of GEMM 1 in FP8: dx[r] = bf16(acc), acc = the FP8 dot of [dg | du][r] with
// [W_gate[e] ; W_up[e]] column by column: the gate half's K blocks, then the up half's, in one
// fp32 accumulator. dg, du [buffer_rows, I] 1x128 along I (each on its own); the weights as
// their transposed copies W_gate^T, W_up^T [E, H, I] (128x128: quantize_blocks_128x128's
// codes_t / scales_t); dx [buffer_rows, H] bf16, padding rows zero.
struct DgradInputFp8Args {
  Segments seg;
  int64_t hidden = 0, intermediate = 0;
  Fp8Rows dg, du;
  Fp8Weights w_gate_t, w_up_t;
  bf16* dx = nullptr;
};

// dgrad of GEMM 2 with the SwiGLU backward fused, in FP8 (DgradHiddenArgs' computation):
// dhr = the FP8 dot of dys[r] with W_down[e] column i (fp32, never rounded), dh = w_r * dhr
// (row_w, else 1), dg, du = bf16(SwiGLU backward) from the saved g, u, and with row_w the
// d topk_w parts into dw_part. Then dg and du quantized in 1x128 blocks along I for
// dgrad_input_fp8 (bit for bit quantize_rows_1x128 of the bf16 dg, du). dys [buffer_rows, H]
// 1x128; W_down as its transposed copy W_down^T [E, I, H] (128x128); g, u, dg, du
// [buffer_rows, I] bf16; dg_codes, du_codes [buffer_rows, I]; dg_scales, du_scales
// [ceil(I / 128)][buffer_rows]. A non-finite dg or du is recorded in `nonfinite` (required).
struct DgradHiddenFp8Args {
  Segments seg;
  int64_t hidden = 0, intermediate = 0;
  Fp8Rows dys;
  Fp8Weights w_down_t;
  const bf16* g = nullptr;
  const bf16* u = nullptr;
  bf16* dg = nullptr;
  bf16* du = nullptr;
  const float* row_w = nullptr;
  float* dw_part = nullptr;
  uint8_t* dg_codes = nullptr;
  uint8_t* du_codes = nullptr;
  float* dg_scales = nullptr;
  float* du_scales = nullptr;
  NonFiniteRecord* nonfinite = nullptr;
};

// wgrad in FP8, K-grouped over each expert's segment rows: dW[e] [m, n] = sum over the
// segment's rows r (in order, 128-row blocks from the segment start) of a[r]^T b[r], each block
// with fp8's two-level accumulation: acc = fmaf(block sum, sa[mm][blk] * sb[nn][blk], acc).
// The operands transposed and quantized along the tokens (quantize_cols_128x1_transposed):
// codes [m (or n), buffer_rows], scales [buffer_rows / 128][m (or n)]. Modes as WgradOut:
// kPartialFp32 writes the fp32 sums, kAccumulateFp32 adds them to an fp32 main grad (one add),
// kWriteBf16 writes bf16(sums). Whole segments only (no row ranges, no seeding partial).
struct Fp8Transposed {
  const uint8_t* codes = nullptr;
  const float* scales = nullptr;
};
struct WgradFp8Problem {
  Fp8Transposed a, b;
  int64_t m = 0, n = 0;
  void* out = nullptr;  // [E, m, n]
  // Elements from expert e's [m, n] block of `out` to e+1's; 0 = m*n (dense). kWriteBf16 and
  // kAccumulateFp32 only (as WgradProblem::out_stride).
  int64_t out_stride = 0;
};
struct WgradFp8Args {
  Segments seg;
  WgradOut mode = WgradOut::kPartialFp32;
  WgradFp8Problem problems[kMaxWgradProblemsPerCall];
  int num_problems = 0;
};

void gemm2_fp8(const Gemm2Fp8Args& args, const Launch& launch, cudaStream_t stream);
void wgrad_fp8(const WgradFp8Args& args, const Launch& launch, cudaStream_t stream);
void dgrad_hidden_swiglu_fp8(const DgradHiddenFp8Args& args, const Launch& launch, cudaStream_t stream);
void dgrad_input_fp8(const DgradInputFp8Args& args, const Launch& launch, cudaStream_t stream);
void gemm1_swiglu_fp8(const Gemm1SwigluFp8Args& args, const Launch& launch, cudaStream_t stream);

}  // namespace mok::gemm
