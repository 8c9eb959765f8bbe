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

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper import deepgemm
from torchtitan_megamoe.ops.hopper.cuda.dgrad2_swiglu import fp8_dgrad2_swiglu_sm90
from torchtitan_megamoe.ops.hopper.cuda.gemm1_swiglu import fp8_gemm1_swiglu_sm90
from torchtitan_megamoe.ops.hopper.cuda.gemm_rows import fp8_gemm_rows_sm90
from torchtitan_megamoe.ops.hopper.heuristics import FP8_INTERPRET, fp8_gemm_candidates
from torchtitan_megamoe.ops.hopper.kernels.fp8_quant import (
    FP8, gather_rows, quantize_block, swiglu_quant_rows,
)
from torchtitan_megamoe.ops.hopper.kernels.tiling import constexprs, grouped_tile
from torchtitan_megamoe.ops.hopper.plan import Plan
from torchtitan_megamoe.ops.hopper.tune import bucket, pick_config, relative_difference

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


_EPILOGUES = {MODE_GEMM_ROWS: "gemm_rows", MODE_GEMM1_SWIGLU: "gemm1_swiglu", MODE_DGRAD2_SWIGLU: "dgrad2_swiglu"}
"""Each mode's candidate list in heuristics.FP8_CONFIGS."""


