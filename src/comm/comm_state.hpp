// Everything one rank of the communication layer owns, and its operations on a stream
// (Workspace::Impl holds one). All operations are collective in the sense that every rank
// issues the same sequence: each one that synchronises ranks runs one round of its barrier
// site, counted on the device (barrier.cuh), so captured CUDA graphs replay safely.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <memory>
#include <optional>

#include "comm/device_buffer.hpp"
#include "comm/error_record.hpp"
#include "comm/nccl_window.hpp"
#include "comm/peer_map.hpp"
#include "comm/roles.hpp"
#include "comm/schedule.hpp"
#include "comm/sync_types.hpp"
#include "mok/config.hpp"
#include "mok/error.hpp"
#include "mok/shape.hpp"

namespace mok::comm {

// Group-barrier sites: one GroupSync and one flag array each, each counting its own rounds.
enum class SyncSite : int {
  kExchange = 0,            // the schedule's routing-table exchange
  kDispatchStart = 1,       // standalone dispatch (staged forward, the backward's pulls)
  kCombineDone = 2,         // standalone combine
  kFusedDispatchStart = 3,  // the fused forward's start
  kFusedCombineDone = 4,    // the fused forward's combine
  kCount = kBarrierSites,
};

class CommState {
 public:
  // Collective. The current CUDA device must be the communicator's device. `row_buffer_rows`:
  // rows of the expert-major row buffer, 0 = every row of the schedule's buffer; fewer (a
  // multiple of the minibatch, Config::resident_routed_rows) make it the fused forward's
  // macrobatch ring, which the standalone dispatch refuses.
  CommState(const LayerShape& shape, const Config& config, ncclComm_t comm, int64_t row_buffer_rows = 0);
  // Over an existing window of window_bytes(shape) bytes (simulated ranks: no communicator, so
  // take_error has no NCCL async error to read).
  CommState(const LayerShape& shape, const Config& config, std::unique_ptr<SymmetricWindow> window,
            int64_t row_buffer_rows = 0);
  static size_t window_bytes(const LayerShape& shape) { return SymmetricLayout::make(shape).total; }
  ~CommState();
  CommState(const CommState&) = delete;
  CommState& operator=(const CommState&) = delete;

  // ---- operations (stream-ordered, no host sync) ----
  void schedule(const int32_t* topk_idx, cudaStream_t stream) { schedule(topk_idx, shape_.tokens, stream); }
  // A call of `tokens` (<= T) tokens: topk_idx [tokens, K]; ScheduleView::tokens says it after.
  void schedule(const int32_t* topk_idx, int64_t tokens, cudaStream_t stream);
  // x [tokens, H] into the symmetric staging buffer (nothing to do when x is x_staging()).
  void stage_x(const __nv_bfloat16* x, cudaStream_t stream) { stage_x(x, shape_.tokens, stream); }
  void stage_x(const __nv_bfloat16* x, int64_t tokens, cudaStream_t stream);
  // Barrier (x staged everywhere), then pull every routed row into row_buffer().
  void dispatch(int ctas, bool dedup, cudaStream_t stream);
  // The launch descriptors behind dispatch()/combine(), for callers that adjust a role (tests,
  // benchmarks) before launch_dispatch/launch_combine. Each runs one round of its barrier
  // site: launch it exactly once, on every rank.
  DispatchLaunch dispatch_launch(int ctas, bool dedup);
  // The same over a saved routing table (a layer's forward context, src/megakernel/context.hpp),
  // pulling from window region `src_offset` ([T, H] bf16: SymmetricLayout::x or ::dy) into `dst`
  // ([buffer_rows, H], every routed row, also when row_buffer() is the macrobatch ring): the
  // backward's pulls of x and dy.
  DispatchLaunch dispatch_launch(int ctas, bool dedup, const ScheduleView& view, size_t src_offset,
                                 __nv_bfloat16* dst);
  // The roles alone (no barrier): what dispatch_launch / combine_launch carry,
  // and what the fused kernel runs beside its own barriers.
  DispatchRole dispatch_role(bool dedup);
  DispatchRole dispatch_role(bool dedup, const ScheduleView& view);
  CombineRole combine_role(const __nv_bfloat16* expert_out, bool own_rows_in_place) const;
  CombineRole combine_role(const __nv_bfloat16* expert_out, bool own_rows_in_place, const ScheduleView& view) const;
  CombineLaunch combine_launch(const __nv_bfloat16* expert_out, int ctas, bool own_rows_in_place);
  CombineLaunch combine_launch(const __nv_bfloat16* expert_out, int ctas, bool own_rows_in_place,
                               const ScheduleView& view);
  // Push expert_out [buffer_rows, H] rows to their slots, then barrier. own_rows_in_place: only
  // the rows of other ranks' tokens move; the epilogue must then be given the same expert_out.
  void combine(const __nv_bfloat16* expert_out, int ctas, bool own_rows_in_place, cudaStream_t stream);
  // y = bf16(fmaf chain over k), after combine. own_rows: the expert_out of an in-place combine
  // (the own rank's (t, k) rows are read there), nullptr when combine filled every slot.
  void epilogue(const float* topk_w, const __nv_bfloat16* shared_out, const __nv_bfloat16* own_rows,
                __nv_bfloat16* y, cudaStream_t stream);
  // The same over a saved routing table (own_rows' rows are named by view.dest_row).
  void epilogue(const float* topk_w, const __nv_bfloat16* shared_out, const __nv_bfloat16* own_rows,
                __nv_bfloat16* y, const ScheduleView& view, cudaStream_t stream);
  // Synchronises `stream`, returns (and clears) the first device-side error. Stream-ordered
  // (no legacy-default-stream copies), so it works with non-blocking streams.
  std::optional<Error> take_error(cudaStream_t stream);

