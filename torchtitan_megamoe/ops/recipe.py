"""The op's precisions as recipes: one frozen record per ``precision`` value saying which GEMMs
run in FP8, how the FP8 operands are scaled, which FP8 weight copies a layer keeps and what the
weights may be. ``RECIPES`` is the one table of them and ``recipe_named(name)`` the one lookup
(torchao's ``Float8LinearConfig.from_recipe_name`` is the model); MegaMoEOptions resolves its
``precision`` into ``options.recipe`` once, and the backends, the module and the converter read
the recipe's fields, never the name.

A new recipe is one more entry here (and its name in ``Precision``); the stages that run its
GEMMs read the fields below."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

import torch

Precision = Literal["bf16", "fp8", "fp8_bwd"]
"""The recipes' names: the values of ``precision`` ([megamoe] and mega_moe())."""

PRECISIONS = typing.get_args(Precision)

SCALE_BLOCK = 128
"""DeepSeek-V3's FP8 scale block: activations and gradients per 1 x 128, weights per 128 x 128,
fp32 promotion every 128 of the contraction."""


@dataclass(frozen=True)
class Recipe:
    name: str
    """The ``precision`` value that names this recipe."""

    fp8_forward: bool
    """GEMM 1 and GEMM 2 run in FP8 (e4m3, fp32 accumulation)."""

    fp8_dgrad: bool
    """The two data-gradient GEMMs (dgrad2, dgrad1) run in FP8."""

    fp8_wgrad_switchable: bool
    """The weight-gradient GEMMs may run in FP8 too: only where the developer switch
    MEGAMOE_FP8_WGRAD=1 opts in (the all-FP8 recipe), else bf16, faster at the Qwen3 shapes.
    Ask ``fp8_wgrad(settings.fp8_wgrad())``: the switch is read per call, options are interned."""

    block: int | None
    """The FP8 scale block along every contraction (SCALE_BLOCK); dim and hidden must be
    multiples of it on every backend (ops/shapes.py). None: no FP8 GEMM."""

    activation_scales: tuple[int, int] | None
    """Block of one scale of the activations and gradients fed to an FP8 GEMM (rows x
    columns): (1, block), one per token and 128 columns. None: no FP8 GEMM."""

    weight_scales: tuple[int, int] | None
    """Block of one scale of the weights' FP8 copies: (block, block). None: no FP8 GEMM."""

    plan_block_m: int | None
    """Row padding of each expert's segment in the routing plan that the FP8 stages need (a
    weight-gradient scale block must not straddle experts): the block; it holds for the bf16
    forward of a recipe with an FP8 backward too, so its saved plan serves that backward. None:
    the backend's own tile height."""

    forward_copies: bool
    """A layer keeps FP8 copies of its weights in the forward layout (w1, w3, w2 as stored):
    the FP8 forward reads them, and FSDP's FP8 all-gather moves them."""

    transposed_copies: bool
    """A layer keeps the transposed FP8 copies the FP8 data gradients read (w2^T, [w1 | w3]^T).
    With forward copies too they are optional (``fp8_keep_transposed``): the backward can make
    them from the forward copies by a byte transpose."""

    stand_ins: bool
    """The op reads the weights only through their FP8 copies (forward and data gradients both
    FP8): a layer holding the copies passes zero-stride stand-ins that carry the weights'
    gradients, in the weights' own dtype (no cast under autocast; fp32 gradients for fp32
    parameters)."""

    weight_dtypes: tuple[torch.dtype, ...]
    """Weight dtypes the hopper backward accepts (fp32 where the weights are read only through
    FP8 copies: their gradients come out in fp32)."""

    @property
    def fp8(self) -> bool:
        """Any GEMM in FP8: the FP8 weight copies (``fp8_weights``) serve this recipe."""
        return self.fp8_forward or self.fp8_dgrad

    def fp8_wgrad(self, switch: bool) -> bool:
        """Whether the weight gradients run in FP8, given the developer switch's state now
        (``settings.fp8_wgrad()``)."""
        return self.fp8_wgrad_switchable and switch

    def kept_copies(self, keep_transposed: bool) -> tuple[bool, bool]:
        """(forward, transposed): the FP8 weight copies a layer keeps across calls;
        ``keep_transposed`` (fp8_keep_transposed) may drop the transposed ones only where the
        forward copies can make them."""
        transposed = self.transposed_copies and (keep_transposed or not self.forward_copies)
        return self.forward_copies, transposed


def _fp8(name: str, forward: bool) -> Recipe:
    """A blockwise FP8 recipe with FP8 data gradients and, with ``forward``, an FP8 forward."""
    return Recipe(
        name=name, fp8_forward=forward, fp8_dgrad=True, fp8_wgrad_switchable=True,
        block=SCALE_BLOCK, activation_scales=(1, SCALE_BLOCK),
        weight_scales=(SCALE_BLOCK, SCALE_BLOCK), plan_block_m=SCALE_BLOCK,
        forward_copies=forward, transposed_copies=True, stand_ins=forward,
        weight_dtypes=(torch.bfloat16, torch.float32) if forward else (torch.bfloat16,),
    )


RECIPES: dict[str, Recipe] = {
    "bf16": Recipe(
        name="bf16", fp8_forward=False, fp8_dgrad=False, fp8_wgrad_switchable=False,
        block=None, activation_scales=None, weight_scales=None, plan_block_m=None,
        forward_copies=False, transposed_copies=False, stand_ins=False,
        weight_dtypes=(torch.bfloat16,),
    ),
    # DeepSeek-V3's: FP8 forward and data gradients, bf16 weight gradients
    "fp8": _fp8("fp8", forward=True),
    # the bf16 forward's accuracy, the FP8 backward's data-gradient speed
    "fp8_bwd": _fp8("fp8_bwd", forward=False),
}


def recipe_named(name: str) -> Recipe:
    """The recipe called ``name`` (a ``precision`` value)."""
    try:
        return RECIPES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown precision {name!r}; pick one of {', '.join(PRECISIONS)}"
        ) from None