def _run(stage, mode, a, a_s, b, b_s, plan: Plan, out, out_s, gather, b2=None, b2_s=None,
         aux=None, tw=None, qt=None, qt_s=None, ht=None, ht_s=None, part=None, config=None,
         outputs=None, expert_base=None):
    E, N, K = b.shape
    e_lo = expert_base or 0
    assert expert_base is None or mode == MODE_GEMM_ROWS
    R = plan.max_rows
    assert K % 128 == 0 and N % 128 == 0 and a.shape[1] == K, (a.shape, b.shape)

    def launch(cfg):
        if cfg.get("impl") == "deepgemm":
            _deepgemm(mode, a, a_s, b, b_s, plan, out, out_s, gather, b2, b2_s, aux, expert_base)
            return
        # ours read each weight contiguous: the halves of a joined [w1; w3] copy are copied
        # (deepgemm.joined; the tuner times that too)
        bb, bbs, bb2, bb2s = (t if t is None else t.contiguous() for t in (b, b_s, b2, b2_s))
        if cfg.get("impl") == "sm90":
            if mode == MODE_GEMM_ROWS:
                rows, rows_s = gather_rows(a, a_s, plan) if gather else (a, a_s)
                fp8_gemm_rows_sm90(rows, rows_s, bb, bbs, plan, out, group_m=cfg["group_m"],
                                   expert_base=expert_base)
            elif mode == MODE_DGRAD2_SWIGLU:
                fp8_dgrad2_swiglu_sm90(a, a_s, bb, bbs, aux, tw, plan, out, out_s, qt, qt_s,
                                       ht, ht_s, part, group_m=cfg["group_m"])
            else:
                fp8_gemm1_swiglu_sm90(a, a_s, bb, bbs, bb2, bb2s, plan, out, out_s, aux,
                                      group_m=cfg["group_m"])
            return
        bm, bn = cfg["block_m"], cfg["block_n"]
        assert plan.block_m % bm == 0 and N % bn == 0
        num_m = R // bm
        desc = TensorDescriptor.from_tensor
        b_desc = desc(bb.view(E * N, K), [bn, 128])
        b2_desc = desc(bb2.view(E * N, K), [bn, 128]) if b2 is not None else b_desc
        a_desc = desc(a, [bm, 128]) if not gather else b_desc
        out_desc = desc(out, [bm, bn])
        aux_desc = desc(aux, [bm, bn]) if aux is not None else out_desc
        qt_desc = desc(qt, [bn, bm]) if qt is not None else out_desc
        ht_desc = desc(ht, [bn, bm]) if ht is not None else out_desc
        f32 = a_s  # placeholder for fp32 pointers a mode does not use
        _fp8_rows_kernel[(num_m * (N // bn),)](
            a, a_desc, a_s, b_desc, bbs, b2_desc, bb2s if b2_s is not None else bbs,
            plan.row_slot, plan.tile_expert, tw if tw is not None else f32,
            out_desc, out_s if out_s is not None else f32, aux_desc,
            qt_desc, qt_s if qt_s is not None else f32, ht_desc, ht_s if ht_s is not None else f32,
            part if part is not None else f32,
            num_m, N, K, R, e_lo, e_lo + E,
            a.stride(0), a_s.stride(0), bbs.stride(0), bbs.stride(1),
            out_s.stride(0) if out_s is not None else 0,
            qt_s.stride(0) if qt_s is not None else 0,
            TOP_K=plan.top_k, PLAN_BM=plan.block_m, GATHER=gather, MODE=mode,
            SAVE_A=aux is not None, F32_DOT=settings.triton_interpreting(), **constexprs(cfg),
        )

    def checked():  # what the tuner compares (the used rows: every position written; syncs)
        return outputs() if outputs else (out[: int(plan.num_rows_used)],)

    if config is None:
        if settings.triton_interpreting():
            config = FP8_INTERPRET
        else:
            # DeepGEMM on or off (MEGAMOE_DEEPGEMM) offers other candidates: another pick
            key = (bucket(R), N, K, E, plan.block_m, gather, aux is not None,
                   expert_base is not None, deepgemm.available(a))
            # a function: the list (and its sm90 check) is built only until the tuner has picked
            config = pick_config(stage, key,
                                 lambda: fp8_gemm_candidates(_EPILOGUES[mode], a, N, K,
                                                             plan.block_m, out, gather,
                                                             expert_base is not None),
                                 launch, outputs=lambda _: checked(),
                                 mismatch=relative_difference)
    launch(config)


def _deepgemm(mode, a, a_s, b, b_s, plan, out, out_s, gather, b2, b2_s, aux, expert_base):
    """The DeepGEMM side (deepgemm.py): A gathered into the row space where it is per token,
    the plain GEMM, and the fused epilogue's work as passes around it (GEMM 1: a = [a1 | a3]
    from two GEMMs on the same rows, then the SwiGLU quantized per row)."""
    assert mode in (MODE_GEMM_ROWS, MODE_GEMM1_SWIGLU) and expert_base is None, mode
    N = b.shape[1]
    rows, rows_s = gather_rows(a, a_s, plan) if gather else (a, a_s)
    layout = deepgemm.grouped_layout(plan)
    if mode == MODE_GEMM_ROWS:
        deepgemm.gemm_rows(rows, rows_s, b, b_s, layout, out)
        return
    acts = aux if aux is not None else torch.empty(
        (plan.max_rows, 2 * N), dtype=torch.bfloat16, device=a.device)
    w13 = deepgemm.joined(b, b_s, b2, b2_s)
    if w13 is not None:  # one launch over [w1; w3] writes [a1 | a3]
        deepgemm.gemm_rows(rows, rows_s, *w13, layout, acts)
    else:
        deepgemm.gemm_rows(rows, rows_s, b, b_s, layout, acts[:, :N])
        deepgemm.gemm_rows(rows, rows_s, b2, b2_s, layout, acts[:, N:])
    swiglu_quant_rows(acts, plan, out, out_s)


def fp8_gemm1_swiglu(xq, xs, w1q, w1s, w3q, w3s, plan: Plan, save_a: bool, config=None):
    """(hq [R_max, H] e4m3, hs [R_max, H/128], a [R_max, 2H] bf16 or None): GEMM 1 + SwiGLU on
    the token rows of xq (gathered by the plan), h quantized per row for GEMM 2."""
    E, H, D = w1q.shape
    R = plan.max_rows
    hq = torch.empty((R, H), dtype=FP8, device=xq.device)
    hs = torch.empty((R, H // 128), dtype=torch.float32, device=xq.device)
    a = torch.empty((R, 2 * H), dtype=torch.bfloat16, device=xq.device) if save_a else None
    _run("fp8_gemm1_swiglu", MODE_GEMM1_SWIGLU, xq, xs, w1q, w1s, plan, hq, hs, gather=True, b2=w3q, b2_s=w3s, aux=a,
         config=config, outputs=lambda: tuple(t[: int(plan.num_rows_used)]
                                              for t in (hq, hs) + ((a,) if save_a else ())))
    return hq, hs, a


def fp8_gemm_rows(aq, a_s, bq, b_s, plan: Plan, out_dtype, gather: bool = False, config=None,
                  expert_base: int | None = None, out: torch.Tensor | None = None,
                  stage: str = "fp8_gemm2"):
    """out [R_max, N] (out_dtype) = rows of aq @ bq[e]^T in the row space; ``stage``: the
    tuner's name (fp8_gemm2, or fp8_dgrad1 for the backward's use). With
    ``expert_base`` e0, bq / b_s hold experts [e0, e0 + E) only and only their rows of ``out``
    (given, or new) are written: one group of a GEMM split by experts."""
    if out is None:
        out = torch.empty((plan.max_rows, bq.shape[1]), dtype=out_dtype, device=aq.device)
    outputs = None
    if expert_base is not None:  # what the tuner compares: this group's rows (syncs)
        def outputs():
            lo, hi = plan.seg_start[[expert_base, expert_base + bq.shape[0]]].tolist()
            return (out[lo:hi],)
    _run(stage, MODE_GEMM_ROWS, aq, a_s, bq, b_s, plan, out, None, gather=gather, config=config,
         outputs=outputs, expert_base=expert_base)
    return out


def fp8_dgrad2_swiglu(gq, gs, w2tq, w2ts, a_saved, topk_weights, plan: Plan, config=None):
    """fp8_dgrad2_swiglu (see the module docstring). Returns (daq [R, 2H], das
    [R, 2H/128], daTq [2H, R], daTs [2H, R/128], hTq [H, R], hTs [H, R/128], part [H/128, R])."""
    E, H, D = w2tq.shape
    R = plan.max_rows
    dev = gq.device
    daq = torch.empty((R, 2 * H), dtype=FP8, device=dev)
    das = torch.empty((R, 2 * H // 128), dtype=torch.float32, device=dev)
    daTq = torch.empty((2 * H, R), dtype=FP8, device=dev)
    daTs = torch.empty((2 * H, R // 128), dtype=torch.float32, device=dev)
    hTq = torch.empty((H, R), dtype=FP8, device=dev)
    hTs = torch.empty((H, R // 128), dtype=torch.float32, device=dev)
    part = torch.empty((H // 128, R), dtype=torch.float32, device=dev)
    assert hTq.stride(0) == R and daTq.stride(0) == R and hTs.stride(0) == daTs.stride(0)
    used = lambda t: t[: int(plan.num_rows_used)]  # noqa: E731  (rows past them are unwritten)
    _run("fp8_dgrad2_swiglu", MODE_DGRAD2_SWIGLU, gq, gs, w2tq, w2ts, plan, daq, das, gather=True, aux=a_saved,
         tw=topk_weights.reshape(-1).float(), qt=daTq, qt_s=daTs, ht=hTq, ht_s=hTs, part=part,
         config=config,
         outputs=lambda: (used(daq), used(das), part.sum(0)[: int(plan.num_rows_used)]))
    return daq, das, daTq, daTs, hTq, hTs, part
