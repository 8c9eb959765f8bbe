"""Shared builders for the converter / checkpoint tests: tiny Qwen3-MoE models, job configs."""

from __future__ import annotations

import copy
import dataclasses
from contextlib import contextmanager

import torch

from torchtitan.config import JobConfig
from torchtitan.models.moe import MoEArgs
from torchtitan.models.qwen3 import Qwen3Model, Qwen3ModelArgs

from torchtitan_megamoe.config import MegaMoEConfig
from torchtitan_megamoe.converter import MegaMoEConverter
from torchtitan_megamoe.flavors import QWEN3_TINY_MOE_ARGS


def tiny_args(n_layers: int = 2, dim: int = 64, moe_inter_dim: int = 32, **moe) -> Qwen3ModelArgs:
    """Qwen3-MoE semantics at toy size (flavors.QWEN3_TINY_MOE_ARGS); ``moe`` overrides
    MoEArgs fields."""
    moe_args = dict(QWEN3_TINY_MOE_ARGS)
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


# --------------------------------------------------------------------------- 2-rank EP workers
# Run under torch.multiprocessing.spawn (gloo, CPU). Each worker raises on a mismatch, which
# spawn re-raises in the test process.


def _init_gloo(rank: int, world: int, init_file: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
    )


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[n] = g.full_tensor() if isinstance(g, DTensor) else g
    return out


def _check_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    err = rel_err(got, want)
    if not err < tol:
        raise AssertionError(f"{name}: relative error {err:.3e} >= {tol:.0e}")


def ep_worker_experts_only(rank: int, world: int, init_file: str) -> None:
    """Stock EP (ExpertParallel, all-to-all hooks) vs converted EP (MegaExpertParallel + op with
    the ep group), both applied through the (wrapped) stock ``apply_moe_ep_tp``; no FSDP."""
    import torch.distributed as dist
    import torchtitan.models.moe.utils as moe_utils
    import torchtitan.models.qwen3.infra.parallelize as qwen3_par
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from torchtitan_megamoe.moe import MegaExperts

    _init_gloo(rank, world, init_file)
    # Stock EP builds its permutation with a Triton kernel unless told to use the CPU version.
    original = moe_utils.generate_permute_indices
    moe_utils.generate_permute_indices = lambda *a, **k: original(*a, **{**k, "use_cpu": True})
    try:
        with cpu_histc():
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
            args = tiny_args(num_shared_experts=1)
            full = build_stock(args, seed=0)  # same weights on every rank
            stock = build_stock(args, seed=0)
            jc = with_parallelism(job_config(), expert_parallel_degree=world)
            converted = build_converted(args, seed=0, jc=jc)
            for model in (stock, converted):
                qwen3_par.apply_moe_ep_tp(
                    model, tp_mesh=None, ep_mesh=mesh, etp_mesh=None, ep_etp_mesh=None,
                    dual_pipe_v=False,
                )
            experts = converted.layers["0"].moe.experts
            assert isinstance(experts, MegaExperts)
            assert isinstance(experts.w1, DTensor) and experts.w1.placements == (Shard(0),)
            assert experts.w1.to_local().shape[0] == args.moe_args.num_experts // world
            # No dispatch hooks on ours; stock's ExpertParallel installed its all-to-all hooks.
            assert not experts._forward_pre_hooks and not experts._forward_hooks
            assert stock.layers["0"].moe.experts._forward_pre_hooks

            gen = torch.Generator().manual_seed(100 + rank)  # different tokens per rank
            tokens = torch.randint(0, args.vocab_size, (2, 16), generator=gen)
            gout = torch.randn(2, 16, args.vocab_size, generator=gen)
            outs = {}
            for name, model in (("full", full), ("stock", stock), ("converted", converted)):
                out = model(tokens)
                (out * gout).sum().backward()
                outs[name] = (out.detach(), _grads(model))
            _check_close("stock EP vs single-rank output", outs["stock"][0], outs["full"][0], 1e-6)
            _check_close(
                "converted EP vs stock EP output", outs["converted"][0], outs["stock"][0], 1e-6
            )
            g_s, g_c = outs["stock"][1], outs["converted"][1]
            assert g_s.keys() == g_c.keys()
            for n in g_s:
                _check_close(f"grad {n}", g_c[n], g_s[n], 1e-5)
            for n, b in stock.named_buffers():
                assert torch.equal(b, dict(converted.named_buffers())[n]), n
    finally:
        moe_utils.generate_permute_indices = original
        dist.destroy_process_group()


