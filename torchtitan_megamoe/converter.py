"""The ``megamoe`` model converter: swaps every stock MoE block for ``MegaMoE``.

TorchTitan builds the model on the meta device, runs ``convert(model)``, then parallelizes
(TP -> EP -> AC -> compile -> FSDP), materializes (``to_empty``) and calls ``init_weights``. The
swap therefore reuses the stock block's (meta) Parameters, buffers and submodules: nothing is
allocated, and names, dtypes and init order stay stock's, so checkpoints interchange both ways.

Everything the fused path does not support is rejected here, before any device work, with an
error naming the setting and what to change.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.models.moe.moe import GroupedExperts, MoE
from torchtitan.protocols.model_converter import register_model_converter
from torchtitan.tools.logging import logger

from torchtitan_megamoe import fp8_allgather
from torchtitan_megamoe.moe import MegaExperts, MegaMoE
from torchtitan_megamoe.ops.api import check_args
from torchtitan_megamoe.ops.device import hopper_present
from torchtitan_megamoe.ops.options import MegaMoEOptions
from torchtitan_megamoe.ops.shapes import shape_error
from torchtitan_megamoe.parallel import install_ep_routing
from torchtitan_megamoe.settings import MegaMoEConfig


# Modules holding a module-level ``_op_sac_save_list`` used by their parallelize function.
_SAC_LIST_MODULES = (
    "torchtitan.models.qwen3.infra.parallelize",
    "torchtitan.models.llama4.infra.parallelize",
    "torchtitan.models.deepseek_v3.infra.parallelize",
)


def resolve_save_activations(cfg: MegaMoEConfig, job_config: JobConfig) -> str:
    """The op's save mode for this job: ``auto`` is ``never`` under per-op selective AC (where
    stock TorchTitan keeps no expert activations, so keeping ours would raise the peak above
    stock's), else ``keep``; an explicit ``keep`` / ``never`` is taken as is."""
    if cfg.save_activations != "auto":
        return cfg.save_activations
    ac = getattr(job_config, "activation_checkpoint", None)
    per_op_sac = (ac is not None and ac.mode == "selective"
                  and str(ac.selective_ac_option) == "op")
    if per_op_sac:
        logger.info("megamoe: save_activations='auto' -> 'never' under per-op selective AC "
                    "(GEMM 1 runs again in the backward; 'keep' trades memory for speed)")
        return "never"
    return "keep"


def build_options(cfg: MegaMoEConfig, job_config: JobConfig) -> MegaMoEOptions:
    """The op's options for this job, built once at conversion: each options field from the
    ``[megamoe]`` field of its name, checked again (fields may have been assigned after the
    section was built), ``save_activations='auto'`` resolved."""
    cfg.validate()
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(MegaMoEOptions)}
    values["save_activations"] = resolve_save_activations(cfg, job_config)
    return MegaMoEOptions(**values)


def _degrees(job_config: JobConfig, parallel_dims: ParallelDims | None) -> dict[str, int]:
    if parallel_dims is not None:
        return {
            "tp": parallel_dims.tp,
            "etp": parallel_dims.etp,
            "pp": parallel_dims.pp,
            "cp": parallel_dims.cp,
            "ep": parallel_dims.ep,
        }
    p = job_config.parallelism
    return {
        "tp": p.tensor_parallel_degree,
        "etp": p.expert_tensor_parallel_degree,
        "pp": p.pipeline_parallel_degree,
        "cp": p.context_parallel_degree,
        "ep": p.expert_parallel_degree,
    }


