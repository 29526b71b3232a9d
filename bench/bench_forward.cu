// bench_forward: mok's forward pass per rank on every local GPU (EP = the GPUs used, one
// thread per GPU, launch mode (a)) for the model shapes dsv3, qwen3, gptoss (mok::dsv3_shape, ...), side by side in one run:
//   fwd_ms               schedule + fused forward (one persistent kernel), best comm-CTA count of the sweep
//   staged_fwd_ms        schedule + the staged forward (the same steps as separate launches)
//   gemms_alone_ms       only the forward's grouped GEMMs (shared + routed), every SM, no communication
//   unfused_baseline_ms  what a careful user builds without fusion: mok's GPU schedule for the
//                        layout, permute kernels, NCCL all-to-all (grouped ncclSend/ncclRecv) of
//                        the token rows, mok's grouped GEMMs, permute, all-to-all back, mok's top-k sum
//   cublas_dense_tflops  one cuBLAS bf16 GEMM of the same FLOPs ([M, 3I] x [3I, H])
// useful TFLOP/s = (2*3*H*I*T*K + 2*3*H*I_sh*T) per rank / time. Every iteration starts on all
// ranks together (host barrier); CUDA events; median of --iters after --warmup and then
// --warm-ms (default 300) of the same op, so ours and cuBLAS are both timed in the steady state
// of the power-capped GPU (0: the cold timing of the earlier runs); the slowest rank's median is
// reported. Uniform random routing, random non-zero data. Bitwise checks at
// full size: fused y == staged y == baseline y (same GEMM tiles, same epilogue).
//
//   bench_forward [--shapes dsv3,qwen3,gptoss] [--comm 8,16,24,32] [--iters 10] [--warmup 3] [--warm-ms 300]
//                 [--minibatch rows (0 = automatic)] [--tokens N] [--ep N]
//                 [--fused-sum 0|1] [--join N] [--push 0|1] [--push-sum 0|1] [--sum-ctas S]
//                 [--macrobatch ROWS] [--ring-sum 0|1] [--alt-comm N]
//                 [--out bench/results/2026-11-30-forward.json] [--trace PREFIX]
//
// Variants of the undecided choices (FusedForwardOptions), each timed interleaved with the
// default at every comm count (A B / B A rounds) and its y compared with the default's bit for
// bit: --fused-sum 1 the top-k sum inside the fused kernel (fwd_fused_sum_ms); --join N
// join_gemm = N (at EP >= 2 capped at the comm count - 1; fwd_join_ms); --push 1 GEMM 2's
// epilogues pushing the combine's rows (fwd_push_ms); --push-sum 1 both (fwd_push_sum_ms);
// --sum-ctas S the fused sum with all but S comm CTAs joining (fwd_sum_ctas_ms). --macrobatch
// ROWS: the same layer on a second workspace with Config::macrobatch = ROWS (a multiple of the
// minibatch, >= two minibatches): the routed rows through a ring (fwd_macrobatch_ms; the routed
// buffers' bytes of both workspaces in routed_buffer_mb / macrobatch_buffer_mb); --ring-sum 1
// the ring with the fused sum (fwd_macrobatch_sum_ms). --alt-comm N: every variant at N comm
// CTAs whatever the sweep's count, and the default at N as one more (fwd_alt_comm_ms).
// y_hash: FNV-1a 64 of the default's y (the same inputs every run: the bits of two builds
// compare by it).
//
// The baseline is favoured: its index maps and per-peer counts are computed once on the host
// (a real step needs the counts on the host for ncclSend/ncclRecv, i.e. a device->host sync),
// and the shared expert reads x without a copy.
#include <nccl.h>

#include <algorithm>
#include <barrier>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
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
#include "megakernel/fused_forward.hpp"
#include "megakernel/staged_forward.hpp"
#include "mok/api.hpp"
#include "mok/bootstrap.hpp"

