"""``mega_moe``: the public functional op, its argument checks and its torch.library registration.

The op is registered as ``torch.ops.megamoe.mega_moe`` (forward) and
``torch.ops.megamoe.mega_moe_backward`` so that torch.compile and selective activation
checkpointing see one opaque op each, not a graph of collectives and GEMMs.

    megamoe::mega_moe(x, topk_ids, topk_weights, w1, w2, w3, group_name, backend, precision)
        -> (Tensor out, Tensor[] saved)
    megamoe::mega_moe_backward(grad_out, x, topk_ids, topk_weights, w1, w2, w3, Tensor[] saved,
                               group_name, backend, precision) -> (dx, dtw, dw1, dw2, dw3)

``saved`` is whatever the backend keeps from its forward for its backward (Triton EP=1: GEMM 1's
pre-activations and the packed plan; reference and Triton EP > 1: nothing, they recompute). It is
an output of the forward op so that selective activation checkpointing with the op in its save
list keeps it (no recompute of the op), while full AC recomputes the forward and holds it only
during that layer's backward. Autograd saves the inputs and ``saved`` (non-differentiable, never
given a gradient). The public ``mega_moe()`` returns ``out`` only. Calls that nothing but
autograd sees (plain eager: no compile, no dispatch mode such as selective AC's, plain tensors)
run the same forward and backward functions as an autograd Function (_EagerMegaMoE) without
the custom op's per-call wrapping.

Backends are modules with
    forward(x, topk_ids, topk_weights, w1, w2, w3, group, precision, save=False)
        -> out, or (out, list[Tensor]) with save=True
    saved_like(x, topk_ids, topk_weights, w1, w2, w3, group, precision) -> list[Tensor]
        (empty tensors of forward's saved shapes/dtypes: the fake impl; static in T, K, E, H)
    backward(grad_out, x, topk_ids, topk_weights, w1, w2, w3, group, precision, saved=None)
        (saved None or empty: recompute)
"""

from __future__ import annotations

import contextlib
import importlib
import warnings

import torch
import torch.distributed as dist

from torchtitan_megamoe.ops.device import capability
from torchtitan_megamoe.ops.options import MegaMoEOptions

BACKENDS = ("auto", "hopper", "reference")
BACKEND_ALIASES = {"triton": "hopper"}
"""Former backend names, still accepted (with a warning naming the new one)."""
PRECISIONS = ("bf16", "fp8", "fp8_bwd")
SAVE_MODES = ("keep", "never")

_SAVE_ACTIVATIONS = "keep"


def set_save_activations(mode: str) -> None:
    """``keep``: backends keep what their backward can reuse (the hopper backend: GEMM 1's
    pre-activations, when no larger than stock's saved activations); ``never``: keep nothing,
    the backward recomputes (less memory, more time). Set by the converter from ``[megamoe]
    save_activations`` (config.py, whose ``auto`` picks one of the two)."""
    global _SAVE_ACTIVATIONS
    if mode not in SAVE_MODES:
        raise ValueError(
            f"save_activations={mode!r} is not one of {', '.join(SAVE_MODES)}"
        )
    _SAVE_ACTIVATIONS = mode

_BACKEND_MODULES = {
    "reference": "torchtitan_megamoe.ops.reference",
    "hopper": "torchtitan_megamoe.ops.hopper",
}


