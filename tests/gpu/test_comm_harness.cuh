// Shared harness of the communication-layer GPU tests (test_comm*.cu): routing patterns, one
// persistent set of rank threads per EP size (launch mode (a)), the full pipeline of one rank
// (schedule -> dispatch -> combine -> epilogue) and its bitwise verification against the CPU
// reference schedule (pure data movement: every byte is predicted exactly).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm_state.hpp"
#include "comm/cuda_check.hpp"
#include "comm/roles.hpp"
#include "comm/simulated_group.hpp"
#include "comm/wait.cuh"
#include "gemm/gemm_host.hpp"
#include "host/simulated_ranks.hpp"
#include "host/workspace_impl.hpp"
#include "mok/api.hpp"
#include "mok/bootstrap.hpp"
#include "reference/bf16.hpp"
#include "reference/schedule.hpp"

namespace mok::test {

inline int gpu_count() { return bootstrap::local_device_count(); }

#define MOK_REQUIRE_GPUS(n)                                                                          \
  do {                                                                                               \
    if (::mok::test::gpu_count() < (n)) {                                                            \
      GTEST_SKIP() << "needs " << (n) << " GPU(s) (one per EP rank), found " << ::mok::test::gpu_count() \
                   << ": not run";                                                                   \
    }                                                                                                \
  } while (0)

// ---- simulated ranks (comm/simulated_group.hpp) -----------------------------------------------
// On a machine with fewer GPUs than a test's EP size, the RankPool runs the EP ranks as threads
// on GPU 0 with a simulated group (plain device pointers instead of NVLink peers), so the EP >= 2
// paths are checked bitwise on 1 GPU. MOK_TEST_SIMULATE_RANKS=0 turns that off (those tests skip).
inline bool simulation_allowed() {
  const char* v = std::getenv("MOK_TEST_SIMULATE_RANKS");
  return v == nullptr || std::string(v) != "0";
}
// Simulated ranks need eager module loading and one hardware queue per stream
// (comm/simulated_group.hpp); set here, at static initialisation, before the first CUDA call
// (values the user set are kept, and checked when a group is made).
inline const bool kSimulatedRankEnv = [] {
  if (simulation_allowed()) {
    setenv("CUDA_MODULE_LOADING", "EAGER", 0);
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  }
  return true;
}();
// The largest EP size simulated (MOK_TEST_SIMULATE_MAX_EP, default 8 = every EP the tests use).
// It was 4 for a while: one first-barrier timeout at simulated ep 8 in a full test_forward run
// (b8b35ba, 1 of ~40 ep 8 test runs); since 3e5edb5, 20 full test_forward runs (400 ep 8 test
// runs) and 10 full test_comm runs (236) passed (docs/comm.md, launch mode (c)).
// Parsed strictly (gemm::host::env_int throws, naming the variable): a typo must not silently
// skip (or widen) the EP cases. Empty counts as unset.
inline int simulate_max_ep() {
  const char* v = std::getenv("MOK_TEST_SIMULATE_MAX_EP");
  if (v != nullptr && *v == '\0') return 8;
  return gemm::host::env_int("MOK_TEST_SIMULATE_MAX_EP", 8, 1, 8, "an EP size");
}
inline bool simulating_ranks(int ep) {
  return ep > gpu_count() && gpu_count() >= 1 && simulation_allowed() && ep <= simulate_max_ep();
}

// For RankPool tests: one GPU per rank, or simulated ranks on one GPU.
#define MOK_REQUIRE_RANKS(n)                                                                           \
  do {                                                                                                 \
    if (::mok::test::gpu_count() == 0) GTEST_SKIP() << "no CUDA GPU: not run";                         \
    if (::mok::test::gpu_count() < (n) && !::mok::test::simulation_allowed()) {                        \
      GTEST_SKIP() << "needs " << (n) << " GPU(s), found " << ::mok::test::gpu_count()                 \
                   << " and MOK_TEST_SIMULATE_RANKS=0: not run";                                       \
    }                                                                                                  \
    if (::mok::test::gpu_count() < (n) && (n) > ::mok::test::simulate_max_ep()) {                      \
      GTEST_SKIP() << "needs " << (n) << " GPU(s), found " << ::mok::test::gpu_count()                 \
                   << ", and simulated ranks stop at ep " << ::mok::test::simulate_max_ep()            \
                   << " (MOK_TEST_SIMULATE_MAX_EP): not run"; \
    }                                                                                                  \
    if (::mok::test::simulating_ranks(n)) {                                                            \
      ::testing::Test::RecordProperty("simulated_ranks", (n));                                         \
      std::printf("[ SIMULATED] ep %d as %d rank threads on GPU 0 (fewer GPUs than ranks; grids "      \
                  "shrunk to fit together; not a performance run)\n", (n), (n));                       \
    }                                                                                                  \
  } while (0)

// This thread's simulated group (set on the RankPool's rank threads in simulated mode).
inline thread_local comm::SimulatedGroup* t_simulated_group = nullptr;

// This rank thread's stream: non-blocking (never ordered behind another rank's work on the
// legacy default stream, which all threads of a context share), created once per thread
// (again by recreate_rank_stream, see RankPool::rendezvous).
struct RankStreamHolder {
  cudaStream_t s = nullptr;
  ~RankStreamHolder() {
    if (s != nullptr) cudaStreamDestroy(s);
  }
};
inline RankStreamHolder& rank_stream_holder() {
  thread_local RankStreamHolder h;
  return h;
}
inline cudaStream_t rank_stream() {
  RankStreamHolder& h = rank_stream_holder();
  if (h.s == nullptr) MOK_CUDA_CHECK(cudaStreamCreateWithFlags(&h.s, cudaStreamNonBlocking));
  return h.s;
}
inline void recreate_rank_stream() {
  RankStreamHolder& h = rank_stream_holder();
  if (h.s != nullptr) MOK_CUDA_CHECK(cudaStreamDestroy(h.s));
  h.s = nullptr;
  rank_stream();
}

// One CTA per simulated rank (RankPool::rendezvous): arrive on the counter, then wait until
// `target` arrivals (or `timeout_ns` on %globaltimer; then ok[rank] stays 0).
static __global__ void rendezvous_kernel(unsigned* arrived, unsigned target, unsigned long long timeout_ns,
                                         unsigned* ok, int rank) {
  atomicAdd(arrived, 1u);
  const uint64_t t0 = comm::global_time_ns();
  while (atomicAdd(arrived, 0u) < target) {
    if (comm::global_time_ns() - t0 > timeout_ns) return;
    __nanosleep(1000);
  }
  ok[rank] = 1u;
}

// Host-to-device cudaMemcpy from pageable memory may return before its DMA finished; the
// rank stream (non-blocking) is not ordered after it. Call after uploads, before launches.
inline void uploads_done() { MOK_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy)); }

