"""Python side of csrc/grouped_gemm_sm90.cu's ROWS mode: grouped GEMMs over a plan's row space,
A and B by TMA, tiles of 128 rows x 256 output columns, K steps of 64 (see the .cu file).

- ``gemm_rows_sm90``: out[r] = in[r] @ w[e]^T, w [E, N, K] (GEMM 2 of the forward; same
  contract as ops/hopper/kernels/gemm2.py, so the two are candidates of one tuner entry);
- ``gemm_rows_nmajor_sm90``: out[r] = in[r, :Ks] @ w[e] + in[r, Ks:] @ w'[e], w, w' [E, Ks, N]
  (the backward's dgrad of linear 1: [da1 | da3] against w1 and w3, as stored, no transpose).

Both write only the used rows of ``out`` (padding rows of ``in`` are zeros, so theirs are too;
a tile half that holds only padding rows is written as zeros without its MMAs) and skip the
tiles whose tile_expert is -1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchtitan_megamoe.ops.hopper.cuda.sm90 import (check_bf16_rows, check_plan, grouped_gemm_library,
                                               launch_context, raise_on_error)

if TYPE_CHECKING:  # ops/triton imports this module: no runtime import back
    from torchtitan_megamoe.ops.hopper.plan import Plan

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
    lib = grouped_gemm_library()
    num_sms, stream, ticket = launch_context(inp.device, dynamic)
    rc = lib.megamoe_gemm_rows(
        inp.data_ptr(), ws[0].data_ptr(), ws[-1].data_ptr(), out.data_ptr(),
        plan.row_slot.data_ptr(), plan.tile_expert.data_ptr(), plan.num_rows_used.data_ptr(), E, N, K, k_split,
        int(n_major), plan.block_m, group_m, R, num_sms,
        ticket.data_ptr() if ticket is not None else None, stream,
    )
    raise_on_error(lib, rc, who)