def mega_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    backend: str = "auto",
    precision: str = "bf16",
) -> torch.Tensor:
    """Fused MoE layer: dispatch, expert SwiGLU MLPs, weighted combine.

    ``out[t] = sum_k topk_weights[t,k] * w2[e] @ (silu(w1[e] @ x[t]) * (w3[e] @ x[t]))`` with
    ``e = topk_ids[t,k]`` (``-1`` drops the slot), fp32 accumulation, ``out`` in ``x.dtype``.
    Under ``torch.autocast``, x and the weights are first cast to the autocast dtype (as for a
    matmul), which is then out's dtype.

    Args:
        x: ``[T, D]`` tokens of this rank.
        topk_ids: ``[T, K]`` integer global expert ids in ``[-1, E_local * group_size)``.
        topk_weights: ``[T, K]`` floating routing weights.
        w1, w3: ``[E_local, H, D]``; w2: ``[E_local, D, H]`` (TorchTitan GroupedExperts layout).
        group: expert-parallel process group; rank ``r`` owns global experts
            ``[r * E_local, (r + 1) * E_local)``. Every rank of the group must call the op.
            ``None``: one rank owns all experts.
        backend: ``auto`` (the Hopper kernels on SM90 GPUs, else reference), ``hopper`` or
            ``reference`` (``triton``, the former name of ``hopper``, is still accepted).
        precision: ``bf16``, ``fp8`` (blockwise FP8 forward and backward) or ``fp8_bwd``
            (BF16 forward, FP8 backward).
    """
    if torch.is_autocast_enabled(x.device.type):
        # Autocast does not reach a custom op. TorchTitan trains under it on one device and
        # under DDP (FSDP casts the parameters instead), so do what it does for a matmul: x and
        # the weights in its dtype (the casts are differentiable: fp32 parameters get fp32
        # gradients), out in that dtype; the op's own math runs with autocast off
        # (_autocast_off).
        amp_dtype = torch.get_autocast_dtype(x.device.type)
        x, w1, w2, w3 = (t.to(amp_dtype) if t.is_floating_point() else t for t in (x, w1, w2, w3))
    check_args(x, topk_ids, topk_weights, w1, w2, w3, group=group, precision=precision)
    backend = resolve_backend(backend, x, group)
    # The Triton forward checks the ids on CUDA inside its first kernels (EP=1: the plan's
    # count kernels, EP > 1: the route kernel), one device assert instead of six launches
    # before the layer's first kernel, host time a waited call pays; other paths check here.
    if not (backend == "hopper" and x.is_cuda):
        _check_ids(topk_ids, w1.shape[0] * group_size(group), group)
    group_name = "" if group is None else group.group_name
    # Keep activations for a backward only when one can follow: inference and no_grad
    # evaluation skip the extra stores (and their memory); save_activations="never" opts out.
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x, topk_weights, w1, w2, w3))
    save = _SAVE_ACTIVATIONS != "never" and needs_grad
    args = (x, topk_ids, topk_weights, w1, w2, w3, group_name, backend, precision, save)
    if _plain_eager(args[:6]):
        # no gradient can flow (inference, no_grad, full AC's first forward): not even an
        # autograd Function, whose apply costs host time before the layer's first kernel
        # (tools/op_overhead.py: ~12 us per no_grad call on this project's CPU)
        return _EagerMegaMoE.apply(*args) if needs_grad else _forward_only(*args)
    out, _saved = torch.ops.megamoe.mega_moe(*args)
    return out


def _plain_eager(tensors) -> bool:
    """Nothing but autograd sees this call: no compile or export trace, no dispatch or
    torch-function mode (selective AC's policy is one), no functorch transform, no tensor
    subclass (DTensor, FakeTensor). Only then may the call skip the registered op."""
    return (
        not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
        and not torch._C._is_torch_function_mode_enabled()
        and not torch._C._are_functorch_transforms_active()
        and all(type(t) is torch.Tensor or type(t) is torch.nn.Parameter for t in tensors)
    )


def canonical_backend(backend: str) -> str:
    """``backend`` with a former name mapped to today's (warning once per name)."""
    if backend in BACKEND_ALIASES:
        new = BACKEND_ALIASES[backend]
        if backend not in _WARNED_ALIASES:
            _WARNED_ALIASES.add(backend)
            warnings.warn(
                f"mega_moe: backend={backend!r} is now called {new!r}; {backend!r} still works "
                f"but will be removed, write backend={new!r}",
                FutureWarning, stacklevel=3,
            )
        return new
    return backend


_WARNED_ALIASES: set[str] = set()


def resolve_backend(backend: str, x: torch.Tensor, group: dist.ProcessGroup | None) -> str:
    backend = canonical_backend(backend)
    if backend not in BACKENDS:
        raise ValueError(
            f"mega_moe: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}"
        )
    if backend != "auto":
        return backend
    if x.is_cuda and capability(x.device) == (9, 0):
        if backend_module("hopper").supports(x, group):
            return "hopper"
    return "reference"


