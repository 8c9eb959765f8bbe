"""What the op's wrappers ask of a CUDA device on every call (its compute capability, its SM
count), asked of torch once per device: each torch.cuda query is Python and driver work on the host,
which a waited forward pays before its first GEMM."""

from __future__ import annotations

import functools

import torch


def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA ``device``."""
    return _properties(_index(device))[0]


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``."""
    return _properties(_index(device))[1]


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _properties(index: int) -> tuple[tuple[int, int], int]:
    p = torch.cuda.get_device_properties(index)
    return (p.major, p.minor), p.multi_processor_count


def is_hopper(device: torch.device) -> bool:
    """Whether ``device`` is a GPU the hopper backend's sm_90a kernels run on (compute
    capability 9.0): the one architecture check of the package."""
    return device.type == "cuda" and capability(device) == (9, 0)


def hopper_present() -> bool:
    """Whether this process's current CUDA device is one (is_hopper)."""
    return torch.cuda.is_available() and is_hopper(torch.device("cuda"))
