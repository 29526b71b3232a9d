#include "comm/comm_state.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "comm/cuda_check.hpp"
#include "comm/roles.hpp"

namespace mok::comm {

CommState::CommState(const LayerShape& shape, const Config& config, ncclComm_t comm, int64_t row_buffer_rows)
    : CommState(shape, config, std::make_unique<SymmetricWindow>(comm, window_bytes(shape)), row_buffer_rows) {
  comm_ = comm;
}

CommState::CommState(const LayerShape& shape, const Config& config, std::unique_ptr<SymmetricWindow> window,
                     int64_t row_buffer_rows)
    : shape_(shape), config_(config), layout_(SymmetricLayout::make(shape)), window_(std::move(window)) {
  if (window_ == nullptr || window_->bytes() < layout_.total || window_->peers().ep != shape.ep) {
    throw_invalid("CommState window", "a symmetric window of >= " + std::to_string(layout_.total) + " bytes over " +
                                          std::to_string(shape.ep) + " ranks",
                  window_ == nullptr ? std::string("nullptr")
                                     : std::to_string(window_->bytes()) + " bytes over " +
                                           std::to_string(window_->peers().ep) + " ranks");
  }
  schedule_ = std::make_unique<ScheduleBuffers>(shape, config);
  row_buffer_rows_ = row_buffer_rows > 0 ? std::min(row_buffer_rows, schedule_->buffer_rows) : schedule_->buffer_rows;
  if (row_buffer_rows_ < schedule_->buffer_rows && row_buffer_rows_ % schedule_->minibatch != 0) {
    throw_invalid("CommState row_buffer_rows", "a multiple of the minibatch (" + std::to_string(schedule_->minibatch) +
                                                   " rows) or the whole buffer",
                  std::to_string(row_buffer_rows));
  }
  row_buffer_ = DeviceBuffer<__nv_bfloat16>(static_cast<size_t>(row_buffer_rows_) * shape.hidden);
  counters_ = DeviceBuffer<uint32_t>(schedule_->max_minibatches + schedule_->buffer_rows / kRowTile + 1);
  syncs_ = DeviceBuffer<GroupSync>(static_cast<size_t>(SyncSite::kCount));
  error_ = DeviceBuffer<DeviceErrorRecord>(1);
  dispatch_bytes_ = DeviceBuffer<unsigned long long>(1);
  MOK_CUDA_CHECK(cudaMemset(dispatch_bytes_.get(), 0, dispatch_bytes_.bytes()));
  MOK_CUDA_CHECK(cudaMemset(syncs_.get(), 0, syncs_.bytes()));
  MOK_CUDA_CHECK(cudaMemset(counters_.get(), 0, counters_.bytes()));
  const DeviceErrorRecord clean = clean_error_record();
  MOK_CUDA_CHECK(cudaMemcpy(error_.get(), &clean, sizeof(clean), cudaMemcpyHostToDevice));
  // Nothing routed yet: the schedule starts poisoned, so a dispatch before schedule() moves nothing.
  const ScheduleHeader none{static_cast<int32_t>(Status::kInvalidArgument), 0, -1, -1, 0};
  MOK_CUDA_CHECK(cudaMemcpy(schedule_->header.get(), &none, sizeof(none), cudaMemcpyHostToDevice));
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
}

CommState::~CommState() { cudaDeviceSynchronize(); }

WaitContext CommState::wait_context() const {
  WaitContext w;
  w.error = error_.get();
  w.timeout_ns = static_cast<uint64_t>(std::llround(config_.wait_timeout_s * 1e9));
  w.rank = rank();
  return w;
}

void CommState::schedule(const int32_t* topk_idx, int64_t tokens, cudaStream_t stream) {
  check_schedule_tokens(shape_, tokens);
  ScheduleLaunch l;
  l.shape = shape_;
  l.peers = peers();
  l.layout = layout_;
  l.topk_idx = topk_idx;
  l.tokens = tokens;
  l.max_rows = config_.max_rows_per_rank(shape_);
  l.barrier = barrier(SyncSite::kExchange);
  l.wait = wait_context();
  launch_schedule(l, *schedule_, stream);
}

void CommState::stage_x(const __nv_bfloat16* x, int64_t tokens, cudaStream_t stream) {
  if (x == x_staging()) return;  // zero-copy: the caller wrote x into the window
  const size_t bytes = static_cast<size_t>(tokens) * shape_.hidden * sizeof(__nv_bfloat16);
  MOK_CUDA_CHECK(cudaMemcpyAsync(x_staging(), x, bytes, cudaMemcpyDeviceToDevice, stream));
}

DispatchRole CommState::dispatch_role(bool dedup) { return dispatch_role(dedup, view()); }

DispatchRole CommState::dispatch_role(bool dedup, const ScheduleView& v) {
  DispatchRole r;
  r.peers = peers();
  r.x_offset = layout_.x;
  r.row_bytes = shape_.hidden * 2;
  r.header = v.header;
  r.rows = v.rows;
  r.row_buffer = reinterpret_cast<char*>(row_buffer_.get());
  r.ready = ready_counters();
  r.tile_done = tile_flags();
  r.tiles_per_minibatch = schedule_->minibatch / kRowTile;
  r.dedup = dedup;
  r.wait = wait_context();
  r.dest_row = v.dest_row;
  r.tokens = shape_.tokens;
  r.topk = shape_.topk;
  r.remote_bytes = count_dispatch_bytes_ ? dispatch_bytes_.get() : nullptr;
  return r;
}

CombineRole CommState::combine_role(const __nv_bfloat16* expert_out, bool own_rows_in_place) const {
  return combine_role(expert_out, own_rows_in_place, view());
}

CombineRole CommState::combine_role(const __nv_bfloat16* expert_out, bool own_rows_in_place,
                                    const ScheduleView& v) const {
  CombineRole r;
  r.peers = peers();
  r.slots_offset = layout_.slots;
  r.row_bytes = shape_.hidden * 2;
  r.topk = shape_.topk;
  r.header = v.header;
  r.rows = v.rows;
  r.expert_out = reinterpret_cast<const char*>(expert_out);
  r.own_rows_in_place = own_rows_in_place;
  r.remote_rows = v.remote_rows;
  r.remote_count = v.remote_count;
  r.arrivals_offset = layout_.arrivals;
  r.wait = wait_context();
  return r;
}

DispatchLaunch CommState::dispatch_launch(int ctas, bool dedup) {
  if (row_buffer_is_ring()) {
    throw_invalid("Config.macrobatch",
                  "0 or at least the routed buffer (" + std::to_string(schedule_->buffer_rows) +
                      " rows) for the standalone dispatch (staged forward, comm benchmarks): it writes every routed "
                      "row, and this workspace's row buffer is a ring of " + std::to_string(row_buffer_rows_) + " rows",
                  std::to_string(config_.macrobatch));
  }
  DispatchLaunch l;
  l.role = dispatch_role(dedup);
  l.start = barrier(SyncSite::kDispatchStart);
  l.ctas = ctas;
  l.counters = counters_.get();
  l.counter_words = counters_.size();
  return l;
}

DispatchLaunch CommState::dispatch_launch(int ctas, bool dedup, const ScheduleView& v, size_t src_offset,
                                         __nv_bfloat16* dst) {
  DispatchLaunch l;  // dst has every routed row (with the ring too: the caller's rows, not the ring)
  l.role = dispatch_role(dedup, v);
  l.role.x_offset = src_offset;
  l.role.row_buffer = reinterpret_cast<char*>(dst);
  l.start = barrier(SyncSite::kDispatchStart);
  l.ctas = ctas;
  l.counters = counters_.get();
  l.counter_words = counters_.size();
  return l;
}

uint64_t CommState::take_dispatch_bytes(cudaStream_t stream) {
  unsigned long long n = 0;
  MOK_CUDA_CHECK(cudaMemcpyAsync(&n, dispatch_bytes_.get(), sizeof(n), cudaMemcpyDeviceToHost, stream));
  MOK_CUDA_CHECK(cudaMemsetAsync(dispatch_bytes_.get(), 0, sizeof(n), stream));
  MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
  return n;
}

void CommState::dispatch(int ctas, bool dedup, cudaStream_t stream) {
  launch_dispatch(dispatch_launch(ctas, dedup), stream);
}

CombineLaunch CommState::combine_launch(const __nv_bfloat16* expert_out, int ctas, bool own_rows_in_place) {
  CombineLaunch l;
  l.role = combine_role(expert_out, own_rows_in_place);
  l.done = barrier(SyncSite::kCombineDone);
  l.ctas = ctas;
  return l;
}

CombineLaunch CommState::combine_launch(const __nv_bfloat16* expert_out, int ctas, bool own_rows_in_place,
                                       const ScheduleView& v) {
  CombineLaunch l;
  l.role = combine_role(expert_out, own_rows_in_place, v);
  l.done = barrier(SyncSite::kCombineDone);
  l.ctas = ctas;
  return l;
}

void CommState::combine(const __nv_bfloat16* expert_out, int ctas, bool own_rows_in_place, cudaStream_t stream) {
  launch_combine(combine_launch(expert_out, ctas, own_rows_in_place), stream);
}

void CommState::epilogue(const float* topk_w, const __nv_bfloat16* shared_out, const __nv_bfloat16* own_rows,
                         __nv_bfloat16* y, cudaStream_t stream) {
  epilogue(topk_w, shared_out, own_rows, y, view(), stream);
}

void CommState::epilogue(const float* topk_w, const __nv_bfloat16* shared_out, const __nv_bfloat16* own_rows,
                         __nv_bfloat16* y, const ScheduleView& v, cudaStream_t stream) {
  EpilogueRole r;
  r.slots = reinterpret_cast<const char*>(slots());
  r.topk_w = topk_w;
  r.shared_out = shared_out;
  r.y = y;
  r.tokens = v.tokens;  // this call's tokens (the rows of y); the tables' stride stays T
  r.hidden = shape_.hidden;
  r.topk = shape_.topk;
  if (own_rows != nullptr) {
    r.own_dest_row = v.dest_row + static_cast<int64_t>(rank()) * shape_.tokens * shape_.topk;
    r.expert_out = reinterpret_cast<const char*>(own_rows);
  }
  launch_epilogue(r, stream);
}

std::optional<Error> CommState::take_error(cudaStream_t stream) {
  const cudaError_t e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) {
    return Error(Status::kCudaError, std::string("mok: the workspace's stream failed: ") + cudaGetErrorName(e) +
                                         " (" + cudaGetErrorString(e) + ")");
  }
  DeviceErrorRecord rec{};
  MOK_CUDA_CHECK(cudaMemcpyAsync(&rec, error_.get(), sizeof(rec), cudaMemcpyDeviceToHost, stream));
  MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::optional<Error> err = describe_device_error(rec, shape_, rank());
  if (err) {
    const DeviceErrorRecord clean = clean_error_record();
    MOK_CUDA_CHECK(cudaMemcpyAsync(error_.get(), &clean, sizeof(clean), cudaMemcpyHostToDevice, stream));
    MOK_CUDA_CHECK(cudaStreamSynchronize(stream));  // `clean` is a stack value
    return err;
  }
  if (comm_ == nullptr) return std::nullopt;  // simulated ranks: no communicator
  ncclResult_t async = ncclSuccess;
  MOK_NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
  if (async != ncclSuccess) {
    return Error(Status::kNcclError, std::string("mok: NCCL communicator error: ") + ncclGetErrorString(async));
  }
  return std::nullopt;
}

}  // namespace mok::comm
