// FP8 block quantizers (docs/fp8.md), bit for bit the CPU reference src/reference/fp8.cpp.
//
// Numerics per block: amax is taken on the bf16 bits (|v| as fp32 bits is (bits & 0x7FFF) << 16,
// and for non-negative floats the integer order is the float order); k comes from the exact
// fp32 exponent and mantissa of amax (no log2); codes are e4m3(v * 2^-k) with 2^-k built from
// bits, converted by cvt.rn.satfinite.e4m3x2.f32 (round to nearest even, saturating, sign of
// zero kept), the rounding ref::to_e4m3 defines. v * 2^-k is exact (a power of two) unless it
// falls below 2^-126, where it encodes to a signed zero either way.
//
// Layout of the work: quantize_rows_1x128 gives one warp to each 1x128 block (lane l holds
// columns 2l, 2l+1, 64+2l, 65+2l: 4-byte loads, each warp access 128 contiguous bytes). The
// two others stage a 128x128 bf16 tile in shared memory (row pitch 130 elements, so a column
// read and a row write are both free of bank conflicts), then write the transposed codes
// through a [128 columns][132 bytes] byte tile aliased onto it, 128 bytes per column per warp
// store. Vector loads and stores are used where the address allows, scalar ones otherwise
// (odd ld, odd cols, partial blocks); nothing outside the tensors is read or written. Each
// activation kernel (rows, cols, dequantize) has a vector path for the layouts the layer uses
// (16-byte loads, a thread's values in registers; 2026-12-07: those passes moved ~1.3-1.9 TB/s on an
// H100 through 2- and 4-byte accesses) and keeps the scalar one for the others: the same math per
// value, so the same bits (tests/gpu/test_fp8_quantize.cu runs both).
#include "gemm/fp8_quantize.hpp"

#include <cuda_fp8.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <string>

#include "gemm/fp8_math.cuh"
#include "gemm/gemm_host.hpp"
#include "mok/error.hpp"

namespace mok::gemm {

namespace {

constexpr int kBlock = 128;                 // block edge (elements)
constexpr int kThreads = 256;               // 8 warps per CTA, every kernel
constexpr int kWarps = kThreads / 32;
constexpr int kTileWordPitch = kBlock / 2 + 1;  // 65 words = 130 bf16 per tile row
constexpr int kCodeWordPitch = kBlock / 4 + 1;  // 33 words = 132 code bytes per tile column
constexpr int64_t kMaxGrid = int64_t{1} << 20;  // grid-stride loops beyond this many CTAs

// Lane l of a warp covering one 128-wide row segment holds columns 2l, 2l+1, 64+2l, 65+2l.
__device__ inline int lane_col(int lane, int j) { return (j >> 1) * 64 + 2 * lane + (j & 1); }

// Loads the lane's 4 elements of a row segment of n <= 128 elements (missing ones read as 0).
__device__ inline void load_segment(const uint16_t* src, int n, int lane, uint16_t (&v)[4]) {
  if (n == kBlock && (reinterpret_cast<uintptr_t>(src) & 3u) == 0) {
    const uint32_t lo = reinterpret_cast<const uint32_t*>(src)[lane];
    const uint32_t hi = reinterpret_cast<const uint32_t*>(src + 64)[lane];
    v[0] = static_cast<uint16_t>(lo);
    v[1] = static_cast<uint16_t>(lo >> 16);
    v[2] = static_cast<uint16_t>(hi);
    v[3] = static_cast<uint16_t>(hi >> 16);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = lane_col(lane, j) < n ? src[lane_col(lane, j)] : uint16_t{0};
  }
}

// Replaces non-finite values by +0 and records their linear index (index0 + column); returns
// the largest |v| as fp32 bits.
__device__ inline uint32_t sanitize(uint16_t (&v)[4], int lane, unsigned long long index0,
                                    NonFiniteRecord* rec) {
  uint32_t amax = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (!bf16_finite(v[j])) {
      atomicMin(&rec->first, index0 + static_cast<unsigned long long>(lane_col(lane, j)));
      v[j] = 0;
    }
    amax = max(amax, abs_bits(v[j]));
  }
  return amax;
}

// The 8 bf16 values of a 16-byte load (columns col .. col+7 of a row) into v, as sanitize does: non-finite
// ones become +0, the first one recorded (index0 + its column); returns the largest |v| as fp32 bits.
__device__ inline uint32_t unpack_sanitize8(uint4 w, int col, unsigned long long index0, NonFiniteRecord* rec,
                                            uint16_t (&v)[8]) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  uint32_t amax = 0;
  int bad = INT_MAX;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    v[j] = static_cast<uint16_t>(words[j / 2] >> (16 * (j % 2)));
    if (!bf16_finite(v[j])) {
      bad = min(bad, col + j);
      v[j] = 0;
    }
    amax = max(amax, abs_bits(v[j]));
  }
  if (bad != INT_MAX) atomicMin(&rec->first, index0 + static_cast<unsigned long long>(bad));
  return amax;
}

