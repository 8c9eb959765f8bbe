"""Python side of csrc/grouped_gemm_sm90.cu's DGRAD_SWIGLU mode: the backward's kernel A on the
forward's saved pre-activations in one launch,

    dh = dy[tok(r)] @ w2[e]          (dy rows gathered inside, w2 [E, D, H] read as stored)
    da1 = w dh a3 silu'(a1),  da3 = w dh silu(a1),  hw = w silu(a1) a3,
    part[j, r] = <dh, h> over H tile j (256 columns)

with w the routing weight of row r's slot, a = [a1 | a3] [R_max, 2H] the saved pre-activations.
Same outputs as ops/hopper/kernels/bwd_dgrad_l2_swiglu.dgrad2_swiglu(..., a=a) with block_n 256 (da
[R_max, 2H], hw [R_max, H], part [H / 256, R_max]), so the two are candidates of one tuner
entry; only the used rows are written. With ``dy_rows`` [R_max, D] the kernel also stores the
dy rows it gathers there (row r = dy[tok(r)], zeros on padding rows; used rows only), what
ops/hopper/kernels/bwd_cublas.gather_rows(dy, plan) gives, for the dw2 weight gradient to read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchtitan_megamoe.ops.hopper.cuda.gemm_rows import BK, BM, BN, shape_supported
from torchtitan_megamoe.ops.hopper.cuda.sm90 import (check_bf16_rows, check_plan, grouped_gemm_library,
                                               launch_context, raise_on_error)

if TYPE_CHECKING:  # ops/triton imports this module: no runtime import back
    from torchtitan_megamoe.ops.hopper.plan import Plan

def dgrad2_swiglu_sm90(dy: torch.Tensor, a: torch.Tensor, topk_weights: torch.Tensor,
                         w2: torch.Tensor, plan: Plan, out: tuple | None = None,
                         dy_rows: torch.Tensor | None = None):
    """(da, hw, part): see the module docstring. ``out``: (da, hw, part) to write; ``dy_rows``:
    where to store the gathered dy rows too (None: nowhere)."""
    E, D, H = w2.shape
    who = "dgrad2_swiglu_sm90"
    if not shape_supported(H, D, plan.block_m):  # the dh GEMM: N = H, K = D, as ROWS tiles it
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
    lib = grouped_gemm_library()
    num_sms, stream, ticket = launch_context(dy.device)
    rc = lib.megamoe_dgrad_swiglu(
        dy.data_ptr(), dy.stride(0), w2.data_ptr(), a.data_ptr(), da.data_ptr(), hw.data_ptr(),
        None if dy_rows is None else dy_rows.data_ptr(), part.data_ptr(), tw.data_ptr(),
        plan.row_slot.data_ptr(), plan.tile_expert.data_ptr(),
        plan.num_rows_used.data_ptr(), E, D, H, plan.top_k, plan.block_m, R, num_sms,
        ticket.data_ptr(), stream,
    )
    raise_on_error(lib, rc, who)
    return da, hw, part
