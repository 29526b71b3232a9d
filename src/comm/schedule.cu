// GPU routing schedule (see schedule.hpp for the steps). One params struct per kernel.
#include "comm/schedule.hpp"

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_select.cuh>
#include <thrust/iterator/counting_iterator.h>

#include <algorithm>
#include <bit>
#include <numeric>
#include <vector>

#include "comm/barrier.cuh"
#include "comm/cuda_check.hpp"

namespace mok::comm {
namespace {

constexpr int kThreads = 256;
constexpr int kSegmentThreads = 512;  // 1024 would cap registers at 64 and spill
constexpr int kMaxExchangeCtas = 32;  // co-resident on any GPU: the group barrier needs that

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- 1. exchange ---------------------------------------------------------------------------
struct ExchangeParams {
  PeerMap peers;
  size_t table_offset[2];  // layout.topk: the exchange round's parity picks one
  const int32_t* topk_idx;
  int64_t entries;       // Tc*K of one rank
  int64_t slot_entries;  // T*K: the slot's size (kEndOfTokens at `entries` when smaller)
  GroupBarrier barrier;
  WaitContext wait;
};

// The routing-table buffer of the exchange round `round` (1, 2, ...): tables alternate so that a
// rank already writing the next round's never overwrites one a slow peer still reads.
__device__ __forceinline__ int table_parity(uint64_t round) { return static_cast<int>(round & 1u); }

__global__ void __launch_bounds__(kThreads) exchange_kernel(const ExchangeParams p) {
  // NOTE: every thread reads the round before its CTA arrives at the barrier below (the
  // group_barrier's bar.sync orders it), and the round moves only once every CTA arrived.
  const size_t table_offset = p.table_offset[table_parity(barrier_round(p.barrier.sync))];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t slot_bytes = static_cast<size_t>(p.slot_entries) * sizeof(int32_t);
  for (int peer = 0; peer < p.peers.ep; ++peer) {
    char* dst = p.peers.base[peer] + table_offset + static_cast<size_t>(p.peers.rank) * slot_bytes;
    // 16-byte vectors when both ends allow (a slot of T*K entries not a multiple of 4 leaves the
    // slots of ranks >= 1 only 4- or 8-byte aligned).
    const bool vector = (p.entries % 4 == 0) && (reinterpret_cast<uintptr_t>(p.topk_idx) % 16 == 0) &&
                        (reinterpret_cast<uintptr_t>(dst) % 16 == 0);
    if (vector) {
      const int4* src4 = reinterpret_cast<const int4*>(p.topk_idx);
      int4* dst4 = reinterpret_cast<int4*>(dst);
      for (int64_t i = first; i < p.entries / 4; i += stride) dst4[i] = src4[i];
    } else {
      int32_t* dst1 = reinterpret_cast<int32_t*>(dst);
      for (int64_t i = first; i < p.entries; i += stride) dst1[i] = p.topk_idx[i];
    }
    if (first == 0 && p.entries < p.slot_entries) reinterpret_cast<int32_t*>(dst)[p.entries] = kEndOfTokens;
  }
  group_barrier(p.barrier, gridDim.x, p.peers, p.wait);
}

// ---- 2. keys and validation ----------------------------------------------------------------
struct KeyParams {
  const int32_t* tables[2];  // this rank's copies of the global table [ep*T*K] (layout.topk)
  const GroupSync* exchange;  // the exchange barrier's site: its last round picks the table
  int64_t entries;       // ep*T*K
  int topk;
  int64_t experts, local_experts;
  int rank;
  uint32_t* keys;
  uint32_t* vals;
  unsigned long long* owner_rows;  // [ep] routed rows each rank receives (zeroed before)
  int ep;
  DeviceErrorRecord* error;
  int64_t tokens;      // T per rank (the table's slot stride)
  int64_t call_tokens; // Tc: entries of tokens >= Tc are absent
  int32_t* token_key;  // [T] step 8
};

__device__ inline unsigned long long routing_key(int64_t item, RoutingErrorKind kind, int32_t value) {
  return (static_cast<unsigned long long>(item) << 34) |
         (static_cast<unsigned long long>(kind) << 32) | static_cast<uint32_t>(value);
}

__device__ inline void key_one(const KeyParams& p, int64_t i, unsigned int* owner_count) {
  const int32_t* table = p.tables[table_parity(p.exchange->opened)];  // the exchange before this kernel
  const int32_t id = table[i];
  const int k = static_cast<int>(i % p.topk);
  const int64_t slot_entries = p.tokens * p.topk, in_slot = i % slot_entries;
  const bool present = in_slot < p.call_tokens * p.topk;
  bool ok = present && id >= 0 && id < p.experts;
  if (present && id == kEndOfTokens) {
    atomicMin(&p.error->routing_key, routing_key(i, RoutingErrorKind::kTokenCount, id));  // that rank has fewer
  } else if (present && !ok) {
    atomicMin(&p.error->routing_key, routing_key(i, RoutingErrorKind::kBadId, id));
  } else if (present) {
    for (int j = 0; j < k; ++j) {
      if (table[i - k + j] == id) {
        atomicMin(&p.error->routing_key, routing_key(i, RoutingErrorKind::kDuplicate, id));
        ok = false;
        break;
      }
    }
  } else if (in_slot == p.call_tokens * p.topk && id != kEndOfTokens) {
    atomicMin(&p.error->routing_key, routing_key(i, RoutingErrorKind::kTokenCount, id));  // that rank has more
  }
  const int64_t owner = ok ? id / p.local_experts : -1;
  if (ok) atomicAdd(&owner_count[owner], 1u);
  p.keys[i] = owner == p.rank ? static_cast<uint32_t>(id - owner * p.local_experts)
                              : static_cast<uint32_t>(p.local_experts);
  p.vals[i] = static_cast<uint32_t>(i);
  // Step 9: the entry k = 0 of each of this rank's tokens keys the token (ids out of range
  // count as 0; such a schedule is poisoned and the keys are never used). Absent tokens key
  // E_local: the stable sort puts them after every present token.
  const int64_t own0 = static_cast<int64_t>(p.rank) * slot_entries;
  if (k == 0 && i >= own0 && i < own0 + slot_entries) {
    int32_t key = static_cast<int32_t>(p.local_experts);
    if (present) {
      key = 0;
      for (int j = 0; j < p.topk; ++j) {
        const int32_t e = table[i + j];
        if (e >= 0 && e < p.experts) key = max(key, static_cast<int32_t>(e % p.local_experts));
      }
    }
    p.token_key[(i - own0) / p.topk] = key;
  }
}

// Every rank counts the rows of EVERY rank (it holds the global table), so a capacity
// overflow anywhere poisons every rank's schedule: a rank whose tokens went to an overflowing
// peer must not return a y missing their contributions. Integer atomics count, never place.
__global__ void __launch_bounds__(kThreads) key_kernel(const KeyParams p) {
  __shared__ unsigned int owner_count[kMaxEp];
  for (int d = threadIdx.x; d < p.ep; d += blockDim.x) owner_count[d] = 0;
  __syncthreads();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < p.entries) key_one(p, i, owner_count);
  __syncthreads();
  for (int d = threadIdx.x; d < p.ep; d += blockDim.x) {
    if (owner_count[d] != 0) atomicAdd(&p.owner_rows[d], static_cast<unsigned long long>(owner_count[d]));
  }
}

// ---- 4. segments ---------------------------------------------------------------------------
struct SegmentParams {
  const uint32_t* sorted_keys;
  int64_t entries;
  int64_t local_experts;
  int64_t max_rows, buffer_rows, minibatch, max_minibatches;
  int rank;
  ScheduleHeader* header;
  int64_t* expert_offset;
  int64_t* expert_rows;
  int64_t* segment_begin;   // first sorted entry of each local expert
  int64_t* mb;              // [3][max_minibatches]
  const unsigned long long* owner_rows;  // [ep] routed rows of every rank
  int ep;
  DeviceErrorRecord* error;
};

__device__ inline int64_t lower_bound(const uint32_t* a, int64_t n, uint32_t v) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (a[mid] < v) lo = mid + 1; else hi = mid;
  }
  return lo;
}

