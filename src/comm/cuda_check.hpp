// CUDA and NCCL return codes turned into mok::Error (kCudaError / kNcclError) naming the call.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

#include "mok/error.hpp"

namespace mok::comm {

[[noreturn]] inline void throw_cuda(cudaError_t e, const char* call, const char* file, int line) {
  throw Error(Status::kCudaError, std::string(call) + " failed: " + cudaGetErrorName(e) + " (" +
                                      cudaGetErrorString(e) + ") at " + file + ":" + std::to_string(line));
}

[[noreturn]] inline void throw_nccl(ncclResult_t r, const char* call, const char* file, int line) {
  throw Error(Status::kNcclError, std::string(call) + " failed: " + ncclGetErrorString(r) + " at " + file +
                                      ":" + std::to_string(line));
}

}  // namespace mok::comm

#define MOK_CUDA_CHECK(call)                                                         \
  do {                                                                               \
    const cudaError_t mok_e_ = (call);                                               \
    if (mok_e_ != cudaSuccess) ::mok::comm::throw_cuda(mok_e_, #call, __FILE__, __LINE__); \
  } while (0)

#define MOK_NCCL_CHECK(call)                                                         \
  do {                                                                               \
    const ncclResult_t mok_r_ = (call);                                              \
    if (mok_r_ != ncclSuccess) ::mok::comm::throw_nccl(mok_r_, #call, __FILE__, __LINE__); \
  } while (0)
