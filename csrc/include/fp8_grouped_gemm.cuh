// The blockwise-FP8 grouped GEMM over a plan's row space, warp-specialized for Hopper (sm_90a):
// one kernel template whose MODE gives three kernel families their FP8 kernels (entry points in
// csrc/<family>.cu; the FP8 wgrad kernel is csrc/wgrad.cu's own). The Triton kernels of
// ops/hopper/kernels/ have the same contracts; the tuner keeps the faster.
//   gemm_rows (GEMM_ROWS):   out[r] = sum_kb (A[r, kb] @ B[e]^T[kb]) * sa[r, kb] * sb[e, n, kb]
//     A e4m3 [R, K] (the row space, by TMA) with 1x128 scales sa [R, K/128]; B e4m3 [E, N, K]
//     with 128x128 block scales sb [E, N/128, K/128]; out bf16 [R, N]. GEMM 2 (A = h) and the
//     backward's dgrad of linear 1 (A = [da1 | da3], B = the transposed [w1; w3] copy).
//   gemm1_swiglu (GEMM1_SWIGLU): GEMM 1 on the token rows of x (gathered: row r reads
//     token row_slot[r] / top_k, padding rows read zeros), a1 against w1 and a3 against w3,
//     h = silu(a1) * a3 quantized in the epilogue to e4m3 with one scale per row of the tile's
//     128 columns (GEMM 2's A operand and its scales), optionally a = [a1 | a3] in bf16.
//   dgrad2_swiglu (DGRAD2_SWIGLU): dgrad of linear 2 and the SwiGLU backward. dhg = dy rows (gathered like
//     GEMM1_SWIGLU's x) @ w2[e] (B = the transposed [E, H, D] copy), then with the saved a = [a1 |
//     a3] and the routing weight w of the row: h = silu(a1) a3, dh = w dhg, da3 = dh silu(a1),
//     da1 = dh a3 sig (1 + a1 (1 - sig)). Outputs, each quantized where it sits in registers:
//     da = [da1 | da3] e4m3 [R, 2H] per row and 128 columns (dgrad of linear 1), da^T [2H, R]
//     and h^T [H, R] per 128 rows of a column (the weight gradients contract over rows; one
//     scale per column of the 128-row tile: the plan's 128-row segments keep one expert per
//     block), and part [H/128, R] = sum over the tile's columns of dhg h (d topk_weights).
//   dgrad2_swiglu rows (DGRAD2_SWIGLU_ROWS): the same main loop and SwiGLU backward, with the
//     outputs of kernels/swiglu_bwd_rows.py's quant form, for the bf16 weight gradients: da =
//     [da1 | da3] bf16 [R, 2H] (it may be the saved a itself: each element is read, then written,
//     by its own thread only), hw = w h bf16 [R, H], da in e4m3 per row and 128 columns (daq, das:
//     dgrad1's A operand) and part [H/128, R]. No dh round trip through memory.
//
// Tile: 128 rows x 128 output columns (GEMM1_SWIGLU: 128 columns of h, i.e. of a1 and of a3); K steps
// of 128 (one scale block; a row of 128 e4m3 is 128 bytes, the 128-byte swizzle's span).
// Promotion: Hopper's FP8 MMA accumulates with reduced precision, so each K step's wgmmas write
// a fresh fp32 partial (64 registers per thread), and after their wait the consumer adds
// partial * sa[row] * sb into its own fp32 accumulator, the recipe's promotion every 128 of K.
// The tensor cores are not idle meanwhile: the two consumer warpgroups run unsynchronized (each
// waits only on its own ring stages), so one promotes while the other's wgmmas run.
//
// Roles (384 threads, one CTA per SM, persistent; unit u = blockIdx.x + i * gridDim.x in the
// GROUP_M order of grouped_tile; units past the used rows or of tiles with tile_expert -1 are
// skipped by both roles alike):
//   warpgroup 0 (producer, 40 registers): per K step it waits `empty[s]`, then
//     GEMM_ROWS: thread 0 alone: arrive.expect_tx(full[s], 32 KiB), TMA loads of the A box [128
//       rows, 128] and the B box [128 rows, 128]; full[s] completes on that one arrival and the
//       bytes.
//     GEMM1_SWIGLU: thread 0: arrive.expect_tx(full[s], 32 KiB) and the w1 and w3 boxes by TMA; all
//       128 threads: 8 cp.async of 16 bytes (the gathered x rows in the swizzle pattern, zeros
//       for padding rows), then cp.async.mbarrier.arrive.noinc(full[s]); full[s] takes 129
//       arrivals and the bytes.
//     GEMM1_SWIGLU with ROWS_A: the x rows gathered into the row space before the launch
//       (zeros and scale 0 for padding rows); thread 0 alone, as GEMM_ROWS, with the w3 box too
//       (48 KiB). Faster where the gathered rows miss L2 (235B); both forms are L2-bound.
//   warpgroups 1, 2 (consumers, 232 registers): rows [0, 64) and [64, 128) of the tile. Per K
//     step: the next step's scales loaded (global, one step ahead: a busy L2's latency), wait
//     full[s] (GEMM1_SWIGLU: a proxy fence for the cp.async rows), 4 wgmma m64n128k32 into the
//     partial, wait, promote; GEMM1_SWIGLU does this twice (w1's box, then w3's). Then a warpgroup
//     barrier and ONE arrival per warpgroup on empty[s] (2 complete it).
//   Epilogue, GEMM_ROWS: the warpgroup's [64, 128] bf16 tile staged in shared memory (two [64, 64]
//     boxes, 128-byte swizzle) and written by bulk tensor stores; the staging buffer is reused
//     once the store engine has read it. GEMM1_SWIGLU: h and its scales (quad shuffles give the row
//     amax over the 4 lanes holding a row), and a, by plain global stores from registers.
//     DGRAD2_SWIGLU, in two passes over the registers (the values recomputed in the second: holding
//     all five would take 320 registers): pass 1 takes the row amaxes (quad shuffles), the
//     part sums and each column's amax over the thread's 2 rows, halved three times across
//     the 8 lanes sharing a column set (shuffles that trade half the values: 7 per 8
//     columns) and written per warp to shared memory; both consumer warpgroups meet at a
//     256-thread barrier, 256 threads reduce the 8 warps' maxima of the 384 (tensor, column)
//     pairs into scales (written to global) and reciprocals, a second barrier; pass 2
//     quantizes (v times the reciprocal of the scale) into five staging boxes per warpgroup
//     (da1, da3 rows [64, 128], 128-byte swizzle; h^T, da1^T, da3^T [128, 64], 64-byte
//     swizzle: conflict-free byte stores) and one thread issues their bulk tensor stores.
// Quantization matches ops/hopper/kernels/fp8_quant.quantize_block: scale = max(amax, 1e-12) /
// 448, q = e4m3(v / scale) (IEEE division, round to nearest even, saturating).
// Waits on: nothing outside the launch. Signals: nothing; the outputs are complete with it.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "epilogue.cuh"
#include "fp8_mma.cuh"
#include "launch.h"
#include "ptx.cuh"
#include "ring.cuh"
#include "scheduler.cuh"
#include "tensor_map.h"

