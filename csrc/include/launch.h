// Host side: the persistent launch every kernel uses, and the error-string entry point each
// library exports.
#pragma once

#include <cuda_runtime.h>

#include "tensor_map.h"

namespace megamoe {

// Launches KERNEL persistently: exactly the CTAs that fit at once (one per SM for these
// kernels), so none starts after the others finish. The first launch of each KERNEL raises its
// shared-memory limit and asks the occupancy API how many fit; later launches reuse the answer.
// Returns 0 or a cudaError_t.
template <auto KERNEL, typename... Args>
static int launch_persistent(int smem_bytes, int threads, int num_sms, cudaStream_t stream,
                             const Args&... args) {
  static int max_ctas = 0;
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  if (max_ctas == 0) {
    cudaError_t err =
        cudaFuncSetAttribute(KERNEL, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (err != cudaSuccess) return static_cast<int>(err);
    cfg.gridDim = dim3(num_sms);
    int n = 0;
    err = cudaOccupancyMaxActiveClusters(&n, KERNEL, &cfg);
    if (err != cudaSuccess) return static_cast<int>(err);
    max_ctas = n > 0 ? min(n, num_sms) : num_sms;
  }
  cfg.gridDim = dim3(max_ctas);
  cudaError_t err = cudaLaunchKernelEx(&cfg, KERNEL, args...);
  return static_cast<int>(err != cudaSuccess ? err : cudaGetLastError());
}

}  // namespace megamoe

// Every library's message for a launch's nonzero return code.
extern "C" const char* megamoe_error_string(int code) {
  return megamoe::tensor_map_error_string(code);
}
