"""Python side of csrc/gemm_rows.cu: grouped GEMMs over a plan's row space with both operands
by TMA (gemm2 and dgrad1).

- ``gemm_rows_sm90`` (bf16): out[r] = in[r] @ w[e]^T, w [E, N, K] (gemm2; same contract as
  ops/hopper/kernels/gemm2.py, so the two are candidates of one tuner entry);
- ``gemm_rows_nmajor_sm90`` (bf16): out[r] = in[r, :Ks] @ w[e] + in[r, Ks:] @ w'[e], w, w'
  [E, Ks, N] (dgrad1: [da1 | da3] against w1 and w3, as stored, no transpose);
- ``fp8_gemm_rows_sm90``: out [R_max, N] bf16 = aq[r] @ bq[e]^T, scaled per 1x128 / 128x128
  block (gemm2; dgrad1 with the transposed [w1 | w3] copy); sides/fp8_gemm.fp8_gemm_rows's
  contract.

The bf16 tiles are 128 rows x 256 output columns with K steps of 64, the FP8 ones 128 x 128 with
K steps of 128. All write only the used rows of ``out`` (padding rows of ``in`` are zeros, so
theirs are too; a bf16 tile half that holds only padding rows is written as zeros without its
MMAs) and skip the tiles whose tile_expert is -1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchtitan_megamoe.ops.hopper.cuda.params import Fp8GemmRowsParams, GemmRowsParams
from torchtitan_megamoe.ops.hopper.cuda.sm90 import (FP8_BLOCK, check_bf16_rows, check_fp8_operands,
                                                     check_plan, launch, launch_context)

if TYPE_CHECKING:
    from torchtitan_megamoe.ops.hopper.plan import Plan

FAMILY = "gemm_rows"
BM, BN, BK = 128, 256, 64


def shape_supported(N: int, K: int, block_m: int) -> bool:
    return N % BN == 0 and K % BK == 0 and block_m % BM == 0


def gemm_rows_sm90(inp: torch.Tensor, w: torch.Tensor, plan: Plan, out: torch.Tensor,
                   group_m: int = 8, dynamic: bool = True) -> None:
    """Writes out [R_max, N] = inp [R_max, K] @ w[e]^T (w [E, N, K]) for the used rows of
    ``plan``. ``group_m``: M tiles that sweep one N tile together. ``dynamic``: tiles from a
    global ticket in one order (see gemm1_swiglu_sm90)."""
    E, N, K = w.shape
    _launch("gemm_rows_sm90", inp, (w,), plan, out, E, N, K, K, False, group_m, dynamic)


def gemm_rows_nmajor_sm90(inp: torch.Tensor, ws: tuple, plan: Plan, out: torch.Tensor,
                          group_m: int = 8, dynamic: bool = True) -> None:
    """Writes out [R_max, N] = sum_i inp[:, i*Ks:(i+1)*Ks] @ ws[i][e] for the used rows of
    ``plan``; ws: one or two [E, Ks, N] weights (N contiguous), inp [R_max, len(ws) * Ks]."""
    if not 1 <= len(ws) <= 2 or any(t.shape != ws[0].shape for t in ws):
        raise ValueError("gemm_rows_nmajor_sm90: ws must be one or two weights of one shape")
    E, Ks, N = ws[0].shape
    _launch("gemm_rows_nmajor_sm90", inp, tuple(ws), plan, out, E, N, Ks * len(ws), Ks, True,
            group_m, dynamic)


def _launch(who, inp, ws, plan, out, E, N, K, k_split, n_major, group_m, dynamic):
    if not shape_supported(N, K, plan.block_m) or k_split % BK:
        raise ValueError(
            f"{who} needs out columns % {BN} == 0, K (and each weight's K) % {BK} == 0 and a "
            f"plan block_m multiple of {BM}; got N={N}, K={K}, block_m={plan.block_m}"
        )
    names = ("w",) if len(ws) == 1 else ("w (first K half)", "w (second K half)")
    check_bf16_rows(who, inp=inp, out=out, **dict(zip(names, ws)))
    if not (inp.is_contiguous() and out.is_contiguous() and all(w.is_contiguous() for w in ws)):
        raise ValueError(f"{who}: inp, the weights and out must be contiguous")
    check_plan(plan, inp.device, who, ("row_slot", "tile_expert", "num_rows_used"))
    R = plan.max_rows
    if inp.shape != (R, K) or out.shape != (R, N):
        raise ValueError(f"{who}: inp {tuple(inp.shape)} and out {tuple(out.shape)} must be "
                         f"[{R}, {K}] and [{R}, {N}] (the plan's row space)")
    num_sms, stream, ticket = launch_context(inp.device, dynamic)
    params = GemmRowsParams(
        inp=inp.data_ptr(), w=ws[0].data_ptr(), w2=ws[-1].data_ptr(), out=out.data_ptr(),
        row_slot=plan.row_slot.data_ptr(), tile_expert=plan.tile_expert.data_ptr(),
        num_rows_used=plan.num_rows_used.data_ptr(), E=E, N=N, K=K, k_split=k_split,
        n_major=int(n_major), plan_bm=plan.block_m, group_m=group_m, rows=R, num_sms=num_sms,
        ticket=ticket.data_ptr() if ticket is not None else None, stream=stream,
    )
    launch(FAMILY, "megamoe_gemm_rows", params, who)


def fp8_gemm_rows_sm90(aq, a_s, bq, b_s, plan: Plan, out: torch.Tensor, group_m: int = 8,
                       expert_base: int | None = None) -> None:
    """Writes the used rows of out [R_max, N] (bf16) = (aq [R_max, K] @ bq[e]^T [E, N, K]),
    scaled by a_s [R_max, K/128] and b_s [E, N/128, K/128]. With ``expert_base`` e0: bq, b_s
    hold experts [e0, e0 + E) only, and only their rows are written."""
    who = "fp8_gemm_rows_sm90"
    E, N, K = bq.shape
    if expert_base is not None and not 0 <= expert_base <= plan.num_local_experts - E:
        raise ValueError(f"{who}: experts [{expert_base}, {expert_base + E}) are not within "
                         f"the plan's {plan.num_local_experts}")
    R = plan.max_rows
    check_fp8_operands(who, plan, N, K, {"aq": aq, "bq": bq}, {"a_s": a_s, "b_s": b_s})
    if aq.shape != (R, K) or out.shape != (R, N) or a_s.shape != (R, K // FP8_BLOCK):
        raise ValueError(f"{who}: aq {tuple(aq.shape)}, a_s {tuple(a_s.shape)} and out "
                         f"{tuple(out.shape)} must be [{R}, {K}], [{R}, {K // FP8_BLOCK}], "
                         f"[{R}, {N}]")
    if out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"{who}: out must be contiguous bfloat16")
    check_plan(plan, aq.device, who, ("tile_expert", "num_rows_used", "seg_start"))
    num_sms, stream, _ = launch_context(aq.device, ticket=False)
    params = Fp8GemmRowsParams(
        a=aq.data_ptr(), a_scale=a_s.data_ptr(), stride_as=a_s.stride(0),
        b=bq.data_ptr(), b_scale=b_s.data_ptr(), stride_bse=b_s.stride(0),
        stride_bsn=b_s.stride(1), out=out.data_ptr(), tile_expert=plan.tile_expert.data_ptr(),
        num_rows_used=plan.num_rows_used.data_ptr(),
        seg_start=plan.seg_start.data_ptr() if expert_base is not None else None,
        expert_base=expert_base or 0, E=E, N=N, K=K, plan_bm=plan.block_m, group_m=group_m,
        rows=R, num_sms=num_sms, stream=stream,
    )
    launch(FAMILY, "megamoe_fp8_gemm_rows", params, who)
