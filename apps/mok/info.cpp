// `mok info` and `mok bench`.
#include <nccl.h>

#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/bench_timing.hpp"
#include "cli.hpp"
#include "comm/cuda_check.hpp"
#include "megakernel/bench_support.hpp"
#include "mok/api.hpp"
#include "mok/bootstrap.hpp"
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

// `mok bench`: schedule + forward of the --shape layer on every local GPU (EP = the GPUs), random
// data and uniform routing; per rank the median of --iters after 3 warm-ups and --warm-ms of
// steady-state runs (bench/bench_timing.hpp, as bench_forward times: at its power cap an H200
// runs these kernels at a lower clock than in the first launches after an idle phase; without
// the steady phase gptoss read 10 % and qwen3 5-7 % fast, docs/perf-log.md 2026-12-03), every
// iteration started on all ranks together. The full side-by-side benchmark is
// build/bin/bench_forward.
int run_bench(const Options& opts) {
  const std::string name = opts.str("shape");
  if (name != "dsv3" && name != "qwen3" && name != "gptoss") throw_invalid("--shape", "dsv3, qwen3 or gptoss", name);
  const int64_t tokens = opts.integer("tokens", 0, 1 << 24);
  const struct {
    int warmup, iters;
    double warm_ms;
  } timing{3, static_cast<int>(opts.integer("iters", 1, 1000)), opts.real("warm-ms", 0, 60000)};
  Config config;
  config.macrobatch = opts.integer("macrobatch", 0, int64_t{1} << 40);
  const int gpus = bootstrap::local_device_count();
  if (gpus < 1) throw Error(Status::kCudaError, "mok bench: no CUDA GPU visible (the forward runs on the GPU)");
  const LayerShape shape = megakernel::bench_shape(name, gpus, tokens);
  config.validate(shape);  // a bad --macrobatch names Config.macrobatch and the rows it takes
  const auto routing = megakernel::uniform_routing(shape, 2026);
  const char* path = std::getenv("MOK_FORWARD_PATH");
  const int64_t resident = config.resident_routed_rows(shape), all = config.buffer_rows_per_rank(shape);
  std::printf("mok bench: %s, EP=%d (every local GPU), %s forward (schedule + forward, Config defaults%s; median of %d "
              "after %.0f ms of steady state)\n",
              shape.to_string().c_str(), gpus, path && std::string(path) == "staged" ? "staged" : "fused",
              resident < all ? (", macrobatch ring of " + std::to_string(resident) + " of " + std::to_string(all) +
                                " routed rows").c_str()
                             : "",
              timing.iters, timing.warm_ms);
  std::vector<double> ms(gpus, 0.0);
  std::barrier<> sync(gpus);
  bootstrap::run_local_ranks(bootstrap::all_local_devices(), [&](bootstrap::LocalRank& r) {
    auto ws = Workspace::create(shape, config, r.comm, r.device);
    megakernel::RandomLayer layer(shape, r.rank, routing[r.rank], 7);
    cudaStream_t stream;
    MOK_CUDA_CHECK(cudaStreamCreate(&stream));
    const double t = bench::time_ms(timing, sync, stream, [&] {
      schedule(*ws, layer.topk_idx.get(), stream);
      forward(*ws, layer.args(), layer.weights(), stream);
    });
    ws->check();
    ms[r.rank] = t;
    MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
    sync.arrive_and_wait();  // no rank frees its window while a peer may still read it
    MOK_CUDA_CHECK(cudaStreamDestroy(stream));
  });
  const double flops = megakernel::forward_flops(shape);
  for (int r = 0; r < gpus; ++r) {
    std::printf("  rank %d: forward %.3f ms, %.1f useful TFLOP/s\n", r, ms[r], flops / ms[r] / 1e9);
  }
  return 0;
}

}  // namespace mok::cli
