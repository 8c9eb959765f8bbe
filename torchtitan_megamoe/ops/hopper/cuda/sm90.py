"""What the CUDA kernel families' wrappers (gemm1_swiglu.py, gemm_rows.py, dgrad2_swiglu.py,
wgrad.py) share: where the kernels may run, each family's library with its entry points typed,
the launch (one parameter struct by pointer), the launch context, and the input checks.

The family modules import this one; it imports none of them.
"""

from __future__ import annotations

import ctypes

import torch

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.device import is_hopper, sm_count
from torchtitan_megamoe.ops.hopper.cuda.build import load, nvcc_path
from torchtitan_megamoe.ops.hopper.cuda.params import ENTRY_POINTS


def sm90_buildable(x: torch.Tensor) -> bool:
    """True where the kernels can run: an sm_90 GPU and nvcc to build them (not the interpreter)."""
    if settings.triton_interpreting():
        return False
    return is_hopper(x.device) and nvcc_path() is not None


def sm90_usable(x: torch.Tensor) -> bool:
    """True where the tuners may offer these kernels: buildable, and not turned off with
    MEGAMOE_CUDA=0 (e.g. to rule them out when debugging; a tuner only keeps one where it is
    the fastest candidate)."""
    return settings.cuda_kernels() and sm90_buildable(x)


def library(family: str) -> ctypes.CDLL:
    """csrc/<family>.cu's library (built on first use), its entry points typed."""
    lib = load(family)
    if not getattr(lib, "_megamoe_typed", False):
        for entry, struct in ENTRY_POINTS[family].items():
            fn = getattr(lib, entry)
            fn.argtypes = [ctypes.POINTER(struct)]
            fn.restype = ctypes.c_int
        lib.megamoe_error_string.argtypes = [ctypes.c_int]
        lib.megamoe_error_string.restype = ctypes.c_char_p
        lib._megamoe_typed = True
    return lib


def launch(family: str, entry: str, params: ctypes.Structure, who: str) -> None:
    """Calls ``entry`` of csrc/<family>.cu with a pointer to ``params`` (its argtypes refuse any
    other struct); raises on its error."""
    lib = library(family)
    rc = getattr(lib, entry)(ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"{who} launch failed: {lib.megamoe_error_string(rc).decode()}")


def launch_context(device: torch.device, ticket: bool = True):
    """(SM count, the current stream's handle, a zeroed int32 ticket or None) for a persistent
    launch on ``device``. The ticket is the dynamic tile order's counter. Each launch leaves
    its ticket zeroed (the last CTA to take a number resets it), so each stream keeps one: a launch
    starts only after the previous one on its stream ended, and launches on other streams
    never share it. No allocation or fill kernel per launch: a torch.zeros(1) would cost host
    time before every GEMM."""
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


FP8 = torch.float8_e4m3fn
FP8_BLOCK = 128
"""The FP8 kernels' tile: 128 rows x 128 columns, K steps of 128 (one scale block)."""


def fp8_shape_supported(N: int, K: int, block_m: int) -> bool:
    """N output columns, K reduction and a plan's block_m fit the FP8 row-space kernels."""
    return N % FP8_BLOCK == 0 and K % FP8_BLOCK == 0 and block_m % FP8_BLOCK == 0


def check_fp8_operands(who, plan, N, K, weights, scales) -> None:
    if not fp8_shape_supported(N, K, plan.block_m):
        raise ValueError(f"{who} needs N % {FP8_BLOCK} == 0, K % {FP8_BLOCK} == 0 and a plan "
                         f"block_m multiple of {FP8_BLOCK}; got N={N}, K={K}, "
                         f"block_m={plan.block_m}")
    for name, w in weights.items():
        if w.dtype != FP8 or not w.is_contiguous() or w.data_ptr() % 16:
            raise ValueError(f"{who}: {name} must be contiguous, 16-byte aligned e4m3")
    for name, s in scales.items():
        if s.dtype != torch.float32 or s.stride(-1) != 1:
            raise ValueError(f"{who}: {name} must be fp32 with unit-stride rows")


def check_fp8_token_rows(who, q_name, q, s_name, s, D) -> None:
    """The token rows a gathering kernel reads by cp.async: e4m3 [T, D], 16-byte aligned rows,
    with their [T, D/128] scales."""
    if q.dtype != FP8 or q.stride(1) != 1 or q.stride(0) % 16 or q.data_ptr() % 16:
        raise ValueError(f"{who}: {q_name} must be e4m3 with unit-stride, 16-byte aligned rows")
    if q.shape[1] != D or s.shape != (q.shape[0], D // FP8_BLOCK):
        raise ValueError(f"{who}: {q_name} {tuple(q.shape)} / {s_name} {tuple(s.shape)} do not "
                         f"match D={D}")
