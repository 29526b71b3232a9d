// Error paths of the communication layer: bad expert ids, duplicate experts, capacity
// overflow and wait timeouts become mok::Error at Workspace::check(), outputs are poisoned,
// nothing hangs; the NCCL version lock; communicator checks.
#include <chrono>

#include "comm/roles.hpp"
#include "test_comm_harness.cuh"

namespace mok::test {
namespace {

LayerShape small_shape(int ep) { return LayerShape{64, 64, 64, 0, 8L * ep, 3, ep}; }

// Outputs of a poisoned schedule: every field -1, no minibatch.
void expect_poisoned(const RankOutputs& o, const std::string& who) {
  EXPECT_NE(o.header.status, 0) << who;
  EXPECT_EQ(o.header.real_rows, -1) << who;
  EXPECT_EQ(o.header.padded_rows, -1) << who;
  EXPECT_EQ(o.header.num_minibatches, 0) << who;
  for (int64_t v : o.offset) ASSERT_EQ(v, -1) << who << ": expert_offset not poisoned";
  for (int64_t v : o.count) ASSERT_EQ(v, -1) << who << ": expert_rows not poisoned";
  for (const auto& r : o.rows) {
    ASSERT_TRUE(r.src_rank == -1 && r.token == -1 && r.k == -1 && r.copy_from == -1) << who << ": rows not poisoned";
  }
  for (int32_t v : o.dest) ASSERT_EQ(v, -1) << who << ": dest_row not poisoned";
}

// Expects check() to throw `status` with every fragment in the message.
void expect_error(Workspace& ws, Status status, const std::vector<std::string>& fragments) {
  try {
    ws.check();
    ADD_FAILURE() << "Workspace::check() did not throw " << status_name(status);
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), status) << e.what();
    for (const auto& f : fragments) EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
  }
}

struct BadRouting {
  std::string name;
  std::vector<std::pair<int64_t, int32_t>> edits;  // (entry t*K+k, value)
  std::string where;                               // the first bad entry, as the message names it
  std::string got;
};

TEST(CommErrors, BadRoutingIsReportedPoisonedAndRecoverable) {
  MOK_REQUIRE_GPUS(1);
  const LayerShape s = small_shape(1);
  Config cfg;
  const auto good = make_routing(s, Pattern::kUniform, 21);
  const std::vector<BadRouting> bad{
      {"id == E", {{5 * 3 + 2, 8}}, "topk_idx[rank 0, token 5, k 2]", "got 8"},
      {"negative id", {{0, -1}}, "topk_idx[rank 0, token 0, k 0]", "got -1"},
      {"duplicate", {{7 * 3 + 1, good[0][7 * 3 + 0]}}, "topk_idx[rank 0, token 7, k 1]", "distinct experts"},
      {"first of several", {{10 * 3 + 0, 99}, {3 * 3 + 2, good[0][3 * 3 + 1]}}, "topk_idx[rank 0, token 3, k 2]",
       "distinct experts"},
  };
  RankPool::get(1).run([&](bootstrap::LocalRank& lr) {
    auto ws = Workspace::create(s, cfg, lr.comm, lr.device);
    comm::CommState& st = *ws->impl().state;
    cudaStream_t stream = nullptr;
    MOK_CUDA_CHECK(cudaStreamCreate(&stream));
    auto d_good = upload(good[0]);
    for (const BadRouting& b : bad) {
      SCOPED_TRACE(b.name);
      auto routing = good[0];
      for (const auto& [i, v] : b.edits) routing[i] = v;
      auto d_bad = upload(routing);
      poison_schedule(st.schedule_buffers());
      schedule(*ws, d_bad.get(), stream);
      expect_error(*ws, Status::kInvalidArgument, {b.where, b.got});
      RankOutputs o;
      download_schedule(st, o);
      expect_poisoned(o, b.name);
      // A dispatch on the poisoned schedule moves nothing and does not hang.
      const size_t bytes = st.schedule_buffers().buffer_rows * s.hidden * 2;
      MOK_CUDA_CHECK(cudaMemset(st.row_buffer(), 0x5A, bytes));
      st.stage_x(ws->x_staging(), stream);
      st.dispatch(4, true, stream);
      ws->check();
      const auto after = download(reinterpret_cast<const uint8_t*>(st.row_buffer()), bytes);
      for (size_t i = 0; i < after.size(); ++i) ASSERT_EQ(after[i], 0x5A) << "dispatch wrote byte " << i;
      // The next valid schedule works again.
      schedule(*ws, d_good.get(), stream);
      ws->check();
      download_schedule(st, o);
      EXPECT_EQ(o.header.status, 0);
      EXPECT_EQ(o.header.real_rows, s.tokens * s.topk);
    }
    MOK_CUDA_CHECK(cudaStreamDestroy(stream));
  });
}

