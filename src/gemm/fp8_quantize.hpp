// GPU block quantizers of the FP8 recipe (docs/fp8.md): bf16 -> e4m3 codes with power-of-two
// fp32 block scales, equal bit for bit to the CPU reference (src/reference/fp8.hpp):
//   k = the smallest integer with amax <= 448 * 2^k, clamped to >= -126; amax == 0 -> k = 0;
//   scale = 2^k; code = e4m3(v * 2^-k), round to nearest even, saturating, sign of zero kept.
// Edge blocks cover only the elements that exist; nothing past a row's `cols` is read, and no
// output element outside the tensor (past cols / rows, or in an ld's padding) is written.
// Non-finite inputs are not errors on the GPU (nothing traps): the kernels write finite
// outputs (such an element counts as 0) and record the first one in row-major order in a
// NonFiniteRecord, which check_nonfinite turns into mok::Error. All outputs are a function of
// the input alone: bitwise identical across runs and launch shapes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace mok::gemm {

// First non-finite element found by a quantizer, in row-major order of the tensor it read:
// the smallest linear index row * cols + col (row/col of the SOURCE tensor), kept with
// atomicMin so the result does not depend on scheduling. ~0ull = none. Reset before use.
struct NonFiniteRecord {
  unsigned long long first;
};
// Sets first = ~0ull (cudaMemsetAsync with 0xFF).
void reset_nonfinite(NonFiniteRecord* dev, cudaStream_t stream);
// Reads the record (synchronises the stream) and, if a non-finite value was recorded, throws
// mok::Error(Status::kInvalidArgument): "mok fp8: non-finite value in <name> at row R, column C",
// with R = first / cols and C = first % cols (`cols` of the tensor the quantizer read). The
// record is left as it is: reset it before the next run.
void check_nonfinite(const NonFiniteRecord* dev, int64_t cols, const char* name, cudaStream_t stream);

// Activations / gradients: 1x128 blocks along cols (the GEMM reduction dimension).
// codes [rows][codes_ld] e4m3 bytes; the scale of row r, block b at scales[b * scales_ld + r]
// ("K-block major": a GEMM tile's 128 row scales of one K block are contiguous, for a TMA load).
// Elements of a row at or past cols are never read; codes at or past cols are not written.
struct QuantizeRowsArgs {
  const __nv_bfloat16* x = nullptr;
  int64_t rows = 0, cols = 0, ld = 0;  // ld in elements, 0 = cols; >= cols
  uint8_t* codes = nullptr;
  int64_t codes_ld = 0;  // 0 = cols; >= cols and a multiple of 16 (TMA row stride)
  float* scales = nullptr;
  int64_t scales_ld = 0;  // 0 = rows; >= rows
  NonFiniteRecord* nonfinite = nullptr;  // required
  // Optional device row count read at run time (the schedule's padded rows of a routed buffer
  // sized for the worst case): rows at or past min(rows, *rows_limit) are neither read nor
  // written; a negative value (a poisoned schedule) means none. nullptr: every row.
  const int64_t* rows_limit = nullptr;
  // > 0: the scales row by row instead, scales[r * scales_row_stride + b] (scales_ld unused; >= the
  // blocks of a row): the packed FP8 rows of the dispatch, each row's scales after its codes.
  int64_t scales_row_stride = 0;
};
void quantize_rows_1x128(const QuantizeRowsArgs& a, cudaStream_t stream);

// The transposed operand of a weight-gradient GEMM: x is [rows][cols] (tokens x features); the
// output is x^T quantized with 1x128 blocks along the token dimension, i.e. blocks of 128
// consecutive rows of x in one column:
//   codes_t[c * codes_t_ld + r] = code of x[r][c];  scales_t[(r / 128) * scales_t_ld + c].
// Equal bit for bit to quantize_rows_1x128 of the transposed matrix (its scales transposed).
// The non-finite record indexes x itself: r * cols + c.
struct QuantizeColsArgs {
  const __nv_bfloat16* x = nullptr;
  int64_t rows = 0, cols = 0, ld = 0;  // ld: 0 = cols; >= cols
  uint8_t* codes_t = nullptr;
  int64_t codes_t_ld = 0;  // 0 = rows; >= rows and a multiple of 16
  float* scales_t = nullptr;
  int64_t scales_t_ld = 0;  // 0 = cols; >= cols
  NonFiniteRecord* nonfinite = nullptr;  // required
  const int64_t* rows_limit = nullptr;  // as QuantizeRowsArgs::rows_limit (rows of x)
  // Optional (row_codes nullptr: none): x's 1x128 row quantization too, quantize_rows_1x128's codes
  // [rows][row_codes_ld] and K-block major scales (row r, block b at row_scales[b * row_scales_ld + r])
  // bit for bit, from the same loads: one read of a tensor that a GEMM takes as rows and a weight
  // gradient as columns (dy). Both layouts need x 16-byte aligned (ld, cols multiples of 8) and the
  // codes 8-byte aligned (row_codes_ld a multiple of 8) to share the pass; otherwise the two passes run.
  uint8_t* row_codes = nullptr;
  int64_t row_codes_ld = 0;   // 0 = cols; >= cols and a multiple of 16
  float* row_scales = nullptr;
  int64_t row_scales_ld = 0;  // 0 = rows; >= rows
};
void quantize_cols_128x1_transposed(const QuantizeColsArgs& a, cudaStream_t stream);

// Weights: 128x128 blocks of a stack of `batch` matrices [rows][cols] (matrix e at
// w + e * batch_stride elements; 0 = rows * cols, else >= rows * cols).
// codes [batch][rows][cols]; scales [batch][ceil(rows/128)][ceil(cols/128)]; optional
// transposed copy (nullptr = not written; both or neither): codes_t [batch][cols][rows],
// scales_t [batch][ceil(cols/128)][ceil(rows/128)], the same codes and scales transposed
// (the amax of a square block does not depend on its orientation).
struct QuantizeBlocksArgs {
  const __nv_bfloat16* w = nullptr;
  int64_t batch = 1, rows = 0, cols = 0, batch_stride = 0;
  uint8_t* codes = nullptr;
  float* scales = nullptr;
  uint8_t* codes_t = nullptr;
  float* scales_t = nullptr;
  NonFiniteRecord* nonfinite = nullptr;  // required; row reported = e * rows + r, cols = cols
};
void quantize_blocks_128x128(const QuantizeBlocksArgs& a, cudaStream_t stream);

// The inverse of quantize_rows_1x128 (ref::dequantize of a 1x128 tensor): out[r][c] =
// bf16(from_e4m3(code) * scale), exact (an e4m3 value times a power of two has 4 significant bits)
// unless it falls below bf16's smallest subnormal. Codes and scales in quantize_rows_1x128's layout
// (scales K-block major); rows at or past *rows_limit (optional, as there) are not written.
struct DequantizeRowsArgs {
  const uint8_t* codes = nullptr;
  int64_t rows = 0, cols = 0;
  int64_t codes_ld = 0;   // 0 = cols
  const float* scales = nullptr;
  int64_t scales_ld = 0;  // 0 = rows
  __nv_bfloat16* out = nullptr;
  int64_t ld = 0;         // 0 = cols
  const int64_t* rows_limit = nullptr;
};
void dequantize_rows_1x128(const DequantizeRowsArgs& a, cudaStream_t stream);

}  // namespace mok::gemm