  // ---- accessors ----
  // Device memory beside the window: the schedule, the row buffer, counters and records.
  size_t device_bytes() const {
    return schedule_->bytes() + row_buffer_.bytes() + counters_.bytes() + syncs_.bytes() + error_.bytes();
  }
  const LayerShape& shape() const { return shape_; }
  const Config& config() const { return config_; }
  int rank() const { return window_->peers().rank; }
  const PeerMap& peers() const { return window_->peers(); }
  const SymmetricLayout& layout() const { return layout_; }
  ScheduleView view() const { return schedule_->view(); }
  const ScheduleBuffers& schedule_buffers() const { return *schedule_; }
  ScheduleBuffers& schedule_buffers() { return *schedule_; }
  __nv_bfloat16* x_staging() const { return reinterpret_cast<__nv_bfloat16*>(window_->local() + layout_.x); }
  const __nv_bfloat16* slots() const { return reinterpret_cast<const __nv_bfloat16*>(window_->local() + layout_.slots); }
  __nv_bfloat16* dy_staging() const { return reinterpret_cast<__nv_bfloat16*>(window_->local() + layout_.dy); }
  float* topk_w_staging() const { return reinterpret_cast<float*>(window_->local() + layout_.topk_w); }
  float* dtopk_landing() const { return reinterpret_cast<float*>(window_->local() + layout_.dtopk); }
  char* window_local() const { return window_->local(); }
  // [T, K] this rank's row of each own entry (t, k), -1 where another rank owns the expert
  // (the schedule's dest_row for this rank's tokens; EpilogueRole::own_dest_row).
  const int32_t* own_dest_row() const {
    return schedule_->dest_row.get() + static_cast<int64_t>(rank()) * shape_.tokens * shape_.topk;
  }
  // [T] rows pushed into each own token's slots (SymmetricLayout::arrivals; CombineRole::count_arrivals).
  uint32_t* arrivals() const { return reinterpret_cast<uint32_t*>(window_->local() + layout_.arrivals); }
  __nv_bfloat16* row_buffer() const { return row_buffer_.get(); }
  // Rows of row_buffer(): the schedule's buffer_rows, or fewer for the macrobatch ring.
  int64_t row_buffer_rows() const { return row_buffer_rows_; }
  bool row_buffer_is_ring() const { return row_buffer_rows_ < schedule_->buffer_rows; }
  uint32_t* ready_counters() const { return counters_.get(); }  // [max_minibatches]
  uint32_t* tile_flags() const { return counters_.get() + schedule_->max_minibatches; }
  // One word after the tile flags: zeroed with the counters before a fused pass, set to 1 when its
  // start barrier opens (GroupBarrier::open_flag).
  uint32_t* pass_open_flag() const {
    return counters_.get() + schedule_->max_minibatches + schedule_->buffer_rows / kRowTile;
  }
  GroupSync* sync(SyncSite site) const { return syncs_.get() + static_cast<int>(site); }
  // The barrier of `site` (its GroupSync and flag array; rounds are counted on the device).
  GroupBarrier barrier(SyncSite site) const {
    return GroupBarrier{sync(site), layout_.site_flags(static_cast<int>(site)), nullptr};
  }
  DeviceErrorRecord* error_record() const { return error_.get(); }
  WaitContext wait_context() const;
  // Accounting (tests, benchmarks): while on, every dispatch role made from this state adds the
  // bytes of the rows it reads from other ranks' windows (DispatchRole::remote_bytes) to one
  // device counter; take_dispatch_bytes synchronises `stream`, returns the count and zeroes it.
  void count_dispatch_bytes(bool on) { count_dispatch_bytes_ = on; }
  uint64_t take_dispatch_bytes(cudaStream_t stream);

 private:
  LayerShape shape_;
  Config config_;
  ncclComm_t comm_ = nullptr;  // null for simulated ranks
  SymmetricLayout layout_;
  std::unique_ptr<SymmetricWindow> window_;
  std::unique_ptr<ScheduleBuffers> schedule_;
  DeviceBuffer<__nv_bfloat16> row_buffer_;
  DeviceBuffer<uint32_t> counters_;
  DeviceBuffer<GroupSync> syncs_;
  DeviceBuffer<DeviceErrorRecord> error_;
  DeviceBuffer<unsigned long long> dispatch_bytes_;
  bool count_dispatch_bytes_ = false;
  int64_t row_buffer_rows_ = 0;
};

}  // namespace mok::comm
