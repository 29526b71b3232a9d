// bench_comm: dispatch and combine bandwidth of the communication layer on every local GPU
// (EP = number of GPUs used, one thread per GPU, launch mode (a)), side by side in one run with
//   - NCCL all-to-all (grouped ncclSend/ncclRecv) of the same bytes per peer pair, and
//   - a plain peer-to-peer pull kernel in the same pattern (every GPU pulls at once),
// sweeping the communication CTAs. DeepSeek-V3-like shape by default (H 7168, top-8, 256
// experts, T 8192 per rank, uniform routing). With one GPU the EP=1 self-copy variant runs
// (local HBM, no NVLink) and the JSON says the EP>=2 figures were not measured.
//
//   bench_comm [--tokens 8192] [--ep N] [--ctas 8,16,24,32] [--iters 10] [--out file.json]
//
// Bytes are counted honestly, per rank and one way: `dispatch_bytes_moved` = rows pulled from
// other ranks (one per (token, k), the plain dispatch), `dispatch_bytes_min` = distinct
// (token, destination rank) pairs (what the dedup dispatch moves over NVLink). GB/s = those
// bytes / time of the slowest rank. Times include the role's phase barrier.
#include <algorithm>
#include <barrier>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "comm/comm_state.hpp"
#include "comm/cuda_check.hpp"
#include "comm/roles.cuh"
#include "host/workspace_impl.hpp"
#include "mok/api.hpp"
#include "mok/bootstrap.hpp"
#include "bench_record.hpp"

namespace {

using namespace mok;

struct Options {
  int64_t tokens = 8192;
  int ep = 0;  // 0 = every local GPU
  std::vector<int> ctas{8, 16, 24, 32};
  int iters = 10, warmup = 3;
  std::string out = "bench/results/comm_dsv3.json";  // copy a quoted run to bench/results/<date>-comm.json
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--tokens") o.tokens = std::stoll(v);
    else if (k == "--ep") o.ep = std::stoi(v);
    else if (k == "--iters") o.iters = std::stoi(v);
    else if (k == "--out") o.out = v;
    else if (k == "--ctas") {
      o.ctas.clear();
      std::stringstream s(v);
      for (std::string x; std::getline(s, x, ',');) o.ctas.push_back(std::stoi(x));
    } else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      std::exit(2);
    }
  }
  return o;
}

// ---- plain peer-to-peer pull in the dispatch pattern ----------------------------------------------
struct PullSegments {
  const int4* src[kMaxEp];
  int4* dst[kMaxEp];
  int64_t vecs[kMaxEp];
  int n = 0;
};

constexpr int64_t kChunkVecs = 32 * comm::CommCtaConfig::kUnroll;  // one warp_copy round: 8 KiB

__global__ void __launch_bounds__(comm::CommCtaConfig::kThreads, 1) pull_kernel(const PullSegments s) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t gw = static_cast<int64_t>(blockIdx.x) * comm::CommCtaConfig::kWarps + warp;
  const int64_t nw = static_cast<int64_t>(gridDim.x) * comm::CommCtaConfig::kWarps;
  for (int p = 0; p < s.n; ++p) {
    for (int64_t c = gw; c * kChunkVecs < s.vecs[p]; c += nw) {
      int64_t n = s.vecs[p] - c * kChunkVecs;
      if (n > kChunkVecs) n = kChunkVecs;
      comm::warp_copy(s.dst[p] + c * kChunkVecs, s.src[p] + c * kChunkVecs, n, lane, comm::StableLoad{});
    }
  }
}

