// The FP8 main-loop blocks: the tile constants the FP8 kernels share, one K step's e4m3 wgmmas,
// and the promotion of their reduced-precision partial into the fp32 accumulator (Hopper's FP8
// MMA accumulates with reduced precision, so every 128 of K is promoted with its scales).
#pragma once

#include <stdint.h>

#include "ptx.cuh"

namespace megamoe {
namespace fp8 {

constexpr int BM = 128;
constexpr int BN = 128;
constexpr int BK = 128;  // e4m3 elements = bytes: one 128-byte swizzle row, one scale block
constexpr int CHUNKS = BK / 16;
constexpr int ROWS_PER_PASS = 128 / CHUNKS;
constexpr int PASSES = BM / ROWS_PER_PASS;
constexpr int A_BYTES = BM * BK;
constexpr int BOX_BYTES = BN * BK;  // one [128 rows, 128] weight box
constexpr int THREADS = 384;
constexpr int PRODUCER_REGS = 40;
constexpr int EPI_BOX_BYTES = 64 * 64 * 2;  // bf16 staging: [64 rows, 64], per half tile

// partial (one K step, fp32) * scale of its row, added into acc: the promotion. acc[4 j + 2 h +
// e] is row (warp 16 + lane / 4 + 8 h), column 8 j + 2 (lane % 4) + e of the warpgroup's tile.
__device__ __forceinline__ void promote(float* acc, float* part, float s0, float s1) {
#pragma unroll
  for (int i = 0; i < 64; ++i) fence_reg(part[i]);  // not read before the wgmma wait
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    acc[4 * j + 0] += part[4 * j + 0] * s0;
    acc[4 * j + 1] += part[4 * j + 1] * s0;
    acc[4 * j + 2] += part[4 * j + 2] * s1;
    acc[4 * j + 3] += part[4 * j + 3] * s1;
  }
}

// One K step's 4 wgmmas into part, committed as one group (not waited for).
__device__ __forceinline__ void mma_issue(float* part, uint32_t a_smem, uint32_t b_smem) {
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < BK / 32; ++k) {
    wgmma_m64n128k32_e4m3(part, smem_desc_swizzled<128>(a_smem + k * 32),
                          smem_desc_swizzled<128>(b_smem + k * 32), k > 0 ? 1 : 0);
  }
  wgmma_commit();
}

// promote with one scale per row (sa0, sa1: the thread's two rows) and one per column (sb[2 j +
// e]: column 8 j + 2 (lane % 4) + e)
__device__ __forceinline__ void promote_cols(float* acc, float* part, float sa0, float sa1,
                                             const float* sb) {
#pragma unroll
  for (int i = 0; i < 64; ++i) fence_reg(part[i]);
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    acc[4 * j + 0] += part[4 * j + 0] * (sa0 * sb[2 * j]);
    acc[4 * j + 1] += part[4 * j + 1] * (sa0 * sb[2 * j + 1]);
    acc[4 * j + 2] += part[4 * j + 2] * (sa1 * sb[2 * j]);
    acc[4 * j + 3] += part[4 * j + 3] * (sa1 * sb[2 * j + 1]);
  }
}

}  // namespace fp8
}  // namespace megamoe
