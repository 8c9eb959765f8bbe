"""dgrad1: dx rows = da1 @ w1[e] + da3 @ w3[e], the weights read as stored.

    triton  kernels/dgrad1.py, dx scattered into slots (the reference)
    cublas  kernels/grouped_mm.py: two M-grouped torch._grouped_mm, rows -> slots by a gather;
            never faster here, so offered only when forced (MEGAMOE_BWD_IMPL=cublas)
    sm90    csrc/'s N-major row GEMM ([da1 | da3] against w1 and w3): dx in the plan's row
            space, whole tiles instead of a scatter

A launch returns (dx rows, in_rows): in_rows True where they are in the row space (sm90),
False where in slots [T*K, D].
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from torchtitan_megamoe.ops.hopper import heuristics
from torchtitan_megamoe.ops.hopper import tiles
from torchtitan_megamoe.ops.hopper.cuda import gemm_rows as sm90_rows
from torchtitan_megamoe.ops.hopper.kernels.dgrad1 import dgrad1
from torchtitan_megamoe.ops.hopper.kernels.grouped_mm import dgrad1_grouped_mm
from torchtitan_megamoe.ops.hopper.plan import Plan
from torchtitan_megamoe.ops.hopper.sides.backward import (
    Shape, cublas_offer, sm90_offered, triton_offer,
)
from torchtitan_megamoe.ops.hopper.configs import Sm90
from torchtitan_megamoe.ops.hopper.sides.table import Side, Stage


class Operands(NamedTuple):
    da: torch.Tensor
    w1: torch.Tensor
    w3: torch.Tensor
    plan: Plan
    dtype: torch.dtype  # of dx


def _sm90(cfg, op: Operands):
    dx_rows = torch.empty(op.plan.max_rows, op.w1.shape[2], dtype=op.dtype, device=op.da.device)
    sm90_rows.gemm_rows_nmajor_sm90(op.da, (op.w1, op.w3), op.plan, dx_rows)
    return dx_rows, True


def _sm90_offer(s: Shape, av) -> list:
    fits = (sm90_offered(s, av) and sm90_rows.shape_supported(s.D, 2 * s.H, tiles.BLOCK_M)
            and s.H % sm90_rows.BK == 0)
    return [Sm90()] if fits else []


STAGE = Stage(
    "dgrad1",
    sides=(
        Side("triton", triton_offer(lambda s: heuristics.dgrad1_triton(s.D, s.H)),
             lambda cfg, op: (dgrad1(op.da, op.w1, op.w3, op.plan, out_dtype=op.dtype,
                                     **cfg.kwargs()), False)),
        Side("cublas", cublas_offer(auto=False),
             lambda cfg, op: (dgrad1_grouped_mm(op.da, op.w1, op.w3, op.plan), False)),
        Side("sm90", _sm90_offer, _sm90),
    ),
    reference="triton",
    # sm90 was the tuner's pick at both Qwen3 shapes: whole-tile stores instead of a scatter
    prefer=("sm90", "triton", "cublas"),
)