TEST(CommErrors, CapacityOverflowIsAnErrorNotAHang) {
  // With one rank the configured capacity can never overflow (max rows = T*K), so the schedule
  // is launched directly with a limit one row short of what the routing needs.
  MOK_REQUIRE_GPUS(1);
  const LayerShape s = small_shape(1);
  Config cfg;
  const auto routing = make_routing(s, Pattern::kUniform, 22);
  RankPool::get(1).run([&](bootstrap::LocalRank& lr) {
    auto ws = Workspace::create(s, cfg, lr.comm, lr.device);
    comm::CommState& st = *ws->impl().state;
    cudaStream_t stream = nullptr;
    MOK_CUDA_CHECK(cudaStreamCreate(&stream));
    auto d_topk = upload(routing[0]);
    schedule(*ws, d_topk.get(), stream);  // ws->impl().last_stream = stream
    ws->check();
    poison_schedule(st.schedule_buffers());
    comm::ScheduleLaunch l;
    l.shape = s;
    l.peers = st.peers();
    l.layout = st.layout();
    l.topk_idx = d_topk.get();
    l.tokens = s.tokens;
    l.max_rows = s.tokens * s.topk - 1;
    l.barrier = st.barrier(comm::SyncSite::kExchange);
    l.wait = st.wait_context();
    comm::launch_schedule(l, st.schedule_buffers(), stream);
    expect_error(*ws, Status::kCapacityOverflow,
                 {"receives " + std::to_string(s.tokens * s.topk) + " routed rows",
                  "max_rows_per_rank = " + std::to_string(s.tokens * s.topk - 1)});
    RankOutputs o;
    download_schedule(st, o);
    expect_poisoned(o, "capacity overflow");
    comm::DeviceBuffer<uint16_t> expert_out(st.schedule_buffers().buffer_rows * s.hidden);
    st.dispatch(2, false, stream);  // both roles skip a poisoned schedule, barriers still pass
    st.combine(reinterpret_cast<const __nv_bfloat16*>(expert_out.get()), 2, true, stream);
    ws->check();
    MOK_CUDA_CHECK(cudaStreamDestroy(stream));
  });
}

TEST(CommErrors, CapacityOverflowOnTwoRanks) {
  MOK_REQUIRE_RANKS(2);
  const LayerShape s = small_shape(2);
  Config cfg;
  cfg.capacity = 1.0;  // rank 0 receives 2*T*K rows, twice the capacity
  const auto routing = make_routing(s, Pattern::kOneRank, 23);
  RankPool& pool = RankPool::get(2);
  pool.run([&](bootstrap::LocalRank& lr) {
    auto ws = create_workspace(s, cfg, lr);
    comm::CommState& st = *ws->impl().state;
    const cudaStream_t stream = rank_stream();
    auto d_topk = upload(routing[lr.rank]);
    comm::DeviceBuffer<uint16_t> expert_out(st.schedule_buffers().buffer_rows * s.hidden);
    uploads_done();
    schedule(*ws, d_topk.get(), stream);
    // Every rank fails, not only the overflowing one: rank 1's tokens went to rank 0's experts,
    // so its y would silently miss their contributions.
    expect_error(*ws, Status::kCapacityOverflow, {"rank 0 receives " + std::to_string(2 * s.tokens * s.topk)});
    st.dispatch(4, true, stream);
    st.combine(reinterpret_cast<const __nv_bfloat16*>(expert_out.get()), 4, true, stream);
    ws->check();
    MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
    pool.barrier();
    ws.reset();
  });
}

TEST(CommErrors, BadRoutingOnTwoRanksIsSeenByBoth) {
  MOK_REQUIRE_RANKS(2);
  const LayerShape s = small_shape(2);
  Config cfg;
  auto routing = make_routing(s, Pattern::kUniform, 24);
  routing[1][9 * 3 + 1] = static_cast<int32_t>(s.experts);  // rank 1, token 9, k 1
  RankPool& pool = RankPool::get(2);
  pool.run([&](bootstrap::LocalRank& lr) {
    auto ws = create_workspace(s, cfg, lr);
    const cudaStream_t stream = rank_stream();
    auto d_topk = upload(routing[lr.rank]);
    uploads_done();
    schedule(*ws, d_topk.get(), stream);
    expect_error(*ws, Status::kInvalidArgument, {"topk_idx[rank 1, token 9, k 1]"});
    MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
    pool.barrier();
    ws.reset();
  });
}

