// Blockwise-FP8 grouped GEMMs over a plan's row space, warp-specialized for Hopper (sm_90a):
// the FP8 counterparts of grouped_gemm_sm90.cu's GATHER and ROWS modes (ops/hopper/kernels/
// fp8_gemm_rows.py is the Triton version of the same contracts; the tuner keeps the faster).
//   megamoe_fp8_gemm_rows (PLAIN):   out[r] = sum_kb (A[r, kb] @ B[e]^T[kb]) * sa[r, kb] * sb[e, n, kb]
//     A e4m3 [R, K] (the row space, by TMA) with 1x128 scales sa [R, K/128]; B e4m3 [E, N, K]
//     with 128x128 block scales sb [E, N/128, K/128]; out bf16 [R, N]. GEMM 2 (A = h) and the
//     backward's dgrad of linear 1 (A = [da1 | da3], B = the transposed [w1; w3] copy).
//   megamoe_fp8_gemm1_swiglu (SWIGLU): GEMM 1 on the token rows of x (gathered: row r reads
//     token row_slot[r] / top_k, padding rows read zeros), a1 against w1 and a3 against w3,
//     h = silu(a1) * a3 quantized in the epilogue to e4m3 with one scale per row of the tile's
//     128 columns (GEMM 2's A operand and its scales), optionally a = [a1 | a3] in bf16.
//   megamoe_fp8_dswiglu (DSWIGLU): the backward's kernel A. dhg = dy rows (gathered like
//     SWIGLU's x) @ w2[e] (B = the transposed [E, H, D] copy), then with the saved a = [a1 |
//     a3] and the routing weight w of the row: h = silu(a1) a3, dh = w dhg, da3 = dh silu(a1),
//     da1 = dh a3 sig (1 + a1 (1 - sig)). Outputs, each quantized where it sits in registers:
//     da = [da1 | da3] e4m3 [R, 2H] per row and 128 columns (dgrad of linear 1), da^T [2H, R]
//     and h^T [H, R] per 128 rows of a column (the weight gradients contract over rows; one
//     scale per column of the 128-row tile: the plan's 128-row segments keep one expert per
//     block), and part [H/128, R] = sum over the tile's columns of dhg h (d topk_weights).
//
// Tile: 128 rows x 128 output columns (SWIGLU: 128 columns of h, i.e. of a1 and of a3); K steps
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
//     PLAIN: thread 0 alone: arrive.expect_tx(full[s], 32 KiB), TMA loads of the A box [128
//       rows, 128] and the B box [128 rows, 128]; full[s] completes on that one arrival and the
//       bytes.
//     SWIGLU: thread 0: arrive.expect_tx(full[s], 32 KiB) and the w1 and w3 boxes by TMA; all
//       128 threads: 8 cp.async of 16 bytes (the gathered x rows in the swizzle pattern, zeros
//       for padding rows), then cp.async.mbarrier.arrive.noinc(full[s]); full[s] takes 129
//       arrivals and the bytes.
//   warpgroups 1, 2 (consumers, 232 registers): rows [0, 64) and [64, 128) of the tile. Per K
//     step: the step's scales loaded (global; their latency hides behind the wait), wait
//     full[s] (SWIGLU: a proxy fence for the cp.async rows), 4 wgmma m64n128k32 into the
//     partial, wait, promote; SWIGLU does this twice (w1's box, then w3's). Then a warpgroup
//     barrier and ONE arrival per warpgroup on empty[s] (2 complete it).
//   Epilogue, PLAIN: the warpgroup's [64, 128] bf16 tile staged in shared memory (two [64, 64]
//     boxes, 128-byte swizzle) and written by bulk tensor stores; the staging buffer is reused
//     once the store engine has read it. SWIGLU: h and its scales (quad shuffles give the row
//     amax over the 4 lanes holding a row), and a, by plain global stores from registers.
//     DSWIGLU, in two passes over the registers (the values recomputed in the second: holding
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

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "sm90_primitives.cuh"

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
constexpr int EPI_BOX_BYTES = 64 * 64 * 2;  // PLAIN staging: [64 rows, 64] bf16, per half tile

enum Mode : int { MODE_PLAIN = 0, MODE_SWIGLU = 1, MODE_DSWIGLU = 2 };

