"""Every environment variable the package reads, in one place. Each is read when asked for
(not at import), so a test or a launcher can set it before the call that needs it. README.md's
"Settings" table documents them."""

from __future__ import annotations

import os
from pathlib import Path

CPU = "MEGAMOE_CPU"
TUNE = "MEGAMOE_TUNE"
BWD_IMPL = "MEGAMOE_BWD_IMPL"
CUDA = "MEGAMOE_CUDA"
CUDA_CACHE = "MEGAMOE_CUDA_CACHE"

BWD_IMPLS = ("auto", "triton", "cublas")


def _flag(name: str, default: str) -> bool:
    value = os.environ.get(name, default).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{name}={value!r} is not a switch; set it to 1 or 0")


def cpu_shims() -> bool:
    """MEGAMOE_CPU=1: patch TorchTitan 0.2.2 to train on CPU (used only without CUDA)."""
    return _flag(CPU, "0")


def tuning() -> bool:
    """MEGAMOE_TUNE=0: take each stage's first candidate instead of timing them."""
    return _flag(TUNE, "1")


def bwd_impl() -> str:
    """MEGAMOE_BWD_IMPL: auto (the tuner picks per stage), triton or cublas (forced)."""
    impl = os.environ.get(BWD_IMPL, "auto").strip().lower() or "auto"
    if impl not in BWD_IMPLS:
        raise ValueError(f"{BWD_IMPL}={impl!r} is not one of {BWD_IMPLS}; unset it or pick one")
    return impl


def cuda_kernels() -> bool:
    """MEGAMOE_CUDA=0: never offer the hand-written CUDA kernels (Triton and cuBLAS only)."""
    return _flag(CUDA, "1")


def cuda_cache() -> Path:
    """MEGAMOE_CUDA_CACHE: where the compiled CUDA libraries are kept."""
    return Path(os.environ.get(CUDA_CACHE,
                               Path.home() / ".cache" / "torchtitan_megamoe" / "cuda"))


def triton_interpreting() -> bool:
    """TRITON_INTERPRET=1 (Triton's own switch): kernels run on the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"
