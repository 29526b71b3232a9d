// bench_backward: mok's backward pass per rank on every local GPU (EP = the GPUs used, one
// thread per GPU) for the model shapes dsv3, qwen3, gptoss (mok::dsv3_shape, ...), side by side in one run:
//   bwd_ms               the backward mok::backward runs (bwd_path: Config::backward_engine's default for --grad-mode)
//   bwd_fused_ms         the fused backward (its dgrad chain, the dy / dx / d topk_w traffic and the
//                        weight gradients as one persistent kernel, fused_backward.hpp)
//   bwd_fused_wgrad_after_ms  the same with the weight gradients as launches after the kernel
//                        (FusedBackwardOptions::wgrad_in_kernel false)
//   bwd_staged_ms        the staged backward (the fused backward's oracle: the steps as separate
//                        launches); f==s: the fused dx equals the staged one bit for bit
//   bwd_gemms_alone_ms   only the backward's grouped GEMMs (shared + routed dh + SwiGLU backward,
//                        dx, K-grouped weight gradients) on the rows already pulled, every SM;
//                        bwd_gemm_<kind>_ms each kind alone (wgrad_bf16: the routed weight
//                        gradients written bf16 instead of added into fp32)
//   bwd_unfused_ms       what a careful user builds without fusion: permute + NCCL all-to-all of the
//                        dy rows, mok's standalone GEMM kinds (the same as above, with the hs
//                        rebuild), permute + all-to-all of the dx rows back, mok's fixed-order sum.
//                        Favoured: index maps, row weights and x rows kept from the forward
//                        (computed once), and no d topk_w return trip
//   step_ms              schedule + fused forward + backward through the API (one training step of the layer)
//   cublas_dense_tflops  one cuBLAS bf16 GEMM of the backward's FLOPs ([2M, 3I] x [3I, H])
//   context_bytes, workspace_bytes  Context::bytes, Workspace::device_bytes
// useful TFLOP/s = 2 x the forward's useful FLOPs per rank / time (recompute not counted).
// staged, fused, fused with the weight gradients after, GEMMs alone and unfused are timed
// interleaved in one loop (bench::time_interleaved_ms), so every ratio between them is taken at
// the same clock; their bits are checked after it, untimed, on a NaN-poisoned dx.
// Steady state and medians as bench_forward (bench_timing.hpp); the slowest rank's median is
// reported. Bitwise: the unfused baseline's dx equals the staged backward's (same GEMM tiles,
// same sum); dx_hash (FNV-1a 64 of mok::backward's dx) compares builds.
//
//   bench_backward [--shapes dsv3,qwen3,gptoss] [--iters 10] [--warmup 3] [--warm-ms 300]
//                  [--tokens N] [--ep N] [--grad-mode fp32|bf16] [--fused-comm N] [--trace PREFIX]
//                  [--concurrent-probe G1,G2,..] [--out bench/results/2026-12-03-backward.json]
// --concurrent-probe: would the dgrad GEMMs (dh, dx) and the weight-gradient GEMMs gain from
// running at the same time on disjoint SMs (what fusing the weight gradients into the kernel
// would do)? Per G: the dgrad kinds on G SMs beside the weight-gradient kinds (--grad-mode) on
// the other SMs, two streams, against each on the whole grid one after the other (printed only;
// docs/experiments.md has the answers).
// --grad-mode (default fp32): weight gradients added into fp32 main grads, or written bf16. At EP 1
// every expert's gradient is on one GPU (dsv3: 11.3 G parameters): fp32 adds read and write
// 90 GB per pass there, a floor of ~19 ms at the H200's ~4.8 TB/s.
#include <nccl.h>

#include <algorithm>
#include <barrier>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "bench_record.hpp"
#include "bench_timing.hpp"
#include "bench_unfused.cuh"
#include "comm/cuda_check.hpp"
#include "host/workspace_impl.hpp"
#include "support/bench_support.hpp"
#include "megakernel/fused_backward.hpp"
#include "megakernel/fused_forward.hpp"
#include "megakernel/staged_backward.hpp"
#include "mok/api.hpp"
#include "mok/bootstrap.hpp"