namespace {

using namespace mok;
using bench::median;
using bench::time_ms;
using bench::time_interleaved_ms;
using bench::gather_rows;
using bench::upload;
using bench::fnv1a64;
using bench::split;

struct Options {
  std::vector<std::string> shapes{"dsv3", "qwen3", "gptoss"};
  std::vector<int> comm{8, 16, 24, 32};
  int iters = 10, warmup = 3, ep = 0;
  double warm_ms = 300;  // steady state before each measurement (bench_timing.hpp)
  int64_t minibatch = 0;  // Config::minibatch (0: automatic)
  bool fused_sum = false, push = false, push_sum = false, ring_sum = false;
  bool join_variant = false;  // --join N given: also time the fused forward with FusedForwardOptions::join_gemm = N
  int join = -1;
  int sum_ctas = 0;           // --sum-ctas S (> 0): the fused sum with all but S comm CTAs joining
  int alt_comm = 0;           // --alt-comm N: the variants (and the default as one more) at N comm CTAs
  int64_t macrobatch = 0;     // --macrobatch ROWS: also time a workspace with Config::macrobatch = ROWS
  int64_t tokens = 0;
  std::string out = "bench/results/2026-11-30-forward.json";
  std::string trace;  // --trace PREFIX: after each comm count's timing, one more pass of the default and of each
                      // variant, written to PREFIX-<shape>[-<variant>]-c<C>-r<rank>.bin
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--shapes") o.shapes = split(v);
    else if (k == "--comm") {
      o.comm.clear();
      for (const auto& c : split(v)) o.comm.push_back(std::stoi(c));
    } else if (k == "--iters") o.iters = std::stoi(v);
    else if (k == "--warmup") o.warmup = std::stoi(v);
    else if (k == "--warm-ms") o.warm_ms = std::stod(v);
    else if (k == "--minibatch") o.minibatch = std::stoll(v);
    else if (k == "--macrobatch") o.macrobatch = std::stoll(v);
    else if (k == "--tokens") o.tokens = std::stoll(v);
    else if (k == "--ep") o.ep = std::stoi(v);
    else if (k == "--fused-sum") o.fused_sum = std::stoi(v) != 0;
    else if (k == "--push") o.push = std::stoi(v) != 0;
    else if (k == "--push-sum") o.push_sum = std::stoi(v) != 0;
    else if (k == "--ring-sum") o.ring_sum = std::stoi(v) != 0;
    else if (k == "--sum-ctas") o.sum_ctas = std::stoi(v);
    else if (k == "--alt-comm") o.alt_comm = std::stoi(v);
    else if (k == "--join") {
      o.join = std::stoi(v);
      o.join_variant = true;
    }
    else if (k == "--out") o.out = v;
    else if (k == "--trace") o.trace = v;
    else {
      std::fprintf(stderr, "bench_forward: unknown option %s\n", k.c_str());
      std::exit(2);
    }
  }
  if (!o.trace.empty() && !megakernel::forward_trace_enabled()) {
    std::fprintf(stderr, "bench_forward: --trace needs a build with -DMOK_FORWARD_TRACE=ON (cmake option)\n");
    std::exit(2);
  }
  return o;
}

// ---- timing ------------------------------------------------------------------------------------

// ---- the unfused baseline (index maps and all-to-all: bench_unfused.cuh) -------------------------
struct Baseline : bench::UnfusedMaps {
  using UnfusedMaps::UnfusedMaps;

  void run(Workspace& ws, const bench::RandomLayer& L, ncclComm_t comm, cudaStream_t st) {
    Workspace::Impl& impl = ws.impl();
    comm::CommState& state = *impl.state;
    megakernel::ForwardBuffers& b = *impl.forward;
    const LayerShape& s = state.shape();
    const int64_t row_bytes = s.hidden * 2;
    schedule(ws, L.topk_idx.get(), st);  // the layout (mok's GPU schedule)
    megakernel::convert_segments(state, b, st);
    gather_rows(send.get(), L.x.get(), send_map.get(), total_send, row_bytes, st);
    all_to_all(send.get(), send_rows, recv.get(), recv_rows, row_bytes, comm, st);
    gather_rows(state.row_buffer(), recv.get(), unpack_map.get(), padded_rows, row_bytes, st);
    megakernel::StagedForwardOptions o;  // GEMMs on every SM
    megakernel::forward_gemms_only(state, b, L.weights(), o, impl.own_context->impl().saved, st);
    gather_rows(back.get(), b.expert_out.get(), back_map.get(), total_recv, row_bytes, st);
    all_to_all(back.get(), recv_rows, recv_back.get(), send_rows, row_bytes, comm, st);
    gather_rows(state.window_local() + state.layout().slots, recv_back.get(), slot_map.get(), s.tokens * s.topk,
                row_bytes, st);
    state.epilogue(L.topk_w.get(), s.has_shared() ? b.shared_out.get() : nullptr, nullptr, L.y.get(), st);
  }
};

