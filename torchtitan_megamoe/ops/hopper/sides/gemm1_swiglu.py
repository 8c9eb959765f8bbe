"""gemm1_swiglu: GEMM 1 + SwiGLU (kernels/gemm1_swiglu.py), its sides and the stage's entry.

    triton  kernels/gemm1_swiglu.py (the reference)
    sm90    csrc/gemm1_swiglu.cu (cuda/gemm1_swiglu.py): warp-specialized, TMA weights,
            cp.async row gathers, a global tile ticket, bulk-store epilogue
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from torchtitan_megamoe.ops.hopper import heuristics
from torchtitan_megamoe.ops.hopper.cuda import gemm1_swiglu as sm90_gemm1
from torchtitan_megamoe.ops.hopper.kernels.gemm1_swiglu import gemm1_swiglu_triton
from torchtitan_megamoe.ops.hopper.plan import Plan
from torchtitan_megamoe.ops.hopper.configs import Sm90
from torchtitan_megamoe.ops.hopper.sides.table import Side, Stage, available
from torchtitan_megamoe.ops.hopper.tune import bucket, pick_config


@dataclass(frozen=True)
class Shape:
    H: int
    D: int
    block_m: int


class Operands(NamedTuple):
    x: torch.Tensor
    w1: torch.Tensor
    w3: torch.Tensor
    plan: Plan
    h: torch.Tensor
    a: torch.Tensor | None  # where a1/a3 go; None: not stored


def _sm90(cfg: Sm90, op: Operands):
    group_m = 0 if cfg.group_m == "wave" else cfg.group_m  # 0: the kernel's wave
    sm90_gemm1.gemm1_swiglu_sm90(op.x, op.w1, op.w3, op.plan, op.h, op.a, group_m=group_m,
                                 dynamic=not cfg.static)


STAGE = Stage(
    "gemm1_swiglu",
    sides=(
        Side("triton", lambda s, av: heuristics.gemm1_swiglu_triton(s.H, s.D),
             lambda cfg, op: gemm1_swiglu_triton(*op, cfg.kwargs())),
        Side("sm90", lambda s, av: [Sm90(group_m=8)]
             if av.sm90 and sm90_gemm1.shape_supported(s.H, s.D, s.block_m) else [], _sm90),
    ),
    reference="triton",
    # sm90 was the tuner's pick at both Qwen3 shapes, with and without the a1/a3 store
    prefer=("sm90", "triton"),
)


def gemm1_swiglu(
    x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, plan: Plan, config=None,
    save_a: bool = False,
    out: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """h [R_max, H] in x.dtype for the rows of ``plan`` (padding rows are 0); with ``save_a``,
    (h, a) where a [R_max, 2H] holds [a1 | a3] (kernels/gemm1_swiglu.py). ``out``: the h (or
    (h, a)) to write (the EP forward reuses one region after region). Tiles whose
    tile_expert is -1 are skipped. ``config``: a config of STAGE's sides; None: the tuner's."""
    E, H, D = w1.shape
    assert x.is_contiguous() and w1.is_contiguous() and w3.is_contiguous()
    R = plan.max_rows
    if out is None:
        h = torch.empty((R, H), dtype=x.dtype, device=x.device)
        a = torch.empty((R, 2 * H), dtype=x.dtype, device=x.device) if save_a else h
    else:
        h, a = out if save_a else (out, out)
        assert h.shape == (R, H) and a.shape[0] == R and h.is_contiguous() and a.is_contiguous()

    def launch(cfg, a_out=a if save_a else None):
        return STAGE.launch(cfg, Operands(x, w1, w3, plan, h, a_out))

    # One pick per shape for both variants: h must be bitwise the same with and without the
    # store, since activation checkpointing recomputes a forward with save_a whose first run had
    # none, and the Triton and CUDA kernels round SwiGLU differently. The candidates are timed
    # with the a1/a3 store whichever variant runs first (a scratch a when the call has none):
    # the store costs the Triton configs more than the CUDA kernel, so timing without it can
    # pick the slower one for training.
    key = (bucket(R), H, D, E, plan.block_m)
    tune_a = []  # the scratch a, made only if the tuner runs

    def tune_launch(cfg):
        if save_a:
            return launch(cfg)
        if not tune_a:
            tune_a.append(torch.empty((R, 2 * H), dtype=x.dtype, device=x.device))
        return launch(cfg, tune_a[0])

    cfg = config or pick_config(STAGE, key, lambda: (Shape(H, D, plan.block_m), available(x)),
                                tune_launch, outputs=lambda _: (h, a if save_a else tune_a[0]))
    launch(cfg)
    return (h, a) if save_a else h
