// Host-side helpers of the grouped GEMM launchers: TMA descriptor encoding, argument
// validation (mok::Error naming the argument), grid size and CUDA error checks.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "gemm/gemm_config.hpp"
#include "gemm/grouped_gemm.hpp"

namespace mok::gemm::host {

// Row-major bf16 matrix [rows, cols] (or a stack [batch, rows, cols] when batch > 0, matrix b
// at base + b * batch_stride elements; 0: rows * cols) viewed by TMA with boxes of
// box_cols x box_rows elements and the 128-byte swizzle. Elements outside the matrix read as
// zero and are never written by stores.
CUtensorMap map_bf16(const void* base, int64_t batch, int64_t rows, int64_t cols, int box_cols,
                     int box_rows, const char* what, int64_t batch_stride = 0);
// The same for fp32 (box_cols <= 32: 128-byte box rows under the swizzle).
CUtensorMap map_f32(const void* base, int64_t batch, int64_t rows, int64_t cols, int box_cols,
                    int box_rows, const char* what, int64_t batch_stride = 0);
// e4m3 codes (bytes) [batch,] rows, cols with the 128-byte swizzle (box_cols <= 128).
// ld: bytes from one row to the next (0 = cols; a multiple of 16 >= cols).
CUtensorMap map_e4m3(const void* base, int64_t batch, int64_t rows, int64_t cols, int box_cols,
                     int box_rows, const char* what, int64_t batch_stride = 0, int64_t ld = 0);
// fp32 [rows, cols] without swizzle, boxes of box_cols x 1 (the FP8 A scales: one K block's
// row scales of a tile, contiguous).
CUtensorMap map_f32_plain(const void* base, int64_t rows, int64_t cols, int box_cols, const char* what);

// Throws unless `value` is a positive multiple of `multiple`.
void check_multiple(const char* argument, int64_t value, int64_t multiple);
void check_pointer(const char* argument, const void* ptr);  // non-null and 16-byte aligned
void check_segments(const Segments& seg);
void check_launch(const Launch& launch);

#ifdef MOK_GEMM_TRACE
// Developer build: device buffer [kTraceCtas][kTraceTiles][kTraceSlots] of u64 that the next
// launches fill with per-tile phase clocks (sm90_pipeline.cuh), or nullptr.
inline unsigned long long*& trace_buffer() {
  static unsigned long long* buffer = nullptr;
  return buffer;
}
#endif

int resolve_grid(const Launch& launch);  // launch.grid or the SM count of the current device
uint64_t timeout_ns(const Launch& launch);
// For the layers above (the GEMM engine itself reads no environment variable): `fallback` when
// environment variable `name` is unset, else its value, which must be a whole decimal number in
// [lo, hi] (anything else throws kInvalidArgument naming the variable and "<what> in [lo, hi]").
int env_int(const char* name, int fallback, int lo, int hi, const char* what);
void check_cuda(cudaError_t err, const char* what);  // throws Error(kCudaError)

}  // namespace mok::gemm::host
