"""What the op asks of an expert-parallel group, in one place: a torch.distributed ProcessGroup
or a loopback rank (ops/loopback.py, R ranks in one process); ``None`` is one rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchtitan_megamoe.ops import loopback


def group_size(group) -> int:
    if loopback.is_loopback(group):
        return group.size
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    if loopback.is_loopback(group):
        return group.rank
    return 0 if group is None else dist.get_rank(group)


def all_reduce_max(group, value: int, device: torch.device) -> int:
    """The largest ``value`` over the group's ranks (a collective: every rank calls it)."""
    if loopback.is_loopback(group):
        return max(group.gather(int(value)))
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def group_from_name(group_name: str):
    """The group a ``group_name`` (what the registered op carries) stands for; "" is None."""
    if not group_name:
        return None
    if group_name.startswith(loopback.PREFIX):
        return loopback.resolve(group_name)
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)
