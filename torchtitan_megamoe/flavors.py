"""Extra Qwen3-MoE flavors, registered into TorchTitan's ``qwen3_args`` by import.

``torchtitan_megamoe.config`` imports this module, so a TOML that sets ``[job]
custom_config_module = "torchtitan_megamoe.config"`` can say ``[model] flavor = "megamoe_tiny"``.
TorchTitan looks the flavor up in ``train_spec.model_args`` (that same dict) after the TOML is
parsed, so registering at import is in time.
"""

from __future__ import annotations

from dataclasses import replace

from torchtitan.models.moe import MoEArgs
from torchtitan.models.qwen3 import qwen3_args, Qwen3ModelArgs

TINY_VOCAB_SIZE = 512
"""Vocabulary of ``megamoe_tiny``; ``torchtitan_megamoe.assets`` trains its tokenizer to fit."""

TINY_EOS_ID = 1
"""Id of ``<|eos|>`` in the generated tokenizer (special tokens come first: bos 0, eos 1)."""


QWEN3_TINY_MOE_ARGS = dict(
    num_experts=8,
    num_shared_experts=0,
    top_k=2,
    score_func="softmax",
    route_norm=True,
    route_scale=1.0,
    score_before_experts=False,
    # stock's grouped-mm path runs its GEMMs in bf16 whatever the param dtype; only the fp32
    # for-loop path can be compared with the fused op at fp32 tolerance
    use_grouped_mm=False,
)
"""Qwen3's MoE semantics (softmax, route_norm, no shared experts, scores after the experts) at
toy size: the tiny flavor's and the CPU tests' MoEArgs."""


def _tiny() -> Qwen3ModelArgs:
    # Small enough for a CPU step in well under a second on 2 cores (debugmodel_moe takes ~20 s),
    # but with the Qwen3-MoE semantics the converter must reproduce: softmax routing in fp32,
    # route_norm, top-2 of 8 experts, no shared experts, scores applied after the experts.
    # use_grouped_mm=False: stock's grouped-mm path casts expert GEMMs to bf16 (and
    # torch._grouped_mm needs CUDA), so the fp32 for-loop path is the one an fp32 A/B can match
    # to ~1e-6.
    return Qwen3ModelArgs(
        vocab_size=TINY_VOCAB_SIZE,
        max_seq_len=256,
        head_dim=16,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        qk_norm=True,
        hidden_dim=128,
        rope_theta=1000000,
        eos_id=TINY_EOS_ID,
        moe_enabled=True,
        moe_inter_dim=32,
        moe_args=MoEArgs(**QWEN3_TINY_MOE_ARGS),
    )


def _tiny_fp8() -> Qwen3ModelArgs:
    # The FP8 recipe scales in 128-wide blocks: dim and moe_inter_dim one block each, the
    # smallest shape it accepts, so a CPU step stays well under a second; routing and
    # vocabulary as megamoe_tiny (the same generated assets).
    return replace(_tiny(), dim=128, head_dim=32, hidden_dim=256, moe_inter_dim=128)


FLAVORS: dict[str, Qwen3ModelArgs] = {"megamoe_tiny": _tiny(), "megamoe_tiny_fp8": _tiny_fp8()}
"""Flavors this module adds to ``torchtitan.models.qwen3.qwen3_args``."""


def add_flavors(flavors: dict[str, Qwen3ModelArgs], source: str) -> None:
    """Add ``flavors`` to Qwen3's flavor table (idempotent; never replaces a foreign one)."""
    for name, args in flavors.items():
        existing = qwen3_args.get(name)
        if existing is not None and existing is not args:
            raise ValueError(
                f"Qwen3 flavor {name!r} already exists and is not torchtitan_megamoe's; rename "
                f"it in {source}."
            )
        qwen3_args[name] = args


def register() -> None:
    add_flavors(FLAVORS, "torchtitan_megamoe/flavors.py")


register()
