"""``mega_moe``: the public functional op, its argument checks and its torch.library registration.

The op is registered as ``torch.ops.megamoe.mega_moe`` (forward) and
``torch.ops.megamoe.mega_moe_backward`` so that torch.compile and selective activation
checkpointing see one opaque op each, not a graph of collectives and GEMMs. Both schemas end
with the fields of ``MegaMoEOptions`` (ops/options.py), in its order, as typed arguments:

    megamoe::mega_moe(x, topk_ids, topk_weights, w1, w2, w3, Tensor?[] fp8_weights,
                      Tensor[] weight_casts, bool save, str group_name, <options>)
        -> (Tensor out, Tensor[] saved)
    megamoe::mega_moe_backward(grad_out, x, topk_ids, topk_weights, w1, w2, w3,
                               Tensor?[] fp8_weights, Tensor[] saved, str group_name, <options>)
        -> (dx, dtopk_weights, dw1, dw2, dw3)
    <options> = str backend, str precision, str save_activations, int max_tokens_per_rank,
                bool fp8_weight_cache, ...   (every field: options.op_schema())

mega_moe() takes the same fields as keyword arguments (its signature and docstring are built
from them).

``fp8_weights``: the layer's FP8 weight copies as their owner made them
(ops/fp8_weights.Fp8Weights.tensors(): 10 slots, None where a part is not held), or an
empty list; the hopper backend's FP8 stages read them instead of quantizing the weights. With
them, a recipe whose ``stand_ins`` hold (``fp8``) reads nothing of w1, w2, w3 but their shapes
(moe.MegaExperts then passes zero-stride stand-ins that carry the weights' gradients).
``weight_casts``: the bf16 casts of fp32 weights as their owner made them, or an empty list;
the hopper bf16 forward takes them instead of casting (and saves them: the backward op gets
them in ``saved``).

``saved`` is whatever the backend keeps from its forward for its backward (hopper EP=1: GEMM 1's
pre-activations and the packed plan; reference: nothing, it recomputes). It is an output of the
forward op so that selective activation checkpointing with the op in its save list keeps it (no
recompute of the op), while full AC recomputes the forward and holds it only during that layer's
backward. Autograd saves the inputs and ``saved`` (non-differentiable, never given a gradient).
The public ``mega_moe()`` returns ``out`` only. Calls that nothing but autograd sees (plain
eager: no compile, no dispatch mode such as selective AC's, plain tensors) run the same forward
and backward functions as an autograd Function (_EagerMegaMoE), which carries the options object
itself, without the custom op's per-call wrapping.

Backends are modules with
    forward(x, topk_ids, topk_weights, w1, w2, w3, group, options, save=False)
        -> out, or (out, list[Tensor]) with save=True
    saved_like(x, topk_ids, topk_weights, w1, w2, w3, group, options) -> list[Tensor]
        (empty tensors of forward's saved shapes/dtypes: the fake impl; static in T, K, E, H)
    backward(grad_out, x, topk_ids, topk_weights, w1, w2, w3, group, options, saved=None)
        (saved None or empty: recompute)
where ``options`` is a MegaMoEOptions whose backend is the module's own name; the hopper
module's forward and backward also take ``fp8_weights`` (an Fp8Weights or None), which the
others are never given, its backward ``release_saved`` (the eager path's: the saved tensors
may be freed once read), and it makes the module-owned copies (``make_fp8_weights``,
``quantize_weight``: moe.MegaExperts asks it through ``backend_module``).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect

import torch
import torch.distributed as dist

from torchtitan_megamoe.ops.device import is_hopper
from torchtitan_megamoe.ops.fp8_weights import Fp8Weights, dequantized
from torchtitan_megamoe.ops.groups import group_from_name, group_size
from torchtitan_megamoe.ops.options import (
    MegaMoEOptions,
    ids_range_message,
    keyword_doc,
    keyword_parameters,
    op_schema,
)
from torchtitan_megamoe.ops.recipe import recipe_named
from torchtitan_megamoe.ops.shapes import shape_error

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
    fp8_weights: Fp8Weights | None = None,
    weight_casts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    **options,
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
            A loopback rank (ops/loopback.py: R ranks in one process) is taken too.
            ``None``: one rank owns all experts.

        fp8_weights: an ``ops.fp8_weights.Fp8Weights`` made from these very weights (in
            the dtype the op computes in), or None: the hopper backend's FP8 stages then read
            these copies instead of quantizing the weights on every call. Its owner vouches
            that they are current; the op checks their shapes only.
        weight_casts: (w1, w2, w3) cast to the autocast dtype by their owner, or None: under a
            bf16 autocast over fp32 weights, where the hopper bf16 forward would cast them itself
            (backend_casts_weights), it takes these instead (and saves them for the backward);
            the gradients still go to the fp32 weights, in fp32. Ignored where the op casts
            nothing. Their owner vouches that they are current; the op checks their shapes.

    The other keyword arguments are the fields of ``MegaMoEOptions`` (ops/options.py), checked
    on first use of each combination (an unknown one raises, naming the options):
    """
    options = MegaMoEOptions.of(**options)
    recipe = options.recipe
    if torch.is_autocast_enabled(x.device.type):
        # Autocast does not reach a custom op. TorchTitan trains under it on one device and
        # under DDP (FSDP casts the parameters instead), so do what it does for a matmul: x and
        # the weights in its dtype (the casts are differentiable: fp32 parameters get fp32
        # gradients), out in that dtype; the op's own math runs with autocast off
        # (_autocast_off). Precision fp8 reads the weights only through FP8 copies, quantized
        # from their values rounded to that dtype by the quantization pass itself, and writes
        # their gradients in their own dtype: no cast pass either way. Zero-stride stand-ins
        # (moe.py) are never read and keep their dtype, their gradients'. The hopper bf16
        # forward at EP=1 casts fp32 weights itself and its backward writes fp32 gradients
        # (hopper.cast_weights): no cast pass of the gradients.
        amp_dtype = compute_dtype(x)
        x = x.to(amp_dtype) if x.is_floating_point() else x
        backend_casts = backend_casts_weights(x, (w1, w2, w3), group, options)
        if not (recipe.stand_ins or backend_casts):
            w1, w2, w3 = (w if is_stand_in(w) else w.to(amp_dtype) for w in (w1, w2, w3))
    else:
        backend_casts = False
    if not backend_casts:
        weight_casts = None  # the op casts nothing here
    elif weight_casts is not None:
        _check_casts(weight_casts, (w1, w2, w3), x.dtype)
    check_args(x, topk_ids, topk_weights, w1, w2, w3, group=group, precision=options.precision,
               backend_casts=backend_casts)
    if options.backend == "auto":
        options = options.with_backend(resolve_backend(x, group))
    if options.backend != "hopper":
        # the reference computes from the weights' values: those of their cast to x's dtype
        w1, w2, w3 = (w if is_stand_in(w) or w.dtype == x.dtype else w.to(x.dtype)
                      for w in (w1, w2, w3))
    if fp8_weights is not None:
        if not recipe.fp8:
            raise ValueError(f"mega_moe: fp8_weights given with precision={options.precision!r}; "
                             "they serve the FP8 recipes only: pass fp8_weights=None")
        fp8_weights.check(w1, w2)
        if options.backend != "hopper":
            # the reference emulates the recipe from real weights: stand-ins get the values
            # the FP8 copies hold (their gradients still flow through the stand-ins)
            if fp8_weights.fwd is not None and any(map(is_stand_in, (w1, w2, w3))):
                f = fp8_weights.fwd
                w1, w2, w3 = ((w + dequantized(q, sc, w.dtype)).to(x.dtype) for w, q, sc in
                              ((w1, f.w1q, f.w1s), (w2, f.w2q, f.w2s), (w3, f.w3q, f.w3s)))
            fp8_weights = None
    # The hopper forward checks the ids on CUDA inside its first kernels (EP=1: the plan's
    # count kernels, EP > 1: the dispatch kernel), one device assert instead of six launches
    # before the layer's first kernel, host time a waited call pays; other paths check here.
    if not (options.backend == "hopper" and x.is_cuda):
        _check_ids(topk_ids, w1.shape[0] * group_size(group), group)
    group_name = "" if group is None else group.group_name
    # Keep activations for a backward only when one can follow: inference and no_grad
    # evaluation skip the extra stores (and their memory); save_activations="never" opts out.
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x, topk_weights, w1, w2, w3))
    save = options.save_activations != "never" and needs_grad
    tensors = (x, topk_ids, topk_weights, w1, w2, w3)
    if _plain_eager(tensors):
        # no gradient can flow (inference, no_grad, full AC's first forward): not even an
        # autograd Function, whose apply costs host time before the layer's first kernel
        if needs_grad:
            return _EagerMegaMoE.apply(*tensors, fp8_weights, weight_casts, save, group_name,
                                       options)
        return _forward_only(*tensors, fp8_weights, weight_casts, save, group_name, options)
    fp8_list = [] if fp8_weights is None else fp8_weights.tensors()
    out, _saved = torch.ops.megamoe.mega_moe(*tensors, fp8_list, list(weight_casts or ()), save,
                                             group_name, *options.op_args())
    return out


