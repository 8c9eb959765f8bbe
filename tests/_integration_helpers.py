"""Shared builders for the converter / checkpoint tests: tiny Qwen3-MoE models, job configs."""

from __future__ import annotations

import copy
import dataclasses
from contextlib import contextmanager

import torch

from torchtitan.config import JobConfig
from torchtitan.models.moe import MoEArgs
from torchtitan.models.qwen3 import Qwen3Model, Qwen3ModelArgs

from torchtitan_megamoe.config import MegaMoE as MegaMoEConfig
from torchtitan_megamoe.converter import MegaMoEConverter


def tiny_args(n_layers: int = 2, dim: int = 64, moe_inter_dim: int = 32, **moe) -> Qwen3ModelArgs:
    """Qwen3-MoE semantics at toy size; ``moe`` overrides MoEArgs fields.

    use_grouped_mm=False: stock's grouped-mm path runs its GEMMs in bf16 whatever the param
    dtype, so only the fp32 for-loop path can be compared with the fused op at fp32 tolerance.
    """
    moe_args = dict(
        num_experts=8,
        num_shared_experts=0,
        top_k=2,
        score_func="softmax",
        route_norm=True,
        route_scale=1.0,
        score_before_experts=False,
        use_grouped_mm=False,
    )
    moe_args.update(moe)
    return Qwen3ModelArgs(
        vocab_size=128,
        max_seq_len=64,
        head_dim=16,
        dim=dim,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=96,
        moe_enabled=True,
        moe_inter_dim=moe_inter_dim,
        moe_args=MoEArgs(**moe_args),
    )


def job_config(converters=("megamoe",), **megamoe) -> JobConfig:
    jc = JobConfig()
    jc.model.converters = list(converters)
    jc.megamoe = MegaMoEConfig(**{"backend": "reference", **megamoe})
    return jc


def init_model(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def build_stock(args: Qwen3ModelArgs, seed: int = 0) -> Qwen3Model:
    with torch.device("meta"):
        model = Qwen3Model(copy.deepcopy(args))
    model.to_empty(device="cpu")
    return init_model(model, seed)


def build_converted(args: Qwen3ModelArgs, seed: int = 0, jc: JobConfig | None = None) -> Qwen3Model:
    """What TorchTitan's trainer does: build on meta, convert, materialize, init."""
    with torch.device("meta"):
        model = Qwen3Model(copy.deepcopy(args))
    MegaMoEConverter(jc or job_config(), None).convert(model)
    model.to_empty(device="cpu")
    return init_model(model, seed)


def with_parallelism(jc: JobConfig, **degrees) -> JobConfig:
    jc.parallelism = dataclasses.replace(jc.parallelism, **degrees)
    return jc


@contextmanager
def cpu_histc():
    """The stock router counts int64 expert ids with torch.histc, which has no integer CPU
    kernel; count in float32 (exact at these sizes) and return the input dtype, as CUDA does."""
    original = torch.histc

    def histc(input, bins=100, min=0, max=0):  # noqa: A002
        if not input.is_floating_point():
            return original(input.float(), bins=bins, min=min, max=max).to(input.dtype)
        return original(input, bins=bins, min=min, max=max)

    torch.histc = histc
    try:
        yield
    finally:
        torch.histc = original


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
