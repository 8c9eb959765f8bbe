"""Tile-order helpers shared by the grouped GEMM kernels."""

import os

import torch
import triton
import triton.language as tl


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


def persistent_programs(device: torch.device) -> int:
    """Programs of a persistent launch: one per SM (a few under the CPU interpreter)."""
    if os.environ.get("TRITON_INTERPRET") == "1" or device.type != "cuda":
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count
