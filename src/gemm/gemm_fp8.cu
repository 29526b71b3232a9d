// Launchers of the FP8 kinds (sm_90a): validation, TMA descriptors, launch.
#include <string>

#include "mok/error.hpp"

#include "gemm/grouped_gemm_fp8.hpp"
#include "gemm/sm90_kinds_fp8.cuh"
#include "gemm/sm90_launch.cuh"

namespace mok::gemm {

namespace {

int64_t blocks_of(int64_t n) { return (n + 127) / 128; }

// What every row-grouped FP8 GEMM checks: the bf16 row kinds' checks, and no clusters.
void check_fp8_row_problem(const Segments& seg, const Launch& launch, int64_t hidden, int64_t intermediate) {
  host::check_row_problem(seg, launch, hidden, intermediate);
  if (launch.cluster == 2) throw_invalid("launch.cluster", "0 or 1 (FP8 kinds run without clusters)", "2");
}

// An FP8 operand (Fp8Rows, Fp8Weights, Fp8Transposed): both device pointers, named <name>.codes, .scales.
template <class Operand>
void check_operand(const std::string& name, const Operand& op) {
  host::check_pointer((name + ".codes").c_str(), op.codes);
  host::check_pointer((name + ".scales").c_str(), op.scales);
}

void check_record(const NonFiniteRecord* record) {
  if (record == nullptr) throw_invalid("nonfinite", "a device NonFiniteRecord", "nullptr");
}

// The TMA maps of an operand quantized 1x128 along its k columns: codes [rows, k], box 128 x 128, and
// scales [ceil(k / 128), rows], box 128 x 1. Also the transposed weight-gradient operands (Fp8Transposed:
// rows = m or n, k = the buffer rows).
template <class Operand>
void map_rows(const Operand& op, int64_t rows, int64_t k, const std::string& name, CUtensorMap& codes,
              CUtensorMap& scales) {
  int64_t ld = 0;
  if constexpr (requires { op.ld; }) ld = op.ld;  // Fp8Rows may be strided; the transposed operands are dense
  codes = host::map_e4m3(op.codes, 0, rows, k, 128, 128, (name + ".codes").c_str(), 0, ld);
  scales = host::map_f32_plain(op.scales, blocks_of(k), rows, 128, (name + ".scales").c_str());
}

// The codes of a weight stack [E, n, k] (128x128 blocks; the kinds read its scales directly), box 128 x 128 x 1.
CUtensorMap map_weights(const Fp8Weights& w, int64_t experts, int64_t n, int64_t k, const std::string& name) {
  return host::map_e4m3(w.codes, experts, n, k, 128, 128, (name + ".codes").c_str());
}

// Launches an FP8 kind (no clusters) with the launch's error sink.
template <class Kind>
void launch_fp8(typename Kind::Params& p, const Launch& launch, cudaStream_t stream) {
  p.err = host::error_sink(launch);
  p.sched.cluster = 1;
  host::launch_kind<Kind>(p, launch, stream);
}

}  // namespace

void gemm2_fp8(const Gemm2Fp8Args& a, const Launch& launch, cudaStream_t stream) {
  check_fp8_row_problem(a.seg, launch, a.hidden, a.intermediate);
  check_operand("h", a.h);
  check_operand("w_down", a.w_down);
  host::check_pointer("out", a.out);
  const int64_t R = a.seg.buffer_rows, H = a.hidden, I = a.intermediate, E = a.seg.experts;
  Gemm2Fp8Params p;
  map_rows(a.h, R, I, "h", p.h, p.h_scales);
  p.w_down = map_weights(a.w_down, E, H, I, "w_down");
  p.w_scales = a.w_down.scales;
  p.out = host::map_bf16(a.out, 0, R, H, 64, 64, "out");
  p.sched = host::row_scheduler(a.seg, H, 128, kGroupM);
  p.k_steps = static_cast<int>(blocks_of(I));
  p.hidden = static_cast<int>(H);
  launch_fp8<Gemm2Fp8Kind<1>>(p, launch, stream);
}

void gemm1_swiglu_fp8(const Gemm1SwigluFp8Args& a, const Launch& launch, cudaStream_t stream) {
  using host::check_pointer;
  check_fp8_row_problem(a.seg, launch, a.hidden, a.intermediate);
  check_operand("x", a.x);
  check_operand("w_gate", a.w_gate);
  check_operand("w_up", a.w_up);
  const bool gu8 = a.g_codes != nullptr || a.u_codes != nullptr || a.g_scales != nullptr || a.u_scales != nullptr;
  if (gu8) {  // g, u quantized in the epilogue: all four pointers and a record; bf16 g, u optional (both or none)
    check_pointer("g_codes", a.g_codes);
    check_pointer("g_scales", a.g_scales);
    check_pointer("u_codes", a.u_codes);
    check_pointer("u_scales", a.u_scales);
    if (a.gu_nonfinite == nullptr) throw_invalid("gu_nonfinite", "a device NonFiniteRecord (with g_codes)", "nullptr");
    if ((a.g == nullptr) != (a.u == nullptr)) {
      throw_invalid("g, u", "both bf16 outputs or neither (with g_codes)", a.g ? "u nullptr" : "g nullptr");
    }
  }
  if (!gu8 || a.g != nullptr) {
    check_pointer("g", a.g);
    check_pointer("u", a.u);
  }
  if (a.h != nullptr) check_pointer("h", a.h);
  check_pointer("h_codes", a.h_codes);
  check_pointer("h_scales", a.h_scales);
  check_record(a.nonfinite);
  const int64_t R = a.seg.buffer_rows, H = a.hidden, I = a.intermediate, E = a.seg.experts;
  Gemm1SwigluFp8Params p;
  map_rows(a.x, R, H, "x", p.x, p.x_scales);
  p.w_gate = map_weights(a.w_gate, E, I, H, "w_gate");
  p.w_up = map_weights(a.w_up, E, I, H, "w_up");
  p.wg_scales = a.w_gate.scales;
  p.wu_scales = a.w_up.scales;
  // A round without its bf16 output stores nothing (zero columns): its map is never used (left zero).
  p.g = p.u = p.h = CUtensorMap{};
  if (a.g != nullptr) {
    p.g = host::map_bf16(a.g, 0, R, I, 64, 64, "g");
    p.u = host::map_bf16(a.u, 0, R, I, 64, 64, "u");
  }
  if (a.h != nullptr) p.h = host::map_bf16(a.h, 0, R, I, 64, 64, "h");
  p.gu_cols = a.g != nullptr ? static_cast<int>(I) : 0;
  p.h_cols = a.h != nullptr ? static_cast<int>(I) : 0;
  p.h_codes = a.h_codes;
  p.h_scales = a.h_scales;
  p.rows = R;
  p.nonfinite = a.nonfinite;
  p.g_codes = a.g_codes;  // (all four set, or all nullptr: checked above)
  p.u_codes = a.u_codes;
  p.g_scales = a.g_scales;
  p.u_scales = a.u_scales;
  p.gu_nonfinite = a.gu_nonfinite;
  p.sched = host::row_scheduler(a.seg, I, 128, kGroupM);
  p.k_steps = static_cast<int>(blocks_of(H));
  p.inter = static_cast<int>(I);
  launch_fp8<Gemm1SwigluFp8Kind<1>>(p, launch, stream);
}

void dgrad_input_fp8(const DgradInputFp8Args& a, const Launch& launch, cudaStream_t stream) {
  check_fp8_row_problem(a.seg, launch, a.hidden, a.intermediate);
  check_operand("dg", a.dg);
  check_operand("du", a.du);
  check_operand("w_gate_t", a.w_gate_t);
  check_operand("w_up_t", a.w_up_t);
  host::check_pointer("dx", a.dx);
  const int64_t R = a.seg.buffer_rows, H = a.hidden, I = a.intermediate, E = a.seg.experts;
  DgradInputFp8Params p;
  map_rows(a.dg, R, I, "dg", p.dg, p.dg_scales);
  map_rows(a.du, R, I, "du", p.du, p.du_scales);
  p.wg_t = map_weights(a.w_gate_t, E, H, I, "w_gate_t");
  p.wu_t = map_weights(a.w_up_t, E, H, I, "w_up_t");
  p.wg_t_scales = a.w_gate_t.scales;
  p.wu_t_scales = a.w_up_t.scales;
  p.dx = host::map_bf16(a.dx, 0, R, H, 64, 64, "dx");
  p.sched = host::row_scheduler(a.seg, H, 128, kGroupM);
  p.k_steps = static_cast<int>(2 * blocks_of(I));
  p.hidden = static_cast<int>(H);
  launch_fp8<DgradInputFp8Kind<1>>(p, launch, stream);
}

void dgrad_hidden_swiglu_fp8(const DgradHiddenFp8Args& a, const Launch& launch, cudaStream_t stream) {
  using host::check_pointer;
  check_fp8_row_problem(a.seg, launch, a.hidden, a.intermediate);
  check_operand("dys", a.dys);
  check_operand("w_down_t", a.w_down_t);
  check_pointer("g", a.g);
  check_pointer("u", a.u);
  check_pointer("dg", a.dg);
  check_pointer("du", a.du);
  check_pointer("dg_codes", a.dg_codes);
  check_pointer("du_codes", a.du_codes);
  check_pointer("dg_scales", a.dg_scales);
  check_pointer("du_scales", a.du_scales);
  check_record(a.nonfinite);
  if (a.row_w != nullptr && a.dw_part == nullptr) {
    throw_invalid("dw_part", "a device array [buffer_rows, ceil(I/256)] with row_w", "nullptr");
  }
  const int64_t R = a.seg.buffer_rows, H = a.hidden, I = a.intermediate, E = a.seg.experts;
  DgradHiddenFp8Params p;
  map_rows(a.dys, R, H, "dys", p.dys, p.dys_scales);
  p.w_down_t = map_weights(a.w_down_t, E, I, H, "w_down_t");
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
  if (a.row_w != nullptr) {
    launch_fp8<DgradHiddenRoutedFp8Kind<1>>(p, launch, stream);
  } else {
    launch_fp8<DgradHiddenFp8Kind<1>>(p, launch, stream);
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
    check_operand(n + "a", pr.a);
    check_operand(n + "b", pr.b);
    check_pointer((n + "out").c_str(), pr.out);
    WgradFp8ProblemParams& pp = p.problems[q];
    map_rows(pr.a, pr.m, R, n + "a", pp.a, pp.a_scales);
    map_rows(pr.b, pr.n, R, n + "b", pp.b, pp.b_scales);
    pp.m = static_cast<int>(pr.m);
    pp.n = static_cast<int>(pr.n);
    pp.out = pr.out;
    // bf16 output goes out by TMA: its expert stride must be a multiple of 16 bytes.
    const int64_t stride_multiple = a.mode == WgradOut::kWriteBf16 ? 8 : 2;
    if (pr.out_stride != 0 &&
        (a.mode == WgradOut::kPartialFp32 || pr.out_stride < pr.m * pr.n || pr.out_stride % stride_multiple != 0)) {
      throw_invalid(n + "out_stride",
                    "0 (dense), or with mode kWriteBf16 (a multiple of 8) / kAccumulateFp32 (even) a number >= m*n = " +
                        std::to_string(pr.m * pr.n),
                    std::to_string(pr.out_stride));
    }
    pp.out_stride = pr.out_stride != 0 ? pr.out_stride : pr.m * pr.n;
    if (a.mode == WgradOut::kWriteBf16) {
      pp.out_map = host::map_bf16(pr.out, a.seg.experts, pr.m, pr.n, 64, 64, (n + "out").c_str(), pp.out_stride);
    }
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
  switch (a.mode) {
    case WgradOut::kPartialFp32: launch_fp8<WgradFp8Kind<kWgradPartialFp32>>(p, launch, stream); break;
    case WgradOut::kWriteBf16: launch_fp8<WgradFp8Kind<kWgradWriteBf16>>(p, launch, stream); break;
    case WgradOut::kAccumulateFp32: launch_fp8<WgradFp8Kind<kWgradAccumulateFp32>>(p, launch, stream); break;
    default: throw_invalid("mode", "a WgradOut value", std::to_string(static_cast<int>(a.mode)));
  }
}

}  // namespace mok::gemm