namespace {

using namespace mok;
using bench::gather_rows;
using bench::time_ms;
using bench::fnv1a64;
using bench::split;

struct Options {
  std::vector<std::string> shapes{"dsv3", "qwen3", "gptoss"};
  int iters = 10, warmup = 3;
  double warm_ms = 300;
  int64_t tokens = 0;
  int ep = 0;
  GradMode mode = GradMode::kAccumulateFp32;  // --grad-mode fp32 (add into fp32 main grads) | bf16 (write)
  int fused_comm = 0;  // --fused-comm N: the fused backward kernel's comm CTAs (0: as mok::backward picks them)
  std::vector<int> probe;  // --concurrent-probe G1,G2,..: dgrad kinds on G SMs beside the wgrad kinds on the rest
  std::string trace;   // --trace PREFIX: one more fused backward, its trace to PREFIX-<shape>-r<rank>.bin
  std::string out = "bench_backward.json";
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--shapes") o.shapes = split(v);
    else if (k == "--iters") o.iters = std::stoi(v);
    else if (k == "--warmup") o.warmup = std::stoi(v);
    else if (k == "--warm-ms") o.warm_ms = std::stod(v);
    else if (k == "--tokens") o.tokens = std::stoll(v);
    else if (k == "--fused-comm") o.fused_comm = std::stoi(v);
    else if (k == "--trace") o.trace = v;
    else if (k == "--concurrent-probe") {
      for (const auto& g : split(v)) o.probe.push_back(std::stoi(g));
    }
    else if (k == "--ep") o.ep = std::stoi(v);
    else if (k == "--out") o.out = v;
    else if (k == "--grad-mode") {
      if (v != "fp32" && v != "bf16") {
        std::fprintf(stderr, "bench_backward: --grad-mode: expected fp32 or bf16, got %s\n", v.c_str());
        std::exit(2);
      }
      o.mode = v == "bf16" ? GradMode::kWriteBf16 : GradMode::kAccumulateFp32;
    }
    else {
      std::fprintf(stderr, "bench_backward: unknown option %s\n", k.c_str());
      std::exit(2);
    }
  }
  return o;
}

// The unfused backward: dy rows out and dx rows back through NCCL all-to-all around mok's GEMMs.
struct Unfused : bench::UnfusedMaps {
  using UnfusedMaps::UnfusedMaps;
  void run(Workspace& ws, const BackwardArgs& a, const ExpertWeights& w, const WeightGrads& g, ncclComm_t comm,
           cudaStream_t st) {
    Workspace::Impl& impl = ws.impl();
    comm::CommState& state = *impl.state;
    megakernel::BackwardBuffers& bb = *impl.backward;
    const LayerShape& s = state.shape();
    const int64_t row_bytes = s.hidden * 2;
    gather_rows(send.get(), a.dy, send_map.get(), total_send, row_bytes, st);
    all_to_all(send.get(), send_rows, recv.get(), recv_rows, row_bytes, comm, st);
    gather_rows(bb.dy_rows.get(), recv.get(), unpack_map.get(), padded_rows, row_bytes, st);
    if (s.has_shared()) {
      MOK_CUDA_CHECK(cudaMemcpyAsync(bb.shared_dy.get(), a.dy, s.tokens * row_bytes, cudaMemcpyDeviceToDevice, st));
    }
    megakernel::StagedBackwardOptions o;  // GEMMs on every SM
    megakernel::backward_gemms(state, *impl.forward, bb, impl.own_context->impl().saved, w, g, o, true, st);
    gather_rows(back.get(), bb.dx_rows.get(), back_map.get(), total_recv, row_bytes, st);
    all_to_all(back.get(), recv_rows, recv_back.get(), send_rows, row_bytes, comm, st);
    gather_rows(state.window_local() + state.layout().slots, recv_back.get(), slot_map.get(), s.tokens * s.topk,
                row_bytes, st);
    state.epilogue(bb.ones.get(), s.has_shared() ? bb.shared_dx.get() : nullptr, nullptr, a.dx, st);
  }
};

