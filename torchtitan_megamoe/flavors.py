"""Extra Qwen3-MoE flavors, registered into TorchTitan's ``qwen3_args`` by import.

``torchtitan_megamoe.config`` imports this module, so a TOML that sets ``[job]
custom_config_module = "torchtitan_megamoe.config"`` can say ``[model] flavor = "megamoe_tiny"``.
TorchTitan looks the flavor up in ``train_spec.model_args`` (that same dict) after the TOML is
parsed, so registering at import is in time.
"""

from __future__ import annotations

from torchtitan.models.moe import MoEArgs
from torchtitan.models.qwen3 import qwen3_args, Qwen3ModelArgs

TINY_VOCAB_SIZE = 512
"""Vocabulary of ``megamoe_tiny``; ``torchtitan_megamoe.assets`` trains its tokenizer to fit."""

TINY_EOS_ID = 1
"""Id of ``<|eos|>`` in the generated tokenizer (special tokens come first: bos 0, eos 1)."""


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
        moe_args=MoEArgs(
            num_experts=8,
            num_shared_experts=0,
            top_k=2,
            score_func="softmax",
            route_norm=True,
            route_scale=1.0,
            score_before_experts=False,
            use_grouped_mm=False,
        ),
    )


FLAVORS: dict[str, Qwen3ModelArgs] = {"megamoe_tiny": _tiny()}
"""Flavors this module adds to ``torchtitan.models.qwen3.qwen3_args``."""


def register() -> None:
    """Add :data:`FLAVORS` to Qwen3's flavor table (idempotent; never replaces a stock one)."""
    for name, args in FLAVORS.items():
        existing = qwen3_args.get(name)
        if existing is not None and existing is not args:
            raise ValueError(
                f"Qwen3 flavor {name!r} already exists and is not torchtitan_megamoe's; rename "
                f"the flavor in torchtitan_megamoe/flavors.py."
            )
        qwen3_args[name] = args


register()
