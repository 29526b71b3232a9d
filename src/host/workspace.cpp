// mok::Workspace and mok::schedule on the NCCL device API (DESIGN §2 step 1, §5).
#include <string>

#include "comm/cuda_check.hpp"
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

}  // namespace

Workspace::Workspace(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Workspace::~Workspace() {
  if (impl_ && impl_->state) {
    DeviceGuard guard(impl_->device);
    impl_->forward.reset();
    impl_->state.reset();
  }
}

std::unique_ptr<Workspace> Workspace::create(const LayerShape& shape, const Config& config, ncclComm* comm,
                                             int device) {
  config.validate(shape);
  check_communicator(shape, comm, device);
  DeviceGuard guard(device);
  auto impl = std::make_unique<Impl>();
  impl->shape = shape;
  impl->config = config;
  impl->device = device;
  impl->comm = comm;
  impl->forward_path = megakernel::forward_path_from_env();
  // The macrobatch ring is the fused forward's; the staged path (a developer path) keeps every row.
  const int64_t resident =
      impl->forward_path == megakernel::ForwardPath::kFused ? config.resident_routed_rows(shape) : 0;
  impl->state = std::make_unique<comm::CommState>(shape, config, comm, resident);
  impl->forward =
      std::make_unique<megakernel::ForwardBuffers>(shape, config, impl->state->view().buffer_rows, resident);
  return std::unique_ptr<Workspace>(new Workspace(std::move(impl)));
}

const LayerShape& Workspace::shape() const { return impl_->shape; }
const Config& Workspace::config() const { return impl_->config; }
int Workspace::rank() const { return impl_->state->rank(); }
int Workspace::device() const { return impl_->device; }
bf16* Workspace::x_staging() { return impl_->state->x_staging(); }

void Workspace::check() {
  DeviceGuard guard(impl_->device);
  if (auto err = impl_->state->take_error(impl_->last_stream)) throw *err;
  megakernel::check_gemm_errors(*impl_->forward, impl_->last_stream);
}

void schedule(Workspace& ws, const int32_t* topk_idx, cudaStream_t stream) {
  if (topk_idx == nullptr) throw_invalid("topk_idx", "a device pointer to [T, K] int32 expert ids", "nullptr");
  Workspace::Impl& impl = ws.impl();
  DeviceGuard guard(impl.device);
  impl.state->schedule(topk_idx, stream);
  impl.last_stream = stream;
}

}  // namespace mok
