// The GPU routing schedule of one rank (docs/comm.md), bitwise equal to
// mok::ref::make_schedule (src/reference/schedule.hpp) for this rank.
//
// Steps, all on the stream, no host sync:
//   1. exchange: this rank's topk_idx [Tc, K] (Tc <= T: this call's tokens, the same on every
//      rank) is written into slot `rank` of every peer's routing table (symmetric window), with
//      kEndOfTokens after it when Tc < T, then a phase barrier; entries of tokens >= Tc are
//      absent: never validated, counted or routed (a rank whose Tc differs is an error);
//   2. keys: every entry of the global table [ep*T*K] is checked (id in [0, E), no expert twice
//      in a token) and keyed by its local expert (E_local for entries owned by other ranks);
//   3. a stable CUB radix sort of (key, entry index): entries of each local expert end up in
//      global token order, which is the canonical order; placement never uses atomics;
//   4. segments: per-expert counts by binary search in the sorted keys, padded to kRowTile,
//      offsets by a block prefix sum; capacity check of EVERY rank (so all ranks fail
//      together); per-minibatch ranges;
//   5. rows: each buffer row's (src_rank, token, k), the owner row of each global entry;
//   6. dedup links: the first row (lowest local expert) of each token on this rank, which the
//      dedup dispatch reads once and fans out to the token's other rows;
//   7. remote rows: the buffer rows of other ranks' tokens in increasing order (CUB select), the
//      work list of the in-place combine (an even split over all comm warps);
//   8. token order: each of this rank's tokens is keyed (in step 2's kernel) by the largest
//      local expert index (id mod E_local) among its K experts, then a stable CUB radix sort
//      orders the tokens by key. Every rank walks its local experts in order (minibatches are
//      expert-major), so a token's last row is ready about when that expert's rows are: the
//      fused forward's top-k sum takes tokens in this order.
// On any routing error or capacity overflow every output is poisoned (-1, minibatches 0) and
// the header's status says why; the error record holds the details for Workspace::check().
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "comm/sync_types.hpp"
#include "comm/device_buffer.hpp"
#include "comm/peer_map.hpp"
#include "mok/config.hpp"
#include "mok/shape.hpp"

namespace mok::comm {

// One row of the expert-major receive buffer (16 bytes: one vector load on the device).
// Padding rows are all -1. copy_from: -1 = pull x[token] from src_rank; otherwise the row of
// this buffer that holds the same token (an earlier local expert), used by the dedup dispatch.
struct alignas(16) RowEntry {
  int32_t src_rank;
  int32_t token;
  int32_t k;
  int32_t copy_from;
};

struct ScheduleHeader {
  int32_t status;           // mok::Status: kOk, kInvalidArgument (routing), kCapacityOverflow
  int32_t unused;
  int64_t real_rows;        // -1 when poisoned
  int64_t padded_rows;      // -1 when poisoned; a multiple of kRowTile
  int64_t num_minibatches;  // 0 when poisoned
};

// Read-only device view for consumers (dispatch, combine, GEMM scheduler).
struct ScheduleView {
  const ScheduleHeader* header = nullptr;
  const int64_t* expert_offset = nullptr;  // [E_local + 1] padded row offsets
  const int64_t* expert_rows = nullptr;    // [E_local] real rows at each segment start
  const RowEntry* rows = nullptr;          // [buffer_rows]
  const int32_t* dest_row = nullptr;       // [ep*T*K] row in THIS rank's buffer of global entry
                                           // (s*T+t)*K+k, -1 when another rank owns it
  const int64_t* mb_begin = nullptr;       // [max_minibatches] padded row range of minibatch m
  const int64_t* mb_end = nullptr;
  const int64_t* mb_real_rows = nullptr;   // real rows inside minibatch m
  const int32_t* remote_rows = nullptr;    // [buffer_rows] rows of other ranks' tokens, increasing
  const int32_t* remote_count = nullptr;   // [1] how many (0 when poisoned)
  const int32_t* token_key = nullptr;      // [T] largest local expert index of this rank's token t (step 8)
  const int32_t* token_order = nullptr;    // [T] this rank's tokens by increasing key (stable)
  int64_t buffer_rows = 0;
  int64_t minibatch = 0;                   // rows per minibatch (a multiple of kRowTile)
  int64_t max_minibatches = 0;
  int64_t tokens = 0;                      // this call's tokens per rank (Tc <= LayerShape::tokens)
};

// Written after a rank's last entry when it calls with fewer tokens than the workspace's T.
inline constexpr int32_t kEndOfTokens = INT32_MIN;

// Device memory of one rank's schedule, sized once at workspace creation.
class ScheduleBuffers {
 public:
  ScheduleBuffers(const LayerShape& shape, const Config& config);
  ScheduleView view() const;
  size_t bytes() const;  // device memory of all the buffers below

  DeviceBuffer<ScheduleHeader> header;
  DeviceBuffer<int64_t> expert_offset, expert_rows, segment_begin;
  DeviceBuffer<RowEntry> rows;
  DeviceBuffer<int32_t> dest_row;
  DeviceBuffer<int64_t> minibatch_ranges;  // [3][max_minibatches]: begin, end, real rows
  DeviceBuffer<int32_t> remote_rows, remote_count;
  DeviceBuffer<int32_t> token_key, token_ids, token_order;
  int token_key_bits = 1;
  DeviceBuffer<uint32_t> keys_in, keys_out, vals_in, vals_out;
  DeviceBuffer<unsigned long long> owner_rows;  // [ep] routed rows of every rank (capacity check)
  DeviceBuffer<unsigned char> sort_temp;
  int64_t buffer_rows = 0, minibatch = 0, max_minibatches = 0, entries = 0;
  int64_t call_tokens = 0;  // Tc of the last launch_schedule (ScheduleView::tokens)
  int key_bits = 1;
};

struct ScheduleLaunch {
  LayerShape shape;
  PeerMap peers;
  SymmetricLayout layout;
  const int32_t* topk_idx = nullptr;  // this rank's [tokens, K], device
  int64_t tokens = 0;                 // Tc: this call's tokens, 1..shape.tokens
  int64_t max_rows = 0;               // Config::max_rows_per_rank (real rows)
  GroupBarrier barrier;               // the exchange barrier
  WaitContext wait;
};

// Throws kInvalidArgument unless 1 <= tokens <= s.tokens (callers check before anything is enqueued).
void check_schedule_tokens(const LayerShape& s, int64_t tokens);
void launch_schedule(const ScheduleLaunch& launch, ScheduleBuffers& buffers, cudaStream_t stream);

}  // namespace mok::comm