__device__ inline void poison_segments(const SegmentParams& p) {
  for (int64_t e = threadIdx.x; e <= p.local_experts; e += blockDim.x) {
    p.expert_offset[e] = -1;
    if (e < p.local_experts) p.expert_rows[e] = -1;
  }
  for (int64_t m = threadIdx.x; m < 3 * p.max_minibatches; m += blockDim.x) p.mb[m] = -1;
  if (threadIdx.x == 0) {
    p.header->real_rows = -1;
    p.header->padded_rows = -1;
    p.header->num_minibatches = 0;
  }
}

// Real rows of [begin, end) = overlap with each expert's real prefix of its segment.
__device__ inline int64_t real_rows_in(const SegmentParams& p, int64_t begin, int64_t end) {
  int64_t n = 0;
  for (int64_t e = 0; e < p.local_experts; ++e) {
    const int64_t lo = max(begin, p.expert_offset[e]);
    const int64_t hi = min(end, p.expert_offset[e] + p.expert_rows[e]);
    n += hi > lo ? hi - lo : 0;
  }
  return n;
}

__global__ void __launch_bounds__(kSegmentThreads) segment_kernel(const SegmentParams p) {
  using Scan = cub::BlockScan<int64_t, kSegmentThreads>;
  using Reduce = cub::BlockReduce<int64_t, kSegmentThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } tmp;
  __shared__ int64_t padded_total, real_total;
  __shared__ int32_t status;

  int64_t running = 0, real = 0;
  for (int64_t base = 0; base < p.local_experts; base += kSegmentThreads) {
    const int64_t e = base + threadIdx.x;
    int64_t count = 0, begin = 0;
    if (e < p.local_experts) {
      begin = lower_bound(p.sorted_keys, p.entries, static_cast<uint32_t>(e));
      count = lower_bound(p.sorted_keys, p.entries, static_cast<uint32_t>(e + 1)) - begin;
    }
    const int64_t padded = ceil_div(count, kRowTile) * kRowTile;
    int64_t offset = 0, chunk_total = 0;
    Scan(tmp.scan).ExclusiveSum(padded, offset, chunk_total);
    __syncthreads();
    const int64_t chunk_real = Reduce(tmp.reduce).Sum(count);
    __syncthreads();
    if (e < p.local_experts) {
      p.expert_offset[e] = running + offset;
      p.expert_rows[e] = count;
      p.segment_begin[e] = begin;
    }
    running += chunk_total;
    if (threadIdx.x == 0) real += chunk_real;  // BlockReduce's result is valid in thread 0 only
  }
  if (threadIdx.x == 0) {
    p.expert_offset[p.local_experts] = running;
    padded_total = running;
    real_total = real;
    int32_t s = static_cast<int32_t>(Status::kOk);
    if (p.error->routing_key != kNoRoutingError) {
      s = static_cast<int32_t>(Status::kInvalidArgument);
    } else {
      // Any rank over capacity (lowest first) fails every rank; padding cannot overflow the
      // buffer once the real rows fit (buffer_rows_per_rank adds the worst-case padding).
      for (int d = 0; d < p.ep; ++d) {
        const int64_t rows_d = static_cast<int64_t>(p.owner_rows[d]);
        if (rows_d > p.max_rows) {
          s = static_cast<int32_t>(Status::kCapacityOverflow);
          record_error(p.error, s, 0, d, p.max_rows, rows_d);
          break;
        }
      }
      if (s == static_cast<int32_t>(Status::kOk) && running > p.buffer_rows) {
        s = static_cast<int32_t>(Status::kCapacityOverflow);
        record_error(p.error, s, 0, p.rank, p.max_rows, real);
      }
    }
    status = s;
    p.header->status = s;
  }
  __syncthreads();
  if (status != static_cast<int32_t>(Status::kOk)) {
    poison_segments(p);
    return;
  }
  const int64_t num_mb = ceil_div(padded_total, p.minibatch);
  for (int64_t m = threadIdx.x; m < p.max_minibatches; m += blockDim.x) {
    const int64_t begin = min(m * p.minibatch, padded_total);
    const int64_t end = min(begin + p.minibatch, padded_total);
    p.mb[m] = begin;
    p.mb[p.max_minibatches + m] = end;
    p.mb[2 * p.max_minibatches + m] = real_rows_in(p, begin, end);
  }
  if (threadIdx.x == 0) {
    p.header->real_rows = real_total;
    p.header->padded_rows = padded_total;
    p.header->num_minibatches = num_mb;
  }
}

