// The unique-id channels of launch mode (b) without GPUs: forked "ranks" run
// bootstrap::share_unique_id through the TCP exchange and through a file, and must all end up
// with rank 0's id. (The CUDA runtime is never touched, so fork() is safe.)
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "mok/bootstrap.hpp"

namespace mok::test {
namespace {

// Forks `world` processes with torchrun-like environments; returns the id bytes each got.
std::vector<std::string> ids_from_forked_ranks(int world, int port, const char* id_file) {
  std::vector<int> fds(world);
  std::vector<pid_t> pids(world);
  for (int r = 0; r < world; ++r) {
    int p[2];
    if (::pipe(p) != 0) return {};
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(p[0]);
      ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port - 1).c_str(), 1);
      ::setenv("MOK_BOOTSTRAP_TIMEOUT_S", "30", 1);
      ::unsetenv("NCCL_COMM_ID");
      if (id_file != nullptr) ::setenv("MOK_UNIQUE_ID_FILE", id_file, 1); else ::unsetenv("MOK_UNIQUE_ID_FILE");
      int code = 1;
      try {
        const auto env = bootstrap::dist_env();
        const ncclUniqueId id = bootstrap::share_unique_id(*env);
        code = ::write(p[1], id.internal, sizeof(id.internal)) == sizeof(id.internal) ? 0 : 2;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
      }
      ::_exit(code);
    }
    ::close(p[1]);
    fds[r] = p[0];
    pids[r] = pid;
  }
  std::vector<std::string> ids(world);
  for (int r = 0; r < world; ++r) {
    char buf[NCCL_UNIQUE_ID_BYTES];
    size_t got = 0;
    while (got < sizeof(buf)) {
      const ssize_t k = ::read(fds[r], buf + got, sizeof(buf) - got);
      if (k <= 0) break;
      got += static_cast<size_t>(k);
    }
    ids[r].assign(buf, got);
    ::close(fds[r]);
    int status = 0;
    ::waitpid(pids[r], &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "rank " << r << " failed";
  }
  return ids;
}

void expect_same_ids(const std::vector<std::string>& ids) {
  ASSERT_FALSE(ids.empty());
  ASSERT_EQ(ids[0].size(), static_cast<size_t>(NCCL_UNIQUE_ID_BYTES));
  for (size_t r = 1; r < ids.size(); ++r) EXPECT_EQ(ids[r], ids[0]) << "rank " << r << " got another id";
}

TEST(CommBootstrap, UniqueIdThroughTcp) {
  const int port = 20000 + static_cast<int>(::getpid() % 20000);
  expect_same_ids(ids_from_forked_ranks(3, port, nullptr));
}

TEST(CommBootstrap, UniqueIdThroughFile) {
  const std::string path = "/tmp/mok_uid_test_" + std::to_string(::getpid());
  std::remove(path.c_str());
  expect_same_ids(ids_from_forked_ranks(3, 29999, path.c_str()));
  std::remove(path.c_str());
}

TEST(CommBootstrap, EnvironmentIsParsed) {
  ::setenv("WORLD_SIZE", "4", 1);
  ::setenv("RANK", "2", 1);
  ::setenv("LOCAL_RANK", "1", 1);
  ::setenv("MASTER_ADDR", "10.0.0.7", 1);
  ::setenv("MASTER_PORT", "1234", 1);
  const auto e = bootstrap::dist_env();
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->world_size, 4);
  EXPECT_EQ(e->rank, 2);
  EXPECT_EQ(e->local_rank, 1);
  EXPECT_EQ(e->master_addr, "10.0.0.7");
  EXPECT_EQ(e->master_port, 1234);
  ::setenv("RANK", "4", 1);
  EXPECT_THROW(bootstrap::dist_env(), Error);
  for (const char* v : {"WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}) ::unsetenv(v);
  EXPECT_FALSE(bootstrap::dist_env().has_value());
}

}  // namespace
}  // namespace mok::test