inline int gpu0_sms() {
  int sms = 0;
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  return sms;
}
// CTAs each of `ep` simulated ranks may keep resident at once (one per SM, 4 SMs spare).
inline int simulated_ctas_per_rank(int ep) { return (gpu0_sms() - 4) / ep; }
// The config a simulated rank runs: every rank's grid (one fused CTA per SM) must be resident
// beside the others', so the grid shrinks to fit ep of them and the comm CTAs to at most half
// of it. Any grid / comm CTA count gives the same bits (D2).
inline Config simulated_config(const LayerShape& s, Config c) {
  const int fit = std::max(2, simulated_ctas_per_rank(s.ep));
  c.grid_sms = std::min(c.grid_sms > 0 ? c.grid_sms : gpu0_sms(), fit);
  const int comm_cap = std::max(1, c.grid_sms / 2);
  c.comm_sms_forward = std::min(c.effective_comm_sms_forward(s), comm_cap);
  c.comm_sms_backward = std::min(c.comm_sms_backward, comm_cap);
  return c;
}

// Milliseconds since the first call (failure reports of simulated ranks carry them).
inline double harness_ms() {
  static const auto t0 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
inline thread_local double t_created_ms = -1;  // when this rank thread's last workspace was created

// Workspace::create for rank `r` of a RankPool (NCCL communicator or simulated group).
inline std::unique_ptr<Workspace> create_workspace(const LayerShape& s, const Config& cfg,
                                                   const bootstrap::LocalRank& r) {
  if (r.comm != nullptr) return Workspace::create(s, cfg, r.comm, r.device);
  if (t_simulated_group == nullptr) {
    throw Error(Status::kInvalidArgument, "create_workspace: rank thread has neither a communicator nor a group");
  }
  auto ws = host::create_simulated_workspace(s, simulated_config(s, cfg), *t_simulated_group, r.rank);
  t_created_ms = harness_ms();
  return ws;
}

// ---- routing patterns ---------------------------------------------------------------------------
enum class Pattern {
  kUniform,      // K distinct experts uniformly at random
  kOneExpert,    // expert 0 in every token (all tokens to one expert), the rest random
  kFewExperts,   // every 4th expert only: many empty experts on every rank
  kOneRank,      // only rank 0's experts: rank 0 receives every row (needs capacity >= ep)
};

inline std::vector<std::vector<int32_t>> make_routing(const LayerShape& s, Pattern p, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t pool = p == Pattern::kFewExperts ? std::max<int64_t>(s.topk, s.experts / 4)
                       : p == Pattern::kOneRank  ? s.local_experts()
                                                 : s.experts;
  std::vector<std::vector<int32_t>> idx(s.ep, std::vector<int32_t>(s.tokens * s.topk));
  std::vector<int32_t> perm(pool);
  for (int r = 0; r < s.ep; ++r) {
    for (int64_t t = 0; t < s.tokens; ++t) {
      for (int64_t i = 0; i < pool; ++i) perm[i] = static_cast<int32_t>(i);
      for (int k = 0; k < s.topk; ++k) {  // partial Fisher-Yates: K distinct ids
        const int64_t j = k + static_cast<int64_t>(rng() % (pool - k));
        std::swap(perm[k], perm[j]);
      }
      if (p == Pattern::kOneExpert) {
        bool has0 = false;
        for (int k = 0; k < s.topk; ++k) has0 |= perm[k] == 0;
        if (!has0) perm[rng() % s.topk] = 0;
      }
      const int64_t spread = p == Pattern::kFewExperts ? s.experts / pool : 1;  // used experts on every rank
      for (int k = 0; k < s.topk; ++k) idx[r][t * s.topk + k] = static_cast<int32_t>(perm[k] * spread);
    }
  }
  return idx;
}

// Random finite, non-zero bf16 values in [-2, -1/64] u [1/64, 2].
inline std::vector<uint16_t> random_bf16(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> mag(1.0f / 64, 2.0f);
  std::vector<uint16_t> v(n);
  for (auto& e : v) e = ref::to_bf16((rng() & 1) ? mag(rng) : -mag(rng));
  return v;
}

// ---- rank threads (launch mode (a)), kept alive across tests -----------------------------------
class RankPool {
 public:
  using Task = std::function<void(bootstrap::LocalRank&)>;

  static RankPool& get(int ep) {
    static std::mutex mu;
    static std::vector<std::unique_ptr<RankPool>> pools(kMaxEp + 1);
    std::lock_guard<std::mutex> lock(mu);
    if (!pools[ep]) pools[ep] = std::unique_ptr<RankPool>(new RankPool(ep));
    return *pools[ep];
  }

  // Runs task on every rank thread; rethrows the first failure after all returned.
  void run(const Task& task) {
    std::unique_lock<std::mutex> lock(mu_);
    task_ = task;
    done_ = 0;
    error_ = nullptr;
    ++generation_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return done_ == ep_; });
    if (error_) std::rethrow_exception(error_);
  }

  // Host barrier among the rank threads (after each synchronised its stream). Gives up after
  // two minutes (a rank that failed never arrives) instead of hanging the test binary.
  void barrier() {
    if (!barrier_.arrive_and_wait(120.0)) {
      throw Error(Status::kTimeout, "test host barrier: a rank thread never arrived (it failed earlier)");
    }
  }

  ~RankPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      ++generation_;
      cv_.notify_all();
    }
    if (driver_.joinable()) driver_.join();
    if (rdv_ != nullptr) cudaFree(rdv_);
  }

 private:
  explicit RankPool(int ep) : ep_(ep) {
    if (simulating_ranks(ep)) {  // ep threads on GPU 0, no NCCL
      group_ = std::make_unique<comm::SimulatedGroup>(ep, 0, 30.0);  // host collectives give up after 30 s
      driver_ = std::thread([this] {
        std::vector<std::thread> ranks;
        for (int i = 0; i < ep_; ++i) {
          ranks.emplace_back([this, i] {
            bootstrap::LocalRank r;
            r.rank = i;
            r.world_size = ep_;
            r.device = 0;
            cudaSetDevice(0);
            t_simulated_group = group_.get();
            try {
              rendezvous(r);
            } catch (const std::exception& e) {
              std::fprintf(stderr, "[ SIMULATED] rank %d of %d: stream rendezvous failed: %s\n", i, ep_, e.what());
            }
            serve(r);
          });
        }
        for (auto& t : ranks) t.join();
      });
      return;
    }
    std::vector<int> devices(ep);
    for (int i = 0; i < ep; ++i) devices[i] = i;
    driver_ = std::thread([this, devices] {
      bootstrap::run_local_ranks(devices, [this](bootstrap::LocalRank& r) { serve(r); });
    });
  }

  // Simulated ranks only, before the first task: proves that every rank's stream runs beside the
  // others' (each pass's kernels wait on each other across ranks). Twice the first simulated
  // ep 8 pass of a process had one rank whose host calls returned on time but whose kernels did
  // not start until the peers' 10 s waits had timed out (docs/comm.md, launch mode (c)): a
  // stream's first use can leave it unable to start beside a spinning peer. So each rank
  // launches rendezvous_kernel on its stream; if any rank did not see all arrivals within 2 s
  // they try again with the same streams (a first-use effect is then gone), and after a second
  // miss with new streams (a stream sharing a hardware queue with a peer's), up to 4 attempts,
  // saying so on stderr: which of the two it was is the evidence docs/comm.md asks for.
  void rendezvous(const bootstrap::LocalRank& r) {
    constexpr int kAttempts = 4;
    if (r.rank == 0) {
      MOK_CUDA_CHECK(cudaMalloc(&rdv_, sizeof(unsigned) * (1 + ep_)));
      MOK_CUDA_CHECK(cudaMemset(rdv_, 0, sizeof(unsigned) * (1 + ep_)));
      MOK_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));  // before the other ranks' kernels
    }
    for (int attempt = 0; attempt < kAttempts; ++attempt) {
      if (!barrier_.arrive_and_wait(120.0)) return;  // rdv_ ready and zeroed (ok flags) for this attempt
      cudaStream_t st = rank_stream();
      rendezvous_kernel<<<1, 1, 0, st>>>(rdv_, static_cast<unsigned>(ep_ * (attempt + 1)), 2000000000ull, rdv_ + 1,
                                         r.rank);
      MOK_CUDA_CHECK(cudaGetLastError());
      MOK_CUDA_CHECK(cudaStreamSynchronize(st));
      if (!barrier_.arrive_and_wait(120.0)) return;  // every kernel done
      std::vector<unsigned> ok(ep_);
      MOK_CUDA_CHECK(cudaMemcpy(ok.data(), rdv_ + 1, sizeof(unsigned) * ep_, cudaMemcpyDeviceToHost));
      std::string late;
      for (int i = 0; i < ep_; ++i) {
        if (ok[i] == 0) late += ' ' + std::to_string(i);
      }
      if (!barrier_.arrive_and_wait(120.0)) return;  // every rank read the flags
      if (late.empty()) {
        if (attempt > 0 && r.rank == 0) {
          std::fprintf(stderr, "[ SIMULATED] ep %d: rank streams ran together at attempt %d\n", ep_, attempt + 1);
        }
        return;
      }
      if (r.rank == 0) {
        std::fprintf(stderr,
                     "[ SIMULATED] ep %d: rank streams did not all run together (attempt %d: ranks%s saw fewer than %d "
                     "arrivals in 2 s); %s\n",
                     ep_, attempt + 1, late.c_str(), ep_,
                     attempt == 0 ? "trying again with the same streams" : "recreating every rank's stream");
        MOK_CUDA_CHECK(cudaMemset(rdv_ + 1, 0, sizeof(unsigned) * ep_));
        MOK_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));  // (no kernel runs now: all finished)
      }
      if (attempt > 0) recreate_rank_stream();
    }
  }

  void serve(bootstrap::LocalRank& r) {
    uint64_t seen = 0;
    for (;;) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (stop_) return;
        task = task_;
      }
      std::exception_ptr err;
      try {
        task(r);
      } catch (const std::exception& e) {
        // Said at once: the other ranks may now wait out a barrier timeout before run() returns.
        std::fprintf(stderr, "rank %d of %d failed at %.1f ms (last workspace created at %.1f ms): %s\n", r.rank, ep_,
                     harness_ms(), t_created_ms, e.what());
        err = std::current_exception();
      } catch (...) {
        err = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (err && !error_) error_ = err;
      if (++done_ == ep_) cv_.notify_all();
    }
  }

  int ep_;
  std::unique_ptr<comm::SimulatedGroup> group_;  // simulated ranks only
  std::thread driver_;
  std::mutex mu_;
  std::condition_variable cv_;
  Task task_;
  uint64_t generation_ = 0;
  int done_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  comm::HostBarrier barrier_{ep_};
  unsigned* rdv_ = nullptr;  // rendezvous: [arrivals, ok per rank] (simulated ranks; freed with the pool)
};