// One 1x128 row block held by a half-warp, 8 values a lane (v, largest |v| amax as fp32 bits; lanes
// past the row's end hold zeros): the block's scale exponent k (amax over the half, half_mask) and
// the lane's 8 codes of v * 2^-k (quantize_rows_vec_kernel's layout and math).
__device__ inline int half_warp_scale_exponent(uint32_t amax, uint32_t half_mask) {
#pragma unroll
  for (int o = 8; o >= 1; o /= 2) amax = max(amax, __shfl_xor_sync(half_mask, amax, o));
  return scale_exponent_bits(amax);
}
__device__ inline uint2 encode8(const uint16_t (&v)[8], float inv) {
  uint2 q;
  q.x = encode2(v[0], v[1], inv) | (static_cast<uint32_t>(encode2(v[2], v[3], inv)) << 16);
  q.y = encode2(v[4], v[5], inv) | (static_cast<uint32_t>(encode2(v[6], v[7], inv)) << 16);
  return q;
}

// Stores the lane's codes (q01: columns 2l, 2l+1; q23: 64+2l, 65+2l) of a segment of n codes.
__device__ inline void store_segment(uint8_t* dst, int n, int lane, uint16_t q01, uint16_t q23) {
  if (n == kBlock && (reinterpret_cast<uintptr_t>(dst) & 1u) == 0) {
    reinterpret_cast<uint16_t*>(dst)[lane] = q01;
    reinterpret_cast<uint16_t*>(dst + 64)[lane] = q23;
  } else {
    const uint8_t q[4] = {static_cast<uint8_t>(q01), static_cast<uint8_t>(q01 >> 8), static_cast<uint8_t>(q23),
                          static_cast<uint8_t>(q23 >> 8)};
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (lane_col(lane, j) < n) dst[lane_col(lane, j)] = q[j];
  }
}

// ---- 1x128 blocks along rows ----

struct RowsParams {
  const uint16_t* x;
  int64_t rows, cols, ld;
  uint8_t* codes;
  int64_t codes_ld;
  float* scales;
  int64_t scales_ld;         // between K blocks
  int64_t scales_rs;         // between rows
  NonFiniteRecord* rec;
  int64_t blocks_per_row;
  const int64_t* rows_limit;
};

// The rows a kernel covers: rows, or fewer per the optional device count (negative: none).
__device__ inline int64_t live_rows(int64_t rows, const int64_t* limit) {
  return limit == nullptr ? rows : max(int64_t{0}, min(rows, *limit));
}

// The vector path (quantize_rows_1x128 picks it when x, its ld, the codes and their ld allow 16-byte
// loads and 8-byte stores, and cols is a multiple of 8): a half-warp per 1x128 block, lane l of the
// half holding columns 8l .. 8l+7 (one 16-byte load; a partial last block's lanes past it hold zeros),
// so a warp reads 512 contiguous bytes of a row per step where the scalar path reads 256 in two
// requests; codes stored 8 bytes a lane. The same math per value, so the same bits.
__global__ void __launch_bounds__(kThreads) quantize_rows_vec_kernel(const RowsParams p) {
  const int lane = threadIdx.x & 15;   // lane in the half-warp
  const int half = (threadIdx.x >> 4) & 1;
  const uint32_t half_mask = 0xFFFFu << (16 * half);
  const int64_t units = live_rows(p.rows, p.rows_limit) * p.blocks_per_row;
  const int64_t stride = int64_t{gridDim.x} * kWarps * 2;
  // (every lane of a warp runs the same number of iterations: the shuffles below are per half)
  for (int64_t base = (int64_t{blockIdx.x} * kWarps + (threadIdx.x >> 5)) * 2; base < units; base += stride) {
    const int64_t u = base + half;
    if (u >= units) continue;  // the warp's second half past the end (this half alone stops)
    const int64_t r = u / p.blocks_per_row, b = u - r * p.blocks_per_row;
    const int64_t c0 = b * kBlock;
    const int n = static_cast<int>(min(int64_t{kBlock}, p.cols - c0));
    const int c = 8 * lane;
    uint16_t v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    uint32_t amax = 0;
    if (c < n) {
      amax = unpack_sanitize8(*reinterpret_cast<const uint4*>(p.x + r * p.ld + c0 + c), c, r * p.cols + c0, p.rec, v);
    }
    const int k = half_warp_scale_exponent(amax, half_mask);
    if (c < n) *reinterpret_cast<uint2*>(p.codes + r * p.codes_ld + c0 + c) = encode8(v, pow2_bits(-k));
    if (lane == 0) p.scales[b * p.scales_ld + r * p.scales_rs] = pow2_bits(k);
  }
}

