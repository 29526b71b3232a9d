#include "megakernel/fp8_steps.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include "comm/cuda_check.hpp"
#include "comm/roles.hpp"
#include "megakernel/staged_backward.hpp"
#include "megakernel/staged_forward.hpp"

namespace mok::megakernel {
namespace {

int64_t blocks128(int64_t v) { return (v + 127) / 128; }
size_t align256(size_t v) { return (v + 255) / 256 * 256; }

// min over a record pair (first = smallest row-major index, ~0 = none).
__global__ void merge_records(const gemm::NonFiniteRecord* from, gemm::NonFiniteRecord* into, int n) {
  const int i = threadIdx.x;
  if (i < n && from[i].first != ~0ull) atomicMin(&into[i].first, from[i].first);
}

// (n <= 32: a warp reads the records with one load a lane; the grid is small, since nearly always no
// record is set and every thread only reads them: 1024 CTAs of 18 loads a thread cost ~37 us a launch.)
__global__ void poison_if_any(const gemm::NonFiniteRecord* records, int n, uint32_t* out, int64_t words) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const unsigned long long v =
      lane < n ? *reinterpret_cast<const volatile unsigned long long*>(&records[lane].first) : ~0ull;
  if (!__any_sync(0xffffffffu, v != ~0ull)) return;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < words; i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = 0x7FFFFFFFu;  // an fp32 NaN, and two bf16 NaNs (0x7FFF, 0xFFFF)
  }
}

// 1x128 rows along `cols` of [rows, cols] bf16 `x` into `to` (live rows: all, or *limit).
void quantize_rows(const bf16* x, int64_t rows, int64_t cols, Fp8Saved to, const int64_t* limit,
                   gemm::NonFiniteRecord* rec, cudaStream_t stream) {
  gemm::QuantizeRowsArgs a;
  a.x = x;
  a.rows = rows;
  a.cols = cols;
  a.codes = to.codes;
  a.scales = to.scales;
  a.nonfinite = rec;
  a.rows_limit = limit;
  gemm::quantize_rows_1x128(a, stream);
}

// x^T of [rows, cols] bf16 `x`, 1x128 blocks along the rows (the tokens), into `q`: codes
// [cols, rows], scales [rows / 128][cols]. With `rows_to`, x's 1x128 rows too, from the same read.
gemm::Fp8Transposed quantize_transposed(const bf16* x, int64_t rows, int64_t cols, const Fp8Codes& q,
                                        const int64_t* limit, gemm::NonFiniteRecord* rec, cudaStream_t stream,
                                        const Fp8Saved* rows_to = nullptr) {
  gemm::QuantizeColsArgs a;
  a.x = x;
  a.rows = rows;
  a.cols = cols;
  a.codes_t = q.codes.get();
  a.scales_t = q.scales.get();
  a.nonfinite = rec;
  a.rows_limit = limit;
  if (rows_to != nullptr) {
    a.row_codes = rows_to->codes;
    a.row_scales = rows_to->scales;
  }
  gemm::quantize_cols_128x1_transposed(a, stream);
  return {q.codes.get(), q.scales.get()};
}

const int64_t* padded_rows(const comm::ScheduleView& v) { return &v.header->padded_rows; }

// dy's 1x128 rows (the dh GEMM's operand) into `rows_to`; with `t_to` dy^T too, from the same read
// (backward_dgrad_fp8's dy_t_too).
void quantize_dy(const bf16* dy, int64_t rows, int64_t hidden, Fp8Saved rows_to, const Fp8Codes* t_to,
                 const int64_t* limit, gemm::NonFiniteRecord* rec, cudaStream_t stream) {
  if (t_to != nullptr) {
    quantize_transposed(dy, rows, hidden, *t_to, limit, rec, stream, &rows_to);
  } else {
    quantize_rows(dy, rows, hidden, rows_to, limit, rec, stream);
  }
}