namespace megamoe {
namespace fp8 {

enum Mode : int { GEMM_ROWS = 0, GEMM1_SWIGLU = 1, DGRAD2_SWIGLU = 2, DGRAD2_SWIGLU_ROWS = 3 };

// DGRAD2_SWIGLU's epilogue memory: per consumer warpgroup 5 staging boxes of [64 rows, 128] (or
// [128, 64]) e4m3, then the per-warp column maxima [8 warps][3 tensors][128] and the
// reciprocals of the column scales [3][128] (tensors: h, da1, da3)
constexpr int DS_BOX_BYTES = 64 * 128;
constexpr int DS_WG_BYTES = 5 * DS_BOX_BYTES;
constexpr int DS_COLMAX_BYTES = 8 * 3 * 128 * 4;
constexpr int DS_INV_BYTES = 3 * 128 * 4;

template <int MODE>
struct Layout {
  static constexpr int B_BYTES = (MODE == GEMM1_SWIGLU ? 2 : 1) * BOX_BYTES;
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  // 6 x 32 KiB where the epilogue needs no shared memory; 4 x 48 or 32 KiB
  static constexpr int STAGES = MODE == GEMM_ROWS || MODE == DGRAD2_SWIGLU_ROWS ? 6 : 4;
  static constexpr int EPI_BYTES =
      MODE == GEMM_ROWS ? 2 * 2 * EPI_BOX_BYTES
      : MODE == DGRAD2_SWIGLU ? 2 * DS_WG_BYTES + DS_COLMAX_BYTES + DS_INV_BYTES : 0;
  // + ring barriers, alignment
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + EPI_BYTES + 2 * STAGES * 8 + 1024;
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory: fewer stages");
};

struct KernelParams {
  const uint8_t* x;       // GEMM1_SWIGLU, DGRAD2_SWIGLU: token rows [T, K] e4m3 (x; dy), stride_x apart
  const float* a_scale;   // GEMM_ROWS: [R, K/128]; GEMM1_SWIGLU, DGRAD2_SWIGLU: [T, K/128]; row stride stride_as
  const float* b_scale;   // [E, N/128, K/128] (GEMM1_SWIGLU: w1's); strides stride_bse, stride_bsn
  const float* b3_scale;  // GEMM1_SWIGLU: w3's, same strides
  uint8_t* hq;            // GEMM1_SWIGLU: h [R, N] e4m3 (row stride N)
  float* hs;              // GEMM1_SWIGLU: h's scales [R, N/128] (row stride N/128)
  __nv_bfloat16* a;       // GEMM1_SWIGLU: nullptr or a = [a1 | a3] [R, 2N]
  const __nv_bfloat16* a_saved;  // DGRAD2_SWIGLU(_ROWS): the forward's a = [a1 | a3] [R, 2N]
  const float* tw;        // DGRAD2_SWIGLU(_ROWS): routing weights, by slot [T * top_k]
  float* das;             // DGRAD2_SWIGLU(_ROWS): da's row scales [R, 2N/128]
  float* hts;             // DGRAD2_SWIGLU: h^T's scales [N, R/128]
  float* dats;            // DGRAD2_SWIGLU: da^T's scales [2N, R/128]
  float* part;            // DGRAD2_SWIGLU(_ROWS): [N/128, R]
  long long rows;         // DGRAD2_SWIGLU(_ROWS): R (part's row length, the transposed outputs')
  const int* row_slot;
  const int* tile_expert;
  const int* num_rows_used;
  // GEMM_ROWS over one group of experts [e0, e0 + num_experts) (B holds only theirs, as expert -
  // e0): rows [seg_start[e0], seg_start[e0 + num_experts]) of the plan; seg_start nullptr:
  // rows [0, num_rows_used), every expert (expert_base 0)
  const int* seg_start;
  int expert_base;
  int num_experts;
  int N;
  int K;
  int top_k;
  int plan_bm;
  int group_m;
  long long stride_x;
  long long stride_as;
  long long stride_bse;
  long long stride_bsn;
  // last: the other modes' parameter offsets stay as they were
  __nv_bfloat16* da;      // DGRAD2_SWIGLU_ROWS: [R, 2N] (may be a_saved)
  __nv_bfloat16* hw;      // DGRAD2_SWIGLU_ROWS: [R, N]
  uint8_t* daq;           // DGRAD2_SWIGLU_ROWS: da in e4m3 [R, 2N]
};

// Both DGRAD2_SWIGLU epilogues: the thread's 2 rows' part sums and da1 / da3 amaxes summed and
// maxed over the quad (a row's 128 columns), part and da's row scales stored by lane 0 of the
// quad, the reciprocals of the scales returned.
__device__ __forceinline__ void row_scales_and_part(const KernelParams& p, long long row_g,
                                                    int pid_n, int q4, float (&psum)[2],
                                                    float (&ra1)[2], float (&ra3)[2],
                                                    float (&rinv1)[2], float (&rinv3)[2]) {
  const int N = p.N;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int m = 1; m <= 2; m *= 2) {
      psum[h] += __shfl_xor_sync(0xffffffffu, psum[h], m);
      ra1[h] = fmaxf(ra1[h], __shfl_xor_sync(0xffffffffu, ra1[h], m));
      ra3[h] = fmaxf(ra3[h], __shfl_xor_sync(0xffffffffu, ra3[h], m));
    }
    const float s1 = e4m3_scale(ra1[h]), s3 = e4m3_scale(ra3[h]);
    rinv1[h] = 1.0f / s1;
    rinv3[h] = 1.0f / s3;
    if (q4 == 0) {
      const long long r = row_g + 8 * h;
      p.part[pid_n * p.rows + r] = psum[h];
      p.das[r * (2 * N / BN) + pid_n] = s1;
      p.das[r * (2 * N / BN) + N / BN + pid_n] = s3;
    }
  }
}

