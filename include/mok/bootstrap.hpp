// Launch helpers: how mok gets its NCCL communicator (docs/comm.md, "Launch modes").
//
// (a) One process drives every local GPU, one thread per GPU (the `mok` program, GPU tests):
//
//       mok::bootstrap::run_local_ranks(mok::bootstrap::all_local_devices(), [&](mok::bootstrap::LocalRank& r) {
//         auto ws = mok::Workspace::create(shape, cfg, r.comm, r.device);  // on r's own thread
//         ...
//       });
//
// (b) One process per GPU, started by torchrun (how PyTorch users run):
//
//       auto dist = mok::bootstrap::init_from_env();   // RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT
//       auto ws = mok::Workspace::create(shape, cfg, dist->comm, dist->device);
//
//     The NCCL unique id travels, in this order of preference, through
//       - NCCL_COMM_ID=host:port   (NCCL itself derives the id on every rank; rank 0 hosts the root),
//       - MOK_UNIQUE_ID_FILE=path  (rank 0 writes the id to a file on a shared filesystem, others poll),
//       - a small TCP exchange: rank 0 listens on MASTER_ADDR:MOK_BOOTSTRAP_PORT (default
//         MASTER_PORT + 1: torchrun's own store already holds MASTER_PORT) and sends the id.
//     Waiting for peers gives up after MOK_BOOTSTRAP_TIMEOUT_S seconds (default 300).
//     Inside a PyTorch program, broadcast the id with torch.distributed instead and call
//     ncclCommInitRank yourself (the python layer does).
//
// Header-only (POSIX sockets), so it works with the static and the shared library alike.
#pragma once

#include <arpa/inet.h>
#include <sys/select.h>
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <nccl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "mok/error.hpp"

namespace mok::bootstrap {

namespace detail {

inline void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(Status::kCudaError, std::string(what) + ": " + cudaGetErrorString(e));
}
inline void nccl_ok(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw Error(Status::kNcclError, std::string(what) + ": " + ncclGetErrorString(r));
}
inline std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}
inline int env_int(const char* name, int fallback) {
  const auto v = env(name);
  if (!v) return fallback;
  char* end = nullptr;
  const long x = std::strtol(v->c_str(), &end, 10);
  if (end == v->c_str() || *end != '\0') throw_invalid(std::string("environment variable ") + name, "an integer", *v);
  return static_cast<int>(x);
}
inline std::chrono::steady_clock::time_point deadline() {
  return std::chrono::steady_clock::now() + std::chrono::seconds(env_int("MOK_BOOTSTRAP_TIMEOUT_S", 300));
}

// Owns a socket descriptor.
struct Socket {
  int fd = -1;
  explicit Socket(int f = -1) : fd(f) {}
  ~Socket() {
    if (fd >= 0) ::close(fd);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
};

inline void send_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k <= 0) throw Error(Status::kNcclError, "mok bootstrap: send of the NCCL unique id failed");
    p += k;
    n -= static_cast<size_t>(k);
  }
}
inline void recv_all(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t k = ::recv(fd, p, n, 0);
    if (k <= 0) throw Error(Status::kNcclError, "mok bootstrap: receiving the NCCL unique id failed");
    p += k;
    n -= static_cast<size_t>(k);
  }
}

inline constexpr char kMagic[8] = {'m', 'o', 'k', '-', 'u', 'i', 'd', '1'};

}  // namespace detail

// ---- (a) one process, one thread per local GPU ------------------------------------------------

struct LocalRank {
  int rank = 0;
  int world_size = 1;
  int device = 0;
  ncclComm_t comm = nullptr;
};

inline int local_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver / no device: not an error here
    return 0;
  }
  return n;
}

inline std::vector<int> all_local_devices() {
  std::vector<int> d(local_device_count());
  for (size_t i = 0; i < d.size(); ++i) d[i] = static_cast<int>(i);
  return d;
}

