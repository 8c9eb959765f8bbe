"""wgrad_dw2 and wgrad_dw13: the weight gradients, fp32 accumulation, fixed row order.

    triton  kernels/wgrad.py, the token operand read by indirection (the reference)
    cublas  kernels/grouped_mm.py: rows gathered, K-grouped torch._grouped_mm
    sm90    csrc/wgrad.cu (cuda/wgrad.py), longest expert first, on the token operand gathered
            into the row space first (dw2 reuses dgrad2_swiglu's dy rows where it left them)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from torchtitan_megamoe.ops.hopper import heuristics
from torchtitan_megamoe.ops.hopper import tiles
from torchtitan_megamoe.ops.hopper.cuda import wgrad as sm90_wgrad
from torchtitan_megamoe.ops.hopper.kernels.grouped_mm import (
    gather_rows, wgrad_dw2_grouped_mm, wgrad_dw13_grouped_mm,
)
from torchtitan_megamoe.ops.hopper.kernels.wgrad import wgrad
from torchtitan_megamoe.ops.hopper.plan import Plan
from torchtitan_megamoe.ops.hopper.sides.backward import (
    Shape, cublas_offer, shape, sm90_offered, triton_offer,
)
from torchtitan_megamoe.ops.hopper.configs import Sm90
from torchtitan_megamoe.ops.hopper.sides.table import Side, Stage, available


class Into(NamedTuple):
    """Where the weight gradients go: ``outs`` (dw1, dw2, dw3), written whole, or with
    ``accumulate`` added to (out = out + gradient, one fp32 add per element in the GEMM's
    epilogue: the bits of an add pass after it, without the pass). The EP backward sums its
    regions' gradients so."""

    outs: tuple
    accumulate: bool = False

    @staticmethod
    def zeros(into: "Into | None", weights: tuple) -> tuple:
        """The gradients of a call without rows: zeros (``into``'s, untouched when it
        accumulates)."""
        if into is None:
            return tuple(torch.zeros_like(w) for w in weights)
        if not into.accumulate:
            for out in into.outs:
                out.zero_()
        return into.outs


class Operands(NamedTuple):
    dy: torch.Tensor | None  # None where acts holds the dy rows (the EP backward's FP8 dy)
    x: torch.Tensor
    da: torch.Tensor  # [da1 | da3]
    acts: dict  # "hw": w*h rows, "dy_rows": dy gathered into the row space or None
    plan: Plan
    params: tuple  # (w1, w2, w3): the gradients take their dtype and layout
    order: torch.Tensor  # experts, longest first
    into: Into | None = None  # None: fresh gradients


def _out(op: Operands, i: int) -> torch.Tensor:
    """Gradient i's output: the given one, or a fresh tensor shaped like parameter i."""
    return op.into.outs[i] if op.into else torch.empty_like(op.params[i])


def _accumulates(op: Operands) -> bool:
    return bool(op.into and op.into.accumulate)


def _finish(op: Operands, grads: tuple) -> tuple:
    """A side that computes fresh gradients (cublas): moved into or added to ``op.into``."""
    if not op.into:
        return grads
    idx = (1,) if len(grads) == 1 else (0, 2)
    for i, g in zip(idx, grads):
        if op.into.accumulate:
            op.into.outs[i].add_(g)
        else:
            op.into.outs[i].copy_(g)
    return tuple(op.into.outs[i] for i in idx)


def _dw2_triton(cfg, op: Operands):
    rows = op.acts.get("dy_rows")  # the dy rows where gathered already (op.dy may be None)
    return wgrad(op.dy if rows is None else rows, op.acts["hw"], _out(op, 1), op.plan,
                 a_gather=rows is None, b_gather=False, expert_order=op.order,
                 accumulate=_accumulates(op), **cfg.kwargs())


def _dw2_cublas(cfg, op: Operands):
    return _finish(op, (wgrad_dw2_grouped_mm(op.dy, op.acts["hw"], op.plan, op.params[1],
                                             dy_rows=op.acts.get("dy_rows")),))[0]


def _dw2_sm90(cfg, op: Operands):
    rows = op.acts.get("dy_rows")
    return sm90_wgrad.wgrad_dw2_sm90(
        gather_rows(op.dy, op.plan) if rows is None else rows, op.acts["hw"], op.plan,
        _out(op, 1), op.order, pre_gathered=True, accumulate=_accumulates(op))


def _dw13_triton(cfg, op: Operands):
    H = op.da.shape[1] // 2
    return tuple(wgrad(a, op.x, _out(op, i), op.plan, a_gather=False, b_gather=True,
                       expert_order=op.order, accumulate=_accumulates(op), **cfg.kwargs())
                 for a, i in ((op.da[:, :H], 0), (op.da[:, H:], 2)))


def _dw13_cublas(cfg, op: Operands):
    return _finish(op, wgrad_dw13_grouped_mm(op.da, op.x, op.plan, op.params[0], op.params[2]))


def _dw13_sm90(cfg, op: Operands):
    return sm90_wgrad.wgrad_dw13_sm90(op.da, gather_rows(op.x, op.plan), op.plan,
                                      _out(op, 0), _out(op, 2), op.order, pre_gathered=True,
                                      accumulate=_accumulates(op))


def _sm90_offer(s: Shape, av) -> list:
    fits = (sm90_offered(s, av) and s.params_ok
            and sm90_wgrad.shapes_supported(s.D, s.H, tiles.BLOCK_M))
    return [Sm90()] if fits else []


def sm90_dw13_offered(D: int, H: int, E: int, block_m: int, x: torch.Tensor) -> bool:
    """Whether the sm90 side of wgrad_dw13 is offered here for fp32 gradients (the EP
    backward's one launch over its kept regions, ep_wgrad.py, is that kernel)."""
    return bool(_sm90_offer(shape(D, H, E, block_m, x.dtype == torch.bfloat16), available(x)))


def _stage(name, triton, cublas, sm90) -> Stage:
    return Stage(
        name,
        sides=(
            Side("triton", triton_offer(lambda s: heuristics.wgrad_triton()), triton),
            Side("cublas", cublas_offer(), cublas),
            Side("sm90", _sm90_offer, sm90),
        ),
        reference="triton",
        # sm90 was the tuner's pick at both Qwen3 shapes (grouped_mm within 4% on dw13 at 235B);
        # grouped_mm is faster than Triton where no csrc/ kernel runs
        prefer=("sm90", "cublas", "triton"),
    )


DW2 = _stage("wgrad_dw2", _dw2_triton, _dw2_cublas, _dw2_sm90)
DW13 = _stage("wgrad_dw13", _dw13_triton, _dw13_cublas, _dw13_sm90)
