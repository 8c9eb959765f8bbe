"""dgrad2_swiglu: dh = dy rows @ w2[e], then the SwiGLU backward with the routing weight.

    triton      kernels/dgrad2_swiglu.py, one launch (the reference)
    cublas      kernels/grouped_mm.py: dy rows gathered, dh by torch._grouped_mm, then
                kernels/swiglu_bwd_rows.py
    sm90        the same two steps with csrc/'s N-major row GEMM (w2 read as stored) for dh
    sm90_fused  csrc/dgrad2_swiglu.cu: one launch, dy rows gathered inside, the SwiGLU backward
                in the epilogue

The gathering sides (cublas, sm90, sm90_fused) keep the dy rows in ``shared["dy_rows"]``, which
wgrad_dw2 then reads instead of gathering them again.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from torchtitan_megamoe.ops.hopper import heuristics
from torchtitan_megamoe.ops.hopper import tiles
from torchtitan_megamoe.ops.hopper.cuda import gemm_rows as sm90_rows
from torchtitan_megamoe.ops.hopper.cuda.dgrad2_swiglu import dgrad2_swiglu_sm90
from torchtitan_megamoe.ops.hopper.kernels.dgrad2_swiglu import dgrad2_swiglu
from torchtitan_megamoe.ops.hopper.kernels.grouped_mm import dgrad2_swiglu_grouped_mm, gather_rows
from torchtitan_megamoe.ops.hopper.kernels.swiglu_bwd_rows import swiglu_bwd_rows
from torchtitan_megamoe.ops.hopper.plan import Plan
from torchtitan_megamoe.ops.hopper.sides.backward import (
    Shape, cublas_offer, sm90_offered, triton_offer,
)
from torchtitan_megamoe.ops.hopper.configs import Sm90, Sm90Fused
from torchtitan_megamoe.ops.hopper.sides.table import Side, Stage


class Operands(NamedTuple):
    dy: torch.Tensor
    a: torch.Tensor  # the forward's saved [a1 | a3]
    topk_weights: torch.Tensor
    w2: torch.Tensor
    plan: Plan
    dtype: torch.dtype  # of da and hw
    bufs: dict  # (da, hw, part), allocated once per partial count so candidates share them
    shared: dict  # "dy_rows": the gathered dy rows, for wgrad_dw2
    # where da goes (None: a buffer of its own); may be ``a`` itself: every side reads a row
    # block's a1 and a3 before it writes their da there, and no other block reads them. Never
    # ``a`` for the tuner's candidates, which all read it
    da_out: torch.Tensor | None = None


def _out(op: Operands, n_h: int) -> tuple:
    """(da, hw, part) for ``n_h`` partials of d(topk_weights) per row."""
    if op.bufs.get("n_h") != n_h:
        R, H, dev = op.plan.max_rows, op.w2.shape[2], op.dy.device
        op.bufs.update(n_h=n_h, out=(
            torch.empty(R, 2 * H, dtype=op.dtype, device=dev) if op.da_out is None
            else op.da_out,
            torch.empty(R, H, dtype=op.dtype, device=dev),
            torch.empty(n_h, R, dtype=torch.float32, device=dev),
        ))
    return op.bufs["out"]


def sm90_rows_side(dy, a, topk_weights, w2, plan: Plan, out=None, dy_rows=None):
    """The sm90 side's two steps: (da, hw, part [1, R_max], dy_rows), as
    kernels/grouped_mm.dgrad2_swiglu_grouped_mm returns them."""
    dy_rows = gather_rows(dy, plan, out=dy_rows)
    dh = torch.empty(plan.max_rows, w2.shape[2], dtype=dy.dtype, device=dy.device)
    sm90_rows.gemm_rows_nmajor_sm90(dy_rows, (w2,), plan, dh)
    return (*swiglu_bwd_rows(dh, a, topk_weights, plan, out=out), dy_rows)


def _triton(cfg, op: Operands):
    kw = cfg.kwargs()
    return dgrad2_swiglu(op.dy, op.a, op.topk_weights, op.w2, op.plan,
                         out=_out(op, -(-op.w2.shape[2] // kw["block_n"])), **kw)


def _rows(two_step):
    def launch(cfg, op: Operands):
        *res, op.shared["dy_rows"] = two_step(op.dy, op.a, op.topk_weights, op.w2, op.plan,
                                              out=_out(op, 1), dy_rows=op.shared.get("dy_rows"))
        return tuple(res)
    return launch


def _sm90_fused(cfg: Sm90Fused, op: Operands):
    out = _out(op, -(-op.w2.shape[2] // cfg.block_n))
    if op.shared.get("dy_rows") is None:
        op.shared["dy_rows"] = torch.empty(op.plan.max_rows, op.dy.shape[1], dtype=op.dtype,
                                           device=op.dy.device)
    return dgrad2_swiglu_sm90(op.dy, op.a, op.topk_weights, op.w2, op.plan, out=out,
                              dy_rows=op.shared["dy_rows"])


def _sm90_fits(s: Shape, av) -> bool:
    return sm90_offered(s, av) and sm90_rows.shape_supported(s.H, s.D, tiles.BLOCK_M)


STAGE = Stage(
    "dgrad2_swiglu",
    sides=(
        Side("triton", triton_offer(lambda s: heuristics.dgrad2_swiglu_triton(s.D, s.H)),
             _triton),
        Side("cublas", cublas_offer(), _rows(dgrad2_swiglu_grouped_mm)),
        Side("sm90", lambda s, av: [Sm90()] if _sm90_fits(s, av) else [],
             _rows(sm90_rows_side)),
        Side("sm90_fused", lambda s, av: [Sm90Fused(block_n=256)] if _sm90_fits(s, av) else [],
             _sm90_fused),
    ),
    reference="triton",
    # one launch that also stores the dy rows was the tuner's pick at both Qwen3 shapes; the
    # grouped_mm backward is faster than the Triton one where no csrc/ kernel runs
    prefer=("sm90_fused", "sm90", "cublas", "triton"),
)

GATHERS_DY = ("cublas", "sm90", "sm90_fused")
"""The sides that leave the gathered dy rows in ``shared`` for wgrad_dw2."""