// DSWIGLU's epilogue memory: per consumer warpgroup 5 staging boxes of [64 rows, 128] (or
// [128, 64]) e4m3, then the per-warp column maxima [8 warps][3 tensors][128] and the
// reciprocals of the column scales [3][128] (tensors: h, da1, da3)
constexpr int DS_BOX_BYTES = 64 * 128;
constexpr int DS_WG_BYTES = 5 * DS_BOX_BYTES;
constexpr int DS_COLMAX_BYTES = 8 * 3 * 128 * 4;
constexpr int DS_INV_BYTES = 3 * 128 * 4;

template <int MODE>
struct Layout {
  static constexpr int B_BYTES = (MODE == MODE_SWIGLU ? 2 : 1) * BOX_BYTES;
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int STAGES = MODE == MODE_PLAIN ? 6 : 4;  // 6 x 32 KiB; 4 x 48 or 32 KiB
  static constexpr int EPI_BYTES =
      MODE == MODE_PLAIN ? 2 * 2 * EPI_BOX_BYTES
      : MODE == MODE_DSWIGLU ? 2 * DS_WG_BYTES + DS_COLMAX_BYTES + DS_INV_BYTES : 0;
  // + ring barriers, alignment
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + EPI_BYTES + 2 * STAGES * 8 + 1024;
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory: fewer stages");
};

struct Params {
  const uint8_t* x;       // SWIGLU, DSWIGLU: token rows [T, K] e4m3 (x; dy), stride_x apart
  const float* a_scale;   // PLAIN: [R, K/128]; SWIGLU, DSWIGLU: [T, K/128]; row stride stride_as
  const float* b_scale;   // [E, N/128, K/128] (SWIGLU: w1's); strides stride_bse, stride_bsn
  const float* b3_scale;  // SWIGLU: w3's, same strides
  uint8_t* hq;            // SWIGLU: h [R, N] e4m3 (row stride N)
  float* hs;              // SWIGLU: h's scales [R, N/128] (row stride N/128)
  __nv_bfloat16* a;       // SWIGLU: nullptr or a = [a1 | a3] [R, 2N]
  const __nv_bfloat16* a_saved;  // DSWIGLU: the forward's a = [a1 | a3] [R, 2N]
  const float* tw;        // DSWIGLU: routing weights, by slot [T * top_k]
  float* das;             // DSWIGLU: da's row scales [R, 2N/128]
  float* hts;             // DSWIGLU: h^T's scales [N, R/128]
  float* dats;            // DSWIGLU: da^T's scales [2N, R/128]
  float* part;            // DSWIGLU: [N/128, R]
  long long rows;         // DSWIGLU: R (the transposed outputs' row length)
  const int* row_slot;
  const int* tile_expert;
  const int* num_rows_used;
  // PLAIN over one group of experts [e0, e0 + num_experts) (B holds only theirs, as expert -
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
};

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

__device__ __forceinline__ float silu_mul(float a1, float a3) {
  return a1 / (1.0f + __expf(-a1)) * a3;
}

// The warpgroup's [64, 128] fp32 tile in bf16 to global at (col, row) of out_map: staged in
// shared memory (two [64, 64] boxes, 128-byte swizzle, at epi_smem + the warpgroup's 16 KiB) and
// written by two bulk tensor stores; the staging is reused once the previous store read it.
__device__ __forceinline__ void store_bf16_tile(const float (&acc)[64], uint32_t epi_smem, int cw,
                                                int warp, int lane, const CUtensorMap* out_map,
                                                int col, int row) {
  const uint32_t tile = epi_smem + cw * 2 * EPI_BOX_BYTES;
  const bool leader = threadIdx.x % 128 == 0;
  if (leader) bulk_wait_read<0>();  // the previous tile's store has read it
  named_barrier(1 + cw, 128);
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      __nv_bfloat162 v = __floats2bfloat162_rn(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
      const int r = warp * 16 + lane / 4 + 8 * h;
      st_shared_b32(tile + (j / 8) * EPI_BOX_BYTES + swizzled_offset<128>(r, j % 8) +
                        4 * (lane % 4),
                    *reinterpret_cast<uint32_t*>(&v));
    }
  }
  fence_proxy_async();  // the st.shared writes, before the store engine reads them
  named_barrier(1 + cw, 128);
  if (leader) {
    tma_store_2d(out_map, col, row, tile);
    tma_store_2d(out_map, col + 64, row, tile + EPI_BOX_BYTES);
    bulk_commit();
  }
}

