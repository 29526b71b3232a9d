// mok::Context: one layer's saved forward context (include/mok/api.hpp, src/megakernel/context.hpp).
#include <cuda_runtime_api.h>

#include <cstdio>
#include <string>

#include "comm/cuda_check.hpp"
#include "host/workspace_impl.hpp"

namespace mok {
namespace {

// ContextLayout's levels: 0 the routing table, 1 and the activations, 2 and room for a deferred wgrad.
int keep_level(Context::Keep keep) {
  return keep == Context::Keep::kRoutingOnly ? 0 : keep == Context::Keep::kDeferredWgrad ? 2 : 1;
}

std::unique_ptr<Context::Impl> new_context(Workspace& ws, Context::Keep keep) {
  if (keep != Context::Keep::kActivations && keep != Context::Keep::kRoutingOnly &&
      keep != Context::Keep::kDeferredWgrad) {
    throw_invalid("keep", "Context::Keep::kActivations, kRoutingOnly or kDeferredWgrad", std::to_string(int(keep)));
  }
  auto impl = std::make_unique<Context::Impl>();
  impl->workspace_serial = ws.impl().serial;
  impl->device = ws.impl().device;
  impl->layout = megakernel::ContextLayout::make(ws.shape(), ws.config(), keep_level(keep));
  impl->bytes = impl->layout.total;
  return impl;
}

}  // namespace

size_t Context::bytes(const LayerShape& shape, const Config& config, Keep keep) {
  config.validate(shape);
  return megakernel::ContextLayout::make(shape, config, keep_level(keep)).total;
}

Context::Context(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::unique_ptr<Context> Context::create(Workspace& ws, cudaStream_t stream, Keep keep) {
  auto impl = new_context(ws, keep);
  DeviceGuard guard(impl->device);
  void* p = nullptr;
  MOK_CUDA_CHECK(cudaMallocAsync(&p, impl->bytes, stream));
  impl->base = static_cast<char*>(p);
  impl->owned = true;
  impl->saved = megakernel::SavedContext::at(impl->base, impl->layout, ws.shape());
  return std::make_unique<Context>(std::move(impl));
}

std::unique_ptr<Context> Context::create(Workspace& ws, void* memory, size_t bytes, Keep keep) {
  auto impl = new_context(ws, keep);
  if (memory == nullptr) throw_invalid("memory", "a device pointer to Context::bytes(shape, config) bytes", "nullptr");
  if (reinterpret_cast<uintptr_t>(memory) % 256 != 0) {
    throw_invalid("memory", "a 256-byte aligned device pointer", "a pointer at offset " +
                                                                      std::to_string(reinterpret_cast<uintptr_t>(memory) % 256) +
                                                                      " from 256-byte alignment");
  }
  if (bytes < impl->bytes) {
    throw_invalid("bytes", "at least Context::bytes(shape, config, keep) = " + std::to_string(impl->bytes),
                  std::to_string(bytes));
  }
  cudaPointerAttributes attr{};
  MOK_CUDA_CHECK(cudaPointerGetAttributes(&attr, memory));
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    throw_invalid("memory", "device memory of device " + std::to_string(impl->device), "host or unregistered memory");
  }
  if (attr.device != impl->device) {
    throw_invalid("memory", "device memory of the workspace's device " + std::to_string(impl->device),
                  "memory of device " + std::to_string(attr.device));
  }
  impl->base = static_cast<char*>(memory);
  impl->saved = megakernel::SavedContext::at(impl->base, impl->layout, ws.shape());
  return std::make_unique<Context>(std::move(impl));
}

// cudaFree, not cudaFreeAsync on the stream of the last use: the caller may have destroyed that
// stream by now (bench_backward did, and the free on it crashed in the driver). cudaFree of a
// stream-ordered allocation waits for the device's work first.
Context::~Context() {
  if (impl_ && impl_->owned && impl_->base != nullptr) {
    int previous = -1;
    cudaGetDevice(&previous);
    cudaSetDevice(impl_->device);
    const cudaError_t e = cudaFree(impl_->base);
    if (e != cudaSuccess) std::fprintf(stderr, "mok: freeing a context: %s\n", cudaGetErrorString(e));
    if (previous >= 0 && previous != impl_->device) cudaSetDevice(previous);
  }
}

size_t Context::bytes() const { return impl_->bytes; }
bool Context::saved() const { return impl_->state == Impl::State::kSaved; }
bool Context::has_activations() const { return impl_->state == Impl::State::kSaved && impl_->complete; }

}  // namespace mok
