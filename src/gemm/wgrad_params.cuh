// The wgrad kind's kernel parameters built from its launch arguments (gemm_wgrad.cu): the
// standalone launch and the fused backward's weight-gradient tasks (megakernel/fused_backward.cu)
// use the same tensor maps, tiles and K ranges, so each tile computes the same bits.
#pragma once

#include <cstdint>

#include "gemm/grouped_gemm.hpp"
#include "gemm/sm90_kinds_wgrad.cuh"

namespace mok::gemm {

// Validates `args` (mok::Error naming the argument) and encodes its tensor maps; *tiles (if
// given): the launch's tile count, which depends on the shapes only.
WgradParams wgrad_params(const WgradArgs& args, const Launch& launch, int64_t* tiles = nullptr);

}  // namespace mok::gemm
