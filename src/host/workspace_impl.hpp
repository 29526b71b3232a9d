// mok::Workspace::Impl: the per-rank state behind the public Workspace (include/mok/api.hpp).
// The communication layer's CommState holds the symmetric NCCL window, the schedule, the
// dispatch row buffer and the device error record; later layers (megakernel) add their
// buffers here.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <memory>
#include <string>

#include "comm/comm_state.hpp"
#include "comm/simulated_group.hpp"
#include "megakernel/context.hpp"
#include "megakernel/fp8_steps.hpp"
#include "megakernel/fused_backward.hpp"
#include "megakernel/fused_forward.hpp"
#include "megakernel/staged_backward.hpp"
#include "megakernel/staged_forward.hpp"
#include "mok/api.hpp"

namespace mok {

// One layer's forward context (include/mok/api.hpp): its memory block and what is in it.
struct Context::Impl {
  enum class State { kEmpty, kSaved, kAwaitingWgrad, kConsumed };
  uint64_t workspace_serial = 0;  // the Workspace::Impl::serial of its workspace
  int device = 0;
  megakernel::ContextLayout layout;
  char* base = nullptr;
  size_t bytes = 0;
  bool owned = false;             // mok allocated `base` (stream-ordered) and frees it
  State state = State::kEmpty;
  // The block holds the activations of its forward (false: routing table only; the backward
  // recomputes them: a routing-only block, ForwardArgs::save_activations false, the macrobatch ring)
  bool complete = false;
  megakernel::SavedContext saved;
};

// One layer's FP8 weight copies (include/mok/api.hpp): their memory block and its views.
struct Fp8WeightCache::Impl {
  uint64_t workspace_serial = 0;  // the Workspace::Impl::serial of its workspace
  int device = 0;
  LayerShape shape;
  char* base = nullptr;
  size_t bytes = 0;
  bool owned = false;  // mok allocated `base` (stream-ordered) and frees it
  bool ready = false;  // update() ran
  megakernel::Fp8WeightViews views;
};

struct Workspace::Impl {
  LayerShape shape;
  Config config;
  int device = 0;
  ncclComm_t comm = nullptr;
  std::unique_ptr<comm::CommState> state;
  std::unique_ptr<megakernel::ForwardBuffers> forward;  // the forward's GEMM buffers
  std::unique_ptr<megakernel::BackwardBuffers> backward;  // the backward's scratch
  // The context of forwards given none (ForwardArgs::context = nullptr), created with the workspace.
  std::unique_ptr<Context> own_context;
  // Config::precision kFp8Block: the weight copies of passes given no cache, quantized per call.
  std::unique_ptr<Fp8WeightCache> own_fp8;
  uint64_t serial = 0;  // unique per workspace of the process: the contexts it made carry it
  // The engines are config.forward_engine / config.backward_engine (tests and benches may change
  // them on a live workspace; a forward engine change keeps the workspace's routed buffers).
  // Testing knob: the fused backward's weight gradients as its kernel's second phase (default) or
  // as launches after it (FusedBackwardOptions::wgrad_in_kernel, same bits).
  bool fused_wgrad_in_kernel = true;
  // Testing knob: the FP8 forward dispatches x quantized (default) or in bf16, quantizing after it
  // (Fp8Pass::dispatch_fp8; the same bits).
  bool fp8_dispatch = true;
  // The fused path's undecided choices (FusedForwardOptions::join_gemm, epilogue_push,
  // fused_topk_sum; the comm CTAs, grid and timeout come from `config`). Defaults as there;
  // tests and benches set them to compare (same bits).
  megakernel::FusedForwardOptions fused;
  cudaStream_t last_stream = nullptr;  // the stream check() synchronises
  // Simulated ranks (host/simulated_ranks.hpp): the group this rank belongs to (it outlives the
  // workspace) and the rank in it; null with an NCCL communicator.
  comm::SimulatedGroup* simulated = nullptr;
  int simulated_rank = -1;
};

// The memory block of a Context or an Fp8WeightCache (include/mok/api.hpp), device_block.cpp.
// The caller's block: throws kInvalidArgument unless `memory` is a 256-byte aligned pointer to at
// least `needed` bytes of device memory of `device`; `size_call` names the function that sizes it
// ("Context::bytes(shape, config, keep)").
void check_caller_block(const void* memory, size_t bytes, size_t needed, int device, const std::string& size_call);
// mok's block: `bytes` allocated stream-ordered on `stream` (cudaMallocAsync) on `device`.
char* allocate_block(size_t bytes, int device, cudaStream_t stream);
// Frees mok's block with cudaFree on its device (not cudaFreeAsync on the stream of its last use: the
// caller may have destroyed that stream by now, bench_backward did and the free on it crashed in the
// driver; cudaFree of a stream-ordered allocation waits for the device's work first). Never throws;
// an error is printed naming `what`.
void free_block(char* base, int device, const char* what) noexcept;

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