mega_moe.__signature__ = inspect.signature(mega_moe).replace(parameters=[
    p for p in inspect.signature(mega_moe).parameters.values() if p.kind is not p.VAR_KEYWORD
] + keyword_parameters())
mega_moe.__doc__ = mega_moe.__doc__.rstrip(" ") + keyword_doc(" " * 8) + "\n    "


def backend_casts_weights(x: torch.Tensor, weights: tuple, group, options) -> bool:
    """Whether this autocast call's backend takes the fp32 weights as they are and casts them
    itself, writing fp32 gradients (hopper.cast_weights): the hopper kernels at EP=1 with a
    bf16 forward, real (not stand-in) fp32 weights."""
    return (x.dtype == torch.bfloat16 and not options.recipe.fp8_forward
            and all(w.dtype == torch.float32 and not is_stand_in(w) for w in weights)
            and group_size(group) <= 1
            and resolved_backend(x, group, options.backend) == "hopper")


def _check_casts(casts, weights, dtype) -> None:
    """Raise, naming the weight, if a cast does not fit its weight (shape, device) or dtype."""
    if len(casts) != 3:
        raise ValueError(f"mega_moe: weight_casts must hold (w1, w2, w3), got {len(casts)}")
    for name, c, w in zip(("w1", "w2", "w3"), casts, weights):
        if c.shape != w.shape or c.dtype != dtype or c.device != w.device:
            raise ValueError(
                f"mega_moe: weight_casts {name} is {tuple(c.shape)} {c.dtype} on {c.device}, "
                f"expected {tuple(w.shape)} {dtype} on {w.device}")


