// Communication layer, whole path on 1, 2, 4 and 8 GPUs (launch mode (a): one thread per GPU):
// GPU schedule bitwise equal to mok::ref::make_schedule, dispatch / combine / epilogue bitwise
// equal to the bytes the reference schedule predicts, for every comm-CTA count and dispatch
// mode (knob invariance), repeated runs identical. EP=n cases skip with fewer than n GPUs.
// CommCtaCounts: the plain pull and the dedup fan-out dispatch and the all-slots combine at
// many CTA counts give the same bytes, and the ready counters end at exactly the tiles of each
// minibatch.
#include <atomic>

#include "comm/roles.hpp"
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

// The routing shapes every suite covers: uniform, skewed, empty experts, one rank receiving
// everything, T not a multiple of 128, top-k 1 and 8.
std::vector<CommCase> routing_cases(int ep) {
  std::vector<CommCase> v;
  v.push_back(make_case("Uniform", ep, 256, 256, 8, 4, Pattern::kUniform, 1));
  v.push_back(make_case("AllTokensToOneExpert", ep, 320, 128, 4, 2, Pattern::kOneExpert, 2));
  v.push_back(make_case("EmptyExperts", ep, 200, 128, 32, 2, Pattern::kFewExperts, 3));
  v.push_back(make_case("OneRankReceivesEverythingUpToCapacity", ep, 256, 128, 8, 4, Pattern::kOneRank, 4));
  v.push_back(make_case("TokensNotMultipleOf128", ep, 300, 192, 8, 3, Pattern::kUniform, 5));
  v.push_back(make_case("TopK1", ep, 384, 256, 8, 1, Pattern::kUniform, 6));
  v.push_back(make_case("TopK8", ep, 256, 512, 16, 8, Pattern::kUniform, 7));
  return v;
}

std::vector<CommCase> cases(int ep) {
  std::vector<CommCase> v = routing_cases(ep);
  v.push_back(make_case("OneLocalExpert", ep, 256, 128, 1, ep, Pattern::kUniform, 8));
  v.push_back(make_case("OneToken", ep, 1, 64, 4, 2, Pattern::kUniform, 9));
  CommCase zc = make_case("ZeroCopyNoShared", ep, 130, 64, 4, 2, Pattern::kUniform, 10);
  zc.zero_copy = true;
  zc.with_shared = false;
  v.push_back(zc);
  CommCase mb = make_case("Minibatch128", ep, 512, 128, 4, 2, Pattern::kUniform, 11);
  mb.config.minibatch = 128;
  v.push_back(mb);
  // More k than the top-k sum loads at once (comm::kEpilogueBatch = 8): two batches and a partial one.
  v.push_back(make_case("TopK20", ep, 96, 128, 24, 20, Pattern::kUniform, 14));
  return v;
}

class CommPipeline : public ::testing::TestWithParam<CommCase> {};

TEST_P(CommPipeline, BitwiseEqualToReference) {
  const CommCase& c = GetParam();
  const int ep = c.shape.ep;
  MOK_REQUIRE_RANKS(ep);
  const auto routing = make_routing(c.shape, c.pattern, c.seed);
  const ref::Schedule ref = ref::make_schedule(c.shape, c.config, routing);
  std::vector<RankInputs> in(ep);
  for (int r = 0; r < ep; ++r) in[r] = make_inputs(c, routing, r);
  std::vector<RankOutputs> out(ep);
  RankPool& pool = RankPool::get(ep);
  pool.run([&](bootstrap::LocalRank& lr) {
    out[lr.rank] = run_rank(c, in[lr.rank], lr, [&] { pool.barrier(); });
  });
  for (int r = 0; r < ep; ++r) {
    expect_schedule(c, ref, routing, r, out[r]);
    expect_data(c, ref, in, r, out[r]);
  }
}

std::string case_name(const ::testing::TestParamInfo<CommCase>& info) { return info.param.name; }

INSTANTIATE_TEST_SUITE_P(Ep1, CommPipeline, ::testing::ValuesIn(cases(1)), case_name);
INSTANTIATE_TEST_SUITE_P(Ep2, CommPipeline, ::testing::ValuesIn(cases(2)), case_name);
// Scale-out (4- and 8-GPU machines); these skip, saying so, with fewer GPUs.
INSTANTIATE_TEST_SUITE_P(Ep4, CommPipeline, ::testing::ValuesIn(cases(4)), case_name);
INSTANTIATE_TEST_SUITE_P(Ep8, CommPipeline, ::testing::ValuesIn(cases(8)), case_name);

