"""Grouped FP8 GEMMs over the plan's row space (M-grouped: each row tile belongs to one expert).

    out[r, n] = sum_k A[r, k] * B[e(r)][n, k]      A, B e4m3; fp32 accumulation

A is [rows, K] with 1x128 scales [rows, K/128] (read directly, or gathered by token: row r reads
A[row_slot[r] // top_k], padding rows load zeros); B is [E, N, K] with 128x128 block scales
[E, N/128, K/128]. Both K-major, as FP8 wgmma reads them. The K loop walks 128-wide steps, and
each step's fp32 partial product is scaled by (a_scale[row] * b_scale[column block]) and added
to the fp32 accumulator: the promotion every 128 of K that Hopper's reduced-precision FP8
accumulation needs.

Epilogues (MODE):
  plain    out [R_max, N] bf16: GEMM 2 (y = h @ w2^T) and the backward's dgrad of linear 1
           (dx rows = [da1 | da3] @ [w1; w3], B = the transposed [E, D, 2H] weight copy)
  swiglu   GEMM 1: two accumulators (w1, w3 share the A tile), h = silu(a1) * a3 quantized in
           the epilogue to e4m3 with one scale per row of the 128-column tile (GEMM 2's A
           operand, no extra pass); optionally a = [a1 | a3] in bf16 for the backward
  dswiglu  fp8_dgrad2_swiglu: dhg = dy_rows @ w2[e] (B = the transposed [E, H, D] copy),
           the SwiGLU backward with the routing weight in the epilogue, and every operand the
           next GEMMs read, quantized where it sits in registers: da = [da1 | da3] per row
           (dgrad of linear 1), da^T and h^T per 128 rows of a column (the weight gradients),
           plus per-tile partials of d(topk_weights) = <dhg, h>
Tiles: BLOCK_M rows x BLOCK_N columns, BLOCK_K = 128 (one scale step). swiglu and dswiglu need
BLOCK_N = 128 (one row scale per tile); dswiglu needs BLOCK_M = 128 (one column scale per tile:
the plan's segments start on 128-row boundaries, so a weight-gradient scale block never mixes
experts). Tiles past the used rows (tile_expert -1) exit at once.
Waits on: nothing inside the launch (EP=1; stream order). Signals: nothing.
"""

import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper.kernels.fp8_quant import quantize_block
from torchtitan_megamoe.ops.hopper.kernels.tiling import constexprs, grouped_tile
from torchtitan_megamoe.ops.hopper.plan import Plan

MODE_GEMM_ROWS, MODE_GEMM1_SWIGLU, MODE_DGRAD2_SWIGLU = 0, 1, 2


