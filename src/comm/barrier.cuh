// Phase barriers of the communication layer.
//
// phase_barrier: one thread of every rank; rank r writes `epoch` into slot r of every peer's
//   flag array (system-scope release) and waits until every slot of its own array holds
//   >= epoch (system-scope acquire). Epochs only grow (the host hands out one per barrier and
//   every rank issues the same sequence), so one slot per peer suffices: a peer that already
//   moved on to epoch+1 still satisfies ">= epoch".
// group_barrier: the CTAs of one kernel (the communication CTAs, co-resident) first meet on a
//   local arrival counter; the last one runs the phase barrier for the rank and opens a local
//   flag that the others wait on.
//
// Why our own and not ncclLsaBarrierSession: its wait spins without a timeout, and every wait
// in mok must turn into an error instead of a hang (DESIGN §6).
#pragma once

#include <cstdint>

#include "comm/peer_map.hpp"
#include "comm/sync_types.hpp"
#include "comm/wait.cuh"

namespace mok::comm {

__device__ __forceinline__ uint64_t* flag_slot(char* window_base, size_t flags_offset, int slot) {
  return reinterpret_cast<uint64_t*>(window_base + flags_offset) + slot;
}

// One thread per rank. Returns false when a wait timed out (already recorded).
__device__ inline bool phase_barrier(const PeerMap& peers, size_t flags_offset, uint64_t epoch,
                                     const WaitContext& ctx) {
  // NOTE: the caller ordered this rank's data writes before this thread (bar.sync / arrival
  // counter); the system fence makes them visible to the peers before they see the epoch.
  __threadfence_system();
  for (int p = 0; p < peers.ep; ++p) {
    store_release<Scope::kSystem>(flag_slot(peers.base[p], flags_offset, peers.rank), epoch);
  }
  for (int p = 0; p < peers.ep; ++p) {
    const uint64_t* mine = flag_slot(peers.base[peers.rank], flags_offset, p);
    if (!wait_geq<Scope::kSystem>(mine, epoch, WaitSite::kPhaseBarrier, ctx)) return false;
  }
  return true;
}

// Every thread of every one of the `nctas` CTAs calls it. Returns false on timeout.
__device__ inline bool group_barrier(const GroupBarrier& gb, uint32_t nctas, const PeerMap& peers,
                                     const WaitContext& ctx) {
  __shared__ int passed;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();  // NOTE: this CTA's writes (ordered by the bar.sync above) before arrival
    const uint32_t before = fetch_add_acq_rel<Scope::kGpu>(&gb.sync->arrived, 1u);
    bool ok = true;
    if (before == nctas - 1) {
      gb.sync->arrived = 0;  // nobody touches the counter again before `opened` moves
      ok = phase_barrier(peers, gb.flags_offset, gb.epoch, ctx);
      if (ok) store_release<Scope::kGpu>(&gb.sync->opened, gb.epoch);
    } else {
      ok = wait_geq<Scope::kGpu>(&gb.sync->opened, gb.epoch, WaitSite::kGroupArrive, ctx);
    }
    passed = ok ? 1 : 0;
  }
  __syncthreads();
  return passed != 0;
}

}  // namespace mok::comm
