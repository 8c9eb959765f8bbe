"""Expert-parallel routing of the reference backend through torch.distributed all_to_all.

Each valid slot's row goes to the rank owning its expert and its result comes back to the source
slot: the plainest correct EP, with host-synced split sizes. It is the oracle's, deliberately
independent of the hopper backend's token exchange (ops/hopper/ep_transport.py,
ops/hopper/ep_dispatch.py), which sends each token once per owning rank, without a host sync.
It needs no capacity, but applies ``max_tokens_per_rank`` as the hopper backend does, so a
setting too small for the traffic fails the same way on both.
"""

import torch
import torch.distributed as dist

from torchtitan_megamoe.ops.options import capacity_error


def slot_rows(t, K, slots):
    """Row of ``t`` ([T, D]) for each slot (t, k), without materializing [T*K, D]."""
    return t[torch.div(slots, K, rounding_mode="floor")]


class AllToAllRoute:
    """Where each valid slot goes: destination rank and local expert, and the exchanges.

    Slots are sorted by global expert id (stable): grouped by destination rank, then by local
    expert, and within an expert in increasing slot order, so the whole op is deterministic."""

    def __init__(self, topk_ids, num_local_experts, group, max_tokens_per_rank=0):
        flat = topk_ids.reshape(-1).long()
        slots = torch.nonzero(flat >= 0).squeeze(1)
        slots = slots[torch.argsort(flat[slots], stable=True)]
        expert = flat[slots]
        self.slots = slots
        self.group = group
        self.R = 1 if group is None else dist.get_world_size(group)
        local_expert = expert % num_local_experts
        if self.R > 1:
            send = torch.bincount(expert // num_local_experts, minlength=self.R)
            # each rank's token count travels with its split sizes, so that every rank sees a
            # batch over the capacity and all of them raise (none waits in an exchange)
            send = torch.stack([send, torch.full_like(send, topk_ids.shape[0])], dim=1)
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=group)
            # split sizes go through the host: one sync per call (the symmetric-memory path has none)
            self.send_splits, self.recv_splits = send[:, 0].tolist(), recv[:, 0].tolist()
            tokens = recv[:, 1].tolist()
            if max_tokens_per_rank and max(tokens) > max_tokens_per_rank:
                rank = tokens.index(max(tokens))
                raise capacity_error(max(tokens), max_tokens_per_rank, f"rank {rank} of the group")
            local_expert = self.dispatch(local_expert)
        self.local_expert = local_expert

    def dispatch(self, rows):
        """Rows in slot order -> rows on the ranks that own their experts."""
        if self.R == 1:
            return rows
        return all_to_all_rows(rows, self.recv_splits, self.send_splits, self.group)

    def combine(self, rows):
        """The reverse of dispatch: expert-side rows back to their source ranks, slot order."""
        if self.R == 1:
            return rows
        return all_to_all_rows(rows, self.send_splits, self.recv_splits, self.group)

    def to_slots(self, rows, num_slots):
        """[valid slots, ...] -> [num_slots, ...] with zeros for dropped slots (unique indices)."""
        out = rows.new_zeros((num_slots,) + tuple(rows.shape[1:]))
        return out.index_put((self.slots,), rows)


def all_to_all_rows(rows, out_splits, in_splits, group):
    out = rows.new_empty((sum(out_splits),) + tuple(rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
    return out