// ---- 5. rows -------------------------------------------------------------------------------
struct RowParams {
  const ScheduleHeader* header;
  const int64_t* expert_offset;
  const int64_t* expert_rows;
  const int64_t* segment_begin;
  const uint32_t* sorted_vals;
  int64_t local_experts, buffer_rows, tokens;
  int topk;
  RowEntry* rows;
  int32_t* dest_row;
};

__global__ void __launch_bounds__(kThreads) row_kernel(const RowParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.buffer_rows) return;
  RowEntry row{-1, -1, -1, -1};
  if (p.header->status == static_cast<int32_t>(Status::kOk) && i < p.header->padded_rows) {
    // The expert owning row i: the last e with offset[e] <= i (empty segments come before it).
    int64_t lo = 0, hi = p.local_experts - 1;  // answer in [0, local_experts)
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (p.expert_offset[mid] <= i) lo = mid; else hi = mid - 1;
    }
    const int64_t j = i - p.expert_offset[lo];
    if (j < p.expert_rows[lo]) {
      const uint32_t entry = p.sorted_vals[p.segment_begin[lo] + j];
      const int64_t global_token = entry / p.topk;
      row.src_rank = static_cast<int32_t>(global_token / p.tokens);
      row.token = static_cast<int32_t>(global_token % p.tokens);
      row.k = static_cast<int32_t>(entry % p.topk);
      p.dest_row[entry] = static_cast<int32_t>(i);
    }
  }
  p.rows[i] = row;
}

