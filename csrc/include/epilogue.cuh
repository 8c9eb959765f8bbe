// Epilogue building blocks: the bf16 tile store through shared memory, the SwiGLU forward and
// backward math, and the e4m3 quantization steps.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "ptx.cuh"

namespace megamoe {

// ---- bf16 store -------------------------------------------------------------------------------

// One [64 rows, 64] bf16 box of a warpgroup's staging tile (128-byte rows, 128-byte swizzle).
constexpr int STAGING_BOX_BYTES = 64 * 64 * 2;

// Writes the warpgroup's [64, 128] tile, pack(j, half) giving the bf16x2 pair of accumulator
// pair (j, half) (row 16 warp + lane / 4 + 8 half, columns 8 j + 2 (lane % 4) + {0, 1}), into
// its staging tile (two boxes at `tile`) and stores it at (col, row) of `map` by two bulk tensor
// stores from one thread. Waits on: the store engine having read the tile's previous store.
// Signals: nothing (the launch's end, or a later bulk_wait, completes the stores).
template <typename Pack>
__device__ __forceinline__ void store_bf16_tile(uint32_t tile, int cw, int warp, int lane,
                                                const CUtensorMap* map, int col, int row,
                                                Pack pack) {
  const bool leader = threadIdx.x % 128 == 0;
  if (leader) bulk_wait_read<0>();
  named_barrier(1 + cw, 128);
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // row r of the warpgroup's 64, column 8j + 2 (lane % 4): box j / 8, 16-byte chunk j % 8,
      // byte 4 (lane % 4) of it
      const int r = warp * 16 + lane / 4 + 8 * half;
      st_shared_b32(tile + (j / 8) * STAGING_BOX_BYTES + swizzled_offset<128>(r, j % 8) +
                        4 * (lane % 4),
                    pack(j, half));
    }
  }
  fence_proxy_async();  // the st.shared writes, before the store engine reads them
  named_barrier(1 + cw, 128);
  if (leader) {
    tma_store_2d(map, col, row, tile);
    tma_store_2d(map, col + 64, row, tile + STAGING_BOX_BYTES);
    bulk_commit();
  }
}

__device__ __forceinline__ uint32_t bf16x2_bits(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ float2 bf16x2_to_float2(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}

// ---- SwiGLU -----------------------------------------------------------------------------------

// The sigmoid of the bf16 epilogues and of every SwiGLU backward: 1 / (1 + __expf(-x)) with an
// approximate division (__fdividef: MUFU.RCP, ~2 ulp, relative accuracy kept for any x; the IEEE
// division's dependent chain set the pace of the SwiGLU backward).
__device__ __forceinline__ float sigmoid_approx(float x) {
  return __fdividef(1.0f, 1.0f + __expf(-x));
}

// h = silu(a1) a3 with the approximate division (the bf16 GEMM 1).
__device__ __forceinline__ float swiglu_approx(float a1, float a3) {
  return __fdividef(a1, 1.0f + __expf(-a1)) * a3;
}

// h = silu(a1) a3 with the IEEE division (the FP8 GEMM 1: h is quantized next, and matches the
// Triton kernel's rounding).
__device__ __forceinline__ float swiglu_ieee(float a1, float a3) {
  return a1 / (1.0f + __expf(-a1)) * a3;
}

// The SwiGLU backward of one element in the FP8 form: g = dh before the routing weight w, a1, a3
// the saved pre-activations; h = silu(a1) a3 (0 on padding rows: they add nothing to dw2),
// da1 = w g a3 silu'(a1), da3 = w g silu(a1).
__device__ __forceinline__ void swiglu_backward(float g, float a1, float a3, float w, bool live,
                                                float& h, float& da1, float& da3) {
  const float sig = sigmoid_approx(a1);
  const float silu = a1 * sig;
  h = live ? silu * a3 : 0.f;
  const float dh = g * w;
  da3 = dh * silu;
  da1 = dh * a3 * sig * (1.0f + a1 * (1.0f - sig));
}

// ---- FP8 quantize -----------------------------------------------------------------------------

// The recipe's scale of a block with maximum |v| amax (kernels/fp8_quant.quantize_block's).
__device__ __forceinline__ float e4m3_scale(float amax) { return fmaxf(amax, 1e-12f) / 448.0f; }

// Two values as packed e4m3 (round to nearest even, saturating), lo in the low byte.
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}

// The maximum over the quad's 4 lanes (the lanes holding one accumulator row).
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// v[0..8): one value per local column k = 2 jj + e (jj < 4) of this lane; returns in v[0] the
// maximum over the 8 lanes g = lane / 4 of the quad position lane % 4 for column k = g: three
// rounds, each sending the half the partner keeps and keeping the other half (7 shuffles).
__device__ __forceinline__ float transpose_max8(float (&v)[8], int lane) {
  const unsigned full = 0xffffffffu;
  const bool b = lane & 16, c = lane & 8, d = lane & 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float send = b ? v[i] : v[i + 4], keep = b ? v[i + 4] : v[i];
    v[i] = fmaxf(keep, __shfl_xor_sync(full, send, 16));
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float send = c ? v[i] : v[i + 2], keep = c ? v[i + 2] : v[i];
    v[i] = fmaxf(keep, __shfl_xor_sync(full, send, 8));
  }
  const float send = d ? v[0] : v[1], keep = d ? v[1] : v[0];
  return fmaxf(keep, __shfl_xor_sync(full, send, 4));
}

}  // namespace megamoe
