// The demo's GPU engine: the mok layer on `ep` local GPUs, one thread per GPU (launch mode (a)
// of docs/comm.md), driven step by step from the demo's main thread.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "mok/config.hpp"
#include "mok/shape.hpp"
#include "reference/layer.hpp"

namespace mok::cli {

class GpuLayer {
 public:
  GpuLayer(const LayerShape& shape, const Config& config);  // starts one thread per GPU
  ~GpuLayer();
  GpuLayer(const GpuLayer&) = delete;
  GpuLayer& operator=(const GpuLayer&) = delete;

  // y of every rank ([ep][T*H] bf16 bits) from the GPU forward (schedule + forward + check).
  std::vector<std::vector<uint16_t>> forward(const ref::LayerWeights& weights, const ref::LayerInputs& inputs);
  // The GPU backward of the last forward (dy [ep][T*H] bf16 bits): dx, d topk_w, the routed
  // weight gradients (global [E, ...] view) and each rank's shared-expert partial sums.
  ref::Gradients backward(const std::vector<std::vector<uint16_t>>& dy);

  struct State;

 private:
  std::unique_ptr<State> state_;
};

}  // namespace mok::cli
