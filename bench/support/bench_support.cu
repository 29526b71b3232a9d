#include "support/bench_support.hpp"

#include <cmath>
#include <random>

#include "comm/cuda_check.hpp"

namespace mok::bench {
namespace {

__device__ __forceinline__ float hash_unit(size_t i, uint32_t seed) {  // [0, 1)
  uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ static_cast<uint32_t>(i >> 32) * 40503u ^ seed;
  h ^= h >> 16;
  h *= 0x7feb352du;
  h ^= h >> 15;
  h *= 0x846ca68bu;
  h ^= h >> 16;
  return (h >> 8) * (1.0f / 16777216.0f);
}

__global__ void fill_bf16_kernel(bf16* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float u = hash_unit(i, seed);
    const float v = (2.0f * u - 1.0f) * scale;
    p[i] = __float2bfloat16(fabsf(v) < scale * 1e-3f ? scale * 1e-3f : v);  // never zero
  }
}

__global__ void fill_f32_kernel(float* p, size_t n, uint32_t seed, float lo, float hi) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    p[i] = lo + (hi - lo) * hash_unit(i, seed);
  }
}

__global__ void mismatch_kernel(const uint16_t* a, const uint16_t* b, size_t n, unsigned long long* count) {
  unsigned long long local = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    local += a[i] != b[i] ? 1 : 0;
  }
  if (local) atomicAdd(count, local);  // integer count only
}

}  // namespace

LayerShape bench_shape(const std::string& name, int ep, int64_t tokens) {
  if (name == "dsv3") return tokens > 0 ? dsv3_shape(ep, tokens) : dsv3_shape(ep);
  if (name == "qwen3") return tokens > 0 ? qwen3_shape(ep, tokens) : qwen3_shape(ep);
  if (name == "gptoss") return tokens > 0 ? gptoss_shape(ep, tokens) : gptoss_shape(ep);
  throw_invalid("shape", "dsv3, qwen3 or gptoss", name);
}

std::vector<std::vector<int32_t>> uniform_routing(const LayerShape& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int32_t>> idx(s.ep, std::vector<int32_t>(s.tokens * s.topk));
  std::vector<int32_t> perm(s.experts);
  for (int r = 0; r < s.ep; ++r) {
    for (int64_t t = 0; t < s.tokens; ++t) {
      for (int64_t i = 0; i < s.experts; ++i) perm[i] = static_cast<int32_t>(i);
      for (int k = 0; k < s.topk; ++k) {  // partial Fisher-Yates: K distinct experts
        std::swap(perm[k], perm[k + rng() % (s.experts - k)]);
        idx[r][t * s.topk + k] = perm[k];
      }
    }
  }
  return idx;
}

void fill_random_bf16(bf16* p, size_t n, uint32_t seed, float scale, cudaStream_t stream) {
  if (n == 0) return;
  fill_bf16_kernel<<<2048, 256, 0, stream>>>(p, n, seed, scale);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void fill_random_f32(float* p, size_t n, uint32_t seed, float lo, float hi, cudaStream_t stream) {
  if (n == 0) return;
  fill_f32_kernel<<<1024, 256, 0, stream>>>(p, n, seed, lo, hi);
  MOK_CUDA_CHECK(cudaGetLastError());
}

RandomLayer::RandomLayer(const LayerShape& s, int rank, const std::vector<int32_t>& idx, uint32_t seed)
    : x(s.tokens * s.hidden),
      y(s.tokens * s.hidden),
      gate(s.local_experts() * s.intermediate * s.hidden),
      up(s.local_experts() * s.intermediate * s.hidden),
      down(s.local_experts() * s.hidden * s.intermediate),
      shared_gate(s.shared_intermediate * s.hidden),
      shared_up(s.shared_intermediate * s.hidden),
      shared_down(s.hidden * s.shared_intermediate),
      topk_w(s.tokens * s.topk),
      topk_idx(s.tokens * s.topk) {
  const uint32_t base = seed * 1000u + static_cast<uint32_t>(rank) * 16u;
  // Uniform in [-a, a] has variance a^2/3: a = sqrt(3/fan_in) keeps unit-variance activations.
  const float wh = std::sqrt(3.0f / float(s.hidden)), wi = std::sqrt(3.0f / float(s.intermediate));
  const float ws = s.has_shared() ? std::sqrt(3.0f / float(s.shared_intermediate)) : 0.0f;
  fill_random_bf16(x.get(), x.size(), base + 1, 1.7f, nullptr);
  fill_random_bf16(gate.get(), gate.size(), base + 2, wh, nullptr);
  fill_random_bf16(up.get(), up.size(), base + 3, wh, nullptr);
  fill_random_bf16(down.get(), down.size(), base + 4, wi, nullptr);
  fill_random_bf16(shared_gate.get(), shared_gate.size(), base + 5, wh, nullptr);
  fill_random_bf16(shared_up.get(), shared_up.size(), base + 6, wh, nullptr);
  fill_random_bf16(shared_down.get(), shared_down.size(), base + 7, ws, nullptr);
  fill_random_f32(topk_w.get(), topk_w.size(), base + 8, 0.05f, 1.0f, nullptr);
  MOK_CUDA_CHECK(cudaMemcpy(topk_idx.get(), idx.data(), idx.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
}

ExpertWeights RandomLayer::weights() const {
  return ExpertWeights{gate.get(), up.get(), down.get(), shared_gate.get(), shared_up.get(), shared_down.get()};
}

ForwardArgs RandomLayer::args() const { return ForwardArgs{x.get(), topk_w.get(), y.get()}; }

int64_t count_mismatches(const bf16* a, const bf16* b, size_t n, cudaStream_t stream) {
  comm::DeviceBuffer<unsigned long long> count(1);
  MOK_CUDA_CHECK(cudaMemsetAsync(count.get(), 0, sizeof(unsigned long long), stream));
  mismatch_kernel<<<1024, 256, 0, stream>>>(reinterpret_cast<const uint16_t*>(a), reinterpret_cast<const uint16_t*>(b),
                                            n, count.get());
  MOK_CUDA_CHECK(cudaGetLastError());
  unsigned long long host = 0;
  MOK_CUDA_CHECK(cudaMemcpyAsync(&host, count.get(), sizeof(host), cudaMemcpyDeviceToHost, stream));
  MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
  return static_cast<int64_t>(host);
}

}  // namespace mok::bench
