#include "megakernel/staged_forward.hpp"

#include <algorithm>
#include <string>

#include "comm/cuda_check.hpp"
#include "gemm/grouped_gemm.hpp"

namespace mok::megakernel {
namespace {

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// The GEMM engine takes int32 segment tables; the schedule keeps int64. A poisoned schedule
// (routing error, capacity overflow) becomes empty segments, so the GEMMs read nothing stale.
__global__ void segments_from_schedule(const comm::ScheduleHeader* header, const int64_t* offset64,
                                       const int64_t* rows64, int experts, int32_t* offset32, int32_t* rows32) {
  const bool ok = header->status == 0;
  for (int e = threadIdx.x; e <= experts; e += blockDim.x) {
    offset32[e] = ok ? static_cast<int32_t>(offset64[e]) : 0;
    if (e < experts) rows32[e] = ok ? static_cast<int32_t>(rows64[e]) : 0;
  }
}

// y is NaN (0xFFFF) whenever the schedule was poisoned or a wait timed out: never silently wrong.
__global__ void poison_if_failed(const comm::ScheduleHeader* header, const comm::DeviceErrorRecord* error, uint4* y,
                                 int64_t vecs) {
  if (header->status == 0 && *reinterpret_cast<const volatile int32_t*>(&error->code) == 0 &&
      *reinterpret_cast<const volatile unsigned long long*>(&error->weight_key) == comm::kNoWeightError) {
    return;
  }
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < vecs; i += int64_t(gridDim.x) * blockDim.x) {
    y[i] = make_uint4(~0u, ~0u, ~0u, ~0u);
  }
}

// Non-finite router weights are bad input, as bad expert ids are: the first one (smallest
// t * K + k) is recorded, y is poisoned after the pass, and Workspace::check() throws it.
__global__ void check_weights_kernel(const float* topk_w, int64_t n, comm::DeviceErrorRecord* error) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float w = topk_w[i];
    if (!isfinite(w)) atomicMin(&error->weight_key, (static_cast<unsigned long long>(i) << 32) | __float_as_uint(w));
  }
}

__global__ void set_word(int32_t* word, int32_t value) { *word = value; }

// dispatched: FP8 only, the routed x as fp8_dispatch left it (else the bf16 rows are quantized here).
void run_expert_gemms(const comm::CommState& state, ForwardBuffers& b, const ExpertWeights& w, const bf16* rows,
                      const StagedForwardOptions& o, const SavedContext& save, cudaStream_t stream,
                      const gemm::Fp8Rows* dispatched = nullptr) {
  const LayerShape& s = state.shape();
  const gemm::Launch launch = gemm_launch(b, o.gemm_grid, o.timeout_s);
  const gemm::Segments seg{b.seg_offsets.get(), b.seg_rows.get(), static_cast<int>(s.local_experts()),
                           b.buffer_rows};
  if (o.fp8 != nullptr) {
    if (s.has_shared()) forward_gemms_fp8(s, b, seg, nullptr, nullptr, *o.fp8, save, launch, true, true, stream);
    forward_gemms_fp8(s, b, seg, rows, &state.view().header->padded_rows, *o.fp8, save, launch, false, true, stream,
                      dispatched);
    return;
  }
  if (s.has_shared()) {  // first, as in the fused kernel (hides the dispatch there)
    const gemm::Segments sseg{b.shared_offsets.get(), b.shared_rows_dev.get(), 1, b.shared_rows};
    gemm::gemm1_swiglu({sseg, s.hidden, s.shared_intermediate, b.shared_x.get(), w.shared_gate, w.shared_up,
                        b.shared_h.get(), save.shared_g, save.shared_u},
                       launch, stream);
    gemm::gemm2({sseg, s.hidden, s.shared_intermediate, b.shared_h.get(), w.shared_down, b.shared_out.get()}, launch,
                stream);
  }
  gemm::gemm1_swiglu({seg, s.hidden, s.intermediate, rows, w.gate, w.up, b.h.get(), save.g, save.u,
                      w.gate_expert_stride, w.up_expert_stride},
                     launch, stream);
  gemm::gemm2({seg, s.hidden, s.intermediate, b.h.get(), w.down, b.expert_out.get(), w.down_expert_stride}, launch,
              stream);
}

}  // namespace

