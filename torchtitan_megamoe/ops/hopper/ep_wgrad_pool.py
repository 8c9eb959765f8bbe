"""The EP backward's weight gradients once over every region's rows (ep_backward.py).

Region by region, each region's weight-gradient GEMMs would run over its own rows only and add
to fp32 sums: at EP=8 a rank's sums are read and written once per region (30B: 0.3 GB of fp32
per region and rank) and every K-loop is an R-th as long. Instead, right after each region's
SwiGLU backward, its da and hw rows are copied (kernels/pool_rows.py) into one pool laid out by
ONE plan over the slots of all R regions: expert-major, within an expert by region 0..R-1, then
by slot (a fixed order). After the last region, wgrad_dw2 and wgrad_dw13 run once over the
pool, reading dy and x rows from the exchange's receive buffers (every region's are there by
then), and add to the sums.

The pool holds what a rank receives at uniform routing times POOL_MARGIN, not R worst-case
regions. Which regions go in is decided on the device before the first region computes: the
longest prefix of the compute order whose rows fit. A region that does not fit (a skewed
routing) runs its weight gradients on its own as before; its plan is masked for the pooled
regions (Plan.masked), so those launches do nothing there. Nothing is dropped, no host sync.
"""

import torch

from torchtitan_megamoe.ops.hopper.kernels.pool_rows import pool_rows
from torchtitan_megamoe.ops.hopper.plan import Plan, build_plan

POOL_MARGIN = 1.25
"""The pool holds this many times the slots a rank receives at uniform routing (C*K)."""


def pool_size(C: int, K: int, E_local: int, block_m: int) -> int:
    """Rows of the pool: the margin over C*K slots plus one segment's padding per expert."""
    rows = int(POOL_MARGIN * C * K) + E_local * (block_m - 1)
    return -(-rows // block_m) * block_m


class WgradPool:
    """The pooled rows of one EP backward call. ``ids`` [R*C, K]: the received local expert
    ids (-1: not here), regions back to back; ``me``: this rank (regions are computed in the
    order me, me+1, ...)."""

    def __init__(self, ids: torch.Tensor, R: int, C: int, me: int, E_local: int, H: int,
                 block_m: int, dtype: torch.dtype):
        K = ids.shape[1]
        self.S, self.block_m = C * K, block_m
        rows = pool_size(C, K, E_local, block_m)
        # real rows per region, in compute order; the pool's rows are at most their sum plus
        # (block_m - 1) of padding per expert
        n = torch.roll((ids.view(R, C * K) >= 0).sum(1), -me)
        fits = torch.cumsum(n, 0) + E_local * (block_m - 1) <= rows
        kept = torch.roll(fits, me)  # by region
        self.live = (~kept).to(torch.int32)  # 1: the region's weight gradients run alone
        pooled = torch.where(kept.view(R, 1, 1), ids.view(R, C, K), -1).view(R * C, K)
        self.plan: Plan = build_plan(pooled, E_local, block_m, rows=rows)
        dev = ids.device
        self.da = torch.empty((rows, 2 * H), dtype=dtype, device=dev)
        self.hw = torch.empty((rows, H), dtype=dtype, device=dev)
        self._first = True

    def alone(self, s: int) -> torch.Tensor:
        """0-d int32 on the device: 1 where region s's weight gradients run on its own."""
        return self.live[s]

    def take(self, s: int, plan: Plan, da: torch.Tensor, hw: torch.Tensor) -> None:
        """Region s's da and hw rows (its plan's row space) into the pool, if it is pooled;
        the first call also zeroes the pool's padding rows."""
        for src, dst in ((da, self.da), (hw, self.hw)):
            pool_rows(src, dst, self.plan, plan, s, zero_pad=self._first)
        self._first = False

    def release(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(da, hw) of the pool, handed over: the pool keeps no reference (the weight
        gradients free hw after dw2)."""
        da, hw, self.da, self.hw = self.da, self.hw, None, None
        return da, hw