// Rank i drives devices[i] on its own thread: cudaSetDevice, ncclCommInitRank (all threads at
// once, as NCCL requires), fn(rank), ncclCommDestroy. Rethrows the first exception after every
// thread ended (a failed rank aborts its communicator so the others do not block in NCCL).
template <class Fn>
void run_local_ranks(const std::vector<int>& devices, Fn&& fn) {
  const int n = static_cast<int>(devices.size());
  if (n < 1) throw_invalid("devices", "at least one CUDA device", "none");
  ncclUniqueId id;
  detail::nccl_ok(ncclGetUniqueId(&id), "ncclGetUniqueId");
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      LocalRank lr{r, n, devices[r], nullptr};
      try {
        detail::cuda_ok(cudaSetDevice(lr.device), "cudaSetDevice");
        detail::nccl_ok(ncclCommInitRank(&lr.comm, n, id, r), "ncclCommInitRank");
        fn(lr);
        detail::nccl_ok(ncclCommDestroy(lr.comm), "ncclCommDestroy");
      } catch (...) {
        if (lr.comm != nullptr) ncclCommAbort(lr.comm);
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

// ---- (b) one process per GPU (torchrun) -------------------------------------------------------

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
};

// The torchrun environment, or nothing when WORLD_SIZE is not set.
inline std::optional<DistEnv> dist_env() {
  if (!detail::env("WORLD_SIZE")) return std::nullopt;
  DistEnv e;
  e.world_size = detail::env_int("WORLD_SIZE", 1);
  e.rank = detail::env_int("RANK", 0);
  e.local_rank = detail::env_int("LOCAL_RANK", e.rank);
  e.master_addr = detail::env("MASTER_ADDR").value_or("127.0.0.1");
  e.master_port = detail::env_int("MASTER_PORT", 29500);
  if (e.world_size < 1 || e.rank < 0 || e.rank >= e.world_size) {
    throw_invalid("RANK / WORLD_SIZE", "0 <= RANK < WORLD_SIZE",
                  std::to_string(e.rank) + " / " + std::to_string(e.world_size));
  }
  return e;
}

namespace detail {

inline ncclUniqueId id_through_file(const DistEnv& e, const std::string& path) {
  ncclUniqueId id;
  if (e.rank == 0) {
    nccl_ok(ncclGetUniqueId(&id), "ncclGetUniqueId");
    const std::string tmp = path + ".tmp" + std::to_string(::getpid());
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      out.write(kMagic, sizeof(kMagic));
      out.write(id.internal, sizeof(id.internal));
      if (!out) throw Error(Status::kNcclError, "mok bootstrap: cannot write " + tmp);
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {  // atomic: readers never see half a file
      throw Error(Status::kNcclError, "mok bootstrap: cannot rename " + tmp + " to " + path);
    }
    return id;
  }
  const auto until = deadline();
  for (;;) {
    std::ifstream in(path, std::ios::binary);
    char magic[sizeof(kMagic)] = {};
    if (in.read(magic, sizeof(magic)) && std::memcmp(magic, kMagic, sizeof(kMagic)) == 0 &&
        in.read(id.internal, sizeof(id.internal))) {
      return id;
    }
    if (std::chrono::steady_clock::now() > until) {
      throw Error(Status::kTimeout, "mok bootstrap: rank " + std::to_string(e.rank) + " found no unique id in " +
                                        path + " before MOK_BOOTSTRAP_TIMEOUT_S");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

inline ncclUniqueId id_through_tcp(const DistEnv& e) {
  const int port = env_int("MOK_BOOTSTRAP_PORT", e.master_port + 1);
  ncclUniqueId id;
  const auto until = deadline();
  if (e.rank == 0) {
    nccl_ok(ncclGetUniqueId(&id), "ncclGetUniqueId");
    Socket server(::socket(AF_INET, SOCK_STREAM, 0));
    if (server.fd < 0) throw Error(Status::kNcclError, "mok bootstrap: socket() failed");
    const int one = 1;
    ::setsockopt(server.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    if (::bind(server.fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(server.fd, 128) != 0) {
      throw Error(Status::kNcclError, "mok bootstrap: rank 0 cannot listen on port " + std::to_string(port) +
                                          " (set MOK_BOOTSTRAP_PORT to a free port): " + std::strerror(errno));
    }
    for (int served = 1; served < e.world_size;) {
      timeval tv{1, 0};
      fd_set set;
      FD_ZERO(&set);
      FD_SET(server.fd, &set);
      if (::select(server.fd + 1, &set, nullptr, nullptr, &tv) > 0) {
        Socket peer(::accept(server.fd, nullptr, nullptr));
        if (peer.fd < 0) continue;
        send_all(peer.fd, kMagic, sizeof(kMagic));
        send_all(peer.fd, id.internal, sizeof(id.internal));
        char ack = 0;
        recv_all(peer.fd, &ack, 1);  // the peer holds the id: it may now close
        ++served;
      } else if (std::chrono::steady_clock::now() > until) {
        throw Error(Status::kTimeout, "mok bootstrap: rank 0 served " + std::to_string(served - 1) + " of " +
                                          std::to_string(e.world_size - 1) + " ranks before MOK_BOOTSTRAP_TIMEOUT_S");
      }
    }
    return id;
  }
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(e.master_addr.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || found == nullptr) {
    throw_invalid("MASTER_ADDR", "a resolvable IPv4 host name or address", e.master_addr);
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(found, &::freeaddrinfo);
  for (;;) {
    Socket s(::socket(AF_INET, SOCK_STREAM, 0));
    if (s.fd >= 0 && ::connect(s.fd, found->ai_addr, found->ai_addrlen) == 0) {
      char magic[sizeof(kMagic)];
      recv_all(s.fd, magic, sizeof(magic));
      if (std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) {
        throw Error(Status::kNcclError, "mok bootstrap: unexpected reply from " + e.master_addr + ":" +
                                            std::to_string(port) + " (another service on MOK_BOOTSTRAP_PORT?)");
      }
      recv_all(s.fd, id.internal, sizeof(id.internal));
      const char ack = 1;
      send_all(s.fd, &ack, 1);
      return id;
    }
    if (std::chrono::steady_clock::now() > until) {
      throw Error(Status::kTimeout, "mok bootstrap: rank " + std::to_string(e.rank) + " could not reach rank 0 at " +
                                        e.master_addr + ":" + std::to_string(port) + " before MOK_BOOTSTRAP_TIMEOUT_S");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

}  // namespace detail

// The same NCCL unique id on every rank (see the header comment for the three channels).
inline ncclUniqueId share_unique_id(const DistEnv& e) {
  if (detail::env("NCCL_COMM_ID")) {
    ncclUniqueId id;  // NCCL encodes NCCL_COMM_ID in the id; every rank computes the same one
    detail::nccl_ok(ncclGetUniqueId(&id), "ncclGetUniqueId (NCCL_COMM_ID)");
    return id;
  }
  if (const auto path = detail::env("MOK_UNIQUE_ID_FILE")) return detail::id_through_file(e, *path);
  return detail::id_through_tcp(e);
}

// This process's rank: device LOCAL_RANK, communicator over WORLD_SIZE ranks.
struct DistComm {
  DistEnv env;
  int device = 0;
  ncclComm_t comm = nullptr;
  DistComm() = default;
  DistComm(const DistComm&) = delete;
  DistComm& operator=(const DistComm&) = delete;
  ~DistComm() {
    if (comm != nullptr) ncclCommDestroy(comm);
  }
};

inline std::unique_ptr<DistComm> init_from_env() {
  const auto e = dist_env();
  if (!e) {
    throw_invalid("WORLD_SIZE", "set by the launcher (torchrun) together with RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT",
                  "unset");
  }
  auto d = std::make_unique<DistComm>();
  d->env = *e;
  d->device = e->local_rank;
  detail::cuda_ok(cudaSetDevice(d->device), "cudaSetDevice(LOCAL_RANK)");
  const ncclUniqueId id = share_unique_id(*e);
  detail::nccl_ok(ncclCommInitRank(&d->comm, e->world_size, id, e->rank), "ncclCommInitRank");
  return d;
}

}  // namespace mok::bootstrap
