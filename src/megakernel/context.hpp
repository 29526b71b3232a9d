// The saved forward context of one layer (docs/architecture.md): what a forward leaves for its backward,
// in one block of device memory that mok or the caller owns (mok::Context, include/mok/api.hpp).
//
//   routing table  the schedule the forward ran on (header, segments, row list, owner rows,
//                  minibatch ranges, the in-place combine's remote-row list) and the GEMM
//                  engine's int32 segments: the backward replays it, no new routing exchange;
//   g, u           [buffer_rows, I] bf16 pre-activations of every routed row (h is rebuilt);
//   shared g, u    [T rounded up to 128, I_shared] of the shared expert;
//                  with Config::precision kFp8Block both in e4m3 with 1x128 scales instead
//                  (DeepSeek-V3's FP8-cached SwiGLU input: ~0.52x the bytes; docs/fp8.md).
// x is not kept: the backward takes it again (BackwardArgs::x) and dispatches it again for
// the gate/up weight gradients, which is NVLink traffic instead of [buffer_rows, H] per layer.
// Neither are the expert outputs: d topk_w comes from the dgrad's accumulator (numerics.md).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "comm/comm_state.hpp"
#include "mok/api.hpp"

namespace mok::megakernel {

struct ForwardBuffers;

// Byte offsets of the pieces inside one context block (each 256-byte aligned).
struct ContextLayout {
  size_t header = 0, expert_offset = 0, expert_rows = 0, rows = 0, dest_row = 0, mb_ranges = 0, remote_rows = 0,
         remote_count = 0, token_key = 0, token_order = 0, seg_offsets = 0, seg_rows = 0, g = 0, u = 0,
         shared_g = 0, shared_u = 0, hs = 0, shared_hs = 0;
  // Config::precision kFp8Block: g, u (and shared g, u) kept in e4m3, 1x128 blocks along I, scales
  // K-block major ([ceil(I / 128)][rows]); the bf16 g, u regions then exist only for a deferring
  // backward's dg, du.
  size_t g8 = 0, g8_scales = 0, u8 = 0, u8_scales = 0, shared_g8 = 0, shared_g8_scales = 0, shared_u8 = 0,
         shared_u8_scales = 0;
  bool fp8 = false;
  size_t schedule_bytes = 0;  // the routing table's share (everything before g)
  size_t total = 0;
  int64_t buffer_rows = 0, shared_rows = 0, max_minibatches = 0, minibatch = 0;
  bool activations = true;  // g, u, shared g, u have room (false: the routing table only)
  bool deferred = false;    // also hs, shared hs: a backward may defer its weight gradients
  // keep: 0 the routing table only, 1 and the activations, 2 and room for a deferred weight gradient
  // (mok::Context::Keep's values)
  static ContextLayout make(const LayerShape& shape, const Config& config, int keep = 1);
};

// An activation kept in FP8 (Fp8Rows' layout: codes [rows, I], scales [ceil(I / 128)][rows]).
struct Fp8Saved {
  uint8_t* codes = nullptr;
  float* scales = nullptr;
};

// Device pointers into one context block.
struct SavedContext {
  comm::ScheduleView schedule;  // the forward's routing table (the copy in this block)
  const int32_t* seg_offsets = nullptr;  // [E_local + 1] the GEMM engine's segments
  const int32_t* seg_rows = nullptr;     // [E_local]
  bf16* g = nullptr;  // [buffer_rows, I]; nullptr: not kept (the backward recomputes g, u)
  bf16* u = nullptr;
  bf16* shared_g = nullptr;  // [shared_rows, I_shared] (nullptr without a shared expert)
  bf16* shared_u = nullptr;
  // A deferring backward leaves its weight gradients' inputs here: dg, du in place of g, u, and
  // hs [buffer_rows, I], shared hs [shared_rows, I_shared] (nullptr unless the layout has room).
  bf16* hs = nullptr;
  bf16* shared_hs = nullptr;
  // FP8 layouts: the kept g, u (codes nullptr: none kept, or a bf16 context).
  Fp8Saved g8, u8, shared_g8, shared_u8;
  static SavedContext at(char* base, const ContextLayout& layout, const LayerShape& shape);
};

// Stream-ordered, after the forward's schedule and convert_segments: copies the routing table
// (CommState's schedule, ForwardBuffers' int32 segments) into the context block.
void save_schedule(const comm::CommState& state, const ForwardBuffers& buffers, const ContextLayout& layout,
                   char* base, cudaStream_t stream);

}  // namespace mok::megakernel
