// Grouped GEMM over a plan's row space on Hopper (sm_90a) with the two consumer warpgroups on
// alternate tiles ("ping-pong"): while one warpgroup runs its tile's epilogue, the other's MMAs
// keep the tensor cores busy. grouped_gemm_sm90.cu's ROWS mode runs both consumer warpgroups on
// one 128 x 256 tile, so nothing feeds the tensor cores during its epilogue (8% of GEMM 2 and 4%
// of kernel C at the 30B shape were its bulk stores alone, docs/PERF.md session 16).
//
// Same contract as the ROWS mode (ops/cuda/gemm_rows.py): for the used rows r of a plan,
//   n_major 0: out[r] = in[r] @ w[e]^T,                         w [E, N, K]
//   n_major 1: out[r] = in[r, :ks] @ w[e] + in[r, ks:] @ w2[e],  w, w2 [E, ks, N]
// bf16 in, out and weights, fp32 accumulation in a fixed order per tile (results are bitwise
// those of any other tile order, and equal the ROWS mode's within bf16 rounding of the output).
// Tiles of tile_expert -1 are skipped (rows untouched); a tile whose first row is padding (slot
// -1; padding rows end a segment, and segments are 128-row aligned) holds only padding rows and
// is written as zeros without loads or MMAs. Padding rows of `in` must be zero (GEMM 1 and
// kernel A leave them so), which makes the padding rows of other tiles zero as well.
//
// Tiles: 128 rows x 128 output columns, one per consumer warpgroup: per k16 two m64n128k16
// wgmma (rows [0, 64) and [64, 128), the same B), so the accumulator is 2 x 64 fp32 registers
// per thread, as the ROWS mode's m64n256k16. K steps of 64 (128-byte rows, 128-byte swizzle).
// Ring: STAGES (6) stages of [A 128 x 64 | B 128 x 64] bf16 = 32 KiB; B is one [128 rows of w,
// 64] box (n_major 0) or two [64 k, 64 n] boxes (n_major 1, the transposed wgmma B). Staging:
// one [64, 128] bf16 tile per consumer warpgroup (two [64, 64] boxes, 16 KiB) for the bulk
// tensor stores. 6 x 32 + 2 x 16 KiB = 224 KiB of the 227.
//
// Roles (384 threads, one CTA per SM, persistent):
//   warpgroup 0, thread 0 (producer): takes units (the global ticket, or every gridDim-th one)
//     in the grouped tile order, skips those of tile_expert -1, and publishes each other unit to
//     the consumer warpgroup whose turn it is: publish index q goes to warpgroup q % 2 through
//     its unit slot (waits unit_empty[q % 2], writes {unit, first ring position, all-padding},
//     arrives unit_full[q % 2]). Then per K step of the unit: waits empty[s],
//     arrive.expect_tx(full[s], 32 KiB), TMA loads of A and B. At the end it publishes -1 to
//     both slots.
//   warpgroups 1 and 2 (consumers, c = 0, 1): take publish indices q = 2 j + c. Each waits
//     unit_full[c] (then frees the slot: unit_empty[c]), then its MMA turn: turn[c], which the
//     other warpgroup arrives on once it has issued the last wgmma batch of the previous unit
//     (q = 0 starts at once). Per K step: waits full[s], issues the batch, waits for the batch
//     before it (one batch stays queued) and frees that one's stage (empty[s], one arrival).
//     After its last batch is issued it arrives on the other's turn[1 - c], so the other
//     warpgroup's MMAs queue right behind; then it waits for its own, frees the last stage and
//     runs the epilogue: each 64-row half is converted to bf16 into its staging tile (after the
//     store engine has read the previous half) and written by two bulk tensor stores.
// Waits on: nothing outside the launch. Signals: nothing; out is complete with the launch, and
// the ticket is zero again (the CTA taking the last number resets it).

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "sm90_primitives.cuh"
#include "sm90_tiles.cuh"

