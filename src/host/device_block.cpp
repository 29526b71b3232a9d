// The memory blocks of mok::Context and mok::Fp8WeightCache: the caller's checked, or mok's own
// (host/workspace_impl.hpp).
#include <cuda_runtime_api.h>

#include <cstdio>
#include <string>

#include "comm/cuda_check.hpp"
#include "host/workspace_impl.hpp"

namespace mok {

void check_caller_block(const void* memory, size_t bytes, size_t needed, int device, const std::string& size_call) {
  if (memory == nullptr) throw_invalid("memory", "a device pointer to " + size_call + " bytes", "nullptr");
  const uintptr_t offset = reinterpret_cast<uintptr_t>(memory) % 256;
  if (offset != 0) {
    throw_invalid("memory", "a 256-byte aligned device pointer",
                  "a pointer at offset " + std::to_string(offset) + " from 256-byte alignment");
  }
  if (bytes < needed) {
    throw_invalid("bytes", "at least " + size_call + " = " + std::to_string(needed), std::to_string(bytes));
  }
  cudaPointerAttributes attr{};
  MOK_CUDA_CHECK(cudaPointerGetAttributes(&attr, memory));
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    throw_invalid("memory", "device memory of device " + std::to_string(device), "host or unregistered memory");
  }
  if (attr.device != device) {
    throw_invalid("memory", "device memory of the workspace's device " + std::to_string(device),
                  "memory of device " + std::to_string(attr.device));
  }
}

char* allocate_block(size_t bytes, int device, cudaStream_t stream) {
  DeviceGuard guard(device);
  void* p = nullptr;
  MOK_CUDA_CHECK(cudaMallocAsync(&p, bytes, stream));
  return static_cast<char*>(p);
}

void free_block(char* base, int device, const char* what) noexcept {
  if (base == nullptr) return;
  int previous = -1;
  cudaGetDevice(&previous);
  cudaSetDevice(device);
  const cudaError_t e = cudaFree(base);
  if (e != cudaSuccess) std::fprintf(stderr, "mok: freeing %s: %s\n", what, cudaGetErrorString(e));
  if (previous >= 0 && previous != device) cudaSetDevice(previous);
}

}  // namespace mok
