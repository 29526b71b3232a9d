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
  impl->base = allocate_block(impl->bytes, impl->device, stream);
  impl->owned = true;
  impl->views = megakernel::Fp8WeightViews::at(impl->base, impl->shape);
  return std::make_unique<Fp8WeightCache>(std::move(impl));
}

std::unique_ptr<Fp8WeightCache> Fp8WeightCache::create(Workspace& ws, void* memory, size_t bytes) {
  auto impl = new_cache(ws);
  check_caller_block(memory, bytes, impl->bytes, impl->device, "Fp8WeightCache::bytes(shape)");
  impl->base = static_cast<char*>(memory);
  impl->views = megakernel::Fp8WeightViews::at(impl->base, impl->shape);
  return std::make_unique<Fp8WeightCache>(std::move(impl));
}

Fp8WeightCache::~Fp8WeightCache() {
  if (impl_ && impl_->owned) free_block(impl_->base, impl_->device, "an Fp8WeightCache");
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
