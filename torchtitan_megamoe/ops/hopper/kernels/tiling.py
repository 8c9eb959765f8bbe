"""Tile-order helpers shared by the grouped GEMM kernels."""

import torch
import triton
import triton.language as tl

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.device import sm_count


@triton.jit
def grouped_tile(t, num_m, num_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of linear tile t: GROUP_M consecutive M tiles sweep one N tile together,
    so an expert's weight tile is read from L2 rather than HBM by all of them, and each A tile
    is reused across N from L2."""
    per_group = GROUP_M * num_n
    first_m = (t // per_group) * GROUP_M
    group_size = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (t % per_group) % group_size
    pid_n = (t % per_group) // group_size
    return pid_m, pid_n


LAUNCH_KNOBS = ("num_warps", "num_stages")
"""Config keys that Triton's launcher takes as they are; every other key is a kernel constexpr."""


def constexprs(cfg: dict) -> dict:
    """A TritonGemm's kwargs() (lowercase keys) as a Triton launch's keyword
    arguments: block_m -> BLOCK_M, use_tma -> USE_TMA, ...; num_warps and num_stages as they
    are."""
    return {k if k in LAUNCH_KNOBS else k.upper(): v for k, v in cfg.items()}


def launch_config(cfg: dict, num_tiles: int, device: torch.device,
                  flags=("use_tma", "persistent")) -> tuple[dict, tuple]:
    """(the launch's keyword arguments, with the boolean ``flags`` defaulted to False, grid):
    one program per SM when persistent, else one per tile."""
    cfg = dict(cfg)
    for f in flags:
        cfg.setdefault(f, False)
    grid = (persistent_programs(device),) if cfg["persistent"] else (num_tiles,)
    return constexprs(cfg), grid


def cdiv(a: int, b: int) -> int:
    """triton.cdiv for host ints. Triton's host helpers are constexpr functions that wrap
    every call (argument unwrapping, an import), and the launchers make ~15 such calls before a
    forward's first GEMM."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 for host ints (0 for n <= 0, as Triton's)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def persistent_programs(device: torch.device) -> int:
    """Programs of a persistent launch: one per SM (a few under the CPU interpreter)."""
    if settings.triton_interpreting() or device.type != "cuda":
        return 3
    return sm_count(device)


@triton.jit
def cast_out(x, dtype: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """x (fp32) cast to the output dtype. The CPU interpreter (seen with Triton 3.9) truncates
    fp32 -> bf16 instead of rounding to nearest even, which biases every stored value toward
    zero (~1% over the three stores of the forward); with EMULATE_RTNE the rounding is done on
    the bits first so the truncation lands on the RTNE result, as the GPU's cvt.rn does."""
    if EMULATE_RTNE:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)).to(tl.float32, bitcast=True)
            # zeros and denormals keep their value (the interpreter mangles tiny denormals)
            x = tl.where((bits & 0x7F800000) != 0, rounded, x)
    return x.to(dtype)