// ---- 6. dedup links ------------------------------------------------------------------------
struct LinkParams {
  const ScheduleHeader* header;
  const int32_t* dest_row;
  int64_t buffer_rows, tokens;
  int topk;
  RowEntry* rows;
};

__global__ void __launch_bounds__(kThreads) link_kernel(const LinkParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.buffer_rows || p.header->status != static_cast<int32_t>(Status::kOk)) return;
  RowEntry row = p.rows[i];
  if (row.src_rank < 0) return;
  const int64_t entry0 = (static_cast<int64_t>(row.src_rank) * p.tokens + row.token) * p.topk;
  int64_t first = i;
  for (int k = 0; k < p.topk; ++k) {
    const int32_t d = p.dest_row[entry0 + k];
    if (d >= 0 && d < first) first = d;
  }
  row.copy_from = first == i ? -1 : static_cast<int32_t>(first);
  p.rows[i] = row;
}

// ---- 7. remote rows ------------------------------------------------------------------------
struct IsRemoteRow {
  const RowEntry* rows;
  int rank;
  __device__ bool operator()(int32_t i) const {
    const int32_t src = rows[i].src_rank;
    return src >= 0 && src != rank;
  }
};

unsigned grid_for(int64_t n, int threads) { return static_cast<unsigned>(std::max<int64_t>(ceil_div(n, threads), 1)); }

}  // namespace

