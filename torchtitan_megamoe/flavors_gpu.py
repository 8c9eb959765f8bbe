"""Reduced-depth Qwen3-MoE flavors for GPU A/B runs, and the memory estimate that sized them.

An A/B run (stock MoE vs the fused op) must use the production layer shapes (dim, experts, top-k,
moe_inter_dim, attention heads), because that is where the speed-up is measured; it need not use
the production depth, which does not fit on 2 or 8 GPUs. Importing this module registers, for
each production MoE flavor, one flavor per smaller depth, named ``<flavor>-L<n_layers>``
(``30B-A3B-L14``, ``235B-A22B-L2``, ...) into TorchTitan's ``qwen3_args`` table, so a TOML or the
CLI (``--model.flavor 30B-A3B-L12``) can choose any depth without code changes.

TOMLs load it with ``[experimental] custom_import = "torchtitan_megamoe.flavors_gpu"``:
TorchTitan imports that module at the start of ``Trainer.__init__``, before it looks the flavor
up. (Too late to add a TOML section, but flavors are only read later.)

:func:`estimate_peak_gib` is the arithmetic behind the depths in the ``*_ab_*gpu.toml`` configs;
:func:`max_layers` picks the deepest model whose estimate stays within the budget.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torchtitan.models.qwen3 import qwen3_args, Qwen3ModelArgs

from torchtitan_megamoe.flavors import add_flavors

BASE_FLAVORS = ("30B-A3B", "235B-A22B")
"""Production flavors that get reduced-depth variants."""

GIB = 1024**3

H200_GIB = 139.0
"""Usable memory of one H200 as PyTorch reports it (141 GB marketed)."""

HEADROOM = 0.85
"""Fraction of the GPU an estimate may fill; the rest absorbs allocator fragmentation, the
estimate's approximations and routing skew beyond :data:`LOAD_IMBALANCE`."""

LOAD_IMBALANCE = 1.5
"""Receive-side rows of the busiest EP rank relative to a perfectly balanced routing."""

RUNTIME_GIB = 4.0
"""CUDA context, NCCL and cuBLAS workspaces, Inductor/Triton kernels (measured order of
magnitude on H200 with torch 2.11)."""


def reduced_name(base: str, n_layers: int) -> str:
    return f"{base}-L{n_layers}"


def reduced(base: str, n_layers: int) -> Qwen3ModelArgs:
    """``base`` with ``n_layers`` layers; everything else, including per-layer shapes, as base."""
    full = qwen3_args[base]
    if not 1 <= n_layers <= full.n_layers:
        raise ValueError(
            f"n_layers={n_layers} for {base!r}: choose 1..{full.n_layers} (the full depth)."
        )
    # deepcopy: the trainer mutates the flavor it picks (max_seq_len, moe_args debug flag), and
    # dataclasses.replace would share the nested MoEArgs with the production flavor.
    args = copy.deepcopy(full)
    args.n_layers = n_layers
    return args


def _flavors() -> dict[str, Qwen3ModelArgs]:
    return {
        reduced_name(base, n): reduced(base, n)
        for base in BASE_FLAVORS
        for n in range(1, qwen3_args[base].n_layers)
    }


FLAVORS: dict[str, Qwen3ModelArgs] = _flavors()
"""Flavors this module adds to ``torchtitan.models.qwen3.qwen3_args``."""


def register() -> None:
    add_flavors(FLAVORS, "torchtitan_megamoe/flavors_gpu.py")


register()


# --------------------------------------------------------------------------------------------
# Memory estimate (per GPU) for FSDP + EP training with fp32 master weights, bf16 compute,
# per-op selective ("op") or full activation checkpointing, `tokens` tokens per GPU.

AC_MODES = ("op", "full")


