#include "megakernel/context.hpp"

#include "comm/cuda_check.hpp"
#include "megakernel/staged_forward.hpp"

namespace mok::megakernel {
namespace {

constexpr size_t kAlign = 256;
size_t align_up(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }
int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

}  // namespace

ContextLayout ContextLayout::make(const LayerShape& s, const Config& config, int keep_level) {
  ContextLayout l;
  l.activations = keep_level >= 1;
  l.deferred = keep_level >= 2;
  l.buffer_rows = config.buffer_rows_per_rank(s);
  l.minibatch = config.effective_minibatch(s);
  l.max_minibatches = (l.buffer_rows + l.minibatch - 1) / l.minibatch;
  l.shared_rows = round_up(s.tokens, kRowTile);
  const int64_t E = s.local_experts();
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t off = at;
    at = align_up(at + bytes);
    return off;
  };
  l.header = take(sizeof(comm::ScheduleHeader));
  l.expert_offset = take((E + 1) * sizeof(int64_t));
  l.expert_rows = take(E * sizeof(int64_t));
  l.rows = take(l.buffer_rows * sizeof(comm::RowEntry));
  l.dest_row = take(static_cast<size_t>(s.ep) * s.tokens * s.topk * sizeof(int32_t));
  l.mb_ranges = take(3 * l.max_minibatches * sizeof(int64_t));
  l.remote_rows = take(l.buffer_rows * sizeof(int32_t));
  l.remote_count = take(sizeof(int32_t));
  l.token_key = take(s.tokens * sizeof(int32_t));
  l.token_order = take(s.tokens * sizeof(int32_t));
  l.seg_offsets = take((E + 1) * sizeof(int32_t));
  l.seg_rows = take(E * sizeof(int32_t));
  l.schedule_bytes = at;
  const int64_t keep = l.activations ? 1 : 0, defer = l.deferred ? 1 : 0;
  l.fp8 = config.precision == Precision::kFp8Block;
  // bf16 g, u: the activations (bf16), or only a deferring backward's dg, du (FP8).
  const int64_t bf16_gu = l.fp8 ? defer : keep;
  l.g = take(bf16_gu * l.buffer_rows * s.intermediate * sizeof(bf16));
  l.u = take(bf16_gu * l.buffer_rows * s.intermediate * sizeof(bf16));
  l.shared_g = take(bf16_gu * l.shared_rows * s.shared_intermediate * sizeof(bf16));
  l.shared_u = take(bf16_gu * l.shared_rows * s.shared_intermediate * sizeof(bf16));
  const int64_t fp8_gu = l.fp8 ? keep : 0;
  const int64_t ib = (s.intermediate + 127) / 128, sb = (s.shared_intermediate + 127) / 128;
  l.g8 = take(fp8_gu * l.buffer_rows * s.intermediate);
  l.g8_scales = take(fp8_gu * ib * l.buffer_rows * sizeof(float));
  l.u8 = take(fp8_gu * l.buffer_rows * s.intermediate);
  l.u8_scales = take(fp8_gu * ib * l.buffer_rows * sizeof(float));
  l.shared_g8 = take(fp8_gu * l.shared_rows * s.shared_intermediate);
  l.shared_g8_scales = take(fp8_gu * sb * l.shared_rows * sizeof(float));
  l.shared_u8 = take(fp8_gu * l.shared_rows * s.shared_intermediate);
  l.shared_u8_scales = take(fp8_gu * sb * l.shared_rows * sizeof(float));
  l.hs = take(defer * l.buffer_rows * s.intermediate * sizeof(bf16));
  l.shared_hs = take(defer * l.shared_rows * s.shared_intermediate * sizeof(bf16));
  l.total = at;
  return l;
}

