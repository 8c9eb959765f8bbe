"""The EP backward's dw1 and dw3 over all its kept regions in one launch (ep_backward.py).

Added region by region, each region's dw1|dw3 is one read-modify-write of the [E, 2H, D] fp32
sums: at EP=8 eight passes over them per call, bandwidth the GEMMs do not hide. Instead, each
region the forward's store kept (kernels/row_store.kept_slots) leaves its da in its slot's rows
of a da store (the a store itself where the call may overwrite it: the op's eager backward)
and its x rows in the same rows of an x store, and after the last region one launch walks
every kept region's rows per expert
(cuda/wgrad.wgrad_dw13_regions_sm90): one sum in the registers, added to the sums once. A
region the store did not keep (later regions overwrite its rows) adds its own dw1|dw3 right
away, as before. Which regions were kept is known on the device only, so each region's launch
takes the counts zeroed where its region was kept and the last one the counts zeroed where
not: no host sync, the same gradients on every call (fixed order: the unkept regions in
compute order, then the kept ones as one sum).

Memory: the x store, [store rows, D], and where a may not be overwritten the da store, [store
rows, 2H]; no region's da or x rows buffer ([M, 2H] and [M, D] each) any more.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from torchtitan_megamoe.ops.hopper.cuda import wgrad as sm90_wgrad
from torchtitan_megamoe.ops.hopper.kernels.grouped_mm import gather_rows
from torchtitan_megamoe.ops.hopper.kernels.row_store import slot_view
from torchtitan_megamoe.ops.hopper.plan import Plan


class KeptRegion(NamedTuple):
    """One region's part (bf16_backward.backward_bf16's ``keep``)."""

    da: torch.Tensor  # its slot's view of the da store: where its da goes
    x_rows: torch.Tensor  # its slot's view of the x store: where its x rows go
    count: torch.Tensor  # [E] its plan's counts, 0 where the region was kept

    def dw13(self, ops) -> tuple:
        """dw1 and dw3 added to ``ops.into`` (a sides.wgrad.Operands) from this region's rows
        unless the store kept them; its x rows gathered into the store either way."""
        x_rows = gather_rows(ops.x, ops.plan, out=self.x_rows)
        outs, acc = ops.into.outs, ops.into.accumulate
        return sm90_wgrad.wgrad_dw13_sm90(ops.da, x_rows, ops.plan.with_count(self.count),
                                          outs[0], outs[2], ops.order, pre_gathered=True,
                                          accumulate=acc)


class KeptRows:
    """The call's kept regions: ``region(i)`` for the i-th region computed, then ``dw13(sums)``
    after the last one. ``store``: the forward's store of a; ``over_a``: da may go over it
    (else into a store of its own); ``plans``: the regions' plans in compute order; ``kept``:
    [R] device bool, kept_slots'; ``S``/``M``: the slot rows and view rows."""

    def __init__(self, store: torch.Tensor, over_a: bool, plans: list[Plan],
                 kept: torch.Tensor, S: int, M: int, D: int, dtype: torch.dtype):
        self.plans, self.kept, self.S, self.M = plans, kept, S, M
        self.da_store = store if over_a else torch.empty_like(store)
        self.x_store = torch.empty((store.shape[0], D), dtype=dtype, device=store.device)

    def region(self, i: int) -> KeptRegion:
        count = torch.where(self.kept[i], 0, self.plans[i].count)
        return KeptRegion(slot_view(self.da_store, i, self.S, self.M),
                          slot_view(self.x_store, i, self.S, self.M), count)

    def dw13(self, dw1: torch.Tensor, dw3: torch.Tensor) -> None:
        """Adds the kept regions' dw1 and dw3 to the fp32 sums (the regions' launches wrote
        them first)."""
        offset = torch.arange(len(self.plans), dtype=torch.int32, device=self.kept.device)
        seg_start = torch.stack([p.seg_start for p in self.plans]) + (offset * self.S)[:, None]
        count = torch.stack([p.count for p in self.plans]) * self.kept[:, None]
        # longest first over the regions' rows, so the tiles in flight share their rows in L2
        order = torch.argsort(count.sum(0), descending=True, stable=True).to(torch.int32)
        sm90_wgrad.wgrad_dw13_regions_sm90(self.da_store, self.x_store, self.plans[0],
                                           seg_start.to(torch.int32).contiguous(),
                                           count.to(torch.int32).contiguous(), dw1, dw3, order,
                                           accumulate=True)
