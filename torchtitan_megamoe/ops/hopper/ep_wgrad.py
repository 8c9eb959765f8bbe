"""The EP backward's dw1 and dw3 over all its kept regions in one launch (ep_backward.py).

Added region by region, each region's dw1|dw3 is one read-modify-write of the [E, 2H, D] fp32
sums: at EP=8 eight passes over them per call, bandwidth the GEMMs do not hide. Instead, each
region the forward's store kept (kernels/row_store.kept_slots) leaves its da written over its
saved a (its slot of the store: the call owns it, the op's eager backward) and its row slots,
offset to its source's rows of the x receive buffer, in its slot of a row-slot store; after the
last region one launch walks every kept region's rows per expert, gathering their x rows from
the receive buffer inside the kernel (cuda/wgrad.wgrad_dw13_regions_sm90): one sum in the
registers, added to the sums once. The own region's x rows go into the receive buffer's own
region first (its backward reads them in place). A region the store did not keep (later
regions overwrite its rows) adds its own dw1|dw3 right away. Which regions were kept is known
on the device only, so each region's launch takes the counts zeroed where its region was kept
and the last one the counts zeroed where not: no host sync, the same gradients on every call
(fixed order: the unkept regions in compute order, then the kept ones as one sum).

Memory: the row-slot store, R * S int32; no region's da or x rows buffer, no copy of x rows.
The x receive buffer is read until the call's last barrier, which orders it before any peer's
next dispatch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from torchtitan_megamoe.ops.hopper.cuda import wgrad as sm90_wgrad
from torchtitan_megamoe.ops.hopper.kernels.row_store import slot_view
from torchtitan_megamoe.ops.hopper.plan import Plan


class KeptRegion(NamedTuple):
    """One region's part (bf16_backward.backward_bf16's ``keep``)."""

    da: torch.Tensor  # where its da goes: its saved a (its slot's view of the store)
    row_slot: torch.Tensor  # its slot of the row-slot store [S]
    slot_base: int  # its source's first slot in the x receive buffer: s * C * K
    x_home: torch.Tensor  # its source's region of the x receive buffer [C, D]
    count: torch.Tensor  # [E] its plan's counts, 0 where the region was kept

    def dw13(self, ops) -> tuple:
        """dw1 and dw3 added to ``ops.into`` (a sides.wgrad.Operands) from this region's rows
        unless the store kept them; its first S row slots (offset) kept either way."""
        rs = ops.plan.row_slot[: self.row_slot.shape[0]]
        torch.where(rs >= 0, rs + self.slot_base, rs, out=self.row_slot)  # padding stays -1
        if ops.x.data_ptr() != self.x_home.data_ptr():  # the own rows, read in place so far
            self.x_home[: ops.x.shape[0]].copy_(ops.x)
        outs = ops.into.outs
        return sm90_wgrad.wgrad_dw13_sm90(ops.da, ops.x, ops.plan.replaced(count=self.count),
                                          outs[0], outs[2], ops.order,
                                          accumulate=ops.into.accumulate)


class KeptRows:
    """The call's kept regions: ``region(i)`` for the i-th region computed, then ``dw13(sums)``
    after the last one. ``store``: the forward's store of a (da goes over it); ``plans`` and
    ``sources``: the regions' plans and source ranks in compute order; ``kept``: [R] device
    bool, kept_slots'; ``S``/``M``: the slot rows and view rows; ``x_recv``: the x receive
    buffer [R, C, D]."""

    def __init__(self, store: torch.Tensor, plans: list[Plan], sources: list[int],
                 kept: torch.Tensor, S: int, M: int, x_recv: torch.Tensor):
        self.store, self.plans, self.sources, self.kept, self.S, self.M = (
            store, plans, sources, kept, S, M)
        self.x_recv = x_recv
        self.row_slot = torch.empty(len(plans) * S, dtype=torch.int32, device=store.device)

    def region(self, i: int) -> KeptRegion:
        count = torch.where(self.kept[i], 0, self.plans[i].count)
        s, C = self.sources[i], self.x_recv.shape[1]
        return KeptRegion(slot_view(self.store, i, self.S, self.M),
                          slot_view(self.row_slot, i, self.S, self.S),
                          s * C * self.plans[i].top_k, self.x_recv[s], count)

    def dw13(self, dw1: torch.Tensor, dw3: torch.Tensor) -> None:
        """Adds the kept regions' dw1 and dw3 to the fp32 sums (the regions' launches wrote
        them first)."""
        R = len(self.plans)
        offset = torch.arange(R, dtype=torch.int32, device=self.kept.device) * self.S
        seg_start = torch.stack([p.seg_start for p in self.plans]) + offset[:, None]
        count = torch.stack([p.count for p in self.plans]) * self.kept[:, None]
        # longest first over the regions' rows, so the tiles in flight share their rows in L2
        order = torch.argsort(count.sum(0), descending=True, stable=True).to(torch.int32)
        # the store's rows past R * S belong to no kept region
        sm90_wgrad.wgrad_dw13_regions_sm90(
            self.store[:R * self.S], self.x_recv.view(-1, self.x_recv.shape[2]), self.plans[0],
            seg_start.to(torch.int32).contiguous(), count.to(torch.int32).contiguous(), dw1,
            dw3, order, accumulate=True, row_slot=self.row_slot)
