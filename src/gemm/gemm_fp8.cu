// Launchers of the FP8 kinds (sm_90a): validation, TMA descriptors, launch.
#include <string>

#include "mok/error.hpp"

#include "gemm/grouped_gemm_fp8.hpp"
#include "gemm/sm90_kinds_fp8.cuh"
#include "gemm/sm90_launch.cuh"

namespace mok::gemm {

namespace {
int64_t blocks_of(int64_t n) { return (n + 127) / 128; }
}  // namespace

void gemm2_fp8(const Gemm2Fp8Args& a, const Launch& launch, cudaStream_t stream) {
  using host::check_pointer;
  host::check_row_problem(a.seg, launch, a.hidden, a.intermediate);
  if (launch.cluster == 2) throw_invalid("launch.cluster", "0 or 1 (FP8 kinds run without clusters)", "2");
  check_pointer("h.codes", a.h.codes);
  check_pointer("h.scales", a.h.scales);
  check_pointer("w_down.codes", a.w_down.codes);
  check_pointer("w_down.scales", a.w_down.scales);
  check_pointer("out", a.out);
  const int64_t R = a.seg.buffer_rows, H = a.hidden, I = a.intermediate, E = a.seg.experts;
  Gemm2Fp8Params p;
  p.h = host::map_e4m3(a.h.codes, 0, R, I, 128, 128, "h.codes");
  p.h_scales = host::map_f32_plain(a.h.scales, blocks_of(I), R, 128, "h.scales");
  p.w_down = host::map_e4m3(a.w_down.codes, E, H, I, 128, 128, "w_down.codes");
  p.w_scales = a.w_down.scales;
  p.out = host::map_bf16(a.out, 0, R, H, 64, 64, "out");
  p.sched = host::row_scheduler(a.seg, H, 128, kGroupM);
  p.k_steps = static_cast<int>(blocks_of(I));
  p.hidden = static_cast<int>(H);
  p.err = host::error_sink(launch);
  p.sched.cluster = 1;
  host::launch_kind<Gemm2Fp8Kind<1>>(p, launch, stream);
}

void gemm1_swiglu_fp8(const Gemm1SwigluFp8Args& a, const Launch& launch, cudaStream_t stream) {
  using host::check_pointer;
  host::check_row_problem(a.seg, launch, a.hidden, a.intermediate);
  if (launch.cluster == 2) throw_invalid("launch.cluster", "0 or 1 (FP8 kinds run without clusters)", "2");
  check_pointer("x.codes", a.x.codes);
  check_pointer("x.scales", a.x.scales);
  check_pointer("w_gate.codes", a.w_gate.codes);
  check_pointer("w_gate.scales", a.w_gate.scales);
  check_pointer("w_up.codes", a.w_up.codes);
  check_pointer("w_up.scales", a.w_up.scales);
  check_pointer("g", a.g);
  check_pointer("u", a.u);
  if (a.h != nullptr) check_pointer("h", a.h);
  check_pointer("h_codes", a.h_codes);
  check_pointer("h_scales", a.h_scales);
  if (a.nonfinite == nullptr) throw_invalid("nonfinite", "a device NonFiniteRecord", "nullptr");
  const int64_t R = a.seg.buffer_rows, H = a.hidden, I = a.intermediate, E = a.seg.experts;
  Gemm1SwigluFp8Params p;
  p.x = host::map_e4m3(a.x.codes, 0, R, H, 128, 128, "x.codes");
  p.x_scales = host::map_f32_plain(a.x.scales, blocks_of(H), R, 128, "x.scales");
  p.w_gate = host::map_e4m3(a.w_gate.codes, E, I, H, 128, 128, "w_gate.codes");
  p.w_up = host::map_e4m3(a.w_up.codes, E, I, H, 128, 128, "w_up.codes");
  p.wg_scales = a.w_gate.scales;
  p.wu_scales = a.w_up.scales;
  p.g = host::map_bf16(a.g, 0, R, I, 64, 64, "g");
  p.u = host::map_bf16(a.u, 0, R, I, 64, 64, "u");
  // Without h the h round stores nothing (zero columns); its map is g's, never used.
  p.h = a.h != nullptr ? host::map_bf16(a.h, 0, R, I, 64, 64, "h") : p.g;
  p.h_cols = a.h != nullptr ? static_cast<int>(I) : 0;
  p.h_codes = a.h_codes;
  p.h_scales = a.h_scales;
  p.rows = R;
  p.nonfinite = a.nonfinite;
  p.sched = host::row_scheduler(a.seg, I, 128, kGroupM);
  p.k_steps = static_cast<int>(blocks_of(H));
  p.inter = static_cast<int>(I);
  p.err = host::error_sink(launch);
  p.sched.cluster = 1;
  host::launch_kind<Gemm1SwigluFp8Kind<1>>(p, launch, stream);
}

void dgrad_input_fp8(const DgradInputFp8Args& a, const Launch& launch, cudaStream_t stream) {
  using host::check_pointer;
  host::check_row_problem(a.seg, launch, a.hidden, a.intermediate);
  if (launch.cluster == 2) throw_invalid("launch.cluster", "0 or 1 (FP8 kinds run without clusters)", "2");
  check_pointer("dg.codes", a.dg.codes);
  check_pointer("dg.scales", a.dg.scales);
  check_pointer("du.codes", a.du.codes);
  check_pointer("du.scales", a.du.scales);
  check_pointer("w_gate_t.codes", a.w_gate_t.codes);
  check_pointer("w_gate_t.scales", a.w_gate_t.scales);
  check_pointer("w_up_t.codes", a.w_up_t.codes);
  check_pointer("w_up_t.scales", a.w_up_t.scales);
  check_pointer("dx", a.dx);
  const int64_t R = a.seg.buffer_rows, H = a.hidden, I = a.intermediate, E = a.seg.experts;
  DgradInputFp8Params p;
  p.dg = host::map_e4m3(a.dg.codes, 0, R, I, 128, 128, "dg.codes");
  p.du = host::map_e4m3(a.du.codes, 0, R, I, 128, 128, "du.codes");
  p.dg_scales = host::map_f32_plain(a.dg.scales, blocks_of(I), R, 128, "dg.scales");
  p.du_scales = host::map_f32_plain(a.du.scales, blocks_of(I), R, 128, "du.scales");
  p.wg_t = host::map_e4m3(a.w_gate_t.codes, E, H, I, 128, 128, "w_gate_t.codes");
  p.wu_t = host::map_e4m3(a.w_up_t.codes, E, H, I, 128, 128, "w_up_t.codes");
  p.wg_t_scales = a.w_gate_t.scales;
  p.wu_t_scales = a.w_up_t.scales;
  p.dx = host::map_bf16(a.dx, 0, R, H, 64, 64, "dx");
  p.sched = host::row_scheduler(a.seg, H, 128, kGroupM);
  p.k_steps = static_cast<int>(2 * blocks_of(I));
  p.hidden = static_cast<int>(H);
  p.err = host::error_sink(launch);
  p.sched.cluster = 1;
  host::launch_kind<DgradInputFp8Kind<1>>(p, launch, stream);
}

void dgrad_hidden_swiglu_fp8(const DgradHiddenFp8Args& a, const Launch& launch, cudaStream_t stream) {
  using host::check_pointer;
  host::check_row_problem(a.seg, launch, a.hidden, a.intermediate);
  if (launch.cluster == 2) throw_invalid("launch.cluster", "0 or 1 (FP8 kinds run without clusters)", "2");
  check_pointer("dys.codes", a.dys.codes);
  check_pointer("dys.scales", a.dys.scales);
  check_pointer("w_down_t.codes", a.w_down_t.codes);
  check_pointer("w_down_t.scales", a.w_down_t.scales);
  check_pointer("g", a.g);
  check_pointer("u", a.u);
  check_pointer("dg", a.dg);
  check_pointer("du", a.du);
  check_pointer("dg_codes", a.dg_codes);
  check_pointer("du_codes", a.du_codes);
  check_pointer("dg_scales", a.dg_scales);
  check_pointer("du_scales", a.du_scales);
  if (a.nonfinite == nullptr) throw_invalid("nonfinite", "a device NonFiniteRecord", "nullptr");
  if (a.row_w != nullptr && a.dw_part == nullptr) {
    throw_invalid("dw_part", "a device array [buffer_rows, ceil(I/256)] with row_w", "nullptr");
  }
  const int64_t R = a.seg.buffer_rows, H = a.hidden, I = a.intermediate, E = a.seg.experts;
  DgradHiddenFp8Params p;
  p.dys = host::map_e4m3(a.dys.codes, 0, R, H, 128, 128, "dys.codes");
  p.dys_scales = host::map_f32_plain(a.dys.scales, blocks_of(H), R, 128, "dys.scales");
  p.w_down_t = host::map_e4m3(a.w_down_t.codes, E, I, H, 128, 128, "w_down_t.codes");
  p.wd_t_scales = a.w_down_t.scales;
  p.i_blocks = static_cast<int>(blocks_of(I));
  p.dg = host::map_bf16(a.dg, 0, R, I, 64, 64, "dg");
  p.du = host::map_bf16(a.du, 0, R, I, 64, 64, "du");
  p.g = host::map_bf16(a.g, 0, R, I, 64, 128, "g");  // the epilogue stages' boxes
  p.u = host::map_bf16(a.u, 0, R, I, 64, 128, "u");
  p.row_w = a.row_w;
  p.dw_part = a.dw_part;
  p.col_tiles = static_cast<int>(dgrad_hidden_col_tiles(I));
  p.dg_codes = a.dg_codes;
  p.du_codes = a.du_codes;
  p.dg_scales = a.dg_scales;
  p.du_scales = a.du_scales;
  p.rows = R;
  p.nonfinite = a.nonfinite;
  p.sched = host::row_scheduler(a.seg, I, 256, kGroupM);
  p.k_steps = static_cast<int>(blocks_of(H));
  p.inter = static_cast<int>(I);
  p.err = host::error_sink(launch);
  p.sched.cluster = 1;
  if (a.row_w != nullptr) {
    host::launch_kind<DgradHiddenRoutedFp8Kind<1>>(p, launch, stream);
  } else {
    host::launch_kind<DgradHiddenFp8Kind<1>>(p, launch, stream);
  }
}

void wgrad_fp8(const WgradFp8Args& a, const Launch& launch, cudaStream_t stream) {
  using host::check_pointer;
  host::check_segments(a.seg);
  host::check_launch(launch);
  if (a.num_problems < 1 || a.num_problems > kMaxWgradProblemsPerCall) {
    throw_invalid("num_problems", "in [1, " + std::to_string(kMaxWgradProblemsPerCall) + "]",
                  std::to_string(a.num_problems));
  }
  const int64_t R = a.seg.buffer_rows;
  WgradFp8Params p{};
  for (int q = 0; q < a.num_problems; ++q) {
    const WgradFp8Problem& pr = a.problems[q];
    const std::string n = "problems[" + std::to_string(q) + "].";
    host::check_multiple((n + "m").c_str(), pr.m, 64);
    host::check_multiple((n + "n").c_str(), pr.n, 64);
    check_pointer((n + "a.codes").c_str(), pr.a.codes);
    check_pointer((n + "a.scales").c_str(), pr.a.scales);
    check_pointer((n + "b.codes").c_str(), pr.b.codes);
    check_pointer((n + "b.scales").c_str(), pr.b.scales);
    check_pointer((n + "out").c_str(), pr.out);
    WgradFp8ProblemParams& pp = p.problems[q];
    pp.a = host::map_e4m3(pr.a.codes, 0, pr.m, R, 128, 128, "a.codes");
    pp.b = host::map_e4m3(pr.b.codes, 0, pr.n, R, 128, 128, "b.codes");
    pp.a_scales = host::map_f32_plain(pr.a.scales, R / 128, pr.m, 128, "a.scales");
    pp.b_scales = host::map_f32_plain(pr.b.scales, R / 128, pr.n, 128, "b.scales");
    pp.m = static_cast<int>(pr.m);
    pp.n = static_cast<int>(pr.n);
    pp.out = pr.out;
    p.sched.m_tiles[q] = static_cast<int>(blocks_of(pr.m));
    p.sched.n_tiles[q] = static_cast<int>(blocks_of(pr.n));
  }
  p.sched.offsets = a.seg.offsets;
  p.sched.rows = a.seg.rows;
  p.sched.row_begin = nullptr;
  p.sched.row_end = nullptr;
  p.sched.experts = a.seg.experts;
  p.sched.num_problems = a.num_problems;
  p.sched.group_m = kGroupM;
  p.sched.cluster = 1;
  p.err = host::error_sink(launch);
  switch (a.mode) {
    case WgradOut::kPartialFp32: host::launch_kind<WgradFp8Kind<kWgradPartialFp32>>(p, launch, stream); break;
    case WgradOut::kWriteBf16: host::launch_kind<WgradFp8Kind<kWgradWriteBf16>>(p, launch, stream); break;
    case WgradOut::kAccumulateFp32: host::launch_kind<WgradFp8Kind<kWgradAccumulateFp32>>(p, launch, stream); break;
    default: throw_invalid("mode", "a WgradOut value", std::to_string(static_cast<int>(a.mode)));
  }
}

}  // namespace mok::gemm
