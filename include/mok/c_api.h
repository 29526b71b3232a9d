/* The mok C API: opaque handles and status codes for language bindings.
 * Mirrors include/mok/api.hpp. Every call returns a mok_status_t; on failure
 * mok_last_error() gives this thread's message (valid until the next mok call). */
#ifndef MOK_C_API_H_
#define MOK_C_API_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  MOK_OK = 0,
  MOK_INVALID_ARGUMENT = 1,
  MOK_CAPACITY_OVERFLOW = 2,
  MOK_NOT_IMPLEMENTED = 3,
  MOK_CUDA_ERROR = 4,
  MOK_NCCL_ERROR = 5,
  MOK_TIMEOUT = 6,
  MOK_INTERNAL = 7
} mok_status_t;

typedef struct {
  int64_t tokens, hidden, intermediate, shared_intermediate, experts;
  int32_t topk, ep;
} mok_layer_shape_t;

typedef struct {
  int32_t comm_sms_forward, comm_sms_backward;
  int64_t minibatch, macrobatch;
  double capacity;
  int32_t grid_sms;
  double wait_timeout_s;
  int32_t forward_engine;  /* mok::ForwardEngine: 0 fused (default), 1 staged */
  int32_t backward_engine; /* mok::BackwardEngine: 0 auto (default), 1 fused, 2 staged */
  int32_t precision;        /* mok::Precision: 0 bf16 (default), 1 fp8_block */
  int32_t fp8_weight_grads; /* with precision 1: 1 (default) weight-gradient GEMMs in FP8, 0 in bf16 */
} mok_config_t;

/* One layer's FP8 weight copies (mok::Fp8WeightCache), for precision 1. */
typedef struct mok_fp8_weights* mok_fp8_weights_t;

typedef struct {
  const void *gate, *up, *down, *shared_gate, *shared_up, *shared_down; /* bf16 device pointers */
  /* Elements from one routed expert's matrix to the next; 0: dense ([E_local, I, H] / [E_local, H, I]).
   * Rows inside an expert are dense. Hugging Face's fused gate_up_proj [E, 2I, H]: gate = p,
   * up = p + I*H, both with stride 2*I*H. */
  int64_t gate_expert_stride, up_expert_stride, down_expert_stride;
  /* Precision 1: the FP8 copies of these weights, current (mok_fp8_weights_update after each change of
   * the weights); NULL: the pass quantizes the weights itself, on every call. Ignored in bf16. */
  mok_fp8_weights_t fp8;
} mok_expert_weights_t;

typedef struct {
  int32_t accumulate_fp32; /* 1: add into fp32 buffers; 0: write bf16 */
  void *gate, *up, *down, *shared_gate, *shared_up, *shared_down;
  int64_t gate_expert_stride, up_expert_stride, down_expert_stride; /* as in mok_expert_weights_t */
} mok_weight_grads_t;

typedef struct mok_workspace* mok_workspace_t;
typedef struct mok_context* mok_context_t; /* one layer's saved forward context (mok::Context) */
typedef void* mok_stream_t;  /* cudaStream_t */
typedef void* mok_nccl_comm_t; /* ncclComm_t */

const char* mok_last_error(void);
const char* mok_status_string(mok_status_t status);
const char* mok_version(void);

/* Fills *config with the documented defaults. */
mok_status_t mok_config_default(mok_config_t* config);
mok_status_t mok_validate(const mok_layer_shape_t* shape, const mok_config_t* config);

mok_status_t mok_workspace_create(const mok_layer_shape_t* shape, const mok_config_t* config,
                                  mok_nccl_comm_t comm, int32_t device, mok_workspace_t* out);
mok_status_t mok_workspace_destroy(mok_workspace_t ws);
mok_status_t mok_workspace_check(mok_workspace_t ws);

/* Device memory the workspace holds (mok::Workspace::device_bytes). */
mok_status_t mok_workspace_bytes(mok_workspace_t ws, uint64_t* bytes);

/* keep (mok::Context::Keep): 0 = room for the activations, 1 = the routing table only (the backward
 * recomputes the activations), 2 = the activations and room for a deferred weight gradient. */
/* Bytes of one context of this shape and config (mok::Context::bytes). */
mok_status_t mok_context_bytes(const mok_layer_shape_t* shape, const mok_config_t* config, int32_t keep,
                               uint64_t* bytes);
/* mok allocates the context's memory on `stream` (stream-ordered) and frees it in destroy. */
mok_status_t mok_context_create(mok_workspace_t ws, mok_stream_t stream, int32_t keep, mok_context_t* out);
/* The caller's device memory: >= mok_context_bytes, 256-byte aligned; it must outlive the context. */
mok_status_t mok_context_create_in(mok_workspace_t ws, void* memory, uint64_t bytes, int32_t keep,
                                   mok_context_t* out);