ForwardBuffers::ForwardBuffers(const LayerShape& s, const Config& config, int64_t rows, int64_t resident)
    : buffer_rows(rows),
      resident_rows(resident > 0 && resident < rows ? resident : rows),
      shared_rows(round_up(s.tokens, kRowTile)),
      seg_offsets(s.local_experts() + 1),
      seg_rows(s.local_experts()),
      shared_offsets(2),
      shared_rows_dev(1),
      h(resident_rows * s.intermediate),
      g(resident_rows < rows ? resident_rows * s.intermediate : 0),
      u(resident_rows < rows ? resident_rows * s.intermediate : 0),
      expert_out((resident_rows < rows ? kRowTile : rows) * s.hidden),
      shared_x(s.has_shared() ? shared_rows * s.hidden : 0),
      shared_h(shared_rows * s.shared_intermediate),
      shared_out(s.has_shared() ? shared_rows * s.hidden : 0),
      gemm_error(1),
      tile_counters(2 * (shared_rows / kRowTile) + 2 * (rows / kRowTile) + 2) {
  const int32_t off[2] = {0, static_cast<int32_t>(shared_rows)};
  const int32_t real = static_cast<int32_t>(s.tokens);
  MOK_CUDA_CHECK(cudaMemcpy(shared_offsets.get(), off, sizeof(off), cudaMemcpyHostToDevice));
  MOK_CUDA_CHECK(cudaMemcpy(shared_rows_dev.get(), &real, sizeof(real), cudaMemcpyHostToDevice));
  if (s.has_shared()) MOK_CUDA_CHECK(cudaMemset(shared_x.get(), 0, shared_x.bytes()));  // padding rows stay 0
  MOK_CUDA_CHECK(cudaMemset(gemm_error.get(), 0, gemm_error.bytes()));
  if (config.precision == Precision::kFp8Block) fp8 = std::make_unique<Fp8ForwardScratch>(s, rows, shared_rows);
}

namespace {

// The staged launches write every routed row: they need a workspace without the ring.
void refuse_ring(const comm::CommState& state, const ForwardBuffers& b, const char* what) {
  if (!b.ring() && !state.row_buffer_is_ring()) return;
  throw_invalid("Config.macrobatch",
                std::string("0 or at least the routed buffer (") + std::to_string(b.buffer_rows) + " rows) for " + what +
                    ", which keeps every routed row (the macrobatch ring is the fused forward's; a workspace created "
                    "with Config::forward_engine = kStaged keeps every row)",
                std::to_string(state.config().macrobatch));
}

}  // namespace

int64_t resident_tile(const ForwardBuffers& b, int64_t tile, int64_t padded_rows) {
  if (!b.ring()) return tile;
  const int64_t ring = b.resident_rows / kRowTile, tiles = padded_rows / kRowTile;
  return tile >= tiles - ring ? tile % ring : -1;
}

void forward_gemms_only(comm::CommState& state, ForwardBuffers& b, const ExpertWeights& w,
                        const StagedForwardOptions& o, const SavedContext& save, cudaStream_t stream) {
  refuse_ring(state, b, "the GEMMs-alone yardstick");
  run_expert_gemms(state, b, w, state.row_buffer(), o, save, stream);
}

void convert_segments(comm::CommState& state, ForwardBuffers& b, cudaStream_t stream) {
  const comm::ScheduleView view = state.view();
  segments_from_schedule<<<1, 256, 0, stream>>>(view.header, view.expert_offset, view.expert_rows,
                                                 static_cast<int>(state.shape().local_experts()), b.seg_offsets.get(),
                                                 b.seg_rows.get());
  MOK_CUDA_CHECK(cudaGetLastError());
}

gemm::Launch gemm_launch(ForwardBuffers& b, int grid, double timeout_s) {
  gemm::Launch l;
  l.grid = grid;
  l.error_flag = b.gemm_error.get();
  l.timeout_s = timeout_s;
  return l;
}