// ---- CTA counts ----------------------------------------------------------------------------------
struct CopyVariant {
  bool dedup;
  int ctas;
};
const std::vector<CopyVariant>& dispatch_variants() {
  static const std::vector<CopyVariant> v{{true, 16}, {true, 1}, {true, 7}, {true, 2}, {true, 24},
                                          {false, 16}, {false, 3}, {false, 2}, {false, 7}};
  return v;
}
const std::vector<CopyVariant>& combine_variants() {
  static const std::vector<CopyVariant> v{{false, 16}, {false, 3}, {false, 7}, {false, 2}};
  return v;
}
std::string variant_name(const CopyVariant& v) {
  return std::string(v.dedup ? "dedup" : "plain") + " ctas " + std::to_string(v.ctas);
}

// Once a launch timed out no other is made (every launch would cost a full timeout); the ranks
// decide together after a host barrier.
std::atomic<bool> g_copy_broken{false};

struct CopyOutputs {
  comm::ScheduleHeader header{};
  std::vector<comm::RowEntry> rows;
  std::vector<std::vector<uint16_t>> dispatched;  // per dispatch variant (empty: not run)
  std::vector<std::vector<uint32_t>> ready;       // per dispatch variant: ready counters
  std::vector<std::vector<uint16_t>> slots;       // per combine variant
  std::vector<std::string> errors;                // device errors, "variant: message"
  std::vector<bool> dispatch_skipped, combine_skipped;  // simulated ranks: the variant's CTAs do not fit
};

CopyOutputs run_variants(const CommCase& c, const RankInputs& in, const bootstrap::LocalRank& lr,
                          const std::function<void()>& sync_ranks) {
  const LayerShape& s = c.shape;
  auto ws = create_workspace(s, c.config, lr);
  comm::CommState& st = *ws->impl().state;
  const comm::ScheduleBuffers& sb = st.schedule_buffers();
  const cudaStream_t stream = rank_stream();
  CopyOutputs out;
  auto d_topk = upload(in.topk);
  auto d_x = upload(in.x);
  auto d_out = upload(in.expert_out);
  uploads_done();
  schedule(*ws, d_topk.get(), stream);
  ws->check();
  MOK_CUDA_CHECK(cudaMemcpy(&out.header, sb.header.get(), sizeof(out.header), cudaMemcpyDeviceToHost));
  out.rows = download(sb.rows.get(), sb.rows.size());
  const int64_t padded = std::max<int64_t>(out.header.padded_rows, 0);
  auto failed = [&](const CopyVariant& v) {
    std::optional<Error> err = st.take_error(stream);
    if (err) {
      out.errors.push_back(variant_name(v) + ": " + err->what());
      g_copy_broken = true;
    }
    sync_ranks();  // every rank sees the same broken flags before the next launch
  };
  // Simulated ranks share one GPU: a variant whose ep * ctas CTAs cannot all be resident
  // would wait at its group barrier for CTAs that never start. Not run then.
  const int fit = lr.comm == nullptr ? simulated_ctas_per_rank(s.ep) : 0;
  auto does_not_fit = [&](const CopyVariant& v) { return lr.comm == nullptr && v.ctas > fit; };
  st.stage_x(reinterpret_cast<const __nv_bfloat16*>(d_x.get()), stream);
  for (const CopyVariant& v : dispatch_variants()) {
    out.dispatch_skipped.push_back(does_not_fit(v));
    if (out.dispatch_skipped.back() || g_copy_broken) {
      out.dispatched.emplace_back();
      out.ready.emplace_back();
      continue;
    }
    MOK_CUDA_CHECK(cudaMemsetAsync(st.row_buffer(), 0xFF, sb.buffer_rows * s.hidden * 2, stream));
    st.dispatch(v.ctas, v.dedup, stream);
    failed(v);
    out.dispatched.push_back(download(reinterpret_cast<const uint16_t*>(st.row_buffer()), padded * s.hidden));
    out.ready.push_back(download(st.ready_counters(), sb.max_minibatches));
  }
  const size_t slot_elems = static_cast<size_t>(s.tokens) * s.topk * s.hidden;
  for (const CopyVariant& v : combine_variants()) {
    out.combine_skipped.push_back(does_not_fit(v));
    if (out.combine_skipped.back() || g_copy_broken) {
      out.slots.emplace_back();
      continue;
    }
    MOK_CUDA_CHECK(cudaMemsetAsync(st.window_local() + st.layout().slots, 0xFF, slot_elems * 2, stream));
    MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
    sync_ranks();  // no peer pushes into the slots before they are poisoned everywhere
    st.combine(reinterpret_cast<const __nv_bfloat16*>(d_out.get()), v.ctas, /*own_rows_in_place=*/false, stream);
    failed(v);
    out.slots.push_back(download(reinterpret_cast<const uint16_t*>(st.slots()), slot_elems));
  }
  MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
  sync_ranks();  // nobody tears its window down while a peer may still touch it
  ws.reset();
  return out;
}