__global__ void __launch_bounds__(kThreads) quantize_rows_kernel(const RowsParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t units = live_rows(p.rows, p.rows_limit) * p.blocks_per_row;
  const int64_t stride = int64_t{gridDim.x} * kWarps;
  for (int64_t u = int64_t{blockIdx.x} * kWarps + (threadIdx.x >> 5); u < units; u += stride) {
    const int64_t r = u / p.blocks_per_row, b = u - r * p.blocks_per_row;
    const int64_t c0 = b * kBlock;
    const int n = static_cast<int>(min(int64_t{kBlock}, p.cols - c0));
    uint16_t v[4];
    load_segment(p.x + r * p.ld + c0, n, lane, v);
    const uint32_t amax = __reduce_max_sync(0xFFFFFFFFu, sanitize(v, lane, r * p.cols + c0, p.rec));
    const int k = scale_exponent_bits(amax);
    const float inv = pow2_bits(-k);
    store_segment(p.codes + r * p.codes_ld + c0, n, lane, encode2(v[0], v[1], inv), encode2(v[2], v[3], inv));
    if (lane == 0) p.scales[b * p.scales_ld + r * p.scales_rs] = pow2_bits(k);
  }
}

// ---- 128x128 tiles in shared memory ----

struct TileSmem {
  uint32_t words[kBlock * kTileWordPitch];  // bf16 tile [128][130]; later the code tile [128][33 words]
  uint32_t amax[2 * kBlock];                // per-column partial amax (two row halves)
};

// The bf16 tile of TileSmem: `pitch` elements a row (the column passes below take any pitch).
inline constexpr int kTilePitch = 2 * kTileWordPitch;
__device__ inline const uint16_t* tile_of(const TileSmem& s) { return reinterpret_cast<const uint16_t*>(s.words); }

// Loads x[r0 .. r0+nr) x [c0 .. c0+nc) (row stride ld) into the tile; elements outside the
// matrix and non-finite ones become +0 (the latter recorded as (rec_row0 + r) * cols + c).
// Returns the thread's largest |v| as fp32 bits.
__device__ inline uint32_t load_tile(TileSmem& s, const uint16_t* x, int64_t ld, int64_t cols, int64_t r0,
                                     int64_t c0, int nr, int nc, int64_t rec_row0, NonFiniteRecord* rec) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t amax = 0;
  for (int r = warp; r < kBlock; r += kWarps) {
    uint16_t v[4] = {0, 0, 0, 0};
    if (r < nr) {
      load_segment(x + (r0 + r) * ld + c0, nc, lane, v);
      amax = max(amax, sanitize(v, lane, (rec_row0 + r0 + r) * cols + c0, rec));
    }
    s.words[r * kTileWordPitch + lane] = v[0] | (static_cast<uint32_t>(v[1]) << 16);
    s.words[r * kTileWordPitch + 32 + lane] = v[2] | (static_cast<uint32_t>(v[3]) << 16);
  }
  return amax;
}

// The largest |v| (fp32 bits) of column c of a bf16 tile (`pitch` elements a row), rows h*64 .. h*64+63.
__device__ inline uint32_t column_amax(const uint16_t* tile, int pitch, int c, int h) {
  uint32_t part = 0;
  for (int r = h * 64; r < h * 64 + 64; ++r) part = max(part, abs_bits(tile[r * pitch + c]));
  return part;
}

// Codes of the same column and rows, four rows per word (row order = byte order).
__device__ inline void column_codes(const uint16_t* tile, int pitch, int c, int h, float inv, uint32_t (&q)[16]) {
  auto at = [&](int r) { return tile[r * pitch + c]; };
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int r = h * 64 + 4 * i;
    q[i] = encode2(at(r), at(r + 1), inv) | (static_cast<uint32_t>(encode2(at(r + 2), at(r + 3), inv)) << 16);
  }
}

// Writes every thread's column codes (column c = tid % 128, rows half h = tid / 128) to the
// code tile aliased on the bf16 tile, then the tile transposed: tile column c (< nc) goes to
// dst + (c0 + c) * dst_ld + r0 .. + nr. Synchronises the CTA before and after.
__device__ inline void store_transposed(uint32_t* words, const uint32_t (&q)[16], uint8_t* dst, int64_t dst_ld,
                                        int64_t r0, int64_t c0, int nr, int nc) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int c = threadIdx.x & (kBlock - 1), h = threadIdx.x >> 7;
  __syncthreads();  // every column read of the bf16 tile is done
#pragma unroll
  for (int i = 0; i < 16; ++i) words[c * kCodeWordPitch + h * 16 + i] = q[i];
  __syncthreads();
  for (int col = warp; col < nc; col += kWarps) {
    uint8_t* out = dst + (c0 + col) * dst_ld + r0;
    const uint32_t word = words[col * kCodeWordPitch + lane];
    if (nr == kBlock && (reinterpret_cast<uintptr_t>(out) & 3u) == 0) {
      reinterpret_cast<uint32_t*>(out)[lane] = word;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (4 * lane + j < nr) out[4 * lane + j] = static_cast<uint8_t>(word >> (8 * j));
    }
  }
  __syncthreads();  // the next tile may overwrite the shared memory
}

