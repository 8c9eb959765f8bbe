"""The SwiGLU-backward rows kernel (bwd_swiglu.py, kernel A's cuBLAS side) vs float64 math on
every used row, outputs poisoned first; padding rows (dh = 0) must come out exactly zero."""

import pytest
import torch
import torch.nn.functional as F

from moe_testing import POISON, plan_for, rel_err, routing
from torchtitan_megamoe.ops.hopper.kernels.swiglu_bwd_rows import swiglu_bwd_rows

T, K, E, H = 13, 3, 5, 40  # H not a multiple of the 32-column inner tile below


@pytest.mark.parametrize("case", ["uneven", "one_expert", "all_dropped"])
def test_swiglu_bwd_rows_vs_f64(case):
    ids = routing(case, T, K, E, seed=1)
    plan = plan_for(ids, E, 16)
    R = plan.max_rows
    g = torch.Generator().manual_seed(2)
    slot = plan.row_slot.long()
    pad = slot < 0
    dh = torch.randn(R, H, generator=g).bfloat16().masked_fill(pad[:, None], 0.0)
    a = torch.randn(R, 2 * H, generator=g).bfloat16()
    tw = torch.rand(T, K, generator=g)
    tw[ids < 0] = float("nan")  # dropped slots have no row: their weight is never read
    out = tuple(torch.full_like(t, POISON) for t in (a, dh)) + (torch.full((1, R), POISON),)
    da, hw, part = swiglu_bwd_rows(dh, a, tw, plan, out=out, block_h=32)

    used = int(plan.num_rows_used)
    a1, a3, d = a[:used, :H].double(), a[:used, H:].double(), dh[:used].double()
    w = torch.where(slot[:used] >= 0, tw.reshape(-1)[slot[:used].clamp(min=0)].double(), 0.0)
    sig = torch.sigmoid(a1)
    h = F.silu(a1) * a3
    want_da = torch.cat([w[:, None] * d * a3 * (sig + a1 * sig * (1 - sig)),
                         w[:, None] * d * F.silu(a1)], 1)
    if used == 0:
        return
    assert rel_err(da[:used], want_da) < 1e-2
    assert rel_err(hw[:used], w[:, None] * h) < 1e-2
    assert rel_err(part[0, :used], (d * h).sum(1)) < 1e-3
    padding = pad[:used]
    assert (da[:used][padding] == 0).all() and (hw[:used][padding] == 0).all()
    assert (part[0, :used][padding] == 0).all()
