// mok::Workspace::Impl: the per-rank state behind the public Workspace (include/mok/api.hpp).
// The communication layer's CommState holds the symmetric NCCL window, the schedule, the
// dispatch row buffer and the device error record; later layers (megakernel) add their
// buffers here.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <memory>

#include "comm/comm_state.hpp"
#include "comm/simulated_group.hpp"
#include "megakernel/fused_forward.hpp"
#include "megakernel/staged_forward.hpp"
#include "mok/api.hpp"

namespace mok {

struct Workspace::Impl {
  LayerShape shape;
  Config config;
  int device = 0;
  ncclComm_t comm = nullptr;
  std::unique_ptr<comm::CommState> state;
  std::unique_ptr<megakernel::ForwardBuffers> forward;  // GEMM buffers and saved context
  // Which forward mok::forward runs: the fused kernel (default) or the staged launches
  // (MOK_FORWARD_PATH=staged at workspace creation; tests and benches may set it directly).
  megakernel::ForwardPath forward_path = megakernel::ForwardPath::kFused;
  // Copy modes of both paths (same bytes either way; tests and benches switch them off to
  // compare): dedup fan-out dispatch, combine with the own rank's rows read in place.
  bool dispatch_dedup = true;
  bool combine_in_place = true;
  // Fused path: token-major dispatch + GEMM 1 gathering its rows (same bits as the fan-out;
  // off by default, FusedForwardOptions::token_major). Set before the first forward pass.
  bool dispatch_token_major = false;
  // Fused path, dedup: rows of the dispatch's first tiles the GEMM CTAs help with
  // (FusedForwardOptions::help_rows; -1 automatic, the default; 0 off). Same bits.
  int64_t dispatch_help_rows = -1;
  // Fused path: the top-k sum inside the fused kernel (FusedForwardOptions::fused_topk_sum; off
  // by default: the epilogue kernel after it). Same bits.
  bool fused_topk_sum = false;
  // Fused path: comm CTAs that take GEMM tasks after their dispatch share
  // (FusedForwardOptions::join_gemm; -1 automatic, the default; 0 none). Same bits.
  int join_gemm = -1;
  // Fused path: the GEMM tasks' hand-out (FusedForwardOptions::task_counter; -1 automatic).
  int task_counter = -1;
  // Fused path: the combine pushed from GEMM 2's epilogue (FusedForwardOptions::epilogue_push;
  // -1 automatic, the default; 0 off; 1 on). Same bits.
  int epilogue_push = -1;
  // Fused path with the macrobatch ring: comm CTAs that dispatch past the first ring window
  // (FusedForwardOptions::ring_comm_ctas; -1 automatic, 0 all). Same bits.
  int ring_comm_ctas = -1;
  // Fused path: routed raster groups aligned to experts (FusedForwardOptions::expert_raster; -1
  // automatic = aligned, 0 global groups, 1 aligned). Same bits.
  int expert_raster = -1;
  cudaStream_t last_stream = nullptr;  // the stream check() synchronises
  // Simulated ranks (host/simulated_ranks.hpp): the group this rank belongs to (it outlives the
  // workspace) and the rank in it; null with an NCCL communicator.
  comm::SimulatedGroup* simulated = nullptr;
  int simulated_rank = -1;
};

// Makes `device` current for the scope (API calls may come from any thread/device).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace mok
