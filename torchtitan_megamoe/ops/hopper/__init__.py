"""Backend ``hopper`` of mega_moe (formerly ``triton``): Hopper (SM90) kernels, BF16 and FP8.

Forward (EP=1, bf16_forward.py): device-side plan (plan.py), grouped GEMM 1 + SwiGLU
(kernels/gemm1_swiglu.py), grouped GEMM 2 into the row space (kernels/gemm2.py), fp32
combine through the slots' rows (kernels/combine.py). FP8 at EP=1: fp8_forward.py,
fp8_backward.py. Backward: bf16_backward.py (BF16); it reads what the forward saved (GEMM 1's pre-activations and the
packed plan) instead of recomputing them. EP > 1 (ep_forward.py, ep_backward.py): each token goes once
to every rank owning one of its experts through the token exchange (ep_route.py over
ops/hopper/ep_transport.py: symmetric memory, copy-engine copies, no host sync), the EP=1 kernels run on the
receive buffer and partial rows return to their sources; the forward overlaps both moves with
its GEMMs (ep_forward.py), the backward does not yet.
"""

import torch

from torchtitan_megamoe.ops.device import capability
from torchtitan_megamoe.ops.hopper.bf16_backward import backward as _backward_any_ep
from torchtitan_megamoe.ops.hopper.bf16_backward import check_backward_dtypes
from torchtitan_megamoe.ops.hopper.fp8_backward import backward_fp8
from torchtitan_megamoe.ops.hopper.fp8_forward import FP8_BLOCK_M, forward_fp8
from torchtitan_megamoe.ops.hopper.ep_forward import forward_ep, saved_like_ep
from torchtitan_megamoe.ops.hopper.bf16_forward import (
    forward_ep1,
    interpret_defaults,
    interpreting,
    min_multiple,
    saved_like as _saved_like_ep1,
)

_SUPPORTED_DTYPES = (torch.bfloat16,)


def _ep_size(group) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


def supports(x: torch.Tensor, group) -> bool:
    """Whether backend="auto" may pick these kernels for ``x`` (weights are checked in forward)."""
    if x.dtype not in _SUPPORTED_DTYPES:
        return False
    if not x.is_cuda or capability(x.device)[0] != 9:
        return False
    return x.dim() == 2 and x.shape[1] % min_multiple() == 0


def check_inputs(x, w1, group, precision) -> None:
    """Raise, naming the fix, for inputs these kernels cannot take."""
    if precision != "bf16":
        E, H, D = w1.shape
        if D % FP8_BLOCK_M or H % FP8_BLOCK_M:
            raise ValueError(
                f"mega_moe backend='hopper' precision={precision!r} uses 128-wide scaling "
                f"blocks and needs dim and hidden % 128 == 0, got dim={D}, hidden={H}; use "
                "precision='bf16'"
            )
        if _ep_size(group) > 1:
            raise NotImplementedError(
                f"mega_moe backend='hopper' precision={precision!r} runs on one rank's experts "
                "only so far (the expert-parallel exchange moves bf16 rows); use "
                "precision='bf16' with an expert-parallel group, or group=None"
            )
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(
            f"mega_moe backend='hopper' needs bfloat16 tensors, got {x.dtype}; cast x and the "
            "weights to torch.bfloat16 or use backend='reference'"
        )
    if not interpreting():
        if not x.is_cuda:
            raise ValueError(
                "mega_moe backend='hopper' needs CUDA tensors; use backend='reference' on CPU"
            )
        major, minor = capability(x.device)
        if major != 9:
            raise ValueError(
                f"mega_moe backend='hopper' targets Hopper (SM90), this GPU is SM{major}{minor}; "
                "use backend='reference'"
            )
    m = min_multiple()
    E, H, D = w1.shape
    if D % m or H % m:
        raise ValueError(
            f"mega_moe backend='hopper' needs dim and hidden to be multiples of {m}, got "
            f"dim={D}, hidden={H}; pad them or use backend='reference'"
        )


def forward(x, topk_ids, topk_weights, w1, w2, w3, group, options, save=False):
    """out; with ``save``, (out, saved: list of tensors for backward(saved=...)). EP=1 saves
    [a, packed_plan] (bf16_forward.py); EP > 1 the same in the receive layout, or nothing where
    ep_forward.keeps_saved says the backward recomputes."""
    precision = options.precision
    check_inputs(x, w1, group, precision)
    if _ep_size(group) > 1:
        block_m, c1, c2 = interpret_defaults(None, None, None)
        return forward_ep(x, topk_ids, topk_weights, w1, w2, w3, group, block_m, c1, c2,
                          save=save)
    if precision == "fp8":
        if not save:
            return forward_fp8(x, topk_ids, topk_weights, w1, w2, w3)
        out, saved = forward_fp8(x, topk_ids, topk_weights, w1, w2, w3, save=True)
        return out, list(saved)
    # fp8_bwd: the bf16 forward, on the FP8 backward's 128-row segments
    block_m = FP8_BLOCK_M if precision == "fp8_bwd" else None
    if not save:
        return forward_ep1(x, topk_ids, topk_weights, w1, w2, w3, block_m=block_m)
    out, saved = forward_ep1(x, topk_ids, topk_weights, w1, w2, w3, block_m=block_m, save=True)
    return out, list(saved)


def saved_like(x, topk_ids, topk_weights, w1, w2, w3, group, options):
    precision = options.precision
    """Empty tensors with the shapes and dtypes forward(..., save=True) saves (fake impl)."""
    if _ep_size(group) > 1:
        block_m, _, _ = interpret_defaults(None, None, None)
        return saved_like_ep(x, topk_ids, w1, group, block_m)
    return _saved_like_ep1(x, topk_ids, w1, block_m=FP8_BLOCK_M if precision != "bf16" else None)


def backward(grad_out, x, topk_ids, topk_weights, w1, w2, w3, group, options, saved=None):
    precision = options.precision
    if precision != "bf16":
        check_inputs(x, w1, group, precision)
        check_backward_dtypes(grad_out, x, w1)
        return backward_fp8(grad_out, x, topk_ids, topk_weights, w1, w2, w3, precision,
                            saved=saved)
    return _backward_any_ep(grad_out, x, topk_ids, topk_weights, w1, w2, w3, group, options,
                            saved=saved)