@triton.jit
def _fp8_rows_kernel(
    a_ptr, a_desc, as_ptr, b_desc, bs_ptr, b2_desc, b2s_ptr, row_slot_ptr, tile_expert_ptr,
    tw_ptr, out_desc, os_ptr, aux_desc, qt_desc, qts_ptr, ht_desc, hts_ptr, part_ptr,
    num_m_tiles, N, K, R_MAX, E_LO, E_HI,
    stride_a, stride_as, stride_bse, stride_bsn, stride_os, stride_qts,
    TOP_K: tl.constexpr, PLAN_BM: tl.constexpr, GATHER: tl.constexpr, MODE: tl.constexpr,
    SAVE_A: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    # Operands come by TMA (descriptors) except the gathered token rows; a pointer tile of
    # [BLOCK_M, 128] 64-bit addresses would take 128 registers per thread (it spilled).
    # F32_DOT: the CPU interpreter (fp32 dots, e4m3 rounding emulated before each cast).
    num_n = N // BLOCK_N
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_m_tiles, num_n, GROUP_M)
    # E_LO, E_HI: the experts B holds (as expert - E_LO); other experts' tiles exit
    expert = tl.load(tile_expert_ptr + (pid_m * BLOCK_M) // PLAN_BM)
    if (expert >= E_LO) & (expert < E_HI):
        expert -= E_LO
        row0 = (pid_m * BLOCK_M).to(tl.int32)
        col0 = (pid_n * BLOCK_N).to(tl.int32)
        rows = row0 + tl.arange(0, BLOCK_M)
        slot = tl.load(row_slot_ptr + rows)
        live = slot >= 0
        if GATHER:
            a_rows = tl.where(live, slot // TOP_K, 0).to(tl.int64)
        else:
            a_rows = rows.to(tl.int64)
        offs_k = tl.arange(0, 128)
        offs_n = col0 + tl.arange(0, BLOCK_N)
        w_row = (expert * N + col0).to(tl.int32)  # row of the [E*N, K] weight view
        sa_ptrs = as_ptr + a_rows * stride_as
        sb_ptrs = bs_ptr + expert.to(tl.int64) * stride_bse + (offs_n // 128) * stride_bsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if MODE == 1:
            acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            sb3_ptrs = b2s_ptr + expert.to(tl.int64) * stride_bse + (offs_n // 128) * stride_bsn
        for k in range(0, K, 128):
            kb = k // 128
            if GATHER:
                a = tl.load(a_ptr + a_rows[:, None] * stride_a + (k + offs_k)[None, :],
                            mask=live[:, None], other=0.0)
            else:
                a = a_desc.load([row0, k])
            sa = tl.load(sa_ptrs + kb, mask=live, other=0.0) if GATHER else tl.load(sa_ptrs + kb)
            b = b_desc.load([w_row, k]).T
            if F32_DOT:  # the interpreter's dot does not take e4m3; fp32 holds them exactly
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc += tl.dot(a, b) * (sa[:, None] * tl.load(sb_ptrs + kb)[None, :])
            if MODE == 1:
                b3 = b2_desc.load([w_row, k]).T
                if F32_DOT:
                    b3 = b3.to(tl.float32)
                acc3 += tl.dot(a, b3) * (sa[:, None] * tl.load(sb3_ptrs + kb)[None, :])

        r64 = rows.to(tl.int64)
        if MODE == 0:
            out_desc.store([row0, col0], acc.to(out_desc.dtype))
        elif MODE == 1:
            h = acc * tl.sigmoid(acc) * acc3
            if SAVE_A:
                aux_desc.store([row0, col0], acc.to(aux_desc.dtype))
                aux_desc.store([row0, N + col0], acc3.to(aux_desc.dtype))
            hq, hs = quantize_block(h, 1, F32_DOT)
            out_desc.store([row0, col0], hq.to(out_desc.dtype))
            tl.store(os_ptr + r64 * stride_os + pid_n, hs)
        else:
            # N here is H; aux = the saved [a1 | a3] (bf16), out / os = da [R, 2H] per row,
            # qt / qts = da^T [2H, R] per 128 rows, ht / hts = h^T [H, R] per 128 rows
            # ordered so that few [BLOCK_M, BLOCK_N] fp32 tiles are live at once (each is 64
            # registers per thread at 8 warps): h and its store first, then da3, then da1
            rb = pid_m  # BLOCK_M == 128: this tile's rows are one scale block of the row axis
            cols_t = offs_n.to(tl.int64)
            a1 = aux_desc.load([row0, col0]).to(tl.float32)
            a3 = aux_desc.load([row0, N + col0]).to(tl.float32)
            sig = tl.sigmoid(a1)
            silu = a1 * sig
            h = silu * a3
            tl.store(part_ptr + pid_n * R_MAX + r64, tl.sum(acc * h, axis=1))
            q, s = quantize_block(h, 0, F32_DOT)
            ht_desc.store([col0, row0], tl.trans(q.to(ht_desc.dtype)))
            tl.store(hts_ptr + cols_t * stride_qts + rb, s)
            w = tl.load(tw_ptr + tl.where(live, slot, 0), mask=live, other=0.0).to(tl.float32)
            dh = acc * w[:, None]
            da = dh * silu  # da3
            q, s = quantize_block(da, 1, F32_DOT)
            out_desc.store([row0, N + col0], q.to(out_desc.dtype))
            tl.store(os_ptr + r64 * stride_os + N // 128 + pid_n, s)
            q, s = quantize_block(da, 0, F32_DOT)
            qt_desc.store([N + col0, row0], tl.trans(q.to(qt_desc.dtype)))
            tl.store(qts_ptr + (N + cols_t) * stride_qts + rb, s)
            da = dh * a3 * sig * (1.0 + a1 * (1.0 - sig))  # da1
            q, s = quantize_block(da, 1, F32_DOT)
            out_desc.store([row0, col0], q.to(out_desc.dtype))
            tl.store(os_ptr + r64 * stride_os + pid_n, s)
            q, s = quantize_block(da, 0, F32_DOT)
            qt_desc.store([col0, row0], tl.trans(q.to(qt_desc.dtype)))
            tl.store(qts_ptr + cols_t * stride_qts + rb, s)


def fp8_rows_triton(cfg: dict, mode, a, a_s, b, b_s, plan: Plan, out, out_s, gather, b2=None,
                    b2_s=None, aux=None, tw=None, qt=None, qt_s=None, ht=None, ht_s=None,
                    part=None, expert_base=None) -> None:
    """One launch of _fp8_rows_kernel in ``mode`` (the module docstring's epilogues); ``cfg``:
    a TritonGemm's kwargs(). Weights (b, b2) and their scales must be contiguous; with
    ``expert_base`` e0, b holds experts [e0, e0 + E) only and only their tiles run."""
    E, N, K = b.shape
    e_lo = expert_base or 0
    R = plan.max_rows
    bm, bn = cfg["block_m"], cfg["block_n"]
    assert plan.block_m % bm == 0 and N % bn == 0
    num_m = R // bm
    desc = TensorDescriptor.from_tensor
    b_desc = desc(b.view(E * N, K), [bn, 128])
    b2_desc = desc(b2.view(E * N, K), [bn, 128]) if b2 is not None else b_desc
    a_desc = desc(a, [bm, 128]) if not gather else b_desc
    out_desc = desc(out, [bm, bn])
    aux_desc = desc(aux, [bm, bn]) if aux is not None else out_desc
    qt_desc = desc(qt, [bn, bm]) if qt is not None else out_desc
    ht_desc = desc(ht, [bn, bm]) if ht is not None else out_desc
    f32 = a_s  # placeholder for fp32 pointers a mode does not use
    _fp8_rows_kernel[(num_m * (N // bn),)](
        a, a_desc, a_s, b_desc, b_s, b2_desc, b2_s if b2_s is not None else b_s,
        plan.row_slot, plan.tile_expert, tw if tw is not None else f32,
        out_desc, out_s if out_s is not None else f32, aux_desc,
        qt_desc, qt_s if qt_s is not None else f32, ht_desc, ht_s if ht_s is not None else f32,
        part if part is not None else f32,
        num_m, N, K, R, e_lo, e_lo + E,
        a.stride(0), a_s.stride(0), b_s.stride(0), b_s.stride(1),
        out_s.stride(0) if out_s is not None else 0,
        qt_s.stride(0) if qt_s is not None else 0,
        TOP_K=plan.top_k, PLAN_BM=plan.block_m, GATHER=gather, MODE=mode,
        SAVE_A=aux is not None, F32_DOT=settings.triton_interpreting(), **constexprs(cfg),
    )
