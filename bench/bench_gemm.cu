// Benchmark of the grouped GEMM engine (src/gemm) on the three model shapes (mok::dsv3_shape, qwen3_shape, gptoss_shape),
// uniform, skewed and random (uniform random top-k routing) expert segments, side by side with
// cuBLAS in the same run:
//   - cuBLAS dense bf16 GEMM (fp32 compute) of the same FLOPs (one big TN GEMM), and
//   - a cuBLAS grouped baseline: one cublasGemmEx per expert segment.
// TFLOP/s count useful FLOPs (real rows only). CUDA events, warm-up, median of repeats,
// random non-zero inputs. Usage: bench_gemm [--shape dsv3|qwen3|gptoss|all] [--reps N]
//                                           [--json FILE] [--commit STR] [--quick]
//                                           [--segments uniform,skewed,random]
//                                           [--warm-ms MS (300; --quick 50)] [--series]
#include <cublas_v2.h>
#include <cuda_runtime.h>

#ifdef MOK_GEMM_TRACE
#include "gemm/gemm_host.hpp"
#include "gemm/sm90_pipeline.cuh"
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "gemm/grouped_gemm.hpp"
#include "gemm/grouped_gemm_fp8.hpp"

namespace {

using mok::gemm::bf16;

#define CK(x)                                                                            \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)
#define CB(x)                                                                            \
  do {                                                                                   \
    cublasStatus_t s_ = (x);                                                             \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                   \
      std::fprintf(stderr, "%s:%d %s: cublas status %d\n", __FILE__, __LINE__, #x, int(s_)); \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

struct ModelShape {
  const char* name;
  int64_t H, I;
  int E;         // local experts
  int64_t rows;  // routed rows on the rank (T * top-k)
  int ep;
  int topk;
};
const ModelShape kShapes[] = {
    {"dsv3", 7168, 2048, 128, 8192 * 8, 2, 8},
    {"qwen3", 2048, 768, 64, 16384 * 8, 2, 8},
    {"gptoss", 2880, 2880, 64, 8192 * 4, 2, 4},
};

enum class SegMode { kUniform, kSkewed, kRandom };
const char* seg_name(SegMode m) {
  return m == SegMode::kUniform ? "uniform" : m == SegMode::kSkewed ? "skewed" : "random";
}

__global__ void fill_random(bf16* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 16; h *= 0x7feb352du; h ^= h >> 15; h *= 0x846ca68bu; h ^= h >> 16;
    const float u = (h >> 8) * (1.0f / 16777216.0f);  // [0, 1)
    p[i] = __float2bfloat16((2.0f * u - 1.0f) * scale);
  }
}

// Random finite e4m3 codes (never 0x7F / 0xFF, the NaNs) and power-of-two scales in [2^-4, 2^3].
__global__ void fill_e4m3(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 16; h *= 0x7feb352du; h ^= h >> 15;
    p[i] = static_cast<uint8_t>((h & 0x80u) | ((h >> 8) % 0x7Fu));
  }
}
__global__ void fill_scales(float* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t h = (static_cast<uint32_t>(i) * 2654435761u ^ seed) >> 13;
    p[i] = ldexpf(1.0f, static_cast<int>(h % 8u) - 4);
  }
}

template <class T>
T* dalloc(size_t n) {
  T* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return p;
}

void randomize(bf16* p, size_t n, uint32_t seed, float scale) {
  fill_random<<<1024, 256>>>(p, n, seed, scale);
  CK(cudaGetLastError());
}

// Real rows per expert: uniform (exactly rows/E: no padding at dsv3), skewed (weights 1/(e+1),
// i.e. Zipf s=1, so the largest expert gets ~E/ln(E) times the mean), or random: the rows this
// rank's E experts receive when every token of all ep ranks picks top-k distinct experts of
// E*ep uniformly at random (fixed seed; the forward bench's routing, ~12 % padding at dsv3).
std::vector<int> segment_rows(const ModelShape& s, SegMode mode) {
  std::vector<int> r(s.E, static_cast<int>(s.rows / s.E));
  if (mode == SegMode::kRandom) {
    std::mt19937 rng(12345);
    const int global = s.E * s.ep;
    std::uniform_int_distribution<int> pick(0, global - 1);
    std::fill(r.begin(), r.end(), 0);
    const int64_t tokens = s.rows / s.topk * s.ep;
    std::vector<int> chosen;
    for (int64_t t = 0; t < tokens; ++t) {
      chosen.clear();
      while (static_cast<int>(chosen.size()) < s.topk) {
        const int e = pick(rng);
        if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
      }
      for (int e : chosen)
        if (e < s.E) ++r[e];
    }
  }
  if (mode == SegMode::kSkewed) {
    double z = 0;
    for (int e = 0; e < s.E; ++e) z += 1.0 / (e + 1);
    int64_t given = 0;
    for (int e = 0; e < s.E; ++e) given += r[e] = static_cast<int>(s.rows / z / (e + 1));
    r[0] += static_cast<int>(s.rows - given);
  }
  return r;
}

