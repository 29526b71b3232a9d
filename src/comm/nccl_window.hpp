// The symmetric window of one rank on the NCCL (>= 2.28) device API (docs/comm.md):
// ncclMemAlloc + ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC) + ncclDevCommCreate (checked:
// it fails when the window is not symmetric), peer addresses resolved once on the device with
// ncclGetPeerPointer into a plain PeerMap. No NVLink multicast is requested, ever.
#pragma once

#include <nccl.h>

#include <cstddef>
#include <memory>
#include <string>

#include "comm/peer_map.hpp"

namespace mok::comm {

class SimulatedGroup;

// Throws Error(kNcclError) unless the loaded libnccl is exactly the version of the headers
// mok was compiled with (ncclDevComm and window layouts come from those headers), and is
// at least 2.28 (the device API).
void check_nccl_version();
// "2.28.9" from an NCCL_VERSION_CODE-style integer.
std::string nccl_version_string(int code);

class SymmetricWindow {
 public:
  // Collective over `comm`: every rank passes the same `bytes`. The current CUDA device must
  // be the communicator's device.
  SymmetricWindow(ncclComm_t comm, size_t bytes);
  // Simulated ranks (comm/simulated_group.hpp): a plain cudaMalloc buffer on the group's device,
  // peer bases exchanged through the group. Collective over the group.
  SymmetricWindow(SimulatedGroup& group, int rank, size_t bytes);
  ~SymmetricWindow();  // collective teardown in reverse order (simulated: the caller's group barrier came first)
  SymmetricWindow(const SymmetricWindow&) = delete;
  SymmetricWindow& operator=(const SymmetricWindow&) = delete;

  char* local() const { return local_; }      // this rank's buffer (host-side APIs: memset, memcpy)
  size_t bytes() const { return bytes_; }
  const PeerMap& peers() const { return peers_; }

 private:
  struct DevComm;
  ncclComm_t comm_ = nullptr;
  bool simulated_ = false;
  char* local_ = nullptr;
  size_t bytes_ = 0;
  ncclWindow_t window_ = nullptr;
  std::unique_ptr<DevComm> dev_comm_;
  PeerMap peers_;
};

}  // namespace mok::comm