// The scales of the dispatched packed rows (fp8_row_bytes each, scales after the H codes) into the
// K-block major [blocks][buffer_rows] the GEMMs read, for the schedule's live rows. A padding row
// (zeroed by the dispatch) gets scale 1, what the quantizer gives a zero row; a real row's scale is
// a power of two, never 0.
__global__ void unpack_scales(const comm::ScheduleHeader* header, const char* rows, int64_t row_bytes, int64_t hidden,
                              int blocks, int64_t buffer_rows, float* scales) {
  const int64_t live = header->status == 0 ? header->padded_rows : 0;
  const int64_t n = live * blocks;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / blocks, b = i - r * blocks;
    const float v = reinterpret_cast<const float*>(rows + r * row_bytes + hidden)[b];
    scales[b * buffer_rows + r] = v == 0.0f ? 1.0f : v;
  }
}

gemm::Segments shared_segments(ForwardBuffers& fwd) {
  return gemm::Segments{fwd.shared_offsets.get(), fwd.shared_rows_dev.get(), 1, fwd.shared_rows};
}

}  // namespace

const char* fp8_tensor_name(int t) {
  static const char* const names[kFp8Tensors] = {
      "x (a token's row; in a recompute, a row of the routed buffer)", "h (a routed row)", "x (shared expert)",
      "h (shared expert)",
      "g or u (a routed row, kept in FP8)", "g or u (shared expert, kept in FP8)",
      "dy (a pulled row of the routed buffer)", "dg or du (a routed row)", "hs (a routed row)",
      "dy (shared expert)", "dg or du (shared expert)", "hs (shared expert)",
      "ExpertWeights.gate (rows of the local experts stacked)", "ExpertWeights.up (rows of the local experts stacked)",
      "ExpertWeights.down (rows of the local experts stacked)", "ExpertWeights.shared_gate",
      "ExpertWeights.shared_up", "ExpertWeights.shared_down"};
  return t >= 0 && t < kFp8Tensors ? names[t] : "(unknown tensor)";
}

int64_t fp8_tensor_cols(int t, const LayerShape& s) {
  switch (t) {
    case kFp8X: case kFp8SharedX: case kFp8Dy: case kFp8SharedDy: return s.hidden;
    case kFp8H: case kFp8Gu: case kFp8DgDu: case kFp8Hs: return s.intermediate;
    case kFp8SharedH: case kFp8SharedGu: case kFp8SharedDgDu: case kFp8SharedHs: return s.shared_intermediate;
    case kFp8WeightGate: case kFp8WeightUp: case kFp8WeightSharedGate: case kFp8WeightSharedUp: return s.hidden;
    case kFp8WeightDown: return s.intermediate;
    case kFp8WeightSharedDown: return s.shared_intermediate;
  }
  return 0;
}

int64_t fp8_row_bytes(int64_t hidden) { return (hidden + 4 * blocks128(hidden) + 15) / 16 * 16; }

gemm::Fp8Rows fp8_dispatch(comm::CommState& state, ForwardBuffers& fwd, const bf16* x, int64_t tokens, int ctas,
                           cudaStream_t stream) {
  const LayerShape& s = state.shape();
  const int64_t P = fp8_row_bytes(s.hidden), R = fwd.buffer_rows;
  const comm::SymmetricLayout& layout = state.layout();
  char* staging = state.window_local() + layout.dy;
  gemm::QuantizeRowsArgs q;
  q.x = x;
  q.rows = tokens;
  q.cols = s.hidden;
  q.codes = reinterpret_cast<uint8_t*>(staging);
  q.codes_ld = P;
  q.scales = reinterpret_cast<float*>(staging + s.hidden);
  q.scales_row_stride = P / 4;
  q.nonfinite = fwd.fp8->records.get() + kFp8X;
  gemm::quantize_rows_1x128(q, stream);
  char* rows = reinterpret_cast<char*>(state.row_buffer());
  comm::DispatchLaunch d = state.dispatch_launch(ctas, /*dedup=*/true, state.view(), layout.dy,
                                                 reinterpret_cast<bf16*>(rows));
  d.role.row_bytes = P;
  comm::launch_dispatch(d, stream);
  const int blocks = static_cast<int>(blocks128(s.hidden));
  unpack_scales<<<static_cast<unsigned>(std::clamp<int64_t>(R * blocks / 256, 1, 2048)), 256, 0, stream>>>(
      state.view().header, rows, P, s.hidden, blocks, R, fwd.fp8->x.scales.get());
  MOK_CUDA_CHECK(cudaGetLastError());
  return {reinterpret_cast<const uint8_t*>(rows), fwd.fp8->x.scales.get(), P};
}

