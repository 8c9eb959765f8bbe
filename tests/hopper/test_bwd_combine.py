"""Backward combine (sum over k of dx slots, d(topk_weights) from partials) vs float64."""

import pytest
import torch

from moe_testing import POISON, SMALL, assert_close, plan_for, routing, same_bits
from torchtitan_megamoe.ops.hopper.kernels.bwd_combine import bwd_combine


def _run_and_check(ids, E, D, n_part=3, dx_dtype=torch.bfloat16, seed=0):
    T, K = ids.shape
    plan = plan_for(ids, E)
    g = torch.Generator().manual_seed(seed)
    live = ids.reshape(-1) >= 0
    dx_slot = torch.randn(T * K, D, generator=g).bfloat16()
    dx_slot[~live] = POISON  # dropped slots are never written by kernel C
    part = torch.randn(n_part, plan.max_rows, generator=g)
    part[:, plan.row_slot < 0] = POISON
    dx, dtw = bwd_combine(dx_slot, part, plan, dx_dtype=dx_dtype, dtw_dtype=torch.float32,
                          block_t=4, block_d=16)
    ref_dx = (dx_slot.double() * live[:, None]).nan_to_num().view(T, K, D).sum(1)
    rows = plan.slot_row.long().clamp(min=0)
    ref_dtw = torch.where(live, part.double().sum(0)[rows], 0).view(T, K)
    assert_close(dx, ref_dx, name="dx")
    assert_close(dtw, ref_dtw, tol=1e-5, name="dtw")
    assert dx.dtype == dx_dtype
    return dx, dtw


@pytest.mark.parametrize("case", ["uneven", "one_expert", "all_dropped"])
def test_bwd_combine_routings(case):
    T, K, E, D = SMALL["T"], SMALL["K"], SMALL["E"], SMALL["D"]
    _run_and_check(routing(case, T, K, E), E, D)


def test_bwd_combine_single_token_fp32():
    _run_and_check(torch.tensor([[0, -1]]), 2, 20, n_part=1, dx_dtype=torch.float32)


def test_bwd_combine_deterministic():
    T, K, E, D = SMALL["T"], SMALL["K"], SMALL["E"], SMALL["D"]
    ids = routing("uneven", T, K, E, seed=3)
    a = _run_and_check(ids, E, D, seed=3)
    b = _run_and_check(ids, E, D, seed=3)
    assert same_bits(a[0], b[0]) and same_bits(a[1], b[1])


@pytest.mark.parametrize("case", ["uneven", "one_expert"])
def test_bwd_combine_reads_row_space_dx_through_slot_row(case):
    """rows=True (the sm90 kernel C's output): slot s's dx row is dx_rows[slot_row[s]]; the
    result is bitwise the slot-space combine of the same rows."""
    T, K, E, D = SMALL["T"], SMALL["K"], SMALL["E"], SMALL["D"]
    ids = routing(case, T, K, E, seed=5)
    plan = plan_for(ids, E)
    g = torch.Generator().manual_seed(5)
    dx_rows = torch.full((plan.max_rows, D), POISON).bfloat16()  # padding / unused rows
    live = plan.slot_row.long() >= 0
    used_rows = plan.slot_row.long()[live]
    dx_rows[used_rows] = torch.randn(len(used_rows), D, generator=g).bfloat16()
    part = torch.randn(2, plan.max_rows, generator=g)
    dx_slot = torch.full((T * K, D), POISON).bfloat16()
    dx_slot[live] = dx_rows[used_rows]
    kw = dict(dx_dtype=torch.bfloat16, dtw_dtype=torch.float32, block_t=4, block_d=16)
    dx, dtw = bwd_combine(dx_rows, part, plan, rows=True, **kw)
    ref_dx, ref_dtw = bwd_combine(dx_slot, part, plan, **kw)
    assert not dx.isnan().any()
    assert same_bits(dx, ref_dx) and same_bits(dtw, ref_dtw)
    with pytest.raises(ValueError, match=rf"\[{plan.max_rows}, D\]"):
        bwd_combine(dx_slot, part, plan, rows=True, **kw)


def test_bwd_combine_live_rows_only():
    """live = n (an EP peer region: the rows that go home): the first n tokens' dx and
    d(topk_weights) bitwise those of the whole call."""
    T, K, E, D = SMALL["T"], SMALL["K"], SMALL["E"], SMALL["D"]
    ids = routing("uneven", T, K, E, seed=7)
    plan = plan_for(ids, E)
    g = torch.Generator().manual_seed(7)
    dx_slot = torch.randn(T * K, D, generator=g).bfloat16()
    part = torch.randn(2, plan.max_rows, generator=g)
    whole = bwd_combine(dx_slot, part, plan, dx_dtype=torch.bfloat16, dtw_dtype=torch.float32,
                        block_t=4, block_d=16)
    n = T // 2 + 1  # not a multiple of block_t
    some = bwd_combine(dx_slot, part, plan, dx_dtype=torch.bfloat16, dtw_dtype=torch.float32,
                       block_t=4, block_d=16, live=torch.tensor([n], dtype=torch.int32))
    assert same_bits(some[0][:n], whole[0][:n]) and same_bits(some[1][:n], whole[1][:n])
