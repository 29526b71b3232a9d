#include "megakernel/persistent_grid.hpp"

#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "comm/cuda_check.hpp"
#include "mok/error.hpp"

namespace mok::megakernel {

int persistent_kernel_sms(const PersistentKernel& k) {
  struct Checked {
    const void* fn;
    int device, sms;
  };
  thread_local std::vector<Checked> checked;  // one entry per (kernel, device) used on this thread
  int device = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&device));
  for (const Checked& c : checked) {
    if (c.fn == k.fn && c.device == device) return c.sms;
  }
  int sms = 0, blocks = 0;
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  MOK_CUDA_CHECK(cudaFuncSetAttribute(k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem_bytes));
  MOK_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, k.fn, k.threads, k.smem_bytes));
  if (blocks < 1) {
    throw Error(Status::kCudaError, std::string("mok ") + k.name + ": the kernel does not fit on an SM (occupancy 0)");
  }
  checked.push_back({k.fn, device, sms});
  return sms;
}

int resolve_persistent_grid(const PersistentKernel& k, int grid_option, int comm_ctas, const char* comm_option) {
  const int sms = persistent_kernel_sms(k);
  const int grid = grid_option > 0 ? grid_option : sms;
  if (grid > sms) {
    throw_invalid("Config.grid_sms", "at most the SMs of the device (" + std::to_string(sms) + "): the " + k.name +
                                         "'s CTAs wait on each other and must all be resident",
                  std::to_string(grid));
  }
  if (comm_ctas < 1 || comm_ctas >= grid) {
    throw_invalid(comm_option,
                  "in [1, " + std::to_string(grid - 1) + "] (the " + k.name + "'s grid of " + std::to_string(grid) +
                      " CTAs must keep at least one GEMM CTA)",
                  std::to_string(comm_ctas));
  }
  return grid;
}

}  // namespace mok::megakernel