// ---- timing ----------------------------------------------------------------------------------------
struct Timer {
  cudaEvent_t a, b;
  Timer() {
    MOK_CUDA_CHECK(cudaEventCreate(&a));
    MOK_CUDA_CHECK(cudaEventCreate(&b));
  }
  ~Timer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct SweepPoint {
  int ctas = 0;
  double dispatch_ms = 0, dispatch_dedup_ms = 0, combine_ms = 0, p2p_ms = 0;
};

struct RankResult {
  int64_t real_rows = 0, remote_rows = 0, remote_first_rows = 0, self_rows = 0, first_rows = 0;
  std::vector<SweepPoint> sweep;
  double nccl_ms = 0, epilogue_ms = 0, schedule_ms = 0;
};

std::vector<std::vector<int32_t>> uniform_routing(const LayerShape& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int32_t>> idx(s.ep, std::vector<int32_t>(s.tokens * s.topk));
  std::vector<int32_t> perm(s.experts);
  for (int r = 0; r < s.ep; ++r) {
    for (int64_t t = 0; t < s.tokens; ++t) {
      for (int64_t i = 0; i < s.experts; ++i) perm[i] = static_cast<int32_t>(i);
      for (int k = 0; k < s.topk; ++k) {
        std::swap(perm[k], perm[k + rng() % (s.experts - k)]);
        idx[r][t * s.topk + k] = perm[k];
      }
    }
  }
  return idx;
}

// Times `iters` runs of `op` on every rank; all ranks start each run together (host barrier).
template <class Op>
double time_ms(const Options& o, std::barrier<>& sync, cudaStream_t stream, Op op) {
  Timer t;
  std::vector<double> ms;
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
    sync.arrive_and_wait();
    MOK_CUDA_CHECK(cudaEventRecord(t.a, stream));
    op();
    MOK_CUDA_CHECK(cudaEventRecord(t.b, stream));
    MOK_CUDA_CHECK(cudaEventSynchronize(t.b));
    float x = 0;
    MOK_CUDA_CHECK(cudaEventElapsedTime(&x, t.a, t.b));
    if (i >= o.warmup) ms.push_back(x);
  }
  return median(ms);
}

