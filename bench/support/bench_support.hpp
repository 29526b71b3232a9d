// Shared pieces of the benchmarks and the `mok` program's bench and soak (library
// mok_bench_support, not part of libmok): one rank's layer filled with random non-zero data on the
// GPU, uniform top-k routing, and bit comparison of device buffers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "comm/device_buffer.hpp"
#include "mok/api.hpp"

namespace mok::bench {

// The benchmarks' model shapes by name ("dsv3", "qwen3", "gptoss": mok::dsv3_shape and the others) at
// T per rank (0 = the shape's default) and EP size. Throws for an unknown name.
LayerShape bench_shape(const std::string& name, int ep, int64_t tokens = 0);

// Uniform routing of every rank: K distinct experts per token, [ep][T*K].
std::vector<std::vector<int32_t>> uniform_routing(const LayerShape& s, uint64_t seed);

// Uniform random values in [-scale, scale] (never exactly zero), hashed from (index, seed).
void fill_random_bf16(bf16* p, size_t n, uint32_t seed, float scale, cudaStream_t stream);
// Uniform random values in [lo, hi).
void fill_random_f32(float* p, size_t n, uint32_t seed, float lo, float hi, cudaStream_t stream);

// One rank's inputs and weights on its GPU, random, weights scaled so activations stay O(1).
struct RandomLayer {
  RandomLayer(const LayerShape& shape, int rank, const std::vector<int32_t>& topk_idx, uint32_t seed);
  ExpertWeights weights() const;
  ForwardArgs args() const;

  comm::DeviceBuffer<bf16> x, y, gate, up, down, shared_gate, shared_up, shared_down;
  comm::DeviceBuffer<float> topk_w;
  comm::DeviceBuffer<int32_t> topk_idx;
};

// Number of 16-bit elements that differ between two device buffers (stream-ordered, synchronises).
int64_t count_mismatches(const bf16* a, const bf16* b, size_t n, cudaStream_t stream);

}  // namespace mok::bench