// Steady state: the H200 lowers its SM clock under sustained tensor load (1.98 GHz idle, 1.3-1.6
// GHz under these kernels), with a lag of tens of milliseconds, so a kernel timed right after a
// lighter one runs faster than it would in a training step. Every measurement therefore first
// runs its own kernel for g_warm_ms (after 2 warm-up launches), ours and cuBLAS alike.
double g_warm_ms = 300.0;
bool g_series = false;  // developer: print the launch times of the warm-up and the timed reps

float median_ms(const std::function<void()>& fn, int reps, cudaStream_t stream) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  auto timed = [&] {
    CK(cudaEventRecord(a, stream));
    fn();
    CK(cudaEventRecord(b, stream));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    return ms;
  };
  std::vector<float> warm;
  double warm_total = 0;
  for (int i = 0; i < 2 || warm_total < g_warm_ms; ++i) {
    warm.push_back(timed());
    warm_total += warm.back();
  }
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) t.push_back(timed());
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  if (g_series) {
    std::string line;
    const size_t step = std::max<size_t>(1, warm.size() / 12);
    for (size_t i = 0; i < warm.size(); i += step) line += " " + std::to_string(warm[i]).substr(0, 6);
    line += " |";
    for (float v : t) line += " " + std::to_string(v).substr(0, 6);
    std::printf("series (%zu warm-up launches, every %zu-th | timed):%s\n", warm.size(), step, line.c_str());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Row-major C[M,N] = A[M,K] . B[N,K]^T in bf16 with fp32 compute (cuBLAS "TN").
void cublas_tn(cublasHandle_t h, int64_t M, int64_t N, int64_t K, const bf16* A, const bf16* B, bf16* C) {
  const float one = 1.0f, zero = 0.0f;
  CB(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(N), int(M), int(K), &one, B, CUDA_R_16BF, int(K), A,
                  CUDA_R_16BF, int(K), &zero, C, CUDA_R_16BF, int(N), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

struct Result {
  std::string kind;
  double flops;
  float ms;
  float dense_ms;    // cuBLAS dense, equal FLOPs
  float grouped_ms;  // cuBLAS per-expert loop (0 = not run)
};

struct Bench {
  const ModelShape& s;
  SegMode mode;
  int reps;
  cudaStream_t stream;
  cublasHandle_t blas;
  std::vector<int> rows;
  std::vector<int32_t> off;
  int64_t R = 0, real = 0;
  mok::gemm::Segments seg;
  uint32_t* d_err = nullptr;

  void setup() {
    rows = segment_rows(s, mode);
    off.assign(1, 0);
    for (int e = 0; e < s.E; ++e) off.push_back(off.back() + (rows[e] + 127) / 128 * 128);
    R = off.back();
    real = 0;
    for (int r : rows) real += r;
    int32_t* d_off = dalloc<int32_t>(s.E + 1);
    int32_t* d_rows = dalloc<int32_t>(s.E);
    CK(cudaMemcpy(d_off, off.data(), off.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_rows, rows.data(), rows.size() * 4, cudaMemcpyHostToDevice));
    seg = {d_off, d_rows, s.E, R};
    d_err = dalloc<uint32_t>(1);
    CK(cudaMemset(d_err, 0, 4));
  }
  // Padding rows of row inputs are zero by contract.
  void zero_padding(bf16* p, int64_t cols) {
    for (int e = 0; e < s.E; ++e) {
      const int64_t a = off[e] + rows[e], b = off[e + 1];
      if (b > a) CK(cudaMemsetAsync(p + a * cols, 0, (b - a) * cols * sizeof(bf16), stream));
    }
  }
  bf16* row_input(int64_t cols, uint32_t seed) {
    bf16* p = dalloc<bf16>(R * cols);
    randomize(p, R * cols, seed, 1.0f);
    zero_padding(p, cols);
    return p;
  }
  mok::gemm::Launch launch(int cluster = 0) const { return {0, d_err, 10.0, cluster}; }

  // cuBLAS per-expert loop: C_e[rows_e, N] = A_e . B_e^T.
  float grouped_loop(int64_t N, int64_t K, const bf16* A, const bf16* B, bf16* C) {
    return median_ms([&] {
      for (int e = 0; e < s.E; ++e)
        if (rows[e] > 0) cublas_tn(blas, rows[e], N, K, A + off[e] * K, B + e * N * K, C + off[e] * N);
    }, reps, stream);
  }
  // cuBLAS per-expert loop for wgrad: out_e[M, N] = A_e^T . B_e over the segment's real rows
  // (A_e [rows_e, M], B_e [rows_e, N], row-major), one cublasGemmEx per (problem, expert).
  float wgrad_loop(const mok::gemm::WgradArgs& a) {
    return median_ms([&] {
      const float one = 1.0f, zero = 0.0f;
      for (int q = 0; q < a.num_problems; ++q) {
        const auto& pr = a.problems[q];
        for (int e = 0; e < s.E; ++e) {
          if (rows[e] == 0) continue;
          bf16* out = static_cast<bf16*>(pr.out) + int64_t(e) * pr.m * pr.n;
          CB(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_T, int(pr.n), int(pr.m), rows[e], &one, pr.b + off[e] * pr.n,
                          CUDA_R_16BF, int(pr.n), pr.a + off[e] * pr.m, CUDA_R_16BF, int(pr.m), &zero, out,
                          CUDA_R_16BF, int(pr.n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        }
      }
    }, reps, stream);
  }
};

// Share of the row tiles' rows that are padding (tile FLOPs spent on zeros before the skip).
#ifdef MOK_GEMM_TRACE
// Developer build (-DMOK_GEMM_TRACE): where a tile's time goes, from the per-tile SM clocks the
// first CTAs record (sm90_pipeline.cuh). Averages over CTAs 0..kTraceCtas-1, all tiles but the
// first and last of each CTA.
void trace_begin() {
  using namespace mok::gemm;
  constexpr size_t n = size_t(kTraceCtas) * kTraceTiles * kTraceSlots + size_t(kTraceMaxCtas) * kTraceCtaSlots;
  if (host::trace_buffer() == nullptr) host::trace_buffer() = dalloc<unsigned long long>(n);
  CK(cudaMemset(host::trace_buffer(), 0, n * 8));
}
void trace_report(const char* name) {
  using namespace mok::gemm;
  std::vector<unsigned long long> t(size_t(kTraceCtas) * kTraceTiles * kTraceSlots + size_t(kTraceMaxCtas) * kTraceCtaSlots);
  CK(cudaMemcpy(t.data(), host::trace_buffer(), t.size() * 8, cudaMemcpyDeviceToHost));
  // Per-CTA spans of the last launch: does the slowest CTA set the kernel's time?
  {
    const unsigned long long* c = t.data() + size_t(kTraceCtas) * kTraceTiles * kTraceSlots;
    struct Cta { int block; unsigned sm; double start, ns, cycles; unsigned long long tiles; };
    std::vector<Cta> v;
    for (int b = 0; b < kTraceMaxCtas; ++b) {
      const unsigned long long* r = c + size_t(b) * kTraceCtaSlots;
      if (r[1] == 0 || r[3] == 0) continue;
      v.push_back({b, unsigned(r[0]), double(r[1]), double(r[3] - r[1]), double(r[4] - r[2]), r[5]});
    }
    if (!v.empty()) {
      double t0 = v[0].start, t1 = 0, cyc = 0, ns = 0;
      for (const auto& x : v) t0 = std::min(t0, x.start);
      for (const auto& x : v) t1 = std::max(t1, x.start + x.ns), cyc += x.cycles, ns += x.ns;
      std::vector<double> d;
      for (const auto& x : v) d.push_back(x.ns);
      std::sort(d.begin(), d.end());
      std::printf("trace %-16s %zu CTAs: span %.3f ms; CTA busy min %.3f / median %.3f / max %.3f ms; SM clock %.2f GHz\n",
                  name, v.size(), (t1 - t0) * 1e-6, d.front() * 1e-6, d[d.size() / 2] * 1e-6, d.back() * 1e-6, cyc / ns);
      // In block order: which SM each block landed on, when it started (us after the first)
      // and how long it ran (us).
      std::string line;
      for (const auto& x : v)
        line += " " + std::to_string(x.block) + ":" + std::to_string(x.sm) + ":" + std::to_string(int((x.start - t0) * 1e-3)) +
                ":" + std::to_string(int(x.ns * 1e-3));
      std::printf("trace %-16s per CTA (block:sm:start us:busy us):%s\n", name, line.c_str());
    }
  }
  double sum[10] = {}, total = 0, k = 0;
  int count = 0, tiles = 0;
  // The same by the producer's ring-slot count of the tile (tiles of different K, padding tiles).
  struct BySlots { long long slots; int n = 0; double tile = 0, kloop = 0, first = 0, epi = 0; };
  std::vector<BySlots> by;
  for (int c = 0; c < kTraceCtas; ++c) {
    auto at = [&](int i, int slot) { return double(t[(size_t(c) * kTraceTiles + i) * kTraceSlots + slot]); };
    int n = 0;
    while (n < kTraceTiles && at(n, 0) != 0) ++n;
    tiles += n;
    for (int i = 1; i + 1 < n; ++i) {
      sum[0] += at(i, 1) - at(i, 0);      // seed
      sum[1] += at(i, 2) - at(i, 1);      // wait for the first stage
      sum[2] += at(i, 3) - at(i, 2);      // rest of the K loop
      sum[3] += at(i, 4) - at(i, 3);      // epilogue
      sum[4] += at(i + 1, 0) - at(i, 4);  // to the next tile
      sum[5] += at(i, 6) - at(i, 5);      // producer: tile start to last stage issued
      sum[6] += at(i, 2) - at(i, 6);      // first stage acquired minus producer done (negative: producer ahead)
      sum[7] += at(i, 8) - at(i, 5);      // producer: the tile's coordinates
      sum[8] += at(i, 9) - at(i, 8);      // producer: wait for the first free slot + issue
      sum[9] += at(i, 2) - at(i, 9);      // first stage: producer issue -> consumer acquired
      total += at(i + 1, 0) - at(i, 0);
      k += at(i, 7);
      ++count;
      const long long slots = static_cast<long long>(at(i, 7));
      auto it = std::find_if(by.begin(), by.end(), [&](const BySlots& e) { return e.slots == slots; });
      if (it == by.end()) it = by.insert(by.end(), BySlots{slots});
      it->n++;
      it->tile += at(i + 1, 0) - at(i, 0);
      it->first += at(i, 2) - at(i, 1);
      it->kloop += at(i, 3) - at(i, 2);
      it->epi += at(i, 4) - at(i, 3);
    }
  }
  if (count == 0) { std::printf("trace %-16s no tiles recorded\n", name); return; }
  for (const BySlots& b : by) {
    std::printf("trace %-16s ring slots %3lld: %5d tiles, cycles/tile %7.0f (first stage %6.0f, K loop %7.0f, epilogue %6.0f)\n",
                name, b.slots, b.n, b.tile / b.n, b.first / b.n, b.kloop / b.n, b.epi / b.n);
  }
  const double tile = total / count;
  std::printf("trace %-16s %5.1f tiles/CTA, %4.1f K steps: cycles/tile %7.0f = seed %5.0f + first stage %5.0f + "
              "K loop %7.0f + epilogue %6.0f + next %5.0f (ideal K loop 1024/step: %7.0f); producer issue span %7.0f\n",
              name, double(tiles) / kTraceCtas, k / count, tile, sum[0] / count, sum[1] / count, sum[2] / count,
              sum[3] / count, sum[4] / count, 1024.0 * k / count, sum[5] / count);
  std::printf("trace %-16s producer per tile: coordinates %6.0f, first slot + issue %6.0f; first stage issued -> "
              "acquired by the consumer %6.0f cycles\n",
              name, sum[7] / count, sum[8] / count, sum[9] / count);
}
#else
void trace_begin() {}
void trace_report(const char*) {}
#endif

double padding_fraction(const ModelShape& s, SegMode mode) {
  int64_t real = 0, padded = 0;
  for (int r : segment_rows(s, mode)) {
    real += r;
    padded += (r + 127) / 128 * 128;
  }
  return padded > 0 ? 1.0 - double(real) / double(padded) : 0.0;
}

std::vector<Result> run_shape(const ModelShape& s, SegMode mode, int reps, cudaStream_t stream,
                              cublasHandle_t blas) {
  Bench b{s, mode, reps, stream, blas};
  b.setup();
  const int64_t H = s.H, I = s.I, E = s.E, R = b.R;
  const double rr = double(b.real);
  bf16* x = b.row_input(H, 1);
  bf16* wg = dalloc<bf16>(E * I * H);
  bf16* wu = dalloc<bf16>(E * I * H);
  bf16* wd = dalloc<bf16>(E * H * I);
  randomize(wg, E * I * H, 2, 0.02f);
  randomize(wu, E * I * H, 3, 0.02f);
  randomize(wd, E * H * I, 4, 0.02f);
  bf16* h = dalloc<bf16>(R * I);
  bf16* g = dalloc<bf16>(R * I);
  bf16* u = dalloc<bf16>(R * I);
  bf16* out = dalloc<bf16>(R * H);
  bf16* dys = b.row_input(H, 5);
  bf16* dg = dalloc<bf16>(R * I);
  bf16* du = dalloc<bf16>(R * I);
  bf16* dx = dalloc<bf16>(R * H);
  bf16* dw_d = dalloc<bf16>(E * H * I);
  bf16* dw_g = dalloc<bf16>(E * I * H);
  bf16* dw_u = dalloc<bf16>(E * I * H);
  // Scratch for the cuBLAS baselines (largest C: rows x max(2I, H)).
  bf16* cbuf = dalloc<bf16>(std::max(R * std::max(2 * I, H), H * I));
  bf16* wgu = dalloc<bf16>(E * 2 * I * H);  // stacked [W_gate; W_up] per expert for the loop baseline
  randomize(wgu, E * 2 * I * H, 6, 0.02f);
  CK(cudaDeviceSynchronize());

  std::vector<Result> res;
  const auto L = b.launch();
  using namespace mok::gemm;
  const int64_t M = b.real;  // dense equal-FLOP GEMMs use the real rows as M
  // Dense equal-FLOP GEMMs read views of two random buffers large enough for every shape.
  const int64_t dense_a_n = M * std::max(H, 2 * I), dense_b_n = std::max(2 * I * H, M * std::max(H, I));
  bf16* dense_a = dalloc<bf16>(dense_a_n);
  bf16* dense_b = dalloc<bf16>(dense_b_n);
  randomize(dense_a, dense_a_n, 7, 1.0f);
  randomize(dense_b, dense_b_n, 8, 0.02f);
  // Sizes that are not multiples of 64 (the routed row count M) are rounded down and the time
  // scaled back to the exact FLOPs: cuBLAS takes a slow path for a K that is not a multiple of
  // 8 (wgrad's dense GEMMs reduce over M: 118 TFLOP/s with M = 65 535 instead of ~690).
  auto dense = [&](int64_t m, int64_t n, int64_t k) {
    auto align = [](int64_t v) { return v >= 64 ? v / 64 * 64 : v; };
    const int64_t ma = align(m), na = align(n), ka = align(k);
    const double scale = double(m) * double(n) * double(k) / (double(ma) * double(na) * double(ka));
    return float(scale * median_ms([&] { cublas_tn(blas, ma, na, ka, dense_a, dense_b, cbuf); }, reps, stream));
  };

  // GEMM 1 + SwiGLU: 2 * rows * 2I * H.
  {
    const double f = 2.0 * rr * 2 * I * H;
    trace_begin();
    const float ms = median_ms([&] { gemm1_swiglu({b.seg, H, I, x, wg, wu, h, g, u}, L, stream); }, reps, stream);
    trace_report("gemm1_swiglu");
    const float d = dense(M, 2 * I, H);
    res.push_back({"gemm1_swiglu", f, ms, d, b.grouped_loop(2 * I, H, x, wgu, cbuf)});
    const auto L2 = b.launch(2);  // 2-CTA clusters with B multicast, for comparison
    res.push_back({"gemm1_swiglu_cluster2", f,
                   median_ms([&] { gemm1_swiglu({b.seg, H, I, x, wg, wu, h, g, u}, L2, stream); }, reps, stream), d, 0});
  }
  // GEMM 2: 2 * rows * H * I.
  {
    const double f = 2.0 * rr * H * I;
    trace_begin();
    const float ms = median_ms([&] { gemm2({b.seg, H, I, h, wd, out}, L, stream); }, reps, stream);
    trace_report("gemm2");
    const float d = dense(M, H, I);
    res.push_back({"gemm2", f, ms, d, b.grouped_loop(H, I, h, wd, cbuf)});
    res.push_back({"gemm2_cluster2", f,
                   median_ms([&] { gemm2({b.seg, H, I, h, wd, out}, b.launch(2), stream); }, reps, stream), d, 0});
  }
  // GEMM 2 in FP8 (e4m3 codes, 1x128 / 128x128 block scales), beside the bf16 kind above;
  // random finite codes and power-of-two scales (the speed does not depend on the values).
  {
    const double f = 2.0 * rr * H * I;
    const int64_t kb = (I + 127) / 128, nb = (H + 127) / 128;
    uint8_t* hc = dalloc<uint8_t>(R * I);
    uint8_t* wc = dalloc<uint8_t>(E * H * I);
    float* hs = dalloc<float>(kb * R);
    float* ws = dalloc<float>(E * nb * kb);
    fill_e4m3<<<1024, 256>>>(hc, R * I, 11);
    fill_e4m3<<<1024, 256>>>(wc, E * H * I, 12);
    fill_scales<<<256, 256>>>(hs, kb * R, 13);
    fill_scales<<<256, 256>>>(ws, E * nb * kb, 14);
    CK(cudaDeviceSynchronize());
    Gemm2Fp8Args a;
    a.seg = b.seg;
    a.hidden = H;
    a.intermediate = I;
    a.h = {hc, hs};
    a.w_down = {wc, ws};
    a.out = out;
    trace_begin();
    const float ms = median_ms([&] { gemm2_fp8(a, L, stream); }, reps, stream);
    trace_report("gemm2_fp8");
    res.push_back({"gemm2_fp8", f, ms, dense(M, H, I), 0});
    // GEMM 1 + SwiGLU in FP8 (writes g, u, h and h's codes and scales), beside gemm1_swiglu.
    const int64_t hb = (H + 127) / 128, ib = (I + 127) / 128;
    uint8_t* xc = dalloc<uint8_t>(R * H);
    uint8_t* gc = dalloc<uint8_t>(E * I * H);
    uint8_t* uc = dalloc<uint8_t>(E * I * H);
    float* xs = dalloc<float>(hb * R);
    float* gs = dalloc<float>(E * ib * hb);
    float* us = dalloc<float>(E * ib * hb);
    NonFiniteRecord* rec = dalloc<NonFiniteRecord>(1);
    fill_e4m3<<<1024, 256>>>(xc, R * H, 15);
    fill_e4m3<<<1024, 256>>>(gc, E * I * H, 16);
    fill_e4m3<<<1024, 256>>>(uc, E * I * H, 17);
    fill_scales<<<256, 256>>>(xs, hb * R, 18);
    fill_scales<<<256, 256>>>(gs, E * ib * hb, 19);
    fill_scales<<<256, 256>>>(us, E * ib * hb, 20);
    reset_nonfinite(rec, stream);
    CK(cudaDeviceSynchronize());
    Gemm1SwigluFp8Args a1;
    a1.seg = b.seg;
    a1.hidden = H;
    a1.intermediate = I;
    a1.x = {xc, xs};
    a1.w_gate = {gc, gs};
    a1.w_up = {uc, us};
    a1.g = g;
    a1.u = u;
    a1.h = h;
    a1.h_codes = hc;
    a1.h_scales = hs;
    a1.nonfinite = rec;
    const double f1 = 2.0 * rr * 2 * I * H;
    trace_begin();
    const float ms1 = median_ms([&] { gemm1_swiglu_fp8(a1, L, stream); }, reps, stream);
    trace_report("gemm1_swiglu_fp8");
    res.push_back({"gemm1_swiglu_fp8", f1, ms1, dense(M, 2 * I, H), 0});
    // As the FP8 layer's forward runs it: no bf16 output, g, u and h quantized in the epilogue (the
    // context's g, u codes; a separate buffer each, scales in h's K-block major layout).
    {
      Gemm1SwigluFp8Args a8 = a1;
      a8.g = a8.u = a8.h = nullptr;
      a8.g_codes = dalloc<uint8_t>(R * I);
      a8.u_codes = dalloc<uint8_t>(R * I);
      a8.g_scales = dalloc<float>(ib * R);
      a8.u_scales = dalloc<float>(ib * R);
      a8.gu_nonfinite = rec;
      trace_begin();
      const float ms8 = median_ms([&] { gemm1_swiglu_fp8(a8, L, stream); }, reps, stream);
      trace_report("gemm1_swiglu_fp8_gu8");
      res.push_back({"gemm1_swiglu_fp8_gu8", f1, ms8, dense(M, 2 * I, H), 0});
      for (void* p : {(void*)a8.g_codes, (void*)a8.u_codes, (void*)a8.g_scales, (void*)a8.u_scales}) CK(cudaFree(p));
    }
    // dgrad of GEMM 1 in FP8 (dg, du codes: reuse h's buffer twice; W^T codes: reuse W_gate's,
    // W_up's of the same size [E, H, I]), beside dgrad_dx.
    DgradInputFp8Args a2;
    a2.seg = b.seg;
    a2.hidden = H;
    a2.intermediate = I;
    a2.dg = {hc, hs};
    a2.du = {hc, hs};
    a2.w_gate_t = {gc, gs};
    a2.w_up_t = {uc, us};
    a2.dx = out;
    trace_begin();
    const float ms2 = median_ms([&] { dgrad_input_fp8(a2, L, stream); }, reps, stream);
    trace_report("dgrad_dx_fp8");
    res.push_back({"dgrad_dx_fp8", 2.0 * rr * 2 * I * H, ms2, dense(M, H, 2 * I), 0});
    // dgrad of GEMM 2 + SwiGLU backward in FP8 (dys: x's codes; W_down^T: W_gate's of the same
    // size [E, I, H]; g, u: GEMM 1's outputs above), beside dgrad_dh_swiglu.
    uint8_t* duc = dalloc<uint8_t>(R * I);
    float* dus = dalloc<float>(ib * R);
    DgradHiddenFp8Args a3;
    a3.seg = b.seg;
    a3.hidden = H;
    a3.intermediate = I;
    a3.dys = {xc, xs};
    a3.w_down_t = {gc, gs};
    a3.g = g;
    a3.u = u;
    a3.dg = dg;
    a3.du = du;
    a3.dg_codes = hc;
    a3.du_codes = duc;
    a3.dg_scales = hs;
    a3.du_scales = dus;
    a3.nonfinite = rec;
    const float ms3 = median_ms([&] { dgrad_hidden_swiglu_fp8(a3, L, stream); }, reps, stream);
    res.push_back({"dgrad_dh_swiglu_fp8", 2.0 * rr * H * I, ms3, dense(M, I, H), 0});
    // The routed kind, as the layer runs it: router weights per row, the d topk_w parts out.
    {
      float* row_w = dalloc<float>(R);
      a3.row_w = row_w;
      a3.dw_part = dalloc<float>(R * dgrad_hidden_col_tiles(I));
      fill_scales<<<256, 256>>>(row_w, R, 21);
      CK(cudaDeviceSynchronize());
      trace_begin();
      const float ms3r = median_ms([&] { dgrad_hidden_swiglu_fp8(a3, L, stream); }, reps, stream);
      trace_report("dgrad_dh_fp8_routed");
      res.push_back({"dgrad_dh_swiglu_fp8_routed", 2.0 * rr * H * I, ms3r, dense(M, I, H), 0});
      CK(cudaFree(row_w));
      CK(cudaFree(a3.dw_part));
    }
    CK(cudaFree(duc));
    CK(cudaFree(dus));
    for (void* p : {(void*)hc, (void*)wc, (void*)hs, (void*)ws, (void*)xc, (void*)gc, (void*)uc, (void*)xs, (void*)gs,
                    (void*)us, (void*)rec})
      CK(cudaFree(p));
  }
  // dgrad: dh + SwiGLU backward (2 rows H I), dX (2 rows 2I H).
  {
    const double f1 = 2.0 * rr * H * I, f2 = 2.0 * rr * 2 * I * H;
    trace_begin();
    const float ms1 = median_ms([&] { dgrad_hidden_swiglu({b.seg, H, I, dys, wd, g, u, dg, du}, L, stream); }, reps, stream);
    trace_report("dgrad_dh_swiglu");
    trace_begin();
    const float ms2 = median_ms([&] { dgrad_input({b.seg, H, I, dg, du, wg, wu, dx}, L, stream); }, reps, stream);
    trace_report("dgrad_dx");
    const float d1 = dense(M, I, H), d2 = dense(M, H, 2 * I);
    res.push_back({"dgrad_dh_swiglu", f1, ms1, d1, 0});
    res.push_back({"dgrad_dx", f2, ms2, d2, 0});
    {  // the routed kind, as the layer runs it: router weights per row, the d topk_w parts out
      DgradHiddenArgs a{b.seg, H, I, dys, wd, g, u, dg, du};
      float* row_w = dalloc<float>(R);
      a.row_w = row_w;
      a.dw_part = dalloc<float>(R * dgrad_hidden_col_tiles(I));
      fill_scales<<<256, 256>>>(row_w, R, 22);
      CK(cudaDeviceSynchronize());
      res.push_back({"dgrad_dh_swiglu_routed", f1, median_ms([&] { dgrad_hidden_swiglu(a, L, stream); }, reps, stream),
                     d1, 0});
      CK(cudaFree(row_w));
      CK(cudaFree(a.dw_part));
    }
    const float ms1c = median_ms([&] { dgrad_hidden_swiglu({b.seg, H, I, dys, wd, g, u, dg, du}, b.launch(2), stream); }, reps, stream);
    const float ms2c = median_ms([&] { dgrad_input({b.seg, H, I, dg, du, wg, wu, dx}, b.launch(2), stream); }, reps, stream);
    res.push_back({"dgrad_cluster2", f1 + f2, ms1c + ms2c, d1 + d2, 0});
    res.push_back({"dgrad", f1 + f2, ms1 + ms2, d1 + d2, 0});
  }
  // wgrad: dW_down = dys^T h, dW_gate = dg^T x, dW_up = du^T x (one launch, 3 problems).
  {
    const double f = 3 * 2.0 * rr * H * I;
    WgradArgs a;
    a.seg = b.seg;
    a.num_problems = 3;
    a.problems[0] = {dys, h, H, I, nullptr, dw_d};
    a.problems[1] = {dg, x, I, H, nullptr, dw_g};
    a.problems[2] = {du, x, I, H, nullptr, dw_u};
    a.mode = WgradOut::kWriteBf16;
    trace_begin();
    const float ms = median_ms([&] { wgrad(a, L, stream); }, reps, stream);
    trace_report("wgrad");
    const float d = dense(H, I, M) + 2 * dense(I, H, M);
    res.push_back({"wgrad", f, ms, d, b.wgrad_loop(a)});
    res.push_back({"wgrad_cluster2", f, median_ms([&] { wgrad(a, b.launch(2), stream); }, reps, stream), d, 0});
    // fp32 main-grad accumulation (reads and writes E*3*H*I fp32: memory-bound at small rows/expert).
    float* mg = dalloc<float>(3 * E * H * I);
    CK(cudaMemset(mg, 0, 3 * E * H * I * sizeof(float)));
    a.mode = WgradOut::kAccumulateFp32;
    a.problems[0].out = mg;
    a.problems[1].out = mg + E * H * I;
    a.problems[2].out = mg + 2 * E * H * I;
    const float ms2 = median_ms([&] { wgrad(a, L, stream); }, reps, stream);
    res.push_back({"wgrad_accumulate_fp32", f, ms2, d, 0});
    // The same three problems in FP8 (operands transposed and quantized along the tokens: random
    // codes and scales), bf16 output, then fp32 main-grad accumulation, beside the two above.
    {
      const int64_t kb = R / 128;
      uint8_t* ch = dalloc<uint8_t>(H * R);  // dy^T and x^T: [H, R]
      uint8_t* ci = dalloc<uint8_t>(I * R);  // hs^T, dg^T, du^T: [I, R]
      float* sh = dalloc<float>(kb * H);
      float* si = dalloc<float>(kb * I);
      fill_e4m3<<<1024, 256>>>(ch, H * R, 21);
      fill_e4m3<<<1024, 256>>>(ci, I * R, 22);
      fill_scales<<<256, 256>>>(sh, kb * H, 23);
      fill_scales<<<256, 256>>>(si, kb * I, 24);
      CK(cudaDeviceSynchronize());
      WgradFp8Args a8;
      a8.seg = b.seg;
      a8.num_problems = 3;
      a8.problems[0] = {{ch, sh}, {ci, si}, H, I, dw_d};
      a8.problems[1] = {{ci, si}, {ch, sh}, I, H, dw_g};
      a8.problems[2] = {{ci, si}, {ch, sh}, I, H, dw_u};
      a8.mode = WgradOut::kWriteBf16;
      trace_begin();
      const float ms8 = median_ms([&] { wgrad_fp8(a8, L, stream); }, reps, stream);
      trace_report("wgrad_fp8");
      res.push_back({"wgrad_fp8", f, ms8, d, 0});
      a8.mode = WgradOut::kAccumulateFp32;
      a8.problems[0].out = mg;
      a8.problems[1].out = mg + E * H * I;
      a8.problems[2].out = mg + 2 * E * H * I;
      res.push_back({"wgrad_fp8_accumulate_fp32", f, median_ms([&] { wgrad_fp8(a8, L, stream); }, reps, stream), d, 0});
      for (void* p : {(void*)ch, (void*)ci, (void*)sh, (void*)si}) CK(cudaFree(p));
    }
    CK(cudaFree(mg));
  }
  CK(cudaDeviceSynchronize());
  uint32_t err = 0;
  CK(cudaMemcpy(&err, b.d_err, 4, cudaMemcpyDeviceToHost));
  if (err != 0) std::fprintf(stderr, "ERROR: gemm error flag 0x%x\n", err);
  for (void* p : {(void*)x, (void*)wg, (void*)wu, (void*)wd, (void*)h, (void*)g, (void*)u, (void*)out, (void*)dys,
                  (void*)dg, (void*)du, (void*)dx, (void*)dw_d, (void*)dw_g, (void*)dw_u, (void*)cbuf, (void*)wgu})
    CK(cudaFree(p));
  return res;
}

double tflops(double f, float ms) { return ms > 0 ? f / (ms * 1e-3) / 1e12 : 0.0; }

}  // namespace

int main(int argc, char** argv) {
  std::string only = "all", json, commit = "unknown", segments = "uniform,skewed,random";
  int reps = 15;
  bool quick = false;
  double warm_ms = -1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--shape" && i + 1 < argc) only = argv[++i];
    else if (a == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (a == "--json" && i + 1 < argc) json = argv[++i];
    else if (a == "--commit" && i + 1 < argc) commit = argv[++i];
    else if (a == "--quick") reps = 5, quick = true;
    else if (a == "--warm-ms" && i + 1 < argc) warm_ms = std::atof(argv[++i]);
    else if (a == "--series") g_series = true;
    else if (a == "--segments" && i + 1 < argc) segments = argv[++i];
    else {
      std::fprintf(stderr, "bench_gemm: unknown or incomplete argument '%s' (see the usage at the top of bench_gemm.cu)\n", a.c_str());
      return 2;
    }
  }
  g_warm_ms = warm_ms >= 0 ? warm_ms : (quick ? 50.0 : 300.0);
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CK(cudaStreamCreate(&stream));
  cublasHandle_t blas;
  CB(cublasCreate(&blas));
  CB(cublasSetStream(blas, stream));

  char date[16];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%d", std::gmtime(&now));
  std::string js = "{\"date\": \"" + std::string(date) + "\", \"commit\": \"" + commit + "\", \"gpu\": \"" + prop.name +
                   "\", \"gpus\": 1, \"command\": \"";
  for (int i = 0; i < argc; ++i) js += std::string(i ? " " : "") + argv[i];
  js += "\", \"results\": [";
  bool first = true;
  std::printf("%-7s %-8s %-22s %9s %9s %11s %7s %13s\n", "shape", "segments", "kind", "ms", "TFLOP/s",
              "cuBLAS-dense", "ratio", "cuBLAS-loop");
  for (const ModelShape& s : kShapes) {
    if (only != "all" && only != s.name) continue;
    for (SegMode mode : {SegMode::kUniform, SegMode::kSkewed, SegMode::kRandom}) {
      if (("," + segments + ",").find(std::string(",") + seg_name(mode) + ",") == std::string::npos) continue;
      const auto res = run_shape(s, mode, reps, stream, blas);
      std::string metrics;
      for (const Result& r : res) {
        const double t = tflops(r.flops, r.ms), d = tflops(r.flops, r.dense_ms), g = tflops(r.flops, r.grouped_ms);
        std::printf("%-7s %-8s %-22s %9.3f %9.1f %11.1f %6.1f%% %13.1f\n", s.name, seg_name(mode),
                    r.kind.c_str(), r.ms, t, d, 100.0 * t / d, g);
        char buf[256];
        std::snprintf(buf, sizeof(buf), "%s\"%s_tflops\": %.1f, \"%s_cublas_dense_tflops\": %.1f", metrics.empty() ? "" : ", ",
                      r.kind.c_str(), t, r.kind.c_str(), d);
        metrics += buf;
        if (r.grouped_ms > 0) {
          std::snprintf(buf, sizeof(buf), ", \"%s_cublas_loop_tflops\": %.1f", r.kind.c_str(), g);
          metrics += buf;
        }
        if (r.kind == "gemm1_swiglu") {
          std::snprintf(buf, sizeof(buf), ", \"cublas_dense_tflops\": %.1f", d);
          metrics += buf;
        }
      }
      js += std::string(first ? "" : ", ") + "{\"bench\": \"gemm\", \"shape\": \"" + s.name + "\", \"ep\": " +
            std::to_string(s.ep) + ", \"segments\": \"" + seg_name(mode) + "\", \"padding_fraction\": " +
            std::to_string(padding_fraction(s, mode)) + ", \"metrics\": {" +
            metrics + "}}";
      first = false;
      std::fflush(stdout);
    }
  }
  js += "]}\n";
  if (!json.empty()) {
    FILE* f = std::fopen(json.c_str(), "w");
    if (f) {
      std::fputs(js.c_str(), f);
      std::fclose(f);
    }
  }
  CB(cublasDestroy(blas));
  return 0;
}