// The SwiGLU backward of one element: g = dhg (before the routing weight w), a1, a3 the saved
// pre-activations. Same arithmetic as the Triton kernel A (ops/hopper/kernels/fp8_gemm.py)
// up to the sigmoid's approximate division (grouped_gemm_sm90.cu's epi_sigmoid).
__device__ __forceinline__ void dswiglu_values(float g, float a1, float a3, float w, bool live,
                                               float& h, float& da1, float& da3) {
  const float sig = __fdividef(1.0f, 1.0f + __expf(-a1));
  const float silu = a1 * sig;
  h = live ? silu * a3 : 0.f;  // padding rows add nothing to dw2
  const float dh = g * w;
  da3 = dh * silu;
  da1 = dh * a3 * sig * (1.0f + a1 * (1.0f - sig));
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

__device__ __forceinline__ float2 bf16x2_to_float2(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}

__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}

// DSWIGLU's epilogue for the warpgroup's 64 rows (see the file comment). acc[4 j + 2 h + e]:
// row warp 16 + lane / 4 + 8 h of the warpgroup, column 8 j + 2 (lane % 4) + e of the tile.
// Both consumer warpgroups call it for the same tile (barrier 3 spans the two).
__device__ __forceinline__ void dswiglu_epilogue(const float (&acc)[64], const Params& p,
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
    dswiglu_values(acc[4 * j + 2 * h + e], e ? a1.y : a1.x, e ? a3.y : a3.x, w[h], live[h], hv,
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
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int m = 1; m <= 2; m *= 2) {
      psum[h] += __shfl_xor_sync(0xffffffffu, psum[h], m);
      ra1[h] = fmaxf(ra1[h], __shfl_xor_sync(0xffffffffu, ra1[h], m));
      ra3[h] = fmaxf(ra3[h], __shfl_xor_sync(0xffffffffu, ra3[h], m));
    }
    const float s1 = fmaxf(ra1[h], 1e-12f) / 448.0f, s3 = fmaxf(ra3[h], 1e-12f) / 448.0f;
    rinv1[h] = 1.0f / s1;
    rinv3[h] = 1.0f / s3;
    if (q4 == 0) {
      const long long r = row_g + 8 * h;
      p.part[pid_n * p.rows + r] = psum[h];
      p.das[r * (2 * N / BN) + pid_n] = s1;
      p.das[r * (2 * N / BN) + N / BN + pid_n] = s3;
    }
  }
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
    const float sc = fmaxf(m, 1e-12f) / 448.0f;
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

