// Small pieces the layer benchmarks share (bench_forward, bench_backward, bench_comm): option
// lists, a bitwise fingerprint of a device buffer, and the cuBLAS dense yardstick.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <barrier>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "bench_timing.hpp"
#include "comm/cuda_check.hpp"
#include "comm/device_buffer.hpp"
#include "support/bench_support.hpp"
#include "mok/error.hpp"
#include "mok/shape.hpp"

#define CUBLAS_OK(x)                                                                                      \
  do {                                                                                                    \
    const cublasStatus_t s_ = (x);                                                                        \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                                    \
      throw ::mok::Error(::mok::Status::kCudaError, "cuBLAS status " + std::to_string(int(s_)));          \
    }                                                                                                     \
  } while (0)

namespace mok::bench {

// "a,b,c" -> {"a", "b", "c"}.
inline std::vector<std::string> split(const std::string& v) {
  std::vector<std::string> out;
  std::stringstream s(v);
  for (std::string x; std::getline(s, x, ',');) out.push_back(x);
  return out;
}

// FNV-1a 64 of a device buffer's bytes (copied to the host; stream-ordered, synchronises): the
// bits of two builds compare by it.
inline uint64_t fnv1a64(const void* p, size_t bytes, cudaStream_t st) {
  std::vector<unsigned char> h(bytes);
  MOK_CUDA_CHECK(cudaMemcpyAsync(h.data(), p, bytes, cudaMemcpyDeviceToHost, st));
  MOK_CUDA_CHECK(cudaStreamSynchronize(st));
  uint64_t x = 1469598103934665603ull;
  for (unsigned char c : h) x = (x ^ c) * 1099511628211ull;
  return x;
}

struct DenseTiming {
  double ms = 0;     // median, as time_ms
  double flops = 0;  // of the GEMM actually run
};

// One cuBLAS bf16 GEMM (fp32 compute) of about `flops` useful FLOPs, shaped like the layer's
// matmuls: [M, 3I] x [H, 3I]^T with M rounded up to 128, random non-zero data, timed as ours.
template <class Options>
DenseTiming cublas_dense(const Options& o, std::barrier<>& sync, cudaStream_t st, const LayerShape& s, double flops) {
  const int64_t N = s.hidden, K = 3 * s.intermediate;
  const int64_t M = (static_cast<int64_t>(flops / (2.0 * N * K)) + 127) / 128 * 128;
  comm::DeviceBuffer<bf16> A(M * K), B(N * K), C(M * N);
  bench::fill_random_bf16(A.get(), A.size(), 91, 1.0f, st);
  bench::fill_random_bf16(B.get(), B.size(), 92, 0.02f, st);
  cublasHandle_t blas;
  CUBLAS_OK(cublasCreate(&blas));
  CUBLAS_OK(cublasSetStream(blas, st));
  const float one = 1.0f, zero = 0.0f;
  DenseTiming t;
  t.ms = time_ms(o, sync, st, [&] {  // row-major C = A B^T as cuBLAS column-major C^T = B A^T
    CUBLAS_OK(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, int(N), int(M), int(K), &one, B.get(), CUDA_R_16BF, int(K),
                           A.get(), CUDA_R_16BF, int(K), &zero, C.get(), CUDA_R_16BF, int(N), CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT));
  });
  t.flops = 2.0 * double(M) * double(N) * double(K);
  cublasDestroy(blas);
  return t;
}

}  // namespace mok::bench
