"""The expert shapes a call may have, as one rule that every check asks: mega_moe's argument
checks, the hopper backend's input checks and the converter at conversion. It imports no
backend (no Triton, no CUDA build), so the converter and ``auto`` ask it for free.

dim D and hidden H must be multiples of
- an FP8 recipe's scale block (Recipe.block), on every backend: the reference emulates the
  same blocks;
- on the hopper backend, also its GEMMs' narrowest tile along D and H (``hopper_multiple``).
"""

from __future__ import annotations

import math

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.recipe import Recipe

HOPPER_MULTIPLE = 64
"""The hopper kernels' narrowest tile along D and H (block_n / block_k) on the GPU."""
INTERPRET_MULTIPLE = 16
"""The same under the CPU interpreter, whose GEMM configs are 16 wide (heuristics'
INTERPRET_GEMM)."""


def hopper_multiple() -> int:
    """What the hopper kernels need D and H to be multiples of, in this process."""
    return INTERPRET_MULTIPLE if settings.triton_interpreting() else HOPPER_MULTIPLE


def shape_error(dim: int, hidden: int, recipe: Recipe, backend: str = "reference") -> str | None:
    """Why ``backend`` cannot take experts of dim ``dim`` and hidden size ``hidden`` in
    ``recipe``, or None if it can. The caller adds where and what to change."""
    if recipe.block and (dim % recipe.block or hidden % recipe.block):
        return (f"precision={recipe.name!r} uses {recipe.block}-wide scaling blocks and needs "
                f"dim and hidden % {recipe.block} == 0, got dim={dim}, hidden={hidden}")
    if backend == "hopper":
        need = math.lcm(hopper_multiple(), recipe.block or 1)
        if dim % need or hidden % need:
            return (f"the hopper kernels need dim and hidden to be multiples of {need} (their "
                    f"narrowest tile), got dim={dim}, hidden={hidden}")
    return None
