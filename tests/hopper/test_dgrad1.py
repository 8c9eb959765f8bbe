"""Kernel C (dgrad L1 into slot rows) vs float64."""

import pytest
import torch

from moe_testing import POISON, SMALL, assert_close, plan_for, routing, same_bits
from torchtitan_megamoe.ops.hopper.kernels.dgrad1 import dgrad1

BLK = dict(block_n=16, block_k=16)


def _inputs(plan, E, H, D, seed=0):
    """da with NaN in every non-real row (padding rows must not reach a slot), weights."""
    g = torch.Generator().manual_seed(seed)
    da = torch.randn(plan.max_rows, 2 * H, generator=g).bfloat16()
    da[plan.row_slot < 0] = POISON
    w1 = (torch.randn(E, H, D, generator=g) * H**-0.5).bfloat16()
    w3 = (torch.randn(E, H, D, generator=g) * H**-0.5).bfloat16()
    return da, w1, w3


def _run_and_check(ids, E, H, D, seed=0, use_tma=False):
    T, K = ids.shape
    plan = plan_for(ids, E)
    da, w1, w3 = _inputs(plan, E, H, D, seed)
    out = torch.full((T * K, D), POISON, dtype=torch.bfloat16)
    dgrad1(da, w1, w3, plan, out=out, use_tma=use_tma, **BLK)
    ref = torch.full((T * K, D), float("nan"), dtype=torch.float64)
    flat = ids.reshape(-1)
    rows = plan.slot_row.long()
    for s in range(T * K):
        if flat[s] >= 0:
            r, e = rows[s], flat[s]
            ref[s] = da[r, :H].double() @ w1[e].double() + da[r, H:].double() @ w3[e].double()
    live = flat >= 0
    assert_close(out[live], ref[live])
    assert torch.isnan(out[~live]).all(), "dropped slots must not be written"
    return out


@pytest.mark.parametrize("case", ["uneven", "one_expert", "all_dropped"])
def test_dgrad_l1_routings(case):
    T, K, E, D, H = SMALL["T"], SMALL["K"], SMALL["E"], SMALL["D"], SMALL["H"]
    _run_and_check(routing(case, T, K, E), E, H, D)


@pytest.mark.parametrize("use_tma", [False, True], ids=["pointers", "tma"])
def test_dgrad_l1_even_shapes(use_tma):
    """D and H multiples of the tiles: the unmasked (EVEN) path, and TMA weight loads."""
    T, K, E = SMALL["T"], SMALL["K"], SMALL["E"]
    _run_and_check(routing("uneven", T, K, E, seed=9), E, 32, 32, seed=9, use_tma=use_tma)


def test_dgrad_l1_single_token():
    _run_and_check(torch.tensor([[1, -1, 0]]), 2, 20, 24, seed=5)


def test_dgrad_l1_deterministic():
    T, K, E, D, H = SMALL["T"], SMALL["K"], SMALL["E"], SMALL["D"], SMALL["H"]
    ids = routing("uneven", T, K, E, seed=2)
    assert same_bits(_run_and_check(ids, E, H, D, seed=2), _run_and_check(ids, E, H, D, seed=2))
