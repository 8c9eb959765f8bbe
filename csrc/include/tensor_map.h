// Host side: the TMA tensor maps every launch describes its operands with, and the launch
// error codes' messages.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

namespace megamoe {

typedef CUresult (*EncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// Tensor map of a row-major [rows, cols] matrix of elem_bytes-wide elements read or written in
// [box_rows, box_cols] boxes; the swizzle is the box row's span (128 or 64 bytes), as the wgmma
// descriptors and the epilogues' staging expect. 0, or an error code for
// tensor_map_error_string (the driver entry point is found through the runtime: no -lcuda).
static inline int encode_tiled_2d(CUtensorMap* map, CUtensorMapDataType dtype, int elem_bytes,
                                  const void* ptr, long long rows, long long cols, int box_rows,
                                  int box_cols) {
  static EncodeTiled encode = nullptr;
  if (encode == nullptr) {
    cudaDriverEntryPointQueryResult q;
    void* fn = nullptr;
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                       cudaEnableDefault, &q);
    if (err != cudaSuccess || q != cudaDriverEntryPointSuccess || fn == nullptr) return -1;
    encode = reinterpret_cast<EncodeTiled>(fn);
  }
  cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * elem_bytes};
  cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  cuuint32_t estr[2] = {1, 1};
  CUresult r = encode(map, dtype, 2, const_cast<void*>(ptr), dims, strides, box, estr,
                      CU_TENSOR_MAP_INTERLEAVE_NONE,
                      box_cols * elem_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B
                                                   : CU_TENSOR_MAP_SWIZZLE_64B,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? 0 : -2;
}

// bf16 [rows, cols] in [box_rows, box_cols] boxes
static inline int make_bf16_map(CUtensorMap* map, const void* ptr, long long rows,
                                long long cols, int box_rows, int box_cols) {
  return encode_tiled_2d(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, ptr, rows, cols, box_rows,
                         box_cols);
}

// e4m3 (as bytes) [rows, cols] in [box_rows, box_cols] boxes
static inline int make_e4m3_map(CUtensorMap* map, const void* ptr, long long rows,
                                long long cols, int box_rows, int box_cols) {
  return encode_tiled_2d(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, ptr, rows, cols, box_rows,
                         box_cols);
}

// What a launch's error code means: encode_tiled_2d's codes, else a cudaError_t.
static inline const char* tensor_map_error_string(int code) {
  if (code == -1) return "cuTensorMapEncodeTiled not found through the CUDA runtime";
  if (code == -2) return "cuTensorMapEncodeTiled rejected a tensor map";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // namespace megamoe