// ---- one rank, one shape ---------------------------------------------------------------------------
struct RankResult {
  std::map<int, double> fused_ms;  // comm CTAs -> ms
  std::map<int, double> fused_sum_ms;  // top-k sum inside the fused kernel (--fused-sum 1)
  std::map<int, double> fused_join_ms;  // comm CTAs taking GEMM tasks (--join N)
  std::map<int, double> fused_push_ms;      // GEMM 2's epilogues pushing the combine's rows (--push 1)
  std::map<int, double> fused_alt_comm_ms;  // the default at --alt-comm N comm CTAs
  std::map<int, double> fused_macrobatch_ms;  // a workspace with the macrobatch ring (--macrobatch ROWS)
  std::map<int, double> fused_push_sum_ms;      // --push with the fused top-k sum (--push-sum 1)
  std::map<int, double> fused_macrobatch_sum_ms;  // the ring with the fused top-k sum (--ring-sum 1)
  std::map<int, double> fused_sum_ctas_ms;        // the fused sum, S comm CTAs not joining (--sum-ctas S)
  double routed_buffer_mb = 0, macrobatch_buffer_mb = 0;  // row buffer + h, g, u + expert_out, MB
  double staged_ms = 0, gemms_ms = 0, baseline_ms = 0, cublas_ms = 0, cublas_flops = 0;
  int64_t minibatch = 0;  // the routed rows per overlap step the pass used (Config::minibatch resolved)
  int64_t fused_vs_staged = -1, baseline_vs_fused = -1;  // mismatching elements of y
  int64_t variants_vs_fused = 0;  // mismatching elements of y over every variant's pass
  uint64_t y_hash = 0;            // FNV-1a 64 of the default's y
};

