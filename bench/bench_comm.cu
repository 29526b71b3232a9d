// bench_comm: dispatch and combine bandwidth of the communication layer on every local GPU
// (EP = number of GPUs used, one thread per GPU, launch mode (a)), side by side in one run with
//   - NCCL all-to-all (grouped ncclSend/ncclRecv) of the same bytes per (source, destination)
//     pair, the own rank's share included (NCCL copies it locally, like dispatch/combine do), and
//   - plain peer copies of the remote bytes only through registers (16-byte vectors, the kWarp
//     copy of the roles), every GPU at once: pull and push,
// sweeping the communication CTAs. DeepSeek-V3-like shape by default (H 7168, top-8, 256
// experts, T 8192 per rank, uniform routing). With one GPU the EP=1 self-copy variant runs (local
// HBM, no NVLink) and the JSON says the EP>=2 figures were not measured.
//
//   bench_comm [--tokens 8192] [--ep N] [--ctas 8,16,24,32] [--iters 20] [--out file.json]
//              [--dispatch warp,warp_dedup] [--combine warp,warp_inplace]
//              [--copy pull_warp,push_warp,pull_warp_min]
//
// Dispatch: `warp` the plain pull (each (token, k) row read on its own; what the macrobatch ring
// runs), `warp_dedup` the dedup fan-out dispatch (the layer's default: each distinct (token, rank)
// read once and stored from registers to every row of that token on this rank). Combine: `warp`
// pushes every real row into its slot (all slots; the ring's combine), `warp_inplace` the layer's
// combine (own_rows_in_place: only other ranks' rows move, split evenly over all comm warps by the
// schedule's remote-row list; the epilogue then reads the own rows in place, timed as
// epilogue_in_place_ms). Copies: pull_warp / push_warp move the remote rows (one per (token, k));
// pull_warp_min pulls exactly the distinct (token, other rank) rows, one segment per peer: it and
// NCCL all-to-all of those bytes (nccl_a2a_min, own share excluded: nothing is copied for the own
// rank) are the same-bytes baselines of the dedup dispatch's NVLink traffic.
//
// Bytes, per rank and one way: `dispatch_bytes_moved` = rows from other ranks, one per (token, k)
// (what crosses NVLink in the plain dispatch and in combine), `dispatch_bytes_min` = distinct
// (token, rank) pairs from other ranks (what the dedup dispatch moves over NVLink). A variant's
// GB/s divides the bytes IT moves over NVLink by the slowest rank's time; the own rank's rows
// (`self_bytes`, local HBM) and padding rows are extra work dispatch/combine and NCCL do and the
// plain copies do not. Times include the role's phase barrier. Every point is printed as soon as
// it is measured; a device error stops the sweep and the JSON keeps what was measured.
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "bench_record.hpp"
#include "bench_timing.hpp"
#include "comm/comm_state.hpp"
#include "comm/cuda_check.hpp"
#include "comm/roles.cuh"
#include "comm/roles.hpp"
#include "host/workspace_impl.hpp"
#include "support/bench_support.hpp"
#include "mok/api.hpp"
#include "mok/bootstrap.hpp"

namespace {

using namespace mok;
using bench::median;
using bench::time_ms;
using bench::split;

struct Options {
  int64_t tokens = 8192;
  int ep = 0;  // 0 = every local GPU
  std::vector<int> ctas{8, 16, 24, 32};
  int iters = 20, warmup = 3;
  std::vector<std::string> dispatch{"warp", "warp_dedup"};
  std::vector<std::string> combine{"warp", "warp_inplace"};
  std::vector<std::string> copy{"pull_warp", "push_warp", "pull_warp_min"};
  std::string out = "bench/results/comm_dsv3.json";  // copy a quoted run to bench/results/<date>-comm.json
};

constexpr const char* kUsage =
    "usage: bench_comm [--tokens 8192] [--ep N] [--ctas 8,16,24,32] [--iters 20] [--out file.json]\n"
    "                  [--dispatch warp,warp_dedup] [--combine warp,warp_inplace]\n"
    "                  [--copy pull_warp,push_warp,pull_warp_min]\n";

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") {
      std::printf("%s", kUsage);
      std::exit(0);
    }
    if (i + 1 == argc) {
      std::fprintf(stderr, "option %s needs a value\n%s", k.c_str(), kUsage);
      std::exit(2);
    }
    const std::string v = argv[i + 1];
    if (k == "--tokens") o.tokens = std::stoll(v);
    else if (k == "--ep") o.ep = std::stoi(v);
    else if (k == "--iters") o.iters = std::stoi(v);
    else if (k == "--out") o.out = v;
    else if (k == "--dispatch") o.dispatch = split(v);
    else if (k == "--combine") o.combine = split(v);
    else if (k == "--copy") o.copy = split(v);
    else if (k == "--ctas") {
      o.ctas.clear();
      for (const auto& x : split(v)) o.ctas.push_back(std::stoi(x));
    } else {
      std::fprintf(stderr, "unknown option %s\n%s", k.c_str(), kUsage);
      std::exit(2);
    }
  }
  return o;
}

