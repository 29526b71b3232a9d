// extern "C" mirror of the C++ API: exceptions become status codes + thread-local text.
#include "mok/c_api.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>
#include <string>

#include "mok/api.hpp"
#include "mok/version.hpp"

struct mok_workspace {
  std::unique_ptr<mok::Workspace> ws;
};

struct mok_context {
  std::unique_ptr<mok::Context> ctx;
};

struct mok_fp8_weights {
  std::unique_ptr<mok::Fp8WeightCache> cache;
};

namespace {

thread_local std::string g_last_error;

template <typename F>
mok_status_t guarded(F&& f) {
  try {
    g_last_error.clear();
    f();
    return MOK_OK;
  } catch (const mok::Error& e) {
    g_last_error = e.what();
    return static_cast<mok_status_t>(e.status());
  } catch (const std::exception& e) {
    g_last_error = std::string("internal error: ") + e.what();
    return MOK_INTERNAL;
  } catch (...) {
    g_last_error = "internal error: unknown exception";
    return MOK_INTERNAL;
  }
}

void require(const void* p, const char* name) {
  if (p == nullptr) mok::throw_invalid(name, "a non-null pointer", "NULL");
}

mok::LayerShape to_shape(const mok_layer_shape_t* s) {
  require(s, "shape");
  return mok::LayerShape{s->tokens, s->hidden, s->intermediate, s->shared_intermediate, s->experts, s->topk, s->ep};
}

mok::Config to_config(const mok_config_t* c) {
  require(c, "config");
  mok::Config cfg;
  cfg.comm_sms_forward = c->comm_sms_forward;
  cfg.comm_sms_backward = c->comm_sms_backward;
  cfg.minibatch = c->minibatch;
  cfg.macrobatch = c->macrobatch;
  cfg.capacity = c->capacity;
  cfg.grid_sms = c->grid_sms;
  cfg.wait_timeout_s = c->wait_timeout_s;
  cfg.forward_engine = static_cast<mok::ForwardEngine>(c->forward_engine);  // Config::validate checks the range
  cfg.backward_engine = static_cast<mok::BackwardEngine>(c->backward_engine);
  cfg.precision = static_cast<mok::Precision>(c->precision);
  if (c->fp8_weight_grads != 0 && c->fp8_weight_grads != 1) {
    mok::throw_invalid("Config.fp8_weight_grads", "0 (bf16 weight-gradient GEMMs) or 1 (FP8)",
                       std::to_string(c->fp8_weight_grads));
  }
  cfg.fp8_weight_grads = c->fp8_weight_grads == 1;
  return cfg;
}

mok::ExpertWeights to_weights(const mok_expert_weights_t* w) {
  require(w, "weights");
  auto b = [](const void* p) { return static_cast<const mok::bf16*>(p); };
  mok::ExpertWeights e{b(w->gate), b(w->up), b(w->down), b(w->shared_gate), b(w->shared_up), b(w->shared_down)};
  e.gate_expert_stride = w->gate_expert_stride;
  e.up_expert_stride = w->up_expert_stride;
  e.down_expert_stride = w->down_expert_stride;
  e.fp8 = w->fp8 != nullptr ? w->fp8->cache.get() : nullptr;
  return e;
}

mok::Workspace& deref(mok_workspace_t ws) {
  require(ws, "workspace");
  return *ws->ws;
}

cudaStream_t stream_of(mok_stream_t s) { return static_cast<cudaStream_t>(s); }

[[noreturn]] void throw_invalid_flag(const char* argument, int32_t value) {
  mok::throw_invalid(argument, "0 or 1", std::to_string(value));
}

mok::Context::Keep keep_of(int32_t keep) {
  if (keep < 0 || keep > 2) {
    mok::throw_invalid("keep", "0 (activations), 1 (routing only) or 2 (deferred weight gradients)", std::to_string(keep));
  }
  return static_cast<mok::Context::Keep>(keep);
}

mok::WeightGrads to_grads(const mok_weight_grads_t* grads) {
  require(grads, "grads");
  mok::WeightGrads g;
  g.mode = grads->accumulate_fp32 ? mok::GradMode::kAccumulateFp32 : mok::GradMode::kWriteBf16;
  g.gate = grads->gate;
  g.up = grads->up;
  g.down = grads->down;
  g.shared_gate = grads->shared_gate;
  g.shared_up = grads->shared_up;
  g.shared_down = grads->shared_down;
  g.gate_expert_stride = grads->gate_expert_stride;
  g.up_expert_stride = grads->up_expert_stride;
  g.down_expert_stride = grads->down_expert_stride;
  return g;
}

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw mok::Error(mok::Status::kCudaError, std::string(what) + ": " + cudaGetErrorString(e));
}

void nccl_ok(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) {
    std::string text = std::string(what) + ": " + ncclGetErrorString(r);
    const char* last = ncclGetLastError(nullptr);
    if (last != nullptr && *last != '\0') text += std::string(" (") + last + ")";
    throw mok::Error(mok::Status::kNcclError, text);
  }
}

}  // namespace

