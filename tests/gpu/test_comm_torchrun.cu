// Launch mode (b): one process per GPU started by torchrun, e.g.
//   torchrun --nproc_per_node=2 --no-python .devbin/test_comm_torchrun
// (`scripts/gpu.sh torchrun` runs it). Every process builds the same routing for all ranks from a
// fixed seed, runs its own rank of the pipeline and checks it bitwise against the reference.
// Skips when WORLD_SIZE is not set (not started by a launcher).
#include "test_comm_harness.cuh"

namespace mok::test {
namespace {

// Every rank's stream idle, then an NCCL all-reduce of one int as the host barrier.
void nccl_barrier(ncclComm_t comm) {
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
  comm::DeviceBuffer<int> one(1);
  MOK_CUDA_CHECK(cudaMemset(one.get(), 0, sizeof(int)));
  MOK_NCCL_CHECK(ncclAllReduce(one.get(), one.get(), 1, ncclInt, ncclSum, comm, nullptr));
  MOK_CUDA_CHECK(cudaDeviceSynchronize());
}

TEST(CommTorchrun, PipelineMatchesReferenceOnEveryRank) {
  const auto env = bootstrap::dist_env();
  if (!env) GTEST_SKIP() << "WORLD_SIZE is not set: start this binary with torchrun --no-python (launch mode b)";
  if (gpu_count() <= env->local_rank) {
    GTEST_SKIP() << "LOCAL_RANK " << env->local_rank << " has no GPU (" << gpu_count() << " visible)";
  }
  auto dist = bootstrap::init_from_env();
  const int ep = env->world_size, rank = env->rank;
  std::printf("rank %d of %d on device %d (%s:%d)\n", rank, ep, dist->device, env->master_addr.c_str(),
              env->master_port);
  for (Pattern p : {Pattern::kUniform, Pattern::kOneRank}) {
    CommCase c;
    c.name = p == Pattern::kUniform ? "torchrun_uniform" : "torchrun_one_rank";
    c.shape = LayerShape{300, 256, 128, 0, 8L * ep, 4, ep};
    c.config.capacity = ep;
    c.pattern = p;
    c.seed = 77;
    const auto routing = make_routing(c.shape, c.pattern, c.seed);
    const ref::Schedule ref = ref::make_schedule(c.shape, c.config, routing);
    std::vector<RankInputs> in(ep);
    for (int r = 0; r < ep; ++r) in[r] = make_inputs(c, routing, r);
    bootstrap::LocalRank lr;
    lr.rank = rank;
    lr.world_size = ep;
    lr.device = dist->device;
    lr.comm = dist->comm;
    const RankOutputs out = run_rank(c, in[rank], lr, [&] { nccl_barrier(dist->comm); });
    expect_schedule(c, ref, routing, rank, out);
    expect_data(c, ref, in, rank, out);
  }
}

}  // namespace
}  // namespace mok::test