// ---- what is measured ------------------------------------------------------------------------------
enum class Kind { kCopy, kDispatch, kCombine };
const char* kind_name(Kind k) { return k == Kind::kCopy ? "copy" : k == Kind::kDispatch ? "dispatch" : "combine"; }

struct Variant {
  Kind kind;
  std::string name;
  bool dedup = false;      // dispatch: the dedup fan-out (NVLink moves dispatch_bytes_min)
  bool push = false;       // copy: local -> peer
  bool in_place = false;   // combine: own_rows_in_place (only other ranks' rows move)
  bool min_bytes = false;  // copy: the distinct (token, rank) bytes only (dispatch_bytes_min)
};

bool lookup(Kind kind, const std::string& name, Variant& v) {
  v = Variant{kind, name};
  switch (kind) {
    case Kind::kCopy:
      v.push = name == "push_warp";
      v.min_bytes = name == "pull_warp_min";
      return name == "pull_warp" || v.push || v.min_bytes;
    case Kind::kDispatch:
      v.dedup = name == "warp_dedup";
      return name == "warp" || v.dedup;
    case Kind::kCombine:
      v.in_place = name == "warp_inplace";
      return name == "warp" || v.in_place;
  }
  return false;
}

// Copies first (the baselines), then dispatch and combine, each in the order given.
std::vector<Variant> plan(const Options& o) {
  std::vector<Variant> out;
  auto add = [&](Kind kind, const std::vector<std::string>& names) {
    for (const auto& n : names) {
      Variant v;
      if (!lookup(kind, n, v)) {
        std::fprintf(stderr, "unknown %s variant %s\n", kind_name(kind), n.c_str());
        std::exit(2);
      }
      out.push_back(v);
    }
  };
  add(Kind::kCopy, o.copy);
  add(Kind::kDispatch, o.dispatch);
  add(Kind::kCombine, o.combine);
  return out;
}

struct Point {
  Variant v;
  int ctas = 0;
  double ms[kMaxEp] = {};
  double worst() const { return *std::max_element(ms, ms + kMaxEp); }
};

// ---- plain peer copies of the remote bytes ----------------------------------------------------------
struct CopySegments {
  const char* src[kMaxEp];
  char* dst[kMaxEp];
  int64_t bytes[kMaxEp];
  int n = 0;
};

__device__ constexpr int64_t kWarpChunk = 32 * comm::CommCtaConfig::kUnroll * 16;  // one warp_copy round: 8 KiB

__global__ void __launch_bounds__(comm::CommCtaConfig::kThreads, 1) copy_warp_kernel(const CopySegments s) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t gw = static_cast<int64_t>(blockIdx.x) * comm::CommCtaConfig::kWarps + warp;
  const int64_t nw = static_cast<int64_t>(gridDim.x) * comm::CommCtaConfig::kWarps;
  for (int p = 0; p < s.n; ++p) {
    for (int64_t c = gw; c * kWarpChunk < s.bytes[p]; c += nw) {
      const int64_t n = s.bytes[p] - c * kWarpChunk < kWarpChunk ? s.bytes[p] - c * kWarpChunk : kWarpChunk;
      comm::warp_copy(reinterpret_cast<int4*>(s.dst[p] + c * kWarpChunk),
                      reinterpret_cast<const int4*>(s.src[p] + c * kWarpChunk), n / 16, lane, comm::StableLoad{});
    }
  }
}

