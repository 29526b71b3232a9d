// Communication layer, whole path on 1 and 2 GPUs (launch mode (a): one thread per GPU):
// GPU schedule bitwise equal to mok::ref::make_schedule, dispatch / combine / epilogue bitwise
// equal to the bytes the reference schedule predicts, for every comm-CTA count and dispatch
// mode (knob invariance), repeated runs identical. EP=2 cases skip with fewer than 2 GPUs.
#include "test_comm_harness.cuh"

namespace mok::test {
namespace {

CommCase make_case(std::string name, int ep, int64_t tokens, int64_t hidden, int64_t local_experts, int topk,
                   Pattern pattern, uint64_t seed) {
  CommCase c;
  c.name = std::move(name) + "_ep" + std::to_string(ep);
  c.shape = LayerShape{tokens, hidden, 128, 0, local_experts * ep, topk, ep};
  c.config.capacity = ep;  // every pattern fits (overflow has its own tests)
  c.config.wait_timeout_s = 5.0;  // a broken barrier fails the test in seconds
  c.pattern = pattern;
  c.seed = seed;
  return c;
}

std::vector<CommCase> cases(int ep) {
  std::vector<CommCase> v;
  v.push_back(make_case("Uniform", ep, 256, 256, 8, 4, Pattern::kUniform, 1));
  v.push_back(make_case("AllTokensToOneExpert", ep, 320, 128, 4, 2, Pattern::kOneExpert, 2));
  v.push_back(make_case("EmptyExperts", ep, 200, 128, 32, 2, Pattern::kFewExperts, 3));
  v.push_back(make_case("OneRankReceivesEverythingUpToCapacity", ep, 256, 128, 8, 4, Pattern::kOneRank, 4));
  v.push_back(make_case("TokensNotMultipleOf128", ep, 300, 192, 8, 3, Pattern::kUniform, 5));
  v.push_back(make_case("TopK1", ep, 384, 256, 8, 1, Pattern::kUniform, 6));
  v.push_back(make_case("TopK8", ep, 256, 512, 16, 8, Pattern::kUniform, 7));
  v.push_back(make_case("OneLocalExpert", ep, 256, 128, 1, ep, Pattern::kUniform, 8));
  v.push_back(make_case("OneToken", ep, 1, 64, 4, 2, Pattern::kUniform, 9));
  CommCase zc = make_case("ZeroCopyNoShared", ep, 130, 64, 4, 2, Pattern::kUniform, 10);
  zc.zero_copy = true;
  zc.with_shared = false;
  v.push_back(zc);
  CommCase mb = make_case("Minibatch128", ep, 512, 128, 4, 2, Pattern::kUniform, 11);
  mb.config.minibatch = 128;
  v.push_back(mb);
  return v;
}

class CommPipeline : public ::testing::TestWithParam<CommCase> {};

TEST_P(CommPipeline, BitwiseEqualToReference) {
  const CommCase& c = GetParam();
  const int ep = c.shape.ep;
  MOK_REQUIRE_GPUS(ep);
  const auto routing = make_routing(c.shape, c.pattern, c.seed);
  const ref::Schedule ref = ref::make_schedule(c.shape, c.config, routing);
  std::vector<RankInputs> in(ep);
  for (int r = 0; r < ep; ++r) in[r] = make_inputs(c, routing, r);
  std::vector<RankOutputs> out(ep);
  RankPool& pool = RankPool::get(ep);
  pool.run([&](bootstrap::LocalRank& lr) {
    out[lr.rank] = run_rank(c, in[lr.rank], lr.comm, lr.device, [&] { pool.barrier(); });
  });
  for (int r = 0; r < ep; ++r) {
    expect_schedule(c, ref, routing, r, out[r]);
    expect_data(c, ref, in, r, out[r]);
  }
}

std::string case_name(const ::testing::TestParamInfo<CommCase>& info) { return info.param.name; }

INSTANTIATE_TEST_SUITE_P(Ep1, CommPipeline, ::testing::ValuesIn(cases(1)), case_name);
INSTANTIATE_TEST_SUITE_P(Ep2, CommPipeline, ::testing::ValuesIn(cases(2)), case_name);

}  // namespace
}  // namespace mok::test
