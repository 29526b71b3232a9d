// The fused GPU backward (docs/megakernel.md "The backward"): the staged
// backward's steps with its dgrad chain as ONE persistent kernel (one CTA per SM) whose CTAs take
// roles from the forward's deterministic task list (task_list.cuh) and run the forward's task
// roles (task_roles.cuh) over the dgrad kinds:
//   - before it (backward_prologue): x, dy, topk_w staged, the x rows pulled (its barrier: all
//     staged on every rank), each row's router weight, a routing-only context's g, u recomputed,
//     hs = bf16(w h) rebuilt;
//   - in it: communication CTAs pull every minibatch's dy rows (raising per-minibatch ready
//     counters); at EP >= 2 they then push each routed row's dx to its owner's slot once its
//     row tile's dx is complete, push d topk_w once the row tile's dh is, and meet every rank at
//     a barrier; at EP 1 (nothing to push: the own rows are read in place) they join the GEMM
//     CTAs after their share of the pull. GEMM CTAs take, in list order: the shared expert's
//     dh + SwiGLU backward and dx tiles (they hide the first pulls), then per minibatch the
//     routed dh (dgrad of GEMM 2 + SwiGLU backward + the d topk_w parts, once its dy rows
//     arrived) and dx (once its row tile's dh is complete), then (unless deferred, or
//     wgrad_in_kernel off) the K-grouped weight gradients: the shared expert's tiles, then the
//     routed experts', each once the dh tiles it reads are complete (backward_wgrad.cuh);
//   - after it: the d topk_w push at EP 1, the fixed-order dx sum (backward_finish).
// Same GEMM tiles, K order, epilogues and sums as the staged backward: the staged backward's bits.
#pragma once

#include <cuda_runtime_api.h>

#include "comm/comm_state.hpp"
#include "megakernel/context.hpp"
#include "megakernel/staged_backward.hpp"
#include "megakernel/staged_forward.hpp"
#include "mok/api.hpp"

namespace mok::megakernel {

struct FusedBackwardOptions {
  int comm_ctas = 16;       // the kernel's communication CTAs (Config::effective_comm_sms_fused_backward)
  int grid = 0;             // Config::grid_sms; 0 = every SM. Must leave >= 1 GEMM CTA.
  double timeout_s = 10.0;  // Config::wait_timeout_s
  int prologue_ctas = 16;   // CTAs of the launches before the kernel (the x pull)
  // The K-grouped weight gradients as the kernel's second phase (tasks after every dgrad task,
  // backward_wgrad.cuh), or (false) as launches after it. Same bits. A testing knob
  // (Workspace::Impl::fused_wgrad_in_kernel): the benches time both placements.
  bool wgrad_in_kernel = true;
};

// One backward pass on `stream` over `saved`, as staged_backward (same arguments, same bits).
void fused_backward(comm::CommState& state, ForwardBuffers& fwd, BackwardBuffers& bwd, const SavedContext& saved,
                    const BackwardArgs& args, const ExpertWeights& weights, const WeightGrads& grads,
                    const FusedBackwardOptions& options, cudaStream_t stream, const GradInputs* defer = nullptr);

}  // namespace mok::megakernel
