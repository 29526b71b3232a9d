// The unfused baselines' pieces (bench_forward, bench_backward): what a careful user builds
// without fusion around mok's grouped GEMMs: permute kernels and NCCL all-to-all (grouped
// ncclSend/ncclRecv) of token rows. The index maps come from mok's schedule rows, computed once on
// the host (a real step would need the counts on the host: a device->host sync the baseline is
// spared).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <vector>

#include "comm/cuda_check.hpp"
#include "comm/device_buffer.hpp"
#include "comm/schedule.hpp"
#include "mok/api.hpp"

namespace mok::bench {

// dst[i] = src[map[i]] (rows of `vecs` 16-byte vectors), map[i] < 0: a zero row. One warp a row.
__global__ void gather_rows_kernel(int4* dst, const int4* src, const int32_t* map, int64_t rows, int64_t vecs) {
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / 32;
  for (int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; r < rows; r += warps) {
    const int32_t from = map[r];
    int4* d = dst + r * vecs;
    for (int64_t v = threadIdx.x % 32; v < vecs; v += 32) d[v] = from >= 0 ? src[from * vecs + v] : make_int4(0, 0, 0, 0);
  }
}

inline void gather_rows(void* dst, const void* src, const int32_t* map, int64_t rows, int64_t row_bytes, cudaStream_t s) {
  if (rows == 0) return;
  gather_rows_kernel<<<1056, 256, 0, s>>>(static_cast<int4*>(dst), static_cast<const int4*>(src), map, rows,
                                          row_bytes / 16);
  MOK_CUDA_CHECK(cudaGetLastError());
}

template <class T>
comm::DeviceBuffer<T> upload(const std::vector<T>& v) {
  comm::DeviceBuffer<T> d(v.size());
  if (!v.empty()) MOK_CUDA_CHECK(cudaMemcpy(d.get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

struct UnfusedMaps {
  int64_t padded_rows = 0, total_send = 0, total_recv = 0;
  std::vector<int64_t> send_rows, recv_rows;  // per peer
  comm::DeviceBuffer<int32_t> send_map, unpack_map, back_map, slot_map;
  comm::DeviceBuffer<bf16> send, recv, back, recv_back;

  // Index maps from the global routing and this rank's schedule rows (downloaded once).
  UnfusedMaps(const LayerShape& s, int rank, const std::vector<std::vector<int32_t>>& routing,
           const std::vector<comm::RowEntry>& rows)
      : padded_rows(static_cast<int64_t>(rows.size())), send_rows(s.ep, 0), recv_rows(s.ep, 0) {
    const int64_t TK = s.tokens * s.topk;
    std::vector<int32_t> send_map_h, slot_map_h(TK, -1);
    for (int p = 0; p < s.ep; ++p) {  // send buffer: blocks per destination, (t, k) order inside
      for (int64_t e = 0; e < TK; ++e) {
        if (s.owner_rank(routing[rank][e]) != p) continue;
        slot_map_h[e] = static_cast<int32_t>(send_map_h.size());  // the reply comes back in this order
        send_map_h.push_back(static_cast<int32_t>(e / s.topk));
        ++send_rows[p];
      }
    }
    std::vector<std::vector<int32_t>> pos(s.ep, std::vector<int32_t>(TK, -1));  // (src, entry) -> recv row
    for (int src = 0; src < s.ep; ++src) {
      for (int64_t e = 0; e < TK; ++e) {
        if (s.owner_rank(routing[src][e]) != rank) continue;
        pos[src][e] = static_cast<int32_t>(total_recv++);
        ++recv_rows[src];
      }
    }
    std::vector<int32_t> unpack_h(padded_rows, -1), back_h(total_recv, -1);
    for (int64_t i = 0; i < padded_rows; ++i) {
      const comm::RowEntry& r = rows[i];
      if (r.src_rank < 0) continue;
      const int32_t j = pos[r.src_rank][int64_t(r.token) * s.topk + r.k];
      unpack_h[i] = j;
      back_h[j] = static_cast<int32_t>(i);
    }
    total_send = static_cast<int64_t>(send_map_h.size());
    send_map = upload(send_map_h);
    slot_map = upload(slot_map_h);
    unpack_map = upload(unpack_h);
    back_map = upload(back_h);
    send = comm::DeviceBuffer<bf16>(total_send * s.hidden);
    recv_back = comm::DeviceBuffer<bf16>(total_send * s.hidden);
    recv = comm::DeviceBuffer<bf16>(total_recv * s.hidden);
    back = comm::DeviceBuffer<bf16>(total_recv * s.hidden);
  }

  // Grouped ncclSend/ncclRecv: `out_rows[p]` rows to p from `sendbuf`, `in_rows[p]` from p into `recvbuf`.
  static void all_to_all(const bf16* sendbuf, const std::vector<int64_t>& out_rows, bf16* recvbuf,
                         const std::vector<int64_t>& in_rows, int64_t row_bytes, ncclComm_t comm, cudaStream_t st) {
    MOK_NCCL_CHECK(ncclGroupStart());
    int64_t so = 0, ro = 0;
    for (size_t p = 0; p < out_rows.size(); ++p) {
      MOK_NCCL_CHECK(ncclSend(reinterpret_cast<const char*>(sendbuf) + so * row_bytes, out_rows[p] * row_bytes,
                              ncclChar, static_cast<int>(p), comm, st));
      MOK_NCCL_CHECK(ncclRecv(reinterpret_cast<char*>(recvbuf) + ro * row_bytes, in_rows[p] * row_bytes, ncclChar,
                              static_cast<int>(p), comm, st));
      so += out_rows[p];
      ro += in_rows[p];
    }
    MOK_NCCL_CHECK(ncclGroupEnd());
  }
};

}  // namespace mok::bench
