// parallel_for and the blocked sequential-order matrix product (see dense.hpp).
#include "reference/dense.hpp"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>

namespace mok::ref::detail {

int resolve_threads(int threads) {
  if (threads > 0) return threads;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(std::min(hw, 64u));
}

void parallel_for(int64_t count, int threads, const std::function<void(int64_t)>& body) {
  const int64_t workers = std::min<int64_t>(resolve_threads(threads), count);
  if (workers <= 1) {
    for (int64_t i = 0; i < count; ++i) body(i);
    return;
  }
  // Dynamic hand-out is safe: an item's result does not depend on which thread runs it.
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto worker = [&] {
    for (int64_t i = next++; i < count; i = next++) {
      try {
        body(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        next = count;
      }
    }
  };
  std::vector<std::thread> pool;
  for (int64_t w = 1; w < workers; ++w) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

namespace {

constexpr int64_t kBlockRows = 16;   // independent chains per column in the inner kernel
constexpr int64_t kBlockCols = 64;   // columns per task (the A block is packed once per task)

// Packs rows [m0, m0 + 16) of A as at[k*16 + r] (rows past M are zero and never stored).
template <class Real>
void pack_rows(MatRef<Real> a, int64_t m0, int64_t M, int64_t K, std::vector<Real>& at) {
  at.assign(static_cast<size_t>(K * kBlockRows), Real(0));
  const int64_t rows = std::min(kBlockRows, M - m0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < K; ++k) at[k * kBlockRows + r] = a.at(m0 + r, k);
  }
}

// Two output columns of one row block: 32 independent sequential chains.
template <class Real>
void kernel_2cols(const Real* at, int64_t K, const Real* b0, const Real* b1, Real* s0, Real* s1) {
  Real acc0[kBlockRows] = {};
  Real acc1[kBlockRows] = {};
  for (int64_t k = 0; k < K; ++k) {
    const Real* a = at + k * kBlockRows;
    const Real x0 = b0[k];
    const Real x1 = b1[k];
    for (int64_t r = 0; r < kBlockRows; ++r) {
      acc0[r] += x0 * a[r];
      acc1[r] += x1 * a[r];
    }
  }
  std::copy(acc0, acc0 + kBlockRows, s0);
  std::copy(acc1, acc1 + kBlockRows, s1);
}

}  // namespace

template <class Real>
void gemm_nt(MatRef<Real> a, const Real* b, int64_t ldb, Real* c, int64_t ldc, int64_t M,
             int64_t N, int64_t K, int threads) {
  if (M <= 0 || N <= 0) return;
  const int64_t row_blocks = (M + kBlockRows - 1) / kBlockRows;
  const int64_t col_blocks = (N + kBlockCols - 1) / kBlockCols;
  parallel_for(row_blocks * col_blocks, threads, [&](int64_t task) {
    const int64_t m0 = (task / col_blocks) * kBlockRows;
    const int64_t n0 = (task % col_blocks) * kBlockCols;
    const int64_t n1 = std::min(N, n0 + kBlockCols);
    const int64_t rows = std::min(kBlockRows, M - m0);
    thread_local std::vector<Real> at;
    pack_rows(a, m0, M, K, at);
    Real s0[kBlockRows], s1[kBlockRows];
    for (int64_t n = n0; n < n1; n += 2) {
      const bool pair = n + 1 < n1;
      // An odd last column runs its chains twice; only the first copy is stored.
      kernel_2cols(at.data(), K, b + n * ldb, b + (pair ? n + 1 : n) * ldb, s0, s1);
      for (int64_t r = 0; r < rows; ++r) {
        c[(m0 + r) * ldc + n] = s0[r];
        if (pair) c[(m0 + r) * ldc + n + 1] = s1[r];
      }
    }
  });
}

template <class Real>
std::vector<Real> transpose(const Real* src, int64_t rows, int64_t cols, int64_t ld) {
  std::vector<Real> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = src[r * ld + c];
  }
  return out;
}

template void gemm_nt<float>(MatRef<float>, const float*, int64_t, float*, int64_t, int64_t,
                             int64_t, int64_t, int);
template void gemm_nt<double>(MatRef<double>, const double*, int64_t, double*, int64_t, int64_t,
                              int64_t, int64_t, int);
template std::vector<float> transpose<float>(const float*, int64_t, int64_t, int64_t);
template std::vector<double> transpose<double>(const double*, int64_t, int64_t, int64_t);

}  // namespace mok::ref::detail
