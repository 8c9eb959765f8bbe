"""What the Hopper kernels of csrc/grouped_gemm_sm90.cu share: where they may run, and their
library (one build per set of compile-time knobs, both entry points typed)."""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from torchtitan_megamoe.ops.cuda.build import load, nvcc_path


BULK_STORE = ("MEGAMOE_SM90_TMA_STORE=1",)
"""The build the tuner candidates use: the epilogue stages each tile in shared memory and writes
it with bulk tensor stores (it won every GEMM it was measured on, docs/PERF.md)."""


def sm90_buildable(x: torch.Tensor) -> bool:
    """True where the kernels can run: an sm_90 GPU and nvcc to build them (not the interpreter)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) != (9, 0):
        return False
    return nvcc_path() is not None


def sm90_usable(x: torch.Tensor) -> bool:
    """True where the tuners may offer these kernels: buildable, and not turned off with
    MEGAMOE_CUDA=0 (e.g. to rule them out when debugging; a tuner only keeps one where it is
    the fastest candidate)."""
    return os.environ.get("MEGAMOE_CUDA", "1") != "0" and sm90_buildable(x)


def grouped_gemm_library(defines: tuple = ()) -> ctypes.CDLL:
    """csrc/grouped_gemm_sm90.cu built with ``defines`` (its MEGAMOE_SM90_* knobs)."""
    lib = load("grouped_gemm_sm90", tuple(defines))
    if not getattr(lib, "_megamoe_typed", False):
        p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        lib.megamoe_gemm1_swiglu.argtypes = [p, p, p, p, p, p, p, p, i, i, i, i, i, i, ll, ll, ll,
                                             ll, i, i, p, p]
        lib.megamoe_gemm1_swiglu.restype = i
        lib.megamoe_gemm_rows.argtypes = [p, p, p, p, p, p, p, i, i, i, i, i, i, i, ll, i, p, p]
        lib.megamoe_gemm_rows.restype = i
        lib.megamoe_wgrad.argtypes = [p, ll, p, ll, p, p, p, p, p, i, i, i, i, i, i, i, p, p]
        lib.megamoe_wgrad.restype = i
        lib.megamoe_dgrad_swiglu.argtypes = [p, ll, p, p, p, p, p, p, p, p, p, i, i, i, i, i, ll,
                                             i, p, p]
        lib.megamoe_dgrad_swiglu.restype = i
        lib.megamoe_error_string.argtypes = [i]
        lib.megamoe_error_string.restype = ctypes.c_char_p
        lib._megamoe_typed = True
    return lib


def launch_context(device: torch.device, ticket: bool = True):
    """(SM count, the current stream's handle, a fresh zeroed int32 ticket or None) for a
    persistent launch on ``device``. The ticket is the dynamic tile order's counter; a new one
    per call (a stream-ordered memset) so launches on other streams never share it."""
    num_sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    stream = torch.cuda.current_stream(device).cuda_stream
    zero = torch.zeros(1, dtype=torch.int32, device=device) if ticket else None
    return num_sms, stream, zero


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def check_plan(plan, device: torch.device, who: str, names=("tile_expert", "num_rows_used")):
    for name in names:
        t = getattr(plan, name)
        if t.dtype != torch.int32 or not t.is_contiguous() or t.device != device:
            raise ValueError(f"{who}: plan.{name} must be contiguous int32 on {device}, got "
                             f"{t.dtype} on {t.device}")


def check_bf16_rows(who: str, **tensors) -> None:
    for name, t in tensors.items():
        if t.dtype != torch.bfloat16:
            raise TypeError(f"{who}: {name} must be bfloat16, got {t.dtype}")
        if t.stride(-1) != 1 or t.data_ptr() % 16 != 0 or (t.dim() > 1 and t.stride(-2) % 8 != 0):
            raise ValueError(f"{who}: {name} needs unit-stride, 16-byte aligned rows")


def raise_on_error(lib: ctypes.CDLL, rc: int, who: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{who} launch failed: {lib.megamoe_error_string(rc).decode()}")
