// The FP8 recipe's per-value math on the GPU (docs/fp8.md), shared by the quantizers
// (fp8_quantize.cu) and the quantizing GEMM epilogues (sm90_kinds_fp8.cuh), so both give the
// bits of the CPU reference (src/reference/fp8.hpp).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>

namespace mok::gemm {

inline constexpr int kMinScaleExponent = -126;  // ref::kMinScaleExponent: 2^k and 2^-k stay normal

__host__ __device__ inline float float_from_bits(uint32_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
#endif
}

__host__ __device__ inline bool bf16_finite(uint16_t b) { return (b & 0x7F80u) != 0x7F80u; }
// |v| of a bf16 as fp32 bits.
__host__ __device__ inline uint32_t abs_bits(uint16_t b) { return static_cast<uint32_t>(b & 0x7FFFu) << 16; }

// ref::scale_exponent on the fp32 bits of a finite amax >= 0. With amax = m * 2^e,
// m in [0.5, 1): a normal amax has biased exponent E and fraction f, m = (1 + f) / 2,
// e = E - 126, and m <= 0.875 <=> f <= 0.75 <=> fraction bits <= 0x600000. A subnormal amax has
// e <= -126, so k <= -134 before the clamp.
__host__ __device__ inline int scale_exponent_bits(uint32_t amax) {
  if (amax == 0) return 0;
  const int biased = static_cast<int>(amax >> 23);
  if (biased == 0) return kMinScaleExponent;
  const int e = biased - 126;
  const int k = (amax & 0x7FFFFFu) <= 0x600000u ? e - 9 : e - 8;
  return k < kMinScaleExponent ? kMinScaleExponent : k;
}

// 2^k for k in [-126, 127], exact.
__host__ __device__ inline float pow2_bits(int k) { return float_from_bits(static_cast<uint32_t>(127 + k) << 23); }

// Codes of two bf16 values (bits) in a block with 2^-k = inv: first value in the low byte.
__host__ __device__ inline uint16_t encode2(uint16_t a, uint16_t b, float inv) {
  const float2 v = make_float2(float_from_bits(static_cast<uint32_t>(a) << 16) * inv,
                               float_from_bits(static_cast<uint32_t>(b) << 16) * inv);
  return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, __NV_E4M3));
}

}  // namespace mok::gemm
