// bf16 <-> fp32 conversion for the CPU reference (docs/numerics.md: "bf16(v) rounds an fp32
// value to the nearest bf16, ties to even; NaN stays NaN"). Header-only, no intrinsics, so
// the reference's rounding does not depend on the host's instruction set.
#pragma once

#include <bit>
#include <cstdint>

namespace mok::ref {

// fp32 -> bf16 bits, round to nearest, ties to even. NaN stays NaN (the quiet bit is set
// so that truncating the low mantissa bits can never turn a NaN into an infinity).
inline uint16_t to_bf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  // Adding 0x7FFF plus the lowest kept bit rounds half to even; a carry out of the mantissa
  // correctly bumps the exponent (and turns the largest finite values into infinity).
  const uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

// bf16 bits -> fp32, exact.
inline float from_bf16(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

// bf16(v) of numerics.md as an fp32 value (exactly representable in bf16).
inline float round_bf16(float value) { return from_bf16(to_bf16(value)); }

}  // namespace mok::ref