// ---- 128x1 blocks (along rows of x), written transposed ----

struct ColsParams {
  const uint16_t* x;
  int64_t rows, cols, ld;
  uint8_t* codes_t;
  int64_t codes_t_ld;
  float* scales_t;
  int64_t scales_t_ld;
  NonFiniteRecord* rec;
  int64_t row_tiles, col_tiles;
  const int64_t* rows_limit;
  // The row quantization of the same x (QuantizeColsArgs::row_codes; the vector kernel only).
  uint8_t* row_codes;
  int64_t row_codes_ld;
  float* row_scales;
  int64_t row_scales_ld;
};

__global__ void __launch_bounds__(kThreads) quantize_cols_kernel(const ColsParams p) {
  __shared__ TileSmem s;
  const int c = threadIdx.x & (kBlock - 1), h = threadIdx.x >> 7;
  const int64_t rows = live_rows(p.rows, p.rows_limit);
  const int64_t row_tiles = (rows + kBlock - 1) / kBlock;  // uniform over the launch
  for (int64_t t = blockIdx.x; t < row_tiles * p.col_tiles; t += gridDim.x) {
    const int64_t br = t / p.col_tiles, bc = t - br * p.col_tiles;
    const int64_t r0 = br * kBlock, c0 = bc * kBlock;
    const int nr = static_cast<int>(min(int64_t{kBlock}, rows - r0));
    const int nc = static_cast<int>(min(int64_t{kBlock}, p.cols - c0));
    load_tile(s, p.x, p.ld, p.cols, r0, c0, nr, nc, 0, p.rec);
    __syncthreads();
    s.amax[h * kBlock + c] = column_amax(tile_of(s), kTilePitch, c, h);
    __syncthreads();
    const int k = scale_exponent_bits(max(s.amax[c], s.amax[kBlock + c]));
    if (h == 0 && c < nc) p.scales_t[br * p.scales_t_ld + c0 + c] = pow2_bits(k);
    uint32_t q[16];
    column_codes(tile_of(s), kTilePitch, c, h, pow2_bits(-k), q);
    store_transposed(s.words, q, p.codes_t, p.codes_t_ld, r0, c0, nr, nc);
  }
}

// The vector path (quantize_cols_128x1_transposed picks it when x and its ld allow 16-byte loads
// and cols is a multiple of 8): the tile is loaded 16 bytes a lane (a half-warp per tile row, where
// load_tile takes two 4-byte loads a lane) into a [128][136] bf16 tile (272-byte rows: aligned
// 16-byte stores, conflict-free column reads); then the scalar path's column passes (amax, codes)
// over it, which keep the registers, hence the CTAs per SM, of that path. (Holding each thread's 64
// column values in registers for both passes instead took 1.36x the scalar path's time on an H100,
// 2026-12-07: fewer CTAs per SM.) The same math per value, so the same bits.
// With p.row_codes the loaded half-warp rows are also quantized as 1x128 row blocks on the spot: a
// half-warp holds one tile row's 128 columns, 8 a lane, quantize_rows_vec_kernel's layout and math.
struct VecTileSmem {
  static constexpr int kPitch = kBlock + 8;  // bf16 elements per tile row
  uint4 rows[kBlock * kPitch / 8];           // the bf16 tile; later the code tile (store_transposed's)
  uint32_t amax[2 * kBlock];
};
static_assert(kBlock * VecTileSmem::kPitch / 2 >= kBlock * kCodeWordPitch, "the code tile fits on the bf16 tile");

