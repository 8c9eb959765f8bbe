"""The routing plan's tile heights: how many rows each expert's segment is padded to, per
path. Every GEMM candidate's block_m divides its plan's height (heuristics.py)."""

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.recipe import SCALE_BLOCK

BLOCK_M = 128
"""Plan tile height on the GPU: every GEMM candidate's block_m divides it."""
FP8_BLOCK_M = SCALE_BLOCK
"""Segment padding of the FP8 plans (the FP8 scale block: a weight-gradient scale block must not
straddle experts); a recipe's ``plan_block_m``."""
INTERPRET_BLOCK_M = 16
"""Plan tile height under the CPU interpreter, which runs numpy per program: small tiles keep
tests quick and still cover several tiles per expert."""


def plan_block_m() -> int:
    """The bf16 plan's tile height (forward and backward)."""
    return INTERPRET_BLOCK_M if settings.triton_interpreting() else BLOCK_M
