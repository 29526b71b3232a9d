// Entry points of include/mok/api.hpp that are not part of the workspace/schedule
// (src/host/workspace.cpp). The forward runs the fused GPU kernel (src/megakernel, or the
// staged launches with MOK_FORWARD_PATH=staged) and saves into the call's Context; the
// backward runs the staged GPU backward over that context (src/megakernel/staged_backward.hpp).
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
      "expert GEMMs, combine; MOK_FORWARD_PATH=staged: the same steps as separate launches); the GPU backward "
      "as staged launches over each layer's saved context (pulls of x and dy, dh + SwiGLU backward with d topk_w, "
      "dx, K-grouped weight gradients, dx push and fixed-order sum)";
  return info;
}

namespace {

[[noreturn]] void not_implemented(const char* what, const std::string& why) {
  throw Error(Status::kNotImplemented, std::string("mok::") + what + ": " + why);
}

void check_forward_args(const Workspace& ws, const ForwardArgs& args, const ExpertWeights& w) {
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

}  // namespace

void forward(Workspace& ws, const ForwardArgs& args, const ExpertWeights& weights, cudaStream_t stream) {
  check_forward_args(ws, args, weights);
  if (args.y == nullptr) throw_invalid("ForwardArgs.y", "a device pointer to [T, H] bf16", "nullptr");
  Workspace::Impl& impl = ws.impl();
  Context::Impl& ctx = context_of(impl, args.context, "ForwardArgs.context");
  DeviceGuard guard(impl.device);
  if (impl.forward_path == megakernel::ForwardPath::kFused) {
    megakernel::FusedForwardOptions options = impl.fused;
    options.comm_ctas = impl.config.effective_comm_sms_forward(impl.shape);
    options.grid = impl.config.grid_sms;
    options.timeout_s = impl.config.wait_timeout_s;
    megakernel::fused_forward(*impl.state, *impl.forward, args, weights, options, ctx.saved, stream);
  } else {
    megakernel::StagedForwardOptions options;
    options.dispatch_ctas = impl.config.effective_comm_sms_forward(impl.shape);
    options.combine_ctas = options.dispatch_ctas;
    options.gemm_grid = impl.config.grid_sms;
    options.timeout_s = impl.config.wait_timeout_s;
    megakernel::staged_forward(*impl.state, *impl.forward, args, weights, options, ctx.saved, stream);
  }
  megakernel::save_schedule(*impl.state, *impl.forward, ctx.layout, ctx.base, stream);
  ctx.state = Context::Impl::State::kSaved;
  ctx.complete = !impl.forward->ring();
  ctx.stream = stream;
  impl.last_stream = stream;
}

void backward(Workspace& ws, const BackwardArgs& args, const ExpertWeights& weights, const WeightGrads& grads,
              cudaStream_t stream) {
  check_forward_args(ws, ForwardArgs{args.x, args.topk_w, nullptr}, weights);
  if (args.dy == nullptr) throw_invalid("BackwardArgs.dy", "a device pointer to [T, H] bf16", "nullptr");
  if (args.dx == nullptr) throw_invalid("BackwardArgs.dx", "a device pointer to [T, H] bf16", "nullptr");
  if (args.dtopk_w == nullptr) throw_invalid("BackwardArgs.dtopk_w", "a device pointer to [T, K] fp32", "nullptr");
  Workspace::Impl& impl = ws.impl();
  Context::Impl& ctx = context_of(impl, args.context, "BackwardArgs.context");
  if (ctx.state != Context::Impl::State::kSaved) {
    throw_invalid("BackwardArgs.context", "the context of a forward that no backward consumed yet",
                  ctx.state == Context::Impl::State::kEmpty ? "a context no forward filled"
                                                            : "a context a backward already consumed");
  }
  if (!ctx.complete) {
    not_implemented("backward",
                    "the forward ran the macrobatch ring (Config::macrobatch below the routed buffer), whose saved "
                    "context keeps only the last macrobatch of g, u; the backward's recompute of the others is not "
                    "built yet: use Config::macrobatch = 0 for training");
  }
  DeviceGuard guard(impl.device);
  megakernel::StagedBackwardOptions options;
  options.comm_ctas = impl.config.effective_comm_sms_backward(impl.shape);
  options.gemm_grid = impl.config.grid_sms;
  options.timeout_s = impl.config.wait_timeout_s;
  megakernel::staged_backward(*impl.state, *impl.forward, *impl.backward, ctx.saved, args, weights, grads, options,
                              stream);
  ctx.state = Context::Impl::State::kConsumed;
  ctx.stream = stream;
  impl.last_stream = stream;
}

void recompute_forward_context(Workspace& ws, const ForwardArgs& args, const ExpertWeights& weights, cudaStream_t) {
  check_forward_args(ws, args, weights);
  not_implemented("recompute_forward_context",
                  "not built yet (activation checkpointing: run mok::forward again into the layer's context)");
}

}  // namespace mok