// DGRAD2_SWIGLU's epilogue for the warpgroup's 64 rows (see the file comment). acc[4 j + 2 h + e]:
// row warp 16 + lane / 4 + 8 h of the warpgroup, column 8 j + 2 (lane % 4) + e of the tile.
// Both consumer warpgroups call it for the same tile (barrier 3 spans the two).
__device__ __forceinline__ void dgrad2_swiglu_epilogue(const float (&acc)[64], const KernelParams& p,
                                                 const CUtensorMap* daq_map,
                                                 const CUtensorMap* dat_map,
                                                 const CUtensorMap* ht_map, uint32_t epi_smem,
                                                 int pid_m, int pid_n, int cw, int warp, int lane,
                                                 const bool (&live)[2], const int (&slot)[2]) {
  const int N = p.N;
  const int q4 = lane % 4, g8 = lane / 4;
  const int r_wg = warp * 16 + g8;                  // + 8 h: the row within the warpgroup
  const long long row_g = pid_m * BM + cw * 64 + r_wg;  // + 8 h: the row of the row space
  const uint32_t stage = epi_smem + cw * DS_WG_BYTES;
  const uint32_t colmax = epi_smem + 2 * DS_WG_BYTES;
  const uint32_t inv_col = colmax + DS_COLMAX_BYTES;
  float w[2];
  const uint32_t* arow[2];  // this lane's bf16 pairs of a1 at arow[h][4 j], of a3 at + N / 2
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    w[h] = live[h] ? __ldg(p.tw + slot[h]) : 0.f;
    arow[h] = reinterpret_cast<const uint32_t*>(
        p.a_saved + (row_g + 8 * h) * (2LL * N) + pid_n * BN + 2 * q4);
  }
  auto values = [&](int j, int h, int e, float& hv, float& d1, float& d3) {
    const float2 a1 = bf16x2_to_float2(__ldg(arow[h] + 4 * j));
    const float2 a3 = bf16x2_to_float2(__ldg(arow[h] + N / 2 + 4 * j));
    swiglu_backward(acc[4 * j + 2 * h + e], e ? a1.y : a1.x, e ? a3.y : a3.x, w[h], live[h], hv,
                   d1, d3);
  };

  // pass 1: row amaxes of da1, da3, the part sums, column amaxes per warp
  float psum[2] = {0.f, 0.f}, ra1[2] = {0.f, 0.f}, ra3[2] = {0.f, 0.f};
