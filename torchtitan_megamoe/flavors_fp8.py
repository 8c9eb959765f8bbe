"""The tiny Qwen3-MoE flavor at FP8's block size, for FP8 training on a CPU.

The FP8 recipe scales in 128-wide blocks, so ``dim`` and ``moe_inter_dim`` must be multiples of
128; ``megamoe_tiny`` (dim 64) cannot run it. ``megamoe_tiny_fp8`` is the same model with
dim = moe_inter_dim = 128 and the same vocabulary, so it trains on the generated tiny assets.

TOMLs load it with ``[experimental] custom_import = "torchtitan_megamoe.flavors_fp8"``:
TorchTitan imports that module at the start of ``Trainer.__init__``, before it looks the flavor
up (``train_configs/qwen3_moe_tiny_fp8_cpu.toml``).
"""

from __future__ import annotations

import copy
from dataclasses import replace

from torchtitan_megamoe.flavors import FLAVORS, add_flavors
from torchtitan_megamoe.ops.reference import FP8_BLOCK


def _tiny_fp8():
    # One block wide in both GEMM dimensions: the smallest shape the recipe accepts, so a
    # CPU step stays well under a second; everything else (routing, vocabulary) as megamoe_tiny.
    return replace(copy.deepcopy(FLAVORS["megamoe_tiny"]), dim=FP8_BLOCK, head_dim=32,
                   hidden_dim=2 * FP8_BLOCK, moe_inter_dim=FP8_BLOCK)


FP8_FLAVORS = {"megamoe_tiny_fp8": _tiny_fp8()}
"""Flavors this module adds to ``torchtitan.models.qwen3.qwen3_args``."""

add_flavors(FP8_FLAVORS, "torchtitan_megamoe/flavors_fp8.py")