def backend_module(name: str):
    return importlib.import_module(_BACKEND_MODULES[name])


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def check_args(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    precision: str = "bf16",
) -> None:
    """Raise early, with the fix in the message, on anything the op cannot compute correctly
    (the id range apart: mega_moe checks it where its backend's kernels do not)."""
    if precision not in PRECISIONS:
        raise ValueError(
            f"mega_moe: unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}"
        )
    if x.dim() != 2:
        raise ValueError(
            f"mega_moe: x must be [tokens, dim], got shape {tuple(x.shape)}; "
            "flatten batch and sequence first (x.view(-1, dim))"
        )
    if not x.is_floating_point():
        raise TypeError(f"mega_moe: x must be a floating tensor, got {x.dtype}")
    T, D = x.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(
            f"mega_moe: topk_ids must be [tokens={T}, top_k], got shape {tuple(topk_ids.shape)}"
        )
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"mega_moe: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"mega_moe: topk_weights shape {tuple(topk_weights.shape)} must equal topk_ids "
            f"shape {tuple(topk_ids.shape)}"
        )
    if not topk_weights.is_floating_point():
        raise TypeError(f"mega_moe: topk_weights must be floating, got {topk_weights.dtype}")
    for name, w in (("w1", w1), ("w2", w2), ("w3", w3)):
        if w.dim() != 3:
            raise ValueError(
                f"mega_moe: {name} must be 3-D [experts, ...], got shape {tuple(w.shape)}"
            )
        if w.dtype != x.dtype:
            raise TypeError(
                f"mega_moe: {name} dtype {w.dtype} differs from x dtype {x.dtype}; cast them to "
                "one dtype (TorchTitan's mixed precision, FSDP or autocast, does this for you)"
            )
    E, H, D1 = w1.shape
    if D1 != D:
        raise ValueError(f"mega_moe: w1 is [E, H, D={D1}] but x has dim {D}")
    if tuple(w3.shape) != (E, H, D):
        raise ValueError(f"mega_moe: w3 shape {tuple(w3.shape)} must equal w1 shape {(E, H, D)}")
    if tuple(w2.shape) != (E, D, H):
        raise ValueError(
            f"mega_moe: w2 shape {tuple(w2.shape)} must be [E, D, H] = {(E, D, H)} "
            "(TorchTitan GroupedExperts layout)"
        )
    devices = {t.device for t in (x, topk_ids, topk_weights, w1, w2, w3)}
    if len(devices) != 1:
        raise ValueError(f"mega_moe: all tensors must be on one device, got {sorted(map(str, devices))}")
    if precision in ("fp8", "fp8_bwd") and (D % 128 or H % 128):
        raise ValueError(
            f"mega_moe: precision={precision!r} uses 128-wide scaling blocks and needs dim and "
            f"hidden % 128 == 0, got dim={D}, hidden={H}; use precision='bf16'"
        )


def ids_range_message(num_experts: int, ep_size: int) -> str:
    return (
        f"mega_moe: topk_ids must lie in [-1, {num_experts}) (-1 drops a slot; "
        f"{num_experts} = local experts x group size {ep_size})"
    )


def _check_ids(topk_ids: torch.Tensor, num_experts: int, group) -> None:
    if topk_ids.numel() == 0:
        return
    bad = (topk_ids < -1) | (topk_ids >= num_experts)
    msg = ids_range_message(num_experts, group_size(group))
    if topk_ids.is_cuda or torch.compiler.is_compiling():
        # A host-side check would sync the stream every layer (and break a compiled graph);
        # the async assert fails on the device instead, with this message.
        torch._assert_async(~bad.any(), msg)
    elif bool(bad.any()):
        first = topk_ids[bad][:4].tolist()
        raise ValueError(f"{msg}; got e.g. {first}")


# --------------------------------------------------------------------------- torch.library


def _group_from_name(group_name: str):
    if not group_name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _autocast_off(device_type: str):
    """The backends' math keeps its own dtypes: autocast off wherever the op runs inside it
    (eager, a compiled graph, a backward: full AC's recompute restores the forward's autocast
    state); mega_moe() has already cast x and the weights."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _options(backend: str, precision: str) -> MegaMoEOptions:
    return MegaMoEOptions(backend=backend, precision=precision)


def _run_forward(x, topk_ids, topk_weights, w1, w2, w3, group_name, backend, precision, save):
    """(out, saved list): the backend's forward, for the registered op and the eager path."""
    impl = backend_module(backend)
    group = _group_from_name(group_name)
    with _autocast_off(x.device.type):
        if not save:
            return impl.forward(x, topk_ids, topk_weights, w1, w2, w3, group,
                                _options(backend, precision)), []
        out, saved = impl.forward(x, topk_ids, topk_weights, w1, w2, w3, group,
                                  _options(backend, precision), save=True)
    return out, list(saved)


def _run_backward(grad_out, x, topk_ids, topk_weights, w1, w2, w3, saved, group_name, backend,
                  precision):
    """(dx, dtopk_weights, dw1, dw2, dw3): the backend's backward (recomputing when ``saved``
    is empty), for the registered op and the eager path."""
    with _autocast_off(x.device.type):
        grads = backend_module(backend).backward(
            grad_out.contiguous(), x, topk_ids, topk_weights, w1, w2, w3,
            _group_from_name(group_name), _options(backend, precision),
            saved=list(saved) or None,
        )
    return tuple(g.contiguous() for g in grads)