namespace megamoe {
namespace pingpong {

constexpr int BM = 128;  // rows of a tile
constexpr int TN = 128;  // output columns of a tile
constexpr int BK = 64;   // K step
constexpr int STAGES = 6;
constexpr int A_BYTES = BM * BK * 2;
constexpr int B_BYTES = TN * BK * 2;
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int BOX_BYTES = 64 * 64 * 2;  // an N-major B box [64 k, 64 n]; a staging box [64, 64]
constexpr int EPI_BYTES = 2 * 2 * BOX_BYTES;
constexpr int THREADS = 384;
constexpr int L2_PROMOTION = 3;  // 256 B, as grouped_gemm_sm90.cu's default
// + ring barriers, turn[2], unit_full[2], unit_empty[2], the two unit slots, alignment
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + EPI_BYTES + 2 * STAGES * 8 + 6 * 8 + 32 + 1024;
static_assert(SMEM_BYTES <= 227 * 1024, "shared memory: fewer stages");

struct Params {
  const int* row_slot;  // the plan's (padding rows -1), or nullptr: no all-padding tiles skipped
  const int* tile_expert;
  const int* num_rows_used;
  int N;        // output columns
  int K;        // reduction length
  int k_split;  // n_major: K steps below it read w_map (rows e * k_split + k), the others w2_map
  int plan_bm;
  int group_m;
  int* ticket;  // a zeroed int the CTAs take unit numbers from (zeroed again by the last
                // taker), or nullptr: every gridDim-th unit
};

// wgmma m64n128k16, bf16 x bf16 -> fp32, A K-major and B K-major or (TRANS_B) N-major, both from
// shared memory; d[] is the warpgroup's 64 x 128 accumulator fragment (register 4 j + i of
// thread (warp, lane): row 16 warp + lane / 4 + 8 (i / 2), column 8 j + 2 (lane % 4) + i % 2).
template <bool TRANS_B>
__device__ __forceinline__ void wgmma_m64n128k16(float* d, uint64_t desc_a, uint64_t desc_b,
                                                 int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, 0, %67;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_B ? 1 : 0));
}