RankResult run_shape(const Options& o, const std::string& name, const LayerShape& s,
                     const std::vector<std::vector<int32_t>>& routing, bootstrap::LocalRank& lr, std::barrier<>& sync) {
  RankResult res;
  Config cfg;  // capacity 2.0
  cfg.minibatch = o.minibatch;  // 0: the automatic minibatch
  auto ws = Workspace::create(s, cfg, lr.comm, lr.device);
  Workspace::Impl& impl = ws->impl();
  comm::CommState& state = *impl.state;
  res.minibatch = state.view().minibatch;
  megakernel::ForwardBuffers& buf = *impl.forward;
  cudaStream_t st;
  MOK_CUDA_CHECK(cudaStreamCreate(&st));
  bench::RandomLayer L(s, lr.rank, routing[lr.rank], 7);
  const ExpertWeights w = L.weights();
  const ForwardArgs args = L.args();
  comm::DeviceBuffer<bf16> y_ref(s.tokens * s.hidden);
  // --macrobatch: the same layer on a workspace whose routed buffers are the ring (collective).
  std::unique_ptr<Workspace> ring_ws;
  auto routed_mb = [&](Workspace& W) {
    const megakernel::ForwardBuffers& b = *W.impl().forward;
    // g, u: the ring's, or (without it) the saved ones in the layer's context
    const double gu = b.ring() ? double(b.g.bytes() + b.u.bytes()) : 2.0 * b.buffer_rows * s.intermediate * 2;
    return (W.impl().state->row_buffer_rows() * s.hidden * 2.0 + b.h.bytes() + gu + b.expert_out.bytes()) / 1e6;
  };
  res.routed_buffer_mb = routed_mb(*ws);
  if (o.macrobatch > 0) {
    Config rc = cfg;
    rc.macrobatch = o.macrobatch;
    ring_ws = Workspace::create(s, rc, lr.comm, lr.device);
    res.macrobatch_buffer_mb = routed_mb(*ring_ws);
  }

  // Fused, sweeping the communication CTAs. At each comm count the default and the variants on
  // are timed with their runs interleaved in A B / B A rounds (timing one after the other read
  // the second slow, whichever it was: docs/megakernel.md), and each variant's y is compared with
  // the default's.
  using Configure = void (*)(megakernel::FusedForwardOptions&, const Options&);
  struct Mode {
    bool on;
    std::map<int, double>* ms;
    Configure configure;
    const char* tag;  // trace file name part ("" for the default)
    bool ring = false;  // runs on ring_ws (--macrobatch)
  };
  const Mode modes[] = {
      {true, &res.fused_ms, [](megakernel::FusedForwardOptions&, const Options&) {}, ""},
      {o.fused_sum, &res.fused_sum_ms,
       [](megakernel::FusedForwardOptions& fo, const Options&) { fo.fused_topk_sum = true; }, "-fused-sum"},
      {o.join_variant, &res.fused_join_ms,
       [](megakernel::FusedForwardOptions& fo, const Options& op) { fo.join_gemm = op.join; }, "-join"},
      {o.push, &res.fused_push_ms,
       [](megakernel::FusedForwardOptions& fo, const Options&) { fo.epilogue_push = 1; }, "-push"},
      {o.alt_comm > 0, &res.fused_alt_comm_ms, [](megakernel::FusedForwardOptions&, const Options&) {}, "-alt-comm"},
      {o.macrobatch > 0, &res.fused_macrobatch_ms, [](megakernel::FusedForwardOptions&, const Options&) {},
       "-macrobatch", true},
      {o.push_sum, &res.fused_push_sum_ms,
       [](megakernel::FusedForwardOptions& fo, const Options&) {
         fo.epilogue_push = 1;
         fo.fused_topk_sum = true;
       },
       "-push-sum"},
      {o.sum_ctas > 0, &res.fused_sum_ctas_ms,
       [](megakernel::FusedForwardOptions& fo, const Options& op) {
         fo.fused_topk_sum = true;
         fo.join_gemm = std::max(0, fo.comm_ctas - op.sum_ctas);
       },
       "-sum-ctas"},
      {o.macrobatch > 0 && o.ring_sum, &res.fused_macrobatch_sum_ms,
       [](megakernel::FusedForwardOptions& fo, const Options&) { fo.fused_topk_sum = true; }, "-macrobatch-sum", true},
  };
  // The workspace a mode runs on, and one pass of it.
  auto ws_of = [&](const Mode* m) -> Workspace& { return m->ring ? *ring_ws : *ws; };
  auto pass = [&](const Mode* m, const megakernel::FusedForwardOptions& fo) {
    Workspace& W = ws_of(m);
    schedule(W, L.topk_idx.get(), st);
    megakernel::fused_forward(*W.impl().state, *W.impl().forward, args, w, fo, W.impl().own_context->impl().saved, st);
    W.impl().last_stream = st;
  };
  auto options_for = [&](int c, Configure configure, bool variant) {
    megakernel::FusedForwardOptions fo;
    fo.comm_ctas = variant && o.alt_comm > 0 ? o.alt_comm : c;
    fo.timeout_s = cfg.wait_timeout_s;
    configure(fo, o);
    // --join N is capped so that one comm CTA still combines at EP >= 2 (a sweep may go below N).
    if (fo.join_gemm > 0) fo.join_gemm = std::min(fo.join_gemm, fo.comm_ctas - (s.ep > 1 ? 1 : 0));
    return fo;
  };
  {  // the default's y: the reference of the variants' bits
    const auto fo = options_for(o.comm.front(), modes[0].configure, false);
    schedule(*ws, L.topk_idx.get(), st);
    megakernel::fused_forward(state, buf, args, w, fo, impl.own_context->impl().saved, st);
    impl.last_stream = st;
    ws->check();
    MOK_CUDA_CHECK(cudaMemcpyAsync(y_ref.get(), args.y, y_ref.bytes(), cudaMemcpyDeviceToDevice, st));
    res.y_hash = fnv1a64(y_ref.get(), y_ref.bytes(), st);
  }
  for (int c : o.comm) {
    // The default and the variants on, timed interleaved (time_interleaved_ms).
    std::vector<const Mode*> on;
    std::vector<megakernel::FusedForwardOptions> fos;
    for (const Mode& m : modes) {
      if (!m.on) continue;
      on.push_back(&m);
      fos.push_back(options_for(c, m.configure, &m != &modes[0]));
    }
    const std::vector<double> ms =
        time_interleaved_ms(o, sync, st, static_cast<int>(on.size()), [&](int j) { pass(on[j], fos[j]); });
    ws->check();
    if (ring_ws) ring_ws->check();
    for (size_t j = 0; j < on.size(); ++j) (*on[j]->ms)[c] = ms[j];
    for (size_t j = 1; j < on.size(); ++j) {  // each variant's y against the default's
      MOK_CUDA_CHECK(cudaStreamSynchronize(st));
      sync.arrive_and_wait();
      pass(on[j], fos[j]);
      ws_of(on[j]).check();
      res.variants_vs_fused += bench::count_mismatches(y_ref.get(), args.y, y_ref.size(), st);
    }
    // One more pass of the default and of each variant, right after the timed ones (steady state).
    for (size_t j = 0; j < on.size() && !o.trace.empty(); ++j) {
      MOK_CUDA_CHECK(cudaStreamSynchronize(st));
      sync.arrive_and_wait();
      pass(on[j], fos[j]);
      ws_of(on[j]).check();
      megakernel::forward_trace_dump(o.trace + "-" + name + on[j]->tag + "-c" + std::to_string(c) + "-r" +
                                     std::to_string(lr.rank) + ".bin");
    }
  }

  megakernel::StagedForwardOptions so;
  so.timeout_s = cfg.wait_timeout_s;
  res.staged_ms = time_ms(o, sync, st, [&] {
    schedule(*ws, L.topk_idx.get(), st);
    megakernel::staged_forward(state, buf, args, w, so, impl.own_context->impl().saved, st);
  });
  ws->check();
  res.fused_vs_staged = bench::count_mismatches(y_ref.get(), args.y, y_ref.size(), st);
  res.gemms_ms = time_ms(o, sync, st, [&] { megakernel::forward_gemms_only(state, buf, w, so, impl.own_context->impl().saved, st); });
  ws->check();

  // Unfused baseline: maps from this rank's schedule rows (downloaded once, not timed).
  comm::ScheduleHeader h{};
  MOK_CUDA_CHECK(cudaMemcpy(&h, state.view().header, sizeof(h), cudaMemcpyDeviceToHost));
  std::vector<comm::RowEntry> rows(h.padded_rows);
  MOK_CUDA_CHECK(cudaMemcpy(rows.data(), state.view().rows, rows.size() * sizeof(comm::RowEntry),
                            cudaMemcpyDeviceToHost));
  {
    Baseline base(s, lr.rank, routing, rows);
    if (s.has_shared()) {  // the shared expert's rows: x itself (T is a multiple of 128 here)
      MOK_CUDA_CHECK(cudaMemcpy(buf.shared_x.get(), args.x, s.tokens * s.hidden * 2, cudaMemcpyDeviceToDevice));
    }
    res.baseline_ms = time_ms(o, sync, st, [&] { base.run(*ws, L, lr.comm, st); });
    ws->check();
    res.baseline_vs_fused = bench::count_mismatches(y_ref.get(), args.y, y_ref.size(), st);
  }

  {  // cuBLAS dense GEMM of (about) the same FLOPs
    const bench::DenseTiming d = bench::cublas_dense(o, sync, st, s, s.forward_flops());
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
  std::snprintf(b, sizeof(b), "%.4g", v);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const int gpus = bootstrap::local_device_count();
  if (gpus < 1) {
    std::printf("bench_forward: no CUDA device visible, nothing measured\n");
    return 0;
  }
  const int ep = o.ep > 0 ? std::min(o.ep, gpus) : gpus;
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
  std::printf("bench_forward: EP=%d (%d GPU(s) visible), per rank, slowest rank's median of %d\n", ep, gpus, o.iters);
  std::printf("%-7s %5s %9s %9s %9s %9s %9s %9s %9s %6s %6s\n", "shape", "comm", "fwd_ms", "TFLOP/s", "staged",
              "gemms", "fwd/gemm", "unfused", "cublasTF", "f==s", "b==f");
  for (size_t i = 0; i < shapes.size(); ++i) {
    const LayerShape& s = shapes[i];
    auto worst = [&](auto get) {
      double m = 0;
      for (const auto& r : res[i]) m = std::max(m, get(r));
      return m;
    };
    int best_comm = o.comm.front();
    double best = 1e30;
    std::ostringstream sweep;
    for (int c : o.comm) {
      const double ms = worst([&](const RankResult& r) { return r.fused_ms.at(c); });
      sweep << (sweep.tellp() > 0 ? ", " : "") << "\"fwd_ms_comm" << c << "\": " << fmt(ms);
      if (ms < best) best = ms, best_comm = c;
    }
    // A variant's sweep (fwd_<name>_ms_commC) and its best time, 0 when it did not run.
    auto variant = [&](bool ran, const char* name, std::map<int, double> RankResult::*ms_of) {
      double best_v = 0;
      for (int c : ran ? o.comm : std::vector<int>{}) {
        const double ms = worst([&](const RankResult& r) { return (r.*ms_of).at(c); });
        sweep << ", \"fwd_" << name << "_ms_comm" << c << "\": " << fmt(ms);
        if (best_v == 0 || ms < best_v) best_v = ms;
      }
      if (ran) sweep << ", \"fwd_" << name << "_ms\": " << fmt(best_v);
      return best_v;
    };
    const double best_fused_sum = variant(o.fused_sum, "fused_sum", &RankResult::fused_sum_ms);
    const double best_join = variant(o.join_variant, "join", &RankResult::fused_join_ms);
    const double best_push = variant(o.push, "push", &RankResult::fused_push_ms);
    const double best_alt_comm = variant(o.alt_comm > 0, "alt_comm", &RankResult::fused_alt_comm_ms);
    const double best_macrobatch = variant(o.macrobatch > 0, "macrobatch", &RankResult::fused_macrobatch_ms);
    const double best_push_sum = variant(o.push_sum, "push_sum", &RankResult::fused_push_sum_ms);
    const bool ring_sum = o.macrobatch > 0 && o.ring_sum;
    const double best_sum_ctas = variant(o.sum_ctas > 0, "sum_ctas", &RankResult::fused_sum_ctas_ms);
    const double best_macrobatch_sum = variant(ring_sum, "macrobatch_sum", &RankResult::fused_macrobatch_sum_ms);
    bool ps = true;
    for (const auto& r : res[i]) ps &= r.variants_vs_fused == 0;
    const bool any_variant =
        o.fused_sum || o.join_variant || o.push || o.macrobatch > 0 || o.alt_comm > 0 || o.push_sum || o.sum_ctas > 0;
    if (any_variant) sweep << ", \"variants_equal_fused\": " << (ps ? "true" : "false");
    sweep << ", \"routed_buffer_mb\": " << fmt(res[i][0].routed_buffer_mb);
    char hash[32];
    std::snprintf(hash, sizeof(hash), "%016llx", static_cast<unsigned long long>(res[i][0].y_hash));
    sweep << ", \"y_hash\": \"" << hash << "\"";
    auto line = [&](bool on, const std::string& what, double ms) {
      if (on) std::printf("%-7s %s: best %.3f ms, same bits: %s\n", o.shapes[i].c_str(), what.c_str(), ms, ps ? "yes" : "NO");
    };
    if (o.alt_comm > 0) sweep << ", \"alt_comm\": " << o.alt_comm;
    line(o.alt_comm > 0, "the default at " + std::to_string(o.alt_comm) + " comm CTAs (the variants too)", best_alt_comm);
    if (o.macrobatch > 0) {
      sweep << ", \"macrobatch\": " << o.macrobatch << ", \"macrobatch_buffer_mb\": " << fmt(res[i][0].macrobatch_buffer_mb);
      line(true, "macrobatch ring of " + std::to_string(o.macrobatch) + " rows (routed buffers " +
                     fmt(res[i][0].routed_buffer_mb) + " -> " + fmt(res[i][0].macrobatch_buffer_mb) + " MB)",
           best_macrobatch);
    }
    line(ring_sum, "macrobatch ring with the top-k sum inside the fused kernel", best_macrobatch_sum);
    line(o.fused_sum, "top-k sum inside the fused kernel", best_fused_sum);
    if (o.sum_ctas > 0) sweep << ", \"sum_ctas\": " << o.sum_ctas;
    line(o.sum_ctas > 0, "top-k sum inside, " + std::to_string(o.sum_ctas) + " comm CTAs not joining", best_sum_ctas);
    line(o.push_sum, "GEMM 2's epilogues pushing + top-k sum inside", best_push_sum);
    line(o.join_variant, "comm CTAs taking GEMM tasks (join_gemm " + std::to_string(o.join) + ")", best_join);
    line(o.push, "GEMM 2's epilogues pushing the combine's rows", best_push);
    std::printf("%-7s y_hash %s\n", o.shapes[i].c_str(), hash);
    const double flops = s.forward_flops();
    const double staged = worst([](const RankResult& r) { return r.staged_ms; });
    const double gemms = worst([](const RankResult& r) { return r.gemms_ms; });
    const double base = worst([](const RankResult& r) { return r.baseline_ms; });
    const double cublas_tf = res[i][0].cublas_flops / worst([](const RankResult& r) { return r.cublas_ms; }) / 1e9;
    bool fs = true, bf = true;
    for (const auto& r : res[i]) fs &= r.fused_vs_staged == 0, bf &= r.baseline_vs_fused == 0;
    std::printf("%-7s %5d %9.3f %9.1f %9.3f %9.3f %9.3f %9.3f %9.1f %6s %6s\n", o.shapes[i].c_str(), best_comm, best,
                flops / best / 1e9, staged, gemms, best / gemms, base, cublas_tf, fs ? "yes" : "NO", bf ? "yes" : "NO");
    results << (i ? ",\n  " : "") << "{\"bench\": \"forward\", \"shape\": \"" << o.shapes[i] << "\", \"ep\": " << ep
            << ", \"tokens_per_rank\": " << s.tokens << ", \"routing\": \"uniform\", \"warm_ms\": " << fmt(o.warm_ms)
            << ", \"minibatch\": " << res[i][0].minibatch
            << ", \"metrics\": {"
            << "\"fwd_ms\": " << fmt(best) << ", \"fwd_tflops\": " << fmt(flops / best / 1e9)
            << ", \"gemms_alone_ms\": " << fmt(gemms) << ", \"unfused_baseline_ms\": " << fmt(base)
            << ", \"cublas_dense_tflops\": " << fmt(cublas_tf) << ", \"staged_fwd_ms\": " << fmt(staged)
            << ", \"comm_sms\": " << best_comm << ", \"fwd_over_gemms_alone\": " << fmt(best / gemms)
            << ", \"fwd_tflops_over_cublas\": " << fmt(flops / best / 1e9 / cublas_tf)
            << ", \"unfused_baseline_tflops\": " << fmt(flops / base / 1e9)
            << ", \"fused_equals_staged\": " << (fs ? "true" : "false")
            << ", \"baseline_equals_fused\": " << (bf ? "true" : "false") << ", " << sweep.str() << "}}";
  }
  if (ep < 2) std::printf("NOTE: EP=1 (one GPU): no NVLink traffic; the EP=2 acceptance figures are NOT measured\n");
  std::ofstream f(o.out);
  f << bench::record_envelope(bench::command_line(argc, argv), "[\n  " + results.str() + "\n]");
  std::printf("wrote %s\n", o.out.c_str());
  return f ? 0 : 1;
}
