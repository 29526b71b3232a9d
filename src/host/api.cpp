// Entry points of include/mok/api.hpp that are not part of the workspace/schedule
// (src/host/workspace.cpp). The forward runs the fused GPU kernel (src/megakernel, or the
// staged launches with MOK_FORWARD_PATH=staged); the GPU backward is not built yet and
// refuses with kNotImplemented rather than return wrong numbers.
#include "host/workspace_impl.hpp"
#include "megakernel/fused_forward.hpp"
#include "megakernel/staged_forward.hpp"
#include "mok/api.hpp"

namespace mok {

EngineInfo engine_info() {
  EngineInfo info;
  info.gpu_schedule = true;
  info.gpu_forward = true;
  info.gpu_backward = false;
  info.description =
      "Hopper (sm_90a): GPU schedule, then one fused persistent forward kernel (dispatch, shared and routed "
      "expert GEMMs, combine; MOK_FORWARD_PATH=staged: the same steps as separate launches); "
      "no GPU backward yet (the CPU reference in src/reference computes it)";
  return info;
}

namespace {

[[noreturn]] void not_implemented(const char* what) {
  throw Error(Status::kNotImplemented,
              std::string("mok::") + what +
                  ": not implemented yet on the GPU (the fused kernel lands with the megakernel layer); "
                  "use the CPU reference (src/reference) meanwhile");
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

}  // namespace

void forward(Workspace& ws, const ForwardArgs& args, const ExpertWeights& weights, cudaStream_t stream) {
  check_forward_args(ws, args, weights);
  if (args.y == nullptr) throw_invalid("ForwardArgs.y", "a device pointer to [T, H] bf16", "nullptr");
  Workspace::Impl& impl = ws.impl();
  DeviceGuard guard(impl.device);
  if (impl.forward_path == megakernel::ForwardPath::kFused) {
    megakernel::FusedForwardOptions options = impl.fused;
    options.comm_ctas = impl.config.effective_comm_sms_forward(impl.shape);
    options.grid = impl.config.grid_sms;
    options.timeout_s = impl.config.wait_timeout_s;
    megakernel::fused_forward(*impl.state, *impl.forward, args, weights, options, stream);
  } else {
    megakernel::StagedForwardOptions options;
    options.dispatch_ctas = impl.config.effective_comm_sms_forward(impl.shape);
    options.combine_ctas = options.dispatch_ctas;
    options.gemm_grid = impl.config.grid_sms;
    options.timeout_s = impl.config.wait_timeout_s;
    megakernel::staged_forward(*impl.state, *impl.forward, args, weights, options, stream);
  }
  impl.last_stream = stream;
}

void backward(Workspace& ws, const BackwardArgs& args, const ExpertWeights& weights, const WeightGrads&,
              cudaStream_t) {
  check_forward_args(ws, ForwardArgs{args.x, args.topk_w, nullptr}, weights);
  if (args.dy == nullptr) throw_invalid("BackwardArgs.dy", "a device pointer to [T, H] bf16", "nullptr");
  if (args.dx == nullptr) throw_invalid("BackwardArgs.dx", "a device pointer to [T, H] bf16", "nullptr");
  if (args.dtopk_w == nullptr) throw_invalid("BackwardArgs.dtopk_w", "a device pointer to [T, K] fp32", "nullptr");
  not_implemented("backward");
}

void recompute_forward_context(Workspace& ws, const ForwardArgs& args, const ExpertWeights& weights, cudaStream_t) {
  check_forward_args(ws, args, weights);
  not_implemented("recompute_forward_context");
}

}  // namespace mok
