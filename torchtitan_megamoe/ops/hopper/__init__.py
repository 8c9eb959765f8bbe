"""Backend ``hopper`` of mega_moe: Hopper (SM90) kernels, BF16 and FP8.

The stages come in pairs, one file per direction, and ``_stages`` below picks the pair by the
recipe (options.recipe, ops/recipe.py: which GEMMs run in FP8) x EP, for the forward and the
backward alike:

    bf16, EP=1   bf16_forward.py / bf16_backward.py   plan, gemm1_swiglu, gemm2, combine /
                                                      dgrad2_swiglu, wgrad, dgrad1, bwd_combine
    fp8,  EP=1   fp8_forward.py  / fp8_backward.py    the same stages in blockwise FP8
    fp8_bwd      bf16_forward.py (the recipe's plan rows) / fp8_backward.py
    any,  EP>1   ep_forward.py   / ep_backward.py     dispatch (ep_dispatch.py over
                                                      ep_transport.py: e4m3 rows where the
                                                      recipe's GEMMs read FP8) around the EP=1
                                                      stages of the recipe, partial rows
                                                      returned to their sources

The backward reads what the forward saved (GEMM 1's pre-activations and the packed plan)
instead of recomputing them. Each stage has one table of implementations (sides/), which its
tuner (tune.py) times; stages.py is the benchmark's view of the stages. The module that owns a
layer's FP8 weight copies makes them with this backend's ``make_fp8_weights`` and
``quantize_weight`` (fp8_weights.py).
"""

import torch

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.device import capability, is_hopper
from torchtitan_megamoe.ops.groups import group_size
from torchtitan_megamoe.ops.hopper.bf16_backward import (
    backward_bf16, check_backward_dtypes, released,
)
from torchtitan_megamoe.ops.hopper.bf16_forward import forward_bf16, saved_like as saved_like_bf16
from torchtitan_megamoe.ops.hopper.ep_backward import backward_ep
from torchtitan_megamoe.ops.hopper.ep_forward import forward_ep, saved_like_ep
from torchtitan_megamoe.ops.hopper.fp8_backward import backward_fp8
from torchtitan_megamoe.ops.hopper.fp8_forward import forward_fp8
from torchtitan_megamoe.ops.hopper.fp8_weights import make_fp8_weights, quantize_weight
from torchtitan_megamoe.ops.shapes import hopper_multiple, shape_error

__all__ = ["backward", "check_inputs", "forward", "make_fp8_weights", "quantize_weight",
           "saved_like", "supports"]

_SUPPORTED_DTYPES = (torch.bfloat16,)


def supports(x: torch.Tensor, group) -> bool:
    """Whether backend="auto" may pick these kernels for ``x`` (weights are checked in forward)."""
    if x.dtype not in _SUPPORTED_DTYPES or not is_hopper(x.device):
        return False
    return x.dim() == 2 and x.shape[1] % hopper_multiple() == 0


def check_inputs(x, w1, group, recipe) -> None:
    """Raise, naming the fix, for inputs these kernels cannot take (the op's own checks,
    ops/api.check_args, ran first: an FP8 recipe's scale blocks included)."""
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(
            f"mega_moe backend='hopper' needs bfloat16 tensors, got {x.dtype}; cast x and the "
            "weights to torch.bfloat16 or use backend='reference'"
        )
    if not settings.triton_interpreting():
        if not x.is_cuda:
            raise ValueError(
                "mega_moe backend='hopper' needs CUDA tensors; use backend='reference' on CPU"
            )
        if not is_hopper(x.device):
            major, minor = capability(x.device)
            raise ValueError(
                f"mega_moe backend='hopper' targets Hopper (SM90), this GPU is SM{major}{minor}; "
                "use backend='reference'"
            )
    E, H, D = w1.shape
    problem = shape_error(D, H, recipe, "hopper")
    if problem is not None:
        raise ValueError(f"mega_moe backend='hopper': {problem}; pad them or use "
                         "backend='reference'")


# (forward, backward) per (GEMMs 1 and 2 in FP8, data gradients in FP8, EP > 1); the EP files
# run every recipe's EP=1 stages on what arrived
_STAGES = {
    (False, False, False): ("bf16", "bf16"),
    (True, True, False): ("fp8", "fp8"),
    (False, True, False): ("bf16", "fp8"),
    (False, False, True): ("ep", "ep"),
    (True, True, True): ("ep", "ep"),
    (False, True, True): ("ep", "ep"),
}


def _stages(options, group) -> tuple[str, str]:
    """Which forward and backward file serve this call: "bf16", "fp8" or "ep"."""
    recipe = options.recipe
    return _STAGES[(recipe.fp8_forward, recipe.fp8_dgrad, group_size(group) > 1)]