#pragma unroll
  for (int quarter = 0; quarter < 4; ++quarter) {
    float cm[3][8];
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int j = 4 * quarter + jj;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float m0 = 0.f, m1 = 0.f, m3 = 0.f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float hv, d1, d3;
          values(j, h, e, hv, d1, d3);
          psum[h] += acc[4 * j + 2 * h + e] * hv;
          ra1[h] = fmaxf(ra1[h], fabsf(d1));
          ra3[h] = fmaxf(ra3[h], fabsf(d3));
          m0 = fmaxf(m0, fabsf(hv));
          m1 = fmaxf(m1, fabsf(d1));
          m3 = fmaxf(m3, fabsf(d3));
        }
        cm[0][2 * jj + e] = m0;
        cm[1][2 * jj + e] = m1;
        cm[2][2 * jj + e] = m3;
      }
    }
    // after the transpose this lane holds column 32 quarter + 8 (g / 2) + 2 q + g % 2 (local
    // column k = g of its quad position) over the warp's 16 rows
    const int col = 32 * quarter + 8 * (g8 >> 1) + 2 * q4 + (g8 & 1);
#pragma unroll
    for (int t = 0; t < 3; ++t) {
      const float m = transpose_max8(cm[t], lane);
      st_shared_b32(colmax + (((cw * 4 + warp) * 3 + t) * 128 + col) * 4, __float_as_uint(m));
    }
  }
  float rinv1[2], rinv3[2];
  row_scales_and_part(p, row_g, pid_n, q4, psum, ra1, ra3, rinv1, rinv3);
  const int t_wg = threadIdx.x % 128;
  if (t_wg == 0) bulk_wait_read<0>();  // the previous tile's staging has been read
  named_barrier(3, 256);               // both warpgroups' column maxima are in shared memory
  // the 384 (tensor, column) scales: max over the 8 warps, scale to global, reciprocal shared
  for (int pc = cw * 128 + t_wg; pc < 3 * 128; pc += 256) {
    const int t = pc / 128, c = pc % 128;
    float m = 0.f;
#pragma unroll
    for (int wi = 0; wi < 8; ++wi)
      m = fmaxf(m, __uint_as_float(ld_shared_b32(colmax + ((wi * 3 + t) * 128 + c) * 4)));
    const float sc = e4m3_scale(m);
    st_shared_b32(inv_col + pc * 4, __float_as_uint(1.0f / sc));
    const long long col = pid_n * BN + c;
    const long long stride_ts = p.rows / BM;
    if (t == 0) p.hts[col * stride_ts + pid_m] = sc;
    else p.dats[((t == 1 ? 0 : N) + col) * stride_ts + pid_m] = sc;
  }
  named_barrier(3, 256);  // the reciprocals are complete

  // pass 2: quantize into the staging boxes
  const uint32_t box_da1 = stage, box_da3 = stage + DS_BOX_BYTES;
  const uint32_t box_ht = stage + 2 * DS_BOX_BYTES, box_da1t = stage + 3 * DS_BOX_BYTES,
                 box_da3t = stage + 4 * DS_BOX_BYTES;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int c0 = 8 * j + 2 * q4;  // this lane's columns c0, c0 + 1 of the tile
    float ci[3][2];
#pragma unroll
    for (int t = 0; t < 3; ++t) {
      ci[t][0] = __uint_as_float(ld_shared_b32(inv_col + (t * 128 + c0) * 4));
      ci[t][1] = __uint_as_float(ld_shared_b32(inv_col + (t * 128 + c0 + 1) * 4));
    }
    float hv[2][2], d1[2][2], d3[2][2];  // [h][e]
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) values(j, h, e, hv[h][e], d1[h][e], d3[h][e]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r_wg + 8 * h;
      const uint32_t off = swizzled_offset<128>(r, j / 2) + 8 * (j % 2) + 2 * q4;
      st_shared_b16(box_da1 + off, e4m3x2(d1[h][0] * rinv1[h], d1[h][1] * rinv1[h]));
      st_shared_b16(box_da3 + off, e4m3x2(d3[h][0] * rinv3[h], d3[h][1] * rinv3[h]));
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      // transposed: row c0 + e of the box, bytes r (h = 0) and r + 8 (h = 1) of chunk warp
      const uint32_t off = swizzled_offset<64>(c0 + e, warp) + g8;
      const uint32_t qh = e4m3x2(hv[0][e] * ci[0][e], hv[1][e] * ci[0][e]);
      const uint32_t q1 = e4m3x2(d1[0][e] * ci[1][e], d1[1][e] * ci[1][e]);
      const uint32_t q3 = e4m3x2(d3[0][e] * ci[2][e], d3[1][e] * ci[2][e]);
      st_shared_b8(box_ht + off, qh);
      st_shared_b8(box_ht + off + 8, qh >> 8);
      st_shared_b8(box_da1t + off, q1);
      st_shared_b8(box_da1t + off + 8, q1 >> 8);
      st_shared_b8(box_da3t + off, q3);
      st_shared_b8(box_da3t + off + 8, q3 >> 8);
    }
  }
  fence_proxy_async();  // the st.shared writes, before the store engine reads them
  named_barrier(1 + cw, 128);
  if (t_wg == 0) {
    const int row = pid_m * BM + cw * 64, col = pid_n * BN;
    tma_store_2d(daq_map, col, row, box_da1);
    tma_store_2d(daq_map, N + col, row, box_da3);
    tma_store_2d(ht_map, row, col, box_ht);
    tma_store_2d(dat_map, row, col, box_da1t);
    tma_store_2d(dat_map, row, N + col, box_da3t);
    bulk_commit();
  }
}

