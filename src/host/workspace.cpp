// mok::Workspace and mok::schedule on the NCCL device API (docs/comm.md).
#include <atomic>
#include <cstdio>
#include <string>

#include "comm/cuda_check.hpp"
#include "host/simulated_ranks.hpp"
#include "host/workspace_impl.hpp"

namespace mok {

DeviceGuard::DeviceGuard(int device) {
  MOK_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != device) MOK_CUDA_CHECK(cudaSetDevice(device));
}

DeviceGuard::~DeviceGuard() {
  int now = -1;
  if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
}

namespace {

void check_communicator(const LayerShape& shape, ncclComm* comm, int device) {
  if (comm == nullptr) throw_invalid("comm", "an NCCL communicator of LayerShape.ep ranks", "nullptr");
  int count = 0, comm_device = -1;
  MOK_NCCL_CHECK(ncclCommCount(comm, &count));
  MOK_NCCL_CHECK(ncclCommCuDevice(comm, &comm_device));
  if (count != shape.ep) {
    throw_invalid("comm", "an NCCL communicator of LayerShape.ep = " + std::to_string(shape.ep) + " ranks",
                  std::to_string(count) + " ranks");
  }
  if (comm_device != device) {
    throw_invalid("device", "the CUDA device of the NCCL communicator (" + std::to_string(comm_device) + ")",
                  std::to_string(device));
  }
}

// The state every workspace gets after its CommState: the forward's buffers, then a device
// sync (the constructors' legacy-stream memsets must be done before the caller's first launch
// on a non-blocking stream).
void finish_impl(Workspace::Impl& impl, int64_t resident) {
  impl.forward = std::make_unique<megakernel::ForwardBuffers>(impl.shape, impl.config,
                                                              impl.state->view().buffer_rows, resident);
  impl.backward = std::make_unique<megakernel::BackwardBuffers>(impl.shape, impl.state->view().buffer_rows,
                                                                impl.state->row_buffer_is_ring(),
                                                                impl.config.precision == Precision::kFp8Block);
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
}

// The workspace's own context (forwards given none), then a device sync as above.
void add_own_context(Workspace& ws) {
  ws.impl().own_context = Context::create(ws, cudaStream_t{nullptr});
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
}

std::unique_ptr<Workspace::Impl> new_impl(const LayerShape& shape, const Config& config, int device) {
  auto impl = std::make_unique<Workspace::Impl>();
  impl->shape = shape;
  impl->config = config;
  impl->device = device;
  static std::atomic<uint64_t> next_serial{1};
  impl->serial = next_serial.fetch_add(1);
  return impl;
}

// The macrobatch ring is the fused forward's; the staged path (a developer path, and FP8's) keeps every row.
int64_t resident_rows(const Workspace::Impl& impl) {
  return impl.config.forward_engine == ForwardEngine::kFused && impl.config.precision == Precision::kBf16
             ? impl.config.resident_routed_rows(impl.shape)
             : 0;
}

}  // namespace

Workspace::Workspace(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::unique_ptr<Workspace> Workspace::adopt(std::unique_ptr<Impl> impl) {
  if (impl == nullptr || impl->state == nullptr || impl->forward == nullptr) {
    throw_invalid("Workspace::adopt impl", "a fully built Workspace::Impl", "an incomplete one");
  }
  return std::unique_ptr<Workspace>(new Workspace(std::move(impl)));
}

Workspace::~Workspace() {
  if (impl_ && impl_->state) {
    DeviceGuard guard(impl_->device);
    if (impl_->simulated != nullptr) {
      // Collective teardown: every rank has issued its last launch before anyone frees memory
      // (the frees sync the whole device, which the other ranks' kernels share).
      try {
        impl_->simulated->barrier(impl_->simulated_rank, "workspace destruction");
      } catch (const std::exception& e) {
        std::fprintf(stderr, "mok: %s (tearing down anyway)\n", e.what());
      }
    }
    impl_->own_context.reset();
    impl_->own_fp8.reset();
    impl_->backward.reset();
    impl_->forward.reset();
    impl_->state.reset();
  }
}

std::unique_ptr<Workspace> Workspace::create(const LayerShape& shape, const Config& config, ncclComm* comm,
                                             int device) {
  config.validate(shape);
  check_communicator(shape, comm, device);
  DeviceGuard guard(device);
  auto impl = new_impl(shape, config, device);
  impl->comm = comm;
  const int64_t resident = resident_rows(*impl);
  impl->state = std::make_unique<comm::CommState>(shape, config, comm, resident);
  finish_impl(*impl, resident);
  std::unique_ptr<Workspace> ws(new Workspace(std::move(impl)));
  add_own_context(*ws);
  return ws;
}

namespace host {

std::unique_ptr<Workspace> create_simulated_workspace(const LayerShape& shape, const Config& config,
                                                      comm::SimulatedGroup& group, int rank) {
  config.validate(shape);
  if (group.ep() != shape.ep) {
    throw_invalid("group", "a simulated group of LayerShape.ep = " + std::to_string(shape.ep) + " ranks",
                  std::to_string(group.ep()) + " ranks");
  }
  group.check_rank(rank);
  DeviceGuard guard(group.device());
  auto impl = new_impl(shape, config, group.device());
  impl->simulated = &group;
  impl->simulated_rank = rank;
  const int64_t resident = resident_rows(*impl);
  auto window = std::make_unique<comm::SymmetricWindow>(group, rank, comm::CommState::window_bytes(shape));
  impl->state = std::make_unique<comm::CommState>(shape, config, std::move(window), resident);
  finish_impl(*impl, resident);  // ends with the device sync
  std::unique_ptr<Workspace> ws = Workspace::adopt(std::move(impl));
  add_own_context(*ws);  // ends with a device sync too
  // Last: no rank launches a kernel that waits on its peers while another is still inside a
  // device-wide sync above (that sync would wait for the spinning kernel: a deadlock).
  group.barrier(rank, "workspace creation");
  return ws;
}

}  // namespace host

const LayerShape& Workspace::shape() const { return impl_->shape; }
const Config& Workspace::config() const { return impl_->config; }
int Workspace::rank() const { return impl_->state->rank(); }
int Workspace::device() const { return impl_->device; }
bf16* Workspace::x_staging() { return impl_->state->x_staging(); }

void Workspace::check() {
  DeviceGuard guard(impl_->device);
  if (auto err = impl_->state->take_error(impl_->last_stream)) throw *err;
  megakernel::check_gemm_errors(*impl_->forward, impl_->last_stream);
  megakernel::check_fp8_records(*impl_->forward, impl_->shape, impl_->last_stream);
}

size_t Workspace::device_bytes() const {
  const Impl& i = *impl_;
  return comm::CommState::window_bytes(i.shape) + i.state->device_bytes() + i.forward->bytes() +
         i.backward->bytes() + (i.own_context ? i.own_context->bytes() : 0) + (i.own_fp8 ? i.own_fp8->bytes() : 0);
}

void schedule(Workspace& ws, const int32_t* topk_idx, cudaStream_t stream) {
  schedule(ws, topk_idx, ws.shape().tokens, stream);
}

void schedule(Workspace& ws, const int32_t* topk_idx, int64_t tokens, cudaStream_t stream) {
  if (topk_idx == nullptr) throw_invalid("topk_idx", "a device pointer to [T, K] int32 expert ids", "nullptr");
  Workspace::Impl& impl = ws.impl();
  DeviceGuard guard(impl.device);
  impl.state->schedule(topk_idx, tokens, stream);
  impl.last_stream = stream;
}

}  // namespace mok