ScheduleBuffers::ScheduleBuffers(const LayerShape& shape, const Config& config)
    : header(1),
      expert_offset(shape.local_experts() + 1),
      expert_rows(shape.local_experts()),
      segment_begin(shape.local_experts()),
      rows(config.buffer_rows_per_rank(shape)),
      dest_row(static_cast<size_t>(shape.ep) * shape.tokens * shape.topk),
      minibatch_ranges(3 * ceil_div(config.buffer_rows_per_rank(shape), config.effective_minibatch(shape))),
      remote_rows(config.buffer_rows_per_rank(shape)),
      remote_count(1),
      token_key(shape.tokens),
      token_ids(shape.tokens),
      token_order(shape.tokens),
      keys_in(dest_row.size()),
      keys_out(dest_row.size()),
      vals_in(dest_row.size()),
      vals_out(dest_row.size()),
      owner_rows(shape.ep) {
  buffer_rows = config.buffer_rows_per_rank(shape);
  call_tokens = shape.tokens;
  minibatch = config.effective_minibatch(shape);
  max_minibatches = ceil_div(buffer_rows, minibatch);
  entries = static_cast<int64_t>(dest_row.size());
  key_bits = std::max(1, static_cast<int>(std::bit_width(static_cast<uint64_t>(shape.local_experts()))));
  // keys 0..E_local (E_local: an absent token of a shorter call)
  token_key_bits = std::max(1, static_cast<int>(std::bit_width(static_cast<uint64_t>(shape.local_experts()))));
  size_t temp_bytes = 0;
  MOK_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in.get(), keys_out.get(), vals_in.get(),
                                                 vals_out.get(), entries, 0, key_bits));
  size_t order_bytes = 0;
  MOK_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, order_bytes, reinterpret_cast<const uint32_t*>(token_key.get()),
                                                 keys_in.get(), token_ids.get(), token_order.get(), shape.tokens, 0,
                                                 token_key_bits));
  temp_bytes = std::max(temp_bytes, order_bytes);
  size_t select_bytes = 0;
  MOK_CUDA_CHECK(cub::DeviceSelect::If(nullptr, select_bytes, thrust::counting_iterator<int32_t>(0), remote_rows.get(),
                                       remote_count.get(), buffer_rows, IsRemoteRow{rows.get(), 0}));
  sort_temp = DeviceBuffer<unsigned char>(std::max(temp_bytes, select_bytes));
  // The token-order sort's values never change (0..T-1): written once here, not per schedule.
  std::vector<int32_t> ids(static_cast<size_t>(shape.tokens));
  std::iota(ids.begin(), ids.end(), 0);
  MOK_CUDA_CHECK(cudaMemcpy(token_ids.get(), ids.data(), token_ids.bytes(), cudaMemcpyHostToDevice));
}

size_t ScheduleBuffers::bytes() const {
  return header.bytes() + expert_offset.bytes() + expert_rows.bytes() + segment_begin.bytes() + rows.bytes() +
         dest_row.bytes() + minibatch_ranges.bytes() + remote_rows.bytes() + remote_count.bytes() + token_key.bytes() +
         token_ids.bytes() + token_order.bytes() + keys_in.bytes() + keys_out.bytes() + vals_in.bytes() +
         vals_out.bytes() + owner_rows.bytes() + sort_temp.bytes();
}

ScheduleView ScheduleBuffers::view() const {
  ScheduleView v;
  v.header = header.get();
  v.expert_offset = expert_offset.get();
  v.expert_rows = expert_rows.get();
  v.rows = rows.get();
  v.dest_row = dest_row.get();
  v.mb_begin = minibatch_ranges.get();
  v.mb_end = minibatch_ranges.get() + max_minibatches;
  v.mb_real_rows = minibatch_ranges.get() + 2 * max_minibatches;
  v.remote_rows = remote_rows.get();
  v.remote_count = remote_count.get();
  v.token_key = token_key.get();
  v.token_order = token_order.get();
  v.buffer_rows = buffer_rows;
  v.minibatch = minibatch;
  v.max_minibatches = max_minibatches;
  v.tokens = call_tokens;
  return v;
}

void check_schedule_tokens(const LayerShape& s, int64_t tokens) {
  if (tokens < 1 || tokens > s.tokens) {
    throw_invalid("tokens", "1 <= tokens <= LayerShape.tokens (" + std::to_string(s.tokens) + ")", std::to_string(tokens));
  }
}