// DGRAD2_SWIGLU_ROWS's epilogue for the thread's 2 rows x 32 columns (acc as in
// dgrad2_swiglu_epilogue). Two passes over the registers, the values recomputed in the second:
// pass 1 the rows' amaxes of da1 and da3 over the tile's 128 columns (a quad holds a row) and the
// part sums; pass 2 the stores. Plain loads of a (not the read-only path: da may be a).
__device__ __forceinline__ void dgrad2_swiglu_rows_epilogue(const float (&acc)[64],
                                                            const KernelParams& p, int pid_m,
                                                            int pid_n, int cw, int warp, int lane,
                                                            const bool (&live)[2],
                                                            const int (&slot)[2]) {
  const int N = p.N;
  const int q4 = lane % 4;
  const long long row_g = pid_m * BM + cw * 64 + warp * 16 + lane / 4;  // + 8 h
  const long long col = pid_n * BN + 2 * q4;                              // + 8 j (+ e)
  float w[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) w[h] = live[h] ? __ldg(p.tw + slot[h]) : 0.f;
  // this lane's bf16 pairs of a1 at a_row(h) + 4 j, of a3 at + N / 2 (32-bit words)
  auto a_row = [&](int h) {
    return reinterpret_cast<const uint32_t*>(p.a_saved + (row_g + 8 * h) * (2LL * N) + col);
  };
  // fn(j, h, hv, d1, d3) for each of the thread's 16 column pairs j of its rows h, in order. The
  // a words of 4 j are loaded before any fn of them runs: with da possibly a, the compiler keeps
  // each load after the stores before it, so loads issued one by one would wait one by one.
  auto each = [&](auto&& fn) {
#pragma unroll
    for (int j0 = 0; j0 < 16; j0 += 4) {
      uint32_t u1[4][2], u3[4][2];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          u1[jj][h] = a_row(h)[4 * (j0 + jj)];
          u3[jj][h] = a_row(h)[N / 2 + 4 * (j0 + jj)];
        }
      }
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int j = j0 + jj;
          const float2 a1 = bf16x2_to_float2(u1[jj][h]), a3 = bf16x2_to_float2(u3[jj][h]);
          float hv[2], d1[2], d3[2];
          swiglu_backward(acc[4 * j + 2 * h], a1.x, a3.x, w[h], live[h], hv[0], d1[0], d3[0]);
          swiglu_backward(acc[4 * j + 2 * h + 1], a1.y, a3.y, w[h], live[h], hv[1], d1[1], d3[1]);
          fn(j, h, hv, d1, d3);
        }
      }
    }
  };

  // pass 1: the part sums and the rows' amaxes
  float psum[2] = {0.f, 0.f}, ra1[2] = {0.f, 0.f}, ra3[2] = {0.f, 0.f};
  each([&](int j, int h, const float (&hv)[2], const float (&d1)[2], const float (&d3)[2]) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      psum[h] += acc[4 * j + 2 * h + e] * hv[e];
      ra1[h] = fmaxf(ra1[h], fabsf(d1[e]));
      ra3[h] = fmaxf(ra3[h], fabsf(d3[e]));
    }
  });
  float rinv1[2], rinv3[2];
  row_scales_and_part(p, row_g, pid_n, q4, psum, ra1, ra3, rinv1, rinv3);

  // pass 2: da1, da3 and hw in bf16, da1 and da3 in e4m3 (every load of a row's element of a
  // comes before the store of its da in this thread's program order)
  each([&](int j, int h, const float (&hv)[2], const float (&d1)[2], const float (&d3)[2]) {
    const long long r = row_g + 8 * h;
    const long long c = col + 8 * j;
    uint32_t* da_row = reinterpret_cast<uint32_t*>(p.da + r * (2LL * N) + c);
    da_row[0] = bf16x2_bits(d1[0], d1[1]);
    da_row[N / 2] = bf16x2_bits(d3[0], d3[1]);
    *reinterpret_cast<uint32_t*>(p.hw + r * N + c) = bf16x2_bits(w[h] * hv[0], w[h] * hv[1]);
    uint16_t* q_row = reinterpret_cast<uint16_t*>(p.daq + r * (2LL * N) + c);
    q_row[0] = static_cast<uint16_t>(e4m3x2(d1[0] * rinv1[h], d1[1] * rinv1[h]));
    q_row[N / 2] = static_cast<uint16_t>(e4m3x2(d3[0] * rinv3[h], d3[1] * rinv3[h]));
  });
}