def is_stand_in(w: torch.Tensor) -> bool:
    """A zero-stride stand-in for a weight whose values only its FP8 copies carry
    (moe.MegaExperts, precision fp8)."""
    return w.numel() > 1 and not any(w.stride())


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


def resolve_backend(x: torch.Tensor, group: dist.ProcessGroup | None) -> str:
    """What backend ``auto`` means for this call: the Hopper kernels where they run, else
    the reference."""
    if is_hopper(x.device) and backend_module("hopper").supports(x, group):
        return "hopper"
    return "reference"


def resolved_backend(x: torch.Tensor, group: dist.ProcessGroup | None, backend: str) -> str:
    """The backend a mega_moe call with this ``x`` (cast as an autocast would) runs."""
    if backend != "auto":
        return backend
    if torch.is_autocast_enabled(x.device.type):
        x = x.new_empty((0, *x.shape[1:]), dtype=torch.get_autocast_dtype(x.device.type))
    return resolve_backend(x, group)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a mega_moe call with this ``x`` computes in: the autocast dtype under an
    autocast (x and the weights are cast to it), else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def backend_module(name: str):
    return importlib.import_module(_BACKEND_MODULES[name])


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
    backend_casts: bool = False,
) -> None:
    """Raise early, with the fix in the message, on anything the op cannot compute correctly
    (the id range apart: mega_moe checks it where its backend's kernels do not). The converter
    runs it at conversion on zero-token stand-ins of each MoE block's inputs.
    ``backend_casts``: the weights may be fp32 (backend_casts_weights)."""
    recipe = recipe_named(precision)
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
        # a recipe reading weights only through FP8 copies of their values in x's dtype, and a
        # stand-in (moe.py), never read: either may be in its parameter's dtype, the gradient's
        if w.dtype != x.dtype and not (w.is_floating_point()
                                       and (recipe.stand_ins or is_stand_in(w)
                                            or backend_casts)):
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
    problem = shape_error(D, H, recipe)
    if problem is not None:
        raise ValueError(f"mega_moe: {problem}; use precision='bf16' or pad the model's sizes")


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


def _autocast_off(device_type: str):
    """The backends' math keeps its own dtypes: autocast off wherever the op runs inside it
    (eager, a compiled graph, a backward: full AC's recompute restores the forward's autocast
    state); mega_moe() has already cast x and the weights."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _fp8_from_list(tensors):
    """The op's ``fp8_weights`` list as an Fp8Weights, or None (empty)."""
    return Fp8Weights.from_tensors(tensors) if tensors else None


