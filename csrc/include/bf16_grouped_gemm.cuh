// The bf16 grouped GEMM over a plan's row space, warp-specialized for Hopper (sm_90a): one kernel
// template whose MODE gives the four kernel families their bf16 kernels (entry points in
// csrc/<family>.cu):
//   gemm1_swiglu (GEMM1_SWIGLU mode, GEMM 1 with SwiGLU in the epilogue):
//     h[r] = silu(x_tok(r) @ w1[e]^T) * (x_tok(r) @ w3[e]^T)
//   gemm_rows (GEMM_ROWS / GEMM_ROWS_NMAJOR modes, GEMM 2 and dgrad1):
//     out[r] = in[r] @ w[e]^T,  in [R, K], out [R, N], w [E, N, K] (K-major weights), or
//     out[r] = in[r, :Ks] @ w[e] + in[r, Ks:] @ w'[e],  w, w' [E, Ks, N] (N-major weights,
//     NMAJOR; w' only when K = 2 Ks, e.g. [da1 | da3] against w1 and w3), all row-major.
//   wgrad (WGRAD_* modes, the backward's weight gradients, fp32 accumulation over the
//     expert's rows):  dw[e] = A_e^T @ B_e  with A_e, B_e the rows of expert e's segment; one
//     of the two operands is gathered by token (dw2: A = dy rows, B = hw; dw1|dw3: A = [da1 |
//     da3], B = x rows), the other read by TMA from the row space (or both by TMA from rows
//     gathered before: WGRAD_TMA).
//   dgrad2_swiglu (DGRAD2_SWIGLU mode, dgrad of linear 2 and the SwiGLU backward on the saved
//     a = [a1 | a3]): dh[r] = dy_tok(r) @ w2[e] (dy gathered as GEMM 1 gathers x, w2 [E, D, H]
//     N-major as GEMM_ROWS_NMAJOR reads it), and in the epilogue the SwiGLU backward with the row's
//     routing weight w: da1 = w dh a3 silu'(a1), da3 = w dh silu(a1), hw = w silu(a1) a3, and
//     per 256-column H tile the partial <dh, h> of d(topk_weights).
// GEMM1_SWIGLU is described first; the differences of the other modes follow it.
//
// GEMM1_SWIGLU: for the rows r of a plan (ops/hopper/plan.py): row r reads token row_slot[r] / top_k of x
// (a gather: no permuted copy of x exists), padding rows (slot -1) read zeros, every 128-row
// tile belongs to one expert e = tile_expert[tile], tiles with e < 0 are skipped (another launch
// of a phased plan computes them). Optional pre-activation store a = [a1 | a3] [R, 2H] (what the
// forward saves for the backward).
//
// Tile: 128 rows x 128 hidden columns of h. The B operand is the w1 tile (128 rows) stacked on
// the w3 tile (128 rows): one m64n256k16 wgmma per 16-wide K step gives a1 in accumulator
// columns [0, 128) and a3 in [128, 256), so a thread holds a1 and a3 of the same (row, col).
// K steps of 64 (rows of 128 bytes, 128-byte swizzle); STAGES-deep ring of [A 16 KiB | B 32 KiB].
//
// Roles (384 threads, one CTA per SM, persistent over the tiles of the used rows, which are
// read on device, so no host sync; tile order: scheduler.cuh):
//   warpgroup 0 (producer, 40 registers): per stage, waits `empty[s]`, then
//       - thread 0: arrive.expect_tx(full[s], 32 KiB) and two TMA loads (w1, w3 tiles);
//       - all 128 threads: 8 cp.async of 16 bytes each (the gathered x rows, written in the
//         swizzle pattern the wgmma descriptor expects), then
//         cp.async.mbarrier.arrive.noinc(full[s]).
//       (cp.async, not one TMA load per gathered row: the TMA unit's cost is per load.)
//     full[s] completes after 129 arrivals and 32 KiB of TMA bytes.
//   warpgroups 1, 2 (consumers, 232 registers): rows [0, 64) and [64, 128) of the tile. Per
//     stage: wait full[s], issue 4 wgmma, wait for them, then a warpgroup barrier and ONE
//     arrival per warpgroup on empty[s] (2 complete it). After the K loop: SwiGLU in fp32, each
//     [64, 128] bf16 output tile of the warpgroup (h, and a1, a3 with the store) staged in
//     shared memory in the 128-byte swizzle and written by bulk tensor stores, so the warpgroup
//     returns to its MMAs once the store engine has read the tile; meanwhile the producer
//     already fills the ring with the next tile's stages.
//   Most of the epilogue is not overlapped with the next tile's MMAs: a fourth (epilogue)
//     warpgroup does not fit the register file (the m64n256k16 accumulator needs more than a
//     512-thread CTA's 128 registers per thread). Only one store per tile moves under the next
//     tile's first batch: GEMM_ROWS's second column half and GEMM 1's last store (DEFER below).
// GEMM_ROWS mode: the tile is 128 rows x 256 output columns; the two 128-row halves
//   of the B stage are rows [0, 128) and [128, 256) of the weight tile (one tensor map), so the
//   accumulator holds columns [0, 128) where GEMM1_SWIGLU has a1 and [128, 256) where it has a3. The
//   A tile is a plain [128, 64] TMA box of `in` (its rows are the plan's rows, contiguous), so
//   full[s] completes on ONE arrival (the producer's thread 0, the only producer thread that
//   works) and 48 KiB of TMA bytes, and the consumers need no proxy fence. Padding rows of `in`
//   are zeros (GEMM 1 writes them), so out's padding rows are zeros too.
//   NMAJOR: the weights are [E * Ks, N] row-major (N contiguous), so the B stage is four
//   [BK k-rows, 64 n] TMA boxes (128-byte rows, 128-byte swizzle), one per 64 output columns,
//   and the wgmma reads B transposed (MN-major descriptor: 8 KiB between the boxes, 1 KiB
//   between 8-row k groups). K steps below Ks read w, the others w'.
// WGRAD modes: a unit is (expert, 128-row M tile, 256-column N tile) of the
//   gradient [E, M, N], in the order experts-longest-first (expert_order) so the tiles in
//   flight share their experts' rows in L2; its K loop walks the expert's segment of the row
//   space in steps of 64 rows (zero steps for an empty expert: the tile is stored as zeros).
//   Both operands are MN-major in shared memory, as four (B) / two (A) [64 rows, 64] boxes with
//   the 128-byte swizzle, read by wgmma transposed (A: trans-a; each consumer warpgroup's 64 M
//   rows are one box). The TMA operand comes as boxes of the row-space tensor; the gathered one
//   by cp.async from its token rows (thread t: 16-byte chunk t % 8 of every box row of rows
//   t / 8 + 16 i, zeros for padding rows), so full[s] takes 128 cp.async arrivals plus the
//   expect_tx one, as in GEMM1_SWIGLU. Padding rows contribute 0: the gathered operand is zero there
//   and the TMA one finite. dw1|dw3: M tiles below m_split go to the first output, the others
//   to the second. WGRAD_TMA: no gathers, one producer thread, as GEMM_ROWS.
// DGRAD2_SWIGLU mode: the producer gathers the dy rows exactly as GEMM1_SWIGLU gathers
//   x (128 threads, cp.async, full[s] = 128 arrivals + the B bytes) and loads the w2 tile as the
//   four N-major boxes of GEMM_ROWS_NMAJOR; the tile is 128 rows x 256 H columns. After a tile's K
//   steps the producer fills EPI_STAGES more ring stages, one per 64 columns, with the saved a1
//   and a3 boxes by TMA, so they arrive while the consumers still multiply. The epilogue reads
//   them from shared memory in the accumulator's layout (the row's slot and routing weight were
//   loaded before the K loop), writes da1 and da3 over them and hw into the stage's third box,
//   and one thread per warpgroup stores the three by bulk tensor stores, then frees the stage
//   once they are read. <dh, h> is summed over the thread's 64 columns, then over the quad's 4
//   lanes (fixed order: deterministic) into part[pid_n, row]. Optionally (store_gathered) the
//   tiles with pid_n 0 also store the gathered dy rows of each K step into a row-space copy
//   [rows, D] (zeros on padding rows), which the dw2 weight gradient then reads by TMA instead
//   of gathering dy again.
// Waits on: nothing outside the launch. Signals: nothing; h (and a) / out are complete with the
// launch, and the dynamic order's ticket is zero again (the CTA taking the last number resets
// it), so the next launch on the stream reuses it.
//
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "epilogue.cuh"
#include "launch.h"
#include "ptx.cuh"
#include "ring.cuh"
#include "scheduler.cuh"
#include "tensor_map.h"