// w1_map: B (GEMM1_SWIGLU: w1; DGRAD2_SWIGLU: w2^T), w3_map: GEMM1_SWIGLU's w3, in_map: GEMM_ROWS's A (GEMM1_SWIGLU's with ROWS_A), out_map:
// GEMM_ROWS's out. DGRAD2_SWIGLU's stores: out_map da [R, 2N] (boxes [64, 128]), in_map da^T [2N, R] and
// w3_map h^T [N, R] (boxes [128, 64]).
template <int MODE, bool ROWS_A>
__global__ void __launch_bounds__(THREADS, 1)
    fp8_gemm_kernel(const __grid_constant__ CUtensorMap w1_map,
                    const __grid_constant__ CUtensorMap w3_map,
                    const __grid_constant__ CUtensorMap in_map,
                    const __grid_constant__ CUtensorMap out_map, const KernelParams p) {
  using L = Layout<MODE>;
  static_assert(!ROWS_A || MODE == GEMM1_SWIGLU, "ROWS_A: GEMM1_SWIGLU's x rows only");
  constexpr bool GATHER = MODE != GEMM_ROWS && !ROWS_A;  // token rows by cp.async (x or dy)
  constexpr bool SWIGLU = MODE == GEMM1_SWIGLU;
  constexpr int STAGES = L::STAGES;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const SmemLayout<STAGES, L::STAGE_BYTES, L::EPI_BYTES> smem(smem_raw);
  const uint32_t smem_base = smem.base;
  const uint32_t epi_smem = smem.epilogue();

  const int tid = threadIdx.x;
  const int wg = tid / 128;
  // full[s]'s arrivals: thread 0's expect_tx (+ the 128 threads' cp.async rows)
  const uint32_t full_arrivals = GATHER ? 128 + 1 : 1;
  if (tid == 0) {
    smem.ring().init(full_arrivals);
    mbar_init_fence();
    tma_prefetch_desc(&w1_map);
    if (SWIGLU) tma_prefetch_desc(&w3_map);
    if (!GATHER) tma_prefetch_desc(&in_map);
  }
  __syncthreads();

  const bool group = p.seg_start != nullptr;
  const int m_lo = group ? p.seg_start[p.expert_base] / BM : 0;
  const int rows_end = group ? p.seg_start[p.expert_base + p.num_experts] : *p.num_rows_used;
  const int num_m = rows_end / BM - m_lo;
  const int num_n = p.N / BN;
  const int num_units = num_m * num_n;
  const int k_blocks = p.K / BK;
  // the unit's tile and its expert's index into B (-1: another phase's tile, skipped by both
  // roles)
  auto decode = [&](int u, int& pid_m, int& pid_n) {
    grouped_tile(u, num_m, num_n, p.group_m, pid_m, pid_n);
    pid_m += m_lo;
    const int e = p.tile_expert[(pid_m * BM) / p.plan_bm];
    return e < 0 ? -1 : e - p.expert_base;
  };

  if (wg == 0) {
    // ---------------- producer ----------------
    setmaxnreg_dec<PRODUCER_REGS>();
    const int c = tid % CHUNKS;   // 16-byte chunk of a row's K step
    const int rg = tid / CHUNKS;  // rows rg + ROWS_PER_PASS i
    const Ring<STAGES> ring = smem.ring();
    int stage = 0;
    uint32_t phase = 0;
    if (!GATHER && tid != 0) return;  // without gathers thread 0 issues every load
    for (int u = blockIdx.x; u < num_units; u += gridDim.x) {
      int pid_m, pid_n;
      const int expert = decode(u, pid_m, pid_n);
      if (expert < 0) continue;
      const int w_row = expert * p.N + pid_n * BN;
      int tok[PASSES];
#pragma unroll
      for (int i = 0; i < PASSES; ++i) {
        const int slot = GATHER ? p.row_slot[pid_m * BM + i * ROWS_PER_PASS + rg] : -1;
        tok[i] = slot >= 0 ? slot / p.top_k : -1;
      }
      for (int kb = 0; kb < k_blocks; ++kb) {
        mbar_wait(ring.empty(stage), phase ^ 1);
        const uint32_t a_smem = smem_base + stage * L::STAGE_BYTES;
        const uint32_t b_smem = a_smem + A_BYTES;
        const uint32_t full = ring.full(stage);
        if constexpr (GATHER) {
          if (tid == 0) {
            mbar_arrive_expect_tx(full, L::B_BYTES);
            tma_load_2d(b_smem, &w1_map, kb * BK, w_row, full);
            if constexpr (SWIGLU) tma_load_2d(b_smem + BOX_BYTES, &w3_map, kb * BK, w_row, full);
          }
#pragma unroll
          for (int i = 0; i < PASSES; ++i) {
            const int r = i * ROWS_PER_PASS + rg;
            const bool valid = tok[i] >= 0;
            const uint8_t* src =
                p.x + (valid ? static_cast<long long>(tok[i]) * p.stride_x : 0) + kb * BK + c * 16;
            cp_async_16(a_smem + swizzled_offset<128>(r, c), src, valid ? 16 : 0);
          }
          cp_async_arrive_noinc(full);
        } else {
          mbar_arrive_expect_tx(full, L::STAGE_BYTES);
          tma_load_2d(a_smem, &in_map, kb * BK, pid_m * BM, full);
          tma_load_2d(b_smem, &w1_map, kb * BK, w_row, full);
          if constexpr (SWIGLU) tma_load_2d(b_smem + BOX_BYTES, &w3_map, kb * BK, w_row, full);
        }
        if (++stage == STAGES) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
  } else {
    // ---------------- consumers ----------------
    setmaxnreg_inc<(65536 / 128 - PRODUCER_REGS) / 2 / 8 * 8>();
    const int cw = wg - 1;  // rows [64 cw, 64 cw + 64) of the tile
    const int warp = (tid % 128) / 32;
    const int lane = tid % 32;
    const int r_in = cw * 64 + warp * 16 + lane / 4;  // this thread's rows: r_in, r_in + 8
    const Ring<STAGES> ring = smem.ring();
    int stage = 0;
    uint32_t phase = 0;
    float part[64];
    float acc[64];
    [[maybe_unused]] float acc3[SWIGLU ? 64 : 1];
    for (int u = blockIdx.x; u < num_units; u += gridDim.x) {
      int pid_m, pid_n;
      const int expert = decode(u, pid_m, pid_n);
      if (expert < 0) continue;
      const int row0 = pid_m * BM + r_in;
      // the rows' scale rows: the row itself (row-space A) or its token (gathered; padding rows:
      // none)
      long long srow[2];
      bool live[2];
      [[maybe_unused]] int slot[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (GATHER) {
          slot[h] = p.row_slot[row0 + 8 * h];
          live[h] = slot[h] >= 0;
          srow[h] = live[h] ? static_cast<long long>(slot[h] / p.top_k) : 0;
        } else {
          live[h] = true;
          srow[h] = row0 + 8 * h;
        }
      }
      const float* sa0 = p.a_scale + srow[0] * p.stride_as;
      const float* sa1 = p.a_scale + srow[1] * p.stride_as;
      const long long sb_off = expert * p.stride_bse + pid_n * p.stride_bsn;
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = 0.f;
      if constexpr (SWIGLU) {
#pragma unroll
        for (int i = 0; i < 64; ++i) acc3[i] = 0.f;
      }
      auto advance = [&]() {
        if (++stage == STAGES) {
          stage = 0;
          phase ^= 1;
        }
      };
      // the warpgroup's wgmmas have all read stage s
      auto release = [&](int s) { ring.release(s, cw); };
      auto stage_smem = [&](uint32_t& a_smem, uint32_t& b_smem) {
        a_smem = smem_base + stage * L::STAGE_BYTES + cw * 64 * BK;
        b_smem = smem_base + stage * L::STAGE_BYTES + A_BYTES;
      };
      // Each K step's scales are loaded during the step before (the last step reloads its
      // own): under a busy L2 their latency outlasts one wgmma batch, which would stall the
      // promotion that needs them.
      // s[0], s[1]: the rows' scales; s[2]: B's (w1's); s[3]: w3's (SWIGLU)
      auto load_scales = [&](int kb, float (&s)[SWIGLU ? 4 : 3]) {
        s[0] = live[0] ? __ldg(sa0 + kb) : 0.f;
        s[1] = live[1] ? __ldg(sa1 + kb) : 0.f;
        s[2] = __ldg(p.b_scale + sb_off + kb);
        if constexpr (SWIGLU) s[3] = __ldg(p.b3_scale + sb_off + kb);
      };
      float next[SWIGLU ? 4 : 3];
      load_scales(0, next);
      if constexpr (SWIGLU) {
        // w1's wgmmas, their promotion, w3's (one partial: a1, a3 and it take 192 registers)
        for (int kb = 0; kb < k_blocks; ++kb) {
          const float a0 = next[0], a1 = next[1], b1 = next[2], b3 = next[3];
          load_scales(min(kb + 1, k_blocks - 1), next);
          mbar_wait(ring.full(stage), phase);
          if constexpr (GATHER) fence_proxy_async();  // the cp.async rows, for the async proxy
          uint32_t a_smem, b_smem;
          stage_smem(a_smem, b_smem);
          mma_issue(part, a_smem, b_smem);
          wgmma_wait<0>();
          promote(acc, part, a0 * b1, a1 * b1);
          mma_issue(part, a_smem, b_smem + BOX_BYTES);
          wgmma_wait<0>();
          release(stage);
          promote(acc3, part, a0 * b3, a1 * b3);
          advance();
        }
      } else {
        // One partial per warpgroup, waited for and promoted per step: the other warpgroup's
        // wgmmas run meanwhile. (A second partial, promoting step kb - 1 under step kb's
        // wgmmas, spills.)
        for (int kb = 0; kb < k_blocks; ++kb) {
          const float s0 = next[0] * next[2], s1 = next[1] * next[2];
          load_scales(min(kb + 1, k_blocks - 1), next);
          mbar_wait(ring.full(stage), phase);
          if constexpr (GATHER) fence_proxy_async();  // DGRAD2_SWIGLU's cp.async rows
          uint32_t a_smem, b_smem;
          stage_smem(a_smem, b_smem);
          mma_issue(part, a_smem, b_smem);
          wgmma_wait<0>();
          release(stage);
          promote(acc, part, s0, s1);
          advance();
        }
      }
      const int col0 = pid_n * BN + 2 * (lane % 4);
      if constexpr (MODE == DGRAD2_SWIGLU) {
        dgrad2_swiglu_epilogue(acc, p, &out_map, &in_map, &w3_map, epi_smem, pid_m, pid_n, cw, warp,
                         lane, live, slot);
      } else if constexpr (MODE == DGRAD2_SWIGLU_ROWS) {
        dgrad2_swiglu_rows_epilogue(acc, p, pid_m, pid_n, cw, warp, lane, live, slot);
      } else if constexpr (SWIGLU) {
        // h = silu(a1) a3, its row amax over the quad's 4 lanes (128 columns), e4m3 + scale
        float amax[2] = {0.f, 0.f};
#pragma unroll
        for (int i = 0; i < 64; ++i) {
          part[i] = swiglu_ieee(acc[i], acc3[i]);  // acc keeps a1 for the store of a
          amax[(i / 2) % 2] = fmaxf(amax[(i / 2) % 2], fabsf(part[i]));
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) amax[h] = quad_max(amax[h]);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float scale = e4m3_scale(amax[h]);
          const long long row = row0 + 8 * h;
          uint8_t* hq_row = p.hq + row * p.N + col0;
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            const float2 v = make_float2(part[4 * j + 2 * h] / scale, part[4 * j + 2 * h + 1] / scale);
            const __nv_fp8x2_storage_t q = __nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, __NV_E4M3);
            *reinterpret_cast<__nv_fp8x2_storage_t*>(hq_row + 8 * j) = q;
          }
          if (lane % 4 == 0) p.hs[row * (p.N / BN) + pid_n] = scale;
          if (p.a != nullptr) {
            __nv_bfloat16* a_row = p.a + row * (2LL * p.N) + col0;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
              *reinterpret_cast<__nv_bfloat162*>(a_row + 8 * j) =
                  __floats2bfloat162_rn(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
              *reinterpret_cast<__nv_bfloat162*>(a_row + p.N + 8 * j) =
                  __floats2bfloat162_rn(acc3[4 * j + 2 * h], acc3[4 * j + 2 * h + 1]);
            }
          }
        }
      } else {
        store_bf16_tile(epi_smem + cw * 2 * EPI_BOX_BYTES, cw, warp, lane, &out_map, pid_n * BN,
                        pid_m * BM + cw * 64, [&](int j, int h) {
                          return bf16x2_bits(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
                        });
      }
    }
    if (!SWIGLU && tid % 128 == 0) bulk_wait<0>();  // the bulk stores done before exit
  }
}

