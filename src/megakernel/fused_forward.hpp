// The fused GPU forward (DESIGN §2, §6): after the schedule, ONE persistent kernel (one CTA
// per SM) whose CTAs take roles from a deterministic task list:
//   - communication CTAs (Config::comm_sms_forward): dispatch every minibatch (pull over
//     NVLink, raising per-minibatch ready counters), then combine every row tile as soon as
//     GEMM 2 finished it (push to the owner's slots), then a barrier of all ranks; or, after
//     their dispatch share, join the GEMM CTAs (FusedForwardOptions::join_gemm);
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
#include "megakernel/staged_forward.hpp"
#include "mok/api.hpp"

namespace mok::megakernel {

// Which forward mok::forward runs. Default fused; MOK_FORWARD_PATH=staged selects the staged
// forward (benchmarking, bisecting), read once when a workspace is created.
enum class ForwardPath { kFused = 0, kStaged = 1 };
ForwardPath forward_path_from_env();
const char* forward_path_name(ForwardPath path);

struct FusedForwardOptions {
  int comm_ctas = 16;       // Config::comm_sms_forward
  int grid = 0;             // Config::grid_sms; 0 = every SM. Must leave >= 1 GEMM CTA.
  double timeout_s = 10.0;  // Config::wait_timeout_s
  bool dedup = true;              // dispatch: each (token, rank) read once and fanned out (same bytes)
  bool own_rows_in_place = true;  // combine: only other ranks' rows move; the epilogue reads own ones in place
  bool combine_remote_list = true;  // in-place combine over the schedule's remote-row list (false: row tiles per CTA)
  // dispatch: each other rank's token lands once in a token-major receive buffer and GEMM 1
  // gathers its rows from x and that buffer with cp.async (no fan-out, no expert-major row
  // buffer). Same bits. Off by default: the dispatch is ~2.7x faster, but on sm_90 the gather
  // makes GEMM 1 slower than the fan-out costs (measured 1.05-1.18x the forward's time,
  // docs/megakernel.md).
  bool token_major = false;
  // Dedup fan-out: the GEMM CTAs' consumer warps also dispatch the first `help_rows` routed
  // rows (round-robin row tiles over every CTA) before their tasks; -1 (default): automatic (a
  // quarter of the routed rows without a shared expert, none with one), 0: off. Same bytes.
  // Ignored with the remote / own CTA split of the dispatch (DispatchRole::remote_ctas).
  int64_t help_rows = -1;
  // The fixed-order top-k sum inside the fused kernel (fused_topk_sum.cuh): each token summed
  // by idle warps as soon as its rows exist (pushed rows counted per token), instead of a
  // separate epilogue kernel after a barrier of all ranks. Same bits. Off by default until it
  // ran at EP >= 2 (measured at EP 1 only: qwen3 -1 to -4 %, docs/megakernel.md).
  bool fused_topk_sum = false;
  // Comm CTAs that take GEMM tasks once their share of the dispatch is done (the task list is
  // handed out through one counter, in list order, so any CTA may take the next task; same
  // bits). The other comm CTAs combine. -1 (default): automatic: every comm CTA when the
  // combine has nothing to move (EP 1 with the own rows in place), else none (not yet measured
  // at EP >= 2); 0: none. At most comm_ctas - 1 when the combine has rows to move. Not with
  // token_major (its gathering producer keeps the round-robin hand-out).
  int join_gemm = -1;
  // How the GEMM tasks are handed out: -1 (default) and 1 through one counter in list order
  // (the GEMM CTAs balance themselves; measured faster than round-robin at EP 1 on qwen3 and
  // dsv3, docs/megakernel.md); 0 round-robin over the GEMM CTAs (no comm CTA may join then).
  // Same tiles, same bits.
  int task_counter = -1;
  // The combine pushed from GEMM 2's epilogue (fused_push.cuh): each routed GEMM 2 tile's warps
  // copy its rows of other ranks' tokens (and, with own_rows_in_place off, the own rank's) from
  // the staging buffer into their slots, so the comm CTAs have no combine and (join_gemm
  // automatic) all but one take GEMM tasks after their dispatch share at EP >= 2. Same bits.
  // -1 (default): automatic (off until measured at EP >= 2); 0 off; 1 on. With fused_topk_sum
  // the comm CTA that stays counts the pushed rows per token (comm::count_pushed_rows).
  // With own_rows_in_place off every row is pushed and expert_out is not written: the slots
  // hold every (t, k) row of the saved context (as after the all-slots combine).
  int epilogue_push = -1;
  // Measurement only: with every row pushed, TMA-store the tiles into expert_out as well (the
  // A/B of the write the push replaces; bench_forward --push-all-store).
  bool push_keeps_expert_out = false;
  // With the macrobatch ring: comm CTAs that keep dispatching past the first ring window (the
  // last ones; the others join the GEMM work, or the first combines, after it;
  // DispatchRole::ring_ctas). -1 (default): automatic
  // (resolve_ring, fused_forward.cu: enough for GEMM 1's pace, dsv3 5, gptoss 4, qwen3 14);
  // 0: all of them; N: min(N, comm_ctas).
  int ring_comm_ctas = -1;
  // Raster groups of the routed tasks inside each minibatch: -1 (default): automatic = aligned
  // to experts (a group of up to 8 row tiles never spans two experts, so the CTAs streaming one
  // expert's weight block run it together: dsv3 EP 1 DRAM reads 32 -> 27 GB per pass, the pass
  // 2.6 % faster, gptoss 3.9 %, qwen3 0.7 %; docs/megakernel.md, seventeenth session); 0: global
  // groups of 8 row tiles (the standalone GEMMs' default); 1: aligned. Same tiles, same bits.
  int expert_raster = -1;
  // Measurement only: stage x into the window at EP 1 too (by default the dispatch reads the
  // caller's x there, DispatchRole::own_x; bench_forward --stage-x 1 times the copy it saves).
  bool stage_x = false;
};

// One forward pass on `stream` after mok::schedule() (no host synchronisation). Writes y; the
// saved context (g, u, shared g, u, combine slots) stays in the buffers as in staged_forward
// (with the epilogue push of every row, the slots hold the own rank's (t, k) rows too and
// expert_out is not written).
// Throws mok::Error for a grid that cannot be co-resident (grid > SMs, or no GEMM CTA left).
void fused_forward(comm::CommState& state, ForwardBuffers& buffers, const ForwardArgs& args,
                   const ExpertWeights& weights, const FusedForwardOptions& options, cudaStream_t stream);

// Developer trace (docs/megakernel.md, "Where the fused forward's time goes"): in a build with
// -DMOK_FORWARD_TRACE (cmake -DMOK_FORWARD_TRACE=ON) every fused_forward() records per-CTA
// phase stamps; forward_trace_dump writes the last pass of this host thread to `path` (format:
// forward_trace.cuh, reader: scripts/forward_trace.py). Other builds: enabled() is false and
// dump throws kInvalidArgument.
bool forward_trace_enabled();
void forward_trace_dump(const std::string& path);

}  // namespace mok::megakernel