// ---- one test case --------------------------------------------------------------------------------
struct CommCase {
  std::string name;
  LayerShape shape;
  Config config;
  Pattern pattern = Pattern::kUniform;
  uint64_t seed = 1;
  bool zero_copy = false;    // write x straight into Workspace::x_staging()
  bool with_shared = true;   // epilogue starts from a shared-expert output
};
// GoogleTest prints a parameter in `--gtest_list_tests`, and CTest's discovered names carry it:
// without this it was a 152-byte hex dump per test (370-character lines in every CI log).
inline void PrintTo(const CommCase& c, std::ostream* os) { *os << c.name; }

struct DispatchVariant {
  int ctas;
  bool dedup;
};
inline const std::vector<DispatchVariant>& dispatch_variants() {
  static const std::vector<DispatchVariant> v{{16, false}, {16, true}, {1, true}, {3, false}, {5, true}};
  return v;
}
// own_rows_in_place: only other ranks' rows are pushed (own-rank slots must stay poisoned) and
// the epilogue reads the own rows from expert_out. Each combine variant is followed by an
// epilogue in its mode. The in-place combine walks the schedule's remote-row list.
struct CombineVariant {
  int ctas;
  bool own_rows_in_place;
};
inline const std::vector<CombineVariant>& combine_variants() {
  static const std::vector<CombineVariant> v{{16, false}, {1, false},       {7, true},
                                             {1, true},   {5, true}, {16, true}};
  return v;
}