// The backward's GEMMs one kind at a time (bwd_gemm_<name>_ms), the weight gradients in both modes.
struct Part {
  const char* name;
  unsigned mask;
  bool bf16;  // weight gradients written bf16 (else as --grad-mode)
};
const Part kParts[] = {{"shared_dh", megakernel::kSharedDh, false},       {"shared_dx", megakernel::kSharedDx, false},
                       {"shared_wgrad", megakernel::kSharedWgrad, false}, {"dh", megakernel::kRoutedDh, false},
                       {"dx", megakernel::kRoutedDx, false},              {"wgrad", megakernel::kRoutedWgrad, false},
                       {"wgrad_bf16", megakernel::kRoutedWgrad, true}};
constexpr int kNumParts = sizeof(kParts) / sizeof(kParts[0]);

struct RankResult {
  double part_ms[kNumParts] = {};
  double fused_after_ms = 0;
  double fused_ms = 0, staged_ms = 0, gemms_ms = 0, unfused_ms = 0, step_ms = 0, cublas_ms = 0, cublas_flops = 0;
  int64_t unfused_vs_staged = -1, fused_vs_staged = -1;
  uint64_t dx_hash = 0;
  size_t context_bytes = 0, workspace_bytes = 0;
  int fused_comm = 0;
  bool fused_default = false;  // mok::backward runs the fused backward
  bool wgrad_in_kernel = true;  // ... with its weight gradients in the kernel (else fused_after_ms)
};

