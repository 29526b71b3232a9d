// Forward launchers: GEMM 1 + SwiGLU and GEMM 2 (sm_90a).
#include "gemm/grouped_gemm.hpp"
#include "gemm/sm90_kinds_rows.cuh"
#include "gemm/sm90_launch.cuh"

namespace mok::gemm {

void gemm1_swiglu(const Gemm1SwigluArgs& a, const Launch& launch, cudaStream_t stream) {
  using host::check_pointer;
  host::check_row_problem(a.seg, launch, a.hidden, a.intermediate);
  check_pointer("x", a.x);
  check_pointer("w_gate", a.w_gate);
  check_pointer("w_up", a.w_up);
  check_pointer("h", a.h);
  check_pointer("g", a.g);
  check_pointer("u", a.u);
  const int64_t R = a.seg.buffer_rows, H = a.hidden, I = a.intermediate, E = a.seg.experts;
  Gemm1SwigluParams p;
  p.x = host::map_bf16(a.x, 0, R, H, 64, 128, "x");
  p.w_gate = host::map_bf16(a.w_gate, E, I, H, 64, 128, "w_gate", a.w_gate_stride);
  p.w_up = host::map_bf16(a.w_up, E, I, H, 64, 128, "w_up", a.w_up_stride);
  p.h = host::map_bf16(a.h, 0, R, I, 64, 64, "h");
  p.g = host::map_bf16(a.g, 0, R, I, 64, 64, "g");
  p.u = host::map_bf16(a.u, 0, R, I, 64, 64, "u");
  p.sched = host::row_scheduler(a.seg, I, 128, kGroupM);
  p.k_steps = static_cast<int>(H / 64);
  p.inter = static_cast<int>(I);
  host::launch_row_kind<Gemm1SwigluKind>(p, launch, stream);
}

void gemm2(const Gemm2Args& a, const Launch& launch, cudaStream_t stream) {
  using host::check_pointer;
  host::check_row_problem(a.seg, launch, a.hidden, a.intermediate);
  check_pointer("h", a.h);
  check_pointer("w_down", a.w_down);
  check_pointer("out", a.out);
  const int64_t R = a.seg.buffer_rows, H = a.hidden, I = a.intermediate, E = a.seg.experts;
  Gemm2Params p;
  p.h = host::map_bf16(a.h, 0, R, I, 64, 128, "h");
  p.w_down = host::map_bf16(a.w_down, E, H, I, 64, 128, "w_down", a.w_down_stride);
  p.out = host::map_bf16(a.out, 0, R, H, 64, 64, "out");
  p.sched = host::row_scheduler(a.seg, H, 256, kGroupM);
  p.k_steps = static_cast<int>(I / 64);
  p.hidden = static_cast<int>(H);
  host::launch_row_kind<Gemm2Kind>(p, launch, stream);
}

}  // namespace mok::gemm