SavedContext SavedContext::at(char* base, const ContextLayout& l, const LayerShape& s) {
  SavedContext c;
  comm::ScheduleView& v = c.schedule;
  v.header = reinterpret_cast<const comm::ScheduleHeader*>(base + l.header);
  v.expert_offset = reinterpret_cast<const int64_t*>(base + l.expert_offset);
  v.expert_rows = reinterpret_cast<const int64_t*>(base + l.expert_rows);
  v.rows = reinterpret_cast<const comm::RowEntry*>(base + l.rows);
  v.dest_row = reinterpret_cast<const int32_t*>(base + l.dest_row);
  const int64_t* mb = reinterpret_cast<const int64_t*>(base + l.mb_ranges);
  v.mb_begin = mb;
  v.mb_end = mb + l.max_minibatches;
  v.mb_real_rows = mb + 2 * l.max_minibatches;
  v.remote_rows = reinterpret_cast<const int32_t*>(base + l.remote_rows);
  v.remote_count = reinterpret_cast<const int32_t*>(base + l.remote_count);
  v.token_key = reinterpret_cast<const int32_t*>(base + l.token_key);
  v.token_order = reinterpret_cast<const int32_t*>(base + l.token_order);
  v.buffer_rows = l.buffer_rows;
  v.minibatch = l.minibatch;
  v.max_minibatches = l.max_minibatches;
  c.seg_offsets = reinterpret_cast<const int32_t*>(base + l.seg_offsets);
  c.seg_rows = reinterpret_cast<const int32_t*>(base + l.seg_rows);
  if (!l.activations) return c;
  if (!l.fp8 || l.deferred) {  // FP8: bf16 g, u only as a deferring backward's dg, du
    c.g = reinterpret_cast<bf16*>(base + l.g);
    c.u = reinterpret_cast<bf16*>(base + l.u);
    if (s.has_shared()) {
      c.shared_g = reinterpret_cast<bf16*>(base + l.shared_g);
      c.shared_u = reinterpret_cast<bf16*>(base + l.shared_u);
    }
  }
  if (l.fp8) {
    auto fp8 = [&](size_t codes, size_t scales) {
      return Fp8Saved{reinterpret_cast<uint8_t*>(base + codes), reinterpret_cast<float*>(base + scales)};
    };
    c.g8 = fp8(l.g8, l.g8_scales);
    c.u8 = fp8(l.u8, l.u8_scales);
    if (s.has_shared()) {
      c.shared_g8 = fp8(l.shared_g8, l.shared_g8_scales);
      c.shared_u8 = fp8(l.shared_u8, l.shared_u8_scales);
    }
  }
  if (l.deferred) {
    c.hs = reinterpret_cast<bf16*>(base + l.hs);
    if (s.has_shared()) c.shared_hs = reinterpret_cast<bf16*>(base + l.shared_hs);
  }
  return c;
}

void save_schedule(const comm::CommState& state, const ForwardBuffers& b, const ContextLayout& l, char* base,
                   cudaStream_t stream) {
  const LayerShape& s = state.shape();
  const comm::ScheduleView v = state.view();
  const int64_t E = s.local_experts();
  auto copy = [&](size_t off, const void* src, size_t bytes) {
    MOK_CUDA_CHECK(cudaMemcpyAsync(base + off, src, bytes, cudaMemcpyDeviceToDevice, stream));
  };
  copy(l.header, v.header, sizeof(comm::ScheduleHeader));
  copy(l.expert_offset, v.expert_offset, (E + 1) * sizeof(int64_t));
  copy(l.expert_rows, v.expert_rows, E * sizeof(int64_t));
  copy(l.rows, v.rows, l.buffer_rows * sizeof(comm::RowEntry));
  copy(l.dest_row, v.dest_row, static_cast<size_t>(s.ep) * s.tokens * s.topk * sizeof(int32_t));
  copy(l.mb_ranges, v.mb_begin, 3 * l.max_minibatches * sizeof(int64_t));
  copy(l.remote_rows, v.remote_rows, l.buffer_rows * sizeof(int32_t));
  copy(l.remote_count, v.remote_count, sizeof(int32_t));
  copy(l.token_key, v.token_key, s.tokens * sizeof(int32_t));
  copy(l.token_order, v.token_order, s.tokens * sizeof(int32_t));
  copy(l.seg_offsets, b.seg_offsets.get(), (E + 1) * sizeof(int32_t));
  copy(l.seg_rows, b.seg_rows.get(), E * sizeof(int32_t));
}

}  // namespace mok::megakernel