void launch_schedule(const ScheduleLaunch& l, ScheduleBuffers& b, cudaStream_t stream) {
  const LayerShape& s = l.shape;
  check_schedule_tokens(s, l.tokens);
  const int64_t per_rank = l.tokens * s.topk;
  const int rank = l.peers.rank;
  b.call_tokens = l.tokens;

  ExchangeParams ex{l.peers, {l.layout.topk[0], l.layout.topk[1]}, l.topk_idx, per_rank, s.tokens * s.topk,
                    l.barrier, l.wait};
  const unsigned ex_ctas = static_cast<unsigned>(std::min<int64_t>(ceil_div(per_rank, kThreads * 4), kMaxExchangeCtas));
  exchange_kernel<<<std::max(ex_ctas, 1u), kThreads, 0, stream>>>(ex);
  MOK_CUDA_CHECK(cudaGetLastError());

  auto table = [&](int parity) { return reinterpret_cast<const int32_t*>(l.peers.base[rank] + l.layout.topk[parity]); };
  MOK_CUDA_CHECK(cudaMemsetAsync(b.owner_rows.get(), 0, b.owner_rows.bytes(), stream));
  KeyParams kp{{table(0), table(1)}, l.barrier.sync, b.entries, s.topk, s.experts, s.local_experts(), rank,
               b.keys_in.get(), b.vals_in.get(), b.owner_rows.get(), s.ep, l.wait.error,
               s.tokens, l.tokens, b.token_key.get()};
  key_kernel<<<grid_for(b.entries, kThreads), kThreads, 0, stream>>>(kp);
  MOK_CUDA_CHECK(cudaGetLastError());

  size_t temp_bytes = b.sort_temp.size();
  MOK_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(b.sort_temp.get(), temp_bytes, b.keys_in.get(), b.keys_out.get(),
                                                 b.vals_in.get(), b.vals_out.get(), b.entries, 0, b.key_bits,
                                                 stream));

  SegmentParams sp{b.keys_out.get(), b.entries, s.local_experts(), l.max_rows, b.buffer_rows, b.minibatch,
                   b.max_minibatches, rank, b.header.get(), b.expert_offset.get(), b.expert_rows.get(),
                   b.segment_begin.get(), b.minibatch_ranges.get(), b.owner_rows.get(), s.ep, l.wait.error};
  segment_kernel<<<1, kSegmentThreads, 0, stream>>>(sp);
  MOK_CUDA_CHECK(cudaGetLastError());

  MOK_CUDA_CHECK(cudaMemsetAsync(b.dest_row.get(), 0xFF, b.dest_row.bytes(), stream));  // -1: not ours
  RowParams rp{b.header.get(), b.expert_offset.get(), b.expert_rows.get(), b.segment_begin.get(),
               b.vals_out.get(), s.local_experts(), b.buffer_rows, s.tokens, s.topk, b.rows.get(), b.dest_row.get()};
  row_kernel<<<grid_for(b.buffer_rows, kThreads), kThreads, 0, stream>>>(rp);
  MOK_CUDA_CHECK(cudaGetLastError());

  LinkParams lp{b.header.get(), b.dest_row.get(), b.buffer_rows, s.tokens, s.topk, b.rows.get()};
  link_kernel<<<grid_for(b.buffer_rows, kThreads), kThreads, 0, stream>>>(lp);
  MOK_CUDA_CHECK(cudaGetLastError());

  size_t select_bytes = b.sort_temp.size();
  MOK_CUDA_CHECK(cub::DeviceSelect::If(b.sort_temp.get(), select_bytes, thrust::counting_iterator<int32_t>(0),
                                       b.remote_rows.get(), b.remote_count.get(), b.buffer_rows,
                                       IsRemoteRow{b.rows.get(), rank}, stream));

  // 8. token order (keys_in is free once step 3 sorted it): stable, so ties keep token order.
  size_t order_bytes = b.sort_temp.size();
  MOK_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(b.sort_temp.get(), order_bytes,
                                                 reinterpret_cast<const uint32_t*>(b.token_key.get()), b.keys_in.get(),
                                                 b.token_ids.get(), b.token_order.get(), s.tokens, 0, b.token_key_bits,
                                                 stream));
}

}  // namespace mok::comm
