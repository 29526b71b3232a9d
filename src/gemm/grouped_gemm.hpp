// Host API of the Hopper (sm_90a) grouped GEMM engine: the five GEMMs of one routed-expert
// MLP over an expert-major row buffer, forward and backward. See docs/gemm.md.
//
// Row buffer contract (every row operand and row output):
//   - rows are grouped by expert: segment e = buffer rows [offsets[e], offsets[e+1]);
//     offsets are multiples of kRowTile (128), nondecreasing, offsets[experts] <= buffer_rows;
//   - rows[e] <= offsets[e+1] - offsets[e] real rows per segment; the remaining rows of the
//     segment are padding. Padding rows of the ROW INPUTS are ZERO by contract (the wgrad
//     reduction runs over them); every row output of this engine writes zeros into them.
//   - offsets and rows live in device memory: tile scheduling reads them on the GPU, so a
//     schedule computed on the GPU needs no host synchronisation. Segments may be empty.
// All matrices are row-major bf16 with fp32 accumulation; rounding follows docs/numerics.md.
// Determinism: every output element is computed by one CTA with a fixed K order and written
// once; results are bitwise identical across runs and grid sizes (docs/gemm.md).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace mok::gemm {

using bf16 = __nv_bfloat16;

struct Segments {
  const int32_t* offsets = nullptr;  // device [experts + 1]
  const int32_t* rows = nullptr;     // device [experts]
  int experts = 0;
  int64_t buffer_rows = 0;  // allocated rows of the row buffers, a multiple of 128
};

struct Launch {
  int grid = 0;                     // persistent CTAs; 0 = one per SM. Never changes results.
  uint32_t* error_flag = nullptr;   // device word, OR-ed with ErrorBit values; nullptr: trap
  double timeout_s = 10.0;          // longest single in-kernel wait before it reports
  int cluster = 0;                  // forward/dgrad: CTAs per cluster sharing B tiles by TMA
                                    // multicast, 1 or 2; 0 = default (1). Never changes results.
                                    // With 2 the grid is rounded down to whole clusters. wgrad: ignored.
};

// GEMM 1 + SwiGLU (forward): per row r of expert e, i < I:
//   g = bf16(x[r] . W_gate[e][i]), u = bf16(x[r] . W_up[e][i]), h = bf16(silu(g) * u).
// x [buffer_rows, H]; W_gate, W_up [E, I, H]; h, g, u [buffer_rows, I] (g, u: saved context).
struct Gemm1SwigluArgs {
  Segments seg;
  int64_t hidden = 0, intermediate = 0;
  const bf16* x = nullptr;
  const bf16* w_gate = nullptr;
  const bf16* w_up = nullptr;
  bf16* h = nullptr;
  bf16* g = nullptr;
  bf16* u = nullptr;
  int64_t w_gate_stride = 0, w_up_stride = 0;  // elements from expert e to e+1; 0 = I*H
};

// GEMM 2 (forward): out[r] = bf16(h[r] . W_down[e]^T). h [buffer_rows, I]; W_down [E, H, I];
// out [buffer_rows, H].
struct Gemm2Args {
  Segments seg;
  int64_t hidden = 0, intermediate = 0;
  const bf16* h = nullptr;
  const bf16* w_down = nullptr;
  bf16* out = nullptr;
  int64_t w_down_stride = 0;  // elements from expert e to e+1; 0 = H*I
};

// dgrad of GEMM 2 with the SwiGLU backward fused (docs/numerics.md Backward): per row r,
// dhr = dys[r] . W_down[e] (fp32), dh = w_r * dhr with w_r = row_w[r] (1 without row_w), then
// dg = bf16(dh*u*s*(1+g*(1-s))), du = bf16(dh*g*s), s = sigmoid(g), from the saved g, u.
// The routed backward passes the UNSCALED dy rows as `dys` and the rows' router weights as
// row_w; the epilogue then also writes, from the same accumulator and h = bf16(silu(g)*u),
//   dw_part[r * ceil(I/256) + n] = sum over the tile's columns i of dhr[i] * h[i]  (fp32: the
//   part of d topk_w of row r in column tile n; the caller sums the tiles in order).
// dys [buffer_rows, H]; W_down [E, H, I]; g, u, dg, du [buffer_rows, I]; row_w [buffer_rows];
// dw_part [buffer_rows, ceil(I/256)] (required with row_w). The shared expert: row_w nullptr.
struct DgradHiddenArgs {
  Segments seg;
  int64_t hidden = 0, intermediate = 0;
  const bf16* dys = nullptr;
  const bf16* w_down = nullptr;
  const bf16* g = nullptr;
  const bf16* u = nullptr;
  bf16* dg = nullptr;
  bf16* du = nullptr;
  const float* row_w = nullptr;
  float* dw_part = nullptr;
  int64_t w_down_stride = 0;  // elements from expert e to e+1; 0 = H*I
};
// Column tiles of the dh GEMM: the second dimension of DgradHiddenArgs::dw_part.
inline int64_t dgrad_hidden_col_tiles(int64_t intermediate) { return (intermediate + 255) / 256; }

