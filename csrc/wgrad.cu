// wgrad: the backward's weight gradients, dw[e] = A_e^T B_e summed over the rows of expert e's
// segment (K-grouped), fp32 accumulation in a fixed order.
//   bf16: bf16_grouped_gemm.cuh's WGRAD_* modes (the token operand gathered inside, or both
//         operands from pre-gathered row-space tensors).
//   FP8:  the kernel below (operands transposed and quantized per 128 rows beforehand).
// Shapes are checked by the Python wrapper (ops/hopper/cuda/wgrad.py). Each entry point returns
// 0, or a negative code / CUDA error number (megamoe_error_string gives the message).

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "include/bf16_grouped_gemm.cuh"
#include "include/epilogue.cuh"
#include "include/fp8_mma.cuh"
#include "include/launch.h"
#include "include/launch_params.h"
#include "include/ptx.cuh"
#include "include/ring.cuh"
#include "include/scheduler.cuh"
#include "include/tensor_map.h"

namespace megamoe {
namespace fp8 {

// ---- FP8: the weight gradients (K-grouped over each expert's segment) -------------------------
// dw[e] [M, N] = sum over the rows r of expert e's segment of A^T[m, r] B^T[n, r] * sa[m, r/128]
// * sb[n, r/128]: A^T [M, R] and B^T [N, R] e4m3 (rows contiguous: K-major), scaled per column
// and 128 rows (their scales [M, R/128], [N, R/128]); out bf16 [E, M, N]. The plan's segments
// start on 128-row boundaries and their padding rows are zeros, so the K loop runs the
// expert's steps up to its last real row; an expert without rows gets zeros.
// Unit: (expert, 128-row M tile, 128-column N tile), experts in the given order (longest
// first). The experts' K lengths differ, so units are handed out dynamically: the producer's
// thread 0 takes the next number from a global ticket (zeroed again by the CTA taking the last
// number) and passes it to its warpgroup (named barrier 4) and to the consumers (a 2-slot ring,
// unit_full / unit_empty), so the CTAs walk one global order however they drift apart.
// Per K step the producer's thread 0 loads the A and B boxes by TMA (expect_tx 32 KiB) and all
// 128 producer threads copy one A scale and one B scale each (cp.async, 4 bytes) into the
// stage's scale area; full[s] takes 129 arrivals. The consumers read the scales of their 2 rows
// and 32 columns from shared memory before the stage's wgmmas, and promote with both:
// acc += partial * sa[row] * sb[column]. Epilogue: store_bf16_tile.
constexpr int WG_STAGES = 5;  // 6 x 33 KiB + the staging would not fit
constexpr int WG_SCALE_BYTES = 2 * 128 * 4;  // [A's 128 rows | B's 128 columns] fp32
constexpr int WG_STAGE_BYTES = A_BYTES + BOX_BYTES + WG_SCALE_BYTES;  // 33 KiB, 1024-aligned
constexpr int WG_EPI_BYTES = 2 * 2 * EPI_BOX_BYTES;
constexpr int WG_SMEM_BYTES =
    WG_STAGES * WG_STAGE_BYTES + WG_EPI_BYTES + (2 * WG_STAGES + 4) * 8 + 16 + 1024;
static_assert(WG_SMEM_BYTES <= 227 * 1024, "shared memory: fewer stages");

struct WgradKernelParams {
  const float* a_scale;  // [M, R/128], row stride stride_as
  const float* b_scale;  // [N, R/128], row stride stride_bs
  long long stride_as;
  long long stride_bs;
  const int* seg_start;     // the plan's [E + 1]
  const int* count;         // real rows per expert [E]
  const int* expert_order;  // [E]
  int* ticket;              // a zeroed int (left zeroed)
  int E, M, N, group_m;
};

// a_map: A^T [M, R], b_map: B^T [N, R] (boxes [128, 128]); out_map: [E * M, N] bf16 (boxes [64, 64])
__global__ void __launch_bounds__(THREADS, 1)
    fp8_wgrad_kernel(const __grid_constant__ CUtensorMap a_map,
                     const __grid_constant__ CUtensorMap b_map,
                     const __grid_constant__ CUtensorMap out_map, const WgradKernelParams p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const SmemLayout<WG_STAGES, WG_STAGE_BYTES, WG_EPI_BYTES> smem(smem_raw);
  const uint32_t smem_base = smem.base;
  const uint32_t epi_smem = smem.epilogue();
  const UnitRing units = smem.units();

  const int tid = threadIdx.x;
  const int wg = tid / 128;
  if (tid == 0) {
    smem.ring().init(128 + 1);  // thread 0's expect_tx + 128 scale copiers
    units.init();
    mbar_init_fence();
    tma_prefetch_desc(&a_map);
    tma_prefetch_desc(&b_map);
  }
  __syncthreads();

  const int num_mt = p.M / BM;
  const int num_n = p.N / BN;
  const int per_expert = num_mt * num_n;
  const int num_units = p.E * per_expert;
  auto decode = [&](int u, int& pid_m, int& pid_n, int& row0, int& k_blocks) {
    grouped_tile(u % per_expert, num_mt, num_n, p.group_m, pid_m, pid_n);
    const int e = p.expert_order[u / per_expert];
    row0 = p.seg_start[e];
    k_blocks = (p.count[e] + BK - 1) / BK;
    return e;
  };

  if (wg == 0) {
    // ---------------- producer ----------------
    setmaxnreg_dec<PRODUCER_REGS>();
    const Ring<WG_STAGES> ring = smem.ring();
    int stage = 0;
    uint32_t phase = 0;
    for (int it = 0;; ++it) {
      const int slot = it & 1;
      if (tid == 0) units.publish(it, slot, p.ticket, num_units);
      named_barrier(4, 128);
      const int u = units.read(slot);
      if (u >= num_units) break;
      int pid_m, pid_n, row0, k_blocks;
      decode(u, pid_m, pid_n, row0, k_blocks);
      const float* sa = p.a_scale + (pid_m * BM + tid) * p.stride_as + row0 / BK;
      const float* sb = p.b_scale + (pid_n * BN + tid) * p.stride_bs + row0 / BK;
      for (int kb = 0; kb < k_blocks; ++kb) {
        mbar_wait(ring.empty(stage), phase ^ 1);
        const uint32_t a_smem = smem_base + stage * WG_STAGE_BYTES;
        const uint32_t b_smem = a_smem + A_BYTES;
        const uint32_t s_smem = b_smem + BOX_BYTES;
        const uint32_t full = ring.full(stage);
        if (tid == 0) {
          mbar_arrive_expect_tx(full, A_BYTES + BOX_BYTES);
          tma_load_2d(a_smem, &a_map, row0 + kb * BK, pid_m * BM, full);
          tma_load_2d(b_smem, &b_map, row0 + kb * BK, pid_n * BN, full);
        }
        cp_async_4(s_smem + 4 * tid, sa + kb);
        cp_async_4(s_smem + 512 + 4 * tid, sb + kb);
        cp_async_arrive_noinc(full);
        if (++stage == WG_STAGES) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
  } else {
    // ---------------- consumers ----------------
    setmaxnreg_inc<(65536 / 128 - PRODUCER_REGS) / 2 / 8 * 8>();
    const int cw = wg - 1;
    const int warp = (tid % 128) / 32;
    const int lane = tid % 32;
    const int r_in = cw * 64 + warp * 16 + lane / 4;
    const Ring<WG_STAGES> ring = smem.ring();
    int stage = 0;
    uint32_t phase = 0;
    float part[64];
    float acc[64];
    for (int it = 0;; ++it) {
      const int u = units.receive(it, cw);
      if (u >= num_units) break;
      int pid_m, pid_n, row0, k_blocks;
      const int expert = decode(u, pid_m, pid_n, row0, k_blocks);
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = 0.f;
      for (int kb = 0; kb < k_blocks; ++kb) {
        mbar_wait(ring.full(stage), phase);
        const uint32_t a_smem = smem_base + stage * WG_STAGE_BYTES + cw * 64 * BK;
        const uint32_t b_smem = smem_base + stage * WG_STAGE_BYTES + A_BYTES;
        const uint32_t s_smem = b_smem + BOX_BYTES;
        mma_issue(part, a_smem, b_smem);
        // the scales, read while the wgmmas run (the stage is not released before its wait)
        const float s0 = __uint_as_float(ld_shared_b32(s_smem + 4 * r_in));
        const float s1 = __uint_as_float(ld_shared_b32(s_smem + 4 * (r_in + 8)));
        float sb[32];
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const float2 v = ld_shared_f32x2(s_smem + 512 + 4 * (8 * j + 2 * (lane % 4)));
          sb[2 * j] = v.x;
          sb[2 * j + 1] = v.y;
        }
        wgmma_wait<0>();
        ring.release(stage, cw);  // the warpgroup's wgmmas and scale reads are done
        promote_cols(acc, part, s0, s1, sb);
        if (++stage == WG_STAGES) {
          stage = 0;
          phase ^= 1;
        }
      }
      store_bf16_tile(epi_smem + cw * 2 * EPI_BOX_BYTES, cw, warp, lane, &out_map, pid_n * BN,
                      expert * p.M + pid_m * BM + cw * 64, [&](int j, int h) {
                        return bf16x2_bits(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
                      });
    }
    if (tid % 128 == 0) bulk_wait<0>();
  }
}

}  // namespace fp8
}  // namespace megamoe

extern "C" int megamoe_wgrad(const WgradParams* a) {
  using namespace megamoe::bf16;
  const int M = a->M, N = a->N, m_split = a->m_split;
  if (a->regions > 1 && a->gather == 1) return -22;  // several plans: A (the rows) by TMA
  CUtensorMap rows_map, a_rows_map, out0_map, out1_map;
  int rc = make_map(&rows_map, a->rows, a->num_rows, a->gather == 0 ? M : N, BK, 64);
  if (rc == 0) {
    rc = a->gather == 2 ? make_map(&a_rows_map, a->tokens, a->num_rows, M, BK, 64)
                        : (a_rows_map = rows_map, 0);
  }
  if (a->out_f32) {  // written from the registers: the maps are placeholders
    out0_map = out1_map = rows_map;
  } else {
    if (rc == 0) {
      rc = make_map(&out0_map, a->out0, static_cast<long long>(a->E) * m_split, N, 64, 64);
    }
    if (rc == 0) {
      rc = make_map(&out1_map, M > m_split ? a->out1 : a->out0,
                    static_cast<long long>(a->E) * m_split, N, 64, 64);
    }
  }
  if (rc != 0) return rc;
  KernelParams p = {};
  if (a->out_f32) {
    p.out_f32[0] = static_cast<float*>(a->out0);
    p.out_f32[1] = static_cast<float*>(M > m_split ? a->out1 : a->out0);
    p.f32_accumulate = a->out_f32 == 2;
  }
  p.x = static_cast<const __nv_bfloat16*>(a->tokens);
  p.stride_x = a->stride_tokens;
  p.h = static_cast<__nv_bfloat16*>(a->out0);
  p.a = static_cast<__nv_bfloat16*>(M > m_split ? a->out1 : a->out0);
  p.stride_h = N;
  p.row_slot = a->row_slot;
  p.seg_start = a->seg_start;
  p.count = a->count;
  p.regions = a->regions > 1 ? a->regions : 1;
  p.expert_order = a->expert_order;
  p.num_experts = a->E;
  p.M = M;
  p.m_split = m_split;
  p.N = N;
  p.top_k = a->top_k;
  p.group_m = 1;
  p.ticket = a->ticket;
  cudaStream_t s = static_cast<cudaStream_t>(a->stream);
  // B by TMA travels in w1_map, A by TMA in in_map
  if (a->gather == 2) {
    return launch<WGRAD_TMA>(rows_map, rows_map, out0_map, out1_map, a_rows_map, p, a->num_sms,
                             s);
  }
  if (a->gather == 1) {
    return launch<WGRAD_GATHER_A>(rows_map, rows_map, out0_map, out1_map, rows_map, p,
                                  a->num_sms, s);
  }
  return launch<WGRAD_GATHER_B>(rows_map, rows_map, out0_map, out1_map, rows_map, p, a->num_sms,
                                s);
}

extern "C" int megamoe_fp8_wgrad(const Fp8WgradParams* a) {
  using namespace megamoe::fp8;
  CUtensorMap a_map, b_map, out_map;
  int rc = megamoe::make_e4m3_map(&a_map, a->at, a->M, a->rows, BM, BK);
  if (rc == 0) rc = megamoe::make_e4m3_map(&b_map, a->bt, a->N, a->rows, BN, BK);
  if (rc == 0) {
    rc = megamoe::make_bf16_map(&out_map, a->out, static_cast<long long>(a->E) * a->M, a->N, 64,
                                64);
  }
  if (rc != 0) return rc;
  WgradKernelParams p = {};
  p.a_scale = a->at_scale;
  p.b_scale = a->bt_scale;
  p.stride_as = a->stride_as;
  p.stride_bs = a->stride_bs;
  p.seg_start = a->seg_start;
  p.count = a->count;
  p.expert_order = a->expert_order;
  p.ticket = a->ticket;
  p.E = a->E;
  p.M = a->M;
  p.N = a->N;
  p.group_m = a->group_m;
  return megamoe::launch_persistent<fp8_wgrad_kernel>(WG_SMEM_BYTES, THREADS, a->num_sms,
                                                      static_cast<cudaStream_t>(a->stream),
                                                      a_map, b_map, out_map, p);
}