mok_status_t mok_context_destroy(mok_context_t ctx);

/* FP8 weight copies (mok::Fp8WeightCache; docs/fp8.md): quantize the weights once per weight update,
 * not once per pass. Bytes of the copies of one layer of this shape (about those of its bf16 weights). */
mok_status_t mok_fp8_weights_bytes(const mok_layer_shape_t* shape, uint64_t* bytes);
/* The caller's device memory: >= mok_fp8_weights_bytes, 256-byte aligned, on the workspace's device; it must
 * outlive the handle. The copies belong to ws (its shape and device) and are empty until the first update. */
mok_status_t mok_fp8_weights_create_in(mok_workspace_t ws, void* memory, uint64_t bytes, mok_fp8_weights_t* out);
/* Quantizes `weights` (weights->fp8 is ignored) into the copies on `stream`: stream-ordered, no host
 * synchronisation (it may be captured into a CUDA graph); passes enqueued after it read the new copies. A
 * non-finite weight is reported by the workspace's mok_workspace_check. */
mok_status_t mok_fp8_weights_update(mok_fp8_weights_t fp8, const mok_expert_weights_t* weights, mok_stream_t stream);
mok_status_t mok_fp8_weights_destroy(mok_fp8_weights_t fp8);

/* Routing table of the next forward: topk_idx [tokens, K] int32 on the device. tokens: this call's
 * T, 1 <= tokens <= the workspace's shape.tokens, the same on every rank (the forward, its
 * backward and its context then work on [tokens, ...] buffers). */
mok_status_t mok_schedule(mok_workspace_t ws, const int32_t* topk_idx, int64_t tokens, mok_stream_t stream);
/* ctx: where the forward saves what its backward needs; NULL: the workspace's own context.
 * save_activations 0: keep only the routing table (activation checkpointing). */
mok_status_t mok_forward(mok_workspace_t ws, mok_context_t ctx, const void* x, const float* topk_w, void* y,
                         const mok_expert_weights_t* weights, int32_t save_activations, mok_stream_t stream);
/* ctx: the matching forward's context (consumed); NULL: the workspace's own.
 * defer_weight_grads 1: the weight gradients later, through mok_backward_weight_grads (ctx keep 2). */
mok_status_t mok_backward(mok_workspace_t ws, mok_context_t ctx, const void* x, const float* topk_w,
                          const void* dy, void* dx, float* dtopk_w, const mok_expert_weights_t* weights,
                          const mok_weight_grads_t* grads, int32_t defer_weight_grads, mok_stream_t stream);
/* The weight gradients a deferring mok_backward left out (x and dy as given to it). */
mok_status_t mok_backward_weight_grads(mok_workspace_t ws, mok_context_t ctx, const void* x, const void* dy,
                                       const mok_weight_grads_t* grads, mok_stream_t stream);
/* Refills the activations of ctx (a forward with save_activations 0) from x. */
mok_status_t mok_recompute_forward_context(mok_workspace_t ws, mok_context_t ctx, const void* x, const float* topk_w,
                                           const mok_expert_weights_t* weights, mok_stream_t stream);


/* ---- For language bindings (the Python package, python/mok) --------------------------------- */

/* What this build implements (mok::engine_info). Any output may be NULL; *description is static text. */
mok_status_t mok_engine_info(int32_t* gpu_schedule, int32_t* gpu_forward, int32_t* gpu_backward,
                             const char** description);

/* NCCL bootstrap for callers without NCCL headers (docs/python.md "Communicators"): one rank makes
 * the id, the launcher shares its bytes (torch.distributed), every rank of the group inits. */
#define MOK_NCCL_UNIQUE_ID_BYTES 128
/* Writes MOK_NCCL_UNIQUE_ID_BYTES bytes (ncclGetUniqueId) to out. */
mok_status_t mok_nccl_unique_id(void* out);
/* ncclCommInitRank on `device` (made current for the call, then restored). Collective: every rank of
 * the group calls it with the same id and nranks. */
mok_status_t mok_nccl_comm_init(const void* id, int32_t nranks, int32_t rank, int32_t device, mok_nccl_comm_t* out);
/* ncclCommDestroy. Destroy every workspace made on the communicator first. */
mok_status_t mok_nccl_comm_destroy(mok_nccl_comm_t comm);
/* runtime: ncclGetVersion() of the libnccl this process loaded; headers: the NCCL_VERSION_CODE mok
 * was compiled with (the device-API path needs them equal). Either may be NULL. */
mok_status_t mok_nccl_versions(int32_t* runtime, int32_t* headers);

#ifdef __cplusplus
}
#endif
#endif /* MOK_C_API_H_ */