template <int MODE, bool ROWS_A = false>
static int launch(const CUtensorMap& w1_map, const CUtensorMap& w3_map, const CUtensorMap& in_map,
                  const CUtensorMap& out_map, const KernelParams& p, int num_sms,
                  cudaStream_t stream) {
  return launch_persistent<fp8_gemm_kernel<MODE, ROWS_A>>(
      Layout<MODE>::SMEM_BYTES, THREADS, num_sms, stream, w1_map, w3_map, in_map, out_map, p);
}

// The KernelParams the gathering modes share: token rows x [T, K] e4m3 (and their scales)
// gathered by the plan against B [E, N, K] e4m3 with 128 x 128 block scales
static KernelParams gathered_params(const void* x, long long stride_x, const float* x_scale,
                                    long long stride_xs, const float* b_scale,
                                    long long stride_bse, long long stride_bsn,
                                    const int* row_slot, const int* tile_expert,
                                    const int* num_rows_used, int N, int K, int top_k,
                                    int plan_bm, int group_m) {
  KernelParams p = {};
  p.x = static_cast<const uint8_t*>(x);
  p.a_scale = x_scale;
  p.b_scale = b_scale;
  p.row_slot = row_slot;
  p.tile_expert = tile_expert;
  p.num_rows_used = num_rows_used;
  p.N = N;
  p.K = K;
  p.top_k = top_k;
  p.plan_bm = plan_bm;
  p.group_m = group_m;
  p.stride_x = stride_x;
  p.stride_as = stride_xs;
  p.stride_bse = stride_bse;
  p.stride_bsn = stride_bsn;
  return p;
}

}  // namespace fp8
}  // namespace megamoe
