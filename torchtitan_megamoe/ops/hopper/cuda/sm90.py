"""What the Hopper kernels of csrc/grouped_gemm_sm90.cu share: where they may run, and their
library (one build, its entry points typed)."""

from __future__ import annotations

import ctypes

import torch

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper.cuda.build import load, nvcc_path
from torchtitan_megamoe.ops.device import capability, sm_count


SOURCE = "grouped_gemm_sm90"
"""csrc/grouped_gemm_sm90.cu, built once (it has no compile-time settings). ``python -m
torchtitan_megamoe.ops.hopper.cuda.sm90`` compiles it (and csrc/fp8_gemm_sm90.cu) into
$MEGAMOE_CUDA_CACHE ahead of time, e.g.
into .cuda_cache here to carry to a GPU machine (scripts/_device_env.sh uses it there)."""


def sm90_buildable(x: torch.Tensor) -> bool:
    """True where the kernels can run: an sm_90 GPU and nvcc to build them (not the interpreter)."""
    if settings.triton_interpreting() or x.device.type != "cuda":
        return False
    return capability(x.device) == (9, 0) and nvcc_path() is not None


def sm90_usable(x: torch.Tensor) -> bool:
    """True where the tuners may offer these kernels: buildable, and not turned off with
    MEGAMOE_CUDA=0 (e.g. to rule them out when debugging; a tuner only keeps one where it is
    the fastest candidate)."""
    return settings.cuda_kernels() and sm90_buildable(x)


def grouped_gemm_library() -> ctypes.CDLL:
    """csrc/grouped_gemm_sm90.cu's library (built on first use)."""
    lib = load(SOURCE)
    if not getattr(lib, "_megamoe_typed", False):
        p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        lib.megamoe_gemm1_swiglu.argtypes = [p, p, p, p, p, p, p, p, i, i, i, i, i, i, ll, ll, ll,
                                             ll, i, p, p]
        lib.megamoe_gemm1_swiglu.restype = i
        lib.megamoe_gemm_rows.argtypes = [p, p, p, p, p, p, p, i, i, i, i, i, i, i, ll, i, p, p]
        lib.megamoe_gemm_rows.restype = i
        lib.megamoe_wgrad.argtypes = [p, ll, p, ll, p, p, p, p, p, p, i, i, i, i, i, i, i, p, p]
        lib.megamoe_wgrad.restype = i
        lib.megamoe_dgrad_swiglu.argtypes = [p, ll, p, p, p, p, p, p, p, p, p, p, i, i, i, i, i,
                                             ll, i, p, p]
        lib.megamoe_dgrad_swiglu.restype = i
        lib.megamoe_error_string.argtypes = [i]
        lib.megamoe_error_string.restype = ctypes.c_char_p
        lib._megamoe_typed = True
    return lib


def launch_context(device: torch.device, ticket: bool = True):
    """(SM count, the current stream's handle, a zeroed int32 ticket or None) for a persistent
    launch on ``device``. The ticket is the dynamic tile order's counter. Each launch leaves
    its ticket zeroed (the last CTA to take a number resets it), so each stream keeps one: a launch
    starts only after the previous one on its stream ended, and launches on other streams
    never share it. No allocation or fill kernel per launch (torch.zeros(1): 7.5-9 us of
    the H200 host's time before the GEMM it precedes, tools/host_issue.py)."""
    num_sms = sm_count(device)
    stream = torch.cuda.current_stream(device).cuda_stream
    return num_sms, stream, (_ticket(device, stream) if ticket else None)


_TICKETS: dict = {}
"""(device index, stream handle) -> that stream's ticket: one int32 on the device, zero between
launches (each launch leaves it zeroed, and a stream runs its launches one after another)."""


def _ticket(device: torch.device, stream: int) -> torch.Tensor:
    if torch.cuda.is_current_stream_capturing():
        # a graph keeps its own zeroed ticket (a memset node replayed with it); one made here
        # for the pool would live in the graph's private memory
        return torch.zeros(1, dtype=torch.int32, device=device)
    key = (device.index, stream)  # the default stream's handle is 0 on every device
    t = _TICKETS.get(key)
    if t is None:
        t = _TICKETS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return t


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


if __name__ == "__main__":
    from torchtitan_megamoe.ops.hopper.cuda.build import build
    from torchtitan_megamoe.ops.hopper.cuda.fp8_library import SOURCE as FP8_SOURCE

    for source in (SOURCE, FP8_SOURCE):
        print(build(source))
