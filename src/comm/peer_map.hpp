// Plain descriptions of the symmetric workspace that kernels receive by value (docs/comm.md):
// peer base addresses resolved once from the NCCL window, and the byte layout of the window.
// Nothing here depends on NCCL types, so a GIN (network) path can later fill the same struct.
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm/sync_types.hpp"
#include "mok/shape.hpp"

#if defined(__CUDACC__)
#define MOK_HD __host__ __device__
#else
#define MOK_HD
#endif

namespace mok::comm {

inline constexpr size_t kWindowAlign = 4096;  // NCCL_WIN_REQUIRED_ALIGNMENT; every region starts aligned

MOK_HD constexpr size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// Base address of every rank's symmetric window as seen from this rank (NVLink load/store).
// base[rank] is this rank's own window through the same flat mapping the peers use.
struct PeerMap {
  int rank = 0;
  int ep = 1;
  char* base[kMaxEp] = {};
};

// Byte offsets of the regions inside the symmetric window (identical on every rank).
//   flags        uint64 [sites][kMaxEp] phase-barrier rounds per barrier site, slot s written by rank s
//   topk[2]      int32  [ep][T*K]       exchanged routing tables, double-buffered by exchange round parity
//   x            bf16   [T, H]          staged (or zero-copy) tokens that peers pull in dispatch
//   slots        bf16   [T, K, H]       combine slots (token, k), pushed by the expert owners
//   arrivals     uint32 [T]             rows pushed into token t's slots this pass (the fused
//                                       forward's top-k sum waits on them; zeroed before each pass)
//   dy           bf16   [T, H]          the backward's staged output gradient (pulled like x)
//   topk_w       fp32   [T, K]          the backward's staged router weights (read per pulled row)
//   dtopk        fp32   [T, K]          d topk_w of each (t, k), written by the row's holder
struct SymmetricLayout {
  size_t flags = 0;
  size_t topk[2] = {0, 0};
  size_t x = 0;
  size_t slots = 0;
  size_t arrivals = 0;
  // The backward's: dy [T, H] bf16 staged for the pulls, topk_w [T, K] fp32 (the pulling rank
  // reads each row's router weight), dtopk [T, K] fp32 (each row's d topk_w lands here).
  size_t dy = 0;
  size_t topk_w = 0;
  size_t dtopk = 0;
  size_t total = 0;

  // The flag array of barrier site `site` (kBarrierSites of them, kMaxEp slots each).
  MOK_HD size_t site_flags(int site) const { return flags + static_cast<size_t>(site) * kMaxEp * sizeof(uint64_t); }

  static SymmetricLayout make(const LayerShape& s) {
    SymmetricLayout l;
    size_t at = 0;
    auto take = [&at](size_t bytes) {
      const size_t off = at;
      at = align_up(at + bytes, kWindowAlign);
      return off;
    };
    const size_t table = static_cast<size_t>(s.ep) * s.tokens * s.topk * sizeof(int32_t);
    const size_t row = static_cast<size_t>(s.hidden) * 2;
    l.flags = take(static_cast<size_t>(kBarrierSites) * kMaxEp * sizeof(uint64_t));
    l.topk[0] = take(table);
    l.topk[1] = take(table);
    l.x = take(static_cast<size_t>(s.tokens) * row);
    l.slots = take(static_cast<size_t>(s.tokens) * s.topk * row);
    l.arrivals = take(static_cast<size_t>(s.tokens) * sizeof(uint32_t));
    l.dy = take(static_cast<size_t>(s.tokens) * row);
    l.topk_w = take(static_cast<size_t>(s.tokens) * s.topk * sizeof(float));
    l.dtopk = take(static_cast<size_t>(s.tokens) * s.topk * sizeof(float));
    l.total = at;
    return l;
  }
};

}  // namespace mok::comm
