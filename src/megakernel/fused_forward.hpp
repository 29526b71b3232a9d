// The fused GPU forward (docs/megakernel.md): after the schedule, ONE persistent kernel (one CTA
// per SM) whose CTAs take roles from a deterministic task list:
//   - communication CTAs (Config::comm_sms_forward): dispatch every minibatch (pull over
//     NVLink, raising per-minibatch ready counters), then combine (push to the owner's slots
//     each row of another rank's token once GEMM 2 finished its tile), then a barrier of all
//     ranks; or, after their dispatch share, join the GEMM CTAs (FusedForwardOptions::join_gemm);
//   - GEMM CTAs: take the tasks of one list in order from a counter: shared-expert tiles
//     first, then per minibatch GEMM1+SwiGLU (once its rows arrived) and GEMM2 (once its
//     hidden row tile is complete), publishing per-row-tile completion counters
//     (src/megakernel/task_list.cuh, fused_roles.cuh).
// The fixed-order top-k sum runs as a small kernel after it (or, with fused_topk_sum, inside
// it: each token once its rows exist). Same GEMM tiles, same K order, same
// epilogues and sums as the staged forward: the bits are the staged forward's bits.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "comm/comm_state.hpp"
#include "megakernel/context.hpp"
#include "megakernel/staged_forward.hpp"
#include "mok/api.hpp"

namespace mok::megakernel {

// The fused forward's choices: Config's three, then the choices still undecided (each gives
// the same bits; docs/megakernel.md says what was measured, docs/experiments.md what lost).
struct FusedForwardOptions {
  int comm_ctas = 16;       // Config::comm_sms_forward
  int grid = 0;             // Config::grid_sms; 0 = every SM. Must leave >= 1 GEMM CTA.
  double timeout_s = 10.0;  // Config::wait_timeout_s
  // Comm CTAs that take GEMM tasks once their share of the dispatch is done. -1 (default):
  // automatic: all of them when the combine has nothing to move (EP 1: wins, the GEMMs get the
  // comm SMs back), else none (with epilogue_push all but one); 0: none; N: N (at most
  // comm_ctas - 1 when the combine has rows to move). Undecided at EP >= 2.
  int join_gemm = -1;
  // The combine pushed from GEMM 2's epilogue (fused_push.cuh): each routed GEMM 2 tile's warps
  // copy its rows of other ranks' tokens into their slots, so the comm CTAs have no combine.
  // -1 (default) and 0: off; 1: on. Wins when it frees the comm CTAs at EP >= 2 (to be
  // measured there: bench_forward --push 1 --push-sum 1 --fused-sum 1 times the variants).
  int epilogue_push = -1;
  // The fixed-order top-k sum inside the fused kernel (fused_topk_sum.cuh): each token summed as
  // soon as its rows exist instead of in a kernel after a barrier of all ranks. Off by default
  // (EP 1: qwen3 -1 to -4 %); wins when the barrier's wait is long (EP >= 2, to be measured).
  bool fused_topk_sum = false;
};

// One forward pass on `stream` after mok::schedule() (no host synchronisation). Writes y and
// the saved g, u, shared g, u into `save` (a layer's context; with the macrobatch ring the routed
// g, u stay in the ring's slots of `buffers` instead). With the ring every row is pushed: the
// slots hold the own rank's (t, k) rows too and expert_out is not written.
// Throws mok::Error for a grid that cannot be co-resident (grid > SMs, or no GEMM CTA left).
void fused_forward(comm::CommState& state, ForwardBuffers& buffers, const ForwardArgs& args,
                   const ExpertWeights& weights, const FusedForwardOptions& options, const SavedContext& save,
                   cudaStream_t stream);

// Developer trace (docs/megakernel.md, "The trace build"): in a build with
// -DMOK_FORWARD_TRACE (cmake -DMOK_FORWARD_TRACE=ON) every fused_forward() records per-CTA
// phase stamps; forward_trace_dump writes the last pass of this host thread to `path` (format:
// forward_trace.cuh, reader: scripts/forward_trace.py). Other builds: enabled() is false and
// dump throws kInvalidArgument.
bool forward_trace_enabled();
void forward_trace_dump(const std::string& path);

}  // namespace mok::megakernel