// Calls with fewer tokens than the workspace: every rank must pass the same count. A rank with
// fewer (its end marker lands inside the others' range) or more (a real id where the others'
// range ends) poisons every rank's schedule with a clear error; the next call recovers.
TEST(CommErrors, TokenCountDifferentAcrossRanksIsAnError) {
  MOK_REQUIRE_RANKS(2);
  const LayerShape s = small_shape(2);
  Config cfg;
  const auto routing = make_routing(s, Pattern::kUniform, 25);
  RankPool& pool = RankPool::get(2);
  pool.run([&](bootstrap::LocalRank& lr) {
    auto ws = create_workspace(s, cfg, lr);
    const cudaStream_t stream = rank_stream();
    auto d_topk = upload(routing[lr.rank]);
    uploads_done();
    for (int64_t other : {s.tokens - 5, s.tokens}) {  // rank 1 has fewer / more than rank 0's T - 3
      const int64_t mine = lr.rank == 0 ? s.tokens - 3 : other;
      schedule(*ws, d_topk.get(), mine, stream);
      expect_error(*ws, Status::kInvalidArgument, {"another token count", "the same tokens on every rank"});
      MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
      pool.barrier();
    }
    schedule(*ws, d_topk.get(), s.tokens - 3, stream);  // the same count again: no error
    EXPECT_NO_THROW(ws->check());
    try {
      schedule(*ws, d_topk.get(), s.tokens + 1, stream);
      ADD_FAILURE() << "tokens > LayerShape.tokens accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("tokens"), std::string::npos) << e.what();
    }
    MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
    pool.barrier();
    ws.reset();
  });
}

TEST(CommErrors, WaitTimesOutIntoAnError) {
  MOK_REQUIRE_GPUS(1);
  const LayerShape s = small_shape(1);
  Config cfg;
  cfg.wait_timeout_s = 0.2;
  RankPool::get(1).run([&](bootstrap::LocalRank& lr) {
    auto ws = Workspace::create(s, cfg, lr.comm, lr.device);
    comm::CommState& st = *ws->impl().state;
    cudaStream_t stream = nullptr;
    MOK_CUDA_CHECK(cudaStreamCreate(&stream));
    auto d_topk = upload(make_routing(s, Pattern::kUniform, 25)[0]);
    schedule(*ws, d_topk.get(), stream);
    ws->check();
    // A flag slot no rank ever writes (peer kMaxEp-1 does not exist).
    const auto* never = reinterpret_cast<const uint64_t*>(st.peers().base[st.rank()] + st.layout().flags) + kMaxEp - 1;
    const auto t0 = std::chrono::steady_clock::now();
    comm::launch_test_wait(never, 1, st.wait_context(), stream);
    expect_error(*ws, Status::kTimeout, {"rank 0", "test flag", "expected a value >= 1", "last saw 0"});
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_GE(waited, 0.15);
    EXPECT_LT(waited, 5.0) << "the wait did not honour Config::wait_timeout_s";
    ws->check();  // the record was cleared

    // A role's wait: combine waiting for expert-output tiles that never become ready.
    comm::DeviceBuffer<uint16_t> expert_out(st.schedule_buffers().buffer_rows * s.hidden);
    comm::DeviceBuffer<uint32_t> out_ready(st.schedule_buffers().buffer_rows / kRowTile);
    MOK_CUDA_CHECK(cudaMemset(out_ready.get(), 0, out_ready.bytes()));
    comm::CombineLaunch l;
    l.role.peers = st.peers();
    l.role.slots_offset = st.layout().slots;
    l.role.row_bytes = s.hidden * 2;
    l.role.topk = s.topk;
    l.role.header = st.schedule_buffers().header.get();
    l.role.rows = st.schedule_buffers().rows.get();
    l.role.expert_out = reinterpret_cast<const char*>(expert_out.get());
    l.role.out_ready = out_ready.get();
    l.role.out_ready_target = 1;
    l.role.wait = st.wait_context();
    l.done = st.barrier(comm::SyncSite::kCombineDone);
    l.ctas = 3;
    comm::launch_combine(l, stream);
    expect_error(*ws, Status::kTimeout, {"combine (an expert-output row tile)"});
    MOK_CUDA_CHECK(cudaStreamDestroy(stream));
  });
}

TEST(CommErrors, CommunicatorMustMatchTheShape) {
  MOK_REQUIRE_GPUS(1);
  RankPool::get(1).run([&](bootstrap::LocalRank& lr) {
    try {
      Workspace::create(small_shape(2), Config{}, lr.comm, lr.device);
      ADD_FAILURE() << "a 1-rank communicator was accepted for ep = 2";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find("LayerShape.ep = 2"), std::string::npos) << e.what();
    }
  });
}

TEST(CommVersion, LoadedNcclMatchesHeadersOrIsRefused) {
  int loaded = 0;
  ASSERT_EQ(ncclGetVersion(&loaded), ncclSuccess);
  std::printf("NCCL headers %s, loaded library %s\n", comm::nccl_version_string(NCCL_VERSION_CODE).c_str(),
              comm::nccl_version_string(loaded).c_str());
  if (loaded == NCCL_VERSION_CODE) {
    EXPECT_NO_THROW(comm::check_nccl_version());
    return;
  }
  try {
    comm::check_nccl_version();
    ADD_FAILURE() << "a mismatched NCCL was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kNcclError);
    EXPECT_NE(std::string(e.what()).find("NCCL version mismatch"), std::string::npos) << e.what();
    std::printf("refused as expected: %s\n", e.what());
  }
}

}  // namespace
}  // namespace mok::test