void stage_shared_rows(ForwardBuffers& b, int64_t tokens, int64_t hidden,
                       std::initializer_list<std::pair<bf16*, const bf16*>> rows, cudaStream_t stream) {
  // A kernel, not a host-to-device copy: stream-ordered and capturable into a CUDA graph.
  set_word<<<1, 1, 0, stream>>>(b.shared_rows_dev.get(), static_cast<int32_t>(tokens));
  MOK_CUDA_CHECK(cudaGetLastError());
  const size_t row = static_cast<size_t>(hidden) * sizeof(bf16);
  for (const auto& [dst, src] : rows) {
    MOK_CUDA_CHECK(cudaMemcpyAsync(dst, src, tokens * row, cudaMemcpyDeviceToDevice, stream));
    if (tokens < b.shared_rows) {
      MOK_CUDA_CHECK(cudaMemsetAsync(dst + tokens * hidden, 0, (b.shared_rows - tokens) * row, stream));
    }
  }
}

void check_router_weights(comm::CommState& state, const float* topk_w, int64_t tokens, cudaStream_t stream) {
  const LayerShape& s = state.shape();
  const int64_t n = tokens * s.topk;
  check_weights_kernel<<<static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 256)), 256, 0, stream>>>(
      topk_w, n, state.error_record());
  MOK_CUDA_CHECK(cudaGetLastError());
}

void poison_y_on_error(comm::CommState& state, bf16* y, int64_t tokens, cudaStream_t stream) {
  const LayerShape& s = state.shape();
  const int64_t vecs = tokens * s.hidden * 2 / 16;
  poison_if_failed<<<static_cast<unsigned>(std::min<int64_t>((vecs + 255) / 256, 1024)), 256, 0, stream>>>(
      state.view().header, state.error_record(), reinterpret_cast<uint4*>(y), vecs);
  MOK_CUDA_CHECK(cudaGetLastError());
}

void staged_forward(comm::CommState& state, ForwardBuffers& b, const ForwardArgs& args, const ExpertWeights& w,
                    const StagedForwardOptions& o, const SavedContext& save, cudaStream_t stream) {
  refuse_ring(state, b, "the staged forward");
  const LayerShape& s = state.shape();
  const int64_t T = state.view().tokens;  // this call's tokens
  check_router_weights(state, args.topk_w, T, stream);
  if (o.fp8 != nullptr) merge_weight_records(b, *o.fp8, stream);
  convert_segments(state, b, stream);
  if (s.has_shared()) stage_shared_rows(b, T, s.hidden, {{b.shared_x.get(), args.x}}, stream);
  gemm::Fp8Rows x8;  // FP8: x dispatched quantized (half the bytes), the same bits as quantizing after
  const bool fp8_rows = o.fp8 != nullptr && o.fp8->dispatch_fp8;
  if (fp8_rows) {
    x8 = fp8_dispatch(state, b, args.x, T, o.dispatch_ctas, stream);
  } else {
    state.stage_x(args.x, T, stream);
    state.dispatch(o.dispatch_ctas, /*dedup=*/true, stream);
  }
  run_expert_gemms(state, b, w, state.row_buffer(), o, save, stream, fp8_rows ? &x8 : nullptr);
  state.combine(b.expert_out.get(), o.combine_ctas, /*own_rows_in_place=*/true, stream);
  state.epilogue(args.topk_w, s.has_shared() ? b.shared_out.get() : nullptr, b.expert_out.get(), args.y, stream);
  poison_y_on_error(state, args.y, T, stream);
  if (o.fp8 != nullptr) poison_on_nonfinite(b, args.y, T * s.hidden / 2, stream);
}

void check_gemm_errors(ForwardBuffers& b, cudaStream_t stream) {
  // Stream-ordered (no legacy-default-stream copies): correct on non-blocking streams too.
  uint32_t bits = 0;
  MOK_CUDA_CHECK(cudaMemcpyAsync(&bits, b.gemm_error.get(), sizeof(bits), cudaMemcpyDeviceToHost, stream));
  MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (bits != 0) {
    MOK_CUDA_CHECK(cudaMemsetAsync(b.gemm_error.get(), 0, sizeof(bits), stream));
    MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
    throw Error(Status::kTimeout, "grouped GEMM reported error bits 0x" + std::to_string(bits) +
                                      " (an in-kernel pipeline wait timed out; see docs/gemm.md)");
  }
}

}  // namespace mok::megakernel