def _fp8_kwargs(fp8_weights) -> dict:
    # only the hopper backend is ever given copies (mega_moe drops them for the others)
    return {} if fp8_weights is None else {"fp8_weights": fp8_weights}


def _run_forward(x, topk_ids, topk_weights, w1, w2, w3, fp8_weights, weight_casts, save,
                 group_name, options):
    """(out, saved list): the backend's forward, for the registered op and the eager path;
    ``fp8_weights``: an Fp8Weights or None; ``weight_casts``: (w1, w2, w3) cast, or None."""
    impl = backend_module(options.backend)
    group = group_from_name(group_name)
    kw = _fp8_kwargs(fp8_weights)
    if weight_casts:  # only the hopper backend casts (mega_moe drops them for the others)
        kw["weight_casts"] = tuple(weight_casts)
    with _autocast_off(x.device.type):
        if not save:
            return impl.forward(x, topk_ids, topk_weights, w1, w2, w3, group, options, **kw), []
        out, saved = impl.forward(x, topk_ids, topk_weights, w1, w2, w3, group, options,
                                  save=True, **kw)
    return out, list(saved)


def _run_backward(grad_out, x, topk_ids, topk_weights, w1, w2, w3, fp8_weights, saved,
                  group_name, options, release_saved=False):
    """(dx, dtopk_weights, dw1, dw2, dw3): the backend's backward (recomputing when ``saved``
    is empty), for the registered op and the eager path. ``release_saved`` (the eager path,
    whose saved tensors nothing else reads): the backend may free them once read."""
    kw = _fp8_kwargs(fp8_weights)
    if release_saved and saved:  # only the hopper backend saves
        kw["release_saved"] = True
    with _autocast_off(x.device.type):
        grads = backend_module(options.backend).backward(
            grad_out.contiguous(), x, topk_ids, topk_weights, w1, w2, w3,
            group_from_name(group_name), options, saved=list(saved) or None, **kw,
        )
    return tuple(g.contiguous() for g in grads)


# Each field of the options is a typed argument of both schemas, so torch.compile and SAC see
# one op whose settings are constants of the graph.
@torch.library.custom_op(
    "megamoe::mega_moe", mutates_args=(),
    schema="(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w1, Tensor w2, Tensor w3, "
           "Tensor?[] fp8_weights, Tensor[] weight_casts, "
           f"bool save, str group_name, {op_schema()}) -> (Tensor, Tensor[])",
)
def _mega_moe_op(x, topk_ids, topk_weights, w1, w2, w3, fp8_weights, weight_casts, save,
                 group_name, *options):
    return _run_forward(x, topk_ids, topk_weights, w1, w2, w3, _fp8_from_list(fp8_weights),
                        weight_casts or None, save, group_name, MegaMoEOptions.of(*options))


@_mega_moe_op.register_fake
def _mega_moe_fake(x, topk_ids, topk_weights, w1, w2, w3, fp8_weights, weight_casts, save,
                   group_name, *options):
    if not save:
        return torch.empty_like(x), []
    options = MegaMoEOptions.of(*options)
    saved = backend_module(options.backend).saved_like(
        x, topk_ids, topk_weights, w1, w2, w3, group_from_name(group_name), options
    )
    return torch.empty_like(x), saved


@torch.library.custom_op(
    "megamoe::mega_moe_backward", mutates_args=(),
    schema="(Tensor grad_out, Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w1, "
           "Tensor w2, Tensor w3, Tensor?[] fp8_weights, Tensor[] saved, str group_name, "
           f"{op_schema()}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _mega_moe_backward_op(grad_out, x, topk_ids, topk_weights, w1, w2, w3, fp8_weights, saved,
                          group_name, *options):
    return _run_backward(grad_out, x, topk_ids, topk_weights, w1, w2, w3,
                         _fp8_from_list(fp8_weights), saved, group_name,
                         MegaMoEOptions.of(*options))


@_mega_moe_backward_op.register_fake
def _mega_moe_backward_fake(grad_out, x, topk_ids, topk_weights, w1, w2, w3, fp8_weights, saved,
                            *config):
    return (
        torch.empty_like(x),
        torch.empty_like(topk_weights),
        torch.empty_like(w1),
        torch.empty_like(w2),
        torch.empty_like(w3),
    )


# the gradients of the forward op's non-tensor inputs: save, group_name and the options
_NO_GRADS = (None,) * (2 + len(MegaMoEOptions().op_args()))


