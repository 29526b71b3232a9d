// mok::Fp8WeightCache: one layer's FP8 weight copies (include/mok/api.hpp, megakernel/fp8_steps.hpp).
#include <cuda_runtime_api.h>

#include <cstdio>
#include <string>

#include "comm/cuda_check.hpp"
#include "host/workspace_impl.hpp"

namespace mok {
namespace {

std::unique_ptr<Fp8WeightCache::Impl> new_cache(Workspace& ws) {
  if (ws.config().precision != Precision::kFp8Block) {
    throw_invalid("ws", "a workspace created with Config::precision = fp8_block (an Fp8WeightCache holds FP8 copies)",
                  std::string("a workspace of precision ") + to_string(ws.config().precision));
  }
  auto impl = std::make_unique<Fp8WeightCache::Impl>();
  impl->workspace_serial = ws.impl().serial;
  impl->device = ws.impl().device;
  impl->shape = ws.shape();
  impl->bytes = megakernel::Fp8WeightViews::bytes(ws.shape());
  return impl;
}

}  // namespace

size_t Fp8WeightCache::bytes(const LayerShape& shape) {
  shape.validate();
  return megakernel::Fp8WeightViews::bytes(shape);
}

Fp8WeightCache::Fp8WeightCache(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::unique_ptr<Fp8WeightCache> Fp8WeightCache::create(Workspace& ws, cudaStream_t stream) {
  auto impl = new_cache(ws);
  DeviceGuard guard(impl->device);
  void* p = nullptr;
  MOK_CUDA_CHECK(cudaMallocAsync(&p, impl->bytes, stream));
  impl->base = static_cast<char*>(p);
  impl->owned = true;
  impl->views = megakernel::Fp8WeightViews::at(impl->base, impl->shape);
  return std::make_unique<Fp8WeightCache>(std::move(impl));
}

std::unique_ptr<Fp8WeightCache> Fp8WeightCache::create(Workspace& ws, void* memory, size_t bytes) {
  auto impl = new_cache(ws);
  if (memory == nullptr) throw_invalid("memory", "a device pointer to Fp8WeightCache::bytes(shape) bytes", "nullptr");
  if (reinterpret_cast<uintptr_t>(memory) % 256 != 0) {
    throw_invalid("memory", "a 256-byte aligned device pointer",
                  "a pointer at offset " + std::to_string(reinterpret_cast<uintptr_t>(memory) % 256) +
                      " from 256-byte alignment");
  }
  if (bytes < impl->bytes) {
    throw_invalid("bytes", "at least Fp8WeightCache::bytes(shape) = " + std::to_string(impl->bytes),
                  std::to_string(bytes));
  }
  cudaPointerAttributes attr{};
  MOK_CUDA_CHECK(cudaPointerGetAttributes(&attr, memory));
  if ((attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) || attr.device != impl->device) {
    throw_invalid("memory", "device memory of the workspace's device " + std::to_string(impl->device),
                  attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged
                      ? "memory of device " + std::to_string(attr.device)
                      : std::string("host or unregistered memory"));
  }
  impl->base = static_cast<char*>(memory);
  impl->views = megakernel::Fp8WeightViews::at(impl->base, impl->shape);
  return std::make_unique<Fp8WeightCache>(std::move(impl));
}

// cudaFree (it waits for the device's work), as ~Context.
Fp8WeightCache::~Fp8WeightCache() {
  if (impl_ && impl_->owned && impl_->base != nullptr) {
    int previous = -1;
    cudaGetDevice(&previous);
    cudaSetDevice(impl_->device);
    const cudaError_t e = cudaFree(impl_->base);
    if (e != cudaSuccess) std::fprintf(stderr, "mok: freeing an Fp8WeightCache: %s\n", cudaGetErrorString(e));
    if (previous >= 0 && previous != impl_->device) cudaSetDevice(previous);
  }
}

void Fp8WeightCache::update(const ExpertWeights& w, cudaStream_t stream) {
  if (w.gate == nullptr || w.up == nullptr || w.down == nullptr) {
    throw_invalid("weights.gate/up/down", "device pointers to the routed expert weights", "nullptr");
  }
  if (impl_->shape.has_shared() && (w.shared_gate == nullptr || w.shared_up == nullptr || w.shared_down == nullptr)) {
    throw_invalid("weights.shared_*", "device pointers (LayerShape.shared_intermediate > 0)", "nullptr");
  }
  DeviceGuard guard(impl_->device);
  megakernel::quantize_weights(impl_->views, w, stream);
  impl_->ready = true;
}

bool Fp8WeightCache::ready() const { return impl_->ready; }
size_t Fp8WeightCache::bytes() const { return impl_->bytes; }

}  // namespace mok
