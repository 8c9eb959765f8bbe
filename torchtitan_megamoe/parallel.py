"""Expert-parallel wiring for ``MegaExperts``.

Stock expert parallelism (``torchtitan.distributed.expert_parallel.ExpertParallel``) does two
things to ``moe.experts``: it shards the weights ``Shard(0)`` on the ``ep`` mesh, and it installs
all-to-all dispatch/combine hooks around the experts' forward. The fused op does its own dispatch
and combine, so ``MegaExpertParallel`` keeps the sharding and drops the hooks.

Stock ``parallelize_*`` functions call ``apply_moe_ep_tp`` by its module-global name; the
converter replaces that name (``install_ep_routing``) with ``apply_moe_ep_tp_with_megamoe``,
which applies ``MegaExpertParallel`` to converted blocks and hands every unconverted block to
the stock function unchanged. Because the sharding (DTensor ``Shard(0)`` on ``ep``) is exactly
stock's, stock ``apply_fsdp`` (a separate FSDP unit on ``moe.experts`` over ``efsdp``, explicit
prefetch of ``moe.experts``) and ``apply_compile`` (which leaves ``experts`` uncompiled) work
unchanged.
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_module, distribute_tensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan_megamoe.moe import MegaExperts

# Modules whose parallelize function calls ``apply_moe_ep_tp`` through a module-global name.
# Missing ones (another TorchTitan version) are skipped.
_PARALLELIZE_MODULES = (
    "torchtitan.models.qwen3.infra.parallelize",
    "torchtitan.models.llama4.infra.parallelize",
    "torchtitan.models.deepseek_v3.infra.parallelize",
)


class MegaExpertParallel(ParallelStyle):
    """Shard ``MegaExperts`` weights on dim 0 (experts) over a 1-D ``ep`` mesh; no token hooks.

    ``ep`` rank r then holds global experts ``[r * E_local, (r + 1) * E_local)``, which is the
    ownership the fused op assumes for ``group = mesh.get_group("ep")``.
    """

    def _partition_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for param_name, param in module.named_parameters(recurse=False):
            dist_param = nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)]))
            module.register_parameter(param_name, dist_param)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, MegaExperts):
            raise TypeError(
                f"MegaExpertParallel applies to MegaExperts modules, got {type(module).__name__}."
            )
        if device_mesh.ndim != 1 or device_mesh.mesh_dim_names != ("ep",):
            raise ValueError(
                "MegaExpertParallel needs the 1-D 'ep' mesh (parallel_dims.get_mesh('ep')), got "
                f"mesh dims {device_mesh.mesh_dim_names}."
            )
        ep = device_mesh.size()
        if module.num_experts % ep != 0:
            raise ValueError(
                f"megamoe: {module.num_experts} experts cannot be split evenly over "
                f"expert_parallel_degree={ep}; choose a degree that divides the expert count."
            )
        return distribute_module(module, device_mesh, partition_fn=self._partition_fn)


def _mega_blocks(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """(blocks whose routed experts are MegaExperts, other MoE blocks) of ``model.layers``."""
    mega, stock = [], []
    layers = getattr(model, "layers", None)
    if layers is None:
        return mega, stock
    for block in layers.values():
        if block is None or not getattr(block, "moe_enabled", False):
            continue
        (mega if isinstance(block.moe.experts, MegaExperts) else stock).append(block)
    return mega, stock


def apply_megamoe_ep(blocks: list[nn.Module], ep_mesh: DeviceMesh) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    for block in blocks:
        parallelize_module(
            module=block.moe.experts,
            device_mesh=ep_mesh,
            parallelize_plan=MegaExpertParallel(),
        )


def apply_moe_ep_tp_with_megamoe(stock_fn: Callable) -> Callable:
    """Wrap a stock ``apply_moe_ep_tp``: converted blocks get ``MegaExpertParallel``; the stock
    function sees only unconverted blocks (converted ones are hidden from it for the call)."""

    @functools.wraps(stock_fn)
    def apply_moe_ep_tp(model: nn.Module, tp_mesh=None, ep_mesh=None, *args, **kwargs):
        mega, stock = _mega_blocks(model)
        if mega:
            etp_mesh = kwargs.get("etp_mesh", args[0] if args else None)
            if tp_mesh is not None or etp_mesh is not None:
                raise NotImplementedError(
                    "megamoe: tensor parallelism / expert tensor parallelism is not supported "
                    "for converted MoE blocks; set tensor_parallel_degree=1 and "
                    "expert_tensor_parallel_degree=1, or drop 'megamoe' from model.converters."
                )
            if ep_mesh is not None:
                apply_megamoe_ep(mega, ep_mesh)
        if stock:
            # Stock iterates model.layers and skips blocks with moe_enabled=False.
            for b in mega:
                b.moe_enabled = False
            try:
                stock_fn(model, tp_mesh, ep_mesh, *args, **kwargs)
            finally:
                for b in mega:
                    b.moe_enabled = True
        elif not mega:
            stock_fn(model, tp_mesh, ep_mesh, *args, **kwargs)

    apply_moe_ep_tp._megamoe_stock = stock_fn  # type: ignore[attr-defined]
    return apply_moe_ep_tp


def install_ep_routing() -> list[str]:
    """Route stock ``apply_moe_ep_tp`` calls through ``apply_moe_ep_tp_with_megamoe``.

    Idempotent (an already wrapped name is left alone). Returns the module names patched now.
    """
    patched = []
    for mod_name in _PARALLELIZE_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        fn = getattr(mod, "apply_moe_ep_tp", None)
        if fn is None or hasattr(fn, "_megamoe_stock"):
            continue
        mod.apply_moe_ep_tp = apply_moe_ep_tp_with_megamoe(fn)
        patched.append(mod_name)
    return patched
