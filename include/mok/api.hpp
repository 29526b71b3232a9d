// The mok C++ API (docs/architecture.md): workspace, schedule, forward, backward, recompute.
//
//   mok::LayerShape shape = mok::dsv3_shape(/*ep=*/2);
//   mok::Config cfg;                                   // documented defaults
//   auto ws = mok::Workspace::create(shape, cfg, comm, device);
//   auto ctx = mok::Context::create(*ws, stream);      // one per layer (or none: the workspace's own)
//   mok::schedule(*ws, topk_idx, stream);              // routing table, on the GPU, no host sync
//   mok::forward(*ws, {x, topk_w, y, ctx.get()}, weights, stream);
//   ...                                                // other layers' schedule + forward
//   mok::backward(*ws, {x, topk_w, dy, dx, dtopk_w, ctx.get()}, weights, grads, stream);
//   ws->check();                                       // sync point: turns device-side errors into mok::Error
//
// All pointers are device pointers of the calling rank; every rank calls the same sequence.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "mok/config.hpp"
#include "mok/error.hpp"
#include "mok/shape.hpp"

struct ncclComm;  // from nccl.h (ncclComm_t is ncclComm*)

namespace mok {

using bf16 = __nv_bfloat16;

class Fp8WeightCache;

// Weights of one rank, bf16, row-major. Routed: this rank's E_local experts.
struct ExpertWeights {
  const bf16* gate = nullptr;         // [E_local, I, H]
  const bf16* up = nullptr;           // [E_local, I, H]
  const bf16* down = nullptr;         // [E_local, H, I]
  const bf16* shared_gate = nullptr;  // [I_shared, H]   (nullptr when I_shared = 0)
  const bf16* shared_up = nullptr;    // [I_shared, H]
  const bf16* shared_down = nullptr;  // [H, I_shared]
  // Elements from one routed expert's matrix to the next; 0: dense (I*H for gate and up, H*I for
  // down). Rows inside an expert stay dense. Hugging Face's fused gate_up_proj [E, 2I, H] without a
  // copy: gate = p, up = p + I*H, gate_expert_stride = up_expert_stride = 2*I*H.
  int64_t gate_expert_stride = 0, up_expert_stride = 0, down_expert_stride = 0;
  // Config::precision kFp8Block: the FP8 copies of these weights (Fp8WeightCache::update after each
  // change of the weights); nullptr: the pass quantizes the weights itself, on every call (the same
  // bits, more time), into the workspace's own copies, which its first such pass allocates (about the
  // bf16 weights' bytes; not while the stream is being captured). Ignored in bf16.
  const Fp8WeightCache* fp8 = nullptr;
};

// How weight gradients are delivered: written as bf16, or added into fp32 main-grad buffers.
enum class GradMode { kWriteBf16 = 0, kAccumulateFp32 = 1 };

// Weight gradients, same shapes as ExpertWeights; element type bf16 or float per `mode`.
struct WeightGrads {
  GradMode mode = GradMode::kAccumulateFp32;
  void* gate = nullptr;
  void* up = nullptr;
  void* down = nullptr;
  void* shared_gate = nullptr;
  void* shared_up = nullptr;
  void* shared_down = nullptr;
  int64_t gate_expert_stride = 0, up_expert_stride = 0, down_expert_stride = 0;  // as in ExpertWeights
};

class Context;

struct ForwardArgs {
  const bf16* x = nullptr;       // [T, H]; may be Workspace::x_staging() (zero-copy dispatch)
  const float* topk_w = nullptr; // [T, K] router weights
  bf16* y = nullptr;             // [T, H] output
  // Where this forward saves what its backward needs (the routing table, g, u); nullptr: the
  // workspace's own context (one layer, or a backward right after its forward).
  Context* context = nullptr;
  // false: keep only the routing table (activation checkpointing); the backward then recomputes
  // g, u from x (GEMM 1 of the forward again, the same bits), or recompute_forward_context
  // refills the context first. The macrobatch ring (Config::macrobatch) implies it.
  bool save_activations = true;
};

struct BackwardArgs {
  const bf16* x = nullptr;       // [T, H] the forward's input (dispatched again for the gate/up weight gradients)
  const float* topk_w = nullptr; // [T, K] the forward's router weights
  const bf16* dy = nullptr;      // [T, H]
  bf16* dx = nullptr;            // [T, H]
  float* dtopk_w = nullptr;      // [T, K]
  Context* context = nullptr;    // the matching forward's context (nullptr: the workspace's own)
  // true: dx and d topk_w now, the weight gradients later through backward_weight_grads (Megatron's
  // delayed wgrad / backward_dw), the same bits. Needs a context created with
  // Context::Keep::kDeferredWgrad (it keeps dg, du and hs until then).
  bool defer_weight_grads = false;
};

// What the compiled engine implements; entry points that are not there throw kNotImplemented.
struct EngineInfo {
  bool gpu_schedule = false;
  bool gpu_forward = false;
  bool gpu_backward = false;
  const char* description = "";
};
EngineInfo engine_info();

// Per-rank state: symmetric NCCL buffers, schedule, saved forward context, error flags.
class Workspace {
 public:
  // `comm` is an NCCL communicator of exactly shape.ep ranks (this rank = its NCCL rank);
  // `device` the CUDA device it was created on. Collective: every rank calls it.
  static std::unique_ptr<Workspace> create(const LayerShape& shape, const Config& config,
                                           ncclComm* comm, int device);
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  const LayerShape& shape() const;
  const Config& config() const;
  int rank() const;
  int device() const;
  // [T, H] buffer in symmetric memory: write x here and pass it as ForwardArgs::x to skip
  // the staging copy.
  bf16* x_staging();
  // Device memory this workspace holds: the symmetric window, the schedule, the forward's and
  // the backward's scratch and its own context (Context::bytes), and with FP8, once a pass ran
  // without an Fp8WeightCache, its own weight copies (Fp8WeightCache::bytes). Each further
  // Context adds Context::bytes(shape, config).
  size_t device_bytes() const;
  // Synchronises the workspace's last stream and throws the first device-side error
  // (capacity overflow, bad expert id, wait timeout) as mok::Error.
  void check();

