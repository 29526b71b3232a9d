// Dense building blocks of the CPU reference: a thread pool-free parallel_for and the one
// matrix product every GEMM of the layer is expressed with.
//
// gemm_nt computes C[m][n] = sum_k A(m, k) * B[n][k] with ONE accumulator per output
// element, starting at +0 and adding the products in k order 0, 1, ..., K-1 (the "sequential
// fp32 sum" of docs/numerics.md). The implementation runs 16 rows x 2 columns of such chains
// side by side (SIMD across independent chains, never across k), so the bits of an element do
// not depend on the blocking, the thread count or the other rows of the call.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace mok::ref::detail {

// threads <= 0: one per hardware thread.
int resolve_threads(int threads);

// Runs body(i) for every i in [0, count) on up to `threads` threads. Items must be
// independent (each writes its own outputs); an exception in any item is rethrown.
void parallel_for(int64_t count, int threads, const std::function<void(int64_t)>& body);

// Read-only view of an M x K operand: element (m, k) is data[m*ld + k], or data[k*ld + m]
// when `transposed` (the matrix is stored as its K x M transpose).
template <class Real>
struct MatRef {
  const Real* data = nullptr;
  int64_t ld = 0;
  bool transposed = false;
  Real at(int64_t m, int64_t k) const { return transposed ? data[k * ld + m] : data[m * ld + k]; }
};

// C[m*ldc + n] = sum over k in order of a(m, k) * b[n*ldb + k], for m < M, n < N.
template <class Real>
void gemm_nt(MatRef<Real> a, const Real* b, int64_t ldb, Real* c, int64_t ldc, int64_t M,
             int64_t N, int64_t K, int threads);

// [cols, rows] transpose of a row-major [rows, cols] matrix with leading dimension ld.
template <class Real>
std::vector<Real> transpose(const Real* src, int64_t rows, int64_t cols, int64_t ld);

}  // namespace mok::ref::detail
