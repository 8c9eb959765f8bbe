"""Python side of csrc/dgrad2_swiglu.cu: the backward's dgrad of linear 2 fused with the SwiGLU
backward, on the forward's saved pre-activations, in one launch.

``dgrad2_swiglu_sm90`` (bf16):

    dh = dy[tok(r)] @ w2[e]          (dy rows gathered inside, w2 [E, D, H] read as stored)
    da1 = w dh a3 silu'(a1),  da3 = w dh silu(a1),  hw = w silu(a1) a3,
    part[j, r] = <dh, h> over H tile j (256 columns)

with w the routing weight of row r's slot, a = [a1 | a3] [R_max, 2H] the saved pre-activations.
Same outputs as the Triton dgrad2_swiglu(..., a=a) with block_n 256 (da
[R_max, 2H], hw [R_max, H], part [H / 256, R_max]), so the two are candidates of one tuner
entry; only the used rows are written. With ``dy_rows`` [R_max, D] the kernel also stores the
dy rows it gathers there (row r = dy[tok(r)], zeros on padding rows; used rows only), what
gathering dy by the plan gives, for the dw2 weight gradient to read.

``fp8_dgrad2_swiglu_sm90``: the same from e4m3 dy and w2^T, with da per row, da^T and h^T per 128
rows quantized to e4m3 with their scales, and the d(topk_weights) partials per 128 columns
(sides/fp8_gemm.fp8_dgrad2_swiglu's contract).

``fp8_dgrad2_swiglu_rows_sm90``: the same GEMM with the outputs of
kernels/swiglu_bwd_rows.swiglu_bwd_rows(..., quant=True) after an FP8 dgrad2 (da and hw bf16, da
per row in e4m3), and part per 128 columns: one launch for the two stages, dh never stored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchtitan_megamoe.ops.hopper.cuda.params import Dgrad2SwigluParams, Fp8Dgrad2SwigluParams
from torchtitan_megamoe.ops.hopper.cuda.sm90 import (FP8, FP8_BLOCK, check_bf16_rows,
                                                     check_fp8_operands, check_fp8_token_rows,
                                                     check_plan, launch, launch_context)

if TYPE_CHECKING:
    from torchtitan_megamoe.ops.hopper.plan import Plan

F32, BF16 = torch.float32, torch.bfloat16

FAMILY = "dgrad2_swiglu"
BM, BN, BK = 128, 256, 64
"""The bf16 tile: 128 rows x 256 H columns, K (= D) steps of 64."""


def shape_supported(H: int, D: int, block_m: int) -> bool:
    return H % BN == 0 and D % BK == 0 and block_m % BM == 0


def dgrad2_swiglu_sm90(dy: torch.Tensor, a: torch.Tensor, topk_weights: torch.Tensor,
                         w2: torch.Tensor, plan: Plan, out: tuple | None = None,
                         dy_rows: torch.Tensor | None = None):
    """(da, hw, part): see the module docstring. ``out``: (da, hw, part) to write; ``dy_rows``:
    where to store the gathered dy rows too (None: nowhere)."""
    E, D, H = w2.shape
    who = "dgrad2_swiglu_sm90"
    if not shape_supported(H, D, plan.block_m):
        raise ValueError(f"{who} needs hidden % {BN} == 0, dim % {BK} == 0 and a plan block_m "
                         f"multiple of {BM}; got hidden={H}, dim={D}, block_m={plan.block_m}")
    R = plan.max_rows
    if out is None:
        out = (torch.empty(R, 2 * H, dtype=dy.dtype, device=dy.device),
               torch.empty(R, H, dtype=dy.dtype, device=dy.device),
               torch.empty(H // BN, R, dtype=torch.float32, device=dy.device))
    da, hw, part = out
    check_bf16_rows(who, dy=dy, w2=w2, a=a, da=da, hw=hw)
    if not all(t.is_contiguous() for t in (w2, a, da, hw, part)):
        raise ValueError(f"{who}: w2, a, da, hw and part must be contiguous")
    if dy_rows is not None and (dy_rows.shape != (R, D) or dy_rows.dtype != dy.dtype
                                or not dy_rows.is_contiguous() or dy_rows.device != dy.device):
        raise ValueError(f"{who}: dy_rows must be a contiguous {dy.dtype} [{R}, {D}] tensor on "
                         f"{dy.device}, got {dy_rows.dtype} {tuple(dy_rows.shape)}")
    if (a.shape != (R, 2 * H) or da.shape != (R, 2 * H) or hw.shape != (R, H)
            or part.shape != (H // BN, R) or part.dtype != torch.float32 or dy.shape[1] != D):
        raise ValueError(f"{who}: shapes dy {tuple(dy.shape)}, a {tuple(a.shape)}, da "
                         f"{tuple(da.shape)}, hw {tuple(hw.shape)}, part {tuple(part.shape)} do "
                         f"not fit D={D}, H={H}, R_max={R}")
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    if tw.numel() != plan.num_tokens * plan.top_k:
        raise ValueError(f"{who}: topk_weights has {tw.numel()} entries, the plan's slots "
                         f"{plan.num_tokens * plan.top_k}")
    check_plan(plan, dy.device, who, ("row_slot", "tile_expert", "num_rows_used"))
    num_sms, stream, ticket = launch_context(dy.device)
    params = Dgrad2SwigluParams(
        dy=dy.data_ptr(), stride_dy=dy.stride(0), w2=w2.data_ptr(), a=a.data_ptr(),
        da=da.data_ptr(), hw=hw.data_ptr(),
        dy_rows=None if dy_rows is None else dy_rows.data_ptr(), part=part.data_ptr(),
        topk_w=tw.data_ptr(), row_slot=plan.row_slot.data_ptr(),
        tile_expert=plan.tile_expert.data_ptr(), num_rows_used=plan.num_rows_used.data_ptr(),
        E=E, D=D, H=H, top_k=plan.top_k, plan_bm=plan.block_m, rows=R, num_sms=num_sms,
        ticket=ticket.data_ptr(), stream=stream,
    )
    launch(FAMILY, "megamoe_dgrad2_swiglu", params, who)
    return da, hw, part


def fp8_dgrad2_swiglu_sm90(gq, gs, w2tq, w2ts, a_saved, tw, plan: Plan, daq, das, daTq, daTs,
                           hTq, hTs, part, group_m: int = 8) -> None:
    """Writes the used rows of daq [R_max, 2H] e4m3 / das [R_max, 2H/128], the used columns of
    daTq [2H, R_max] / daTs [2H, R_max/128] and hTq [H, R_max] / hTs [H, R_max/128], and part
    [H/128, R_max] (fp32): dgrad2_swiglu on the token rows of gq [T, D] (dy, scales gs
    [T, D/128]) against w2tq [E, H, D] (w2^T), with a_saved [R_max, 2H] bf16 and tw
    [T * top_k] fp32."""
    who = "fp8_dgrad2_swiglu_sm90"
    H, R, B = w2tq.shape[1], plan.max_rows, FP8_BLOCK
    if R % 16:
        raise ValueError(f"{who}: the plan's max_rows ({R}) must be a multiple of 16 (the "
                         "transposed outputs' rows are written by TMA)")
    _fp8_launch(who, "megamoe_fp8_dgrad2_swiglu", gq, gs, w2tq, w2ts, a_saved, tw, plan, group_m,
                {"daq": (daq, (R, 2 * H), FP8), "das": (das, (R, 2 * H // B), F32),
                 "daTq": (daTq, (2 * H, R), FP8), "daTs": (daTs, (2 * H, R // B), F32),
                 "hTq": (hTq, (H, R), FP8), "hTs": (hTs, (H, R // B), F32),
                 "part": (part, (H // B, R), F32)})


def fp8_dgrad2_swiglu_rows_sm90(gq, gs, w2tq, w2ts, a_saved, tw, plan: Plan,
                                out: tuple | None = None, group_m: int = 8) -> tuple:
    """(da, hw, part, daq, das): da [R_max, 2H] and hw [R_max, H] bf16, part [H/128, R_max]
    fp32, daq [R_max, 2H] e4m3 with das [R_max, 2H/128], written on the used rows, from the token
    rows of gq [T, D] (dy, scales gs [T, D/128]) against w2tq [E, H, D] (w2^T), with a_saved
    [R_max, 2H] bf16 and tw [T * top_k] fp32. ``out``: (da, hw, part) to write, None where a
    new one will do; da may be a_saved itself (each element is read before it is written, by
    one thread)."""
    H, R, B = w2tq.shape[1], plan.max_rows, FP8_BLOCK
    new = lambda *shape, dtype: torch.empty(shape, dtype=dtype, device=gq.device)  # noqa: E731
    da, hw, part = out or (None, None, None)
    da = new(R, 2 * H, dtype=BF16) if da is None else da
    hw = new(R, H, dtype=BF16) if hw is None else hw
    part = new(H // B, R, dtype=F32) if part is None else part
    daq, das = new(R, 2 * H, dtype=FP8), new(R, 2 * H // B, dtype=F32)
    _fp8_launch("fp8_dgrad2_swiglu_rows_sm90", "megamoe_fp8_dgrad2_swiglu_rows", gq, gs, w2tq,
                w2ts, a_saved, tw, plan, group_m,
                {"da": (da, (R, 2 * H), BF16), "hw": (hw, (R, H), BF16),
                 "part": (part, (H // B, R), F32), "daq": (daq, (R, 2 * H), FP8),
                 "das": (das, (R, 2 * H // B), F32)})
    return da, hw, part, daq, das


def _fp8_launch(who, entry, gq, gs, w2tq, w2ts, a_saved, tw, plan: Plan, group_m: int,
                outs: dict) -> None:
    """Both FP8 entry points: the checks of their shared operands and of ``outs`` ({params
    field: (tensor, its shape, its dtype)}, each contiguous), then the launch."""
    E, H, D = w2tq.shape
    R = plan.max_rows
    of = lambda dt: {n: t for n, (t, _, d) in outs.items() if d == dt}  # noqa: E731
    check_fp8_operands(who, plan, H, D, {"w2tq": w2tq, **of(FP8)},
                       {"gs": gs, "w2ts": w2ts, **of(F32)})
    check_fp8_token_rows(who, "gq", gq, "gs", gs, D)
    for name, (t, shape, dtype) in {"a_saved": (a_saved, (R, 2 * H), BF16), **outs}.items():
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{who}: {name} must be contiguous {dtype} {list(shape)}, got "
                             f"{t.dtype} {list(t.shape)}")
    if (tw.dtype != torch.float32 or not tw.is_contiguous()
            or tw.numel() != gq.shape[0] * plan.top_k):
        raise ValueError(f"{who}: tw must be contiguous float32 [T * top_k]")
    check_plan(plan, gq.device, who, ("row_slot", "tile_expert", "num_rows_used"))
    num_sms, stream, _ = launch_context(gq.device, ticket=False)
    params = Fp8Dgrad2SwigluParams(
        dy=gq.data_ptr(), stride_dy=gq.stride(0), dy_scale=gs.data_ptr(), stride_dys=gs.stride(0),
        w2t=w2tq.data_ptr(), w2t_scale=w2ts.data_ptr(), stride_bse=w2ts.stride(0),
        stride_bsn=w2ts.stride(1), a_saved=a_saved.data_ptr(), tw=tw.data_ptr(),
        row_slot=plan.row_slot.data_ptr(), tile_expert=plan.tile_expert.data_ptr(),
        num_rows_used=plan.num_rows_used.data_ptr(), E=E, H=H, D=D, top_k=plan.top_k,
        plan_bm=plan.block_m, group_m=group_m, rows=R, num_sms=num_sms, stream=stream,
        **{name: t.data_ptr() for name, (t, _, _) in outs.items()},
    )
    launch(FAMILY, entry, params, who)
