"""What the bf16 backward's stage tables share: the problem they are offered for, and where the
grouped_mm and csrc/ sides fit (MEGAMOE_BWD_IMPL=auto offers every side that fits, triton only
Triton, cublas only grouped_mm)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper import tiles
from torchtitan_megamoe.ops.hopper.configs import Cublas


@dataclass(frozen=True)
class Shape:
    D: int
    H: int
    E: int
    block_m: int
    forced: str = "auto"  # MEGAMOE_BWD_IMPL
    bf16: bool = True  # the stage's operands are bf16
    params_ok: bool = True  # wgrad: parameters whose gradients the csrc/ kernel can write


def shape(D: int, H: int, E: int, block_m: int, bf16: bool, params_ok: bool = True) -> Shape:
    return Shape(D, H, E, block_m, settings.bwd_impl(), bf16, params_ok)


def cublas_unsupported_reason(D: int, H: int, E: int = 1) -> str | None:
    """Why the _grouped_mm stages cannot run for these dims (None: they can)."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if E >= 1024:
        return f"torch._grouped_mm takes fewer than 1024 groups, got {E} local experts"
    if D % 8 or H % 8:
        return f"torch._grouped_mm needs D and H multiples of 8 (16-byte strides), got D={D}, H={H}"
    return None


def triton_offer(configs):
    """A Triton side's offer: ``configs(shape)`` unless grouped_mm is forced."""
    return lambda s, av: [] if s.forced == "cublas" else configs(s)


def cublas_offer(auto: bool = True):
    """The grouped_mm side's offer: forced, or under auto where it runs (``auto`` False: a
    stage where it is never faster, offered only when forced)."""
    def offer(s: Shape, av) -> list:
        reason = cublas_unsupported_reason(s.D, s.H, s.E)
        if s.forced == "cublas":
            if reason:
                raise ValueError(f"{settings.BWD_IMPL}=cublas: {reason}; set "
                                 f"{settings.BWD_IMPL}=triton or auto")
            return [Cublas()]
        return [Cublas()] if s.forced == "auto" and auto and av.cublas and not reason else []
    return offer


def sm90_offered(s: Shape, av) -> bool:
    """The csrc/ kernels run at the GPU plan's tile height on bf16 operands, under auto."""
    return av.sm90 and s.forced == "auto" and s.block_m == tiles.BLOCK_M and s.bf16


def params_ok(params: tuple) -> bool:
    """Contiguous bf16 or fp32 parameters of one dtype (the csrc/ weight gradients are written
    in their dtype and layout; a zero-stride stand-in's, moe.py, is contiguous too)."""
    return (all(p.dtype == params[0].dtype for p in params)
            and all(p.dtype in (torch.bfloat16, torch.float32)
                    and (p.is_contiguous() or not any(p.stride())) for p in params))
