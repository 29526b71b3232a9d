// Entry points of include/mok/api.hpp that are not part of the workspace/schedule
// (src/host/workspace.cpp). The forward runs Config::forward_engine (the fused GPU kernel of
// src/megakernel by default, or the staged launches) and saves into the call's Context; the
// backward runs Config::effective_backward_engine over that context (fused_backward.hpp,
// staged_backward.hpp).
#include "comm/roles.hpp"
#include "host/workspace_impl.hpp"
#include "megakernel/fused_forward.hpp"
#include "megakernel/staged_forward.hpp"
#include "mok/api.hpp"

namespace mok {

EngineInfo engine_info() {
  EngineInfo info;
  info.gpu_schedule = true;
  info.gpu_forward = true;
  info.gpu_backward = true;
  info.description =
      "Hopper (sm_90a): GPU schedule, then one fused persistent forward kernel (dispatch, shared and routed "
      "expert GEMMs, combine); the GPU backward over each layer's saved context as one fused persistent kernel "
      "(pulls of x and dy, dh + SwiGLU backward with d topk_w, dx, dx push, the K-grouped weight gradients as its "
      "second phase) or as staged launches of the same roles (Config::forward_engine / backward_engine; the "
      "same bits)";
  return info;
}

namespace {

// Expert strides: 0 (dense) or at least one expert's matrix, a multiple of 8 elements (16-byte TMA
// strides).
void check_expert_stride(const char* argument, int64_t stride, int64_t dense) {
  if (stride != 0 && (stride < dense || stride % 8 != 0)) {
    throw_invalid(argument, "0 (dense) or a multiple of 8 elements >= " + std::to_string(dense), std::to_string(stride));
  }
}

void check_forward_args(const Workspace& ws, const ForwardArgs& args, const ExpertWeights& w) {
  const int64_t IH = ws.shape().intermediate * ws.shape().hidden;
  check_expert_stride("ExpertWeights.gate_expert_stride", w.gate_expert_stride, IH);
  check_expert_stride("ExpertWeights.up_expert_stride", w.up_expert_stride, IH);
  check_expert_stride("ExpertWeights.down_expert_stride", w.down_expert_stride, IH);
  if (args.x == nullptr) throw_invalid("ForwardArgs.x", "a device pointer to [T, H] bf16", "nullptr");
  if (args.topk_w == nullptr) throw_invalid("ForwardArgs.topk_w", "a device pointer to [T, K] fp32", "nullptr");
  if (w.gate == nullptr || w.up == nullptr || w.down == nullptr) {
    throw_invalid("ExpertWeights.gate/up/down", "device pointers to the routed expert weights", "nullptr");
  }
  if (ws.shape().has_shared() &&
      (w.shared_gate == nullptr || w.shared_up == nullptr || w.shared_down == nullptr)) {
    throw_invalid("ExpertWeights.shared_*", "device pointers (LayerShape.shared_intermediate > 0)", "nullptr");
  }
}

// The context a call names, or the workspace's own; it must belong to this workspace.
Context::Impl& context_of(Workspace::Impl& impl, Context* ctx, const char* argument) {
  Context::Impl& c = ctx != nullptr ? ctx->impl() : impl.own_context->impl();
  if (c.workspace_serial != impl.serial) {
    throw_invalid(argument, "a Context created for this workspace (Context::create(ws, ...))",
                  "a context of another workspace");
  }
  return c;
}

// Config::precision kFp8Block: the pass's weight copies, the caller's cache (ExpertWeights::fp8), or
// else the workspace's own, quantized now from the bf16 weights (the same bits, more time). The own
// copies are allocated by the first pass that needs them (about the bf16 weights' bytes: a caller
// with a cache, such as the PyTorch layer, never pays for them), which must not be captured.
megakernel::Fp8Pass fp8_pass(Workspace& ws, const ExpertWeights& w, cudaStream_t stream) {
  Workspace::Impl& impl = ws.impl();
  megakernel::Fp8Pass pass;
  pass.fp8_wgrad = impl.config.fp8_weight_grads;
  pass.dispatch_fp8 = impl.fp8_dispatch;
  if (w.fp8 != nullptr) {
    const Fp8WeightCache::Impl& cache = w.fp8->impl();
    if (cache.workspace_serial != impl.serial) {
      throw_invalid("ExpertWeights.fp8", "an Fp8WeightCache created for this workspace (Fp8WeightCache::create(ws, ...))",
                    "a cache of another workspace");
    }
    if (!cache.ready) throw_invalid("ExpertWeights.fp8", "a cache that update() has filled", "a cache never updated");
    pass.weights = &cache.views;
  } else {
    if (!impl.own_fp8) {
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      MOK_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
      if (capture != cudaStreamCaptureStatusNone) {
        throw_invalid("ExpertWeights.fp8",
                      "an Fp8WeightCache while the stream is being captured (the workspace's own FP8 weight copies are "
                      "allocated by its first FP8 pass without one: run a pass before capturing, or pass a cache)",
                      "nullptr");
      }
      impl.own_fp8 = Fp8WeightCache::create(ws, stream);
    }
    impl.own_fp8->update(w, stream);
    pass.weights = &impl.own_fp8->impl().views;
  }
  return pass;
}

bool is_fp8(const Workspace::Impl& impl) { return impl.config.precision == Precision::kFp8Block; }

}  // namespace

void forward(Workspace& ws, const ForwardArgs& args, const ExpertWeights& weights, cudaStream_t stream) {
  check_forward_args(ws, args, weights);
  if (args.y == nullptr) throw_invalid("ForwardArgs.y", "a device pointer to [T, H] bf16", "nullptr");
  Workspace::Impl& impl = ws.impl();
  Context::Impl& ctx = context_of(impl, args.context, "ForwardArgs.context");
  DeviceGuard guard(impl.device);
  // The activations go to the context when it keeps them; else (and with the ring, whose routed
  // g, u stay in its slots) to the backward's recompute scratch, where nothing reads them.
  const bool keep = ctx.layout.activations && args.save_activations && !impl.forward->ring();
  // FP8: the context keeps g, u in FP8, written by GEMM 1's epilogue (forward_gemms_fp8); without
  // keeping them GEMM 1's bf16 g, u go to the scratch.
  megakernel::SavedContext target =
      keep && !is_fp8(impl) ? ctx.saved : impl.backward->scratch_activations(ctx.saved);
  if (!keep) target.g8 = target.u8 = target.shared_g8 = target.shared_u8 = megakernel::Fp8Saved{};
  if (impl.config.forward_engine == ForwardEngine::kFused && !is_fp8(impl)) {
    megakernel::FusedForwardOptions options = impl.fused;
    options.comm_ctas = impl.config.effective_comm_sms_forward(impl.shape);
    options.grid = impl.config.grid_sms;
    options.timeout_s = impl.config.wait_timeout_s;
    megakernel::fused_forward(*impl.state, *impl.forward, args, weights, options, target, stream);
  } else {
    megakernel::StagedForwardOptions options;
    options.dispatch_ctas = impl.config.effective_comm_sms_staged_forward(impl.shape, comm::device_sms());
    options.combine_ctas = options.dispatch_ctas;
    options.gemm_grid = impl.config.grid_sms;
    options.timeout_s = impl.config.wait_timeout_s;
    megakernel::Fp8Pass pass;
    if (is_fp8(impl)) {  // FP8 runs the staged launches with the FP8 GEMM kinds (config.hpp)
      pass = fp8_pass(ws, weights, stream);
      options.fp8 = &pass;
    }
    megakernel::staged_forward(*impl.state, *impl.forward, args, weights, options, target, stream);
  }
  megakernel::save_schedule(*impl.state, *impl.forward, ctx.layout, ctx.base, stream);
  ctx.saved.schedule.tokens = impl.state->view().tokens;  // the call's T: its backward's buffers
  ctx.state = Context::Impl::State::kSaved;
  ctx.complete = keep;
  impl.last_stream = stream;
}

namespace {

megakernel::StagedBackwardOptions backward_options(const Workspace::Impl& impl) {
  megakernel::StagedBackwardOptions options;
  options.comm_ctas = impl.config.effective_comm_sms_backward(impl.shape, comm::device_sms());
  options.gemm_grid = impl.config.grid_sms;
  options.timeout_s = impl.config.wait_timeout_s;
  return options;
}

// The fused backward's kernel and its launches before it (the x pull: the staged backward's count).
megakernel::FusedBackwardOptions fused_backward_options(const Workspace::Impl& impl) {
  megakernel::FusedBackwardOptions options;
  options.comm_ctas = impl.config.effective_comm_sms_fused_backward(impl.shape, comm::device_sms());
  options.grid = impl.config.grid_sms;
  options.timeout_s = impl.config.wait_timeout_s;
  options.prologue_ctas = backward_options(impl).comm_ctas;
  options.wgrad_in_kernel = impl.fused_wgrad_in_kernel;
  return options;
}

// The saved context as the backward reads it: without activations (g == nullptr) it recomputes them.
// FP8 layouts keep g, u in e4m3 (SavedContext::g8, ...): their bf16 g, u are never activations.
megakernel::SavedContext as_saved(const Context::Impl& ctx) {
  megakernel::SavedContext c = ctx.saved;
  if (!ctx.complete || ctx.layout.fp8) c.g = c.u = c.shared_g = c.shared_u = nullptr;
  if (!ctx.complete) c.g8 = c.u8 = c.shared_g8 = c.shared_u8 = megakernel::Fp8Saved{};
  return c;
}

void require_saved(const Context::Impl& ctx, const char* argument) {
  if (ctx.state != Context::Impl::State::kSaved) {
    throw_invalid(argument, "the context of a forward that no backward consumed yet",
                  ctx.state == Context::Impl::State::kEmpty            ? "a context no forward filled"
                  : ctx.state == Context::Impl::State::kAwaitingWgrad ? "a context whose backward awaits backward_weight_grads"
                                                                       : "a context a backward already consumed");
  }
}

// Where a deferring backward leaves dg, du (in place of g, u) and hs in the context.
megakernel::GradInputs deferred_inputs(const Context::Impl& ctx) {
  megakernel::GradInputs g;
  g.dg = ctx.saved.g;
  g.du = ctx.saved.u;
  g.hs = ctx.saved.hs;
  g.shared_dg = ctx.saved.shared_g;
  g.shared_du = ctx.saved.shared_u;
  g.shared_hs = ctx.saved.shared_hs;
  return g;
}

}  // namespace

void backward(Workspace& ws, const BackwardArgs& args, const ExpertWeights& weights, const WeightGrads& grads,
              cudaStream_t stream) {
  check_forward_args(ws, ForwardArgs{args.x, args.topk_w, nullptr}, weights);
  if (args.dy == nullptr) throw_invalid("BackwardArgs.dy", "a device pointer to [T, H] bf16", "nullptr");
  if (args.dx == nullptr) throw_invalid("BackwardArgs.dx", "a device pointer to [T, H] bf16", "nullptr");
  if (args.dtopk_w == nullptr) throw_invalid("BackwardArgs.dtopk_w", "a device pointer to [T, K] fp32", "nullptr");
  Workspace::Impl& impl = ws.impl();
  Context::Impl& ctx = context_of(impl, args.context, "BackwardArgs.context");
  require_saved(ctx, "BackwardArgs.context");
  if (args.defer_weight_grads && !ctx.layout.deferred) {
    throw_invalid("BackwardArgs.context", "a context created with Context::Keep::kDeferredWgrad (defer_weight_grads)",
                  "a context without room for the deferred weight gradients' inputs");
  }
  DeviceGuard guard(impl.device);
  const megakernel::GradInputs defer = deferred_inputs(ctx);
  const megakernel::GradInputs* into = args.defer_weight_grads ? &defer : nullptr;
  if (is_fp8(impl)) {  // FP8 runs the staged launches with the FP8 GEMM kinds (config.hpp)
    megakernel::StagedBackwardOptions options = backward_options(impl);
    const megakernel::Fp8Pass pass = fp8_pass(ws, weights, stream);
    options.fp8 = &pass;
    megakernel::staged_backward(*impl.state, *impl.forward, *impl.backward, as_saved(ctx), args, weights, grads,
                                options, stream, into);
  } else if (impl.config.effective_backward_engine(grads.mode == GradMode::kAccumulateFp32) ==
             BackwardEngine::kFused) {
    megakernel::fused_backward(*impl.state, *impl.forward, *impl.backward, as_saved(ctx), args, weights, grads,
                               fused_backward_options(impl), stream, into);
  } else {
    megakernel::staged_backward(*impl.state, *impl.forward, *impl.backward, as_saved(ctx), args, weights, grads,
                                backward_options(impl), stream, into);
  }
  ctx.state = args.defer_weight_grads ? Context::Impl::State::kAwaitingWgrad : Context::Impl::State::kConsumed;
  impl.last_stream = stream;
}

void backward_weight_grads(Workspace& ws, const BackwardArgs& args, const WeightGrads& grads, cudaStream_t stream) {
  if (args.x == nullptr) throw_invalid("BackwardArgs.x", "a device pointer to [T, H] bf16", "nullptr");
  if (args.dy == nullptr) throw_invalid("BackwardArgs.dy", "a device pointer to [T, H] bf16", "nullptr");
  Workspace::Impl& impl = ws.impl();
  Context::Impl& ctx = context_of(impl, args.context, "BackwardArgs.context");
  if (ctx.state != Context::Impl::State::kAwaitingWgrad) {
    throw_invalid("BackwardArgs.context", "the context of a backward called with defer_weight_grads",
                  "a context without deferred weight gradients");
  }
  DeviceGuard guard(impl.device);
  megakernel::StagedBackwardOptions options = backward_options(impl);
  megakernel::Fp8Pass pass;  // no weights: the weight gradients read none
  pass.fp8_wgrad = impl.config.fp8_weight_grads;
  if (is_fp8(impl)) options.fp8 = &pass;
  megakernel::deferred_weight_grads(*impl.state, *impl.forward, *impl.backward, ctx.saved, args, grads,
                                    deferred_inputs(ctx), options, stream);
  ctx.state = Context::Impl::State::kConsumed;
  impl.last_stream = stream;
}

void recompute_forward_context(Workspace& ws, const ForwardArgs& args, const ExpertWeights& weights,
                               cudaStream_t stream) {
  check_forward_args(ws, args, weights);
  Workspace::Impl& impl = ws.impl();
  Context::Impl& ctx = context_of(impl, args.context, "ForwardArgs.context");
  require_saved(ctx, "ForwardArgs.context");
  if (!ctx.layout.activations) {
    throw_invalid("ForwardArgs.context", "a context with room for the activations (Context::Keep::kActivations)",
                  "a routing-only context (its backward recomputes them itself)");
  }
  DeviceGuard guard(impl.device);
  megakernel::StagedBackwardOptions options = backward_options(impl);
  megakernel::Fp8Pass pass;
  if (is_fp8(impl)) {
    pass = fp8_pass(ws, weights, stream);
    options.fp8 = &pass;
  }
  // FP8: GEMM 1's epilogue writes the context's FP8 copies (its bf16 g, u are not written).
  const megakernel::SavedContext out = is_fp8(impl) ? impl.backward->scratch_activations(ctx.saved) : ctx.saved;
  megakernel::recompute_activations(*impl.state, *impl.forward, *impl.backward, ctx.saved, args.x, weights, out,
                                    options, stream);
  ctx.complete = true;
  impl.last_stream = stream;
}

}  // namespace mok