extern "C" {

const char* mok_last_error(void) { return g_last_error.c_str(); }

const char* mok_status_string(mok_status_t status) {
  return mok::status_name(static_cast<mok::Status>(status));
}

const char* mok_version(void) { return mok::kVersion; }

mok_status_t mok_config_default(mok_config_t* config) {
  return guarded([&] {
    require(config, "config");
    const mok::Config d;
    *config = mok_config_t{d.comm_sms_forward,
                           d.comm_sms_backward,
                           d.minibatch,
                           d.macrobatch,
                           d.capacity,
                           d.grid_sms,
                           d.wait_timeout_s,
                           static_cast<int32_t>(d.forward_engine),
                           static_cast<int32_t>(d.backward_engine),
                           static_cast<int32_t>(d.precision),
                           d.fp8_weight_grads ? 1 : 0};
  });
}

mok_status_t mok_validate(const mok_layer_shape_t* shape, const mok_config_t* config) {
  return guarded([&] { to_config(config).validate(to_shape(shape)); });
}

mok_status_t mok_workspace_create(const mok_layer_shape_t* shape, const mok_config_t* config,
                                  mok_nccl_comm_t comm, int32_t device, mok_workspace_t* out) {
  return guarded([&] {
    require(out, "out");
    *out = nullptr;
    auto ws = mok::Workspace::create(to_shape(shape), to_config(config), static_cast<ncclComm*>(comm), device);
    *out = new mok_workspace{std::move(ws)};
  });
}

mok_status_t mok_workspace_destroy(mok_workspace_t ws) {
  return guarded([&] { delete ws; });
}

mok_status_t mok_workspace_check(mok_workspace_t ws) {
  return guarded([&] { deref(ws).check(); });
}

mok_status_t mok_schedule(mok_workspace_t ws, const int32_t* topk_idx, int64_t tokens, mok_stream_t stream) {
  return guarded([&] { mok::schedule(deref(ws), topk_idx, tokens, stream_of(stream)); });
}

mok_status_t mok_workspace_bytes(mok_workspace_t ws, uint64_t* bytes) {
  return guarded([&] {
    require(bytes, "bytes");
    *bytes = deref(ws).device_bytes();
  });
}

mok_status_t mok_context_bytes(const mok_layer_shape_t* shape, const mok_config_t* config, int32_t keep,
                               uint64_t* bytes) {
  return guarded([&] {
    require(bytes, "bytes");
    *bytes = mok::Context::bytes(to_shape(shape), to_config(config), keep_of(keep));
  });
}

mok_status_t mok_context_create(mok_workspace_t ws, mok_stream_t stream, int32_t keep, mok_context_t* out) {
  return guarded([&] {
    require(out, "out");
    *out = nullptr;
    *out = new mok_context{mok::Context::create(deref(ws), stream_of(stream), keep_of(keep))};
  });
}

mok_status_t mok_context_create_in(mok_workspace_t ws, void* memory, uint64_t bytes, int32_t keep,
                                   mok_context_t* out) {
  return guarded([&] {
    require(out, "out");
    *out = nullptr;
    *out = new mok_context{mok::Context::create(deref(ws), memory, static_cast<size_t>(bytes), keep_of(keep))};
  });
}

mok_status_t mok_context_destroy(mok_context_t ctx) {
  return guarded([&] { delete ctx; });
}

mok_status_t mok_fp8_weights_bytes(const mok_layer_shape_t* shape, uint64_t* bytes) {
  return guarded([&] {
    require(bytes, "bytes");
    *bytes = mok::Fp8WeightCache::bytes(to_shape(shape));
  });
}

mok_status_t mok_fp8_weights_create_in(mok_workspace_t ws, void* memory, uint64_t bytes, mok_fp8_weights_t* out) {
  return guarded([&] {
    require(out, "out");
    *out = nullptr;
    *out = new mok_fp8_weights{mok::Fp8WeightCache::create(deref(ws), memory, static_cast<size_t>(bytes))};
  });
}

mok_status_t mok_fp8_weights_update(mok_fp8_weights_t fp8, const mok_expert_weights_t* weights, mok_stream_t stream) {
  return guarded([&] {
    require(fp8, "fp8");
    fp8->cache->update(to_weights(weights), stream_of(stream));
  });
}

mok_status_t mok_fp8_weights_destroy(mok_fp8_weights_t fp8) {
  return guarded([&] { delete fp8; });
}

mok_status_t mok_forward(mok_workspace_t ws, mok_context_t ctx, const void* x, const float* topk_w, void* y,
                         const mok_expert_weights_t* weights, int32_t save_activations, mok_stream_t stream) {
  return guarded([&] {
    if (save_activations != 0 && save_activations != 1) throw_invalid_flag("save_activations", save_activations);
    mok::ForwardArgs args{static_cast<const mok::bf16*>(x), topk_w, static_cast<mok::bf16*>(y),
                          ctx != nullptr ? ctx->ctx.get() : nullptr, save_activations == 1};
    mok::forward(deref(ws), args, to_weights(weights), stream_of(stream));
  });
}

mok_status_t mok_backward(mok_workspace_t ws, mok_context_t ctx, const void* x, const float* topk_w, const void* dy,
                          void* dx, float* dtopk_w, const mok_expert_weights_t* weights,
                          const mok_weight_grads_t* grads, int32_t defer_weight_grads, mok_stream_t stream) {
  return guarded([&] {
    if (defer_weight_grads != 0 && defer_weight_grads != 1) throw_invalid_flag("defer_weight_grads", defer_weight_grads);
    mok::BackwardArgs args{static_cast<const mok::bf16*>(x), topk_w, static_cast<const mok::bf16*>(dy),
                           static_cast<mok::bf16*>(dx), dtopk_w, ctx != nullptr ? ctx->ctx.get() : nullptr,
                           defer_weight_grads == 1};
    mok::backward(deref(ws), args, to_weights(weights), to_grads(grads), stream_of(stream));
  });
}

mok_status_t mok_backward_weight_grads(mok_workspace_t ws, mok_context_t ctx, const void* x, const void* dy,
                                       const mok_weight_grads_t* grads, mok_stream_t stream) {
  return guarded([&] {
    mok::BackwardArgs args;
    args.x = static_cast<const mok::bf16*>(x);
    args.dy = static_cast<const mok::bf16*>(dy);
    args.context = ctx != nullptr ? ctx->ctx.get() : nullptr;
    mok::backward_weight_grads(deref(ws), args, to_grads(grads), stream_of(stream));
  });
}

mok_status_t mok_recompute_forward_context(mok_workspace_t ws, mok_context_t ctx, const void* x, const float* topk_w,
                                           const mok_expert_weights_t* weights, mok_stream_t stream) {
  return guarded([&] {
    mok::ForwardArgs args{static_cast<const mok::bf16*>(x), topk_w, nullptr, ctx != nullptr ? ctx->ctx.get() : nullptr};
    mok::recompute_forward_context(deref(ws), args, to_weights(weights), stream_of(stream));
  });
}

// ---- For language bindings ----------------------------------------------------------------------

mok_status_t mok_engine_info(int32_t* gpu_schedule, int32_t* gpu_forward, int32_t* gpu_backward,
                             const char** description) {
  return guarded([&] {
    const mok::EngineInfo info = mok::engine_info();
    if (gpu_schedule != nullptr) *gpu_schedule = info.gpu_schedule ? 1 : 0;
    if (gpu_forward != nullptr) *gpu_forward = info.gpu_forward ? 1 : 0;
    if (gpu_backward != nullptr) *gpu_backward = info.gpu_backward ? 1 : 0;
    if (description != nullptr) *description = info.description;
  });
}

mok_status_t mok_nccl_unique_id(void* out) {
  static_assert(sizeof(ncclUniqueId) == MOK_NCCL_UNIQUE_ID_BYTES, "ncclUniqueId is 128 bytes");
  return guarded([&] {
    require(out, "out");
    ncclUniqueId id;
    nccl_ok(ncclGetUniqueId(&id), "ncclGetUniqueId");
    std::memcpy(out, id.internal, sizeof(id.internal));
  });
}

mok_status_t mok_nccl_comm_init(const void* id, int32_t nranks, int32_t rank, int32_t device, mok_nccl_comm_t* out) {
  return guarded([&] {
    require(id, "id");
    require(out, "out");
    *out = nullptr;
    if (nranks < 1) mok::throw_invalid("nranks", "at least 1", std::to_string(nranks));
    if (rank < 0 || rank >= nranks) {
      mok::throw_invalid("rank", "0 <= rank < nranks (" + std::to_string(nranks) + ")", std::to_string(rank));
    }
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      cudaGetLastError();
      count = 0;
    }
    if (device < 0 || device >= count) {
      mok::throw_invalid("device", "a CUDA device in [0, " + std::to_string(count) + ")", std::to_string(device));
    }
    ncclUniqueId uid;
    std::memcpy(uid.internal, id, sizeof(uid.internal));
    int previous = -1;
    cuda_ok(cudaGetDevice(&previous), "cudaGetDevice");
    cuda_ok(cudaSetDevice(device), "cudaSetDevice");
    ncclComm_t comm = nullptr;
    const ncclResult_t r = ncclCommInitRank(&comm, nranks, uid, rank);
    cudaSetDevice(previous);
    nccl_ok(r, "ncclCommInitRank");
    *out = comm;
  });
}

mok_status_t mok_nccl_comm_destroy(mok_nccl_comm_t comm) {
  return guarded([&] {
    if (comm != nullptr) nccl_ok(ncclCommDestroy(static_cast<ncclComm_t>(comm)), "ncclCommDestroy");
  });
}

mok_status_t mok_nccl_versions(int32_t* runtime, int32_t* headers) {
  return guarded([&] {
    int loaded = 0;
    nccl_ok(ncclGetVersion(&loaded), "ncclGetVersion");
    if (runtime != nullptr) *runtime = loaded;
    if (headers != nullptr) *headers = NCCL_VERSION_CODE;
  });
}

}  // extern "C"
