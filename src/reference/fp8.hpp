// The FP8 recipe's numerics for the CPU reference (docs/fp8.md): e4m3 rounding, power-of-two
// block scales, block quantization of activations (1x128) and weights (128x128), and the
// two-level accumulation of an FP8 dot product. Every rounding here is the definition the GPU
// kernels are tested against bit for bit; only the order of the sum inside one 128-wide block
// of a dot product may differ on the GPU (the tensor core's order).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace mok::ref {

// ---- e4m3 (OCP FP8 E4M3 "fn": bias 7, no infinities, max finite 448, 0x7F/0xFF = NaN) ----

inline constexpr float kE4m3Max = 448.0f;
inline constexpr uint8_t kE4m3NaN = 0x7F;  // what to_e4m3 returns for a NaN of either sign

// fp32 -> e4m3 bits: round to nearest, ties to even, saturating (|v| > 448, infinities
// included, gives +-448 = 0x7E / 0xFE). NaN gives 0x7F whatever its sign. The sign of zero and
// of values that round to zero is kept (0x80 is -0).
uint8_t to_e4m3(float v);

// e4m3 bits -> fp32, exact (0x7F and 0xFF decode to NaN).
float from_e4m3(uint8_t code);

// ---- power-of-two block scales ----

// The smallest scale exponent: 2^k and 2^-k must both be normal fp32 numbers (so neither the
// scale nor its reciprocal is flushed to zero on the GPU). Finite inputs never need k > 120.
inline constexpr int kMinScaleExponent = -126;

// The exponent k of a block's scale 2^k: the smallest k with amax / 2^k <= 448, i.e.
// 2^ceil(log2(amax / 448)), found from the exact fp32 exponent of amax (no log2/pow). Then
// amax / 2^k lies in (224, 448] unless k is clamped to kMinScaleExponent (amax < 448 * 2^-127).
// amax == 0 gives k = 0 (scale 1). amax must be finite and >= 0 (Error otherwise).
int scale_exponent(float amax);

// 2^k as fp32 (k in [kMinScaleExponent, 127]), exact.
float pow2(int k);

// The e4m3 code of v in a block whose scale is 2^k: to_e4m3(v * 2^-k). The product is exact
// (see docs/fp8.md), so dividing by the scale or multiplying by its reciprocal agree.
uint8_t quantize_e4m3(float v, int k);

// ---- block-quantized tensors ----

// A [rows, cols] row-major tensor of e4m3 codes with one fp32 scale per block of
// block_rows x block_cols elements; edge blocks cover only the elements that exist.
struct Fp8Tensor {
  int64_t rows = 0, cols = 0;
  int block_rows = 1, block_cols = 128;
  std::vector<uint8_t> data;  // [rows][cols]
  std::vector<float> scales;  // [ceil(rows / block_rows)][ceil(cols / block_cols)], powers of 2

  int64_t scale_rows() const { return (rows + block_rows - 1) / block_rows; }
  int64_t scale_cols() const { return (cols + block_cols - 1) / block_cols; }
  // The scale of the block holding element (r, c).
  float scale_at(int64_t r, int64_t c) const {
    return scales[static_cast<size_t>((r / block_rows) * scale_cols() + c / block_cols)];
  }
};

// Activations and gradients: blocks of 1x128 along cols (the reduction dimension). `name`
// names the tensor in errors: a non-finite input throws mok::Error(kInvalidArgument) naming
// the row and column of the first one in row-major order. `ld` is the row stride in elements
// (0 means cols); elements of a row past cols are never read.
Fp8Tensor quantize_rows_1x128(const float* v, int64_t rows, int64_t cols, const char* name,
                              int64_t ld = 0);
// Weights: blocks of 128x128. Same arguments.
Fp8Tensor quantize_blocks_128x128(const float* v, int64_t rows, int64_t cols, const char* name,
                                  int64_t ld = 0);
// bf16 inputs (bits as in bf16.hpp), widened exactly to fp32 first.
Fp8Tensor quantize_rows_1x128(const uint16_t* v, int64_t rows, int64_t cols, const char* name,
                              int64_t ld = 0);
Fp8Tensor quantize_blocks_128x128(const uint16_t* v, int64_t rows, int64_t cols,
                                  const char* name, int64_t ld = 0);

// from_e4m3(code) * scale for every element, [rows][cols] row-major (exact).
std::vector<float> dequantize(const Fp8Tensor& t);

// ---- FP8 dot product with two-level accumulation ----

// One output element of an FP8 GEMM: a and w are k e4m3 codes along the reduction dimension,
// a_scales / w_scales their scales per 128-wide block (ceil(k / 128) each). For b = 0, 1, ...:
//   partial = 0; for i in block b (ascending): partial += from_e4m3(a[i]) * from_e4m3(w[i])
//   acc = fmaf(partial, a_scales[b] * w_scales[b], acc)          (acc starts at +0)
// all in fp32. The products and the scale products are exact; the sums round.
float dot_fp8(const uint8_t* a, const float* a_scales, const uint8_t* w, const float* w_scales,
              int64_t k);
// The same continuing from acc (instead of +0): a reduction over several operand pairs in one
// accumulator, block after block (dgrad of G1: the gate half's blocks, then the up half's).
float dot_fp8_from(float acc, const uint8_t* a, const float* a_scales, const uint8_t* w,
                   const float* w_scales, int64_t k);

// out[m][n] of a @ w^T: row m of a (1x128 blocks) with row n of w (w is [N, K], 128x128 blocks,
// K along cols as the layer's weights are stored), both with K = cols.
float dot_fp8(const Fp8Tensor& a, int64_t m, const Fp8Tensor& w, int64_t n);

}  // namespace mok::ref