def _setup_context(ctx, inputs, output):
    # the casts reach the backward in saved (the hopper forward saves what it computed from)
    x, topk_ids, topk_weights, w1, w2, w3, fp8_weights, weight_casts, _save, *config = inputs
    ctx.casts = len(weight_casts)
    _out, saved = output
    ctx.mark_non_differentiable(*saved)
    # Gradients of the saved outputs are never used: do not let autograd allocate zeros for them
    # (a is as an activation).
    ctx.set_materialize_grads(False)
    _save_tensors(ctx, (x, topk_ids, topk_weights, w1, w2, w3), fp8_weights, saved)
    ctx.config = tuple(config)  # group_name and the options' fields


def _save_tensors(ctx, inputs, fp8_list, saved) -> None:
    """Save the op's inputs, the FP8 copies it was given (list slots, None where not held) and
    the forward's ``saved`` for the backward. Saved, not held on ctx: autograd frees them once
    this node's backward has run, so a layer's copies can go before the rest of the step's
    backward (moe.MegaExperts, fp8_free_after_backward)."""
    ctx.fp8_slots = [t is not None for t in fp8_list]
    ctx.save_for_backward(*inputs, *(t for t in fp8_list if t is not None), *saved)


def _saved_tensors(ctx) -> tuple:
    """(the six inputs, the fp8_weights list, saved): what _save_tensors saved."""
    x, topk_ids, topk_weights, w1, w2, w3, *rest = ctx.saved_tensors
    n = sum(ctx.fp8_slots)
    held = iter(rest[:n])
    return ((x, topk_ids, topk_weights, w1, w2, w3),
            [next(held) if slot else None for slot in ctx.fp8_slots], rest[n:])


def _backward(ctx, grad_out, _grad_saved):
    (x, topk_ids, topk_weights, w1, w2, w3), fp8_weights, saved = _saved_tensors(ctx)
    if grad_out is None:  # out itself was unused (grads are not materialized)
        grad_out = torch.zeros_like(x)
    dx, dweights, dw1, dw2, dw3 = torch.ops.megamoe.mega_moe_backward(
        grad_out, x, topk_ids, topk_weights, w1, w2, w3, fp8_weights, saved, *ctx.config
    )
    # torch.library passes a tensor list holding a None as one opaque argument (its gradient:
    # None) and a list of tensors element by element (a None each)
    fp8_grad = None if not all(ctx.fp8_slots) else [None] * len(ctx.fp8_slots)
    return (dx, None, dweights, dw1, dw2, dw3, fp8_grad, [None] * ctx.casts) + _NO_GRADS


_mega_moe_op.register_autograd(_backward, setup_context=_setup_context)


def _forward_only(*args):
    """A plain eager call that no gradient can flow through: the op's forward, nothing else."""
    return _run_forward(*args)[0]


class _EagerMegaMoE(torch.autograd.Function):
    """The registered op's forward and backward (_run_forward, _run_backward) as a plain
    autograd Function, for calls that nothing but autograd sees (_plain_eager): torch.library's
    per-call wrapping of a custom op (argument re-packing, tensor-list pytrees, output alias
    checks) costs host time on every forward and backward (tools/op_overhead.py measures it),
    before the layer's first kernel. Same saved tensors, same gradients (bit for bit: the same
    functions run); compile, export, selective AC and tensor subclasses keep the registered op,
    which they need to see."""

    @staticmethod
    def forward(ctx, x, topk_ids, topk_weights, w1, w2, w3, fp8_weights, weight_casts, save,
                group_name, options):
        out, saved = _run_forward(x, topk_ids, topk_weights, w1, w2, w3, fp8_weights,
                                  weight_casts, save, group_name, options)
        _save_tensors(ctx, (x, topk_ids, topk_weights, w1, w2, w3),
              [] if fp8_weights is None else fp8_weights.tensors(), saved)
        ctx.config = (group_name, options)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x, topk_ids, topk_weights, w1, w2, w3), fp8_list, saved = _saved_tensors(ctx)
        group_name, options = ctx.config
        if _plain_eager((grad_out, x)):
            # its saved tensors are this node's alone (not a compiled graph's buffers)
            grads = _run_backward(grad_out, x, topk_ids, topk_weights, w1, w2, w3,
                                  _fp8_from_list(fp8_list), saved, group_name, options,
                                  release_saved=True)
        else:
            grads = torch.ops.megamoe.mega_moe_backward(
                grad_out, x, topk_ids, topk_weights, w1, w2, w3, fp8_list, saved, group_name,
                *options.op_args())
        dx, dweights, dw1, dw2, dw3 = grads
        return dx, None, dweights, dw1, dw2, dw3, None, None, None, None, None