@dataclass(frozen=True)
class MemoryEstimate:
    states_gib: float
    """fp32 params + fp32 grads + Adam exp_avg/exp_avg_sq: 16 bytes per parameter, sharded over
    all ranks (dense weights by FSDP; experts by EP x efsdp, which is also every rank)."""

    activations_gib: float
    """Saved per layer, bf16. Full AC: the block input only. Per-op SAC: block input, wq and wv
    outputs (every other mm is saved; wk/wo recomputed, the router gate always recomputed),
    attention output + fp32 log-sum-exp, and the MoE output (the fused op is on the save list;
    stock recomputes its grouped GEMMs and all-to-alls, so it keeps no more)."""

    logits_gib: float
    """Loss peak: bf16 logits, their fp32 copy in the loss, fp32 gradient (10 bytes per logit)."""

    moe_workspace_gib: float
    """One MoE layer in backward on the busiest rank: dispatched rows, the SwiGLU intermediates
    and their gradients (both sides), rows = tokens * top_k * LOAD_IMBALANCE."""

    fsdp_gib: float
    """Unsharded bf16 weights of two layers (current + prefetched), the bf16 and fp32 gradient
    buffers of one layer, and the unsharded output projection with its fp32 gradient."""

    runtime_gib: float = RUNTIME_GIB

    @property
    def total_gib(self) -> float:
        return (
            self.states_gib
            + self.activations_gib
            + self.logits_gib
            + self.moe_workspace_gib
            + self.fsdp_gib
            + self.runtime_gib
        )


def _layer_params(a: Qwen3ModelArgs) -> tuple[int, int]:
    """(dense, routed-expert) parameters of one transformer block."""
    q = a.n_heads * a.head_dim
    kv = a.n_kv_heads * a.head_dim
    attention = a.dim * q + 2 * a.dim * kv + q * a.dim + 2 * a.head_dim
    router = a.dim * a.moe_args.num_experts
    norms = 2 * a.dim
    experts = 3 * a.moe_args.num_experts * a.dim * a.moe_inter_dim
    return attention + router + norms, experts


def param_count(a: Qwen3ModelArgs) -> int:
    """Parameters of flavor ``a`` (buffers excluded), as TorchTitan's Qwen3 model builds it."""
    dense_layer, experts_layer = _layer_params(a)
    embed = a.vocab_size * a.dim * (1 if a.enable_weight_tying else 2)
    return embed + a.dim + a.n_layers * (dense_layer + experts_layer)


def estimate_peak_gib(
    a: Qwen3ModelArgs, world: int, ep: int, tokens: int, ac: str = "op"
) -> MemoryEstimate:
    """Peak memory of one GPU training flavor ``a`` on ``world`` GPUs with EP degree ``ep`` and
    activation checkpointing ``ac`` ("op": selective per-op, "full")."""
    if world % ep != 0:
        raise ValueError(f"world={world} is not a multiple of ep={ep}")
    if ac not in AC_MODES:
        raise ValueError(f"ac={ac!r}: choose one of {AC_MODES}")
    dense_layer, experts_layer = _layer_params(a)
    states = 16 * param_count(a) / world

    t, d = tokens, a.dim
    q = a.n_heads * a.head_dim
    kv = a.n_kv_heads * a.head_dim
    if ac == "full":
        per_layer_act = 2 * t * d
    else:
        per_layer_act = 2 * t * (d + q + kv + q + d) + 4 * t * a.n_heads
    activations = a.n_layers * per_layer_act

    logits = 10 * t * a.vocab_size

    rows = t * a.moe_args.top_k * LOAD_IMBALANCE
    # forward recompute + backward: (dispatched x, its a2a copy, expert out) x D and
    # (h1, h3, silu*h3) x H, each bf16, once for values and once for gradients.
    moe = 2 * 2 * rows * (3 * d + 3 * a.moe_inter_dim)

    layer_local = dense_layer + experts_layer / ep
    fsdp = 2 * 2 * layer_local + (2 + 4) * layer_local + (2 + 4) * a.vocab_size * d

    return MemoryEstimate(
        states_gib=states / GIB,
        activations_gib=activations / GIB,
        logits_gib=logits / GIB,
        moe_workspace_gib=moe / GIB,
        fsdp_gib=fsdp / GIB,
    )


def max_layers(
    base: str,
    world: int,
    ep: int,
    tokens: int,
    ac: str = "op",
    budget_gib: float | None = None,
) -> int:
    """Deepest variant of ``base`` whose estimate fits ``budget_gib`` (default: HEADROOM of an
    H200); 0 if not even one layer fits."""
    budget = H200_GIB * HEADROOM if budget_gib is None else budget_gib
    best = 0
    for n in range(1, qwen3_args[base].n_layers + 1):
        if estimate_peak_gib(reduced(base, n), world, ep, tokens, ac).total_gib <= budget:
            best = n
    return best
