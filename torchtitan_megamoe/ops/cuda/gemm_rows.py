"""Python side of csrc/grouped_gemm_sm90.cu's ROWS mode: out[r] = in[r] @ w[e]^T over a plan's
row space (GEMM 2 of the forward).

Same contract as ops/triton/gemm2_rows.py (in and out [R_max, ·] in the plan's row space, only
the used rows written, tiles of tile_expert -1 skipped), so the two are candidates of one tuner
entry. Tiles: 128 rows x 256 output columns, K steps of 64, A and B by TMA; see the .cu file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchtitan_megamoe.ops.cuda.sm90 import (check_bf16_rows, check_plan, grouped_gemm_library,
                                               raise_on_error)

if TYPE_CHECKING:  # ops/triton imports this module: no runtime import back
    from torchtitan_megamoe.ops.triton.plan import Plan

BM, BN, BK = 128, 256, 64


def shape_supported(N: int, K: int, block_m: int) -> bool:
    return N % BN == 0 and K % BK == 0 and block_m % BM == 0


def gemm_rows_sm90(inp: torch.Tensor, w: torch.Tensor, plan: Plan, out: torch.Tensor,
                   group_m: int = 8, defines: tuple = (), dynamic: bool = True) -> None:
    """Writes out [R_max, N] = inp [R_max, K] @ w[e]^T (w [E, N, K]) for the used rows of
    ``plan``. ``group_m``: M tiles that sweep one N tile together. ``defines``: the .cu file's
    MEGAMOE_SM90_* knobs. ``dynamic``: tiles from a global ticket in one order (see
    gemm1_swiglu_sm90)."""
    E, N, K = w.shape
    if not shape_supported(N, K, plan.block_m):
        raise ValueError(
            f"gemm_rows_sm90 needs out columns % {BN} == 0, K % {BK} == 0 and a plan block_m "
            f"multiple of {BM}; got N={N}, K={K}, block_m={plan.block_m}"
        )
    check_bf16_rows("gemm_rows_sm90", inp=inp, w=w, out=out)
    if not (inp.is_contiguous() and w.is_contiguous() and out.is_contiguous()):
        raise ValueError("gemm_rows_sm90: inp, w and out must be contiguous")
    check_plan(plan, inp.device, "gemm_rows_sm90")
    R = plan.max_rows
    if inp.shape != (R, K) or out.shape != (R, N):
        raise ValueError(f"gemm_rows_sm90: inp {tuple(inp.shape)} and out {tuple(out.shape)} "
                         f"must be [{R}, {K}] and [{R}, {N}] (the plan's row space)")
    lib = grouped_gemm_library(tuple(defines))
    num_sms = torch.cuda.get_device_properties(inp.device).multi_processor_count
    stream = torch.cuda.current_stream(inp.device).cuda_stream
    ticket = torch.zeros(1, dtype=torch.int32, device=inp.device) if dynamic else None
    rc = lib.megamoe_gemm_rows(
        inp.data_ptr(), w.data_ptr(), out.data_ptr(), plan.tile_expert.data_ptr(),
        plan.num_rows_used.data_ptr(), E, N, K, plan.block_m, group_m, R, num_sms,
        ticket.data_ptr() if ticket is not None else None, stream,
    )
    raise_on_error(lib, rc, "gemm_rows_sm90")