// ---- the weights ----

size_t Fp8WeightViews::bytes(const LayerShape& s) {
  return align256(kFp8Weights * sizeof(gemm::NonFiniteRecord)) +
         [&] {
           size_t total = 0;
           const int64_t E = s.local_experts(), H = s.hidden, I = s.intermediate, S = s.shared_intermediate;
           const int64_t dims[kFp8Weights][3] = {{E, I, H}, {E, I, H}, {E, H, I}, {1, S, H}, {1, S, H}, {1, H, S}};
           for (const auto& d : dims) {
             const int64_t elems = d[0] * d[1] * d[2], blocks = d[0] * blocks128(d[1]) * blocks128(d[2]);
             total += 2 * align256(elems) + 2 * align256(blocks * sizeof(float));
           }
           return total;
         }();
}

Fp8WeightViews Fp8WeightViews::at(char* base, const LayerShape& s) {
  Fp8WeightViews v;
  v.records = reinterpret_cast<gemm::NonFiniteRecord*>(base);
  size_t off = align256(kFp8Weights * sizeof(gemm::NonFiniteRecord));
  const int64_t E = s.local_experts(), H = s.hidden, I = s.intermediate, S = s.shared_intermediate;
  const int64_t dims[kFp8Weights][3] = {{E, I, H}, {E, I, H}, {E, H, I}, {1, S, H}, {1, S, H}, {1, H, S}};
  for (int i = 0; i < kFp8Weights; ++i) {
    Fp8Matrix& m = v.m[i];
    m.batch = dims[i][0];
    m.rows = dims[i][1];
    m.cols = dims[i][2];
    const int64_t elems = m.batch * m.rows * m.cols, blocks = m.batch * blocks128(m.rows) * blocks128(m.cols);
    auto take = [&](size_t n) {
      char* p = base + off;
      off += align256(n);
      return p;
    };
    m.w.codes = reinterpret_cast<uint8_t*>(take(elems));
    m.w_t.codes = reinterpret_cast<uint8_t*>(take(elems));
    m.w.scales = reinterpret_cast<float*>(take(blocks * sizeof(float)));
    m.w_t.scales = reinterpret_cast<float*>(take(blocks * sizeof(float)));
  }
  return v;
}

void quantize_weights(const Fp8WeightViews& v, const ExpertWeights& w, cudaStream_t stream) {
  MOK_CUDA_CHECK(cudaMemsetAsync(v.records, 0xFF, kFp8Weights * sizeof(gemm::NonFiniteRecord), stream));
  const bf16* src[kFp8Weights] = {w.gate, w.up, w.down, w.shared_gate, w.shared_up, w.shared_down};
  const int64_t strides[kFp8Weights] = {w.gate_expert_stride, w.up_expert_stride, w.down_expert_stride, 0, 0, 0};
  for (int i = 0; i < kFp8Weights; ++i) {
    const Fp8Matrix& m = v.m[i];
    if (m.rows == 0) continue;  // no shared expert
    gemm::QuantizeBlocksArgs a;
    a.w = src[i];
    a.batch = m.batch;
    a.rows = m.rows;
    a.cols = m.cols;
    a.batch_stride = strides[i];
    a.codes = const_cast<uint8_t*>(m.w.codes);
    a.scales = const_cast<float*>(m.w.scales);
    a.codes_t = const_cast<uint8_t*>(m.w_t.codes);
    a.scales_t = const_cast<float*>(m.w_t.scales);
    a.nonfinite = v.records + i;
    gemm::quantize_blocks_128x128(a, stream);
  }
}

// ---- scratch and records ----

Fp8Codes::Fp8Codes(int64_t rows, int64_t cols) : codes(rows * cols), scales(blocks128(cols) * rows) {}