def forward(x, topk_ids, topk_weights, w1, w2, w3, group, options, save=False, fp8_weights=None,
            weight_casts=None):
    """out; with ``save``, (out, saved: list of tensors for backward(saved=...)). EP=1 saves
    [a, packed_plan] (bf16_forward.py); EP > 1 [store of every region's a (a slot each), each
    region's packed plan] (ep_forward.py), or nothing where ep_forward.keeps_saved says the
    backward recomputes. ``fp8_weights``: the layer's
    fp8_weights.Fp8Weights (the FP8 stages' ``weight_cache``), or None: quantize per call.
    ``weight_casts``: the bf16 forward's casts of fp32 weights as their owner made them, or
    None: cast here (cast_weights)."""
    check_inputs(x, w1, group, options.recipe)
    stage, _ = _stages(options, group)
    copies = ()
    if stage == "bf16":
        copies = tuple(weight_casts) if weight_casts else cast_weights(x, (w1, w2, w3))
    if copies:
        w1, w2, w3 = copies
    if stage == "ep":
        res = forward_ep(x, topk_ids, topk_weights, w1, w2, w3, group, options.recipe,
                         options.max_tokens_per_rank, save=save,
                         weight_cache=_weight_cache(fp8_weights))
    elif stage == "fp8":
        res = forward_fp8(x, topk_ids, topk_weights, w1, w2, w3, _weight_cache(fp8_weights),
                          save=save)
    else:
        # a bf16 forward before an FP8 backward: on that backward's plan rows
        res = forward_bf16(x, topk_ids, topk_weights, w1, w2, w3,
                           block_m=options.recipe.plan_block_m, save=save)
    if not save:
        return res
    out, saved = res
    return out, list(saved) + list(copies)


def cast_weights(x, weights) -> tuple:
    """The bf16 forward's own copies of fp32 weights (api.mega_moe passes an EP=1 call's
    parameters through under autocast; their owner may pass them made: ``weight_casts``),
    saved after the forward's for the backward, which reads them and writes the gradients in
    fp32 straight from its GEMMs: no cast pass of the gradients. () where the weights are x's
    dtype."""
    if weights[0].dtype == x.dtype:
        return ()
    return tuple(w.to(x.dtype) for w in weights)


def _weight_cache(fp8_weights):
    """What the FP8 stages get as ``weight_cache`` (fp8_weights.py): the layer's copies, or
    False (quantize on every call)."""
    return False if fp8_weights is None else fp8_weights


def saved_like(x, topk_ids, topk_weights, w1, w2, w3, group, options):
    """Empty tensors with the shapes and dtypes forward(..., save=True) saves (fake impl)."""
    stage, _ = _stages(options, group)
    if stage == "ep":
        return saved_like_ep(x, topk_ids, w1, group, options.recipe, options.max_tokens_per_rank)
    copies = ([x.new_empty(w.shape) for w in (w1, w2, w3)]
              if stage == "bf16" and w1.dtype != x.dtype else [])
    return saved_like_bf16(x, topk_ids, w1, block_m=options.recipe.plan_block_m) + copies


def backward(grad_out, x, topk_ids, topk_weights, w1, w2, w3, group, options, saved=None,
             fp8_weights=None, release_saved=False):
    """(dx, dtopk_weights, dw1, dw2, dw3); ``saved``: what forward(..., save=True) returned,
    None or empty to recompute; ``fp8_weights`` as in forward. ``release_saved``: ``saved`` is
    dead after this call (the op's eager backward): the EP=1 stages free GEMM 1's
    pre-activations as soon as they have read them. Saved ones an earlier backward of the same
    graph freed (retain_graph) are recomputed."""
    forward_stage, stage = _stages(options, group)
    grads_like = None
    if forward_stage == "bf16" and w1.dtype != x.dtype:  # the forward's cast_weights
        grads_like = (w1, w2, w3)
        copies = saved[2:] if saved and not released(saved) else cast_weights(x, grads_like)
        w1, w2, w3 = copies
        saved = saved[:2] if saved else saved
    if released(saved):
        saved = None
    recipe = options.recipe
    if recipe.fp8:  # bf16's were checked by the forward
        check_inputs(x, w1, group, recipe)
    check_backward_dtypes(grad_out, x, w1, recipe.weight_dtypes)
    if stage == "ep":
        return backward_ep(grad_out, x, topk_ids, topk_weights, w1, w2, w3, group, recipe,
                           options.max_tokens_per_rank, saved=saved,
                           weight_cache=_weight_cache(fp8_weights), release_saved=release_saved)
    if stage == "fp8":
        return backward_fp8(grad_out, x, topk_ids, topk_weights, w1, w2, w3, recipe,
                            _weight_cache(fp8_weights), saved=saved, release_saved=release_saved,
                            grads_like=grads_like)
    return backward_bf16(grad_out, x, topk_ids, topk_weights, w1, w2, w3, saved=saved,
                         release_saved=release_saved, grads_like=grads_like)