// dgrad of GEMM 1: dx[r] = bf16([dg | du][r] . [W_gate[e] ; W_up[e]]), one fp32 sum over
// the gate half then the up half. dg, du [buffer_rows, I]; W_gate, W_up [E, I, H];
// dx [buffer_rows, H].
struct DgradInputArgs {
  Segments seg;
  int64_t hidden = 0, intermediate = 0;
  const bf16* dg = nullptr;
  const bf16* du = nullptr;
  const bf16* w_gate = nullptr;
  const bf16* w_up = nullptr;
  bf16* dx = nullptr;
  int64_t w_gate_stride = 0, w_up_stride = 0;  // elements from expert e to e+1; 0 = I*H
};

// wgrad, K-grouped: dW[e] [M, N] = sum over the expert's rows r (in row order) of
// a[r]^T b[r]  (a [buffer_rows, M], b [buffer_rows, N]):
//   dW_down = dys^T h (M=H, N=I);  dW_gate = dg^T x, dW_up = du^T x (M=I, N=H).
// Rows reduced for expert e: [offsets[e] + row_begin[e], offsets[e] + row_end[e]) clipped to
// the segment and to its real rows rounded up to 64; row_begin/row_end are relative to the
// segment start, multiples of 128 (kRowTile), nullptr = the whole segment. The reduction
// steps through 64-row blocks aligned to the segment start, so a range split over several
// calls, with the fp32 partial of one call seeding the next, gives the bits of one call.
enum class WgradOut {
  kPartialFp32 = 0,     // out = float [E, M, N]: the fp32 sums (to be continued)
  kWriteBf16 = 1,       // out = bf16 [E, M, N]: bf16(sums)
  kAccumulateFp32 = 2,  // out = float [E, M, N] main grad: out += sums (one fp32 add)
};

struct WgradProblem {
  const bf16* a = nullptr;  // [buffer_rows, m]
  const bf16* b = nullptr;  // [buffer_rows, n]
  int64_t m = 0, n = 0;
  const float* partial_in = nullptr;  // float [E, m, n] seeding the sums, or nullptr = zeros
  void* out = nullptr;                // see WgradOut; may alias partial_in
  // Elements from expert e's [m, n] block of `out` to e+1's; 0 = m*n. kWriteBf16 and
  // kAccumulateFp32 only (partials stay dense).
  int64_t out_stride = 0;
};

inline constexpr int kMaxWgradProblemsPerCall = 3;

struct WgradArgs {
  Segments seg;
  const int32_t* row_begin = nullptr;  // device [experts] or nullptr
  const int32_t* row_end = nullptr;    // device [experts] or nullptr
  WgradOut mode = WgradOut::kWriteBf16;
  WgradProblem problems[kMaxWgradProblemsPerCall];
  int num_problems = 0;
};

// Launchers: validate (throw mok::Error naming the bad argument), encode TMA descriptors,
// launch on `stream`. Asynchronous; check launch.error_flag after the stream completes.
void gemm1_swiglu(const Gemm1SwigluArgs& args, const Launch& launch, cudaStream_t stream);
void gemm2(const Gemm2Args& args, const Launch& launch, cudaStream_t stream);
void dgrad_hidden_swiglu(const DgradHiddenArgs& args, const Launch& launch, cudaStream_t stream);
void dgrad_input(const DgradInputArgs& args, const Launch& launch, cudaStream_t stream);
void wgrad(const WgradArgs& args, const Launch& launch, cudaStream_t stream);

}  // namespace mok::gemm
