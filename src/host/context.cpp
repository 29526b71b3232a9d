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
  impl->base = allocate_block(impl->bytes, impl->device, stream);
  impl->owned = true;
  impl->saved = megakernel::SavedContext::at(impl->base, impl->layout, ws.shape());
  return std::make_unique<Context>(std::move(impl));
}

std::unique_ptr<Context> Context::create(Workspace& ws, void* memory, size_t bytes, Keep keep) {
  auto impl = new_context(ws, keep);
  check_caller_block(memory, bytes, impl->bytes, impl->device, "Context::bytes(shape, config, keep)");
  impl->base = static_cast<char*>(memory);
  impl->saved = megakernel::SavedContext::at(impl->base, impl->layout, ws.shape());
  return std::make_unique<Context>(std::move(impl));
}

Context::~Context() {
  if (impl_ && impl_->owned) free_block(impl_->base, impl_->device, "a context");
}

size_t Context::bytes() const { return impl_->bytes; }
bool Context::saved() const { return impl_->state == Impl::State::kSaved; }
bool Context::has_activations() const { return impl_->state == Impl::State::kSaved && impl_->complete; }

}  // namespace mok
