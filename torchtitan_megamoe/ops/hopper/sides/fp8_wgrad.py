"""fp8_wgrad: the all-FP8 recipe's weight gradients (kernels/fp8_wgrad.py), its sides and entry.

    triton  kernels/fp8_wgrad.py (the reference)
    sm90    csrc/wgrad.cu in FP8 (cuda/wgrad.py): a dynamic ticket, experts longest first, both
            scale vectors of each 128-row step in the ring
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper import heuristics
from torchtitan_megamoe.ops.hopper.cuda.wgrad import fp8_wgrad_sm90, fp8_wgrad_supported
from torchtitan_megamoe.ops.hopper.heuristics import FP8_INTERPRET
from torchtitan_megamoe.ops.hopper.kernels.fp8_wgrad import fp8_wgrad_triton
from torchtitan_megamoe.ops.hopper.kernels.wgrad import longest_first
from torchtitan_megamoe.ops.hopper.plan import Plan
from torchtitan_megamoe.ops.hopper.configs import Sm90
from torchtitan_megamoe.ops.hopper.sides.table import Side, Stage, available
from torchtitan_megamoe.ops.hopper.tune import bucket, pick_config


@dataclass(frozen=True)
class Shape:
    M: int
    N: int
    out_dtype: torch.dtype


class Operands(NamedTuple):
    at: torch.Tensor
    ats: torch.Tensor
    bt: torch.Tensor
    bts: torch.Tensor
    plan: Plan
    out: torch.Tensor
    order: torch.Tensor


def _triton(cfg, op: Operands):
    fp8_wgrad_triton(*op, cfg.kwargs())
    return (op.out,)


def _sm90(cfg: Sm90, op: Operands):
    fp8_wgrad_sm90(*op, group_m=cfg.group_m)
    return (op.out,)


STAGE = Stage(
    "fp8_wgrad",
    sides=(
        Side("triton", lambda s, av: heuristics.fp8_wgrad_triton(s.M, s.N), _triton),
        Side("sm90", lambda s, av: [Sm90(group_m=8)]
             if av.sm90 and fp8_wgrad_supported(s.M, s.N, s.out_dtype) else [], _sm90),
    ),
    reference="triton",
    # sm90's warp-specialized promotion keeps the tensor cores busy where Triton's stalls them
    prefer=("sm90", "triton"),
)


def fp8_wgrad(at, ats, bt, bts, plan: Plan, out: torch.Tensor, order=None, config=None):
    """out [E, M, N] (written whole) = per expert A^T[:, seg] @ B^T[:, seg]^T."""
    E, M, N = out.shape
    assert at.shape[0] == M and bt.shape[0] == N and out.is_contiguous()
    assert at.stride(1) == 1 and bt.stride(1) == 1
    order = longest_first(plan) if order is None else order
    op = Operands(at, ats, bt, bts, plan, out, order)

    def launch(cfg):
        return STAGE.launch(cfg, op)

    if config is None:
        if settings.triton_interpreting():
            config = FP8_INTERPRET
        else:
            config = pick_config(STAGE, (bucket(plan.max_rows), M, N, E),
                                 lambda: (Shape(M, N, out.dtype), available(at)), launch,
                                 outputs=lambda res: res)
    launch(config)
    return out