__global__ void __launch_bounds__(kThreads) quantize_cols_vec_kernel(const ColsParams p) {
  __shared__ VecTileSmem s;
  const int c = threadIdx.x & (kBlock - 1), h = threadIdx.x >> 7;
  const int chunk = threadIdx.x & 15, row_in_pass = threadIdx.x >> 4;  // 16 rows of 16 chunks per pass
  const int64_t rows = live_rows(p.rows, p.rows_limit);
  const int64_t row_tiles = (rows + kBlock - 1) / kBlock;  // uniform over the launch
  const uint16_t* tile = reinterpret_cast<const uint16_t*>(s.rows);
  for (int64_t t = blockIdx.x; t < row_tiles * p.col_tiles; t += gridDim.x) {
    const int64_t br = t / p.col_tiles, bc = t - br * p.col_tiles;
    const int64_t r0 = br * kBlock, c0 = bc * kBlock;
    const int nr = static_cast<int>(min(int64_t{kBlock}, rows - r0));
    const int nc = static_cast<int>(min(int64_t{kBlock}, p.cols - c0));
    const int col = 8 * chunk;
    const uint32_t half_mask = 0xFFFFu << (16 * ((threadIdx.x >> 4) & 1));
#pragma unroll 4
    for (int r = row_in_pass; r < kBlock; r += kThreads / 16) {
      uint4 w = make_uint4(0u, 0u, 0u, 0u);
      uint16_t v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      uint32_t amax = 0;
      const bool in = r < nr && col < nc;
      if (in) {
        amax = unpack_sanitize8(*reinterpret_cast<const uint4*>(p.x + (r0 + r) * p.ld + c0 + col), col,
                                (r0 + r) * p.cols + c0, p.rec, v);
        auto pair = [&](int j) { return v[2 * j] | (static_cast<uint32_t>(v[2 * j + 1]) << 16); };
        w = make_uint4(pair(0), pair(1), pair(2), pair(3));
      }
      s.rows[(r * VecTileSmem::kPitch + col) / 8] = w;
      if (p.row_codes != nullptr) {  // uniform over the launch; every lane of a half takes part
        const int k = half_warp_scale_exponent(amax, half_mask);
        if (in) *reinterpret_cast<uint2*>(p.row_codes + (r0 + r) * p.row_codes_ld + c0 + col) = encode8(v, pow2_bits(-k));
        if (r < nr && chunk == 0) p.row_scales[bc * p.row_scales_ld + r0 + r] = pow2_bits(k);
      }
    }
    __syncthreads();
    s.amax[h * kBlock + c] = column_amax(tile, VecTileSmem::kPitch, c, h);
    __syncthreads();
    const int k = scale_exponent_bits(max(s.amax[c], s.amax[kBlock + c]));
    if (h == 0 && c < nc) p.scales_t[br * p.scales_t_ld + c0 + c] = pow2_bits(k);
    uint32_t q[16];
    column_codes(tile, VecTileSmem::kPitch, c, h, pow2_bits(-k), q);
    store_transposed(reinterpret_cast<uint32_t*>(s.rows), q, p.codes_t, p.codes_t_ld, r0, c0, nr, nc);
  }
}

// ---- 128x128 blocks of a stack of matrices ----

struct BlocksParams {
  const uint16_t* w;
  int64_t batch, rows, cols, batch_stride;
  uint8_t* codes;
  float* scales;
  uint8_t* codes_t;
  float* scales_t;
  NonFiniteRecord* rec;
  int64_t row_tiles, col_tiles;
};

__global__ void __launch_bounds__(kThreads) quantize_blocks_kernel(const BlocksParams p) {
  __shared__ TileSmem s;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t per_matrix = p.row_tiles * p.col_tiles;
  for (int64_t t = blockIdx.x; t < p.batch * per_matrix; t += gridDim.x) {
    const int64_t e = t / per_matrix, br = (t - e * per_matrix) / p.col_tiles;
    const int64_t bc = t - e * per_matrix - br * p.col_tiles;
    const int64_t r0 = br * kBlock, c0 = bc * kBlock;
    const int nr = static_cast<int>(min(int64_t{kBlock}, p.rows - r0));
    const int nc = static_cast<int>(min(int64_t{kBlock}, p.cols - c0));
    const uint32_t part =
        load_tile(s, p.w + e * p.batch_stride, p.cols, p.cols, r0, c0, nr, nc, e * p.rows, p.rec);
    const uint32_t warp_amax = __reduce_max_sync(0xFFFFFFFFu, part);
    if (lane == 0) s.amax[warp] = warp_amax;
    __syncthreads();
    uint32_t amax = 0;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) amax = max(amax, s.amax[i]);
    const int k = scale_exponent_bits(amax);
    const float inv = pow2_bits(-k);
    if (threadIdx.x == 0) {
      p.scales[(e * p.row_tiles + br) * p.col_tiles + bc] = pow2_bits(k);
      if (p.scales_t) p.scales_t[(e * p.col_tiles + bc) * p.row_tiles + br] = pow2_bits(k);
    }
    // Row-major codes, from the tile rows this warp loaded.
    for (int r = warp; r < nr; r += kWarps) {
      const uint32_t lo = s.words[r * kTileWordPitch + lane], hi = s.words[r * kTileWordPitch + 32 + lane];
      store_segment(p.codes + (e * p.rows + r0 + r) * p.cols + c0, nc, lane,
                    encode2(static_cast<uint16_t>(lo), static_cast<uint16_t>(lo >> 16), inv),
                    encode2(static_cast<uint16_t>(hi), static_cast<uint16_t>(hi >> 16), inv));
    }
    if (p.codes_t) {  // uniform over the launch
      uint32_t q[16];
      column_codes(tile_of(s), kTilePitch, threadIdx.x & (kBlock - 1), threadIdx.x >> 7, inv, q);
      store_transposed(s.words, q, p.codes_t + e * p.cols * p.rows, p.rows, r0, c0, nr, nc);
    } else {
      __syncthreads();  // s.amax and the tile are read before the next tile overwrites them
    }
  }
}

// ---- 1x128 rows back to bf16 ----

