// The dgrad kinds' kernel parameters built from their launch arguments (gemm_dgrad.cu): the
// standalone launches and the fused backward's tasks (megakernel/fused_backward.cu) use the same
// tensor maps, K steps and prefetch placement, so each tile computes the same bits. The
// parameters' scheduler describes the standalone launch; the fused kernel finds its tiles itself.
#pragma once

#include "gemm/grouped_gemm.hpp"
#include "gemm/sm90_kinds_rows.cuh"

namespace mok::gemm {

DgradHiddenParams dgrad_hidden_params(const DgradHiddenArgs& args, const Launch& launch);
DgradInputParams dgrad_input_params(const DgradInputArgs& args, const Launch& launch);

}  // namespace mok::gemm
