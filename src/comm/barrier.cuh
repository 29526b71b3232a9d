// Phase barriers of the communication layer.
//
// phase_barrier: one thread of every rank; rank r writes `epoch` into slot r of every peer's
//   flag array of the site (system-scope release) and waits until every slot of its own array
//   holds >= epoch (system-scope acquire). A site's epochs are its rounds 1, 2, 3, ... and every
//   rank issues the same sequence of barriers, so one slot per peer suffices: a peer that already
//   moved on to the next round still satisfies ">= epoch".
// group_barrier: the CTAs of one kernel (the communication CTAs, co-resident) first meet on a
//   local arrival counter; the last one runs the phase barrier for the rank and opens a local
//   flag that the others wait on.
//
// Rounds live on the device: each participant reads the site's last round (GroupSync::opened)
// before it arrives, and only the last arrival moves it, so all read the same value. Nothing of
// a barrier is fixed at launch, and a kernel captured in a CUDA graph waits anew on every replay
// (an epoch handed out by the host would be baked into the graph and be passed at once from the
// second replay on). Every launch of a site runs after the previous one on the stream.
//
// Why our own and not ncclLsaBarrierSession: its wait spins without a timeout, and every wait
// in mok must turn into an error instead of a hang (docs/megakernel.md).
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

// The round a barrier of this site opens in the current launch. Call before arriving.
__device__ __forceinline__ uint64_t barrier_round(const GroupSync* sync) {
  return load_acquire<Scope::kGpu>(&sync->opened) + 1;
}

// One thread per CTA, after its CTA's writes were ordered before it (bar.sync). Arrives at the
// site; the last of the `nctas` arrivals runs the phase barrier and opens the round (and
// gb.open_flag), the others wait for it. Returns false on timeout (recorded).
__device__ inline bool group_arrive_and_wait(const GroupBarrier& gb, uint32_t nctas, const PeerMap& peers,
                                             const WaitContext& ctx) {
  const uint64_t round = barrier_round(gb.sync);  // NOTE: before the arrival below (acq_rel orders it)
  __threadfence_system();  // NOTE: this CTA's writes (ordered by the caller's bar.sync) before arrival
  const uint32_t before = fetch_add_acq_rel<Scope::kGpu>(&gb.sync->arrived, 1u);
  if (before == nctas - 1) {
    gb.sync->arrived = 0;  // nobody touches the counter again before `opened` moves
    if (!phase_barrier(peers, gb.flags_offset, round, ctx)) return false;
    store_release<Scope::kGpu>(&gb.sync->opened, round);
    if (gb.open_flag != nullptr) store_release<Scope::kGpu>(gb.open_flag, 1u);
    return true;
  }
  return wait_geq<Scope::kGpu>(&gb.sync->opened, round, WaitSite::kGroupArrive, ctx);
}

// Every thread of every one of the `nctas` CTAs calls it. Returns false on timeout.
__device__ inline bool group_barrier(const GroupBarrier& gb, uint32_t nctas, const PeerMap& peers,
                                     const WaitContext& ctx) {
  __shared__ int passed;
  __syncthreads();
  if (threadIdx.x == 0) passed = group_arrive_and_wait(gb, nctas, peers, ctx) ? 1 : 0;
  __syncthreads();
  return passed != 0;
}

}  // namespace mok::comm
