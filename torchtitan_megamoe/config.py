"""The ``[megamoe]`` TOML section.

Point TorchTitan at this module with ``[job] custom_config_module =
"torchtitan_megamoe.config"``: TorchTitan imports it while it parses the TOML and merges the
``JobConfig`` below into its own, so ``[megamoe]`` keys and ``--megamoe.<field>`` CLI overrides
work. Importing this module also registers the ``megamoe`` model converter, so
``[model] converters = ["megamoe"]`` switches the fused op on; leaving it out gives the stock run
(the A/B switch).
"""

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class MegaMoEConfig:
    backend: Literal["auto", "hopper", "reference", "triton"] = "auto"
    """Which implementation of the fused op runs. ``auto``: the Hopper kernels (Triton and
    CUDA C++) on SM90 GPUs, the PyTorch reference everywhere else (CPU, older GPUs). ``hopper``:
    insist on the kernels (error if they cannot run); ``triton`` is its former name, still
    accepted with a warning. ``reference``: plain PyTorch, any device; the oracle the
    kernels are tested against."""

    precision: Literal["bf16", "fp8", "fp8_bwd"] = "bf16"
    """Arithmetic of the expert GEMMs. ``bf16``: BF16 inputs, fp32 accumulation. ``fp8``:
    blockwise FP8 (e4m3) forward and backward, DeepSeek-V3's recipe: 1x128 activation scales,
    128x128 weight scales, per-128-row scales for the weight gradients' operands, fp32
    promotion every 128 of K. ``fp8_bwd``: the BF16 forward, the FP8 backward. Both run in the
    Hopper kernels with expert_parallel_degree = 1 (FSDP is fine) and need dim and
    moe_inter_dim % 128 == 0; the reference backend emulates the same recipe on any device."""

    fp8_weight_cache: bool = False
    """FP8 only: keep each layer's quantized expert weights (forward and backward layouts) from
    one call to the next instead of quantizing them on every call, re-made after every
    optimizer step (the converter's post-optimizer hook) and whenever a weight's version
    counter moves (any in-place write: a checkpoint load, an init). Saves ~0.7 ms per 30B-A3B
    layer forward + backward at 16384 tokens on H200 (docs/PERF.md, FP8 stages) and costs memory equal to
    the experts' bf16 weights per layer (30B-A3B: 1.2 GB per layer). Refused under FSDP (the
    gathered weights are rewritten in place without a version change)."""

    save_activations: Literal["auto", "keep", "never"] = "auto"
    """What the fused op keeps from its forward for the backward. ``keep``: the Triton backend
    keeps GEMM 1's pre-activations a1/a3 (bf16) so the backward does not recompute GEMM 1 -
    0.42 GiB per MoE layer at 30B-A3B and 16384 tokens per GPU, 0.84 GiB at 235B-A22B (stock
    TorchTitan keeps 1.06 / 2.13 GiB of routed activations when it keeps any), and at EP > 1
    only while that bound holds in the receive layout (EP=2 yes, EP >= 4 no). ``never``: keep
    nothing; the backward runs GEMM 1 again (+1.7 ms per layer at 30B-A3B on H200, bitwise the
    same gradients). ``auto``: ``never`` under per-op selective AC, ``keep`` otherwise. Per-op
    SAC keeps the op's outputs for every layer while stock TorchTitan 0.2.2's per-op SAC keeps
    no expert activations (``_grouped_mm`` is not in its save list: it recomputes its experts),
    so keeping them would put the step's peak memory above stock's (measured on 2 H200s:
    +0.47 GiB for 2 layers at 4096 tokens); under full AC or no AC ``keep`` costs at most
    stock's memory. Choose ``keep`` under per-op SAC to trade that memory for the faster
    backward."""

    max_tokens_per_rank: int = 0
    """Capacity of the expert-parallel token exchange (EP > 1), in tokens per rank (local batch
    x sequence length). Each rank's receive buffers hold this many rows from every rank of the
    EP group, so no routing can overflow them. 0 sizes them from the first MoE call (the
    largest batch in the group). They are symmetric memory, created once and shared by all
    layers, and cannot grow: set this when later steps bring more tokens per rank than the
    first (a larger call raises an error naming this knob). Memory per rank: 3 x ep x
    max_tokens_per_rank x dim x 2 bytes (30B-A3B, EP=8, 16384 tokens: 1.5 GiB)."""


@dataclass
class JobConfig:
    megamoe: MegaMoEConfig = field(default_factory=MegaMoEConfig)


def _register() -> None:
    # Registration by import, as TorchTitan's own converters do; the import is deferred to here so
    # that `import torchtitan_megamoe.config` alone is enough for a TOML to use the converter.
    from torchtitan_megamoe import cpu, flavors, flavors_gpu  # noqa: F401  (CPU shims; flavors)
    from torchtitan_megamoe import converter  # noqa: F401


_register()