template <bool NMAJOR>
__global__ void __launch_bounds__(THREADS, 1)
    rows_pingpong_kernel(const __grid_constant__ CUtensorMap w_map,
                         const __grid_constant__ CUtensorMap w2_map,
                         const __grid_constant__ CUtensorMap in_map,
                         const __grid_constant__ CUtensorMap out_map, const Params p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // the swizzled tiles need their 8-row groups aligned to 1024 bytes
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));
  const uint32_t smem_base = smem_u32(smem);
  const uint32_t epi_smem = smem_base + STAGES * STAGE_BYTES;
  const uint32_t full_bar = epi_smem + EPI_BYTES;
  const uint32_t empty_bar = full_bar + STAGES * 8;
  const uint32_t turn_bar = empty_bar + STAGES * 8;
  const uint32_t unit_full = turn_bar + 2 * 8;
  const uint32_t unit_empty = unit_full + 2 * 8;
  // unit slot c: {unit (-1: none left), first ring position, all padding}
  volatile int* unit_slot = reinterpret_cast<volatile int*>(
      smem + STAGES * STAGE_BYTES + EPI_BYTES + 2 * STAGES * 8 + 6 * 8);

  const int tid = threadIdx.x;
  const int wg = tid / 128;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_bar + 8 * s, 1);   // the producer's expect_tx; the TMA bytes complete it
      mbar_init(empty_bar + 8 * s, 1);  // the one consumer warpgroup that read the stage
    }
    for (int c = 0; c < 2; ++c) {
      mbar_init(turn_bar + 8 * c, 128);  // every thread of the other consumer warpgroup
      mbar_init(unit_full + 8 * c, 1);
      mbar_init(unit_empty + 8 * c, 1);
    }
    mbar_init_fence();
    tma_prefetch_desc(&w_map);
    if (NMAJOR) tma_prefetch_desc(&w2_map);
    tma_prefetch_desc(&in_map);
    tma_prefetch_desc(&out_map);
  }
  __syncthreads();

  const int num_m = *p.num_rows_used / BM;
  const int num_n = p.N / TN;
  const int num_units = num_m * num_n;
  const int k_blocks = p.K / BK;

  if (wg == 0) {
    // ---------------- producer ----------------
    setmaxnreg_dec<40>();
    if (tid != 0) return;
    int q = 0;    // units published so far
    int pos = 0;  // K steps loaded so far: the ring position of the next unit's first stage
    int stage = 0;
    uint32_t phase = 0;
    auto publish = [&](int unit, int first, int zero) {
      const int c = q & 1;
      mbar_wait(unit_empty + 8 * c, ((q >> 1) & 1) ^ 1);
      unit_slot[4 * c] = unit;
      unit_slot[4 * c + 1] = first;
      unit_slot[4 * c + 2] = zero;
      mbar_arrive(unit_full + 8 * c);  // release: the consumers' wait acquires the slot
      ++q;
    };
    for (int it = 0;; ++it) {
      int u;
      if (p.ticket != nullptr) {
        u = atomicAdd(p.ticket, 1);
        // Every CTA takes exactly one number >= num_units (then stops), so the taker of
        // num_units + gridDim.x - 1 is the last one to touch the ticket: it zeroes it for the
        // next launch on this stream (ops/cuda/sm90.py keeps one ticket per stream).
        if (u == num_units + static_cast<int>(gridDim.x) - 1) atomicExch(p.ticket, 0);
      } else {
        u = blockIdx.x + it * gridDim.x;
      }
      if (u >= num_units) break;
      int pid_m, pid_n;
      grouped_tile(u, num_m, num_n, p.group_m, pid_m, pid_n);
      const int expert = p.tile_expert[(pid_m * BM) / p.plan_bm];
      if (expert < 0) continue;
      const bool zero = p.row_slot != nullptr && p.row_slot[pid_m * BM] < 0;
      publish(u, pos, zero);
      if (zero) continue;
      for (int kb = 0; kb < k_blocks; ++kb) {
        mbar_wait(empty_bar + 8 * stage, phase ^ 1);
        const uint32_t full = full_bar + 8 * stage;
        const uint32_t a_smem = smem_base + stage * STAGE_BYTES;
        const uint32_t b_smem = a_smem + A_BYTES;
        mbar_arrive_expect_tx(full, STAGE_BYTES);
        tma_load_2d(a_smem, &in_map, kb * BK, pid_m * BM, full);
        if constexpr (NMAJOR) {
          const int k0 = kb * BK;
          const bool first = k0 < p.k_split;
          const int k_row = expert * p.k_split + (first ? k0 : k0 - p.k_split);
#pragma unroll
          for (int j = 0; j < TN / 64; ++j) {
            tma_load_2d(b_smem + j * BOX_BYTES, first ? &w_map : &w2_map, pid_n * TN + 64 * j,
                        k_row, full);
          }
        } else {
          tma_load_2d(b_smem, &w_map, kb * BK, expert * p.N + pid_n * TN, full);
        }
        if (++stage == STAGES) {
          stage = 0;
          phase ^= 1;
        }
      }
      pos += k_blocks;
    }
    publish(-1, 0, 0);
    publish(-1, 0, 0);
  } else {
    // ---------------- consumers ----------------
    setmaxnreg_inc<232>();  // 40 x 128 + 232 x 256 <= 64K registers
    const int cw = wg - 1;
    const int warp = (tid % 128) / 32;
    const int lane = tid % 32;
    const uint32_t staging = epi_smem + cw * 2 * BOX_BYTES;
    float acc0[64], acc1[64];  // rows [0, 64) and [64, 128) of the tile
    // Frees ring stage s once every warp of the warpgroup is past the wgmma batch that read it
    // (a predicated arrival, not a branch: a batch stays in flight across it).
    auto release = [&](int s, bool pred) {
      named_barrier(1 + cw, 128);
      mbar_arrive_if(empty_bar + 8 * s, pred && tid % 128 == 0);
    };
    for (int j = 0;; ++j) {
      mbar_wait(unit_full + 8 * cw, j & 1);
      const int u = unit_slot[4 * cw];
      const int first = unit_slot[4 * cw + 1];
      const bool zero = unit_slot[4 * cw + 2] != 0;
      named_barrier(1 + cw, 128);  // the whole warpgroup has read the slot
      mbar_arrive_if(unit_empty + 8 * cw, tid % 128 == 0);
      if (u < 0) break;
      int pid_m, pid_n;
      grouped_tile(u, num_m, num_n, p.group_m, pid_m, pid_n);
      // The MMA turn: publish index 2 j + cw follows the other warpgroup's 2 j + cw - 1.
      if (j > 0 || cw == 1) mbar_wait(turn_bar + 8 * cw, (cw == 1 ? j : j - 1) & 1);
      // The whole wgmma pipeline of the tile sits on one path: no branch between a batch's
      // issue and its wait (ptxas would serialize the wgmmas otherwise), so an all-padding tile
      // runs the same code with no K steps.
      if (zero) {
#pragma unroll
        for (int i = 0; i < 64; ++i) {
          acc0[i] = 0.f;
          acc1[i] = 0.f;
        }
      }
      const int steps = zero ? 0 : k_blocks;
      int stage = first % STAGES;
      uint32_t phase = (first / STAGES) & 1;
      int prev = stage;
      for (int kb = 0; kb < steps; ++kb) {
        mbar_wait(full_bar + 8 * stage, phase);
        const uint32_t a_smem = smem_base + stage * STAGE_BYTES;
        const uint32_t b_smem = a_smem + A_BYTES;
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < BK / 16; ++k) {
          const uint64_t b_desc = NMAJOR ? smem_desc_nmajor128(b_smem + k * 16 * 128, BOX_BYTES)
                                         : smem_desc_swizzled<128>(b_smem + k * 32);
          const int scale = (kb > 0 || k > 0) ? 1 : 0;
          wgmma_m64n128k16<NMAJOR>(acc0, smem_desc_swizzled<128>(a_smem + k * 32), b_desc, scale);
          wgmma_m64n128k16<NMAJOR>(acc1, smem_desc_swizzled<128>(a_smem + 64 * 128 + k * 32),
                                   b_desc, scale);
        }
        wgmma_commit();
        // keep this batch queued on the tensor cores while the previous one retires, then free
        // the previous batch's stage
        wgmma_wait<1>();
        release(prev, kb > 0);
        prev = stage;
        if (++stage == STAGES) {
          stage = 0;
          phase ^= 1;
        }
      }
      // every batch of this tile is issued: the other warpgroup's MMAs may queue behind them
      mbar_arrive(turn_bar + 8 * (1 - cw));
      wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < 64; ++i) {
        fence_reg(acc0[i]);
        fence_reg(acc1[i]);
      }
      release(prev, steps > 0);
      // Epilogue, one 64-row half at a time through this warpgroup's staging tile. Waits on:
      // the store engine having read the tile's previous contents. Signals: nothing (the
      // launch's end completes the stores).
      auto store_half = [&](const float (&acc)[64], int half) {
        if (tid % 128 == 0) bulk_wait_read<0>();
        named_barrier(1 + cw, 128);
#pragma unroll
        for (int jj = 0; jj < 16; ++jj) {
#pragma unroll
          for (int h8 = 0; h8 < 2; ++h8) {
            __nv_bfloat162 v = __floats2bfloat162_rn(acc[4 * jj + 2 * h8], acc[4 * jj + 2 * h8 + 1]);
            // row r of the half, column 8 jj + 2 (lane % 4): box jj / 8, 16-byte chunk jj % 8
            const int r = warp * 16 + lane / 4 + 8 * h8;
            st_shared_b32(staging + (jj / 8) * BOX_BYTES + swizzled_offset<128>(r, jj % 8) +
                              4 * (lane % 4),
                          *reinterpret_cast<uint32_t*>(&v));
          }
        }
        fence_proxy_async();  // the st.shared writes, before the store engine reads them
        named_barrier(1 + cw, 128);
        if (tid % 128 == 0) {
          const int row = pid_m * BM + 64 * half, col = pid_n * TN;
          tma_store_2d(&out_map, col, row, staging);
          tma_store_2d(&out_map, col + 64, row, staging + BOX_BYTES);
          bulk_commit();
        }
      };
      store_half(acc0, 0);
      store_half(acc1, 1);
    }
    // the last tile's bulk stores complete before the CTA exits
    if (tid % 128 == 0) bulk_wait<0>();
  }
}

