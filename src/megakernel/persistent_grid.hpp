// The grid of a fused persistent kernel (fused_forward.cu, fused_backward.cu). Its CTAs wait on
// each other (task inputs, comm barriers), so every one must be resident at once: one CTA per
// SM, at most the SMs of the device, and at least one GEMM CTA beside the communication CTAs.
#pragma once

namespace mok::megakernel {

struct PersistentKernel {
  const void* fn;      // the __global__ function
  int threads;         // per CTA
  int smem_bytes;      // dynamic shared memory per CTA
  const char* name;    // "fused forward", "fused backward": named in the errors
};

// The SMs of the current device, after checking (once per thread, device and kernel) that one
// CTA of `k` fits on an SM with its dynamic shared memory (the attribute is set then). Throws
// Error(kCudaError) when it does not.
int persistent_kernel_sms(const PersistentKernel& k);

// grid (0: every SM) checked against the SMs and comm_ctas against the grid; returns the grid.
// Throws kInvalidArgument naming Config.grid_sms or `comm_option`.
int resolve_persistent_grid(const PersistentKernel& k, int grid, int comm_ctas, const char* comm_option);

}  // namespace mok::megakernel
