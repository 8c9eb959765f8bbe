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

enum Mode : int { MODE_PLAIN = 0, MODE_SWIGLU = 1 };

template <int MODE>
struct Layout {
  static constexpr int B_BYTES = (MODE == MODE_SWIGLU ? 2 : 1) * BOX_BYTES;
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int STAGES = MODE == MODE_SWIGLU ? 4 : 6;  // 4 x 48 KiB, 6 x 32 KiB
  static constexpr int EPI_BYTES = MODE == MODE_PLAIN ? 2 * 2 * EPI_BOX_BYTES : 0;
  // + ring barriers, alignment
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + EPI_BYTES + 2 * STAGES * 8 + 1024;
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory: fewer stages");
};

struct Params {
  const uint8_t* x;       // SWIGLU: token rows [T, K] e4m3, stride_x bytes apart
  const float* a_scale;   // PLAIN: [R, K/128]; SWIGLU: [T, K/128]; row stride stride_as
  const float* b_scale;   // [E, N/128, K/128] (SWIGLU: w1's); strides stride_bse, stride_bsn
  const float* b3_scale;  // SWIGLU: w3's, same strides
  uint8_t* hq;            // SWIGLU: h [R, N] e4m3 (row stride N)
  float* hs;              // SWIGLU: h's scales [R, N/128] (row stride N/128)
  __nv_bfloat16* a;       // SWIGLU: nullptr or a = [a1 | a3] [R, 2N]
  const int* row_slot;
  const int* tile_expert;
  const int* num_rows_used;
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

// w1_map: B (SWIGLU: w1), w3_map: SWIGLU's w3, in_map: PLAIN's A, out_map: PLAIN's out
template <int MODE>
__global__ void __launch_bounds__(THREADS, 1)
    fp8_gemm_kernel(const __grid_constant__ CUtensorMap w1_map,
                    const __grid_constant__ CUtensorMap w3_map,
                    const __grid_constant__ CUtensorMap in_map,
                    const __grid_constant__ CUtensorMap out_map, const Params p) {
  using L = Layout<MODE>;
  constexpr bool GATHER = MODE == MODE_SWIGLU;
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
    if (GATHER) tma_prefetch_desc(&w3_map);
    if (!GATHER) tma_prefetch_desc(&in_map);
  }
  __syncthreads();

  const int num_m = *p.num_rows_used / BM;
  const int num_n = p.N / BN;
  const int num_units = num_m * num_n;
  const int k_blocks = p.K / BK;
  // the unit's tile and expert (-1: another phase's tile, skipped by both roles)
  auto decode = [&](int u, int& pid_m, int& pid_n) {
    grouped_tile(u, num_m, num_n, p.group_m, pid_m, pid_n);
    return p.tile_expert[(pid_m * BM) / p.plan_bm];
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
            mbar_arrive_expect_tx(full, 2 * BOX_BYTES);
            tma_load_2d(b_smem, &w1_map, kb * BK, w_row, full);
            tma_load_2d(b_smem + BOX_BYTES, &w3_map, kb * BK, w_row, full);
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
    [[maybe_unused]] float acc3[GATHER ? 64 : 1];
    for (int u = blockIdx.x; u < num_units; u += gridDim.x) {
      int pid_m, pid_n;
      const int expert = decode(u, pid_m, pid_n);
      if (expert < 0) continue;
      const int row0 = pid_m * BM + r_in;
      // the rows' scale rows: the row itself (PLAIN) or its token (SWIGLU; padding rows: none)
      long long srow[2];
      bool live[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (GATHER) {
          const int slot = p.row_slot[row0 + 8 * h];
          live[h] = slot >= 0;
          srow[h] = live[h] ? static_cast<long long>(slot / p.top_k) : 0;
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
      if constexpr (GATHER) {
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
      if constexpr (GATHER) {
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
          const float s0 = __ldg(sa0 + kb) * b1, s1 = __ldg(sa1 + kb) * b1;
          mbar_wait(full_bar + 8 * stage, phase);
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
      if constexpr (GATHER) {
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
        const uint32_t tile = epi_smem + cw * 2 * EPI_BOX_BYTES;
        if (tid % 128 == 0) bulk_wait_read<0>();  // the previous tile's store has read it
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
        if (tid % 128 == 0) {
          const int out_row = pid_m * BM + cw * 64;
          tma_store_2d(&out_map, pid_n * BN, out_row, tile);
          tma_store_2d(&out_map, pid_n * BN + 64, out_row, tile + EPI_BOX_BYTES);
          bulk_commit();
        }
      }
    }
    if (!GATHER && tid % 128 == 0) bulk_wait<0>();
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

}  // namespace fp8
}  // namespace megamoe

using megamoe::encode_tiled_2d;

// out [rows, N] bf16 = the plan's rows of a [rows, K] e4m3 against b [E, N, K] e4m3 (see PLAIN)
extern "C" int megamoe_fp8_gemm_rows(const void* a, const float* a_scale, long long stride_as,
                                     const void* b, const float* b_scale, long long stride_bse,
                                     long long stride_bsn, void* out, const int* tile_expert,
                                     const int* num_rows_used, int E, int N, int K, int plan_bm,
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
  Params p = {};
  p.x = static_cast<const uint8_t*>(x);
  p.a_scale = x_scale;
  p.b_scale = w1_scale;
  p.b3_scale = w3_scale;
  p.hq = static_cast<uint8_t*>(hq);
  p.hs = hs;
  p.a = static_cast<__nv_bfloat16*>(a);
  p.row_slot = row_slot;
  p.tile_expert = tile_expert;
  p.num_rows_used = num_rows_used;
  p.N = H;
  p.K = D;
  p.top_k = top_k;
  p.plan_bm = plan_bm;
  p.group_m = group_m;
  p.stride_x = stride_x;
  p.stride_as = stride_xs;
  p.stride_bse = stride_bse;
  p.stride_bsn = stride_bsn;
  return launch<MODE_SWIGLU>(w1_map, w3_map, w1_map, w1_map, p, num_sms,
                             static_cast<cudaStream_t>(stream));
}

extern "C" const char* megamoe_error_string(int code) {
  return megamoe::tensor_map_error_string(code);
}
