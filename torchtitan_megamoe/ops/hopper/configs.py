"""The typed configs of every side. A config names its side (``side``); the stage table
dispatches a launch on it. ``kwargs()`` gives the set fields as keyword arguments (the Triton
launchers' lowercase schema); ``as_dict()`` the form the benchmark reports (``impl``: the side,
absent for Triton)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar


class Config:
    side: ClassVar[str]

    def kwargs(self) -> dict:
        """Fields that are set (None and False: the launcher's default)."""
        return {f.name: v for f in fields(self)
                if (v := getattr(self, f.name)) is not None and v is not False}

    def as_dict(self) -> dict:
        return self.kwargs() if self.side == "triton" else {"impl": self.side, **self.kwargs()}


@dataclass(frozen=True)
class TritonGemm(Config):
    """A Triton GEMM's tile (block_m rows, block_n output columns, block_k contraction step),
    group_m (M tiles that sweep one N tile together: an int, or "wave"), launch knobs and
    switches. Unset fields are left to the launcher (the FP8 kernels fix block_k at 128)."""

    side: ClassVar[str] = "triton"
    block_m: int | None = None
    block_n: int | None = None
    block_k: int | None = None
    group_m: int | str | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    use_tma: bool = False
    persistent: bool = False
    tma_store: bool = False


@dataclass(frozen=True)
class Sm90(Config):
    """A csrc/ kernel for sm_90a; group_m as TritonGemm's ("wave": the kernel's own), static:
    a fixed tile order instead of the dynamic ticket; gather_first (FP8 GEMM 1): the token rows
    gathered into the row space by a pass first and read by TMA, not by cp.async inside."""

    side: ClassVar[str] = "sm90"
    group_m: int | str = 8
    static: bool = False
    gather_first: bool = False


@dataclass(frozen=True)
class Sm90Fused(Config):
    """dgrad2_swiglu as one csrc/ launch (dy rows gathered inside, the SwiGLU backward in the
    epilogue); block_n: its H tile, which sets the number of d(topk_weights) partials."""

    side: ClassVar[str] = "sm90_fused"
    block_n: int = 256


@dataclass(frozen=True)
class Cublas(Config):
    """torch._grouped_mm (kernels/grouped_mm.py)."""

    side: ClassVar[str] = "cublas"


@dataclass(frozen=True)
class DeepGemm(Config):
    """DeepGEMM's grouped FP8 GEMM (deepgemm.py); it picks its own tiles."""

    side: ClassVar[str] = "deepgemm"
