// SwiGLU forward/backward element math of docs/numerics.md, shared by the GEMM epilogues
// and (later) the fused kernel so that both give the same bits. fp32 math on bf16 inputs.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace mok::gemm {

__host__ __device__ inline float sigmoid_f32(float g) { return 1.0f / (1.0f + expf(-g)); }

// h = bf16(silu(g) * u), g and u already rounded to bf16 (numerics.md forward step 2).
__device__ inline float swiglu_fwd(float g, float u) { return (g * sigmoid_f32(g)) * u; }

// dg = dh*u*s*(1+g*(1-s)), du = dh*g*s with s = sigmoid(g) (numerics.md backward step 3).
__device__ inline void swiglu_bwd(float dh, float g, float u, float& dg, float& du) {
  const float s = sigmoid_f32(g);
  dg = dh * u * s * (1.0f + g * (1.0f - s));
  du = dh * g * s;
}

__device__ inline uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // round to nearest even, each half
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ inline float2 unpack_bf16x2(uint32_t bits) {
  __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162*>(&bits);
  return __bfloat1622float2(v);
}

}  // namespace mok::gemm
