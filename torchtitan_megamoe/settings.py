"""Every setting the package reads, in one place: the ``[megamoe]`` TOML section
(``MegaMoEConfig``, checked when it is built) and the ``MEGAMOE_*`` environment variables.
Each variable is read when asked for (not at import), so a test or a launcher can set it before
the call that needs it. README.md's "Settings" table documents them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from torchtitan_megamoe.checked import check_fields, checked
from torchtitan_megamoe.ops.recipe import Precision

Backend = Literal["auto", "hopper", "reference"]
"""Which implementation of the op runs (mega_moe's ``backend``, [megamoe] backend)."""
SaveActivations = Literal["keep", "never"]
"""What the op's forward keeps for its backward (``save_activations``; [megamoe] adds auto)."""

CPU = "MEGAMOE_CPU"
TUNE = "MEGAMOE_TUNE"
BWD_IMPL = "MEGAMOE_BWD_IMPL"
CUDA = "MEGAMOE_CUDA"
CUDA_CACHE = "MEGAMOE_CUDA_CACHE"
FP8_WGRAD = "MEGAMOE_FP8_WGRAD"
FP8_FUSED_DGRAD2 = "MEGAMOE_FP8_FUSED_DGRAD2"
DEEPGEMM = "MEGAMOE_DEEPGEMM"
LOOPBACK_LINK_GBS = "MEGAMOE_LOOPBACK_LINK_GBS"
LOOPBACK_PACED = "MEGAMOE_LOOPBACK_PACED"
EXCHANGE_TIMEOUT_S = "MEGAMOE_EXCHANGE_TIMEOUT_S"

BWD_IMPLS = ("auto", "triton", "cublas")


def _flag(name: str, default: str) -> bool:
    value = os.environ.get(name, default).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{name}={value!r} is not a switch; set it to 1 or 0")


def cpu_shims() -> bool:
    """MEGAMOE_CPU=1: patch TorchTitan 0.2.2 to train on CPU (used only without CUDA)."""
    return _flag(CPU, "0")


def tuning() -> bool:
    """MEGAMOE_TUNE=0: run each stage's untuned pick (its best-known side, sides/table.py)
    instead of timing the candidates."""
    return _flag(TUNE, "1")


def bwd_impl() -> str:
    """MEGAMOE_BWD_IMPL: auto (the tuner picks per stage), triton or cublas (forced)."""
    impl = os.environ.get(BWD_IMPL, "auto").strip().lower() or "auto"
    if impl not in BWD_IMPLS:
        raise ValueError(f"{BWD_IMPL}={impl!r} is not one of {BWD_IMPLS}; unset it or pick one")
    return impl


def cuda_kernels() -> bool:
    """MEGAMOE_CUDA=0: never offer the hand-written CUDA kernels (Triton and cuBLAS only)."""
    return _flag(CUDA, "1")


def fp8_wgrad() -> bool:
    """MEGAMOE_FP8_WGRAD=1: FP8 weight gradients too (the all-FP8 recipe). Default: the FP8
    precisions take their weight gradients in bf16, faster at the Qwen3 shapes."""
    return _flag(FP8_WGRAD, "0")


def fp8_fused_dgrad2() -> bool:
    """MEGAMOE_FP8_FUSED_DGRAD2=1: the FP8 backward's dgrad of linear 2 and its SwiGLU backward
    in one sm90 launch (dh never stored), where the CUDA kernels run; off until measured."""
    return _flag(FP8_FUSED_DGRAD2, "0")


def deepgemm() -> bool:
    """MEGAMOE_DEEPGEMM=0: never offer DeepGEMM's kernels, even where it is installed."""
    return _flag(DEEPGEMM, "1")


def cuda_cache() -> Path:
    """MEGAMOE_CUDA_CACHE: where the compiled CUDA libraries are kept."""
    return Path(os.environ.get(CUDA_CACHE,
                               Path.home() / ".cache" / "torchtitan_megamoe" / "cuda"))


def loopback_link_gbs() -> float:
    """MEGAMOE_LOOPBACK_LINK_GBS=G: loopback EP ranks (a measuring mode) pace each transfer to a
    G GB/s per-direction link, e.g. 326 for NVLink between two H200s; 0 (default): no pacing."""
    value = os.environ.get(LOOPBACK_LINK_GBS, "0").strip() or "0"
    try:
        gbs = float(value)
    except ValueError:
        gbs = -1.0
    if gbs < 0:
        raise ValueError(f"{LOOPBACK_LINK_GBS}={value!r}: give a bandwidth in GB/s (0: off)")
    return gbs


def loopback_paced_transfers() -> frozenset | None:
    """MEGAMOE_LOOPBACK_PACED="combine,return dx": pace only these transfers (with
    MEGAMOE_LOOPBACK_LINK_GBS), to measure what each one exposes; unset: every transfer."""
    value = os.environ.get(LOOPBACK_PACED, "").strip()
    return frozenset(t.strip() for t in value.split(",") if t.strip()) if value else None


def exchange_timeout_ms() -> int:
    """MEGAMOE_EXCHANGE_TIMEOUT_S: how long a device-side EP wait (a barrier, a peer's signal)
    may last before it fails with a CUDA error instead of hanging the job (default 600 s: a
    peer's first call may spend minutes compiling and tuning kernels)."""
    value = os.environ.get(EXCHANGE_TIMEOUT_S, "600").strip() or "600"
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if seconds <= 0:
        raise ValueError(f"{EXCHANGE_TIMEOUT_S}={value!r}: give a positive number of seconds")
    return int(seconds * 1000)


def triton_interpreting() -> bool:
    """TRITON_INTERPRET=1 (Triton's own switch): kernels run on the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@checked
@dataclass
class MegaMoEConfig:
    """The ``[megamoe]`` section of a TorchTitan TOML (``--megamoe.<field>`` on the command
    line), added by ``[job] custom_config_module = "torchtitan_megamoe.config"``. Every value is
    checked when the section is built (TOML values reach it unchecked) and again by the
    converter: a wrong type or value raises, naming the field, before any step runs. The
    converter turns it into the op's ``MegaMoEOptions`` (ops/options.py), one per model: each
    options field from the field of its name here (a new option is a field in both)."""

    backend: Backend = "auto"
    """Which implementation of the fused op runs. ``auto``: the Hopper kernels (Triton and
    CUDA C++) on SM90 GPUs, the PyTorch reference everywhere else (CPU, older GPUs).
    ``hopper``: insist on the kernels (error if they cannot run). ``reference``: plain PyTorch,
    any device; the oracle the kernels are tested against."""

    precision: Precision = "bf16"
    """Arithmetic of the expert GEMMs. ``bf16``: BF16 inputs, fp32 accumulation. ``fp8``:
    the forward and data-gradient GEMMs in blockwise FP8 (e4m3), DeepSeek-V3's recipe: 1x128
    activation scales, 128x128 weight scales, fp32 promotion every 128 of K; the weight
    gradients in bf16 (faster at the Qwen3 shapes; MEGAMOE_FP8_WGRAD=1: FP8 too).
    ``fp8_bwd``: the BF16 forward, the FP8 data gradients, bf16 weight gradients. Both run in the
    Hopper kernels at any expert_parallel_degree (tokens travel as e4m3 rows where the recipe
    quantizes them anyway), with or without FSDP, and need dim and moe_inter_dim % 128 == 0;
    the reference backend emulates the same recipe on any device."""

    fp8_weight_cache: bool = True
    """FP8 precisions on the hopper backend (ignored otherwise): each MoE layer makes its
    expert weights' FP8 copies (forward and transposed layouts) once per optimizer step, at the
    start of the model's forward (``fp8_free_after_backward``, the default: freed after its
    backward) or in the converter's post-optimizer hook (kept from one call to the next), so
    the step's backward quantizes no weight (the hook re-makes them every step: a fused
    optimizer moves no version counter). A weight changed outside the optimizer step (a
    checkpoint load, a copy_) is seen by its version counter and quantized again before the
    next call. Memory kept: as much as the layer's bf16 expert weights for ``fp8`` (30B-A3B:
    1.2 GB per layer), half that for ``fp8_bwd``. ``false``: quantize on every call and keep
    nothing. Under FSDP see docs/ARCHITECTURE.md ("FP8 weights")."""

    fp8_keep_transposed: bool = True
    """With ``fp8_weight_cache`` at precision ``fp8``: keep the transposed copies (the
    backward's layouts) too. ``false`` keeps only the forward copies, half the memory (the
    layer's bf16 expert weights' worth becomes half that), and the backward makes the transposed
    ones from them by a byte transpose on every call (no quantization, one read and write of
    the FP8 weights)."""

    fp8_free_after_backward: bool = True
    """With ``fp8_weight_cache``: each MoE layer frees its FP8 copies as soon as its backward
    has read them and makes them again at the start of the model's next forward. The step's peak, at the end of the
    backward where every weight gradient is alive, then holds one layer's copies instead of
    every layer's (30B-A3B ``fp8``: 1.2 GB per layer). The quantization stays once per step
    with one micro-batch per step; with gradient accumulation it runs once per micro-batch.
    ``false``: keep them from one optimizer step to the next (made once per step, in the
    converter's post-optimizer hook)."""

    bf16_weight_cache: bool = True
    """A bf16 forward (``bf16``, ``fp8_bwd``) under TorchTitan's bf16 autocast over fp32
    parameters (one GPU without FSDP; FSDP casts the parameters itself), hopper backend, EP=1:
    each MoE layer casts its expert weights to bf16 once per step, at the start of the model's
    forward, and frees the casts once its backward has read them, instead of casting them in
    every forward and again in the activation checkpointing's recompute (30B-A3B: three
    0.4 GB fp32 reads per layer and pass saved). Memory: the casts, 1.2 GB per 30B-A3B layer,
    live from the forward to that layer's backward, as ``fp8``'s FP8 copies do. ``false``: cast
    in every call."""

    save_activations: Literal["auto", SaveActivations] = "auto"
    """What the fused op keeps from its forward for the backward. ``keep``: the hopper backend
    keeps GEMM 1's pre-activations a1/a3 (bf16) so the backward does not recompute GEMM 1 -
    0.42 GiB per MoE layer at 30B-A3B and 16384 tokens per GPU, 0.84 GiB at 235B-A22B (stock
    TorchTitan keeps 1.06 / 2.13 GiB of routed activations when it keeps any), and at EP > 1
    only while that bound holds in the receive layout (EP=2 yes, EP >= 4 no). ``never``: keep
    nothing; the backward runs GEMM 1 again (more time, bitwise the same gradients).
    ``auto``: ``never`` under per-op selective AC, ``keep`` otherwise. Per-op SAC keeps the
    op's outputs for every layer while stock TorchTitan 0.2.2's per-op SAC keeps no expert
    activations (``_grouped_mm`` is not in its save list: it recomputes its experts), so
    keeping them would put the step's peak memory above stock's; under full AC or no AC
    ``keep`` costs at most stock's memory. Choose ``keep`` under per-op SAC to trade that
    memory for the faster backward."""

    max_tokens_per_rank: int = 0
    """Capacity of the expert-parallel token exchange (EP > 1), in tokens per rank (local batch
    x sequence length). Each rank's receive buffers hold this many rows from every rank of the
    EP group, so no routing can overflow them. 0 sizes them from the first MoE call (the
    largest batch in the group). They are symmetric memory, created once and shared by all
    layers, and cannot grow: set this when later steps bring more tokens per rank than the
    first. A call with more tokens raises an error naming this field and the value needed, on
    the reference backend too. Memory per rank: 3 x ep x max_tokens_per_rank x dim x 2 bytes
    (30B-A3B, EP=8, 16384 tokens: 1.5 GiB)."""

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise, naming the field, the value and what it must be, for any value that does
        not fit (a string "false" for a bool, a float or a word for a count, an unknown
        name)."""
        check_fields(self, "[megamoe]")
