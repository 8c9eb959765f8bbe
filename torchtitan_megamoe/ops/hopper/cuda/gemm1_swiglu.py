"""Python side of csrc/gemm1_swiglu.cu: GEMM 1 + SwiGLU on the plan's gathered token rows.

- ``gemm1_swiglu_sm90`` (bf16): h [R_max, H] and optionally the saved pre-activations a
  [R_max, 2H]; same contract as ops/hopper/kernels/gemm1_swiglu.py, so the two are candidates
  of one tuner entry. Tiles of 128 rows x 128 columns, K steps of 64.
- ``fp8_gemm1_swiglu_sm90``: h in e4m3 with per-row scales per 128 columns, optionally a in
  bf16 (sides/fp8_gemm.fp8_gemm1_swiglu's contract), on the token rows or on rows gathered
  before (``x_rows``).

Both write only the used rows and skip the tiles whose tile_expert is -1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchtitan_megamoe.ops.hopper.cuda.params import Fp8Gemm1SwigluParams, Gemm1SwigluParams
from torchtitan_megamoe.ops.hopper.cuda.sm90 import (FP8_BLOCK, check_bf16_rows, check_fp8_operands,
                                                     check_fp8_token_rows, check_plan, launch,
                                                     launch_context)

if TYPE_CHECKING:
    from torchtitan_megamoe.ops.hopper.plan import Plan

FAMILY = "gemm1_swiglu"
BM, BN, BK = 128, 128, 64


def shape_supported(H: int, D: int, block_m: int) -> bool:
    return H % BN == 0 and D % BK == 0 and block_m % BM == 0


def gemm1_swiglu_sm90(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, plan: Plan,
                      h: torch.Tensor, a: torch.Tensor | None = None, group_m: int = 8,
                      dynamic: bool = True) -> None:
    """Writes h (and a, when given) for the rows of ``plan``; see the module docstring.

    ``group_m``: M tiles that sweep one N tile together; 0: one group per wave of resident CTAs.
    ``dynamic``: CTAs take their tiles from a global ticket in one order, instead of every
    gridDim-th tile (whose CTAs drift apart and spread over more experts' weights than L2
    holds)."""
    E, H, D = w1.shape
    if not shape_supported(H, D, plan.block_m):
        raise ValueError(
            f"gemm1_swiglu_sm90 needs hidden % {BN} == 0, dim % {BK} == 0 and a plan block_m "
            f"multiple of {BM}; got hidden={H}, dim={D}, block_m={plan.block_m}"
        )
    named = dict(x=x, w1=w1, w3=w3, h=h) | (dict(a=a) if a is not None else {})
    check_bf16_rows("gemm1_swiglu_sm90", **named)
    if not (w1.is_contiguous() and w3.is_contiguous()):
        raise ValueError("gemm1_swiglu_sm90: w1 and w3 must be contiguous [E, H, D]")
    check_plan(plan, x.device, "gemm1_swiglu_sm90", ("row_slot", "tile_expert", "num_rows_used"))
    assert x.shape[1] == D and h.shape == (plan.max_rows, H)
    assert a is None or a.shape == (plan.max_rows, 2 * H)
    num_sms, stream, ticket = launch_context(x.device, dynamic)
    num_n = H // BN
    if group_m == 0:
        group_m = max(1, num_sms // num_n)
    params = Gemm1SwigluParams(
        x=x.data_ptr(), w1=w1.data_ptr(), w3=w3.data_ptr(), h=h.data_ptr(),
        a=a.data_ptr() if a is not None else None,
        row_slot=plan.row_slot.data_ptr(), tile_expert=plan.tile_expert.data_ptr(),
        num_rows_used=plan.num_rows_used.data_ptr(),
        E=E, H=H, D=D, top_k=plan.top_k, plan_bm=plan.block_m, group_m=group_m,
        stride_x=x.stride(0), stride_h=h.stride(0), stride_a=a.stride(0) if a is not None else 0,
        rows=h.shape[0], num_sms=num_sms,
        ticket=ticket.data_ptr() if ticket is not None else None, stream=stream,
    )
    launch(FAMILY, "megamoe_gemm1_swiglu", params, "gemm1_swiglu_sm90")


def fp8_gemm1_swiglu_sm90(xq, xs, w1q, w1s, w3q, w3s, plan: Plan, hq, hs, a=None,
                          group_m: int = 8, x_rows: bool = False) -> None:
    """Writes the used rows of hq [R_max, H] e4m3, hs [R_max, H/128] and (unless None) a
    [R_max, 2H] bf16: GEMM 1 + SwiGLU on the token rows of xq [T, D] (scales xs [T, D/128]),
    gathered inside by cp.async; with ``x_rows``, xq / xs are those rows gathered before into
    the plan's row space, [R_max, D] / [R_max, D/128] contiguous (kernels/fp8_quant.gather_rows),
    read by TMA."""
    who = "fp8_gemm1_swiglu_sm90"
    E, H, D = w1q.shape
    R = plan.max_rows
    check_fp8_operands(who, plan, H, D, {"w1q": w1q, "w3q": w3q, "hq": hq},
                       {"xs": xs, "w1s": w1s, "w3s": w3s, "hs": hs})
    if w3q.shape != w1q.shape or w1s.stride() != w3s.stride() or w1s.shape != w3s.shape:
        raise ValueError(f"{who}: w1 and w3 (and their scales) must have one shape and layout")
    check_fp8_token_rows(who, "xq", xq, "xs", xs, D)
    if x_rows and (xq.shape[0] != R or not (xq.is_contiguous() and xs.is_contiguous())):
        raise ValueError(f"{who}: with x_rows, xq / xs must be the plan's rows, contiguous "
                         f"[{R}, {D}] / [{R}, {D // FP8_BLOCK}]; got {tuple(xq.shape)}")
    if hq.shape != (R, H) or not hs.is_contiguous() or hs.shape != (R, H // FP8_BLOCK):
        raise ValueError(f"{who}: hq / hs must be [{R}, {H}] / [{R}, {H // FP8_BLOCK}] "
                         "contiguous")
    if a is not None and (a.shape != (R, 2 * H) or a.dtype != torch.bfloat16
                          or not a.is_contiguous()):
        raise ValueError(f"{who}: a must be contiguous bfloat16 [{R}, {2 * H}]")
    check_plan(plan, xq.device, who, ("row_slot", "tile_expert", "num_rows_used"))
    num_sms, stream, _ = launch_context(xq.device, ticket=False)
    params = Fp8Gemm1SwigluParams(
        x=xq.data_ptr(), stride_x=xq.stride(0), x_scale=xs.data_ptr(), stride_xs=xs.stride(0),
        w1=w1q.data_ptr(), w1_scale=w1s.data_ptr(), w3=w3q.data_ptr(), w3_scale=w3s.data_ptr(),
        stride_bse=w1s.stride(0), stride_bsn=w1s.stride(1),
        hq=hq.data_ptr(), hs=hs.data_ptr(), a=a.data_ptr() if a is not None else None,
        row_slot=plan.row_slot.data_ptr(), tile_expert=plan.tile_expert.data_ptr(),
        num_rows_used=plan.num_rows_used.data_ptr(),
        E=E, H=H, D=D, top_k=plan.top_k, plan_bm=plan.block_m, group_m=group_m,
        x_rows=R if x_rows else 0, num_sms=num_sms, stream=stream,
    )
    launch(FAMILY, "megamoe_fp8_gemm1_swiglu", params, who)