def ep_worker_parallelize_qwen3(rank: int, world: int, init_file: str) -> None:
    """TorchTitan's own path: meta build -> (convert) -> parallelize_qwen3 with EP=2 + FSDP +
    activation checkpointing -> to_empty -> load the same full weights; stock vs converted loss and
    gradients on one step. A fused op that bypassed moe.experts.__call__ (FSDP's unshard hook)
    or mis-assigned expert shards would show here."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, StateDictOptions

    import torchtitan_megamoe.cpu as cpu
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.qwen3 import parallelize_qwen3, Qwen3Model

    from torchtitan_megamoe.converter import MegaMoEConverter
    from torchtitan_megamoe.moe import MegaExperts

    cpu.apply()  # this process only: device type cpu, histc, permute indices, gloo FSDP sums
    _init_gloo(rank, world, init_file)
    try:
        pd = ParallelDims(
            dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=world, etp=1, world_size=world
        )
        pd.build_mesh()
        args = tiny_args()
        full_sd = build_stock(args, seed=0).state_dict()

        def build(convert: bool):
            jc = job_config(converters=("megamoe",) if convert else ())
            jc.parallelism = dataclasses.replace(jc.parallelism, expert_parallel_degree=world)
            jc.training = dataclasses.replace(
                jc.training, seq_len=16, mixed_precision_param="float32"
            )
            # Converted: per-op SAC, with the fused op on the save list (not recomputed). Stock:
            # full AC (same numerics), because stock + per-op SAC + EP + FSDP trips torch
            # 2.13's SAC recompute check ("record_function_enter_new invocation index ... not
            # found in storage": FSDP's hooks on moe.experts run more record_function ops in
            # the recompute than in the forward). Ours trips it too when shared experts
            # follow the routed experts, hence Qwen3's num_shared_experts=0 here.
            ac = dict(mode="selective", selective_ac_option="op") if convert else dict(mode="full")
            jc.activation_checkpoint = dataclasses.replace(jc.activation_checkpoint, **ac)
            with torch.device("meta"):
                model = Qwen3Model(copy.deepcopy(args))
            if convert:
                MegaMoEConverter(jc, pd).convert(model)
            model = parallelize_qwen3(model, pd, jc)
            model.to_empty(device="cpu")
            with torch.no_grad():
                model.init_weights(buffer_device=torch.device("cpu"))
            set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True))
            return model

        stock, converted = build(False), build(True)
        assert any(isinstance(m, MegaExperts) for m in converted.modules())

        gen = torch.Generator().manual_seed(200 + rank)
        tokens = torch.randint(0, args.vocab_size, (2, 16), generator=gen)
        labels = torch.randint(0, args.vocab_size, (2, 16), generator=gen)
        results = {}
        for name, model in (("stock", stock), ("converted", converted)):
            logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
            results[name] = (loss.detach(), _grads(model))
        _check_close("loss", results["converted"][0], results["stock"][0], 1e-6)
        g_s, g_c = results["stock"][1], results["converted"][1]
        assert g_s.keys() == g_c.keys()
        for n in g_s:
            _check_close(f"grad {n}", g_c[n], g_s[n], 1e-5)
    finally:
        dist.destroy_process_group()


def ep_worker(rank: int, world: int, init_file: str) -> None:
    """Both EP checks in one spawn (process start-up and imports dominate their cost); the
    second applies the process-wide CPU shims, so it runs last."""
    ep_worker_experts_only(rank, world, init_file)
    ep_worker_parallelize_qwen3(rank, world, init_file + ".2")