@torch.library.custom_op("megamoe::mega_moe", mutates_args=())
def _mega_moe_op(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    group_name: str,
    backend: str,
    precision: str,
    save: bool,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return _run_forward(x, topk_ids, topk_weights, w1, w2, w3, group_name, backend, precision,
                        save)


@_mega_moe_op.register_fake
def _mega_moe_fake(x, topk_ids, topk_weights, w1, w2, w3, group_name, backend, precision,
                   save):
    if not save:
        return torch.empty_like(x), []
    saved = backend_module(backend).saved_like(
        x, topk_ids, topk_weights, w1, w2, w3, _group_from_name(group_name),
        _options(backend, precision)
    )
    return torch.empty_like(x), saved


@torch.library.custom_op("megamoe::mega_moe_backward", mutates_args=())
def _mega_moe_backward_op(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    saved: list[torch.Tensor],
    group_name: str,
    backend: str,
    precision: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _run_backward(grad_out, x, topk_ids, topk_weights, w1, w2, w3, saved, group_name,
                         backend, precision)


@_mega_moe_backward_op.register_fake
def _mega_moe_backward_fake(
    grad_out, x, topk_ids, topk_weights, w1, w2, w3, saved, group_name, backend, precision
):
    return (
        torch.empty_like(x),
        torch.empty_like(topk_weights),
        torch.empty_like(w1),
        torch.empty_like(w2),
        torch.empty_like(w3),
    )


def _setup_context(ctx, inputs, output):
    x, topk_ids, topk_weights, w1, w2, w3, group_name, backend, precision, _save = inputs
    _out, saved = output
    ctx.mark_non_differentiable(*saved)
    # Gradients of the saved outputs are never used: do not let autograd allocate zeros for them
    # (a is as an activation).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, topk_ids, topk_weights, w1, w2, w3, *saved)
    ctx.config = (group_name, backend, precision)


def _backward(ctx, grad_out, _grad_saved):
    x, topk_ids, topk_weights, w1, w2, w3, *saved = ctx.saved_tensors
    if grad_out is None:  # out itself was unused (grads are not materialized)
        grad_out = torch.zeros_like(x)
    dx, dweights, dw1, dw2, dw3 = torch.ops.megamoe.mega_moe_backward(
        grad_out, x, topk_ids, topk_weights, w1, w2, w3, saved, *ctx.config
    )
    return dx, None, dweights, dw1, dw2, dw3, None, None, None, None


_mega_moe_op.register_autograd(_backward, setup_context=_setup_context)


def _forward_only(*args):
    """A plain eager call that no gradient can flow through: the op's forward, nothing else."""
    return _run_forward(*args)[0]


class _EagerMegaMoE(torch.autograd.Function):
    """The registered op's forward and backward (_run_forward, _run_backward) as a plain
    autograd Function, for calls that nothing but autograd sees (_plain_eager): torch.library's
    per-call wrapping of a custom op (argument re-packing, tensor-list pytrees, output alias
    checks) cost 0.24 ms of host time per forward with autograd and 0.57 ms per forward +
    backward on the H200 machines' host (tools/op_overhead.py; docs/PERF.md at 5e0bafa), before the
    layer's first kernel. Same saved tensors, same gradients (bit for
    bit: the same functions run); compile, export, selective AC and tensor subclasses keep the
    registered op, which they need to see."""

    @staticmethod
    def forward(ctx, x, topk_ids, topk_weights, w1, w2, w3, group_name, backend, precision,
                save):
        out, saved = _run_forward(x, topk_ids, topk_weights, w1, w2, w3, group_name, backend,
                                  precision, save)
        ctx.save_for_backward(x, topk_ids, topk_weights, w1, w2, w3, *saved)
        ctx.config = (group_name, backend, precision)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, topk_ids, topk_weights, w1, w2, w3, *saved = ctx.saved_tensors
        args = (grad_out, x, topk_ids, topk_weights, w1, w2, w3, saved, *ctx.config)
        if _plain_eager((grad_out, x)):
            grads = _run_backward(*args)
        else:
            grads = torch.ops.megamoe.mega_moe_backward(*args)
        dx, dweights, dw1, dw2, dw3 = grads
        return dx, None, dweights, dw1, dw2, dw3, None, None, None, None
