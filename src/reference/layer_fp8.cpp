// One expert's SwiGLU MLP in the FP8 recipe (docs/fp8.md): the steps of layer_mlp.cpp with every
// matrix product on e4m3 operands (ref::quantize_* of the bf16 values, ref::dot_fp8). Each
// operand is quantized where the GPU path quantizes it: the rows x, dy, h, dg, du per row
// (1x128 along the reduction dimension), the weights and their transposes in 128x128 blocks,
// the weight gradients' operands along the tokens of the expert's rows in the given order.
// Sequential loops: the reference's FP8 shapes are test-sized.
#include <cmath>
#include <vector>

#include "reference/dense.hpp"
#include "reference/fp8.hpp"
#include "reference/layer_core.hpp"

namespace mok::ref::detail {
namespace {

// out[r][c] = act(dot_fp8 of row r of a with row c of w) for r < a.rows, c < w.rows; rows in parallel.
void gemm_fp8(const Fp8Tensor& a, const Fp8Tensor& w, float* out, bool round, int threads) {
  parallel_for(a.rows, threads, [&](int64_t r) {
    for (int64_t c = 0; c < w.rows; ++c) {
      const float v = dot_fp8(a, r, w, c);
      out[r * w.rows + c] = round ? act(v) : v;
    }
  });
}

// Columns [c0, c0 + cols) of a row-major [n, ld] matrix as its own [n, cols] matrix.
std::vector<float> columns(const float* v, int64_t n, int64_t ld, int64_t c0, int64_t cols) {
  std::vector<float> out(static_cast<size_t>(n * cols));
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = v[r * ld + c0 + c];
  return out;
}

}  // namespace

void mlp_forward_fp8(const MlpWeights<float>& w, const float* x, int64_t n, float* g, float* u, float* o,
                     int threads) {
  const int64_t H = w.hidden, I = w.inter;
  // G1: g = bf16(x . W_gate[i]), u = bf16(x . W_up[i]) on x (1x128 along H), W (128x128).
  const Fp8Tensor xq = quantize_rows_1x128(x, n, H, "x");
  gemm_fp8(xq, quantize_blocks_128x128(w.gate, I, H, "w_gate"), g, true, threads);
  gemm_fp8(xq, quantize_blocks_128x128(w.up, I, H, "w_up"), u, true, threads);
  // h = bf16(silu(g) * u), then G2 on h (1x128 along I) and W_down (128x128).
  std::vector<float> h(static_cast<size_t>(n * I));
  for (int64_t e = 0; e < n * I; ++e) h[e] = swiglu(g[e], u[e]);
  gemm_fp8(quantize_rows_1x128(h.data(), n, I, "h"), quantize_blocks_128x128(w.down, H, I, "w_down"), o, true, threads);
}

// g, u as the FP8 context keeps them (DeepSeek-V3's cached SwiGLU input): quantized 1x128 along I,
// then dequantized and rounded to bf16 (exact unless a value falls below bf16's smallest subnormal).
static std::vector<float> saved_fp8(const float* v, int64_t n, int64_t I, const char* name) {
  std::vector<float> out = dequantize(quantize_rows_1x128(v, n, I, name));
  for (float& e : out) e = act(e);
  return out;
}

void mlp_backward_fp8(const MlpWeights<float>& w, const float* dy, const float* row_w, const float* g_in,
                      const float* u_in, int64_t n, float* dgu, float* hs, float* dx, float* dtopk_w,
                      int threads) {
  const int64_t H = w.hidden, I = w.inter;
  // Step 1 (FP8): the saved g, u are the forward's after an FP8 round trip (the context keeps them in
  // e4m3); every step below reads those, h's rebuild and the SwiGLU backward included.
  const std::vector<float> g8 = saved_fp8(g_in, n, I, "g"), u8 = saved_fp8(u_in, n, I, "u");
  const float* g = g8.data();
  const float* u = u8.data();
  // Step 2: dhr = dy . W_down (fp32) on dy (1x128 along H) and W_down^T (128x128).
  const std::vector<float> down_t = transpose(w.down, H, I, I);  // [I, H]
  std::vector<float> dhr(static_cast<size_t>(n * I));
  gemm_fp8(quantize_rows_1x128(dy, n, H, "dy"), quantize_blocks_128x128(down_t.data(), I, H, "w_down^T"),
           dhr.data(), false, threads);
  // Steps 3, 4, 6 as the bf16 layer.
  swiglu_backward_rows(dhr.data(), row_w, g, u, n, I, dgu, hs, dtopk_w);
  // Step 5: dx = bf16([dg | du] . [W_gate ; W_up]): dg and du quantized each on its own (1x128
  // along I), the transposed weights 128x128; one accumulator, the gate half's blocks first.
  const Fp8Tensor dgq = quantize_rows_1x128(dgu, n, I, "dg", 2 * I);
  const Fp8Tensor duq = quantize_rows_1x128(dgu + I, n, I, "du", 2 * I);
  const std::vector<float> gate_t = transpose(w.gate, I, H, H), up_t = transpose(w.up, I, H, H);  // [H, I]
  const Fp8Tensor wgt = quantize_blocks_128x128(gate_t.data(), H, I, "w_gate^T");
  const Fp8Tensor wut = quantize_blocks_128x128(up_t.data(), H, I, "w_up^T");
  const int64_t kb = dgq.scale_cols();
  parallel_for(n, threads, [&](int64_t r) {
    for (int64_t j = 0; j < H; ++j) {
      const float* sw = wgt.scales.data() + (j / 128) * kb;
      const float* su = wut.scales.data() + (j / 128) * kb;
      float acc = dot_fp8_from(0.0f, dgq.data.data() + r * I, dgq.scales.data() + r * kb, wgt.data.data() + j * I,
                               sw, I);
      acc = dot_fp8_from(acc, duq.data.data() + r * I, duq.scales.data() + r * kb, wut.data.data() + j * I, su, I);
      dx[r * H + j] = act(acc);
    }
  });
}

void mlp_wgrad_fp8(const MlpWeights<float>& w, const float* x, const float* dy, const float* dgu, const float* hs,
                   int64_t n, float* dgate, float* dup, float* ddown, int threads) {
  const int64_t H = w.hidden, I = w.inter;
  // The reduction runs over the n rows (tokens): every operand transposed, 1x128 blocks along
  // the rows from the first one.
  const std::vector<float> x_t = transpose(x, n, H, H), dy_t = transpose(dy, n, H, H);  // [H, n]
  const std::vector<float> hs_t = transpose(hs, n, I, I);                                // [I, n]
  const std::vector<float> dg = columns(dgu, n, 2 * I, 0, I), du = columns(dgu, n, 2 * I, I, I);
  const std::vector<float> dg_t = transpose(dg.data(), n, I, I), du_t = transpose(du.data(), n, I, I);
  const Fp8Tensor xq = quantize_rows_1x128(x_t.data(), H, n, "x^T");
  gemm_fp8(quantize_rows_1x128(dg_t.data(), I, n, "dg^T"), xq, dgate, false, threads);   // [I, H]
  gemm_fp8(quantize_rows_1x128(du_t.data(), I, n, "du^T"), xq, dup, false, threads);     // [I, H]
  gemm_fp8(quantize_rows_1x128(dy_t.data(), H, n, "dy^T"), quantize_rows_1x128(hs_t.data(), I, n, "hs^T"),
           ddown, false, threads);                                                        // [H, I]
}

}  // namespace mok::ref::detail
