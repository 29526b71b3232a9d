// Standalone launches of the communication roles (tests, benchmarks, and the unfused path).
// The fused megakernel calls the same __device__ roles from roles.cuh instead.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "comm/role_types.hpp"

namespace mok::comm {

// group barrier (x staged on every rank) then dispatch_pull, on `ctas` CTAs.
// `counters` ([counter_words] = ready counters then tile flags) are zeroed first.
struct DispatchLaunch {
  DispatchRole role;
  GroupBarrier start;
  int ctas = 16;
  uint32_t* counters = nullptr;
  size_t counter_words = 0;
};
void launch_dispatch(const DispatchLaunch& launch, cudaStream_t stream);

// combine_push then the group barrier after which every rank may read its slots.
struct CombineLaunch {
  CombineRole role;
  GroupBarrier done;
  int ctas = 16;
};
void launch_combine(const CombineLaunch& launch, cudaStream_t stream);

// topk_sum_epilogue over the whole grid.
void launch_epilogue(const EpilogueRole& role, cudaStream_t stream);

// One thread waits for *flag >= expected through wait_geq (system scope); tests use it to
// prove that a wait nobody satisfies turns into a kTimeout error instead of a hang.
// SMs of the current device, cached per thread (launches and per-call options stay cheap).
int device_sms();

void launch_test_wait(const uint64_t* flag, uint64_t expected, const WaitContext& ctx, cudaStream_t stream);

}  // namespace mok::comm