std::vector<CommCase> cta_count_cases(int ep) {
  std::vector<CommCase> v = routing_cases(ep);
  v.push_back(make_case("TopK32FanOutOfAWholeWarp", ep, 130, 128, 32, 32, Pattern::kUniform, 12));
  v.push_back(make_case("OneToken", ep, 1, 64, 4, 2, Pattern::kUniform, 9));
  v.push_back(make_case("WideRows", ep, 160, 9216, 4, 2, Pattern::kUniform, 13));
  CommCase mb = make_case("Minibatch128", ep, 512, 128, 4, 2, Pattern::kUniform, 11);
  mb.config.minibatch = 128;
  v.push_back(mb);
  for (CommCase& c : v) c.config.wait_timeout_s = 2.0;
  return v;
}

class CommCtaCounts : public ::testing::TestWithParam<CommCase> {};

TEST_P(CommCtaCounts, EveryCountGivesTheReferenceBytes) {
  const CommCase& c = GetParam();
  const int ep = c.shape.ep;
  MOK_REQUIRE_RANKS(ep);
  const LayerShape& s = c.shape;
  const int64_t H = s.hidden;
  const auto routing = make_routing(s, c.pattern, c.seed);
  const ref::Schedule ref = ref::make_schedule(s, c.config, routing);
  std::vector<RankInputs> in(ep);
  for (int r = 0; r < ep; ++r) in[r] = make_inputs(c, routing, r);
  std::vector<CopyOutputs> out(ep);
  RankPool& pool = RankPool::get(ep);
  pool.run([&](bootstrap::LocalRank& lr) {
    out[lr.rank] = run_variants(c, in[lr.rank], lr, [&] { pool.barrier(); });
  });
  const int64_t mb = c.config.effective_minibatch(s);
  for (int r = 0; r < ep; ++r) {
    const ref::RankSchedule& rs = ref.ranks[r];
    const CopyOutputs& o = out[r];
    const std::string who = c.name + " rank " + std::to_string(r);
    for (const std::string& e : o.errors) ADD_FAILURE() << who << ": " << e;
    ASSERT_EQ(o.header.padded_rows, rs.padded_rows) << who;
    std::vector<uint16_t> want(rs.padded_rows * H, 0);
    for (int64_t i = 0; i < rs.padded_rows; ++i) {
      const ref::RowRef& row = rs.rows[i];
      if (!row.is_padding()) std::memcpy(&want[i * H], &in[row.src_rank].x[row.token * H], H * 2);
    }
    for (size_t v = 0; v < o.dispatched.size(); ++v) {
      const std::string name = variant_name(dispatch_variants()[v]);
      if (o.dispatch_skipped[v]) {
        if (r == 0) std::printf("[ SIMULATED] dispatch %s not run: %d ranks x its CTAs do not fit on one GPU\n", name.c_str(), ep);
        continue;
      }
      if (o.dispatched[v].empty() && rs.padded_rows > 0) {
        ADD_FAILURE() << who << ": dispatch " << name << " not run (a launch failed earlier)";
        continue;
      }
      const int64_t bad = first_mismatch(o.dispatched[v], want);
      EXPECT_EQ(bad, -1) << who << ": dispatch " << name << " first mismatch at row " << bad / H << " col " << bad % H;
      // Ready counters: exactly the row tiles of each minibatch (never more, never less).
      for (size_t m = 0; m < o.ready[v].size(); ++m) {
        const int64_t begin = std::min<int64_t>(m * mb, rs.padded_rows), end = std::min(begin + mb, rs.padded_rows);
        EXPECT_EQ(o.ready[v][m], static_cast<uint32_t>((end - begin) / kRowTile))
            << who << ": dispatch " << name << " ready[" << m << "]";
      }
    }
    std::vector<uint16_t> slots(s.tokens * s.topk * H);
    for (int64_t j = 0; j < s.tokens * s.topk; ++j) {
      const int owner = s.owner_rank(in[r].topk[j]);
      std::memcpy(&slots[j * H], &in[owner].expert_out[ref.dest_row[r][j] * H], H * 2);
    }
    for (size_t v = 0; v < o.slots.size(); ++v) {
      const std::string name = variant_name(combine_variants()[v]);
      if (o.combine_skipped[v]) {
        if (r == 0) std::printf("[ SIMULATED] combine %s not run: %d ranks x its CTAs do not fit on one GPU\n", name.c_str(), ep);
        continue;
      }
      if (o.slots[v].empty()) {
        ADD_FAILURE() << who << ": combine " << name << " not run (a launch failed earlier)";
        continue;
      }
      const int64_t bad = first_mismatch(o.slots[v], slots);
      EXPECT_EQ(bad, -1) << who << ": combine " << name << " first mismatch at slot " << bad / H << " col " << bad % H;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ep1, CommCtaCounts, ::testing::ValuesIn(cta_count_cases(1)), case_name);
INSTANTIATE_TEST_SUITE_P(Ep2, CommCtaCounts, ::testing::ValuesIn(cta_count_cases(2)), case_name);
INSTANTIATE_TEST_SUITE_P(Ep8, CommCtaCounts, ::testing::ValuesIn(cta_count_cases(8)), case_name);

}  // namespace
}  // namespace mok::test