RankResult run_shape(const Options& o, const std::string& name, const LayerShape& s,
                     const std::vector<std::vector<int32_t>>& routing,
                     bootstrap::LocalRank& lr, std::barrier<>& sync) {
  RankResult res;
  Config cfg;  // capacity 2.0, automatic minibatch
  auto ws = Workspace::create(s, cfg, lr.comm, lr.device);
  Workspace::Impl& impl = ws->impl();
  cudaStream_t st;
  MOK_CUDA_CHECK(cudaStreamCreate(&st));
  bench::RandomLayer L(s, lr.rank, routing[lr.rank], 7);
  const ExpertWeights w = L.weights();
  const size_t TH = size_t(s.tokens) * s.hidden, TK = size_t(s.tokens) * s.topk;
  comm::DeviceBuffer<bf16> dy(TH), dx(TH);
  comm::DeviceBuffer<float> dtopk(TK);
  bench::fill_random_bf16(dy.get(), TH, 11 + lr.rank, 1e-2f, st);
  // The gradient buffers, in floats: fp32 main grads, or bf16 (2 bytes an element) with --grad-mode
  // bf16, so that dsv3 at EP 1 (11.3 G routed parameters) fits an 80 GB card in bf16 mode.
  const size_t el = o.mode == GradMode::kWriteBf16 ? 2 : 4;
  auto floats = [&](size_t elements) { return (elements * el + sizeof(float) - 1) / sizeof(float); };
  const size_t routed = floats(size_t(s.local_experts()) * s.intermediate * s.hidden),
               shared = floats(size_t(s.shared_intermediate) * s.hidden);
  comm::DeviceBuffer<float> gg(routed), gu(routed), gd(routed), sg(shared), su(shared), sd(shared);
  for (auto* b : {&gg, &gu, &gd, &sg, &su, &sd}) {
    if (b->bytes()) MOK_CUDA_CHECK(cudaMemsetAsync(b->get(), 0, b->bytes(), st));
  }
  const WeightGrads grads{o.mode, gg.get(), gu.get(), gd.get(), sg.get(), su.get(), sd.get()};
  const BackwardArgs bargs{L.x.get(), L.topk_w.get(), dy.get(), dx.get(), dtopk.get()};
  res.context_bytes = Context::bytes(s, cfg);
  res.workspace_bytes = ws->device_bytes();

  // One step through the API: the context the timed backwards below replay.
  schedule(*ws, L.topk_idx.get(), st);
  forward(*ws, L.args(), w, st);
  backward(*ws, bargs, w, grads, st);
  ws->check();
  res.dx_hash = fnv1a64(dx.get(), dx.bytes(), st);

  megakernel::StagedBackwardOptions so;
  so.comm_ctas = cfg.effective_comm_sms_backward(s, comm::device_sms());  // as mok::backward picks it
  so.timeout_s = cfg.wait_timeout_s;
  const megakernel::SavedContext& saved = impl.own_context->impl().saved;
  megakernel::FusedBackwardOptions fo;  // as mok::backward picks them
  fo.comm_ctas = o.fused_comm > 0 ? o.fused_comm : cfg.effective_comm_sms_fused_backward(s, comm::device_sms());
  fo.timeout_s = cfg.wait_timeout_s;
  fo.prologue_ctas = so.comm_ctas;
  fo.wgrad_in_kernel = true;
  megakernel::FusedBackwardOptions after = fo;  // the weight gradients as launches after the kernel
  after.wgrad_in_kernel = false;
  res.wgrad_in_kernel = impl.fused_wgrad_in_kernel;
  res.fused_comm = fo.comm_ctas;
  res.fused_default = cfg.effective_backward_engine(o.mode == GradMode::kAccumulateFp32) == BackwardEngine::kFused;
  Unfused base = [&] {  // index maps from the forward's schedule (computed once: favoured)
    comm::ScheduleHeader h{};
    MOK_CUDA_CHECK(cudaMemcpy(&h, saved.schedule.header, sizeof(h), cudaMemcpyDeviceToHost));
    std::vector<comm::RowEntry> rows(h.padded_rows);
    MOK_CUDA_CHECK(cudaMemcpy(rows.data(), saved.schedule.rows, rows.size() * sizeof(comm::RowEntry),
                              cudaMemcpyDeviceToHost));
    return Unfused(s, lr.rank, routing, rows);
  }();
  // The forms of the backward compared by the ratios, timed interleaved (time_interleaved_ms):
  // one after the other in separate loops, the second of two fused timings read 1.5-2.5 ms off at
  // dsv3 / gptoss whichever it was (2026-12-04, bench/results/...-in-kernel-0d27ac6.txt). Each
  // is a whole backward on the same context (the GEMMs alone read the rows the one before it left;
  // the unfused baseline the x rows and row weights).
  enum Form { kStaged, kFused, kFusedAfter, kGemms, kUnfused, kForms };
  const std::vector<double> ms = bench::time_interleaved_ms(o, sync, st, kForms, [&](int j) {
    switch (j) {
      case kStaged:
        megakernel::staged_backward(*impl.state, *impl.forward, *impl.backward, saved, bargs, w, grads, so, st);
        break;
      case kFused:
        megakernel::fused_backward(*impl.state, *impl.forward, *impl.backward, saved, bargs, w, grads, fo, st);
        break;
      case kFusedAfter:
        megakernel::fused_backward(*impl.state, *impl.forward, *impl.backward, saved, bargs, w, grads, after, st);
        break;
      case kGemms:
        megakernel::backward_gemms(*impl.state, *impl.forward, *impl.backward, saved, w, grads,
                                   megakernel::StagedBackwardOptions{}, false, st);
        break;
      default:
        base.run(*ws, bargs, w, grads, lr.comm, st);
    }
  });
  ws->check();
  res.staged_ms = ms[kStaged];
  res.fused_ms = ms[kFused];
  res.fused_after_ms = ms[kFusedAfter];
  res.gemms_ms = ms[kGemms];
  res.unfused_ms = ms[kUnfused];
  // Bits, untimed: each form's dx against the staged one (poisoned in between).
  comm::DeviceBuffer<bf16> dx_staged(TH);
  megakernel::staged_backward(*impl.state, *impl.forward, *impl.backward, saved, bargs, w, grads, so, st);
  ws->check();
  MOK_CUDA_CHECK(cudaMemcpyAsync(dx_staged.get(), dx.get(), dx.bytes(), cudaMemcpyDeviceToDevice, st));
  auto mismatches = [&](auto run_form) {
    MOK_CUDA_CHECK(cudaMemsetAsync(dx.get(), 0xff, dx.bytes(), st));  // NaN
    run_form();
    ws->check();
    return bench::count_mismatches(dx_staged.get(), dx.get(), dx.size(), st);
  };
  res.fused_vs_staged = mismatches([&] {
    megakernel::fused_backward(*impl.state, *impl.forward, *impl.backward, saved, bargs, w, grads, fo, st);
  });
  res.fused_vs_staged += mismatches([&] {
    megakernel::fused_backward(*impl.state, *impl.forward, *impl.backward, saved, bargs, w, grads, after, st);
  });
  res.unfused_vs_staged = mismatches([&] { base.run(*ws, bargs, w, grads, lr.comm, st); });
  if (!o.trace.empty()) {  // (a -DMOK_FORWARD_TRACE build: main refuses --trace otherwise)
    megakernel::FusedBackwardOptions traced = impl.fused_wgrad_in_kernel ? fo : after;
    sync.arrive_and_wait();
    megakernel::fused_backward(*impl.state, *impl.forward, *impl.backward, saved, bargs, w, grads, traced, st);
    ws->check();
    megakernel::forward_trace_dump(o.trace + "-" + name + "-r" + std::to_string(lr.rank) + ".bin");
  }
  if (!o.probe.empty()) {
    using namespace megakernel;
    const unsigned dgrad = kRoutedDh | kRoutedDx | (s.has_shared() ? kSharedDh | kSharedDx : 0u);
    const unsigned wgrad = kRoutedWgrad | (s.has_shared() ? kSharedWgrad : 0u);
    cudaStream_t st2;
    cudaEvent_t e0, e1;
    MOK_CUDA_CHECK(cudaStreamCreateWithFlags(&st2, cudaStreamNonBlocking));
    MOK_CUDA_CHECK(cudaEventCreateWithFlags(&e0, cudaEventDisableTiming));
    MOK_CUDA_CHECK(cudaEventCreateWithFlags(&e1, cudaEventDisableTiming));
    auto run = [&](unsigned mask, int grid, cudaStream_t q) {
      StagedBackwardOptions g;
      g.gemm_grid = grid;
      backward_gemms(*impl.state, *impl.forward, *impl.backward, saved, w, grads, g, false, q, mask);
    };
    const int sms = comm::device_sms();
    const double dg = time_ms(o, sync, st, [&] { run(dgrad, 0, st); });
    const double wg = time_ms(o, sync, st, [&] { run(wgrad, 0, st); });
    std::printf("%-7s probe (%s grads): dgrad alone %.3f ms, wgrad alone %.3f ms, sum %.3f\n", name.c_str(),
                o.mode == GradMode::kWriteBf16 ? "bf16" : "fp32", dg, wg, dg + wg);
    for (int G : o.probe) {
      const double a = time_ms(o, sync, st, [&] { run(dgrad, G, st); });
      const double b = time_ms(o, sync, st, [&] { run(wgrad, sms - G, st); });
      const double both = time_ms(o, sync, st, [&] {
        MOK_CUDA_CHECK(cudaEventRecord(e0, st));
        MOK_CUDA_CHECK(cudaStreamWaitEvent(st2, e0));
        run(dgrad, G, st);
        run(wgrad, sms - G, st2);
        MOK_CUDA_CHECK(cudaEventRecord(e1, st2));
        MOK_CUDA_CHECK(cudaStreamWaitEvent(st, e1));
      });
      std::printf("%-7s probe: dgrad on %d SMs %.3f ms, wgrad on %d SMs %.3f ms, both at once %.3f ms (%.3fx the sum of "
                  "the full-grid times)\n",
                  name.c_str(), G, a, sms - G, b, both, both / (dg + wg));
    }
    ws->check();
    MOK_CUDA_CHECK(cudaEventDestroy(e0));
    MOK_CUDA_CHECK(cudaEventDestroy(e1));
    MOK_CUDA_CHECK(cudaStreamDestroy(st2));
  }
  const WeightGrads grads_bf16{GradMode::kWriteBf16, gg.get(), gu.get(), gd.get(), sg.get(), su.get(), sd.get()};
  for (int p = 0; p < kNumParts; ++p) {
    if ((kParts[p].mask & (megakernel::kSharedDh | megakernel::kSharedDx | megakernel::kSharedWgrad)) && !s.has_shared()) {
      continue;
    }
    res.part_ms[p] = time_ms(o, sync, st, [&] {
      megakernel::backward_gemms(*impl.state, *impl.forward, *impl.backward, saved, w, kParts[p].bf16 ? grads_bf16 : grads,
                                 megakernel::StagedBackwardOptions{}, false, st, kParts[p].mask);
    });
  }
  ws->check();
  res.step_ms = time_ms(o, sync, st, [&] {
    schedule(*ws, L.topk_idx.get(), st);
    forward(*ws, L.args(), w, st);
    backward(*ws, bargs, w, grads, st);
  });
  ws->check();
  {  // cuBLAS dense GEMM of (about) the backward's FLOPs
    const bench::DenseTiming d = bench::cublas_dense(o, sync, st, s, 2.0 * s.forward_flops());
    res.cublas_ms = d.ms;
    res.cublas_flops = d.flops;
  }
  MOK_CUDA_CHECK(cudaStreamSynchronize(st));
  sync.arrive_and_wait();  // nobody frees its window while a peer may still read it
  MOK_CUDA_CHECK(cudaStreamDestroy(st));
  return res;
}