// w1_map: B (SWIGLU: w1; DSWIGLU: w2^T), w3_map: SWIGLU's w3, in_map: PLAIN's A, out_map:
// PLAIN's out. DSWIGLU's stores: out_map da [R, 2N] (boxes [64, 128]), in_map da^T [2N, R] and
// w3_map h^T [N, R] (boxes [128, 64]).
template <int MODE>
__global__ void __launch_bounds__(THREADS, 1)
    fp8_gemm_kernel(const __grid_constant__ CUtensorMap w1_map,
                    const __grid_constant__ CUtensorMap w3_map,
                    const __grid_constant__ CUtensorMap in_map,
                    const __grid_constant__ CUtensorMap out_map, const Params p) {
  using L = Layout<MODE>;
  constexpr bool GATHER = MODE != MODE_PLAIN;  // token rows by cp.async (x or dy)
  constexpr bool SWIGLU = MODE == MODE_SWIGLU;
  constexpr int STAGES = L::STAGES;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));
  const uint32_t smem_base = smem_u32(smem);
  const uint32_t epi_smem = smem_base + STAGES * L::STAGE_BYTES;
  const uint32_t full_bar = epi_smem + L::EPI_BYTES;
  const uint32_t empty_bar = full_bar + STAGES * 8;

  const int tid = threadIdx.x;
  const int wg = tid / 128;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_bar + 8 * s, GATHER ? 128 + 1 : 1);
      mbar_init(empty_bar + 8 * s, 2);  // one per consumer warpgroup
    }
    mbar_init_fence();
    tma_prefetch_desc(&w1_map);
    if (SWIGLU) tma_prefetch_desc(&w3_map);
    if (!GATHER) tma_prefetch_desc(&in_map);
  }
  __syncthreads();

  const bool group = p.seg_start != nullptr;
  const int m_lo = group ? p.seg_start[p.expert_base] / BM : 0;
  const int num_m =
      (group ? p.seg_start[p.expert_base + p.num_experts] : *p.num_rows_used) / BM - m_lo;
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
    int stage = 0;
    uint32_t phase = 0;
    if (!GATHER && tid != 0) return;  // PLAIN: thread 0 issues every load
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
        mbar_wait(empty_bar + 8 * stage, phase ^ 1);
        const uint32_t a_smem = smem_base + stage * L::STAGE_BYTES;
        const uint32_t b_smem = a_smem + A_BYTES;
        const uint32_t full = full_bar + 8 * stage;
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
          mbar_arrive_expect_tx(full, A_BYTES + BOX_BYTES);
          tma_load_2d(a_smem, &in_map, kb * BK, pid_m * BM, full);
          tma_load_2d(b_smem, &w1_map, kb * BK, w_row, full);
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
      // the rows' scale rows: the row itself (PLAIN) or its token (SWIGLU; padding rows: none)
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
      auto release = [&](int s) {
        named_barrier(1 + cw, 128);  // the warpgroup's wgmmas have all read the stage
        mbar_arrive_if(empty_bar + 8 * s, tid % 128 == 0);
      };
      auto stage_smem = [&](uint32_t& a_smem, uint32_t& b_smem) {
        a_smem = smem_base + stage * L::STAGE_BYTES + cw * 64 * BK;
        b_smem = smem_base + stage * L::STAGE_BYTES + A_BYTES;
      };
      if constexpr (SWIGLU) {
        // w1's wgmmas, their promotion, w3's (one partial: a1, a3 and it take 192 registers)
        for (int kb = 0; kb < k_blocks; ++kb) {
          const float a0 = live[0] ? __ldg(sa0 + kb) : 0.f;
          const float a1 = live[1] ? __ldg(sa1 + kb) : 0.f;
          const float b1 = __ldg(p.b_scale + sb_off + kb);
          const float b3 = __ldg(p.b3_scale + sb_off + kb);
          mbar_wait(full_bar + 8 * stage, phase);
          fence_proxy_async();  // the cp.async rows, for the wgmma's async proxy
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
        // wgmmas, spilled 316 bytes per thread under ptxas 13.0: docs/PERF.md.)
        for (int kb = 0; kb < k_blocks; ++kb) {
          const float b1 = __ldg(p.b_scale + sb_off + kb);
          const float s0 = (live[0] ? __ldg(sa0 + kb) : 0.f) * b1;
          const float s1 = (live[1] ? __ldg(sa1 + kb) : 0.f) * b1;
          mbar_wait(full_bar + 8 * stage, phase);
          if constexpr (GATHER) fence_proxy_async();  // DSWIGLU's cp.async rows
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
      if constexpr (MODE == MODE_DSWIGLU) {
        dswiglu_epilogue(acc, p, &out_map, &in_map, &w3_map, epi_smem, pid_m, pid_n, cw, warp,
                         lane, live, slot);
      } else if constexpr (SWIGLU) {
        // h = silu(a1) a3, its row amax over the quad's 4 lanes (128 columns), e4m3 + scale
        float amax[2] = {0.f, 0.f};
#pragma unroll
        for (int i = 0; i < 64; ++i) {
          part[i] = silu_mul(acc[i], acc3[i]);  // acc keeps a1 for the store of a
          amax[(i / 2) % 2] = fmaxf(amax[(i / 2) % 2], fabsf(part[i]));
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          amax[h] = fmaxf(amax[h], __shfl_xor_sync(0xffffffffu, amax[h], 1));
          amax[h] = fmaxf(amax[h], __shfl_xor_sync(0xffffffffu, amax[h], 2));
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float scale = fmaxf(amax[h], 1e-12f) / 448.0f;
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
        store_bf16_tile(acc, epi_smem, cw, warp, lane, &out_map, pid_n * BN, pid_m * BM + cw * 64);
      }
    }
    if (!SWIGLU && tid % 128 == 0) bulk_wait<0>();  // the bulk stores done before exit
  }
}

template <int MODE>
static int launch(const CUtensorMap& w1_map, const CUtensorMap& w3_map, const CUtensorMap& in_map,
                  const CUtensorMap& out_map, const Params& p, int num_sms, cudaStream_t stream) {
  constexpr int SMEM = Layout<MODE>::SMEM_BYTES;
  static bool configured = false;
  if (!configured) {
    cudaError_t err = cudaFuncSetAttribute(fp8_gemm_kernel<MODE>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
    if (err != cudaSuccess) return static_cast<int>(err);
    configured = true;
  }
  fp8_gemm_kernel<MODE><<<num_sms, THREADS, SMEM, stream>>>(w1_map, w3_map, in_map, out_map, p);
  return static_cast<int>(cudaGetLastError());
}

// ---- WGRAD: the weight gradients (K-grouped over each expert's segment) -----------------------
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

struct WgradParams {
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

// a_map: A^T [M, R], b_map: B^T [N, R] (boxes [128, 128]); out_map: [E * M, N] bf16 (boxes [64, 64])
__global__ void __launch_bounds__(THREADS, 1)
    fp8_wgrad_kernel(const __grid_constant__ CUtensorMap a_map,
                     const __grid_constant__ CUtensorMap b_map,
                     const __grid_constant__ CUtensorMap out_map, const WgradParams p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));
  const uint32_t smem_base = smem_u32(smem);
  const uint32_t epi_smem = smem_base + WG_STAGES * WG_STAGE_BYTES;
  const uint32_t full_bar = epi_smem + WG_EPI_BYTES;
  const uint32_t empty_bar = full_bar + WG_STAGES * 8;
  const uint32_t unit_full = empty_bar + WG_STAGES * 8;
  const uint32_t unit_empty = unit_full + 2 * 8;
  volatile int* unit_id = reinterpret_cast<volatile int*>(
      smem + WG_STAGES * WG_STAGE_BYTES + WG_EPI_BYTES + (2 * WG_STAGES + 4) * 8);

  const int tid = threadIdx.x;
  const int wg = tid / 128;
  if (tid == 0) {
    for (int s = 0; s < WG_STAGES; ++s) {
      mbar_init(full_bar + 8 * s, 128 + 1);  // thread 0's expect_tx + 128 scale copiers
      mbar_init(empty_bar + 8 * s, 2);
    }
    for (int s = 0; s < 2; ++s) {
      mbar_init(unit_full + 8 * s, 1);
      mbar_init(unit_empty + 8 * s, 2);
    }
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
    int stage = 0;
    uint32_t phase = 0;
    for (int it = 0;; ++it) {
      const int slot = it & 1;
      if (tid == 0) {
        mbar_wait(unit_empty + 8 * slot, ((it >> 1) & 1) ^ 1);
        unit_id[slot] = take_unit(p.ticket, num_units);
        mbar_arrive(unit_full + 8 * slot);
      }
      named_barrier(4, 128);
      const int u = unit_id[slot];
      if (u >= num_units) break;
      int pid_m, pid_n, row0, k_blocks;
      decode(u, pid_m, pid_n, row0, k_blocks);
      const float* sa = p.a_scale + (pid_m * BM + tid) * p.stride_as + row0 / BK;
      const float* sb = p.b_scale + (pid_n * BN + tid) * p.stride_bs + row0 / BK;
      for (int kb = 0; kb < k_blocks; ++kb) {
        mbar_wait(empty_bar + 8 * stage, phase ^ 1);
        const uint32_t a_smem = smem_base + stage * WG_STAGE_BYTES;
        const uint32_t b_smem = a_smem + A_BYTES;
        const uint32_t s_smem = b_smem + BOX_BYTES;
        const uint32_t full = full_bar + 8 * stage;
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
    int stage = 0;
    uint32_t phase = 0;
    float part[64];
    float acc[64];
    for (int it = 0;; ++it) {
      const int slot = it & 1;
      mbar_wait(unit_full + 8 * slot, (it >> 1) & 1);
      const int u = unit_id[slot];
      named_barrier(1 + cw, 128);  // the warpgroup has read the id
      mbar_arrive_if(unit_empty + 8 * slot, tid % 128 == 0);
      if (u >= num_units) break;
      int pid_m, pid_n, row0, k_blocks;
      const int expert = decode(u, pid_m, pid_n, row0, k_blocks);
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = 0.f;
      for (int kb = 0; kb < k_blocks; ++kb) {
        mbar_wait(full_bar + 8 * stage, phase);
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
        named_barrier(1 + cw, 128);  // the warpgroup's wgmmas and scale reads are done
        mbar_arrive_if(empty_bar + 8 * stage, tid % 128 == 0);
        promote_cols(acc, part, s0, s1, sb);
        if (++stage == WG_STAGES) {
          stage = 0;
          phase ^= 1;
        }
      }
      store_bf16_tile(acc, epi_smem, cw, warp, lane, &out_map, pid_n * BN,
                      expert * p.M + pid_m * BM + cw * 64);
    }
    if (tid % 128 == 0) bulk_wait<0>();
  }
}

}  // namespace fp8
}  // namespace megamoe

using megamoe::encode_tiled_2d;

// out [rows, N] bf16 = the plan's rows of a [rows, K] e4m3 against b [E, N, K] e4m3 (see PLAIN);
// with seg_start (the plan's, on the device) only the rows of experts [e0, e0 + E), b holding
// just those experts (expert_base = e0)
extern "C" int megamoe_fp8_gemm_rows(const void* a, const float* a_scale, long long stride_as,
                                     const void* b, const float* b_scale, long long stride_bse,
                                     long long stride_bsn, void* out, const int* tile_expert,
                                     const int* num_rows_used, const int* seg_start,
                                     int expert_base, int E, int N, int K, int plan_bm,
                                     int group_m, long long rows, int num_sms, void* stream) {
  using namespace megamoe::fp8;
  CUtensorMap b_map, in_map, out_map;
  int rc = encode_tiled_2d(&b_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, b,
                           static_cast<long long>(E) * N, K, BN, BK);
  if (rc == 0) rc = encode_tiled_2d(&in_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, a, rows, K, BM, BK);
  if (rc == 0)
    rc = encode_tiled_2d(&out_map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, out, rows, N, 64, 64);
  if (rc != 0) return rc;
  Params p = {};
  p.a_scale = a_scale;
  p.b_scale = b_scale;
  p.tile_expert = tile_expert;
  p.num_rows_used = num_rows_used;
  p.seg_start = seg_start;
  p.expert_base = expert_base;
  p.num_experts = E;
  p.N = N;
  p.K = K;
  p.plan_bm = plan_bm;
  p.group_m = group_m;
  p.stride_as = stride_as;
  p.stride_bse = stride_bse;
  p.stride_bsn = stride_bsn;
  return launch<MODE_PLAIN>(b_map, b_map, in_map, out_map, p, num_sms,
                            static_cast<cudaStream_t>(stream));
}

// The Params the gathering modes share: token rows x [T, K] e4m3 (and their scales) gathered by
// the plan against B [E, N, K] e4m3 with 128 x 128 block scales
static megamoe::fp8::Params gathered_params(const void* x, long long stride_x, const float* x_scale,
                              long long stride_xs, const float* b_scale, long long stride_bse,
                              long long stride_bsn, const int* row_slot, const int* tile_expert,
                              const int* num_rows_used, int N, int K, int top_k, int plan_bm,
                              int group_m) {
  megamoe::fp8::Params p = {};
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

// hq [rows, H] e4m3 + hs [rows, H/128], and a [rows, 2H] bf16 unless nullptr: GEMM 1 + SwiGLU
// on the plan's token rows of x [T, D] e4m3 (see SWIGLU)
extern "C" int megamoe_fp8_gemm1_swiglu(const void* x, long long stride_x, const float* x_scale,
                                        long long stride_xs, const void* w1, const float* w1_scale,
                                        const void* w3, const float* w3_scale,
                                        long long stride_bse, long long stride_bsn, void* hq,
                                        float* hs, void* a, const int* row_slot,
                                        const int* tile_expert, const int* num_rows_used, int E,
                                        int H, int D, int top_k, int plan_bm, int group_m,
                                        int num_sms, void* stream) {
  using namespace megamoe::fp8;
  CUtensorMap w1_map, w3_map;
  int rc = encode_tiled_2d(&w1_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, w1,
                           static_cast<long long>(E) * H, D, BN, BK);
  if (rc == 0)
    rc = encode_tiled_2d(&w3_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, w3,
                         static_cast<long long>(E) * H, D, BN, BK);
  if (rc != 0) return rc;
  Params p = gathered_params(x, stride_x, x_scale, stride_xs, w1_scale, stride_bse, stride_bsn,
                             row_slot, tile_expert, num_rows_used, H, D, top_k, plan_bm, group_m);
  p.b3_scale = w3_scale;
  p.hq = static_cast<uint8_t*>(hq);
  p.hs = hs;
  p.a = static_cast<__nv_bfloat16*>(a);
  return launch<MODE_SWIGLU>(w1_map, w3_map, w1_map, w1_map, p, num_sms,
                             static_cast<cudaStream_t>(stream));
}

// kernel A (see DSWIGLU): from dy [T, D] e4m3 (scales [T, D/128]), w2^T [E, H, D] e4m3, the saved
// a [rows, 2H] bf16 and the routing weights, da [rows, 2H] + scales, da^T [2H, rows] + scales
// [2H, rows/128], h^T [H, rows] + scales, part [H/128, rows]
extern "C" int megamoe_fp8_dswiglu(const void* dy, long long stride_dy, const float* dy_scale,
                                   long long stride_dys, const void* w2t, const float* w2t_scale,
                                   long long stride_bse, long long stride_bsn,
                                   const void* a_saved, const float* tw, void* daq, float* das,
                                   void* daTq, float* daTs, void* hTq, float* hTs, float* part,
                                   const int* row_slot, const int* tile_expert,
                                   const int* num_rows_used, int E, int H, int D, int top_k,
                                   int plan_bm, int group_m, long long rows, int num_sms,
                                   void* stream) {
  using namespace megamoe::fp8;
  CUtensorMap w_map, daq_map, dat_map, ht_map;
  int rc = encode_tiled_2d(&w_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, w2t,
                           static_cast<long long>(E) * H, D, BN, BK);
  if (rc == 0)
    rc = encode_tiled_2d(&daq_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, daq, rows, 2LL * H, 64, BN);
  if (rc == 0)
    rc = encode_tiled_2d(&dat_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, daTq, 2LL * H, rows, BN, 64);
  if (rc == 0)
    rc = encode_tiled_2d(&ht_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, hTq, H, rows, BN, 64);
  if (rc != 0) return rc;
  Params p = gathered_params(dy, stride_dy, dy_scale, stride_dys, w2t_scale, stride_bse,
                             stride_bsn, row_slot, tile_expert, num_rows_used, H, D, top_k,
                             plan_bm, group_m);
  p.a_saved = static_cast<const __nv_bfloat16*>(a_saved);
  p.tw = tw;
  p.das = das;
  p.hts = hTs;
  p.dats = daTs;
  p.part = part;
  p.rows = rows;
  return launch<MODE_DSWIGLU>(w_map, ht_map, dat_map, daq_map, p, num_sms,
                              static_cast<cudaStream_t>(stream));
}

// out [E, M, N] bf16 = per expert e: at[:, segment(e)] @ bt[:, segment(e)]^T (see WGRAD);
// ticket: a zeroed device int, left zeroed
extern "C" int megamoe_fp8_wgrad(const void* at, const float* at_scale, long long stride_as,
                                 const void* bt, const float* bt_scale, long long stride_bs,
                                 void* out, const int* seg_start, const int* count,
                                 const int* expert_order, int E, int M, int N, long long rows,
                                 int group_m, int num_sms, int* ticket, void* stream) {
  using namespace megamoe::fp8;
  CUtensorMap a_map, b_map, out_map;
  int rc = encode_tiled_2d(&a_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, at, M, rows, BM, BK);
  if (rc == 0) rc = encode_tiled_2d(&b_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, bt, N, rows, BN, BK);
  if (rc == 0)
    rc = encode_tiled_2d(&out_map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, out,
                         static_cast<long long>(E) * M, N, 64, 64);
  if (rc != 0) return rc;
  WgradParams p = {};
  p.a_scale = at_scale;
  p.b_scale = bt_scale;
  p.stride_as = stride_as;
  p.stride_bs = stride_bs;
  p.seg_start = seg_start;
  p.count = count;
  p.expert_order = expert_order;
  p.ticket = ticket;
  p.E = E;
  p.M = M;
  p.N = N;
  p.group_m = group_m;
  static bool configured = false;
  if (!configured) {
    cudaError_t err = cudaFuncSetAttribute(fp8_wgrad_kernel,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           WG_SMEM_BYTES);
    if (err != cudaSuccess) return static_cast<int>(err);
    configured = true;
  }
  fp8_wgrad_kernel<<<num_sms, THREADS, WG_SMEM_BYTES, static_cast<cudaStream_t>(stream)>>>(
      a_map, b_map, out_map, p);
  return static_cast<int>(cudaGetLastError());
}

extern "C" const char* megamoe_error_string(int code) {
  return megamoe::tensor_map_error_string(code);
}
