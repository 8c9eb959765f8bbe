"""Python side of csrc/wgrad.cu: the backward's weight gradients as one K-grouped GEMM per
launch.

bf16: fp32 accumulation over each expert's rows in a fixed order, with the token-indexed
operand gathered inside the kernel (no gathered copy of dy or x):

- ``wgrad_dw2_sm90``:  dw2[e] = sum_r dy[tok(r)]^T hw[r]            ([E, D, H], w2's layout)
- ``wgrad_dw13_sm90``: dw1[e] | dw3[e] = sum_r [da1 | da3][r]^T x[tok(r)]   ([E, H, D] each)

over the rows r of expert e's segment of the plan (padding rows add 0: the gathered operand is
zero there; the K loop stops after the last 64-row step that holds one of plan.count[e]'s real
rows, so a build_plan segment skips its all-padding last step). An expert without rows gets a
zero gradient. ``pre_gathered=True`` takes the token operand already gathered into the row space ([R_max, .], zero padding rows, e.g. the
dy rows dgrad2_swiglu stored): both operands then come by TMA and the kernel's
producer is one thread: the form the tuner offers (the in-kernel gather is slower than
torch._grouped_mm and is not offered). Same results as the Triton wgrad and the _grouped_mm side
within bf16 rounding of the output.

The gradients are written in the outputs' dtype: bf16 through a staging tile and TMA stores, or
fp32 (the gradients of fp32 parameters, under a bf16 autocast) straight from the accumulators,
so no cast pass follows; fp32 ones can also be added to (``accumulate``: the EP backward's sums
over regions, no add pass).

FP8: ``fp8_wgrad_sm90``: out [E, M, N] bf16 from operands transposed and quantized per 128 rows
beforehand (sides/fp8_wgrad.fp8_wgrad's contract), units handed out by a dynamic ticket.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchtitan_megamoe.ops.hopper.cuda.params import Fp8WgradParams, WgradParams
from torchtitan_megamoe.ops.hopper.cuda.sm90 import (FP8, FP8_BLOCK, check_bf16_rows, check_plan,
                                                     launch, launch_context)

if TYPE_CHECKING:
    from torchtitan_megamoe.ops.hopper.plan import Plan

FAMILY = "wgrad"
BM, BN, BK = 128, 256, 64


def shapes_supported(D: int, H: int, block_m: int) -> bool:
    """dw2 [D, H] and dw1|dw3 [2H, D] per expert both fit the 128 x 256 tiles."""
    return D % BM == 0 and H % BM == 0 and H % BN == 0 and D % BN == 0 and block_m % BK == 0


def wgrad_dw2_sm90(dy: torch.Tensor, hw: torch.Tensor, plan: Plan, dw2: torch.Tensor,
                   expert_order: torch.Tensor | None = None,
                   pre_gathered: bool = False, accumulate: bool = False) -> torch.Tensor:
    """dw2 [E, D, H] (written, or added to with ``accumulate``; returned) from dy [T, D] (rows
    gathered by token; with ``pre_gathered`` dy rows [R_max, D]) and hw [R_max, H] (row
    space)."""
    E, D, H = dw2.shape
    _launch("wgrad_dw2_sm90", dy, hw, (dw2,), plan, E, D, H, D, 2 if pre_gathered else 1,
            expert_order, accumulate)
    return dw2


def wgrad_dw13_sm90(da: torch.Tensor, x: torch.Tensor, plan: Plan, dw1: torch.Tensor,
                    dw3: torch.Tensor, expert_order: torch.Tensor | None = None,
                    pre_gathered: bool = False, accumulate: bool = False):
    """(dw1, dw3) [E, H, D] (written, or added to with ``accumulate``; returned) from da =
    [da1 | da3] [R_max, 2H] (row space) and x [T, D] (rows gathered by token; with
    ``pre_gathered`` x rows [R_max, D])."""
    E, H, D = dw1.shape
    if dw3.shape != dw1.shape:
        raise ValueError(f"wgrad_dw13_sm90: dw1 {tuple(dw1.shape)} and dw3 "
                         f"{tuple(dw3.shape)} must have one shape")
    if pre_gathered:  # A = da and B = x rows, both row space
        _launch("wgrad_dw13_sm90", da, x, (dw1, dw3), plan, E, 2 * H, D, H, 2, expert_order,
                accumulate)
    else:
        _launch("wgrad_dw13_sm90", x, da, (dw1, dw3), plan, E, 2 * H, D, H, 0, expert_order,
                accumulate)
    return dw1, dw3


def wgrad_dw13_regions_sm90(da: torch.Tensor, x: torch.Tensor, plan: Plan,
                            seg_start: torch.Tensor, count: torch.Tensor, dw1: torch.Tensor,
                            dw3: torch.Tensor, expert_order: torch.Tensor | None = None,
                            accumulate: bool = False, row_slot: torch.Tensor | None = None):
    """wgrad_dw13_sm90 over G plans' rows at once: per expert e, one K walk over the segments
    [seg_start[g, e], + count[g, e]) of g = 0..G-1, rows of da [N_rows, 2H] (one sum in the
    registers, not G added gradients). x: rows [N_rows, D] in the same row space, or with
    ``row_slot`` ([N_rows] int32: the slot of each row, -1 on padding) token rows gathered
    inside the kernel (row r reads x[row_slot[r] // top_k]). seg_start [G, E + 1] and count
    [G, E]: int32 on the device, each plan's segments already offset to its rows; count[g, e]
    = 0 leaves plan g out for expert e. ``plan``: any of the G (its block_m and top_k)."""
    E, H, D = dw1.shape
    if dw3.shape != dw1.shape:
        raise ValueError(f"wgrad_dw13_regions_sm90: dw1 {tuple(dw1.shape)} and dw3 "
                         f"{tuple(dw3.shape)} must have one shape")
    who = "wgrad_dw13_regions_sm90"
    if row_slot is None:
        _launch(who, da, x, (dw1, dw3), plan, E, 2 * H, D, H, 2, expert_order, accumulate,
                regions=(seg_start, count))
        return dw1, dw3
    if row_slot.dtype != torch.int32 or row_slot.shape != (da.shape[0],):
        raise ValueError(f"{who}: row_slot must be int32 [{da.shape[0]}] (one per row of da), "
                         f"got {row_slot.dtype} {tuple(row_slot.shape)}")
    _launch(who, x, da, (dw1, dw3), plan.replaced(row_slot=row_slot), E, 2 * H, D, H, 0,
            expert_order, accumulate, regions=(seg_start, count))
    return dw1, dw3


def _launch(who, tokens, rows, outs, plan, E, M, N, m_split, gather, expert_order, accumulate,
            regions=None):
    """gather 1: tokens (A) by token, rows = B; 0: rows = A, tokens (B) by token; 2: tokens =
    A and rows = B, both row space. ``accumulate``: fp32 outs, added to. ``regions``:
    (seg_start [G, E + 1], count [G, E]) instead of the plan's (gather 0 or 2; rows and the
    plan's row_slot: all G plans')."""
    if M % BM or m_split % BM or N % BN or plan.block_m % BK:
        raise ValueError(f"{who} needs the gradient's rows per expert % {BM} == 0 and columns "
                         f"% {BN} == 0 (plan block_m % {BK}); got {M} x {N}, block_m "
                         f"{plan.block_m}")
    check_bf16_rows(who, **{"the token rows": tokens, "the row-space operand": rows})
    out_f32 = outs[0].dtype == torch.float32
    if any(o.dtype != outs[0].dtype or o.dtype not in (torch.bfloat16, torch.float32)
           for o in outs):
        raise TypeError(f"{who}: the gradients must all be bfloat16 or all float32 (fp32 "
                        f"parameters), got {[o.dtype for o in outs]}")
    if accumulate and not out_f32:  # a bf16 sum over regions would round once per region
        raise ValueError(f"{who} accumulates into fp32 gradients only, the outputs are "
                         f"{outs[0].dtype}")
    if not (rows.is_contiguous() and all(o.is_contiguous() for o in outs)):
        raise ValueError(f"{who}: the row-space operand and the outputs must be contiguous")
    seg_start, count, G = plan.seg_start, plan.count, 1
    if regions is not None:
        seg_start, count = regions
        G = seg_start.shape[0]
        if (gather == 1 or seg_start.shape != (G, E + 1) or count.shape != (G, E)
                or any(t.dtype != torch.int32 or not t.is_contiguous()
                       or t.device != rows.device for t in regions)):
            raise ValueError(f"{who}: needs da by rows and contiguous int32 "
                             f"seg_start [G, {E + 1}] and count [G, {E}] on {rows.device}, got "
                             f"{tuple(seg_start.shape)} {seg_start.dtype}, "
                             f"{tuple(count.shape)} {count.dtype}")
    R = plan.max_rows if regions is None else rows.shape[0]
    a_cols, b_cols = (M, N) if gather else (N, M)  # tokens' and rows' columns
    if (rows.shape != (R, b_cols) or tokens.shape[1] != a_cols
            or (gather == 2 and (tokens.shape[0] != R or not tokens.is_contiguous()))):
        raise ValueError(f"{who}: operand shapes {tuple(tokens.shape)}, {tuple(rows.shape)} "
                         f"do not match the gradient [{E}, {M}, {N}] and R_max {R}")
    check_plan(plan, rows.device, who, ("row_slot", "seg_start", "count"))
    if regions is None and plan.seg_start.numel() != E + 1:
        raise ValueError(f"{who}: the plan has {plan.seg_start.numel() - 1} experts, the "
                         f"gradient {E}")
    if expert_order is not None:
        expert_order = expert_order.to(torch.int32).contiguous()
    num_sms, stream, ticket = launch_context(rows.device)
    params = WgradParams(
        tokens=tokens.data_ptr(), stride_tokens=tokens.stride(0), rows=rows.data_ptr(),
        num_rows=R, out0=outs[0].data_ptr(), out1=outs[-1].data_ptr(),
        row_slot=plan.row_slot.data_ptr(), seg_start=seg_start.data_ptr(),
        count=count.data_ptr(),
        expert_order=expert_order.data_ptr() if expert_order is not None else None,
        E=E, M=M, N=N, m_split=m_split, top_k=plan.top_k, gather=gather, regions=G,
        out_f32=2 if accumulate else int(out_f32),
        num_sms=num_sms,
        ticket=ticket.data_ptr(), stream=stream,
    )
    launch(FAMILY, "megamoe_wgrad", params, who)


def fp8_wgrad_supported(M: int, N: int, out_dtype: torch.dtype) -> bool:
    return M % FP8_BLOCK == 0 and N % FP8_BLOCK == 0 and out_dtype == torch.bfloat16


def fp8_wgrad_sm90(at, ats, bt, bts, plan: Plan, out: torch.Tensor, order: torch.Tensor,
                   group_m: int = 8) -> None:
    """Writes out [E, M, N] bf16 whole: per expert e, at[:, seg(e)] @ bt[:, seg(e)]^T with at
    [M, R_max], bt [N, R_max] e4m3 scaled per column and 128 rows (ats [M, R_max/128], bts [N,
    R_max/128]); order: the experts' order (longest first), int32 on the device."""
    who = "fp8_wgrad_sm90"
    E, M, N = out.shape
    R = plan.max_rows
    B = FP8_BLOCK
    if not fp8_wgrad_supported(M, N, out.dtype) or not out.is_contiguous():
        raise ValueError(f"{who} needs M % {B} == 0, N % {B} == 0 and a contiguous bfloat16 "
                         f"out; got M={M}, N={N}, {out.dtype}")
    for name, t, rows in (("at", at, M), ("bt", bt, N)):
        if (t.dtype != FP8 or t.shape != (rows, R) or t.stride(1) != 1 or t.stride(0) % 16
                or t.data_ptr() % 16):
            raise ValueError(f"{who}: {name} must be e4m3 [{rows}, {R}] with unit-stride, "
                             f"16-byte aligned rows")
    for name, t, rows in (("ats", ats, M), ("bts", bts, N)):
        if t.dtype != torch.float32 or t.shape != (rows, R // B) or t.stride(1) != 1:
            raise ValueError(f"{who}: {name} must be fp32 [{rows}, {R // B}], unit-stride rows")
    if order.dtype != torch.int32 or order.numel() != E or not order.is_contiguous():
        raise ValueError(f"{who}: order must be {E} contiguous int32 expert ids")
    check_plan(plan, at.device, who, ("seg_start", "count"))
    num_sms, stream, ticket = launch_context(at.device)
    params = Fp8WgradParams(
        at=at.data_ptr(), at_scale=ats.data_ptr(), stride_as=ats.stride(0),
        bt=bt.data_ptr(), bt_scale=bts.data_ptr(), stride_bs=bts.stride(0),
        out=out.data_ptr(), seg_start=plan.seg_start.data_ptr(), count=plan.count.data_ptr(),
        expert_order=order.data_ptr(), E=E, M=M, N=N, rows=R, group_m=group_m,
        num_sms=num_sms, ticket=ticket.data_ptr(), stream=stream,
    )
    launch(FAMILY, "megamoe_fp8_wgrad", params, who)