struct DequantParams {
  const uint8_t* codes;
  int64_t rows, cols, codes_ld;
  const float* scales;
  int64_t scales_ld;
  __nv_bfloat16* out;
  int64_t ld;
  const int64_t* rows_limit;
};

// The vector path (dequantize_rows_1x128 picks it when cols, the codes and their ld allow 16-byte
// loads and out and its ld 16-byte stores): a thread per 16 codes of a row (one 16-byte load, one
// scale, two 16-byte stores), where the scalar path below moves one byte per thread. The same math
// per value (the e4m3 value, exact in fp16, times the power-of-two scale, rounded to bf16: exact).
__global__ void __launch_bounds__(kThreads) dequantize_rows_vec_kernel(const DequantParams p) {
  const int64_t chunks = p.cols / 16;
  const int64_t n = live_rows(p.rows, p.rows_limit) * chunks;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads) {
    const int64_t r = i / chunks, c = (i - r * chunks) * 16;
    const uint4 w = *reinterpret_cast<const uint4*>(p.codes + r * p.codes_ld + c);
    const float scale = p.scales[(c / kBlock) * p.scales_ld + r];
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
    uint32_t out[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>(words[j / 2] >> (16 * (j % 2)));
      const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
      const __nv_bfloat162 b = __floats2bfloat162_rn(f.x * scale, f.y * scale);
      out[j] = *reinterpret_cast<const uint32_t*>(&b);
    }
    uint4* dst = reinterpret_cast<uint4*>(p.out + r * p.ld + c);
    dst[0] = make_uint4(out[0], out[1], out[2], out[3]);
    dst[1] = make_uint4(out[4], out[5], out[6], out[7]);
  }
}

__global__ void __launch_bounds__(kThreads) dequantize_rows_kernel(const DequantParams p) {
  const int64_t n = live_rows(p.rows, p.rows_limit) * p.cols;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads) {
    const int64_t r = i / p.cols, c = i - r * p.cols;
    const __half_raw h = __nv_cvt_fp8_to_halfraw(p.codes[r * p.codes_ld + c], __NV_E4M3);
    const float v = __half2float(__half(h)) * p.scales[(c / kBlock) * p.scales_ld + r];
    p.out[r * p.ld + c] = __float2bfloat16_rn(v);
  }
}

// ---- host-side checks ----

std::string str(int64_t v) { return std::to_string(v); }

void check_extent(const char* arg, int64_t v) {
  if (v < 0) throw_invalid(arg, ">= 0", str(v));
}

// A device pointer of `align`-byte elements; nullptr only when nothing is to be accessed.
void check_ptr(const char* arg, const void* p, size_t align, bool needed) {
  if (!needed) return;
  if (p == nullptr) throw_invalid(arg, "a device pointer", "nullptr");
  if (reinterpret_cast<uintptr_t>(p) % align != 0) {
    throw_invalid(arg, "a " + std::to_string(align) + "-byte aligned device pointer", "a misaligned pointer");
  }
}

// Resolves a leading dimension (0 = fallback) and checks it is >= min_value (named min_name)
// and, if multiple > 1, a multiple of it.
int64_t resolve_ld(const char* arg, int64_t ld, int64_t fallback, int64_t min_value, const char* min_name,
                   int64_t multiple) {
  if (ld < 0) throw_invalid(arg, std::string(">= 0 (0 = ") + min_name + ")", str(ld));
  const int64_t v = ld == 0 ? fallback : ld;
  std::string expected = std::string(">= ") + min_name + " = " + str(min_value);
  if (multiple > 1) expected = "a multiple of " + str(multiple) + " " + expected;
  if (v < min_value || v % multiple != 0) {
    throw_invalid(arg, expected, ld == 0 ? str(v) + " (0 = " + min_name + ")" : str(v));
  }
  return v;
}

void check_record(const NonFiniteRecord* rec) {
  if (rec == nullptr) throw_invalid("a.nonfinite", "a device NonFiniteRecord", "nullptr");
}

unsigned grid_for(int64_t work_items) {
  return static_cast<unsigned>(std::clamp<int64_t>(work_items, 1, kMaxGrid));
}

}  // namespace

void reset_nonfinite(NonFiniteRecord* dev, cudaStream_t stream) {
  if (dev == nullptr) throw_invalid("nonfinite", "a device NonFiniteRecord", "nullptr");
  host::check_cuda(cudaMemsetAsync(dev, 0xFF, sizeof(NonFiniteRecord), stream), "reset_nonfinite");
}