template <bool NMAJOR>
static int launch(const CUtensorMap& w_map, const CUtensorMap& w2_map, const CUtensorMap& in_map,
                  const CUtensorMap& out_map, const Params& p, int num_sms, cudaStream_t stream) {
  static bool configured = false;
  if (!configured) {
    cudaError_t err = cudaFuncSetAttribute(rows_pingpong_kernel<NMAJOR>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
    if (err != cudaSuccess) return static_cast<int>(err);
    configured = true;
  }
  // persistent: one CTA per SM
  rows_pingpong_kernel<NMAJOR><<<num_sms, THREADS, SMEM_BYTES, stream>>>(w_map, w2_map, in_map,
                                                                          out_map, p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace pingpong
}  // namespace megamoe

// C entry point (ctypes); see the header for the contract. in [rows, K] and out [rows, N]
// contiguous bf16, weights contiguous. Shapes are checked by the Python wrapper
// (ops/cuda/gemm_rows.py): N % 128 == 0, K and k_split % 64 == 0, plan_bm % 128 == 0. row_slot:
// the plan's, or nullptr. ticket: a zeroed device int (dynamic tile order; left zeroed) or
// nullptr (static). Returns 0, or a negative code / CUDA error number (megamoe_error_string).
extern "C" int megamoe_gemm_rows_pingpong(const void* in, const void* w, const void* w2, void* out,
                                          const int* row_slot, const int* tile_expert,
                                          const int* num_rows_used, int E, int N, int K,
                                          int k_split, int n_major, int plan_bm, int group_m,
                                          long long rows, int num_sms, int* ticket, void* stream) {
  using namespace megamoe::pingpong;
  using megamoe::make_bf16_map;
  CUtensorMap w_map, w2_map, in_map, out_map;
  int rc;
  if (n_major) {
    rc = make_bf16_map(&w_map, w, static_cast<long long>(E) * k_split, N, BK, 64, L2_PROMOTION);
    if (rc == 0) {
      rc = make_bf16_map(&w2_map, K > k_split ? w2 : w, static_cast<long long>(E) * k_split, N,
                         BK, 64, L2_PROMOTION);
    }
  } else {
    rc = make_bf16_map(&w_map, w, static_cast<long long>(E) * N, K, TN, 64, L2_PROMOTION);
    w2_map = w_map;
  }
  if (rc == 0) rc = make_bf16_map(&in_map, in, rows, K, BM, 64, L2_PROMOTION);
  if (rc == 0) rc = make_bf16_map(&out_map, out, rows, N, 64, 64, L2_PROMOTION);
  if (rc != 0) return rc;
  Params p = {};
  p.row_slot = row_slot;
  p.tile_expert = tile_expert;
  p.num_rows_used = num_rows_used;
  p.N = N;
  p.K = K;
  p.k_split = n_major ? k_split : K;
  p.plan_bm = plan_bm;
  p.group_m = group_m;
  p.ticket = ticket;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return n_major ? launch<true>(w_map, w2_map, in_map, out_map, p, num_sms, s)
                 : launch<false>(w_map, w2_map, in_map, out_map, p, num_sms, s);
}

extern "C" const char* megamoe_error_string(int code) {
  if (const char* m = megamoe::tensor_map_error(code)) return m;
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