Fp8ForwardScratch::Fp8ForwardScratch(const LayerShape& s, int64_t R, int64_t SR)
    : x(R, s.hidden), h(R, s.intermediate), records(kFp8Tensors) {
  if (s.has_shared()) {
    shared_x = Fp8Codes(SR, s.hidden);
    shared_h = Fp8Codes(SR, s.shared_intermediate);
  }
  MOK_CUDA_CHECK(cudaMemset(records.get(), 0xFF, records.bytes()));
}
size_t Fp8ForwardScratch::bytes() const {
  return x.bytes() + h.bytes() + shared_x.bytes() + shared_h.bytes() + records.bytes();
}

Fp8BackwardScratch::Fp8BackwardScratch(const LayerShape& s, int64_t R, int64_t SR)
    : dy(R, s.hidden), dg(R, s.intermediate), du(R, s.intermediate) {
  if (s.has_shared()) {
    shared_dy = Fp8Codes(SR, s.hidden);
    shared_dg = Fp8Codes(SR, s.shared_intermediate);
    shared_du = Fp8Codes(SR, s.shared_intermediate);
  }
}
size_t Fp8BackwardScratch::bytes() const {
  return dy.bytes() + dg.bytes() + du.bytes() + shared_dy.bytes() + shared_dg.bytes() + shared_du.bytes();
}