std::string fmt(double v) {
  char b[64];
  std::snprintf(b, sizeof b, "%.4f", v);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  if (!o.trace.empty() && !megakernel::forward_trace_enabled()) {
    std::fprintf(stderr, "bench_backward: --trace needs a build with -DMOK_FORWARD_TRACE=ON (cmake option)\n");
    return 2;
  }
  const int gpus = bootstrap::local_device_count();
  if (gpus < 1) {
    std::printf("bench_backward: no CUDA device visible, nothing measured\n");
    return 0;
  }
  const int ep = o.ep > 0 ? std::min(o.ep, gpus) : gpus;
  for (int G : o.probe) {
    if (G < 1 || G >= comm::device_sms()) {
      std::fprintf(stderr, "bench_backward: --concurrent-probe: expected SM counts in [1, %d), got %d\n",
                   comm::device_sms(), G);
      return 2;
    }
  }
  std::vector<LayerShape> shapes;
  std::vector<std::vector<std::vector<int32_t>>> routings;
  for (const auto& name : o.shapes) {
    shapes.push_back(bench::bench_shape(name, ep, o.tokens));
    routings.push_back(bench::uniform_routing(shapes.back(), 2026));
  }
  std::vector<std::vector<RankResult>> res(shapes.size(), std::vector<RankResult>(ep));
  std::barrier<> sync(ep);
  std::vector<int> devices(ep);
  for (int i = 0; i < ep; ++i) devices[i] = i;
  bootstrap::run_local_ranks(devices, [&](bootstrap::LocalRank& lr) {
    for (size_t i = 0; i < shapes.size(); ++i) res[i][lr.rank] = run_shape(o, o.shapes[i], shapes[i], routings[i], lr, sync);
  });
  std::ostringstream results;
  std::printf("bench_backward: EP=%d (%d GPU(s) visible), per rank, slowest rank's median of %d; bwd = %s; "
              "weight gradients %s\n",
              ep, gpus, o.iters, res.empty() || !res[0][0].fused_default ? "staged" : "fused", o.mode == GradMode::kWriteBf16 ? "written bf16" : "added into fp32");
  std::printf("%-7s %9s %9s %9s %9s %9s %9s %9s %9s %9s %9s %9s %6s %6s\n", "shape", "bwd_ms", "TFLOP/s", "of_cublas",
              "gemms", "bwd/gemm", "fused", "fus_aft", "staged", "unfused", "unf/bwd", "step_ms", "f==s", "u==s");
  for (size_t i = 0; i < shapes.size(); ++i) {
    const LayerShape& s = shapes[i];
    auto worst = [&](auto get) {
      double m = 0;
      for (const auto& r : res[i]) m = std::max(m, get(r));
      return m;
    };
    const double flops = 2.0 * s.forward_flops();
    const double fused = worst([](const RankResult& r) { return r.fused_ms; });
    const double staged = worst([](const RankResult& r) { return r.staged_ms; });
    const double fused_after = worst([](const RankResult& r) { return r.fused_after_ms; });
    const bool fused_default = res[i][0].fused_default;
    const double bwd = !fused_default ? staged : res[i][0].wgrad_in_kernel ? fused : fused_after;
    const double gemms = worst([](const RankResult& r) { return r.gemms_ms; });
    const double unfused = worst([](const RankResult& r) { return r.unfused_ms; });
    const double step = worst([](const RankResult& r) { return r.step_ms; });
    const double cublas_tf = res[i][0].cublas_flops / worst([](const RankResult& r) { return r.cublas_ms; }) / 1e9;
    bool us = true;
    bool fs = true;
    for (const auto& r : res[i]) us &= r.unfused_vs_staged == 0;
    for (const auto& r : res[i]) fs &= r.fused_vs_staged == 0;
    const double tf = flops / bwd / 1e9;
    std::printf("%-7s %9.3f %9.1f %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %6s %6s\n", o.shapes[i].c_str(),
                bwd, tf, tf / cublas_tf, gemms, bwd / gemms, fused, fused_after, staged, unfused, unfused / bwd, step,
                fs ? "yes" : "NO", us ? "yes" : "NO");
    std::ostringstream parts;
    std::printf("%-7s GEMMs one at a time (ms):", o.shapes[i].c_str());
    for (int p = 0; p < kNumParts; ++p) {
      const double ms = worst([&](const RankResult& r) { return r.part_ms[p]; });
      std::printf(" %s %.3f", kParts[p].name, ms);
      parts << ", \"bwd_gemm_" << kParts[p].name << "_ms\": " << fmt(ms);
    }
    std::printf("\n");
    char hash[32];
    std::snprintf(hash, sizeof(hash), "%016llx", static_cast<unsigned long long>(res[i][0].dx_hash));
    std::printf("%-7s dx_hash %s  fused comm CTAs %d  context %.1f MB  workspace %.1f MB  cuBLAS dense %.1f TFLOP/s\n", o.shapes[i].c_str(),
                hash, res[i][0].fused_comm, res[i][0].context_bytes / 1e6, res[i][0].workspace_bytes / 1e6, cublas_tf);
    results << (i ? ",\n  " : "") << "{\"bench\": \"backward\", \"shape\": \"" << o.shapes[i] << "\", \"ep\": " << ep
            << ", \"tokens_per_rank\": " << s.tokens << ", \"routing\": \"uniform\", \"warm_ms\": " << fmt(o.warm_ms)
            << ", \"bwd_path\": \"" << (fused_default ? "fused" : "staged") << "\", \"fused_comm_ctas\": " << res[i][0].fused_comm << ", \"grad_mode\": \"" << (o.mode == GradMode::kWriteBf16 ? "bf16" : "fp32")
            << "\", \"metrics\": {"
            << "\"bwd_ms\": " << fmt(bwd) << ", \"bwd_tflops\": " << fmt(tf) << ", \"bwd_gemms_alone_ms\": " << fmt(gemms)
            << ", \"bwd_unfused_ms\": " << fmt(unfused) << ", \"bwd_staged_ms\": " << fmt(staged)
            << ", \"bwd_fused_ms\": " << fmt(fused) << ", \"staged_over_fused\": " << fmt(staged / fused)
            << ", \"bwd_fused_wgrad_after_ms\": " << fmt(fused_after)
            << ", \"fused_dx_equals_staged\": " << (fs ? "true" : "false")
            << ", \"cublas_dense_tflops\": " << fmt(cublas_tf) << ", \"bwd_tflops_over_cublas\": " << fmt(tf / cublas_tf)
            << ", \"bwd_over_gemms_alone\": " << fmt(bwd / gemms) << ", \"unfused_over_bwd\": " << fmt(unfused / bwd)
            << ", \"unfused_dx_equals_staged\": " << (us ? "true" : "false") << ", \"context_bytes\": "
            << res[i][0].context_bytes << ", \"workspace_bytes\": " << res[i][0].workspace_bytes << ", \"dx_hash\": \""
            << hash << "\"" << parts.str() << "}},\n  {\"bench\": \"step\", \"shape\": \"" << o.shapes[i] << "\", \"ep\": " << ep
            << ", \"tokens_per_rank\": " << s.tokens << ", \"metrics\": {\"step_ms\": " << fmt(step) << "}}";
  }
  if (ep < 2) std::printf("NOTE: EP=1 (one GPU): no NVLink traffic\n");
  std::ofstream f(o.out);
  f << bench::record_envelope(bench::command_line(argc, argv), "[\n  " + results.str() + "\n]");
  std::printf("wrote %s\n", o.out.c_str());
  return f ? 0 : 1;
}