  struct Impl;
  Impl& impl() { return *impl_; }
  // Internal (src/host): wraps a fully built Impl (the simulated-ranks factory uses it).
  static std::unique_ptr<Workspace> adopt(std::unique_ptr<Impl> impl);

 private:
  explicit Workspace(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// What one layer's forward keeps for its backward (docs/architecture.md): the routing table and the saved
// g, u (and shared g, u) in one block of device memory. Many layers share one Workspace and
// keep one Context each; a backward consumes the context of its forward, in any order. The
// context belongs to the workspace that created it (a backward on another workspace, or on a
// context that no forward filled or a backward already consumed, throws kInvalidArgument).
class Context {
 public:
  // What a context has room for: the routing table and the activations (g, u, shared g, u), or
  // the routing table alone (the backward recomputes the activations from x).
  // kDeferredWgrad: the activations and room for what a backward that defers its weight
  // gradients leaves for them (hs beside dg, du, which take the place of g, u).
  enum class Keep { kActivations = 0, kRoutingOnly = 1, kDeferredWgrad = 2 };
  // Device bytes of one context (docs/architecture.md "Buffers and sizes"): the routing table
  // (~16 B per buffer row + 4 B per global (t, k)) plus, with kActivations, g, u
  // [buffer_rows, I] and shared g, u [T, I_shared] in bf16; kDeferredWgrad adds hs [buffer_rows, I]
  // and shared hs [T, I_shared].
  static size_t bytes(const LayerShape& shape, const Config& config, Keep keep = Keep::kActivations);
  // mok allocates the block on `stream` (stream-ordered, cudaMallocAsync) and frees it when the
  // context is destroyed (cudaFree: it waits for the device's work, so destroy contexts after
  // their last use, not inside a step).
  static std::unique_ptr<Context> create(Workspace& ws, cudaStream_t stream, Keep keep = Keep::kActivations);
  // The caller's memory (a torch-allocated tensor, say): `bytes` >= Context::bytes(shape, config,
  // keep), 256-byte aligned, on the workspace's device; it must outlive the context's last use.
  static std::unique_ptr<Context> create(Workspace& ws, void* memory, size_t bytes, Keep keep = Keep::kActivations);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  size_t bytes() const;
  // A forward filled it and no backward consumed it yet.
  bool saved() const;
  // It holds the activations (else the backward recomputes them).
  bool has_activations() const;

  struct Impl;
  Impl& impl() { return *impl_; }
  explicit Context(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};
inline size_t context_bytes(const LayerShape& shape, const Config& config, Context::Keep keep = Context::Keep::kActivations) {
  return Context::bytes(shape, config, keep);
}

// The FP8 copies of one layer's weights (Config::precision kFp8Block, docs/fp8.md "Weights"): every
// matrix of ExpertWeights in 128x128-block e4m3 with its fp32 scales, and the transposed copies the
// backward's dgrad GEMMs read (the same codes and scales, transposed). FP8 training quantizes the
// weights once per weight update, not once per call: update() after each optimizer step (the Python
// layer does it when a parameter's version counter moves), and pass the cache in ExpertWeights::fp8.
// It belongs to the workspace that created it (its shape, its device); a non-finite weight is
// reported by that workspace's check(), naming the matrix, and poisons the outputs of the passes
// that read the cache until the next update() with finite weights.
class Fp8WeightCache {
 public:
  // Device bytes: for each of gate, up, down (and the shared three) the codes twice (as is and
  // transposed, 2 bytes per weight element) and the scales twice (4 bytes per 128x128 block each):
  // about as many bytes as the bf16 weights.
  static size_t bytes(const LayerShape& shape);
  // mok allocates the memory on `stream` (stream-ordered) and frees it on destruction (as Context).
  static std::unique_ptr<Fp8WeightCache> create(Workspace& ws, cudaStream_t stream);
  // The caller's memory: >= bytes(shape), 256-byte aligned, on the workspace's device.
  static std::unique_ptr<Fp8WeightCache> create(Workspace& ws, void* memory, size_t bytes);
  ~Fp8WeightCache();
  Fp8WeightCache(const Fp8WeightCache&) = delete;
  Fp8WeightCache& operator=(const Fp8WeightCache&) = delete;

  // Quantizes `weights` (both orientations) on `stream`: stream-ordered, no host synchronisation.
  // weights.fp8 is ignored. Passes enqueued after it read the new copies.
  void update(const ExpertWeights& weights, cudaStream_t stream);
  // update() has run at least once.
  bool ready() const;
  size_t bytes() const;

  struct Impl;
  Impl& impl() { return *impl_; }
  const Impl& impl() const { return *impl_; }
  explicit Fp8WeightCache(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

// Routing table for the next forward/backward: exchanged and derived on the GPU (docs/comm.md).
void schedule(Workspace& ws, const int32_t* topk_idx, cudaStream_t stream);
// The same for a call of `tokens` tokens (1 <= tokens <= shape.tokens, the same on every rank: the
// last batch of an epoch, packed sequences): topk_idx is [tokens, K], and the forward, its backward
// and its context work on [tokens, ...] buffers.
void schedule(Workspace& ws, const int32_t* topk_idx, int64_t tokens, cudaStream_t stream);
// y = shared(x) + sum_k topk_w[t,k] * expert_{topk_idx[t,k]}(x[t]); saves the forward context.
void forward(Workspace& ws, const ForwardArgs& args, const ExpertWeights& weights,
             cudaStream_t stream);
// dx, d topk_w and weight gradients from dy, using the saved context of the matching forward
// (which it consumes), after that forward's routing table (no new exchange, no host sync).
// Weight gradients are added into fp32 buffers or written bf16 (WeightGrads::mode); the shared
// expert's are this rank's partial sums (the caller all-reduces them like data-parallel ones).
void backward(Workspace& ws, const BackwardArgs& args, const ExpertWeights& weights,
              const WeightGrads& grads, cudaStream_t stream);
// The weight gradients of a backward called with defer_weight_grads (args.x, args.dy and
// args.context as there; dx, dtopk_w and topk_w are not used): x and dy are pulled again over the
// saved routing table and the weight gradients computed from the dg, du, hs the backward left in
// the context, which this call consumes. Collective, like backward.
void backward_weight_grads(Workspace& ws, const BackwardArgs& args, const WeightGrads& grads, cudaStream_t stream);
// Refills the activations of a context whose forward kept only the routing table
// (ForwardArgs::save_activations false, or the macrobatch ring) from x (args.x, args.context),
// without producing y and without a new routing exchange: the x rows over the saved table, then
// GEMM 1 (the same bits as a forward that kept them). The context needs room for them (Keep::kActivations).
void recompute_forward_context(Workspace& ws, const ForwardArgs& args,
                               const ExpertWeights& weights, cudaStream_t stream);

}  // namespace mok
