#include "comm/nccl_window.hpp"

#include <nccl_device.h>

#include <string>

#include "comm/cuda_check.hpp"
#include "comm/device_buffer.hpp"
#include "comm/simulated_group.hpp"

namespace mok::comm {
namespace {

// Each peer's window base as this rank sees it (LSA flat mapping; self included).
__global__ void resolve_peers_kernel(ncclWindow_t window, int ep, char** out) {
  const int p = threadIdx.x;
  if (p < ep) out[p] = static_cast<char*>(ncclGetPeerPointer(window, 0, p));
}

}  // namespace

struct SymmetricWindow::DevComm {
  ncclDevComm comm;
};

std::string nccl_version_string(int code) {
  // NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z for 2.9 and later.
  return std::to_string(code / 10000) + "." + std::to_string(code / 100 % 100) + "." + std::to_string(code % 100);
}

void check_nccl_version() {
  int loaded = 0;
  MOK_NCCL_CHECK(ncclGetVersion(&loaded));
  if (loaded != NCCL_VERSION_CODE) {
    throw Error(Status::kNcclError,
                "NCCL version mismatch: the loaded libnccl is " + nccl_version_string(loaded) +
                    " but mok was compiled against the " + nccl_version_string(NCCL_VERSION_CODE) +
                    " headers; the NCCL device API (window and device-communicator layouts) needs the "
                    "same version. Point LD_LIBRARY_PATH at the matching libnccl.so.2 (e.g. PyTorch's "
                    "nvidia/nccl/lib) or rebuild mok against the loaded NCCL's headers.");
  }
  if (NCCL_VERSION_CODE < NCCL_VERSION(2, 28, 0)) {
    throw Error(Status::kNcclError, "NCCL " + nccl_version_string(loaded) + " has no device API; mok needs >= 2.28");
  }
}

SymmetricWindow::SymmetricWindow(ncclComm_t comm, size_t bytes) : comm_(comm), bytes_(bytes) {
  check_nccl_version();
  int ep = 0, rank = 0;
  MOK_NCCL_CHECK(ncclCommCount(comm, &ep));
  MOK_NCCL_CHECK(ncclCommUserRank(comm, &rank));
  if (ep > kMaxEp) throw_invalid("NCCL communicator size", "at most " + std::to_string(kMaxEp), std::to_string(ep));
  const ncclTeam_t lsa = ncclTeamLsa(comm);
  if (lsa.nRanks != ep) {
    throw Error(Status::kNotImplemented,
                "the NCCL communicator spans " + std::to_string(ep) + " ranks but only " +
                    std::to_string(lsa.nRanks) +
                    " are load/store accessible (NVLink) from rank " + std::to_string(rank) +
                    "; multi-host expert parallelism (NCCL GIN) is not implemented yet");
  }
  void* p = nullptr;
  MOK_NCCL_CHECK(ncclMemAlloc(&p, bytes));
  local_ = static_cast<char*>(p);
  try {
    // Zero (flags start at epoch 0) before the collective registration: no peer can write into
    // this window before every rank has registered it, hence after this memset.
    MOK_CUDA_CHECK(cudaMemset(local_, 0, bytes));
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
    MOK_NCCL_CHECK(ncclCommWindowRegister(comm, local_, bytes, &window_, NCCL_WIN_COLL_SYMMETRIC));
    dev_comm_ = std::make_unique<DevComm>();
    ncclDevCommRequirements reqs{};  // 2.28.9 has no NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER; no multimem
    const ncclResult_t r = ncclDevCommCreate(comm, &reqs, &dev_comm_->comm);
    if (r != ncclSuccess) {
      dev_comm_.reset();
      throw Error(Status::kNcclError,
                  std::string("ncclDevCommCreate failed (") + ncclGetErrorString(r) +
                      "): this communicator does not support symmetric memory (needs CUDA VMM / "
                      "NCCL_CUMEM_ENABLE and peer access between all ranks)");
    }
    peers_.rank = rank;
    peers_.ep = ep;
    DeviceBuffer<char*> resolved(ep);
    resolve_peers_kernel<<<1, kMaxEp>>>(window_, ep, resolved.get());
    MOK_CUDA_CHECK(cudaGetLastError());
    MOK_CUDA_CHECK(cudaMemcpy(peers_.base, resolved.get(), ep * sizeof(char*), cudaMemcpyDeviceToHost));
    for (int i = 0; i < ep; ++i) {
      if (peers_.base[i] == nullptr) {
        throw Error(Status::kNcclError, "ncclGetPeerPointer returned null for peer " + std::to_string(i));
      }
    }
  } catch (...) {
    if (dev_comm_) ncclDevCommDestroy(comm_, &dev_comm_->comm);
    if (window_ != nullptr) ncclCommWindowDeregister(comm_, window_);
    ncclMemFree(local_);
    throw;
  }
}

SymmetricWindow::SymmetricWindow(SimulatedGroup& group, int rank, size_t bytes) : simulated_(true), bytes_(bytes) {
  int device = -1;
  MOK_CUDA_CHECK(cudaGetDevice(&device));
  if (device != group.device()) {
    throw_invalid("current CUDA device", "the simulated group's device " + std::to_string(group.device()),
                  std::to_string(device));
  }
  MOK_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&local_), bytes));
  try {
    MOK_CUDA_CHECK(cudaMemset(local_, 0, bytes));  // flags start at epoch 0, as with NCCL
    MOK_CUDA_CHECK(cudaDeviceSynchronize());
  } catch (...) {
    cudaFree(local_);
    throw;
  }
  // A rank that fails above never arrives here; its peers time out in the exchange with a clear
  // error instead of reading a missing base.
  peers_ = group.exchange(rank, local_);
}

SymmetricWindow::~SymmetricWindow() {
  // Errors cannot be thrown from here; the communicator's owner sees NCCL's async error.
  cudaDeviceSynchronize();
  if (simulated_) {
    cudaFree(local_);
    return;
  }
  if (dev_comm_) ncclDevCommDestroy(comm_, &dev_comm_->comm);
  if (window_ != nullptr) ncclCommWindowDeregister(comm_, window_);
  if (local_ != nullptr) ncclMemFree(local_);
}

}  // namespace mok::comm
