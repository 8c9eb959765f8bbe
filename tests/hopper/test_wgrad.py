"""Kernel B (grouped weight gradients) vs float64 per-expert sums."""

import pytest
import torch

from moe_testing import POISON, SMALL, assert_close, plan_for, routing, same_bits
from torchtitan_megamoe.ops.hopper.kernels.wgrad import longest_first, wgrad

BLK = dict(block_m=16, block_n=16, block_k=8)


def _operands(plan, T, M, N, a_gather, b_gather, seed=0, pad=POISON):
    """a, b operands; row-space buffers get NaN in every row past the used ones and ``pad`` in
    the padding rows of segments (NaN: proves they are not read; a large finite value, for the
    TMA path that reads them: proves they contribute nothing)."""
    g = torch.Generator().manual_seed(seed)
    real = plan.row_slot >= 0
    used = torch.arange(plan.max_rows) < int(plan.num_rows_used)

    def make(cols, gather):
        if gather:
            return torch.randn(T, cols, generator=g).bfloat16()
        t = torch.randn(plan.max_rows, cols, generator=g).bfloat16()
        t[~real] = pad
        t[~used] = POISON
        return t

    return make(M, a_gather), make(N, b_gather)


def _expected(plan, a, b, a_gather, b_gather, E):
    K = plan.top_k
    out = torch.zeros(E, a.shape[1], b.shape[1], dtype=torch.float64)
    row_slot = plan.row_slot.long()
    for r in range(plan.max_rows):
        s = row_slot[r].item()
        if s < 0:
            continue
        e = int(torch.searchsorted(plan.seg_start[1:].long(), torch.tensor(r), right=True))
        ar = a[s // K] if a_gather else a[r]
        br = b[s // K] if b_gather else b[r]
        out[e] += torch.outer(ar.double(), br.double())
    return out


@pytest.mark.parametrize("case", ["uneven", "one_expert", "all_dropped"])
@pytest.mark.parametrize("gather", [(True, False), (False, True)], ids=["dw2", "dw13"])
def test_wgrad_routings(case, gather):
    T, K, E = SMALL["T"], SMALL["K"], SMALL["E"]
    M, N = 24, 40
    ids = routing(case, T, K, E)
    plan = plan_for(ids, E)
    a, b = _operands(plan, T, M, N, *gather)
    out = torch.full((E, M, N), POISON, dtype=torch.bfloat16)
    wgrad(a, b, out, plan, a_gather=gather[0], b_gather=gather[1], **BLK)
    ref = _expected(plan, a, b, *gather, E)
    assert_close(out, ref, name=case)
    empty = plan.count == 0
    assert (out[empty] == 0).all(), "experts without rows must get zero gradients"


@pytest.mark.parametrize("use_tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("gather", [(True, False), (False, True)], ids=["dw2", "dw13"])
def test_wgrad_even_shapes(gather, use_tma):
    """M, N multiples of the tiles (no column masks); TMA for the row-space operand."""
    T, K, E = SMALL["T"], SMALL["K"], SMALL["E"]
    M, N = 32, 16
    ids = routing("uneven", T, K, E, seed=5)
    plan = plan_for(ids, E)
    a, b = _operands(plan, T, M, N, *gather, seed=5, pad=1e4 if use_tma else POISON)
    out = torch.full((E, M, N), POISON, dtype=torch.bfloat16)
    wgrad(a, b, out, plan, a_gather=gather[0], b_gather=gather[1], use_tma=use_tma, **BLK)
    assert_close(out, _expected(plan, a, b, *gather, E))


def test_wgrad_layout_dtype_and_single_token():
    """fp32 parameter with a transposed layout; T=1 routed to two experts."""
    E, M, N = 3, 20, 12
    ids = torch.tensor([[2, 0]])
    plan = plan_for(ids, E)
    a, b = _operands(plan, 1, M, N, False, True, seed=2)
    out = torch.full((E, N, M), POISON, dtype=torch.float32).transpose(1, 2)
    wgrad(a, b, out, plan, a_gather=False, b_gather=True, **BLK)
    assert_close(out, _expected(plan, a, b, False, True, E), tol=1e-5)


def test_wgrad_deterministic():
    T, K, E = SMALL["T"], SMALL["K"], SMALL["E"]
    ids = routing("uneven", T, K, E, seed=4)
    plan = plan_for(ids, E)
    a, b = _operands(plan, T, 24, 40, True, False, seed=4)
    outs = [wgrad(a, b, torch.empty(E, 24, 40, dtype=torch.bfloat16), plan,
                  a_gather=True, b_gather=False, **BLK) for _ in range(2)]
    assert same_bits(*outs)


def test_wgrad_rejects_bad_shapes():
    plan = plan_for(torch.tensor([[0, 1]]), 2)
    a = torch.zeros(plan.max_rows, 4, dtype=torch.bfloat16)
    b = torch.zeros(3, 4, dtype=torch.bfloat16)  # T is 1
    with pytest.raises(ValueError, match="expected"):
        wgrad(a, b, torch.empty(2, 4, 4), plan, a_gather=False, b_gather=True)


def test_wgrad_expert_order_does_not_change_results():
    """Launch order of the experts' tiles (largest first by default) leaves every bit as is."""
    T, K, E = SMALL["T"], SMALL["K"], SMALL["E"]
    ids = routing("uneven", T, K, E, seed=6)
    plan = plan_for(ids, E)
    order = longest_first(plan)
    counts = plan.count[order.long()]
    assert sorted(order.tolist()) == list(range(E)) and (counts[:-1] >= counts[1:]).all()
    a, b = _operands(plan, T, 24, 40, False, True, seed=6)
    outs = [wgrad(a, b, torch.empty(E, 24, 40, dtype=torch.bfloat16), plan, a_gather=False,
                  b_gather=True, expert_order=o, **BLK)
            for o in (order, torch.arange(E, dtype=torch.int32))]
    assert same_bits(*outs)


@pytest.mark.parametrize("gather", [(True, False), (False, True)], ids=["dw2", "dw13"])
def test_wgrad_accumulate_adds_to_fp32_out_bitwise(gather):
    """accumulate: out + the gradient, the bits of a fresh launch followed by an add pass (the
    EP backward's sums over regions); experts without rows leave out as it was."""
    T, K, E = SMALL["T"], SMALL["K"], SMALL["E"]
    ids = routing("uneven", T, K, E, seed=7)
    plan = plan_for(ids, E)
    a, b = _operands(plan, T, 24, 40, *gather, seed=7)
    before = torch.randn(E, 24, 40, generator=torch.Generator().manual_seed(8))
    fresh = wgrad(a, b, torch.empty(E, 24, 40), plan, a_gather=gather[0], b_gather=gather[1],
                  **BLK)
    got = wgrad(a, b, before.clone(), plan, a_gather=gather[0], b_gather=gather[1],
                accumulate=True, **BLK)
    assert same_bits(got, before + fresh)
    with pytest.raises(ValueError, match="fp32"):
        wgrad(a, b, torch.empty(E, 24, 40, dtype=torch.bfloat16), plan, a_gather=gather[0],
              b_gather=gather[1], accumulate=True, **BLK)
