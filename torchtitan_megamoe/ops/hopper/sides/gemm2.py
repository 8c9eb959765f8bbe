"""gemm2: GEMM 2 into the row space (kernels/gemm2.py), its sides and the stage's entry.

    triton  kernels/gemm2.py (the reference)
    sm90    csrc/gemm_rows.cu (cuda/gemm_rows.py): TMA for both operands, wgmma, a tile ticket,
            bulk-store epilogue; bf16 only
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from torchtitan_megamoe.ops.hopper import heuristics
from torchtitan_megamoe.ops.hopper.cuda import gemm_rows as sm90_rows
from torchtitan_megamoe.ops.hopper.kernels.gemm2 import gemm2_triton
from torchtitan_megamoe.ops.hopper.plan import Plan
from torchtitan_megamoe.ops.hopper.configs import Sm90
from torchtitan_megamoe.ops.hopper.sides.table import Side, Stage, available
from torchtitan_megamoe.ops.hopper.tune import bucket, pick_config


@dataclass(frozen=True)
class Shape:
    D: int
    H: int
    block_m: int
    bf16: bool = True  # h, w2 and y all bf16


class Operands(NamedTuple):
    h: torch.Tensor
    w2: torch.Tensor
    plan: Plan
    y: torch.Tensor


def _sm90_offer(s: Shape, av) -> list:
    return [Sm90(group_m=8)] if (s.bf16 and sm90_rows.shape_supported(s.D, s.H, s.block_m)
                                 and av.sm90) else []


STAGE = Stage(
    "gemm2",
    sides=(
        Side("triton", lambda s, av: heuristics.gemm2_triton(s.D, s.H),
             lambda cfg, op: gemm2_triton(*op, cfg.kwargs())),
        Side("sm90", _sm90_offer,
             lambda cfg, op: sm90_rows.gemm_rows_sm90(*op, group_m=cfg.group_m,
                                                      dynamic=not cfg.static)),
    ),
    reference="triton",
    # sm90 was the tuner's pick at both Qwen3 shapes
    prefer=("sm90", "triton"),
)


def gemm2(h: torch.Tensor, w2: torch.Tensor, plan: Plan, out_dtype: torch.dtype | None = None,
          config=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y [R_max, D]: row r holds the expert output of row r (slot plan.row_slot[r]); rows past
    the used ones are left unwritten and must not be read (the combine reaches rows only
    through plan.slot_row). ``out``: the y to write (the EP forward reuses one region after
    region). ``config``: a config of STAGE's sides; None: the tuner's."""
    E, D, H = w2.shape
    assert h.is_contiguous() and w2.is_contiguous() and h.shape == (plan.max_rows, H)
    R = plan.max_rows
    y = out if out is not None else torch.empty((R, D), dtype=out_dtype or h.dtype,
                                                device=h.device)
    assert y.shape == (R, D) and y.is_contiguous()

    def launch(cfg):
        return STAGE.launch(cfg, Operands(h, w2, plan, y))

    key = (bucket(R), H, D, E, plan.block_m)
    bf16 = h.dtype == w2.dtype == y.dtype == torch.bfloat16
    cfg = config or pick_config(STAGE, key,
                                lambda: (Shape(D, H, plan.block_m, bf16), available(h)),
                                launch, outputs=lambda _: (y,))
    launch(cfg)
    return y
