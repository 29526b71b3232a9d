// dgrad launchers: GEMM 2 dgrad with the SwiGLU backward fused, and GEMM 1 dgrad (sm_90a).
#include <algorithm>

#include "mok/error.hpp"

#include "gemm/grouped_gemm.hpp"
#include "gemm/dgrad_params.cuh"
#include "gemm/sm90_kinds_rows.cuh"
#include "gemm/sm90_launch.cuh"

namespace mok::gemm {

DgradHiddenParams dgrad_hidden_params(const DgradHiddenArgs& a, const Launch& launch) {
  using host::check_pointer;
  host::check_row_problem(a.seg, launch, a.hidden, a.intermediate);
  check_pointer("dys", a.dys);
  check_pointer("w_down", a.w_down);
  check_pointer("g", a.g);
  check_pointer("u", a.u);
  check_pointer("dg", a.dg);
  check_pointer("du", a.du);
  const int64_t R = a.seg.buffer_rows, H = a.hidden, I = a.intermediate, E = a.seg.experts;
  DgradHiddenParams p;
  p.dys = host::map_bf16(a.dys, 0, R, H, 64, 128, "dys");
  p.w_down = host::map_bf16(a.w_down, E, H, I, 64, 64, "w_down", a.w_down_stride);
  p.dg = host::map_bf16(a.dg, 0, R, I, 64, 64, "dg");
  p.du = host::map_bf16(a.du, 0, R, I, 64, 64, "du");
  p.row_w = a.row_w;
  p.dw_part = a.dw_part;
  p.col_tiles = static_cast<int>(dgrad_hidden_col_tiles(I));
  p.g = host::map_bf16(a.g, 0, R, I, 64, 128, "g");  // the epilogue stages' boxes
  p.u = host::map_bf16(a.u, 0, R, I, 64, 128, "u");
  p.sched = host::row_scheduler(a.seg, I, 256, kGroupM);
  p.k_steps = static_cast<int>(H / 64);
  p.inter = static_cast<int>(I);
  if (a.row_w != nullptr && a.dw_part == nullptr) {
    throw_invalid("dw_part", "a device array [buffer_rows, ceil(I/256)] with row_w", "nullptr");
  }
  return p;
}

void dgrad_hidden_swiglu(const DgradHiddenArgs& a, const Launch& launch, cudaStream_t stream) {
  DgradHiddenParams p = dgrad_hidden_params(a, launch);
  if (a.row_w != nullptr) {
    host::launch_row_kind<DgradHiddenRoutedKind>(p, launch, stream);
  } else {
    host::launch_row_kind<DgradHiddenKind>(p, launch, stream);
  }
}

DgradInputParams dgrad_input_params(const DgradInputArgs& a, const Launch& launch) {
  using host::check_pointer;
  host::check_row_problem(a.seg, launch, a.hidden, a.intermediate);
  check_pointer("dg", a.dg);
  check_pointer("du", a.du);
  check_pointer("w_gate", a.w_gate);
  check_pointer("w_up", a.w_up);
  check_pointer("dx", a.dx);
  const int64_t R = a.seg.buffer_rows, H = a.hidden, I = a.intermediate, E = a.seg.experts;
  DgradInputParams p;
  p.dg = host::map_bf16(a.dg, 0, R, I, 64, 128, "dg");
  p.du = host::map_bf16(a.du, 0, R, I, 64, 128, "du");
  p.w_gate = host::map_bf16(a.w_gate, E, I, H, 64, 64, "w_gate", a.w_gate_stride);
  p.w_up = host::map_bf16(a.w_up, E, I, H, 64, 64, "w_up", a.w_up_stride);
  p.dx = host::map_bf16(a.dx, 0, R, H, 64, 64, "dx");
  p.sched = host::row_scheduler(a.seg, H, 256, kGroupM);
  p.k_steps = static_cast<int>(2 * I / 64);
  p.hidden = static_cast<int>(H);
  return p;
}

void dgrad_input(const DgradInputArgs& a, const Launch& launch, cudaStream_t stream) {
  DgradInputParams p = dgrad_input_params(a, launch);
  host::launch_row_kind<DgradInputKind>(p, launch, stream);
}

}  // namespace mok::gemm