void merge_weight_records(ForwardBuffers& fwd, const Fp8Pass& pass, cudaStream_t stream) {
  if (pass.weights == nullptr) return;  // a pass without weights (the deferred weight gradients)
  merge_records<<<1, 32, 0, stream>>>(pass.weights->records, fwd.fp8->records.get() + kFp8WeightGate, kFp8Weights);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void poison_on_nonfinite(const ForwardBuffers& fwd, void* out, int64_t words, cudaStream_t stream) {
  if (words <= 0) return;
  static_assert(kFp8Tensors <= 32, "poison_if_any reads the records one a lane");
  const unsigned blocks = static_cast<unsigned>(std::clamp<int64_t>((words + 255) / 256, 1, 264));
  poison_if_any<<<blocks, 256, 0, stream>>>(fwd.fp8->records.get(), kFp8Tensors, static_cast<uint32_t*>(out), words);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void check_fp8_records(ForwardBuffers& fwd, const LayerShape& s, cudaStream_t stream) {
  if (!fwd.fp8) return;
  gemm::NonFiniteRecord h[kFp8Tensors];
  MOK_CUDA_CHECK(cudaMemcpyAsync(h, fwd.fp8->records.get(), sizeof(h), cudaMemcpyDeviceToHost, stream));
  MOK_CUDA_CHECK(cudaMemsetAsync(fwd.fp8->records.get(), 0xFF, sizeof(h), stream));
  MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (int t = 0; t < kFp8Tensors; ++t) {
    if (h[t].first == ~0ull) continue;
    const int64_t cols = std::max<int64_t>(fp8_tensor_cols(t, s), 1);
    throw Error(Status::kInvalidArgument, std::string("mok fp8: non-finite value in ") + fp8_tensor_name(t) +
                                              " at row " + std::to_string(h[t].first / cols) + ", column " +
                                              std::to_string(h[t].first % cols) +
                                              " (Config::precision fp8_block quantizes it; the outputs of the passes "
                                              "since the last check() are NaN)");
  }
}

// ---- the FP8 context's g, u ----

namespace {

struct GuRows {  // one half (routed or shared) of the activations
  int64_t rows, cols;
  const int64_t* live;
  bf16 *g, *u;
  Fp8Saved g8, u8;
};

// The routed and the shared halves of (bf16 `b`, FP8 `f`) with their row counts.
std::vector<GuRows> halves(const LayerShape& s, const ForwardBuffers& fwd, const comm::ScheduleView& v,
                           const SavedContext& b, const SavedContext& f) {
  std::vector<GuRows> h{{fwd.buffer_rows, s.intermediate, padded_rows(v), b.g, b.u, f.g8, f.u8}};
  if (s.has_shared()) {
    h.push_back({fwd.shared_rows, s.shared_intermediate, nullptr, b.shared_g, b.shared_u, f.shared_g8, f.shared_u8});
  }
  return h;
}

void dequantize_from(Fp8Saved from, const GuRows& h, bf16* out, cudaStream_t stream) {
  gemm::DequantizeRowsArgs a;
  a.codes = from.codes;
  a.rows = h.rows;
  a.cols = h.cols;
  a.scales = from.scales;
  a.out = out;
  a.rows_limit = h.live;
  gemm::dequantize_rows_1x128(a, stream);
}

}  // namespace

void load_activations_fp8(const LayerShape& s, const ForwardBuffers& fwd, const comm::ScheduleView& v,
                          const SavedContext& from, const SavedContext& into, cudaStream_t stream) {
  for (const GuRows& h : halves(s, fwd, v, into, from)) {
    dequantize_from(h.g8, h, h.g, stream);
    dequantize_from(h.u8, h, h.u, stream);
  }
}

void round_activations_fp8(const LayerShape& s, ForwardBuffers& fwd, const comm::ScheduleView& v,
                           const SavedContext& gu, cudaStream_t stream) {
  Fp8ForwardScratch& q = *fwd.fp8;
  SavedContext scratch;  // the FP8 round trip goes through h's buffers (free in a backward)
  scratch.g8 = scratch.u8 = q.h.out();
  scratch.shared_g8 = scratch.shared_u8 = q.shared_h.out();
  int half = 0;
  for (const GuRows& h : halves(s, fwd, v, gu, scratch)) {
    gemm::NonFiniteRecord* r = q.records.get() + (half++ == 0 ? kFp8Gu : kFp8SharedGu);
    for (bf16* t : {h.g, h.u}) {  // one after the other through the same scratch (stream-ordered)
      quantize_rows(t, h.rows, h.cols, h.g8, h.live, r, stream);
      dequantize_from(h.g8, h, t, stream);
    }
  }
}

// ---- the passes' GEMM steps ----

namespace {

// GEMM 1 writes the FP8 context's g, u itself when `save` has them (its epilogue quantizes the rounded
// g, u: the bits of quantize_rows_1x128 over its bf16 g, u, without such a pass and without the bf16
// copies, which nothing else reads then).
void keep_gu_fp8(gemm::Gemm1SwigluFp8Args& g1, Fp8Saved g8, Fp8Saved u8, gemm::NonFiniteRecord* rec) {
  if (g8.codes == nullptr) return;
  g1.g = g1.u = nullptr;
  g1.g_codes = g8.codes;
  g1.g_scales = g8.scales;
  g1.u_codes = u8.codes;
  g1.u_scales = u8.scales;
  g1.gu_nonfinite = rec;
}

}  // namespace

void forward_gemms_fp8(const LayerShape& s, ForwardBuffers& fwd, const gemm::Segments& seg, const bf16* x_rows,
                       const int64_t* live_rows, const Fp8Pass& pass, const SavedContext& save,
                       const gemm::Launch& launch, bool shared, bool gemm2, cudaStream_t stream,
                       const gemm::Fp8Rows* dispatched) {
  const Fp8WeightViews& w = *pass.weights;
  Fp8ForwardScratch& q = *fwd.fp8;
  gemm::NonFiniteRecord* rec = q.records.get();
  if (shared) {
    const gemm::Segments sseg = shared_segments(fwd);
    quantize_rows(fwd.shared_x.get(), fwd.shared_rows, s.hidden, q.shared_x.out(), nullptr, rec + kFp8SharedX, stream);
    gemm::Gemm1SwigluFp8Args g1{sseg, s.hidden, s.shared_intermediate, q.shared_x.rows(), w.shared_gate().w,
                                w.shared_up().w, save.shared_g, save.shared_u, nullptr, q.shared_h.codes.get(),
                                q.shared_h.scales.get(), rec + kFp8SharedH};
    keep_gu_fp8(g1, save.shared_g8, save.shared_u8, rec + kFp8SharedGu);
    gemm::gemm1_swiglu_fp8(g1, launch, stream);
    if (gemm2) {
      gemm::gemm2_fp8(
          {sseg, s.hidden, s.shared_intermediate, q.shared_h.rows(), w.shared_down().w, fwd.shared_out.get()}, launch,
          stream);
    }
    return;
  }
  if (dispatched == nullptr) {
    quantize_rows(x_rows, seg.buffer_rows, s.hidden, q.x.out(), live_rows, rec + kFp8X, stream);
  }
  const gemm::Fp8Rows x = dispatched != nullptr ? *dispatched : q.x.rows();
  gemm::Gemm1SwigluFp8Args g1{seg, s.hidden, s.intermediate, x, w.gate().w, w.up().w, save.g, save.u,
                              nullptr, q.h.codes.get(), q.h.scales.get(), rec + kFp8H};
  keep_gu_fp8(g1, save.g8, save.u8, rec + kFp8Gu);
  gemm::gemm1_swiglu_fp8(g1, launch, stream);
  if (gemm2) {
    gemm::gemm2_fp8({seg, s.hidden, s.intermediate, q.h.rows(), w.down().w, fwd.expert_out.get()}, launch, stream);
  }
}

namespace {

// dh = dys . W_down and the SwiGLU backward in FP8 (the args' operands), dg's and du's codes and scales
// into (dg, du) for dx, a non-finite dg or du recorded in `rec`.
void dgrad_hidden_fp8(gemm::DgradHiddenFp8Args a, const Fp8Codes& dg, const Fp8Codes& du, gemm::NonFiniteRecord* rec,
                      const gemm::Launch& launch, cudaStream_t stream) {
  a.dg_codes = dg.codes.get();
  a.du_codes = du.codes.get();
  a.dg_scales = dg.scales.get();
  a.du_scales = du.scales.get();
  a.nonfinite = rec;
  gemm::dgrad_hidden_swiglu_fp8(a, launch, stream);
}

}  // namespace

void backward_dgrad_fp8(const comm::CommState& state, ForwardBuffers& fwd, BackwardBuffers& bwd,
                        const SavedContext& saved, const Fp8Pass& pass, const GradInputs& out, bool shared, bool dh,
                        bool dx, const gemm::Launch& launch, cudaStream_t stream, bool dy_t_too) {
  const LayerShape& s = state.shape();
  const Fp8WeightViews& w = *pass.weights;
  Fp8BackwardScratch& q = *bwd.fp8;
  gemm::NonFiniteRecord* rec = fwd.fp8->records.get();
  if (shared) {
    const gemm::Segments seg = shared_segments(fwd);
    const int64_t S = s.shared_intermediate;
    if (dh) {  // (dy^T into x's buffer: backward_wgrad_fp8's dy_t_ready)
      quantize_dy(bwd.shared_dy.get(), fwd.shared_rows, s.hidden, q.shared_dy.out(),
                  dy_t_too ? &fwd.fp8->shared_x : nullptr, nullptr, rec + kFp8SharedDy, stream);
      dgrad_hidden_fp8({seg, s.hidden, S, q.shared_dy.rows(), w.shared_down().w_t, saved.shared_g, saved.shared_u,
                        out.shared_dg, out.shared_du},
                       q.shared_dg, q.shared_du, rec + kFp8SharedDgDu, launch, stream);
    }
    if (dx) {
      gemm::dgrad_input_fp8({seg, s.hidden, S, q.shared_dg.rows(), q.shared_du.rows(), w.shared_gate().w_t,
                             w.shared_up().w_t, bwd.shared_dx.get()},
                            launch, stream);
    }
    return;
  }
  const gemm::Segments seg{saved.seg_offsets, saved.seg_rows, static_cast<int>(s.local_experts()), bwd.buffer_rows};
  if (dh) {  // (dy^T into x's buffer: backward_wgrad_fp8's dy_t_ready)
    quantize_dy(bwd.dy_rows.get(), bwd.buffer_rows, s.hidden, q.dy.out(), dy_t_too ? &fwd.fp8->x : nullptr,
                padded_rows(saved.schedule), rec + kFp8Dy, stream);
    gemm::DgradHiddenFp8Args a{seg, s.hidden, s.intermediate, q.dy.rows(), w.down().w_t, saved.g, saved.u, out.dg,
                               out.du};
    a.row_w = bwd.row_w.get();
    a.dw_part = bwd.dw_part.get();
    dgrad_hidden_fp8(a, q.dg, q.du, rec + kFp8DgDu, launch, stream);
  }
  if (dx) {
    gemm::dgrad_input_fp8({seg, s.hidden, s.intermediate, q.dg.rows(), q.du.rows(), w.gate().w_t, w.up().w_t,
                           bwd.dx_rows.get()},
                          launch, stream);
  }
}

void backward_wgrad_fp8(const comm::CommState& state, ForwardBuffers& fwd, BackwardBuffers& bwd,
                        const SavedContext& saved, const bf16* x_rows, const WeightGrads& grads, const GradInputs& in,
                        bool shared, const gemm::Launch& launch, cudaStream_t stream, bool dy_t_ready) {
  const LayerShape& s = state.shape();
  Fp8ForwardScratch& qf = *fwd.fp8;
  Fp8BackwardScratch& qb = *bwd.fp8;
  gemm::NonFiniteRecord* rec = qf.records.get();
  const int64_t H = s.hidden;
  gemm::WgradFp8Args wa;
  wa.mode = grads.mode == GradMode::kWriteBf16 ? gemm::WgradOut::kWriteBf16 : gemm::WgradOut::kAccumulateFp32;
  wa.num_problems = 3;
  if (shared) {  // dy unscaled, over this rank's tokens; every row of the segment's tiles is zero past T
    const int64_t S = s.shared_intermediate, R = fwd.shared_rows;
    wa.seg = shared_segments(fwd);
    // dy^T: in x's buffer when the dgrad's pass over dy wrote it (x^T then goes into dy's)
    const gemm::Fp8Transposed dy_t =
        dy_t_ready ? gemm::Fp8Transposed{qf.shared_x.codes.get(), qf.shared_x.scales.get()}
                   : quantize_transposed(bwd.shared_dy.get(), R, H, qb.shared_dy, nullptr, rec + kFp8SharedDy, stream);
    const gemm::Fp8Transposed hs_t = quantize_transposed(in.shared_hs, R, S, qf.shared_h, nullptr,
                                                         rec + kFp8SharedHs, stream);
    const gemm::Fp8Transposed dg_t = quantize_transposed(in.shared_dg, R, S, qb.shared_dg, nullptr,
                                                         rec + kFp8SharedDgDu, stream);
    const gemm::Fp8Transposed du_t = quantize_transposed(in.shared_du, R, S, qb.shared_du, nullptr,
                                                         rec + kFp8SharedDgDu, stream);
    const gemm::Fp8Transposed x_t = quantize_transposed(fwd.shared_x.get(), R, H, dy_t_ready ? qb.shared_dy : qf.shared_x,
                                                        nullptr, rec + kFp8SharedX, stream);
    wa.problems[0] = {dy_t, hs_t, H, S, grads.shared_down};
    wa.problems[1] = {dg_t, x_t, S, H, grads.shared_gate};
    wa.problems[2] = {du_t, x_t, S, H, grads.shared_up};
    gemm::wgrad_fp8(wa, launch, stream);
    return;
  }
  const int64_t I = s.intermediate, R = bwd.buffer_rows;
  const int64_t* live = padded_rows(saved.schedule);
  wa.seg = gemm::Segments{saved.seg_offsets, saved.seg_rows, static_cast<int>(s.local_experts()), R};
  const gemm::Fp8Transposed dy_t = dy_t_ready ? gemm::Fp8Transposed{qf.x.codes.get(), qf.x.scales.get()}
                                              : quantize_transposed(bwd.dy_rows.get(), R, H, qb.dy, live, rec + kFp8Dy, stream);
  const gemm::Fp8Transposed hs_t = quantize_transposed(in.hs, R, I, qf.h, live, rec + kFp8Hs, stream);
  const gemm::Fp8Transposed dg_t = quantize_transposed(in.dg, R, I, qb.dg, live, rec + kFp8DgDu, stream);
  const gemm::Fp8Transposed du_t = quantize_transposed(in.du, R, I, qb.du, live, rec + kFp8DgDu, stream);
  const gemm::Fp8Transposed x_t = quantize_transposed(x_rows, R, H, dy_t_ready ? qb.dy : qf.x, live, rec + kFp8X, stream);
  wa.problems[0] = {dy_t, hs_t, H, I, grads.down, grads.down_expert_stride};
  wa.problems[1] = {dg_t, x_t, I, H, grads.gate, grads.gate_expert_stride};
  wa.problems[2] = {du_t, x_t, I, H, grads.up, grads.up_expert_stride};
  gemm::wgrad_fp8(wa, launch, stream);
}

}  // namespace mok::megakernel