struct RankInputs {
  std::vector<int32_t> topk;
  std::vector<uint16_t> x, shared, expert_out;
  std::vector<float> w;
};

struct RankOutputs {
  comm::ScheduleHeader header{};
  std::vector<int64_t> offset, count, mb;
  std::vector<comm::RowEntry> rows, rows_again;
  std::vector<int32_t> dest, remote_rows;  // remote_rows: the first remote_count entries
  std::vector<int32_t> token_key, token_order;  // [T] each
  std::vector<std::vector<uint16_t>> dispatched;  // per dispatch variant: [padded_rows, H]
  std::vector<std::vector<uint16_t>> slots;       // per combine variant: [T, K, H]
  std::vector<std::vector<uint16_t>> ys;          // per combine variant: the epilogue's y after it
  std::vector<uint16_t> y_again;                  // the last variant's epilogue, run again
};

inline RankInputs make_inputs(const CommCase& c, const std::vector<std::vector<int32_t>>& routing, int rank) {
  const LayerShape& s = c.shape;
  RankInputs in;
  in.topk = routing[rank];
  const uint64_t seed = c.seed * 1000 + rank;
  in.x = random_bf16(s.tokens * s.hidden, seed + 11);
  in.shared = random_bf16(s.tokens * s.hidden, seed + 13);
  in.expert_out = random_bf16(c.config.buffer_rows_per_rank(s) * s.hidden, seed + 17);
  std::mt19937_64 rng(seed + 19);
  std::uniform_real_distribution<float> w(-1.0f, 1.0f);
  in.w.resize(s.tokens * s.topk);
  for (auto& v : in.w) v = w(rng);
  return in;
}