def _fsdp_degree(job_config: JobConfig, parallel_dims: ParallelDims | None) -> int:
    """Over how many ranks FSDP shards each routed expert weight at EP=1 (1: not sharded)."""
    if parallel_dims is not None:
        return parallel_dims.dp_shard * parallel_dims.cp if parallel_dims.fsdp_enabled else 1
    p = job_config.parallelism
    if p.data_parallel_shard_degree != -1:
        return max(p.data_parallel_shard_degree, 1)
    # -1: the ranks left over by the other degrees
    rest = (max(p.data_parallel_replicate_degree, 1) * p.tensor_parallel_degree
            * p.pipeline_parallel_degree * p.context_parallel_degree)
    return max(int(os.environ.get("WORLD_SIZE", "1")) // rest, 1)


def fp8_allgather_applies(options: MegaMoEOptions, num_experts: int, fsdp_degree: int,
                          ep_degree: int) -> str | None:
    """Why FSDP cannot gather this model's expert weights as FP8 (fp8_allgather.py), or None
    if it can: a recipe that reads the weights only through their FP8 copies (``fp8``) with the
    weight cache, on the Hopper kernels, FSDP sharding each rank's whole experts evenly (at
    EP > 1 over the ranks EP leaves, TorchTitan's efsdp mesh: one rank on one node at EP=8,
    where the "gather" hands the rank its own FP8 copies, made once per optimizer step)."""
    if not options.recipe.stand_ins or not options.fp8_weight_cache:
        return "it serves precision 'fp8' with fp8_weight_cache on"
    if ep_degree <= 1 and fsdp_degree <= 1:
        return "FSDP does not shard the experts"
    local, efsdp = num_experts // max(ep_degree, 1), max(fsdp_degree // max(ep_degree, 1), 1)
    if local % efsdp:
        return (f"the {local} experts of a rank are not divisible by the experts' FSDP degree "
                f"{efsdp} (FSDP would pad the shards)")
    if options.backend == "reference" or (options.backend == "auto" and not hopper_present()):
        return "the reference backend emulates FP8 from the bf16 weights"
    return None


def validate_job(job_config: JobConfig, parallel_dims: ParallelDims | None,
                 options: MegaMoEOptions) -> None:
    """Reject parallelism and converter combinations the fused path does not support."""
    d = _degrees(job_config, parallel_dims)
    if d["tp"] > 1:
        raise NotImplementedError(
            f"megamoe: tensor_parallel_degree={d['tp']} is not supported (the MoE input would "
            "be replicated over TP ranks and the experts TP-sharded). Set "
            "parallelism.tensor_parallel_degree=1 (use FSDP/EP instead), or drop 'megamoe' "
            "from model.converters."
        )
    if d["etp"] > 1:
        raise NotImplementedError(
            f"megamoe: expert_tensor_parallel_degree={d['etp']} is not supported (experts are "
            "only split whole over EP ranks). Set parallelism.expert_tensor_parallel_degree=1."
        )
    if d["pp"] > 1:
        raise NotImplementedError(
            f"megamoe: pipeline_parallel_degree={d['pp']} is not supported yet (not validated "
            "with the fused op). Set parallelism.pipeline_parallel_degree=1 or drop 'megamoe'."
        )
    if d["cp"] > 1:
        raise NotImplementedError(
            f"megamoe: context_parallel_degree={d['cp']} is not supported yet (not validated "
            "with the fused op). Set parallelism.context_parallel_degree=1 or drop 'megamoe'."
        )
    if job_config.parallelism.expert_parallel_comm_backend != "standard":
        raise NotImplementedError(
            "megamoe: parallelism.expert_parallel_comm_backend="
            f"{job_config.parallelism.expert_parallel_comm_backend!r} (DeepEP MoE) cannot be "
            "combined with the fused op, which does its own dispatch/combine. Set it to "
            "'standard'."
        )
    for name in job_config.model.converters:
        if name.startswith("quantize.grouped_mm"):
            raise NotImplementedError(
                f"megamoe: model.converters contains {name!r}, which replaces the experts' "
                "grouped GEMMs that megamoe fuses. Remove it and use [megamoe] precision "
                "('fp8' / 'fp8_bwd') for low-precision experts."
            )


def validate_moe(
    fqn: str, moe: nn.Module, options: MegaMoEOptions, ep_degree: int = 1
) -> None:
    """Reject an MoE block the fused op cannot compute exactly like stock."""
    where = f"megamoe: MoE block '{fqn}'"
    if type(moe) is not MoE:
        raise NotImplementedError(
            f"{where} is a {type(moe).__name__}, not a stock torchtitan MoE (DeepEP MoE and "
            "other MoE variants are not supported). Use moe_impl / expert_parallel_comm_backend "
            "'standard', or drop 'megamoe' from model.converters."
        )
    if moe.score_before_experts:
        raise NotImplementedError(
            f"{where} has score_before_experts=True; the fused op applies routing weights to "
            "the expert outputs (score_before_experts=False, as in Qwen3). Set "
            "moe_args.score_before_experts=False or drop 'megamoe' from model.converters."
        )
    experts = moe.experts
    if type(experts) is not GroupedExperts:
        raise NotImplementedError(
            f"{where} has experts of type {type(experts).__name__}; only stock GroupedExperts "
            "(SwiGLU: w2 @ (silu(w1 x) * w3 x)) is supported. Apply 'megamoe' before any "
            "converter that replaces the experts, or drop it."
        )
    # the op's own argument checks (expert layout, FP8 block size), on zero-token stand-ins of
    # this block's inputs: nothing is allocated, and what the op would refuse fails here
    w1 = experts.w1
    e, h, dim = w1.shape
    x = torch.empty((0, dim), dtype=w1.dtype, device=w1.device)
    ids = torch.empty((0, moe.router.top_k), dtype=torch.int64, device=w1.device)
    try:
        check_args(x, ids, ids.to(torch.float32), w1, experts.w2, experts.w3,
                   precision=options.precision)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{where} (dim={dim}, moe_inter_dim={h}): {err}") from None
    if e % ep_degree != 0:
        raise ValueError(
            f"{where}: num_experts={e} is not divisible by expert_parallel_degree={ep_degree}; "
            "choose an EP degree that divides the expert count."
        )
    if options.backend == "hopper":
        problem = shape_error(dim, h, options.recipe, "hopper")
        if problem is not None:
            raise ValueError(
                f"{where}: backend='hopper' cannot run this shape: {problem}. Use "
                "[megamoe] backend='auto' or 'reference', or change the model shape."
            )


def add_op_to_sac_save_list() -> bool:
    """Put the fused op in the per-op selective-AC save lists, so recompute does not repeat
    its communication. No-op (False) if the op is not registered."""
    import importlib

    try:
        op = torch.ops.megamoe.mega_moe.default
    except (AttributeError, RuntimeError):
        return False
    for mod_name in _SAC_LIST_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        save_list = getattr(mod, "_op_sac_save_list", None)
        if isinstance(save_list, set):
            save_list.add(op)
    return True


def convert_moe_blocks(
    model: nn.Module, options: MegaMoEOptions, ep_degree: int = 1
) -> list[str]:
    """Validate every stock MoE block of ``model``, then swap each for ``MegaMoE`` in place.
    Already converted blocks are left alone. Returns the converted module names."""
    found = [
        (fqn, m)
        for fqn, m in model.named_modules()
        if isinstance(m, MoE) and not isinstance(m, MegaMoE)
    ]
    for fqn, m in found:
        validate_moe(fqn, m, options, ep_degree)
    for fqn, m in found:
        if not fqn:
            raise ValueError("megamoe: convert() needs a model containing MoE blocks, not an MoE.")
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(
            parent,
            child,
            MegaMoE.from_moe(m, options=options),
        )
    return [fqn for fqn, _ in found]


class MegaMoEConverter:
    """ModelConverter ``megamoe`` (``[model] converters = ["megamoe"]``)."""

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims):
        cfg = getattr(job_config, "megamoe", None)
        if cfg is None:
            logger.warning(
                "megamoe: job config has no [megamoe] section (set [job] custom_config_module = "
                "'torchtitan_megamoe.config'); using the defaults."
            )
            cfg = MegaMoEConfig()
        self.options = build_options(cfg, job_config)
        validate_job(job_config, parallel_dims, self.options)
        self.ep_degree = _degrees(job_config, parallel_dims)["ep"]
        self.fsdp_degree = _fsdp_degree(job_config, parallel_dims)

    def convert(self, model: nn.Module) -> None:
        converted = convert_moe_blocks(model, self.options, self.ep_degree)
        if not any(isinstance(m, MegaMoE) for m in model.modules()):
            raise ValueError(
                "megamoe: the model has no torchtitan MoE blocks to convert (is it an MoE "
                "flavor, e.g. qwen3 '30B-A3B'?). Drop 'megamoe' from model.converters."
            )
        if self.options.backend == "auto":
            shapes = {
                (m.experts.w1.shape[2], m.experts.w1.shape[1])
                for m in model.modules()
                if isinstance(m, MegaMoE)
            }
            for dim, hidden in sorted(shapes):
                problem = shape_error(dim, hidden, self.options.recipe, "hopper")
                if problem is not None:
                    logger.warning(
                        f"megamoe: backend='auto' will use the slow PyTorch reference on GPUs "
                        f"too for this model: {problem}."
                    )
        self._install_fp8_allgather(model)
        if copies_made_ahead(self.options):
            model.register_forward_pre_hook(make_weight_copies_ahead)
        install_ep_routing()
        add_op_to_sac_save_list()
        logger.info(
            f"megamoe: converted {len(converted)} MoE blocks ("
            + ", ".join(f"{k}={v}" for k, v in self.options.as_kwargs().items())
            + f", ep={self.ep_degree})"
        )

    def _install_fp8_allgather(self, model: nn.Module) -> None:
        """Under FSDP with precision fp8, have FSDP gather the experts' FP8 copies
        (fp8_allgather.py); where it cannot, say so: those weights are gathered in bf16 and
        quantized on every call."""
        # at EP > 1 FSDP wraps the experts over the ranks EP leaves (TorchTitan's efsdp mesh),
        # one rank included: there the "gather" hands each rank its own per-step FP8 copies
        if not self.options.recipe.fp8 or (self.ep_degree <= 1 and self.fsdp_degree <= 1):
            return
        blocks = [m for m in model.modules() if isinstance(m, MegaMoE)]
        for moe in blocks:
            why = fp8_allgather_applies(self.options, moe.experts.num_experts,
                                        self.fsdp_degree, self.ep_degree)
            if why is not None:
                logger.warning(
                    "megamoe: under FSDP the expert weights are gathered in bf16 and quantized "
                    f"to FP8 on every call ({why}); the FP8 all-gather needs precision 'fp8', "
                    "fp8_weight_cache=true, the hopper backend and experts divisible by the "
                    "FSDP degree.")
                return
            fp8_allgather.install(moe.experts)
        logger.info(f"megamoe: FSDP gathers the expert weights as FP8 ({len(blocks)} blocks)")

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        # new weights: each layer re-makes its FP8 copies (fp8_weight_cache) here, once per
        # optimizer step, so the next step's forward and backward quantize nothing, and frees
        # its bf16 casts (bf16_weight_cache), which the next forward makes
        refresh_weight_copies(model)