namespace megamoe {
namespace bf16 {

constexpr int BM = 128;
constexpr int BN = 128;
constexpr int BK = 64;                  // K step: rows of 128 bytes, the 128-byte swizzle
constexpr int ROW_BYTES = BK * 2;       // one K step of one row, the swizzle span
constexpr int CHUNKS = ROW_BYTES / 16;  // 16-byte cp.async chunks per row
constexpr int ROWS_PER_PASS = 128 / CHUNKS;  // rows the producer's 128 threads gather at once
constexpr int PASSES = BM / ROWS_PER_PASS;
constexpr int STAGES = 4;  // ring depth: 4 x 48 KiB of the 227 KiB of shared memory
// register split: 40 per producer thread, 232 per consumer thread (40 * 128 + 232 * 256 <= 64K)
constexpr int PRODUCER_REGS = 40;
constexpr int A_BYTES = BM * BK * 2;
constexpr int B_BYTES = 2 * BN * BK * 2;
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int NMAJOR_BOX_BYTES = BK * 128;  // NMAJOR: one [BK, 64] box of the B stage
constexpr int THREADS = 384;
// DGRAD2_SWIGLU: the epilogue runs on EPI_STAGES more ring stages per tile, one per 64 of its 256
// columns: [a1 box | a3 box | hw staging], each [128 rows, 64] bf16 in the 128-byte swizzle (a
// stage of BK 64 holds exactly the three). da1 and da3 overwrite a1 and a3 in place.
constexpr int EPI_STAGES = 4;
constexpr int EPI_IN_BYTES = 128 * 64 * 2;
// The epilogue's staging: one [64 rows, 128 columns] bf16 tile per consumer warpgroup, as two
// boxes of 64 columns (128-byte rows, 128-byte swizzle), after the ring
constexpr int EPI_BOX_BYTES = STAGING_BOX_BYTES;
constexpr int EPI_BYTES = 2 * 2 * EPI_BOX_BYTES;
// + ring barriers, the tile scheduler's 2-slot ring (4 barriers, 2 ids), alignment
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + EPI_BYTES + 2 * STAGES * 8 + 64 + 1024;
static_assert(SMEM_BYTES <= 227 * 1024, "shared memory: fewer stages");

struct KernelParams {
  const __nv_bfloat16* x;  // GEMM1_SWIGLU: the token rows; GEMM_ROWS: unused (the A map reads `in`)
  __nv_bfloat16* h;        // GEMM1_SWIGLU: h [R, H]; GEMM_ROWS: out [R, N]
  __nv_bfloat16* a;  // GEMM1_SWIGLU: nullptr (no pre-activation store) or a [R, 2H]; GEMM_ROWS: nullptr
  const int* row_slot;
  const int* tile_expert;
  const int* num_rows_used;
  int N;  // output columns per weight operand: H (GEMM1_SWIGLU: a1 and a3 each), N (GEMM_ROWS)
  int K;  // reduction length: D (GEMM1_SWIGLU), K (GEMM_ROWS)
  int k_split;  // NMAJOR: K steps below it read w1_map (rows e * k_split + k), the others w3_map
  // WGRAD: the expert segments [seg_start[e], seg_start[e + 1]) and the order of the experts'
  // units (nullptr: 0, 1, ...); M rows of the gradient per expert, split at m_split between
  // the two outputs (h_map, a_map; = M for one output); x: the gathered operand's token rows
  const int* seg_start;
  const int* expert_order;
  // WGRAD: each expert's rows that are not trailing padding (plan.count). Padding rows end a
  // segment and add zeros, so the K loop stops after the last K step holding a counted row: a
  // segment padded to 128 rows loses its last 64-row step when at most 64 of its last 128 rows
  // are real.
  const int* count;
  // WGRAD_TMA and WGRAD_GATHER_B: the K walk covers `regions` plans' row spaces (the EP
  // backward's regions in one launch): seg_start [regions, E + 1] holds each plan's first rows
  // in the row-space operand (and row_slot), count [regions, E] its real rows (0: the plan adds
  // nothing for the expert)
  int regions;
  // WGRAD: fp32 outputs (the gradients of fp32 parameters, written from the registers) instead
  // of the bf16 ones in h_map / a_map; nullptr: bf16
  float* out_f32[2];
  int f32_accumulate;  // 1: out_f32 += the gradient (one fp32 add: the bits of an add pass)
  // DGRAD2_SWIGLU (a, da and hw travel as tensor maps; so do the gathered dy rows, in w3_map,
  // when store_gathered is set)
  const float* topk_w;  // [T * K] routing weights by slot
  int store_gathered;
  float* part;          // [H / 256, part_stride]
  long long part_stride;
  int M;
  int m_split;
  int num_experts;
  int top_k;
  int plan_bm;
  int group_m;
  int* ticket;  // dynamic tile order: a zeroed int the CTAs take unit numbers from (zeroed again
               // by the last taker); nullptr: static
  long long stride_x;
  long long stride_h;
  long long stride_a;
};

enum Mode : int {
  GEMM1_SWIGLU = 0,      // x rows gathered, w1|w3 K-major, SwiGLU epilogue
  GEMM_ROWS = 1,         // in by TMA, w K-major
  GEMM_ROWS_NMAJOR = 2,  // in by TMA, w (and w') N-major
  WGRAD_GATHER_A = 3,    // A (dy rows) gathered, B (hw) by TMA
  WGRAD_GATHER_B = 4,    // A ([da1 | da3]) by TMA, B (x rows) gathered
  WGRAD_TMA = 5,         // both from row-space tensors by TMA (rows gathered before)
  DGRAD2_SWIGLU = 6,     // dy rows gathered, w2 N-major, SwiGLU backward epilogue
};

// GEMM1_SWIGLU: w1_map / w3_map are the two weights, in_map unused, h_map / a_map = h / a. GEMM_ROWS:
// w1_map = w3_map = the weight (NMAJOR: w and w'), in_map = `in`, h_map = out, a_map unused. WGRAD:
// in_map = A's row-space tensor (GATHER_B) or w1_map = B's (GATHER_A); h_map, a_map = the two
// outputs. DGRAD2_SWIGLU: w1_map = w2, w3_map = the gathered dy rows' copy (store_gathered),
// in_map = a, h_map = da, a_map = hw.
template <int MODE>
__global__ void __launch_bounds__(THREADS, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap w1_map,
                        const __grid_constant__ CUtensorMap w3_map,
                        const __grid_constant__ CUtensorMap h_map,
                        const __grid_constant__ CUtensorMap a_map,
                        const __grid_constant__ CUtensorMap in_map, const KernelParams p) {
  constexpr bool ROWS = MODE != GEMM1_SWIGLU;     // 256-column tiles, one B operand
  constexpr bool NMAJOR = MODE >= GEMM_ROWS_NMAJOR;  // B N-major (transposed wgmma B)
  constexpr bool WGRAD = MODE >= WGRAD_GATHER_A && MODE <= WGRAD_TMA;  // K = expert rows
  constexpr bool GATHER_ROWS = MODE == GEMM1_SWIGLU || MODE == DGRAD2_SWIGLU;  // K-major gather
  constexpr bool GATHER_A = GATHER_ROWS || MODE == WGRAD_GATHER_A;
  constexpr bool GATHER_B = MODE == WGRAD_GATHER_B;
  constexpr bool GATHERS = GATHER_A || GATHER_B;  // the producer's 128 threads issue cp.async
  constexpr int TILE_N = ROWS ? 2 * BN : BN;  // output columns of a tile (per operand in GEMM1_SWIGLU)
  // DEFER: a tile's last [64, 128] store per warpgroup (GEMM_ROWS: its second column half; GEMM 1: h
  // in inference, a3 in the training forward) is held as 32 packed bf16x2 registers and staged
  // and stored under the next tile's first wgmma batch (predicated, no branch), so its wait for
  // the staging tile and its shared-memory writes leave the tensor cores' idle time. Not in
  // WGRAD, where it was slower on dw2 at large shapes.
  constexpr bool RDEFER = MODE == GEMM_ROWS || MODE == GEMM_ROWS_NMAJOR;
  constexpr bool DEFER = RDEFER || MODE == GEMM1_SWIGLU;
  static_assert(MODE != DGRAD2_SWIGLU || (BK == 64 && TILE_N == 64 * EPI_STAGES &&
                                               STAGE_BYTES == 3 * EPI_IN_BYTES),
                "DGRAD2_SWIGLU: the epilogue stages need BK 64");
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const SmemLayout<STAGES, STAGE_BYTES, EPI_BYTES> smem(smem_raw);
  const uint32_t smem_base = smem.base;
  const uint32_t epi_smem = smem.epilogue();  // the epilogue's staging tiles
  const UnitRing units = smem.units();
  const bool dynamic = p.ticket != nullptr;

  const int tid = threadIdx.x;
  const int wg = tid / 128;
  if (tid == 0) {
    smem.ring().init(GATHERS ? 128 + 1 : 1);
    units.init();
    mbar_init_fence();
    tma_prefetch_desc(&w1_map);
    tma_prefetch_desc(&w3_map);
    if (ROWS) tma_prefetch_desc(&in_map);
    if (WGRAD) tma_prefetch_desc(&h_map);
  }
  __syncthreads();

  // A unit is one M tile x one N tile (WGRAD: of one expert's gradient).
  const int num_m = WGRAD ? 0 : *p.num_rows_used / BM;
  const int num_n = p.N / TILE_N;
  const int num_mt = WGRAD ? p.M / BM : 0;  // WGRAD: M tiles per expert
  const int num_units = WGRAD ? p.num_experts * num_mt * num_n : num_m * num_n;
  const int first_unit = blockIdx.x;
  const int unit_stride = gridDim.x;
  const int group_m = p.group_m;

  // Unit of the it-th tile this CTA computes. Static: every gridDim-th unit from blockIdx. Dynamic:
  // the producer's thread 0 takes the next unit number from the global ticket and
  // passes it to its warpgroup (named barrier 3) and to the consumers (the UnitRing), so the CTAs walk the units in one global order however they drift apart: the
  // weights of the units in flight stay in L2 (the static stride let slow and fast SMs spread
  // over several experts' weights, multiplying the DRAM traffic).
  auto static_unit = [&](int it) { return first_unit + it * unit_stride; };

  // What both roles need of a unit: its tile, its expert (-1: another phase's tile, skipped),
  // its K steps and (WGRAD) first row of the segment.
  struct Tile {
    int pid_m, pid_n, expert, k_blocks, row0;
    bool any;
  };
  auto decode = [&](int u) {
    Tile t;
    if constexpr (WGRAD) {
      const int per_expert = num_mt * num_n;
      const int ei = u / per_expert;
      t.pid_m = (u % per_expert) / num_n;
      t.pid_n = u % num_n;
      t.expert = p.expert_order != nullptr ? p.expert_order[ei] : ei;
      t.row0 = p.seg_start[t.expert];
      t.k_blocks = (p.count[t.expert] + BK - 1) / BK;
      for (int j = 1; j < p.regions; ++j) {
        t.k_blocks += (p.count[j * p.num_experts + t.expert] + BK - 1) / BK;
      }
      // a gradient added to gains nothing from a unit without rows: skipped, not stored
      t.any = !(p.f32_accumulate && t.k_blocks == 0);
    } else {
      grouped_tile(u, num_m, num_n, group_m, t.pid_m, t.pid_n);
      t.expert = t.pid_m < num_m ? p.tile_expert[(t.pid_m * BM) / p.plan_bm] : -1;
      t.any = t.expert >= 0;
      t.k_blocks = p.K / BK;
      t.row0 = 0;
    }
    return t;
  };

  if (wg == 0) {
    // ---------------- producer ----------------
    setmaxnreg_dec<PRODUCER_REGS>();
    const int c = tid & (CHUNKS - 1);                              // 16-byte chunk of a row's K step
    const int rg = static_cast<int>(static_cast<unsigned>(tid) / CHUNKS);  // rows rg, rg + ROWS_PER_PASS, ...
    const Ring<STAGES> ring = smem.ring();
    int stage = 0;
    uint32_t phase = 0;
    // Completes stage `full` once this thread's cp.async gathers land (the consumers fence them
    // for the async proxy).
    auto gathers_issued = [&](uint32_t full) { cp_async_arrive_noinc(full); };
    // no gathers (GEMM_ROWS): thread 0 issues every TMA load; the other producer threads idle
    for (int it = 0; GATHERS || tid == 0; ++it) {
      int u;
      if (dynamic) {
        const int slot = it & 1;
        if (tid == 0) units.publish(it, slot, p.ticket, num_units);
        if (GATHERS) named_barrier(3, 128);
        u = units.read(slot);
      } else {
        u = static_unit(it);
      }
      if (u >= num_units) break;
      const Tile t = decode(u);
      if (!t.any) continue;
      const int expert = t.expert, pid_m = t.pid_m, pid_n = t.pid_n, k_blocks = t.k_blocks;
      const int w_row = expert * p.N + pid_n * TILE_N;
      // B halves: the w1 and w3 tiles (GEMM1_SWIGLU), rows [0, 128) and [128, 256) of w's tile (GEMM_ROWS)
      const int w_row_b1 = ROWS ? w_row + BN : w_row;
      int tok[PASSES];
#pragma unroll
      for (int i = 0; i < PASSES; ++i) {
        const int slot =
                GATHER_ROWS && expert >= 0 ? p.row_slot[pid_m * BM + i * ROWS_PER_PASS + rg]
                                              : -1;
        tok[i] = slot >= 0 ? slot / p.top_k : -1;
      }
      // WGRAD gathers: the slots of this thread's rows (t / 8 + 16 i) of the next K step, loaded
      // one step ahead so that their latency hides behind the empty-slot wait and the previous
      // step's copies instead of stalling every step (the rows change with every K step)
      // WGRAD: a walk over the K steps (regions > 1: region after region, each region's first
      // row and K steps of the expert); next_row gives the first row of the next step
      struct Walk {
        int reg, kb, row0, steps;
      };
      auto next_row = [&](Walk& w) {
        while (w.kb == w.steps) {  // the next region with rows (k_blocks counts them all)
          ++w.reg;
          w.kb = 0;
          w.row0 = p.seg_start[w.reg * (p.num_experts + 1) + expert];
          w.steps = (p.count[w.reg * p.num_experts + expert] + BK - 1) / BK;
        }
        return w.row0 + BK * w.kb++;
      };
      Walk walk = {0, 0, t.row0, WGRAD ? (p.count[expert] + BK - 1) / BK : 0};
      constexpr int ROW_PASSES = BK / 16;
      int next_slot[ROW_PASSES];
      int next_r0 = 0;  // gathers: the first row of the step whose slots were loaded last
      auto load_slots = [&](int kb) {
        if (WGRAD && GATHERS && kb < k_blocks) next_r0 = next_row(walk);
#pragma unroll
        for (int i = 0; i < ROW_PASSES; ++i) {
          next_slot[i] = WGRAD && GATHERS && kb < k_blocks
                             ? p.row_slot[next_r0 + tid / 8 + 16 * i] : -1;
        }
      };
      load_slots(0);
      // GATHER_ROWS: this thread's 16-byte chunk c of the K step of the tile's rows rg + 16 i
      // (8 threads per 128-byte row), zeros for padding rows
      auto gather_rows = [&](uint32_t a_smem, int kb) {
#pragma unroll
        for (int i = 0; i < PASSES; ++i) {
          const int r = i * ROWS_PER_PASS + rg;
          const uint32_t dst = a_smem + swizzled_offset<ROW_BYTES>(r, c);
          const bool valid = tok[i] >= 0;
          const __nv_bfloat16* src =
              p.x + (valid ? static_cast<long long>(tok[i]) * p.stride_x : 0) + kb * BK + c * 8;
          cp_async_16(dst, src, valid ? 16 : 0);
        }
      };
      for (int kb = 0; kb < k_blocks; ++kb) {
        int slot[ROW_PASSES];
#pragma unroll
        for (int i = 0; i < ROW_PASSES; ++i) slot[i] = next_slot[i];
        const int step_r0 = next_r0;
        load_slots(kb + 1);
        mbar_wait(ring.empty(stage), phase ^ 1);
        const uint32_t a_smem = smem_base + stage * STAGE_BYTES;
        const uint32_t b_smem = a_smem + A_BYTES;
        const uint32_t full = ring.full(stage);
        if constexpr (WGRAD) {
          const int r0 = GATHERS ? step_r0 : next_row(walk);
          if (tid == 0) {
            mbar_arrive_expect_tx(full, (GATHER_A ? 0 : A_BYTES) + (GATHER_B ? 0 : B_BYTES));
            if (!GATHER_A) {
#pragma unroll
              for (int j = 0; j < BM / 64; ++j) {
                tma_load_2d(a_smem + j * NMAJOR_BOX_BYTES, &in_map, pid_m * BM + 64 * j, r0, full);
              }
            }
            if (!GATHER_B) {
#pragma unroll
              for (int j = 0; j < TILE_N / 64; ++j) {
                tma_load_2d(b_smem + j * NMAJOR_BOX_BYTES, &w1_map, pid_n * TILE_N + 64 * j, r0,
                            full);
              }
            }
          }
          if constexpr (GATHERS) {
            // The gathered operand, coalesced as GEMM 1's gather: 8 consecutive threads copy one
            // 128-byte row of a box (thread t: chunk t % 8 of rows t / 8 + 16 i), so every warp
            // request reads whole 128-byte lines instead of a 16-byte piece of 32 rows.
            constexpr int BOXES = (GATHER_A ? BM : TILE_N) / 64;
            const int c = tid % 8, rsub = tid / 8;
            const __nv_bfloat16* src =
                p.x + (GATHER_A ? pid_m * BM : pid_n * TILE_N) + c * 8;
            const uint32_t dst = GATHER_A ? a_smem : b_smem;
#pragma unroll
            for (int i = 0; i < ROW_PASSES; ++i) {
              const int row = rsub + 16 * i;
              const __nv_bfloat16* row_src =
                  src + (slot[i] >= 0 ? static_cast<long long>(slot[i] / p.top_k) * p.stride_x : 0);
#pragma unroll
              for (int bx = 0; bx < BOXES; ++bx) {
                cp_async_16(dst + bx * NMAJOR_BOX_BYTES + swizzled_offset<128>(row, c),
                            row_src + bx * 64, slot[i] >= 0 ? 16 : 0);
              }
            }
            gathers_issued(full);
          }
        } else if constexpr (MODE == DGRAD2_SWIGLU) {
          if (tid == 0) {
            mbar_arrive_expect_tx(full, B_BYTES);
#pragma unroll
            for (int j = 0; j < TILE_N / 64; ++j) {
              tma_load_2d(b_smem + j * NMAJOR_BOX_BYTES, &w1_map, pid_n * TILE_N + 64 * j,
                          expert * p.k_split + kb * BK, full);
            }
          }
          gather_rows(a_smem, kb);
          gathers_issued(full);
        } else if constexpr (NMAJOR) {
          const int k0 = kb * BK;
          const bool first = k0 < p.k_split;
          const CUtensorMap* w_map = first ? &w1_map : &w3_map;
          const int k_row = expert * p.k_split + (first ? k0 : k0 - p.k_split);
          mbar_arrive_expect_tx(full, A_BYTES + B_BYTES);
          tma_load_2d(a_smem, &in_map, k0, pid_m * BM, full);
#pragma unroll
          for (int j = 0; j < TILE_N / 64; ++j) {
            tma_load_2d(b_smem + j * NMAJOR_BOX_BYTES, w_map, pid_n * TILE_N + 64 * j, k_row, full);
          }
        } else if constexpr (ROWS) {
          mbar_arrive_expect_tx(full, A_BYTES + B_BYTES);
          tma_load_2d(a_smem, &in_map, kb * BK, pid_m * BM, full);
          tma_load_2d(b_smem, &w1_map, kb * BK, w_row, full);
          tma_load_2d(b_smem + B_BYTES / 2, &w3_map, kb * BK, w_row_b1, full);
        } else {
          if (tid == 0) {
            mbar_arrive_expect_tx(full, B_BYTES);
            tma_load_2d(b_smem, &w1_map, kb * BK, w_row, full);
            tma_load_2d(b_smem + B_BYTES / 2, &w3_map, kb * BK, w_row_b1, full);
          }
          gather_rows(a_smem, kb);
          gathers_issued(full);
        }
        if (++stage == STAGES) {
          stage = 0;
          phase ^= 1;
        }
      }
      if constexpr (MODE == DGRAD2_SWIGLU) {
        // The epilogue's stages: per 64 columns of the tile, the saved a1 and a3 [128 rows, 64]
        // boxes, loaded while the consumers still multiply (see EPI_STAGES). full[s] takes the
        // same 129 arrivals as a K step: thread 0's expect_tx and one from every thread.
#pragma unroll 1
        for (int c = 0; c < EPI_STAGES; ++c) {
          mbar_wait(ring.empty(stage), phase ^ 1);
          const uint32_t full = ring.full(stage);
          const uint32_t slot_smem = smem_base + stage * STAGE_BYTES;
          if (tid == 0) {
            const int col = pid_n * TILE_N + 64 * c;
            mbar_arrive_expect_tx(full, 2 * EPI_IN_BYTES);
            tma_load_2d(slot_smem, &in_map, col, pid_m * BM, full);
            tma_load_2d(slot_smem + EPI_IN_BYTES, &in_map, p.N + col, pid_m * BM, full);
          }
          mbar_arrive(full);
          if (++stage == STAGES) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
    }
  } else {
    // ---------------- consumers ----------------
    // the register file is 64K: what the producer gives up, the two consumer warpgroups share
    setmaxnreg_inc<(65536 / 128 - PRODUCER_REGS) / 2 / 8 * 8>();
    const int cw = wg - 1;  // rows [64 cw, 64 cw + 64) of the tile
    const int warp = (tid % 128) / 32;
    const int lane = tid % 32;
    float acc[128];
    const Ring<STAGES> ring = smem.ring();
    int stage = 0;
    uint32_t phase = 0;
    // DEFER: the previous tile's last store (GEMM_ROWS: its second column half), packed, waiting to
    // be staged and stored
    [[maybe_unused]] uint32_t pend[32];
    [[maybe_unused]] bool pending = false;
    [[maybe_unused]] int pend_col = 0, pend_row = 0;
    [[maybe_unused]] const CUtensorMap* pend_map = &h_map;
    // Stages and stores the pending half (every instruction predicated on `pending`, so it can
    // run while a wgmma batch is in flight). Waits on: the store engine having read the
    // staging tile (the first half's store). Signals: nothing.
    [[maybe_unused]] auto flush_pending = [&]() {
      const bool pred = pending;
      const uint32_t tile = epi_smem + cw * 2 * EPI_BOX_BYTES;
      bulk_wait_read_all_if(pred && tid % 128 == 0);
      named_barrier(1 + cw, 128);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = warp * 16 + lane / 4 + 8 * half;
          st_shared_b32_if(tile + (j / 8) * EPI_BOX_BYTES + swizzled_offset<128>(r, j % 8) +
                               4 * (lane % 4),
                           pend[2 * j + half], pred);
        }
      }
      fence_proxy_async();
      named_barrier(1 + cw, 128);
      const bool issue = pred && tid % 128 == 0;
      tma_store_2d_commit_if(pend_map, pend_col, pend_row, tile, issue);
      tma_store_2d_commit_if(pend_map, pend_col + 64, pend_row, tile + EPI_BOX_BYTES, issue);
      pending = false;
    };
    for (int it = 0;; ++it) {
      int u;
      if (dynamic) {
        u = units.receive(it, cw);
      } else {
        u = static_unit(it);
      }
      if (u >= num_units) break;
      // Padding skip: a segment's padding rows sit at its end and segments are aligned to the
      // plan's 128-row multiple, so when this warpgroup's first row is padding (slot -1) all
      // its 64 rows are; its MMAs would only multiply zeros. It passes the stages on and
      // writes zeros, what the MMAs would have given (about half the plan's padding compute).
      // Not in WGRAD, whose K loop is the rows. DGRAD2_SWIGLU
      // also takes the slots of this thread's two epilogue rows (their routing weights follow
      // decode's loads; all are used only after the K loop). The slots are loaded before
      // decode's tile_expert load so that the latencies overlap.
      int first_slot = 0;
      int row_slot2[2] = {-1, -1};
      if (!WGRAD && p.row_slot != nullptr) {
        int um, pn;
        grouped_tile(u, num_m, num_n, group_m, um, pn);
        const int m = um;
        if (m < num_m) {
          const int* rows = p.row_slot + m * BM + cw * 64;
          first_slot = rows[0];
          if constexpr (MODE == DGRAD2_SWIGLU) {
#pragma unroll
            for (int half = 0; half < 2; ++half) row_slot2[half] = rows[warp * 16 + lane / 4 + 8 * half];
          }
        }
      }
      const Tile t = decode(u);
      if (!t.any) continue;
      float row_w[2] = {0.f, 0.f};
      if constexpr (MODE == DGRAD2_SWIGLU) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          if (row_slot2[half] >= 0) row_w[half] = p.topk_w[row_slot2[half]];
        }
      }
      const bool active = t.expert >= 0;
      const int pid_m = t.pid_m, pid_n = t.pid_n, k_blocks = t.k_blocks;
      const bool zero_rows = active && first_slot < 0;
      auto release = [&](int s, bool pred) { ring.release(s, cw, pred); };
      auto advance = [&]() {
        if (++stage == STAGES) {
          stage = 0;
          phase ^= 1;
        }
      };
      // DGRAD2_SWIGLU with store_gathered: the warpgroup's thread 0 stores its 64 gathered dy
      // rows of each K step (a [64, 64] box, the one tile per M tile with pid_n 0) into the
      // row-space copy that dw2 reads, then waits until the store engine has read them before
      // the slot is freed (well within the stage's MMAs)
      const bool store_rows =
          MODE == DGRAD2_SWIGLU && p.store_gathered && pid_n == 0 && tid % 128 == 0;
      auto store_gathered = [&](int kb) {
        if constexpr (MODE == DGRAD2_SWIGLU) {
          tma_store_2d_commit_if(&w3_map, kb * BK, pid_m * BM + cw * 64,
                                 smem_base + stage * STAGE_BYTES + cw * 64 * ROW_BYTES, store_rows);
        }
      };
      if (!active || zero_rows) {
        // nothing but padding rows (or no expert, which a plan never gives): pass every stage on
        for (int kb = 0; kb < k_blocks; ++kb) {
          mbar_wait(ring.full(stage), phase);
          if constexpr (MODE == DGRAD2_SWIGLU) {
            fence_proxy_async();  // the zero-filled gathers, for the store engine
            store_gathered(kb);
            bulk_wait_read_all_if(store_rows);
          }
          release(stage, true);
          advance();
        }
        if (!active) continue;
      }
      // The whole wgmma pipeline of the tile sits on one path: no branch between a batch's
      // issue and its wait (ptxas would serialize the wgmmas otherwise).
      if ((WGRAD && k_blocks == 0) || zero_rows) {
        // an expert without rows (its gradient tile is zero), or padding rows
#pragma unroll
        for (int i = 0; i < 128; ++i) acc[i] = 0.f;
      }
      int prev = stage;
      // one K step: wait for its stage, issue its wgmma batch (left in flight)
      auto issue_step = [&](int kb) {
        mbar_wait(ring.full(stage), phase);
        // the cp.async rows are generic-proxy writes; wgmma reads through the async proxy
        // (no gathers: TMA wrote both operands, nothing to fence)
        if (GATHERS) fence_proxy_async();
        store_gathered(kb);
        // this warpgroup's 64 rows of A: rows [64 cw, +64) (K-major) or box cw (M-major)
        const uint32_t a_smem =
            smem_base + stage * STAGE_BYTES + (WGRAD ? cw * NMAJOR_BOX_BYTES : cw * 64 * ROW_BYTES);
        const uint32_t b_smem = smem_base + stage * STAGE_BYTES + A_BYTES;
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < BK / 16; ++k) {
          const uint64_t a_desc =
              WGRAD ? smem_desc_nmajor128(a_smem + k * 16 * 128, NMAJOR_BOX_BYTES)
                    : smem_desc_swizzled<ROW_BYTES>(a_smem + k * 32);
          const uint64_t b_desc =
              NMAJOR ? smem_desc_nmajor128(b_smem + k * 16 * 128, NMAJOR_BOX_BYTES)
                     : smem_desc_swizzled<ROW_BYTES>(b_smem + k * 32);
          wgmma_m64n256k16<WGRAD, NMAJOR>(acc, a_desc, b_desc, (kb > 0 || k > 0) ? 1 : 0);
        }
        wgmma_commit();
      };
      // after a K step's issue: wait for its batch and free its stage (leaving one batch queued
      // while the previous one retires measured no faster)
      auto retire_step = [&]() {
        wgmma_wait<0>();
        if (MODE == DGRAD2_SWIGLU) bulk_wait_read_all_if(store_rows);
        release(stage, true);
        prev = stage;
        advance();
      };
      const int steps = zero_rows ? 0 : k_blocks;
      int kb0 = 0;
      if constexpr (DEFER) {
        if (steps > 0) {
          // the previous tile's deferred store goes out under this tile's first batch
          issue_step(0);
          flush_pending();
          retire_step();
          kb0 = 1;
        }
      }
      for (int kb = kb0; kb < steps; ++kb) {
        issue_step(kb);
        retire_step();
      }
      if constexpr (DEFER) {
        if (pending) flush_pending();  // no K step ran (padding rows, an expert without rows)
      }
      wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < 128; ++i) fence_reg(acc[i]);
      // Epilogue. Accumulator register 4j + q of thread (warp, lane) holds row
      // 16 warp + lane/4 + 8 (q/2) and column 8j + 2 (lane%4) + q%2 of the 64x256 block; j < 16
      // is a1, j >= 16 the a3 of column 8 (j - 16) + ...
      if constexpr (MODE == DGRAD2_SWIGLU) {
        // SwiGLU backward on the tile's dh (fp32, in the accumulators), 64 columns per epilogue
        // stage (see EPI_STAGES): this warpgroup's rows [64 cw, +64) of the stage's a1 and a3
        // boxes are read from shared memory in the accumulator's layout, da1 and da3 written
        // back over them and hw into the third box, then thread 0 stores the three [64, 64]
        // boxes. Waits on: full[s] (the producer's a1/a3 loads). Signals: empty[s] once the
        // store engine has read the stage.
        const int H = p.N;
        float dot[2] = {0.f, 0.f};
#pragma unroll
        for (int c = 0; c < EPI_STAGES; ++c) {
          mbar_wait(ring.full(stage), phase);
          const uint32_t a1_s = smem_base + stage * STAGE_BYTES + cw * (EPI_IN_BYTES / 2);
          const uint32_t a3_s = a1_s + EPI_IN_BYTES;
          const uint32_t hw_s = a3_s + EPI_IN_BYTES;
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const uint32_t off =
                  swizzled_offset<128>(warp * 16 + lane / 4 + 8 * half, jj) + 4 * (lane % 4);
              const uint32_t a1_bits = ld_shared_b32(a1_s + off);
              const uint32_t a3_bits = ld_shared_b32(a3_s + off);
              const float2 a1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&a1_bits));
              const float2 a3 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&a3_bits));
              const float w = row_w[half];
              float da1[2], da3[2], hw[2];
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const float x1 = e ? a1.y : a1.x, x3 = e ? a3.y : a3.x;
                const float dh = acc[4 * (8 * c + jj) + 2 * half + e];
                const float sig = sigmoid_approx(x1);
                const float silu = x1 * sig;
                const float h = silu * x3;
                dot[half] += dh * h;
                const float dhw = dh * w;
                da1[e] = dhw * x3 * (sig + silu * (1.0f - sig));
                da3[e] = dhw * silu;
                hw[e] = h * w;
              }
              __nv_bfloat162 v1 = __floats2bfloat162_rn(da1[0], da1[1]);
              __nv_bfloat162 v3 = __floats2bfloat162_rn(da3[0], da3[1]);
              __nv_bfloat162 vh = __floats2bfloat162_rn(hw[0], hw[1]);
              st_shared_b32(a1_s + off, *reinterpret_cast<uint32_t*>(&v1));
              st_shared_b32(a3_s + off, *reinterpret_cast<uint32_t*>(&v3));
              st_shared_b32(hw_s + off, *reinterpret_cast<uint32_t*>(&vh));
            }
          }
          fence_proxy_async();  // the st.shared writes, before the store engine reads them
          named_barrier(1 + cw, 128);
          if (tid % 128 == 0) {
            const int col = pid_n * TILE_N + 64 * c, row = pid_m * BM + cw * 64;
            tma_store_2d(&h_map, col, row, a1_s);
            tma_store_2d(&h_map, H + col, row, a3_s);
            tma_store_2d(&a_map, col, row, hw_s);
            bulk_commit();
            // each stage is freed only once the next one's stores are issued, so its bulk reads
            // overlap the next stage's math
            if (c > 0) {
              bulk_wait_read<1>();  // the previous stage's stores have read it
              mbar_arrive(ring.empty(prev));
            }
            if (c == EPI_STAGES - 1) {
              bulk_wait_read<0>();
              mbar_arrive(ring.empty(stage));
            }
          }
          prev = stage;
          advance();
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float d = dot[half];
          d += __shfl_xor_sync(0xffffffffu, d, 1);
          d += __shfl_xor_sync(0xffffffffu, d, 2);
          const long long row =
              static_cast<long long>(pid_m) * BM + cw * 64 + warp * 16 + lane / 4 + 8 * half;
          if (lane % 4 == 0) p.part[pid_n * p.part_stride + row] = d;
        }
        continue;
      }
      // where the tile goes: its rows of the row space (GEMM1_SWIGLU, GEMM_ROWS), or of the expert's
      // gradient in the first or second output (WGRAD)
      const bool second = WGRAD && pid_m * BM >= p.m_split;
      const int out_row0 = WGRAD ? t.expert * p.m_split + pid_m * BM - (second ? p.m_split : 0)
                                 : pid_m * BM;
      const CUtensorMap* out_map = second ? &a_map : &h_map;
      // One staging tile per warpgroup (two would cost a ring stage).
      const int out_row = out_row0 + cw * 64;
      // Accumulator pair (j, half) as packed bf16x2: which 0 h = silu(a1) a3, 1 the first
      // column half (a1), 3 the second (a3)
      auto out_pair = [&](int j, int half, int which) -> uint32_t {
        const float a1x = acc[4 * j + 2 * half], a1y = acc[4 * j + 2 * half + 1];
        const float a3x = acc[64 + 4 * j + 2 * half], a3y = acc[64 + 4 * j + 2 * half + 1];
        float vx = a1x, vy = a1y;
        if (which == 0) {
          vx = swiglu_approx(a1x, a3x);
          vy = swiglu_approx(a1y, a3y);
        } else if (which == 3) {
          vx = a3x;
          vy = a3y;
        }
        return bf16x2_bits(vx, vy);
      };
      // DEFER: packs the tile's last store for flush_pending under the next tile's first batch
      [[maybe_unused]] auto defer_out = [&](const CUtensorMap* map, int out_col, int which) {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
#pragma unroll
          for (int half = 0; half < 2; ++half) pend[2 * j + half] = out_pair(j, half, which);
        }
        pend_map = map;
        pend_col = out_col;
        pend_row = out_row;
        pending = true;
      };
      auto stage_out = [&](const CUtensorMap* map, int out_col, int which) {
        store_bf16_tile(epi_smem + cw * 2 * EPI_BOX_BYTES, cw, warp, lane, map, out_col, out_row,
                        [&](int j, int half) { return out_pair(j, half, which); });
      };
      if constexpr (WGRAD) {
        if (p.out_f32[0] != nullptr) {
          // fp32 gradient: each quad's 8 consecutive floats of a row are one 32-byte sector, so
          // the stores go straight from the registers (no staging tile, no bf16 pass after)
          float* out = p.out_f32[second ? 1 : 0] + static_cast<long long>(out_row) * p.N +
                       pid_n * TILE_N + 2 * (lane % 4);
          auto at = [&](int j, int half) {
            return out + static_cast<long long>(warp * 16 + lane / 4 + 8 * half) * p.N + 8 * j;
          };
          // accumulate: reductions in L2 (red), so no warp waits on a load of the old sums
#pragma unroll
          for (int j = 0; j < 16; ++j) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const float2 lo = make_float2(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
              const float2 hi =
                  make_float2(acc[64 + 4 * j + 2 * half], acc[64 + 4 * j + 2 * half + 1]);
              if (p.f32_accumulate) {
                red_add_f32x2(at(j, half), lo);
                red_add_f32x2(at(j, half) + BN, hi);
              } else {
                *reinterpret_cast<float2*>(at(j, half)) = lo;
                *reinterpret_cast<float2*>(at(j, half) + BN) = hi;
              }
            }
          }
          continue;
        }
      }
      if constexpr (ROWS) {
        // the two column halves of the tile, as they sit in the accumulator
        stage_out(out_map, pid_n * TILE_N, 1);
        if constexpr (RDEFER) {
          defer_out(out_map, pid_n * TILE_N + BN, 3);
        } else {
          stage_out(out_map, pid_n * TILE_N + BN, 3);
        }
      } else if (p.a == nullptr) {
        defer_out(&h_map, pid_n * BN, 0);
      } else {
        stage_out(&h_map, pid_n * BN, 0);
        stage_out(&a_map, pid_n * BN, 1);
        defer_out(&a_map, p.N + pid_n * BN, 3);
      }
    }
    if constexpr (DEFER) {
      if (pending) flush_pending();  // the last tile's deferred store
    }
    // the last tile's bulk stores complete before the CTA exits
    if (tid % 128 == 0) bulk_wait<0>();
  }
}

// The launch of MODE: the five tensor maps as the kernel names them, and its parameters.
template <int MODE>
static int launch(const CUtensorMap& w1_map, const CUtensorMap& w3_map, const CUtensorMap& h_map,
                  const CUtensorMap& a_map, const CUtensorMap& in_map, const KernelParams& p,
                  int num_sms, cudaStream_t stream) {
  return launch_persistent<grouped_gemm_kernel<MODE>>(SMEM_BYTES, THREADS, num_sms, stream,
                                                      w1_map, w3_map, h_map, a_map, in_map, p);
}

// bf16 [rows, cols] in [box_rows, box_cols] boxes (K steps of BK by default)
static int make_map(CUtensorMap* map, const void* ptr, long long rows, long long cols,
                    int box_rows, int box_cols = BK) {
  return make_bf16_map(map, ptr, rows, cols, box_rows, box_cols);
}

}  // namespace bf16
}  // namespace megamoe
