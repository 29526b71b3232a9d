// SwiGLU forward/backward element math of docs/numerics.md, shared by the GEMM epilogues
// and (later) the fused kernel so that both give the same bits. fp32 math on bf16 inputs.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace mok::gemm {

// On the GPU exp and the reciprocal are the SFU's approximations (ex2.approx.ftz after a
// multiply by log2(e), rcp.approx.ftz): relative error about 2^-21, far below the bf16
// rounding (2^-9) that every use of sigmoid ends in, and ~10x fewer instructions than the
// IEEE expf and division, which dominated the GEMM 1 and dh epilogues (docs/gemm.md). The
// host (CPU reference) keeps libm; numerics.md lists the difference.
__host__ __device__ inline float sigmoid_f32(float g) {
#if defined(__CUDA_ARCH__)
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(-g * 1.44269504088896341f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
  return r;
#else
  return 1.0f / (1.0f + expf(-g));
#endif
}

// h = bf16(silu(g) * u), g and u already rounded to bf16 (numerics.md forward step 2).
__device__ inline float swiglu_fwd(float g, float u) { return (g * sigmoid_f32(g)) * u; }

// dg = dh*u*s*(1+g*(1-s)), du = dh*g*s with s = sigmoid(g) (numerics.md backward step 3).
__device__ inline void swiglu_bwd(float dh, float g, float u, float& dg, float& du) {
  const float s = sigmoid_f32(g);
  dg = dh * u * s * (1.0f + g * (1.0f - s));
  du = dh * g * s;
}

// The routed row's step of numerics.md Backward: from the raw dhr = dy . W_down and the row's
// router weight w: dh = w * dhr, dg, du as swiglu_bwd, and h = bf16(silu(g) * u) rebuilt with
// the bits of the forward (the same sigmoid value feeds both).
__device__ inline void swiglu_bwd_routed(float dhr, float w, float g, float u, float& dg, float& du, float& h) {
  const float s = sigmoid_f32(g);
  const float dh = w * dhr;
  dg = dh * u * s * (1.0f + g * (1.0f - s));
  du = dh * g * s;
  h = __bfloat162float(__float2bfloat16_rn((g * s) * u));
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