RankResult run_rank(const Options& o, const LayerShape& shape, const Config& cfg,
                    const std::vector<std::vector<int32_t>>& routing, const std::vector<std::vector<int64_t>>& pair_rows,
                    bootstrap::LocalRank& lr, std::barrier<>& sync) {
  RankResult res;
  const int ep = shape.ep, r = lr.rank;
  const int64_t row_bytes = shape.hidden * 2;
  auto ws = Workspace::create(shape, cfg, lr.comm, lr.device);
  comm::CommState& st = *ws->impl().state;
  cudaStream_t stream;
  MOK_CUDA_CHECK(cudaStreamCreate(&stream));  // blocking: ordered after the setup copies
  comm::DeviceBuffer<int32_t> topk(routing[r].size());
  MOK_CUDA_CHECK(cudaMemcpy(topk.get(), routing[r].data(), topk.bytes(), cudaMemcpyHostToDevice));
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  schedule(*ws, topk.get(), stream);
  ws->check();
  const auto& sb = st.schedule_buffers();
  comm::ScheduleHeader header;
  MOK_CUDA_CHECK(cudaMemcpy(&header, sb.header.get(), sizeof(header), cudaMemcpyDeviceToHost));
  std::vector<comm::RowEntry> rows(header.padded_rows);
  MOK_CUDA_CHECK(cudaMemcpy(rows.data(), sb.rows.get(), rows.size() * sizeof(comm::RowEntry), cudaMemcpyDeviceToHost));
  res.real_rows = header.real_rows;
  for (const auto& e : rows) {
    if (e.src_rank < 0) continue;
    res.first_rows += e.copy_from < 0 ? 1 : 0;
    if (e.src_rank == r) {
      ++res.self_rows;
    } else {
      ++res.remote_rows;
      res.remote_first_rows += e.copy_from < 0 ? 1 : 0;
    }
  }
  // Payloads: x (staged once) and expert outputs; contents do not matter for timing.
  MOK_CUDA_CHECK(cudaMemset(ws->x_staging(), 0x3C, shape.tokens * row_bytes));
  comm::DeviceBuffer<__nv_bfloat16> expert_out(sb.buffer_rows * shape.hidden);
  MOK_CUDA_CHECK(cudaMemset(expert_out.get(), 0x3D, expert_out.bytes()));
  comm::DeviceBuffer<float> topk_w(shape.tokens * shape.topk);
  MOK_CUDA_CHECK(cudaMemset(topk_w.get(), 0, topk_w.bytes()));
  comm::DeviceBuffer<__nv_bfloat16> y(shape.tokens * shape.hidden);
  MOK_CUDA_CHECK(cudaDeviceSynchronize());

  // Plain pull pattern: from each source rank s, the bytes this rank's dispatch pulls from s,
  // read from s's combine-slot region (large enough) into the row buffer.
  PullSegments seg;
  int64_t dst_off = 0;
  for (int s = 0; s < ep; ++s) {
    if (ep > 1 && s == r) continue;  // EP=1: the self-copy variant
    const int64_t vecs = pair_rows[s][r] * row_bytes / 16;
    seg.src[seg.n] = reinterpret_cast<const int4*>(st.peers().base[s] + st.layout().slots);
    seg.dst[seg.n] = reinterpret_cast<int4*>(st.row_buffer()) + dst_off;
    seg.vecs[seg.n] = vecs;
    dst_off += vecs;
    ++seg.n;
  }

  for (int c : o.ctas) {
    SweepPoint p;
    p.ctas = c;
    p.dispatch_ms = time_ms(o, sync, stream, [&] { st.dispatch(c, false, stream); });
    p.dispatch_dedup_ms = time_ms(o, sync, stream, [&] { st.dispatch(c, true, stream); });
    p.combine_ms = time_ms(o, sync, stream, [&] { st.combine(expert_out.get(), c, stream); });
    p.p2p_ms = time_ms(o, sync, stream, [&] {
      pull_kernel<<<c, comm::CommCtaConfig::kThreads, 0, stream>>>(seg);
      MOK_CUDA_CHECK(cudaGetLastError());
    });
    ws->check();
    res.sweep.push_back(p);
  }
  res.schedule_ms = time_ms(o, sync, stream, [&] { schedule(*ws, topk.get(), stream); });
  ws->check();
  res.epilogue_ms = time_ms(o, sync, stream, [&] { st.epilogue(topk_w.get(), nullptr, y.get(), stream); });

  // NCCL all-to-all of the same bytes per (source, destination) pair, self included like dispatch.
  int64_t send_total = 0, recv_total = 0;
  for (int p = 0; p < ep; ++p) {
    send_total += pair_rows[r][p] * row_bytes;
    recv_total += pair_rows[p][r] * row_bytes;
  }
  comm::DeviceBuffer<char> sendbuf(send_total), recvbuf(recv_total);
  res.nccl_ms = time_ms(o, sync, stream, [&] {
    MOK_NCCL_CHECK(ncclGroupStart());
    int64_t so = 0, ro = 0;
    for (int p = 0; p < ep; ++p) {
      const int64_t sb_ = pair_rows[r][p] * row_bytes, rb = pair_rows[p][r] * row_bytes;
      MOK_NCCL_CHECK(ncclSend(sendbuf.get() + so, sb_, ncclChar, p, lr.comm, stream));
      MOK_NCCL_CHECK(ncclRecv(recvbuf.get() + ro, rb, ncclChar, p, lr.comm, stream));
      so += sb_;
      ro += rb;
    }
    MOK_NCCL_CHECK(ncclGroupEnd());
  });
  ws->check();
  MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
  sync.arrive_and_wait();  // nobody frees its window while a peer still reads it
  ws.reset();
  MOK_CUDA_CHECK(cudaStreamDestroy(stream));
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
  const std::string command = bench::command_line(argc, argv);
  const int gpus = bootstrap::local_device_count();
  if (gpus < 1) {
    std::printf("bench_comm: no CUDA device visible, nothing measured\n");
    return 0;
  }
  const int ep = o.ep > 0 ? std::min(o.ep, gpus) : gpus;
  const LayerShape shape = dsv3_shape(ep, o.tokens);
  Config cfg;  // capacity 2.0 (min(capacity, ep) x T*K rows per rank)
  const auto routing = uniform_routing(shape, 2026);
  std::vector<std::vector<int64_t>> pair_rows(ep, std::vector<int64_t>(ep, 0));  // [src][dst]
  for (int s = 0; s < ep; ++s) {
    for (int32_t e : routing[s]) ++pair_rows[s][shape.owner_rank(e)];
  }
  std::vector<RankResult> res(ep);
  std::barrier<> sync(ep);
  std::vector<int> devices(ep);
  for (int i = 0; i < ep; ++i) devices[i] = i;
  bootstrap::run_local_ranks(devices, [&](bootstrap::LocalRank& lr) {
    res[lr.rank] = run_rank(o, shape, cfg, routing, pair_rows, lr, sync);
  });

  // Per-rank one-way bytes and the slowest rank's time.
  const double row_bytes = shape.hidden * 2.0;
  double moved = 0, minimum = 0;
  for (const auto& r : res) {
    moved = std::max(moved, (ep > 1 ? r.remote_rows : r.self_rows) * row_bytes);
    // EP=1: the dedup dispatch reads each token once from x and copies its other rows locally.
    minimum = std::max(minimum, (ep > 1 ? r.remote_first_rows : r.first_rows) * row_bytes);
  }
  auto worst = [&](auto get) {
    double m = 0;
    for (const auto& r : res) m = std::max(m, get(r));
    return m;
  };
  const double nccl_ms = worst([](const RankResult& r) { return r.nccl_ms; });
  const double epi_ms = worst([](const RankResult& r) { return r.epilogue_ms; });
  const double sched_ms = worst([](const RankResult& r) { return r.schedule_ms; });
  std::printf("bench_comm: EP=%d (%d GPU(s) visible), T=%lld/rank, H=%lld, E=%lld, K=%d\n", ep, gpus,
              static_cast<long long>(shape.tokens), static_cast<long long>(shape.hidden),
              static_cast<long long>(shape.experts), shape.topk);
  std::printf("bytes per rank one way: moved %.1f MB (one row per (token,k)), minimum %.1f MB (distinct token,rank)%s\n",
              moved / 1e6, minimum / 1e6, ep == 1 ? " [EP=1: self-copy through HBM, no NVLink]" : "");
  std::printf("%5s %12s %9s %12s %9s %12s %9s %12s %9s\n", "ctas", "dispatch_ms", "GB/s", "dedup_ms", "GB/s(min)",
              "combine_ms", "GB/s", "p2p_ms", "GB/s");
  SweepPoint best_d{}, best_c{}, best_p{};
  best_d.dispatch_ms = best_c.combine_ms = best_p.p2p_ms = 1e30;
  double best_dedup = 1e30;
  int best_dedup_ctas = 0;
  std::ostringstream sweep;
  for (size_t i = 0; i < o.ctas.size(); ++i) {
    SweepPoint w;
    w.ctas = o.ctas[i];
    w.dispatch_ms = worst([&](const RankResult& r) { return r.sweep[i].dispatch_ms; });
    w.dispatch_dedup_ms = worst([&](const RankResult& r) { return r.sweep[i].dispatch_dedup_ms; });
    w.combine_ms = worst([&](const RankResult& r) { return r.sweep[i].combine_ms; });
    w.p2p_ms = worst([&](const RankResult& r) { return r.sweep[i].p2p_ms; });
    std::printf("%5d %12.3f %9.1f %12.3f %9.1f %12.3f %9.1f %12.3f %9.1f\n", w.ctas, w.dispatch_ms,
                moved / w.dispatch_ms / 1e6, w.dispatch_dedup_ms, minimum / w.dispatch_dedup_ms / 1e6, w.combine_ms,
                moved / w.combine_ms / 1e6, w.p2p_ms, moved / w.p2p_ms / 1e6);
    sweep << (i ? ", " : "") << "{\"comm_ctas\": " << w.ctas << ", \"dispatch_ms\": " << fmt(w.dispatch_ms)
          << ", \"dispatch_dedup_ms\": " << fmt(w.dispatch_dedup_ms) << ", \"combine_ms\": " << fmt(w.combine_ms)
          << ", \"p2p_copy_ms\": " << fmt(w.p2p_ms) << "}";
    if (w.ctas <= 24) {
      if (w.dispatch_ms < best_d.dispatch_ms) best_d = w;
      if (w.combine_ms < best_c.combine_ms) best_c = w;
      if (w.dispatch_dedup_ms < best_dedup) best_dedup = w.dispatch_dedup_ms, best_dedup_ctas = w.ctas;
    }
    if (w.p2p_ms < best_p.p2p_ms) best_p = w;
  }
  std::printf("NCCL all-to-all (ncclSend/ncclRecv, same bytes): %.3f ms = %.1f GB/s; epilogue %.3f ms; schedule %.3f ms\n",
              nccl_ms, moved / nccl_ms / 1e6, epi_ms, sched_ms);
  if (ep < 2) std::printf("NOTE: EP=2 figures NOT measured (only %d GPU); these are EP=1 self-copy numbers\n", gpus);

  cudaDeviceProp prop{};
  MOK_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  int nccl_version = 0;
  ncclGetVersion(&nccl_version);
  std::ostringstream j;
  j << "[{\n  \"bench\": \"comm\",\n  \"shape\": \"dsv3\",\n  \"ep\": " << ep << ",\n  \"device\": \"" << prop.name
    << "\",\n  \"gpus_visible\": " << gpus << ",\n  \"nccl\": \"" << comm::nccl_version_string(nccl_version)
    << "\",\n  \"tokens_per_rank\": " << shape.tokens << ", \"hidden\": " << shape.hidden
    << ", \"experts\": " << shape.experts << ", \"topk\": " << shape.topk << ",\n  \"routing\": \"uniform\",\n"
    << "  \"bytes_basis\": \""
    << (ep > 1 ? "per rank, one way, NVLink bytes into the rank"
               : "EP=1 self-copy through HBM (no NVLink); EP=2 figures not measured")
    << "\",\n  \"ep2_measured\": " << (ep >= 2 ? "true" : "false") << ",\n  \"metrics\": {"
    << "\"dispatch_GBps\": " << fmt(moved / best_d.dispatch_ms / 1e6)
    << ", \"combine_GBps\": " << fmt(moved / best_c.combine_ms / 1e6)
    << ", \"dispatch_ms\": " << fmt(best_d.dispatch_ms) << ", \"combine_ms\": " << fmt(best_c.combine_ms)
    << ", \"nccl_a2a_GBps\": " << fmt(moved / nccl_ms / 1e6) << ", \"p2p_copy_GBps\": " << fmt(moved / best_p.p2p_ms / 1e6)
    << ", \"comm_ctas\": " << best_d.ctas << ", \"combine_ctas\": " << best_c.ctas
    << ", \"dispatch_bytes_moved\": " << static_cast<int64_t>(moved)
    << ", \"dispatch_bytes_min\": " << static_cast<int64_t>(minimum)
    << ", \"dispatch_dedup_ms\": " << fmt(best_dedup) << ", \"dispatch_dedup_ctas\": " << best_dedup_ctas
    << ", \"dispatch_dedup_GBps_min_bytes\": " << fmt(minimum / best_dedup / 1e6)
    << ", \"nccl_a2a_ms\": " << fmt(nccl_ms) << ", \"p2p_copy_ms\": " << fmt(best_p.p2p_ms)
    << ", \"p2p_copy_ctas\": " << best_p.ctas << ", \"epilogue_ms\": " << fmt(epi_ms)
    << ", \"schedule_ms\": " << fmt(sched_ms) << "},\n  \"sweep\": ["
    << sweep.str() << "]\n}]";
  std::ofstream f(o.out);
  f << bench::record_envelope(command, j.str());
  std::printf("wrote %s\n", o.out.c_str());
  return f ? 0 : 1;
}