// ---- timing ----------------------------------------------------------------------------------------


struct RowStats {
  int64_t real = 0, remote = 0, remote_first = 0, self = 0, self_first = 0, padding = 0;
};

struct Shared {
  const Options& o;
  LayerShape shape;
  std::vector<Point> points;
  std::vector<RowStats> stats;
  std::vector<double> nccl_ms, nccl_min_ms, epilogue_ms, epilogue_in_place_ms, schedule_ms;
  std::atomic<bool> failed{false};
  std::string failure;
  std::barrier<> sync;
  Shared(const Options& opt, const LayerShape& s, std::vector<Point> p)
      : o(opt), shape(s), points(std::move(p)), stats(s.ep), nccl_ms(s.ep), nccl_min_ms(s.ep), epilogue_ms(s.ep),
        epilogue_in_place_ms(s.ep), schedule_ms(s.ep),
        sync(s.ep) {}
};

std::string fmt(double v) {
  if (!std::isfinite(v)) return "null";
  char b[64];
  std::snprintf(b, sizeof(b), "%.4g", v);
  return b;
}

void write_json(Shared& sh, const std::string& command);

void run_rank(Shared& sh, const Config& cfg, const std::vector<std::vector<int32_t>>& routing,
              const std::vector<std::vector<int64_t>>& pair_rows, const std::vector<std::vector<int64_t>>& pair_tokens,
              bootstrap::LocalRank& lr, const std::string& command) {
  const Options& o = sh.o;
  const LayerShape& shape = sh.shape;
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
  RowStats& rs = sh.stats[r];
  rs.real = header.real_rows;
  for (const auto& e : rows) {
    if (e.src_rank < 0) {
      ++rs.padding;
    } else if (e.src_rank == r) {
      ++rs.self;
      rs.self_first += e.copy_from < 0 ? 1 : 0;
    } else {
      ++rs.remote;
      rs.remote_first += e.copy_from < 0 ? 1 : 0;
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

  // Plain copies: from / to each peer s, the bytes dispatch pulls from s (= combine pushes to
  // s at EP=2). Pull: s's combine-slot region -> the row buffer; push: row buffer -> s's slots.
  CopySegments pull, push, pull_min;
  int64_t off = 0;
  for (int s = 0; s < ep; ++s) {
    if (ep > 1 && s == r) continue;  // EP=1: the self-copy variant
    const int64_t bytes = pair_rows[s][r] * row_bytes;
    char* peer = st.peers().base[s] + st.layout().slots;
    char* local = reinterpret_cast<char*>(st.row_buffer()) + off;
    pull.src[pull.n] = peer, pull.dst[pull.n] = local, pull.bytes[pull.n] = bytes, ++pull.n;
    push.src[push.n] = local, push.dst[push.n] = peer, push.bytes[push.n] = bytes, ++push.n;
    pull_min.src[pull_min.n] = peer, pull_min.dst[pull_min.n] = local;
    pull_min.bytes[pull_min.n++] = pair_tokens[s][r] * row_bytes;  // distinct tokens of s this rank needs
    off += bytes;
  }

  auto stop_if_failed = [&](const char* what) {
    std::optional<Error> err = st.take_error(stream);
    if (err) {
      std::fprintf(stderr, "rank %d: %s failed: %s\n", r, what, err->what());
      if (!sh.failed.exchange(true)) sh.failure = std::string(what) + ": " + err->what();
    }
    sh.sync.arrive_and_wait();
    return sh.failed.load();
  };

  // NCCL all-to-all (grouped send/recv) of rows[s][d] rows from rank s to rank d; the own
  // rank's pair too when with_self (NCCL copies it locally).
  auto time_nccl_a2a = [&](const std::vector<std::vector<int64_t>>& rows, bool with_self) {
    int64_t send_total = 0, recv_total = 0;
    for (int p = 0; p < ep; ++p) {
      if (p == r && !with_self) continue;
      send_total += rows[r][p] * row_bytes;
      recv_total += rows[p][r] * row_bytes;
    }
    comm::DeviceBuffer<char> sendbuf(send_total), recvbuf(recv_total);
    return time_ms(o, sh.sync, stream, [&] {
      MOK_NCCL_CHECK(ncclGroupStart());
      int64_t so = 0, ro = 0;
      for (int p = 0; p < ep; ++p) {
        if (p == r && !with_self) continue;
        const int64_t sbytes = rows[r][p] * row_bytes, rbytes = rows[p][r] * row_bytes;
        MOK_NCCL_CHECK(ncclSend(sendbuf.get() + so, sbytes, ncclChar, p, lr.comm, stream));
        MOK_NCCL_CHECK(ncclRecv(recvbuf.get() + ro, rbytes, ncclChar, p, lr.comm, stream));
        so += sbytes;
        ro += rbytes;
      }
      MOK_NCCL_CHECK(ncclGroupEnd());
    });
  };

  // Baselines first: a variant that fails later cannot cost them.
  if (!sh.failed) {
    // The same bytes per (source, destination) pair as dispatch, self included like dispatch.
    sh.nccl_ms[r] = time_nccl_a2a(pair_rows, true);
    stop_if_failed("nccl");
  }
  if (!sh.failed && ep > 1) {
    // The distinct (token, rank) rows: what the dedup dispatch reads over NVLink (no own share).
    sh.nccl_min_ms[r] = time_nccl_a2a(pair_tokens, false);
    stop_if_failed("nccl (distinct rows)");
  }
  if (!sh.failed) {
    sh.schedule_ms[r] = time_ms(o, sh.sync, stream, [&] { schedule(*ws, topk.get(), stream); });
    sh.epilogue_ms[r] = time_ms(o, sh.sync, stream, [&] { st.epilogue(topk_w.get(), nullptr, nullptr, y.get(), stream); });
    sh.epilogue_in_place_ms[r] =
        time_ms(o, sh.sync, stream, [&] { st.epilogue(topk_w.get(), nullptr, expert_out.get(), y.get(), stream); });
    stop_if_failed("schedule/epilogue");
  }
  for (Point& p : sh.points) {
    if (sh.failed) break;
    const Variant& v = p.v;
    const int c = p.ctas;
    if (v.kind == Kind::kCopy) {
      const CopySegments& seg = v.min_bytes ? pull_min : v.push ? push : pull;
      p.ms[r] = time_ms(o, sh.sync, stream, [&] {
        copy_warp_kernel<<<c, comm::CommCtaConfig::kThreads, 0, stream>>>(seg);
        MOK_CUDA_CHECK(cudaGetLastError());
      });
    } else if (v.kind == Kind::kDispatch) {
      p.ms[r] = time_ms(o, sh.sync, stream, [&] { st.dispatch(c, v.dedup, stream); });
    } else {
      p.ms[r] = time_ms(o, sh.sync, stream, [&] { st.combine(expert_out.get(), c, v.in_place, stream); });
    }
    const std::string what = std::string(kind_name(v.kind)) + " " + v.name + " @" + std::to_string(c);
    if (stop_if_failed(what.c_str())) break;
    if (r == 0) {
      const RowStats& s0 = sh.stats[0];
      const double nv =
          static_cast<double>(v.dedup || v.min_bytes ? s0.remote_first : (ep > 1 ? s0.remote : s0.self)) * row_bytes;
      std::printf("  %-8s %-11s ctas %2d  %7.3f ms  %6.1f GB/s (NVLink bytes of rank 0)\n", kind_name(v.kind),
                  v.name.c_str(), c, p.worst(), nv / p.worst() / 1e6);
      std::fflush(stdout);
    }
  }
  sh.sync.arrive_and_wait();
  if (r == 0) write_json(sh, command);  // before teardown: a teardown problem cannot lose the record
  if (sh.failed) return;                // a dead peer: leave the window alone (teardown is collective)
  MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
  sh.sync.arrive_and_wait();  // nobody frees its window while a peer still reads it
  ws.reset();
  MOK_CUDA_CHECK(cudaStreamDestroy(stream));
}

// ---- report ----------------------------------------------------------------------------------------
struct Best {
  const Point* p = nullptr;
  double ms = INFINITY;
};

// in_place: -1 any, 0 / 1 only combines with own_rows_in_place off / on.
Best best_of(const Shared& sh, Kind kind, int max_ctas, bool dedup, const std::string& only = "", int in_place = -1) {
  Best b;
  for (const Point& p : sh.points) {
    if (p.v.kind != kind || p.ctas > max_ctas || p.v.dedup != dedup) continue;
    // The distinct-row copy (fewer bytes than the others) only when asked for by name.
    if (only.empty() && p.v.min_bytes) continue;
    if (in_place >= 0 && p.v.in_place != (in_place == 1)) continue;
    if (!only.empty() && p.v.name != only) continue;
    const double ms = p.worst();
    if (ms > 0 && ms < b.ms) b = Best{&p, ms};
  }
  return b;
}

void write_json(Shared& sh, const std::string& command) {
  const LayerShape& shape = sh.shape;
  const int ep = shape.ep;
  const double rb = shape.hidden * 2.0;
  RowStats w;  // the largest per-rank figures (all ranks alike for uniform routing)
  for (const RowStats& s : sh.stats) {
    w.real = std::max(w.real, s.real), w.remote = std::max(w.remote, s.remote);
    w.remote_first = std::max(w.remote_first, s.remote_first), w.self = std::max(w.self, s.self);
    w.self_first = std::max(w.self_first, s.self_first), w.padding = std::max(w.padding, s.padding);
  }
  const double moved = (ep > 1 ? w.remote : w.self) * rb;          // plain dispatch / combine / copies / NCCL remote
  const double minimum = (ep > 1 ? w.remote_first : w.self_first) * rb;  // dedup dispatch
  auto nvlink_bytes = [&](const Point& p) { return p.v.dedup || p.v.min_bytes ? minimum : moved; };
  auto worst = [&](const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); };
  const double nccl_ms = sh.failed ? NAN : worst(sh.nccl_ms);
  // The layer's dispatch / combine: the fastest variant at <= 24 CTAs of any kind (the defaults
  // are dedup fan-out and own rows in place); the plain ones are reported beside them.
  const Best dp = best_of(sh, Kind::kDispatch, 24, false), dd = best_of(sh, Kind::kDispatch, 24, true);
  const Best d = dd.ms < dp.ms ? dd : dp;
  const Best cs = best_of(sh, Kind::kCombine, 24, false, "", 0), ci = best_of(sh, Kind::kCombine, 24, false, "", 1);
  const Best c = ci.ms < cs.ms ? ci : cs;
  const Best d0 = best_of(sh, Kind::kDispatch, 24, false, "warp"), c0 = best_of(sh, Kind::kCombine, 24, false, "warp");
  const Best pw = best_of(sh, Kind::kCopy, 1 << 30, false, "pull_warp");
  // The same-bytes baselines of the dedup dispatch's NVLink traffic (distinct (token, rank) bytes).
  const Best pm = best_of(sh, Kind::kCopy, 1 << 30, false, "pull_warp_min");
  const double nccl_min_ms = sh.failed || ep < 2 ? NAN : worst(sh.nccl_min_ms);
  const Best cp = best_of(sh, Kind::kCopy, 1 << 30, false);
  auto gbps = [&](double bytes, double ms) { return bytes / ms / 1e6; };

  std::printf("\nbench_comm: EP=%d, T=%lld/rank, H=%lld, E=%lld, K=%d%s\n", ep, static_cast<long long>(shape.tokens),
              static_cast<long long>(shape.hidden), static_cast<long long>(shape.experts), shape.topk,
              ep == 1 ? " [EP=1: self-copy through HBM, no NVLink; EP=2 NOT measured]" : "");
  std::printf("per rank, one way: remote rows %.1f MB (NVLink, plain), distinct remote (token,rank) %.1f MB "
              "(NVLink, dedup), own-rank rows %.1f MB (local HBM), padding %.1f MB (zeros)\n",
              moved / 1e6, minimum / 1e6, w.self * rb / 1e6, w.padding * rb / 1e6);
  if (sh.failed) std::printf("SWEEP STOPPED: %s\n", sh.failure.c_str());
  // pull_ms/ms and nccl_ms/ms: time ratios (> 1 = faster than the best plain pull copy of the
  // remote bytes / than NCCL); for plain variants pull_ms/ms is also the NVLink GB/s ratio.
  std::printf("%-9s %-11s %5s %9s %10s %10s %10s\n", "kind", "variant", "ctas", "ms", "NVLinkGB/s", "pull_ms/ms",
              "nccl_ms/ms");
  std::ostringstream sweep;
  bool first = true;
  for (const Point& p : sh.points) {
    const double ms = p.worst();
    if (!(ms > 0)) continue;
    const double g = gbps(nvlink_bytes(p), ms);
    std::printf("%-9s %-11s %5d %9.3f %10.1f %10.3f %10.3f\n", kind_name(p.v.kind), p.v.name.c_str(), p.ctas, ms, g,
                pw.p ? pw.ms / ms : NAN, nccl_ms / ms);
    sweep << (first ? "" : ",\n    ") << "{\"kind\": \"" << kind_name(p.v.kind) << "\", \"variant\": \"" << p.v.name
          << "\", \"comm_ctas\": " << p.ctas << ", \"ms\": " << fmt(ms) << ", \"nvlink_bytes\": "
          << static_cast<int64_t>(nvlink_bytes(p)) << ", \"nvlink_GBps\": " << fmt(g) << "}";
    first = false;
  }
  std::printf("NCCL all-to-all (same bytes per pair, own share included): %.3f ms = %.1f GB/s of remote bytes\n", nccl_ms,
              gbps(moved, nccl_ms));
  if (dp.p) std::printf("best plain dispatch <= 24 CTAs: %s @%d %.3f ms (%.1f GB/s)\n", dp.p->v.name.c_str(), dp.p->ctas, dp.ms, gbps(moved, dp.ms));
  if (dd.p) std::printf("best dedup dispatch <= 24 CTAs: %s @%d %.3f ms (%.1f GB/s NVLink, %.1f GB/s of (token, k) rows delivered)\n",
                        dd.p->v.name.c_str(), dd.p->ctas, dd.ms, gbps(minimum, dd.ms), gbps(moved, dd.ms));
  if (pm.p || std::isfinite(nccl_min_ms)) {
    std::printf("the dedup dispatch's NVLink bytes alone (%.1f MB): pull copy %.3f ms (%.1f GB/s), NCCL all-to-all "
                "%.3f ms (%.1f GB/s)\n", minimum / 1e6, pm.ms, gbps(minimum, pm.ms), nccl_min_ms,
                gbps(minimum, nccl_min_ms));
  }
  if (cs.p) std::printf("best combine into every slot <= 24 CTAs: %s @%d %.3f ms (%.1f GB/s)\n", cs.p->v.name.c_str(), cs.p->ctas, cs.ms, gbps(moved, cs.ms));
  if (ci.p) std::printf("best combine, own rows in place, <= 24 CTAs: %s @%d %.3f ms (%.1f GB/s)\n", ci.p->v.name.c_str(), ci.p->ctas, ci.ms, gbps(moved, ci.ms));
  if (!sh.failed) {
    std::printf("epilogue: %.3f ms from the slots, %.3f ms with own rows in place; NCCL + epilogue %.3f ms, "
                "best combine + its epilogue %.3f ms\n", worst(sh.epilogue_ms), worst(sh.epilogue_in_place_ms),
                nccl_ms + worst(sh.epilogue_ms), c.ms + (c.p && c.p->v.in_place ? worst(sh.epilogue_in_place_ms) : worst(sh.epilogue_ms)));
  }

  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  int nccl_version = 0;
  ncclGetVersion(&nccl_version);
  auto name_of = [](const Best& b) { return b.p ? "\"" + b.p->v.name + "\"" : std::string("null"); };
  auto ctas_of = [](const Best& b) { return b.p ? std::to_string(b.p->ctas) : std::string("null"); };
  std::ostringstream j;
  j << "[{\n  \"bench\": \"comm\",\n  \"shape\": \"dsv3\",\n  \"ep\": " << ep << ",\n  \"device\": \"" << prop.name
    << "\",\n  \"nccl\": \"" << comm::nccl_version_string(nccl_version) << "\",\n  \"tokens_per_rank\": " << shape.tokens
    << ", \"hidden\": " << shape.hidden << ", \"experts\": " << shape.experts << ", \"topk\": " << shape.topk
    << ",\n  \"routing\": \"uniform\",\n  \"ep2_measured\": " << (ep >= 2 ? "true" : "false")
    << ",\n  \"complete\": " << (sh.failed ? "false" : "true") << ",\n  \"bytes_basis\": \""
    << (ep > 1 ? "per rank, one way; GB/s = bytes / slowest rank's median time. dispatch_GBps, combine_GBps, "
                 "nccl_a2a_GBps, p2p_copy_GBps: dispatch_bytes_moved (other ranks' rows, one per (token, k)) over "
                 "the time of the fastest variant at <= 24 CTAs (dispatch_engine, combine_engine). The dedup "
                 "dispatch moves only dispatch_bytes_min over NVLink (dispatch_nvlink_GBps) and delivers the same "
                 "(token, k) rows; the in-place combine moves exactly dispatch_bytes_moved over NVLink and leaves the "
                 "own rank's rows (self_bytes) in place for the epilogue (epilogue_in_place_ms). NCCL copies the own "
                 "share locally; the plain copies move the remote bytes only. p2p_copy_min_GBps, nccl_a2a_min_GBps: "
                 "dispatch_bytes_min (each distinct (token, other rank) row once) over the time of a plain pull "
                 "copy of exactly those bytes and of NCCL all-to-all of exactly those bytes (own share excluded): "
                 "the same-bytes baselines of dispatch_dedup_nvlink_GBps"
               : "EP=1 self-copy through HBM (no NVLink); EP=2 figures not measured")
    << "\",\n  \"metrics\": {"
    << "\"dispatch_GBps\": " << fmt(gbps(moved, d.ms)) << ", \"combine_GBps\": " << fmt(gbps(moved, c.ms))
    << ", \"dispatch_nvlink_GBps\": " << fmt(d.p ? gbps(nvlink_bytes(*d.p), d.ms) : NAN)
    << ", \"dispatch_ms\": " << fmt(d.ms) << ", \"combine_ms\": " << fmt(c.ms)
    << ", \"nccl_a2a_GBps\": " << fmt(gbps(moved, nccl_ms)) << ", \"p2p_copy_GBps\": " << fmt(gbps(moved, pw.ms))
    << ", \"comm_ctas\": " << ctas_of(d) << ", \"dispatch_bytes_moved\": " << static_cast<int64_t>(moved)
    << ", \"dispatch_bytes_min\": " << static_cast<int64_t>(minimum) << ",\n    \"dispatch_engine\": " << name_of(d)
    << ", \"combine_engine\": " << name_of(c) << ", \"combine_ctas\": " << ctas_of(c)
    << ", \"nccl_a2a_ms\": " << fmt(nccl_ms) << ", \"p2p_copy_ms\": " << fmt(pw.ms) << ", \"p2p_copy_ctas\": " << ctas_of(pw)
    << ", \"copy_best_GBps\": " << fmt(gbps(moved, cp.ms)) << ", \"copy_best\": " << name_of(cp)
    << ", \"copy_best_ctas\": " << ctas_of(cp) << ",\n    \"dispatch_dedup_ms\": " << fmt(dd.ms)
    << ", \"dispatch_dedup_engine\": " << name_of(dd) << ", \"dispatch_dedup_ctas\": " << ctas_of(dd)
    << ", \"dispatch_dedup_nvlink_GBps\": " << fmt(gbps(minimum, dd.ms))
    << ", \"dispatch_plain_ms\": " << fmt(dp.ms) << ", \"dispatch_plain_engine\": " << name_of(dp)
    << ", \"dispatch_plain_ctas\": " << ctas_of(dp) << ", \"combine_all_slots_ms\": " << fmt(cs.ms)
    << ", \"combine_all_slots_engine\": " << name_of(cs) << ", \"combine_all_slots_ctas\": " << ctas_of(cs)
    << ", \"combine_in_place_ms\": " << fmt(ci.ms) << ", \"combine_in_place_ctas\": " << ctas_of(ci)
    << ",\n    \"dispatch_warp_ms\": " << fmt(d0.ms) << ", \"dispatch_warp_ctas\": " << ctas_of(d0)
    << ", \"combine_warp_ms\": " << fmt(c0.ms) << ", \"combine_warp_ctas\": " << ctas_of(c0)
    << ", \"self_bytes\": " << static_cast<int64_t>(w.self * rb) << ", \"padding_bytes\": " << static_cast<int64_t>(w.padding * rb)
    << ", \"epilogue_ms\": " << fmt(sh.failed ? NAN : worst(sh.epilogue_ms))
    << ", \"epilogue_in_place_ms\": " << fmt(sh.failed ? NAN : worst(sh.epilogue_in_place_ms))
    << ", \"schedule_ms\": " << fmt(sh.failed ? NAN : worst(sh.schedule_ms))
    << ",\n    \"p2p_copy_min_ms\": " << fmt(pm.ms) << ", \"p2p_copy_min_GBps\": " << fmt(gbps(minimum, pm.ms))
    << ", \"p2p_copy_min_ctas\": " << ctas_of(pm) << ", \"nccl_a2a_min_ms\": " << fmt(nccl_min_ms)
    << ", \"nccl_a2a_min_GBps\": " << fmt(gbps(minimum, nccl_min_ms)) << "},\n  \"sweep\": [\n    " << sweep.str()
    << "]\n}]";
  std::ofstream f(sh.o.out);
  f << bench::record_envelope(command, j.str());
  std::printf("wrote %s%s\n", sh.o.out.c_str(), f ? "" : " (FAILED)");
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const std::vector<Variant> variants = plan(o);  // unknown variant names fail here, GPU or not
  const std::string command = bench::command_line(argc, argv);
  const int gpus = bootstrap::local_device_count();
  if (gpus < 1) {
    std::printf("bench_comm: no CUDA device visible, nothing measured\n");
    return 0;
  }
  const int ep = o.ep > 0 ? std::min(o.ep, gpus) : gpus;
  const LayerShape shape = dsv3_shape(ep, o.tokens);
  Config cfg;  // capacity 2.0 (min(capacity, ep) x T*K rows per rank)
  cfg.wait_timeout_s = 2.0;  // a broken variant stops the sweep in seconds
  const auto routing = bench::uniform_routing(shape, 2026);
  std::vector<std::vector<int64_t>> pair_rows(ep, std::vector<int64_t>(ep, 0));  // [src][dst]
  std::vector<std::vector<int64_t>> pair_tokens(ep, std::vector<int64_t>(ep, 0));  // distinct tokens [src][dst]
  std::vector<char> to(ep);  // ranks token t of rank s goes to
  for (int s = 0; s < ep; ++s) {
    for (int32_t e : routing[s]) ++pair_rows[s][shape.owner_rank(e)];
    for (int64_t t = 0; t < shape.tokens; ++t) {
      std::fill(to.begin(), to.end(), 0);
      for (int k = 0; k < shape.topk; ++k) to[shape.owner_rank(routing[s][t * shape.topk + k])] = 1;
      for (int d = 0; d < ep; ++d) pair_tokens[s][d] += to[d];
    }
  }
  std::vector<Point> points;
  for (const Variant& v : variants) {
    for (int c : o.ctas) points.push_back(Point{v, c});
  }
  Shared sh(o, shape, std::move(points));
  std::vector<int> devices(ep);
  for (int i = 0; i < ep; ++i) devices[i] = i;
  std::printf("bench_comm: EP=%d (%d GPU(s) visible), %zu points\n", ep, gpus, sh.points.size());
  bootstrap::run_local_ranks(devices, [&](bootstrap::LocalRank& lr) {
    try {
      run_rank(sh, cfg, routing, pair_rows, pair_tokens, lr, command);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: %s\n", lr.rank, e.what());
      if (!sh.failed.exchange(true)) sh.failure = e.what();
      sh.sync.arrive_and_drop();  // the other ranks must not wait for this one
      throw;
    }
  });
  return sh.failed ? 1 : 0;
}
