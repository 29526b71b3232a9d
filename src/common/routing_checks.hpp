// Host-side checks of routing inputs (the CPU reference path and tests use them; the GPU
// schedule performs the same checks on the device and reports them through error flags).
#pragma once

#include <cstdint>
#include <span>

#include "mok/shape.hpp"

namespace mok {

// topk_idx [T, K] of one rank: every id in [0, E), no expert twice within one token.
// Throws Error(kInvalidArgument) naming rank, token and k, e.g.
// "topk_idx[rank 1, token 5, k 2]: expected an expert id in [0, 256), got 300".
void check_topk_idx(const LayerShape& shape, int rank, std::span<const int32_t> topk_idx);
// topk_w [T, K] of one rank: every weight finite.
void check_topk_w(const LayerShape& shape, int rank, std::span<const float> topk_w);
// Per-rank token counts must all equal shape.tokens ("different T across ranks").
void check_tokens_per_rank(const LayerShape& shape, std::span<const int64_t> tokens_per_rank);

}  // namespace mok
