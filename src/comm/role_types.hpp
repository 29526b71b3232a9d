// Parameters of the communication roles (host-compilable); the device code is in roles.cuh.
#pragma once

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

#include "comm/peer_map.hpp"
#include "comm/schedule.hpp"
#include "comm/sync_types.hpp"

namespace mok::comm {

// Shape of a communication CTA. 16 warps x 16 vectors x 16 B = 128 KiB in flight per CTA:
// NVLink loads take microseconds, and 16 CTAs must keep ~1 MB in flight to fill a link.
struct CommCtaConfig {
  static constexpr int kThreads = 512;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kUnroll = 16;
};

struct DispatchRole {
  PeerMap peers;
  size_t x_offset = 0;              // SymmetricLayout::x
  int64_t row_bytes = 0;            // H * 2, a multiple of 128
  const ScheduleHeader* header = nullptr;
  const RowEntry* rows = nullptr;
  char* row_buffer = nullptr;       // [buffer_rows, H] bf16, local
  uint32_t* ready = nullptr;        // [max_minibatches] +1 per finished row tile (zeroed before)
  uint32_t* tile_done = nullptr;    // [buffer_rows / kRowTile] first-occurrence rows landed (zeroed before)
  int64_t tiles_per_minibatch = 1;
  bool dedup = false;               // pull each (token, rank) once, copy the other rows locally
  WaitContext wait;
};

struct CombineRole {
  PeerMap peers;
  size_t slots_offset = 0;          // SymmetricLayout::slots
  int64_t row_bytes = 0;
  int topk = 1;
  const ScheduleHeader* header = nullptr;
  const RowEntry* rows = nullptr;
  const char* expert_out = nullptr; // [buffer_rows, H] bf16, local (GEMM 2 output)
  const uint32_t* out_ready = nullptr;  // optional [tiles]: row tile t is final once >= out_ready_target
  uint32_t out_ready_target = 0;
  WaitContext wait;
};

struct EpilogueRole {
  const char* slots = nullptr;             // this rank's [T, K, H] bf16 slots (after the barrier)
  const float* topk_w = nullptr;           // [T, K]
  const __nv_bfloat16* shared_out = nullptr;  // [T, H] shared-expert output, or nullptr (acc = 0)
  __nv_bfloat16* y = nullptr;              // [T, H]
  int64_t tokens = 0, hidden = 0;
  int topk = 1;
};

}  // namespace mok::comm