void check_nonfinite(const NonFiniteRecord* dev, int64_t cols, const char* name, cudaStream_t stream) {
  if (dev == nullptr) throw_invalid("nonfinite", "a device NonFiniteRecord", "nullptr");
  check_extent("cols", cols);
  NonFiniteRecord h{};
  host::check_cuda(cudaMemcpyAsync(&h, dev, sizeof h, cudaMemcpyDeviceToHost, stream), "check_nonfinite copy");
  host::check_cuda(cudaStreamSynchronize(stream), "check_nonfinite sync");
  if (h.first == ~0ull) return;
  const std::string tensor = name ? name : "(unnamed tensor)";
  const std::string where = cols > 0 ? "at row " + std::to_string(h.first / cols) + ", column " +
                                           std::to_string(h.first % cols)
                                     : "at element " + std::to_string(h.first);
  throw Error(Status::kInvalidArgument, "mok fp8: non-finite value in " + tensor + " " + where);
}

void quantize_rows_1x128(const QuantizeRowsArgs& a, cudaStream_t stream) {
  check_extent("a.rows", a.rows);
  check_extent("a.cols", a.cols);
  check_record(a.nonfinite);
  const int64_t ld = resolve_ld("a.ld", a.ld, a.cols, a.cols, "cols", 1);
  const int64_t codes_ld = resolve_ld("a.codes_ld", a.codes_ld, a.cols, a.cols, "cols", 16);
  const int64_t blocks_per_row = (a.cols + kBlock - 1) / kBlock;
  if (a.scales_row_stride < 0 || (a.scales_row_stride > 0 && a.scales_row_stride < blocks_per_row)) {
    throw_invalid("a.scales_row_stride", "0 (K-block major scales) or >= the blocks of a row = " + str(blocks_per_row),
                  str(a.scales_row_stride));
  }
  const bool by_row = a.scales_row_stride > 0;
  const int64_t scales_ld = by_row ? 1 : resolve_ld("a.scales_ld", a.scales_ld, a.rows, a.rows, "rows", 1);
  const bool work = a.rows > 0 && a.cols > 0;
  check_ptr("a.x", a.x, 2, work);
  check_ptr("a.codes", a.codes, 1, work);
  check_ptr("a.scales", a.scales, 4, work);
  if (!work) return;
  RowsParams p{reinterpret_cast<const uint16_t*>(a.x), a.rows, a.cols, ld, a.codes, codes_ld, a.scales,
               scales_ld, by_row ? a.scales_row_stride : 1, a.nonfinite, blocks_per_row, a.rows_limit};
  const int64_t units = a.rows * p.blocks_per_row;
  const bool vec = a.cols % 8 == 0 && ld % 8 == 0 && codes_ld % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(a.x) % 16 == 0 && reinterpret_cast<uintptr_t>(a.codes) % 8 == 0;
  if (vec) {
    quantize_rows_vec_kernel<<<grid_for((units + 2 * kWarps - 1) / (2 * kWarps)), kThreads, 0, stream>>>(p);
  } else {
    quantize_rows_kernel<<<grid_for((units + kWarps - 1) / kWarps), kThreads, 0, stream>>>(p);
  }
  host::check_cuda(cudaGetLastError(), "quantize_rows_1x128 launch");
}

void quantize_cols_128x1_transposed(const QuantizeColsArgs& a, cudaStream_t stream) {
  check_extent("a.rows", a.rows);
  check_extent("a.cols", a.cols);
  check_record(a.nonfinite);
  const int64_t ld = resolve_ld("a.ld", a.ld, a.cols, a.cols, "cols", 1);
  const int64_t codes_t_ld = resolve_ld("a.codes_t_ld", a.codes_t_ld, a.rows, a.rows, "rows", 16);
  const int64_t scales_t_ld = resolve_ld("a.scales_t_ld", a.scales_t_ld, a.cols, a.cols, "cols", 1);
  const bool work = a.rows > 0 && a.cols > 0;
  check_ptr("a.x", a.x, 2, work);
  check_ptr("a.codes_t", a.codes_t, 1, work);
  check_ptr("a.scales_t", a.scales_t, 4, work);
  if (!work) return;
  const bool with_rows = a.row_codes != nullptr || a.row_scales != nullptr;
  int64_t row_codes_ld = 0, row_scales_ld = 0;
  if (with_rows) {
    if (a.row_codes == nullptr || a.row_scales == nullptr) {
      throw_invalid("a.row_codes, a.row_scales", "both set (the row quantization too) or both nullptr",
                    a.row_codes ? "row_scales nullptr" : "row_codes nullptr");
    }
    row_codes_ld = resolve_ld("a.row_codes_ld", a.row_codes_ld, a.cols, a.cols, "cols", 16);
    row_scales_ld = resolve_ld("a.row_scales_ld", a.row_scales_ld, a.rows, a.rows, "rows", 1);
    check_ptr("a.row_codes", a.row_codes, 1, work);
    check_ptr("a.row_scales", a.row_scales, 4, work);
  }
  ColsParams p{reinterpret_cast<const uint16_t*>(a.x), a.rows, a.cols, ld, a.codes_t, codes_t_ld, a.scales_t,
               scales_t_ld, a.nonfinite, (a.rows + kBlock - 1) / kBlock, (a.cols + kBlock - 1) / kBlock,
               a.rows_limit, nullptr, 0, nullptr, 0};
  const bool vec = a.cols % 8 == 0 && ld % 8 == 0 && reinterpret_cast<uintptr_t>(a.x) % 16 == 0;
  if (with_rows) {
    if (vec && reinterpret_cast<uintptr_t>(a.row_codes) % 8 == 0) {
      p.row_codes = a.row_codes;
      p.row_codes_ld = row_codes_ld;
      p.row_scales = a.row_scales;
      p.row_scales_ld = row_scales_ld;
    } else {  // the layouts do not share a pass: the row quantizer first (the same bits)
      QuantizeRowsArgs r;
      r.x = a.x;
      r.rows = a.rows;
      r.cols = a.cols;
      r.ld = ld;
      r.codes = a.row_codes;
      r.codes_ld = row_codes_ld;
      r.scales = a.row_scales;
      r.scales_ld = row_scales_ld;
      r.nonfinite = a.nonfinite;
      r.rows_limit = a.rows_limit;
      quantize_rows_1x128(r, stream);
    }
  }
  if (vec) {
    quantize_cols_vec_kernel<<<grid_for(p.row_tiles * p.col_tiles), kThreads, 0, stream>>>(p);
  } else {
    quantize_cols_kernel<<<grid_for(p.row_tiles * p.col_tiles), kThreads, 0, stream>>>(p);
  }
  host::check_cuda(cudaGetLastError(), "quantize_cols_128x1_transposed launch");
}