def copies_made_ahead(options) -> bool:
    """Whether the layers make weight copies at the start of each training forward (the
    model pre-hook): FP8 copies freed after each backward, or bf16 casts (a bf16 forward:
    where they apply at all is each layer's call, MegaExperts._casts_apply)."""
    fp8 = options.recipe.fp8 and options.fp8_weight_cache and options.fp8_free_after_backward
    return fp8 or (options.bf16_weight_cache and not options.recipe.fp8_forward)


def make_weight_copies_ahead(model: nn.Module, _args) -> None:
    """A training forward's pre-hook on the model (copies freed after each layer's backward):
    every layer makes its weight copies (FP8, bf16 casts) before the first layer runs, their
    launches queued behind the last step's optimizer, not at each layer's call, where the
    host-bound forward's GPU would wait for them. The step's peak, at the end of the forward,
    holds every layer's copies either way."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return
    experts = model.__dict__.get("_megamoe_experts")
    if experts is None:  # found once, in this module (a pipeline stage holds some layers)
        experts = [m for m in model.modules() if isinstance(m, MegaExperts)]
        model.__dict__["_megamoe_experts"] = experts
    for m in experts:
        m.make_weight_copies_ahead()


def refresh_weight_copies(model: nn.Module | list[nn.Module]) -> int:
    """Have every MegaExperts of ``model`` (or of each model part) re-make the FP8 copies it
    holds and free its bf16 casts (MegaExperts.refresh_weight_copies); returns how many
    modules were asked."""
    parts = model if isinstance(model, (list, tuple)) else [model]
    asked = 0
    for part in parts:
        for m in part.modules():
            if isinstance(m, MegaExperts):
                m.refresh_weight_copies()
                asked += 1
    return asked


def _register() -> None:
    from torchtitan.protocols import model_converter

    # Registration asserts on duplicates; a module reload must not break it.
    if model_converter._registry_model_converter_cls.get("megamoe") is not MegaMoEConverter:
        model_converter._registry_model_converter_cls.pop("megamoe", None)
        register_model_converter(MegaMoEConverter, "megamoe")


_register()
