#include "gemm/gemm_host.hpp"

#include <cudaTypedefs.h>

#include <cstdlib>
#include <string>

#include "mok/error.hpp"

namespace mok::gemm::host {

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw Error(Status::kCudaError, std::string("mok gemm: ") + what + ": " + cudaGetErrorString(err));
  }
}

namespace {

// The driver entry point through the runtime, so libmok does not link libcuda: binaries then
// load on machines without a GPU driver (CPU tests, CI) and fail only when a GEMM is launched.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    check_cuda(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q),
               "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)");
    if (q != cudaDriverEntryPointSuccess || p == nullptr) {
      throw Error(Status::kCudaError, "mok gemm: the CUDA driver has no cuTensorMapEncodeTiled (needs a 12.0+ driver)");
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

}  // namespace

namespace {

CUtensorMap map_2d_or_3d(CUtensorMapDataType type, int elem_bytes, const void* base, int64_t batch, int64_t rows,
                         int64_t cols, int box_cols, int box_rows, const char* what, int64_t batch_stride,
                         CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B, int64_t ld = 0) {
  CUtensorMap map;
  const int64_t row = ld > 0 ? ld : cols;  // elements from one row to the next
  const int64_t stride = batch_stride > 0 ? batch_stride : rows * row;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(batch > 0 ? batch : 1)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(row) * elem_bytes, static_cast<cuuint64_t>(stride) * elem_bytes};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const cuuint32_t rank = batch > 0 ? 3 : 2;
  const CUresult r = tensor_map_encoder()(
      &map, type, rank, const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    throw Error(Status::kCudaError, std::string("mok gemm: cuTensorMapEncodeTiled for ") + what + " [" +
                                        std::to_string(batch) + ", " + std::to_string(rows) + ", " +
                                        std::to_string(cols) + "] (batch stride " + std::to_string(stride) +
                                        "): CUresult " + std::to_string(int(r)));
  }
  return map;
}

}  // namespace

CUtensorMap map_bf16(const void* base, int64_t batch, int64_t rows, int64_t cols, int box_cols, int box_rows,
                     const char* what, int64_t batch_stride) {
  return map_2d_or_3d(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, batch, rows, cols, box_cols, box_rows, what,
                      batch_stride);
}

CUtensorMap map_f32(const void* base, int64_t batch, int64_t rows, int64_t cols, int box_cols, int box_rows,
                    const char* what, int64_t batch_stride) {
  return map_2d_or_3d(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, base, batch, rows, cols, box_cols, box_rows, what,
                      batch_stride);
}

CUtensorMap map_e4m3(const void* base, int64_t batch, int64_t rows, int64_t cols, int box_cols, int box_rows,
                     const char* what, int64_t batch_stride, int64_t ld) {
  if (ld != 0 && (ld < cols || ld % 16 != 0)) {
    throw_invalid(std::string(what) + " row stride", "0 (= " + std::to_string(cols) + " columns) or a multiple of 16 >= it",
                  std::to_string(ld));
  }
  return map_2d_or_3d(CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, base, batch, rows, cols, box_cols, box_rows, what,
                      batch_stride, CU_TENSOR_MAP_SWIZZLE_128B, ld);
}

CUtensorMap map_f32_plain(const void* base, int64_t rows, int64_t cols, int box_cols, const char* what) {
  return map_2d_or_3d(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, base, 0, rows, cols, box_cols, 1, what, 0,
                      CU_TENSOR_MAP_SWIZZLE_NONE);
}

void check_multiple(const char* argument, int64_t value, int64_t multiple) {
  if (value <= 0 || value % multiple != 0) {
    throw_invalid(argument, "a positive multiple of " + std::to_string(multiple), std::to_string(value));
  }
}

void check_pointer(const char* argument, const void* ptr) {
  if (ptr == nullptr) throw_invalid(argument, "a device pointer", "nullptr");
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) {
    throw_invalid(argument, "a 16-byte aligned device pointer (TMA)", "a misaligned pointer");
  }
}

void check_segments(const Segments& seg) {
  if (seg.experts <= 0 || seg.experts > 65536) {
    throw_invalid("seg.experts", "in [1, 65536]", std::to_string(seg.experts));
  }
  if (seg.offsets == nullptr) throw_invalid("seg.offsets", "a device array of experts+1 ints", "nullptr");
  if (seg.rows == nullptr) throw_invalid("seg.rows", "a device array of experts ints", "nullptr");
  check_multiple("seg.buffer_rows", seg.buffer_rows, 128);
  if (seg.buffer_rows >= (int64_t{1} << 31)) {
    throw_invalid("seg.buffer_rows", "below 2^31", std::to_string(seg.buffer_rows));
  }
}

void check_launch(const Launch& launch) {
  if (launch.grid < 0) throw_invalid("launch.grid", ">= 0 (0 = one CTA per SM)", std::to_string(launch.grid));
  if (!(launch.timeout_s > 0)) throw_invalid("launch.timeout_s", "> 0", std::to_string(launch.timeout_s));
  if (launch.cluster < 0 || launch.cluster > 2) {
    throw_invalid("launch.cluster", "0 (default), 1 or 2", std::to_string(launch.cluster));
  }
}

int resolve_grid(const Launch& launch) {
  if (launch.grid > 0) return launch.grid;
  int device = 0, sms = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
  return sms;
}

uint64_t timeout_ns(const Launch& launch) { return static_cast<uint64_t>(launch.timeout_s * 1e9); }

int env_int(const char* name, int fallback, int lo, int hi, const char* what) {
  const char* v = std::getenv(name);
  if (v == nullptr) return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || x < lo || x > hi) {
    throw_invalid(name, std::string(what) + " in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]", v);
  }
  return static_cast<int>(x);
}

}  // namespace mok::gemm::host