void dequantize_rows_1x128(const DequantizeRowsArgs& a, cudaStream_t stream) {
  check_extent("a.rows", a.rows);
  check_extent("a.cols", a.cols);
  const int64_t codes_ld = resolve_ld("a.codes_ld", a.codes_ld, a.cols, a.cols, "cols", 1);
  const int64_t scales_ld = resolve_ld("a.scales_ld", a.scales_ld, a.rows, a.rows, "rows", 1);
  const int64_t ld = resolve_ld("a.ld", a.ld, a.cols, a.cols, "cols", 1);
  const bool work = a.rows > 0 && a.cols > 0;
  check_ptr("a.codes", a.codes, 1, work);
  check_ptr("a.scales", a.scales, 4, work);
  check_ptr("a.out", a.out, 2, work);
  if (!work) return;
  DequantParams p{a.codes, a.rows, a.cols, codes_ld, a.scales, scales_ld, a.out, ld, a.rows_limit};
  const bool vec = a.cols % 16 == 0 && codes_ld % 16 == 0 && ld % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(a.codes) % 16 == 0 && reinterpret_cast<uintptr_t>(a.out) % 16 == 0;
  if (vec) {
    const int64_t threads = a.rows * (a.cols / 16);
    dequantize_rows_vec_kernel<<<grid_for((threads + kThreads - 1) / kThreads), kThreads, 0, stream>>>(p);
  } else {
    dequantize_rows_kernel<<<grid_for(std::min<int64_t>((a.rows * a.cols + kThreads - 1) / kThreads, 8192)),
                             kThreads, 0, stream>>>(p);
  }
  host::check_cuda(cudaGetLastError(), "dequantize_rows_1x128 launch");
}

void quantize_blocks_128x128(const QuantizeBlocksArgs& a, cudaStream_t stream) {
  check_extent("a.batch", a.batch);
  check_extent("a.rows", a.rows);
  check_extent("a.cols", a.cols);
  check_record(a.nonfinite);
  const int64_t stride =
      resolve_ld("a.batch_stride", a.batch_stride, a.rows * a.cols, a.rows * a.cols, "rows * cols", 1);
  if ((a.codes_t == nullptr) != (a.scales_t == nullptr)) {
    throw_invalid("a.codes_t, a.scales_t", "both set (transposed copy) or both nullptr",
                  a.codes_t ? "scales_t nullptr" : "codes_t nullptr");
  }
  const bool work = a.batch > 0 && a.rows > 0 && a.cols > 0;
  check_ptr("a.w", a.w, 2, work);
  check_ptr("a.codes", a.codes, 1, work);
  check_ptr("a.scales", a.scales, 4, work);
  check_ptr("a.scales_t", a.scales_t, 4, work && a.scales_t != nullptr);
  if (!work) return;
  BlocksParams p{reinterpret_cast<const uint16_t*>(a.w), a.batch, a.rows, a.cols, stride, a.codes, a.scales,
                 a.codes_t, a.scales_t, a.nonfinite, (a.rows + kBlock - 1) / kBlock,
                 (a.cols + kBlock - 1) / kBlock};
  quantize_blocks_kernel<<<grid_for(a.batch * p.row_tiles * p.col_tiles), kThreads, 0, stream>>>(p);
  host::check_cuda(cudaGetLastError(), "quantize_blocks_128x128 launch");
}

}  // namespace mok::gemm