template <class T>
std::vector<T> download(const T* d, size_t n) {
  std::vector<T> h(n);
  if (n > 0) MOK_CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

template <class T>
comm::DeviceBuffer<T> upload(const std::vector<T>& h) {
  comm::DeviceBuffer<T> d(h.size());
  if (!h.empty()) MOK_CUDA_CHECK(cudaMemcpy(d.get(), h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// Poisons every schedule output (0xAB bytes) so a row the GPU never wrote cannot pass. On
// `stream` and synchronised (nothing device-wide: simulated ranks share the device).
inline void poison_schedule(const comm::ScheduleBuffers& b, cudaStream_t stream = nullptr) {
  MOK_CUDA_CHECK(cudaMemsetAsync(b.header.get(), 0xAB, b.header.bytes(), stream));
  MOK_CUDA_CHECK(cudaMemsetAsync(b.expert_offset.get(), 0xAB, b.expert_offset.bytes(), stream));
  MOK_CUDA_CHECK(cudaMemsetAsync(b.expert_rows.get(), 0xAB, b.expert_rows.bytes(), stream));
  MOK_CUDA_CHECK(cudaMemsetAsync(b.rows.get(), 0xAB, b.rows.bytes(), stream));
  MOK_CUDA_CHECK(cudaMemsetAsync(b.dest_row.get(), 0xAB, b.dest_row.bytes(), stream));
  MOK_CUDA_CHECK(cudaMemsetAsync(b.minibatch_ranges.get(), 0xAB, b.minibatch_ranges.bytes(), stream));
  MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
}

inline void download_schedule(const comm::CommState& st, RankOutputs& out) {
  const comm::ScheduleBuffers& b = st.schedule_buffers();
  MOK_CUDA_CHECK(cudaMemcpy(&out.header, b.header.get(), sizeof(out.header), cudaMemcpyDeviceToHost));
  out.offset = download(b.expert_offset.get(), b.expert_offset.size());
  out.count = download(b.expert_rows.get(), b.expert_rows.size());
  out.rows = download(b.rows.get(), b.rows.size());
  out.dest = download(b.dest_row.get(), b.dest_row.size());
  out.mb = download(b.minibatch_ranges.get(), b.minibatch_ranges.size());
  int32_t n = 0;
  MOK_CUDA_CHECK(cudaMemcpy(&n, b.remote_count.get(), sizeof(n), cudaMemcpyDeviceToHost));
  out.remote_rows = download(b.remote_rows.get(), static_cast<size_t>(std::max(n, 0)));
  out.token_key = download(b.token_key.get(), b.token_key.size());
  out.token_order = download(b.token_order.get(), b.token_order.size());
}

// The whole pipeline on one rank. `sync_ranks` = every rank's stream idle, then a host barrier
// (needed only where the test poisons a buffer that peers write into).
inline RankOutputs run_rank(const CommCase& c, const RankInputs& in, const bootstrap::LocalRank& lr,
                            const std::function<void()>& sync_ranks) {
  const LayerShape& s = c.shape;
  auto ws = create_workspace(s, c.config, lr);
  comm::CommState& st = *ws->impl().state;
  const cudaStream_t stream = rank_stream();  // non-blocking: uploads_done() orders the copies below
  RankOutputs out;
  auto d_topk = upload(in.topk);
  auto d_x = upload(in.x);
  auto d_shared = upload(in.shared);
  auto d_out = upload(in.expert_out);
  auto d_w = upload(in.w);
  comm::DeviceBuffer<uint16_t> d_y(s.tokens * s.hidden);
  uploads_done();

  poison_schedule(st.schedule_buffers(), stream);
  schedule(*ws, d_topk.get(), stream);
  ws->check();
  download_schedule(st, out);
  schedule(*ws, d_topk.get(), stream);  // D1: a second run gives the same rows
  ws->check();
  out.rows_again = download(st.schedule_buffers().rows.get(), st.schedule_buffers().rows.size());

  const int64_t padded = std::max<int64_t>(out.header.padded_rows, 0);
  const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(d_x.get());
  if (c.zero_copy) {
    MOK_CUDA_CHECK(cudaMemcpyAsync(ws->x_staging(), in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice, stream));
    x = ws->x_staging();
  }
  for (const DispatchVariant& v : dispatch_variants()) {
    MOK_CUDA_CHECK(cudaMemsetAsync(st.row_buffer(), 0xFF, st.schedule_buffers().buffer_rows * s.hidden * 2, stream));
    st.stage_x(x, stream);
    st.dispatch(v.ctas, v.dedup, stream);
    ws->check();
    out.dispatched.push_back(download(reinterpret_cast<const uint16_t*>(st.row_buffer()), padded * s.hidden));
  }
  const size_t slot_elems = static_cast<size_t>(s.tokens) * s.topk * s.hidden;
  const __nv_bfloat16* shared = c.with_shared ? reinterpret_cast<const __nv_bfloat16*>(d_shared.get()) : nullptr;
  const auto* expert_out = reinterpret_cast<const __nv_bfloat16*>(d_out.get());
  auto* y = reinterpret_cast<__nv_bfloat16*>(d_y.get());
  for (const CombineVariant& v : combine_variants()) {
    MOK_CUDA_CHECK(cudaMemsetAsync(st.window_local() + st.layout().slots, 0xFF, slot_elems * 2, stream));
    MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
    sync_ranks();  // no peer pushes into the slots before they are poisoned everywhere
    comm::CombineLaunch l = st.combine_launch(expert_out, v.ctas, v.own_rows_in_place);
    comm::launch_combine(l, stream);
    ws->check();
    out.slots.push_back(download(reinterpret_cast<const uint16_t*>(st.slots()), slot_elems));
    MOK_CUDA_CHECK(cudaMemsetAsync(y, 0xFF, d_y.bytes(), stream));
    st.epilogue(d_w.get(), shared, v.own_rows_in_place ? expert_out : nullptr, y, stream);
    ws->check();
    out.ys.push_back(download(d_y.get(), d_y.size()));
  }
  MOK_CUDA_CHECK(cudaMemsetAsync(y, 0xFF, d_y.bytes(), stream));
  st.epilogue(d_w.get(), shared, combine_variants().back().own_rows_in_place ? expert_out : nullptr, y, stream);
  ws->check();
  out.y_again = download(d_y.get(), d_y.size());
  MOK_CUDA_CHECK(cudaStreamSynchronize(stream));
  sync_ranks();  // nobody tears its window down while a peer may still touch it
  ws.reset();
  return out;
}

// ---- verification ---------------------------------------------------------------------------------
// Index of the first differing element, or -1.
template <class T>
int64_t first_mismatch(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return static_cast<int64_t>(i);
  }
  return -1;
}

inline void expect_schedule(const CommCase& c, const ref::Schedule& ref,
                            const std::vector<std::vector<int32_t>>& routing, int r, const RankOutputs& o) {
  const LayerShape& s = c.shape;
  const ref::RankSchedule& rs = ref.ranks[r];
  const std::string who = c.name + " rank " + std::to_string(r);
  ASSERT_EQ(o.header.status, 0) << who;
  EXPECT_EQ(o.header.real_rows, rs.real_rows) << who;
  ASSERT_EQ(o.header.padded_rows, rs.padded_rows) << who;
  EXPECT_EQ(first_mismatch(o.offset, rs.expert_offset), -1) << who << ": expert_offset";
  EXPECT_EQ(first_mismatch(o.count, rs.expert_rows), -1) << who << ": expert_rows";
  for (int64_t i = 0; i < static_cast<int64_t>(o.rows.size()); ++i) {
    const comm::RowEntry& g = o.rows[i];
    const ref::RowRef want = i < rs.padded_rows ? rs.rows[i] : ref::RowRef{};
    if (g.src_rank != want.src_rank || g.token != want.token || g.k != want.k) {
      ADD_FAILURE() << who << ": first mismatching row " << i << ": GPU (" << g.src_rank << ", " << g.token << ", "
                    << g.k << "), reference (" << want.src_rank << ", " << want.token << ", " << want.k << ")";
      break;
    }
  }
  EXPECT_EQ(first_mismatch(o.rows, o.rows_again), -1) << who << ": schedule not bitwise repeatable";
  // The in-place combine's work list: this rank's rows of other ranks' tokens, increasing.
  std::vector<int32_t> remote;
  for (int64_t i = 0; i < rs.padded_rows; ++i) {
    if (!rs.rows[i].is_padding() && rs.rows[i].src_rank != r) remote.push_back(static_cast<int32_t>(i));
  }
  EXPECT_EQ(first_mismatch(o.remote_rows, remote), -1) << who << ": remote_rows (" << o.remote_rows.size() << " vs "
                                                       << remote.size() << " expected)";
  // dest_row: this rank's row of every source entry; -1 where another rank owns the expert.
  for (int src = 0; src < s.ep; ++src) {
    for (int64_t j = 0; j < s.tokens * s.topk; ++j) {
      const bool ours = s.owner_rank(routing[src][j]) == r;
      const int64_t want = ours ? ref.dest_row[src][j] : -1;
      const int32_t got = o.dest[src * s.tokens * s.topk + j];
      if (got != want) {
        ADD_FAILURE() << who << ": dest_row[src " << src << "][" << j << "] = " << got << ", expected " << want;
        return;
      }
    }
  }
  // Minibatch ranges and dedup links follow from the reference rows.
  const int64_t mb = c.config.effective_minibatch(s);
  const int64_t max_mb = static_cast<int64_t>(o.mb.size() / 3);
  for (int64_t m = 0; m < max_mb; ++m) {
    const int64_t begin = std::min(m * mb, rs.padded_rows), end = std::min(begin + mb, rs.padded_rows);
    int64_t real = 0;
    for (int64_t i = begin; i < end; ++i) real += rs.rows[i].is_padding() ? 0 : 1;
    EXPECT_EQ(o.mb[m], begin) << who << ": minibatch " << m << " begin";
    EXPECT_EQ(o.mb[max_mb + m], end) << who << ": minibatch " << m << " end";
    EXPECT_EQ(o.mb[2 * max_mb + m], real) << who << ": minibatch " << m << " real rows";
  }
  EXPECT_EQ(o.header.num_minibatches, (rs.padded_rows + mb - 1) / mb) << who;
  // Token keys (the fused top-k sum's order): the largest local expert index of each own token.
  ASSERT_EQ(static_cast<int64_t>(o.token_key.size()), s.tokens) << who;
  for (int64_t t = 0; t < s.tokens; ++t) {
    int32_t want = 0;
    for (int k = 0; k < s.topk; ++k) {
      want = std::max(want, static_cast<int32_t>(routing[r][t * s.topk + k] % s.local_experts()));
    }
    if (o.token_key[t] != want) {
      ADD_FAILURE() << who << ": token_key[" << t << "] = " << o.token_key[t] << ", expected " << want;
      break;
    }
  }
  std::vector<int32_t> order(static_cast<size_t>(s.tokens));
  for (int64_t t = 0; t < s.tokens; ++t) order[t] = static_cast<int32_t>(t);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return o.token_key[a] < o.token_key[b]; });
  EXPECT_EQ(first_mismatch(o.token_order, order), -1) << who << ": token_order (tokens by increasing key, stable)";
  // Dedup link: the token's first row on this rank (lowest local expert), -1 for that row itself.
  for (int64_t i = 0; i < rs.padded_rows; ++i) {
    const ref::RowRef& row = rs.rows[i];
    int64_t first = i;
    if (!row.is_padding()) {
      for (int k = 0; k < s.topk; ++k) {
        const int64_t j = static_cast<int64_t>(row.token) * s.topk + k;
        if (s.owner_rank(routing[row.src_rank][j]) == r) first = std::min(first, ref.dest_row[row.src_rank][j]);
      }
    }
    const int32_t want = row.is_padding() || first == i ? -1 : static_cast<int32_t>(first);
    if (o.rows[i].copy_from != want) {
      ADD_FAILURE() << who << ": row " << i << " copy_from " << o.rows[i].copy_from << ", expected " << want;
      break;
    }
  }
}

inline void expect_data(const CommCase& c, const ref::Schedule& ref, const std::vector<RankInputs>& in,
                        int r, const RankOutputs& o) {
  const LayerShape& s = c.shape;
  const int64_t H = s.hidden;
  const ref::RankSchedule& rs = ref.ranks[r];
  const std::string who = c.name + " rank " + std::to_string(r);
  // Dispatch: row i holds x_src[token] bits, padding rows are zero.
  std::vector<uint16_t> want(rs.padded_rows * H, 0);
  for (int64_t i = 0; i < rs.padded_rows; ++i) {
    const ref::RowRef& row = rs.rows[i];
    if (!row.is_padding()) std::memcpy(&want[i * H], &in[row.src_rank].x[row.token * H], H * 2);
  }
  for (size_t v = 0; v < o.dispatched.size(); ++v) {
    const int64_t bad = first_mismatch(o.dispatched[v], want);
    EXPECT_EQ(bad, -1) << who << ": dispatch variant (ctas " << dispatch_variants()[v].ctas << ", dedup "
                       << dispatch_variants()[v].dedup << ") first mismatch at row " << bad / H << " col " << bad % H;
  }
  // Combine: slot (t, k) of rank r holds the owner's expert output row dest_row[r][t*K+k].
  std::vector<uint16_t> slots(s.tokens * s.topk * H);
  for (int64_t j = 0; j < s.tokens * s.topk; ++j) {
    const int owner = s.owner_rank(in[r].topk[j]);
    std::memcpy(&slots[j * H], &in[owner].expert_out[ref.dest_row[r][j] * H], H * 2);
  }
  // In place: the own rank's slots are never written (still the 0xFFFF poison).
  std::vector<uint16_t> slots_in_place = slots;
  for (int64_t j = 0; j < s.tokens * s.topk; ++j) {
    if (s.owner_rank(in[r].topk[j]) == r) std::fill_n(&slots_in_place[j * H], H, uint16_t{0xFFFF});
  }
  for (size_t v = 0; v < o.slots.size(); ++v) {
    const CombineVariant& cv = combine_variants()[v];
    const int64_t bad = first_mismatch(o.slots[v], cv.own_rows_in_place ? slots_in_place : slots);
    EXPECT_EQ(bad, -1) << who << ": combine variant (ctas " << cv.ctas << ", own rows in place "
                       << cv.own_rows_in_place << ") first mismatch at slot " << bad / H << " col " << bad % H;
  }
  // Epilogue (docs/numerics.md): acc = shared or 0; acc = fmaf(w, slot, acc) for k = 0..K-1.
  std::vector<uint16_t> y(s.tokens * H);
  for (int64_t t = 0; t < s.tokens; ++t) {
    for (int64_t j = 0; j < H; ++j) {
      float acc = c.with_shared ? ref::from_bf16(in[r].shared[t * H + j]) : 0.0f;
      for (int k = 0; k < s.topk; ++k) {
        acc = std::fmaf(in[r].w[t * s.topk + k], ref::from_bf16(slots[(t * s.topk + k) * H + j]), acc);
      }
      y[t * H + j] = ref::to_bf16(acc);
    }
  }
  for (size_t v = 0; v < o.ys.size(); ++v) {
    const int64_t bad = first_mismatch(o.ys[v], y);
    EXPECT_EQ(bad, -1) << who << ": epilogue after combine variant " << v << " (own rows in place "
                       << combine_variants()[v].own_rows_in_place << ") first mismatch at token " << bad / H
                       << " col " << bad % H;
  }
  ASSERT_FALSE(o.ys.empty()) << who;
  EXPECT_EQ(first_mismatch(o.ys.back(), o.y_again), -1) << who << ": epilogue not bitwise repeatable";
}

}  // namespace mok::test
