// `mok`: the command-line program. `mok --help` lists the subcommands.
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <stdexcept>

#include "cli.hpp"
#include "mok/error.hpp"
#include "mok/version.hpp"

namespace {

constexpr const char* kUsage = R"(mok — deterministic fused mixture-of-experts layer (forward + backward)

usage: mok <command> [options]

commands:
  demo    train a small student MoE layer to match a fixed random teacher layer on
          synthetic tokens, then train again and check the two runs are bitwise identical
            --steps N       training steps (default 300)
            --log-every N   progress line every N steps (default 25)
            --ep N          expert-parallel ranks (default 0 = every GPU on the GPU engine,
                            2 simulated ranks on the CPU reference)
            --tokens N      tokens per rank per step (default 128)
            --lr X          Adam learning rate (default 0.006)
            --seed N        seed of teacher, student and data (default 1)
            --engine E      auto | cpu | gpu (default auto: forward and backward on the
                            GPUs when a GPU is visible, else the CPU reference)
  bench   time one pass on every local GPU (EP = the GPUs; random data, uniform routing);
          prints the memory of the workspace and of one layer's context
            --pass P        forward | backward | step (default forward; step = schedule +
                            forward + backward)
            --shape S       dsv3 | qwen3 | gptoss (default dsv3)
            --tokens N      tokens per rank (default 0 = the shape's: 8192, 16384, 8192)
            --iters N       timed iterations after 3 warm-ups (default 10)
            --warm-ms X     steady-state runs before the timed ones, in ms (default 300: the
                            power-capped clock; 0 times right after the warm-ups)
            --macrobatch R  Config::macrobatch: routed rows kept resident (default 0 = all;
                            below the routed buffer the fused forward runs them through a ring)
            --forward-engine E   Config::forward_engine: fused | staged (default fused)
            --backward-engine E  Config::backward_engine: auto | fused | staged (default auto:
                                 the faster one for the gradient mode, fp32 main grads here)
            --precision P   Config::precision: bf16 | fp8 (default bf16; fp8 = fp8_block, the
                            block-scaled FP8 GEMMs: staged launches, weights quantized once
                            into an Fp8WeightCache before the timed runs)
  soak    training steps with fresh random routing every step (uniform, Zipf-skewed, all
          tokens to one expert, empty experts) on every local GPU: the fused and the staged
          forward, each with the GPU backward, compared bit for bit every step
            --steps N       steps (default 2000)
            --log-every N   progress line every N steps (default 250)
            --tokens N      tokens per rank (default 2048; the layer is H 1024, I 512,
                            I_shared 512, E 32, top-4)
            --seed N        seed of the routing and data (default 1)
            --out FILE      also write the counts as a bench/results record (JSON)
  info    what this build contains: engine, the engines and the precision Config's defaults
          run, GPUs, NCCL
  help    this text (also --help, -h)
  version print the version

docs: README.md and docs/ in the source tree.
)";

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  const std::string cmd = argv[1];
  std::vector<std::string> rest(argv + 2, argv + argc);
  try {
    if (cmd == "help" || cmd == "--help" || cmd == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (cmd == "version" || cmd == "--version") {
      std::printf("mok %s\n", mok::kVersion);
      return 0;
    }
    if (cmd == "info") return mok::cli::run_info();
    if (cmd == "demo") {
      return mok::cli::run_demo(mok::cli::Options(
          rest, {{"steps", "300"}, {"log-every", "25"}, {"ep", "0"}, {"tokens", "128"}, {"lr", "0.006"},
                 {"seed", "1"}, {"engine", "auto"}}));
    }
    if (cmd == "bench") {
      return mok::cli::run_bench(mok::cli::Options(rest, {{"shape", "dsv3"}, {"pass", "forward"}, {"tokens", "0"}, {"iters", "10"}, {"warm-ms", "300"}, {"macrobatch", "0"},
                                                               {"forward-engine", "fused"}, {"backward-engine", "auto"},
                                                               {"precision", "bf16"}}));
    }
    if (cmd == "soak") {
      return mok::cli::run_soak(
          mok::cli::Options(rest, {{"steps", "2000"}, {"log-every", "250"}, {"seed", "1"}, {"tokens", "2048"}, {"out", ""}}));
    }
    std::fprintf(stderr, "mok: unknown command '%s' (expected demo, bench, soak, info, help or version)\n", cmd.c_str());
    return 2;
  } catch (const mok::Error& e) {
    std::fprintf(stderr, "mok %s: error (%s): %s\n", cmd.c_str(), mok::status_name(e.status()), e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mok %s: error: %s\n", cmd.c_str(), e.what());
    return 1;
  }
}
