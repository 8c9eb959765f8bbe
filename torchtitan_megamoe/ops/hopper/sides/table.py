"""A stage's table of implementations: its sides (name, the configs that fit a problem, the
launch), the side the tuner checks the others against, and the order of preference that picks
what runs untuned (CPU interpreter, CUDA graph capture, MEGAMOE_TUNE=0).

    offer(shape, avail)  Offer(candidates: the reference side's configs first, then the other
                         sides' in table order; untuned: the first config of the most preferred
                         side that offers one)
    launch(cfg, ops)     the side named by cfg.side launches cfg on the stage's operands

``shape``: a stage's frozen problem description (dims, dtypes as flags, plan tile height);
``avail``: which optional sides can run here (Available, from a tensor by ``available``); both
are plain values, so a test can pin every stage's offer at any shape without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper import deepgemm
from torchtitan_megamoe.ops.hopper.cuda.sm90 import sm90_usable


@dataclass(frozen=True)
class Available:
    """Which optional sides can run: sm90 (csrc/ built for an sm_90 GPU, MEGAMOE_CUDA on),
    deepgemm (installed, MEGAMOE_DEEPGEMM on, Hopper), cublas (torch._grouped_mm on a GPU)."""

    sm90: bool = False
    deepgemm: bool = False
    cublas: bool = False


def available(t: torch.Tensor) -> Available:
    """What can run on ``t``'s device. The interpreter runs Triton alone unless a side is
    forced (MEGAMOE_BWD_IMPL)."""
    return Available(
        sm90=sm90_usable(t), deepgemm=deepgemm.available(t),
        cublas=(hasattr(torch, "_grouped_mm") and t.is_cuda
                and not settings.triton_interpreting()))


@dataclass(frozen=True)
class Side:
    name: str
    offer: Callable[[Any, Available], list]
    """(shape, avail) -> the side's configs that fit, in the tuner's order; [] where none does."""
    launch: Callable[[Any, Any], Any]
    """(config, operands) -> what the launch returns (the tuner checks its outputs)."""


@dataclass(frozen=True)
class Offer:
    candidates: tuple
    untuned: Any


@dataclass(frozen=True)
class Stage:
    name: str
    sides: tuple[Side, ...]
    reference: str
    """The side whose first config the tuner checks every other candidate against."""
    prefer: tuple[str, ...]
    """Every side, fastest first where it fits (measured on the GPU at the production shapes)."""

    def __post_init__(self):
        names = [s.name for s in self.sides]
        assert sorted(self.prefer) == sorted(names) and self.reference in names, self

    def offer(self, shape, avail: Available) -> Offer:
        offers = {s.name: s.offer(shape, avail) for s in self.sides}
        order = [self.reference] + [s.name for s in self.sides if s.name != self.reference]
        untuned = next((offers[n][0] for n in self.prefer if offers[n]), None)
        return Offer(tuple(c for n in order for c in offers[n]), untuned)

    def launch(self, cfg, ops):
        for side in self.sides:
            if side.name == cfg.side:
                return side.launch(cfg, ops)
        raise ValueError(f"{self.name} has no side {cfg.side!r}")
