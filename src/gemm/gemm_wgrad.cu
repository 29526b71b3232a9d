// wgrad launcher: K-grouped weight gradients over each expert's rows (sm_90a).
#include <algorithm>
#include <string>

#include "gemm/grouped_gemm.hpp"
#include "gemm/sm90_kinds_wgrad.cuh"
#include "gemm/sm90_launch.cuh"
#include "gemm/wgrad_params.cuh"
#include "mok/error.hpp"

namespace mok::gemm {

namespace {
// One kernel per output mode and per "some problem continues an fp32 partial".
template <bool Seeded>
void launch_mode(WgradOut mode, const WgradParams& p, const Launch& l, cudaStream_t stream) {
  switch (mode) {
    case WgradOut::kPartialFp32: host::launch_kind<WgradKind<kWgradPartialFp32, 1, Seeded>>(p, l, stream); break;
    case WgradOut::kWriteBf16: host::launch_kind<WgradKind<kWgradWriteBf16, 1, Seeded>>(p, l, stream); break;
    case WgradOut::kAccumulateFp32: host::launch_kind<WgradKind<kWgradAccumulateFp32, 1, Seeded>>(p, l, stream); break;
  }
}
}  // namespace

WgradParams wgrad_params(const WgradArgs& a, const Launch& launch, int64_t* tiles_out) {
  host::check_segments(a.seg);
  host::check_launch(launch);
  if (a.num_problems < 1 || a.num_problems > kMaxWgradProblemsPerCall) {
    throw_invalid("num_problems", "in [1, 3]", std::to_string(a.num_problems));
  }
  const int mode = static_cast<int>(a.mode);
  if (mode < 0 || mode > 2) throw_invalid("mode", "a WgradOut value", std::to_string(mode));
  static_assert(int(WgradOut::kPartialFp32) == kWgradPartialFp32 && int(WgradOut::kWriteBf16) == kWgradWriteBf16 &&
                int(WgradOut::kAccumulateFp32) == kWgradAccumulateFp32);
  const int64_t R = a.seg.buffer_rows, E = a.seg.experts;
  constexpr int tile_n = WgradKind<kWgradWriteBf16, 1>::Cfg::kBN;  // cooperative 128 x 256 tiles
  WgradParams p{};
  p.sched.offsets = a.seg.offsets;
  p.sched.rows = a.seg.rows;
  p.sched.row_begin = a.row_begin;
  p.sched.row_end = a.row_end;
  p.sched.experts = a.seg.experts;
  p.sched.num_problems = a.num_problems;
  p.sched.group_m = kGroupM;
  int64_t tiles = 0;
  for (int q = 0; q < a.num_problems; ++q) {
    const WgradProblem& pr = a.problems[q];
    const std::string name = "problems[" + std::to_string(q) + "]";
    host::check_multiple((name + ".m").c_str(), pr.m, 64);
    host::check_multiple((name + ".n").c_str(), pr.n, 64);
    host::check_pointer((name + ".a").c_str(), pr.a);
    host::check_pointer((name + ".b").c_str(), pr.b);
    host::check_pointer((name + ".out").c_str(), pr.out);
    if (pr.partial_in != nullptr) host::check_pointer((name + ".partial_in").c_str(), pr.partial_in);
    if (pr.out_stride != 0 && (a.mode == WgradOut::kPartialFp32 || pr.out_stride < pr.m * pr.n || pr.out_stride % 8 != 0)) {
      throw_invalid((name + ".out_stride").c_str(),
                    "0, or (kWriteBf16 / kAccumulateFp32) a multiple of 8 >= m*n = " + std::to_string(pr.m * pr.n),
                    std::to_string(pr.out_stride));
    }
    WgradProblemParams& kp = p.problems[q];
    kp.a = host::map_bf16(pr.a, 0, R, pr.m, 64, 64, "wgrad a");
    kp.b = host::map_bf16(pr.b, 0, R, pr.n, 64, 64, "wgrad b");
    if (a.mode == WgradOut::kWriteBf16) {
      kp.out = host::map_bf16(pr.out, E, pr.m, pr.n, 64, 64, "wgrad out", pr.out_stride);
    } else if (a.mode == WgradOut::kAccumulateFp32) {
      kp.out = host::map_f32(pr.out, E, pr.m, pr.n, 32, 64, "wgrad main grad", pr.out_stride);  // TMA load / store boxes
    } else {
      kp.out = kp.b;  // unused: kPartialFp32 stores through out_ptr
    }
    kp.m = static_cast<int>(pr.m);
    kp.n = static_cast<int>(pr.n);
    kp.partial_in = pr.partial_in;
    kp.out_ptr = pr.out;
    p.sched.m_tiles[q] = static_cast<int>((pr.m + 127) / 128);
    p.sched.n_tiles[q] = static_cast<int>((pr.n + tile_n - 1) / tile_n);
    tiles += E * p.sched.m_tiles[q] * p.sched.n_tiles[q];
  }
  if (tiles >= (int64_t{1} << 31)) throw_invalid("wgrad problem", "fewer than 2^31 tiles", std::to_string(tiles));
  p.err = host::error_sink(launch);
  // wgrad runs without clusters (launch.cluster is ignored): its 2-CTA variant spilled
  // registers (docs/gemm.md) and its K loops are short, so B multicast has little to save.
  p.sched.cluster = 1;
  if (tiles_out != nullptr) *tiles_out = tiles;
  return p;
}

void wgrad(const WgradArgs& a, const Launch& launch, cudaStream_t stream) {
  int64_t tiles = 0;
  const WgradParams p = wgrad_params(a, launch, &tiles);
  Launch l = launch;
  // The host knows the tile count: no more CTAs than tiles.
  l.grid = static_cast<int>(std::min<int64_t>(host::resolve_grid(launch), tiles));
  // The seeding kernel only when some problem continues an fp32 partial (without one the
  // plain-zeros seed measured +18 % on bf16 wgrad, docs/gemm.md 2026-11-30; same bits).
  bool seeded = false;
  for (int q = 0; q < a.num_problems; ++q) seeded = seeded || a.problems[q].partial_in != nullptr;
  if (seeded) {
    launch_mode<true>(a.mode, p, l, stream);
  } else {
    launch_mode<false>(a.mode, p, l, stream);
  }
}

}  // namespace mok::gemm
