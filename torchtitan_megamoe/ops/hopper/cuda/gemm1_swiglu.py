"""Python side of csrc/grouped_gemm_sm90.cu's GATHER mode: the warp-specialized Hopper GEMM 1 +
SwiGLU.

Same contract as ops/hopper/kernels/gemm1_swiglu.py (one plan, h [R_max, H] and optionally the saved
pre-activations a [R_max, 2H], tiles of tile_expert -1 skipped), so the two are candidates of
one tuner entry. The kernel's shapes: 128-row x 128-column tiles, K steps of 64; see the .cu
file for its roles and barriers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchtitan_megamoe.ops.hopper.cuda.sm90 import (check_bf16_rows, check_plan, grouped_gemm_library,
                                               launch_context, raise_on_error)

if TYPE_CHECKING:  # ops/triton imports this module: no runtime import back
    from torchtitan_megamoe.ops.hopper.plan import Plan

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
    lib = grouped_gemm_library()
    num_sms, stream, ticket = launch_context(x.device, dynamic)
    num_n = H // BN
    if group_m == 0:
        group_m = max(1, num_sms // num_n)
    rc = lib.megamoe_gemm1_swiglu(
        x.data_ptr(), w1.data_ptr(), w3.data_ptr(), h.data_ptr(),
        a.data_ptr() if a is not None else None,
        plan.row_slot.data_ptr(), plan.tile_expert.data_ptr(), plan.num_rows_used.data_ptr(),
        E, H, D, plan.top_k, plan.block_m, group_m, x.stride(0), h.stride(0),
        a.stride(0) if a is not None else 0, h.shape[0], num_sms,
        ticket.data_ptr() if ticket is not None else None, stream,
    )
    raise_on_error(lib, rc, "gemm1_swiglu_sm90")
