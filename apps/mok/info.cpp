// `mok info` and `mok bench`.
#include <nccl.h>

#include <cstdio>

#include "cli.hpp"
#include "mok/api.hpp"
#include "mok/version.hpp"

namespace mok::cli {

int run_info() {
  const EngineInfo info = engine_info();
  std::printf("mok %s\n", kVersion);
  std::printf("engine: %s\n", info.description);
  std::printf("  gpu schedule: %s, gpu forward: %s, gpu backward: %s\n", info.gpu_schedule ? "yes" : "no",
              info.gpu_forward ? "yes" : "no", info.gpu_backward ? "yes" : "no");
  int version = 0;
  ncclGetVersion(&version);
  std::printf("NCCL: headers %d, loaded library %d%s\n", NCCL_VERSION_CODE, version,
              version == NCCL_VERSION_CODE ? "" : "  (MISMATCH: the device-API path refuses to start)");
  int gpus = 0;
  const cudaError_t err = cudaGetDeviceCount(&gpus);
  if (err != cudaSuccess) {
    std::printf("CUDA GPUs: none visible (%s)\n", cudaGetErrorString(err));
    return 0;
  }
  std::printf("CUDA GPUs: %d\n", gpus);
  for (int d = 0; d < gpus; ++d) {
    cudaDeviceProp p{};
    cudaGetDeviceProperties(&p, d);
    std::printf("  [%d] %s, sm_%d%d, %d SMs, %.0f GiB%s\n", d, p.name, p.major, p.minor, p.multiProcessorCount,
                p.totalGlobalMem / 1073741824.0, p.major == 9 ? "" : "  (mok's kernels need sm_90)");
  }
  return 0;
}

int run_bench(const Options& opts) {
  const std::string shape = opts.str("shape");
  if (shape != "dsv3" && shape != "qwen3" && shape != "gptoss") {
    throw_invalid("--shape", "dsv3, qwen3 or gptoss", shape);
  }
  (void)opts.integer("tokens", 0, 1 << 24);
  if (!engine_info().gpu_forward) {
    throw Error(Status::kNotImplemented,
                "mok bench: the fused GPU forward is not built yet; the GEMM and communication benchmarks "
                "are build/bin/bench_gemm and build/bin/bench_comm");
  }
  return 0;
}

}  // namespace mok::cli
