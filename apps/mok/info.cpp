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
#include "comm/device_buffer.hpp"
#include "support/bench_support.hpp"
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
  const Config defaults;
  std::printf("engines (Config defaults): forward %s; backward %s = %s with fp32 main grads, %s with bf16 gradients\n",
              to_string(defaults.forward_engine), to_string(defaults.backward_engine),
              to_string(defaults.effective_backward_engine(true)), to_string(defaults.effective_backward_engine(false)));
  std::printf("precision (Config default): %s; fp8_block runs the expert GEMMs in block-scaled FP8 (weight gradients "
              "in %s by default; docs/fp8.md)\n",
              to_string(defaults.precision), defaults.fp8_weight_grads ? "FP8" : "bf16");
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

// `mok bench`: one pass of the --shape layer on every local GPU (EP = the GPUs), random data and
// uniform routing: --pass forward (schedule + forward), backward (the backward over a saved
// context; every timed run replays the same context) or step (schedule + forward + backward); per
// rank the median of --iters after 3 warm-ups and --warm-ms of steady-state runs
// (bench/bench_timing.hpp, as bench_forward times: at its power cap an H200 runs these kernels at
// a lower clock than in the first launches after an idle phase; without the steady phase gptoss
// read 10 % and qwen3 5-7 % fast, docs/perf-log.md 2026-12-03), every iteration started on all
// ranks together. Also prints the memory of the workspace and of one layer's context. --precision fp8
// runs Config::precision kFp8Block with the weights quantized once into an Fp8WeightCache before the
// timed runs (as training does once per optimizer step; that update is not timed) and also prints the
// cache's memory. The full side-by-side benchmarks are build/bin/bench_forward and bench_backward.
int run_bench(const Options& opts) {
  const std::string name = opts.str("shape");
  if (name != "dsv3" && name != "qwen3" && name != "gptoss") throw_invalid("--shape", "dsv3, qwen3 or gptoss", name);
  const std::string pass = opts.str("pass");
  if (pass != "forward" && pass != "backward" && pass != "step") {
    throw_invalid("--pass", "forward, backward or step", pass);
  }
  const int64_t tokens = opts.integer("tokens", 0, 1 << 24);
  const struct {
    int warmup, iters;
    double warm_ms;
  } timing{3, static_cast<int>(opts.integer("iters", 1, 1000)), opts.real("warm-ms", 0, 60000)};
  Config config;
  config.macrobatch = opts.integer("macrobatch", 0, int64_t{1} << 40);
  const std::string fe = opts.str("forward-engine"), be = opts.str("backward-engine");
  if (fe != "fused" && fe != "staged") throw_invalid("--forward-engine", "fused or staged", fe);
  if (be != "auto" && be != "fused" && be != "staged") throw_invalid("--backward-engine", "auto, fused or staged", be);
  config.forward_engine = fe == "staged" ? ForwardEngine::kStaged : ForwardEngine::kFused;
  config.backward_engine = be == "auto" ? BackwardEngine::kAuto : be == "fused" ? BackwardEngine::kFused : BackwardEngine::kStaged;
  const std::string precision = opts.str("precision");
  if (precision != "bf16" && precision != "fp8" && precision != "fp8_block") {
    throw_invalid("--precision", "bf16 or fp8 (also written fp8_block)", precision);
  }
  config.precision = precision == "bf16" ? Precision::kBf16 : Precision::kFp8Block;
  const bool fp8 = config.precision == Precision::kFp8Block;
  const int gpus = bootstrap::local_device_count();
  if (gpus < 1) throw Error(Status::kCudaError, "mok bench: no CUDA GPU visible (the layer runs on the GPU)");
  const LayerShape shape = bench::bench_shape(name, gpus, tokens);
  config.validate(shape);  // a bad --macrobatch (or a ring with fp8) names Config.macrobatch and the rows it takes
  const auto routing = bench::uniform_routing(shape, 2026);
  const char* fwd_path = to_string(config.forward_engine);
  const char* bwd_path = to_string(config.effective_backward_engine(true));  // the timed backward adds into fp32
  const int64_t resident = config.resident_routed_rows(shape), all = config.buffer_rows_per_rank(shape);
  // kFp8Block runs the staged launches whatever the engines say (config.hpp)
  if (fp8) fwd_path = bwd_path = "staged FP8";
  std::printf("mok bench: %s, EP=%d (every local GPU), pass %s (%s forward, %s backward; Config%s; "
              "median of %d after %.0f ms of steady state)\n",
              shape.to_string().c_str(), gpus, pass.c_str(), fwd_path, bwd_path,
              resident < all ? (", macrobatch ring of " + std::to_string(resident) + " of " + std::to_string(all) +
                                " routed rows").c_str()
                             : "",
              timing.iters, timing.warm_ms);
  std::vector<double> ms(gpus, 0.0);
  std::vector<size_t> ws_bytes(gpus, 0);
  std::barrier<> sync(gpus);
  bootstrap::run_local_ranks(bootstrap::all_local_devices(), [&](bootstrap::LocalRank& r) {
    auto ws = Workspace::create(shape, config, r.comm, r.device);
    ws_bytes[r.rank] = ws->device_bytes();
    bench::RandomLayer layer(shape, r.rank, routing[r.rank], 7);
    cudaStream_t stream;
    MOK_CUDA_CHECK(cudaStreamCreate(&stream));
    const size_t TH = size_t(shape.tokens) * shape.hidden;
    const size_t routed = size_t(shape.local_experts()) * shape.intermediate * shape.hidden;
    const size_t shared = size_t(shape.shared_intermediate) * shape.hidden;
    comm::DeviceBuffer<bf16> dy(TH), dx(TH);
    comm::DeviceBuffer<float> dtopk(size_t(shape.tokens) * shape.topk), gg(routed), gu(routed), gd(routed), sg(shared),
        su(shared), sd(shared);
    bench::fill_random_bf16(dy.get(), TH, 11 + r.rank, 1e-2f, stream);
    for (auto* b : {&gg, &gu, &gd, &sg, &su, &sd}) {
      if (b->bytes()) MOK_CUDA_CHECK(cudaMemsetAsync(b->get(), 0, b->bytes(), stream));
    }
    const WeightGrads grads{GradMode::kAccumulateFp32, gg.get(), gu.get(), gd.get(), sg.get(), su.get(), sd.get()};
    const BackwardArgs bargs{layer.x.get(), layer.topk_w.get(), dy.get(), dx.get(), dtopk.get()};
    ExpertWeights weights = layer.weights();
    std::unique_ptr<Fp8WeightCache> fp8_cache;
    if (fp8) {  // quantized once, before the timed runs: the weights do not change here
      fp8_cache = Fp8WeightCache::create(*ws, stream);
      fp8_cache->update(weights, stream);
      weights.fp8 = fp8_cache.get();
    }
    auto fwd = [&] {
      schedule(*ws, layer.topk_idx.get(), stream);
      forward(*ws, layer.args(), weights, stream);
    };
    double t = 0;
    if (pass == "forward") {
      t = bench::time_ms(timing, sync, stream, fwd);
    } else if (pass == "step") {
      t = bench::time_ms(timing, sync, stream, [&] {
        fwd();
        backward(*ws, bargs, weights, grads, stream);
      });
    } else {
      // backward alone: each timed run consumes a context, so each gets a fresh forward outside
      // the timed span (forward, then the events around the backward)
      std::vector<double> v;
      cudaEvent_t a, b;
      MOK_CUDA_CHECK(cudaEventCreate(&a));
      MOK_CUDA_CHECK(cudaEventCreate(&b));
      for (int i = 0; i < timing.warmup + timing.iters; ++i) {
        fwd();
        MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
        sync.arrive_and_wait();
        MOK_CUDA_CHECK(cudaEventRecord(a, stream));
        backward(*ws, bargs, weights, grads, stream);
        MOK_CUDA_CHECK(cudaEventRecord(b, stream));
        MOK_CUDA_CHECK(cudaEventSynchronize(b));
        float x = 0;
        MOK_CUDA_CHECK(cudaEventElapsedTime(&x, a, b));
        if (i >= timing.warmup) v.push_back(x);
      }
      cudaEventDestroy(a);
      cudaEventDestroy(b);
      t = bench::median(v);
    }
    ws->check();
    ms[r.rank] = t;
    MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
    sync.arrive_and_wait();  // no rank frees its window while a peer may still read it
    fp8_cache.reset();       // freed on the stream, before it goes
    MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
    MOK_CUDA_CHECK(cudaStreamDestroy(stream));
  });
  const double flops = shape.forward_flops() * (pass == "forward" ? 1.0 : pass == "backward" ? 2.0 : 3.0);
  for (int r = 0; r < gpus; ++r) {
    std::printf("  rank %d: %s %.3f ms, %.1f useful TFLOP/s\n", r, pass.c_str(), ms[r], flops / ms[r] / 1e9);
  }
  std::printf("  memory per rank: workspace %.1f MB (its own context included), each further layer's context %.1f MB",
              ws_bytes[0] / 1e6, Context::bytes(shape, config) / 1e6);
  if (fp8) std::printf(", each layer's FP8 weight copies %.1f MB", Fp8WeightCache::bytes(shape) / 1e6);
  std::printf("\n");
  return 0;
}

}  // namespace mok::cli
