// What the persistent sm90 kernels of csrc/ share besides PTX: the grouped tile order (device)
// and the bf16 tensor maps their TMA loads and bulk stores use (host).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace megamoe {

// Tile t of num_m x num_n in the grouped order: GROUP_M consecutive M tiles sweep one N tile
// together, so the weight tile they share is reused from L2.
__device__ __forceinline__ void grouped_tile(int t, int num_m, int num_n, int group_m, int& pid_m,
                                             int& pid_n) {
  const int per_group = group_m * num_n;
  const int first_m = (t / per_group) * group_m;
  const int size = min(num_m - first_m, group_m);
  pid_m = first_m + (t % per_group) % size;
  pid_n = (t % per_group) / size;
}

typedef CUresult (*EncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// Tensor map of a [rows, cols] row-major bf16 matrix, boxes of box_rows x box_cols, stored in
// shared memory with the box_cols * 2-byte swizzle (128 or 64: the layouts smem_desc_swizzled
// and swizzled_offset describe); l2_promotion: CUtensorMapL2promotion (0 none ... 3 256 B).
// Returns 0, -1 (no cuTensorMapEncodeTiled) or -2 (map rejected): see tensor_map_error.
static int make_bf16_map(CUtensorMap* map, const void* ptr, long long rows, long long cols,
                         int box_rows, int box_cols, int l2_promotion) {
  static EncodeTiled encode = nullptr;
  if (encode == nullptr) {
    cudaDriverEntryPointQueryResult q;
    void* fn = nullptr;
    cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q);
    if (err != cudaSuccess || q != cudaDriverEntryPointSuccess || fn == nullptr) return -1;
    encode = reinterpret_cast<EncodeTiled>(fn);
  }
  cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};
  cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  cuuint32_t estr[2] = {1, 1};
  CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(ptr), dims,
                      strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                      box_cols * 2 == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
                      static_cast<CUtensorMapL2promotion>(l2_promotion),
                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? 0 : -2;
}

// The message of make_bf16_map's codes, or nullptr for any other code.
static const char* tensor_map_error(int code) {
  if (code == -1) return "cuTensorMapEncodeTiled not found through the CUDA runtime";
  if (code == -2) return "cuTensorMapEncodeTiled rejected a tensor map";
  return nullptr;
}

}  // namespace megamoe
