"""The shared helpers' own checks (tests/moe_testing.py): the float64 reference against the
formula written out slot by slot, its gradients against finite differences, the per-slot
closed forms that the kernel tests compare with against its autograd, and the routings."""

import pytest
import torch
import torch.nn.functional as F

from moe_testing import (
    BACKWARD_ROUTINGS, FORWARD_ROUTINGS, grads_f64, make_inputs, moe_f64, per_slot_f64, rel_err,
    routing, routings,
)


def _slot_by_slot(x, ids, w, w1, w2, w3):
    """The formula, one (token, slot) at a time."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            xt = x[t].double()
            h = F.silu(w1[e].double() @ xt) * (w3[e].double() @ xt)
            out[t] += w[t, k].double() * (w2[e].double() @ h)
    return out


@pytest.mark.parametrize("name", sorted(set(FORWARD_ROUTINGS + BACKWARD_ROUTINGS
                                            + ("empty_experts", "all_dropped_but_one"))))
def test_moe_f64_is_the_formula_slot_by_slot(name):
    T, K, E, D, H = 9, 3, 5, 8, 6
    ids = routing(name, T, K, E, seed=1)
    inp = make_inputs(ids.shape[0], K, E, D, H, ids, seed=1, dtype=torch.float64)
    w = inp["topk_weights"].clone()
    w[ids < 0] = float("nan")  # a dropped slot's weight is never read
    got = moe_f64(inp["x"], ids, w, inp["w1"], inp["w2"], inp["w3"])
    want = _slot_by_slot(inp["x"], ids, w, inp["w1"], inp["w2"], inp["w3"])
    assert got.dtype == torch.float64 and torch.isfinite(got).all()
    assert rel_err(got, want) < 1e-13


def test_moe_f64_gradcheck():
    """moe_f64 is differentiable as written (finite differences)."""
    T, K, E, D, H = 3, 2, 2, 3, 2
    ids = torch.tensor([[0, 1], [1, -1], [1, 0]])
    inp = make_inputs(T, K, E, D, H, ids, dtype=torch.float64)
    args = [inp[k].requires_grad_() for k in ("x", "topk_weights", "w1", "w2", "w3")]
    assert torch.autograd.gradcheck(
        lambda x, tw, w1, w2, w3: moe_f64(x, ids, tw, w1, w2, w3), args
    )


@pytest.mark.parametrize("case", [0, 1])
def test_closed_forms_match_autograd(case):
    """The per-slot formulas the kernels implement reproduce float64 autograd of the forward."""
    T, K, E, D, H = 5, 2, 3, 6, 4
    name = BACKWARD_ROUTINGS[case]
    ids = routing(name, T, K, E, seed=case)
    inp = make_inputs(T, K, E, D, H, ids, seed=case, dtype=torch.float64)
    dx, dtw, dw1, dw2, dw3 = grads_f64(inp)
    ps = per_slot_f64(inp)
    torch.testing.assert_close(ps["dx_slot"].view(T, K, D).sum(1), dx)
    torch.testing.assert_close(ps["dtw"].view(T, K), dtw)
    slot_e = ids.reshape(-1)
    tok = torch.arange(T * K) // K
    for e in range(E):
        sel = slot_e == e
        xs, dys = inp["x"][tok[sel]], inp["dy"][tok[sel]]
        torch.testing.assert_close(ps["da1"][sel].T @ xs, dw1[e])
        torch.testing.assert_close(ps["da3"][sel].T @ xs, dw3[e])
        torch.testing.assert_close(dys.T @ ps["hw"][sel], dw2[e])


def test_grads_f64_of_nothing_routed_are_zeros():
    inp = make_inputs(4, 2, 3, 8, 6, routing("all_dropped", 4, 2, 3), dtype=torch.float64)
    for g, k in zip(grads_f64(inp), ("x", "topk_weights", "w1", "w2", "w3")):
        assert g.shape == inp[k].shape and (g == 0).all(), k


def test_routings_are_what_their_names_say():
    T, K, E = 31, 3, 6
    cases = dict(routings(T, K, E, names=FORWARD_ROUTINGS + BACKWARD_ROUTINGS
                          + ("empty_experts", "all_dropped_but_one")))
    for name, ids in cases.items():
        assert ids.dtype == torch.int64 and ids.shape == ((1, K) if name == "t1" else (T, K))
        assert ((ids >= -1) & (ids < E)).all(), name
        for row in ids.tolist():  # the experts of a token are distinct, as top-k gives
            live = [e for e in row if e >= 0]
            assert len(live) == len(set(live)), (name, row)
    assert (cases["random"] >= 0).all() and (cases["dropped"] < 0).any()
    assert not (cases["uneven"] == 1).any() and (cases["uneven"] < 0).any()
    assert set(cases["one_expert"].unique().tolist()) == {-1, E - 1}
    assert (cases["all_dropped"] < 0).all()
    assert set(cases["empty_experts"].unique().tolist()) == {-1, 0, 1}
    assert (cases["all_dropped_but_one"] >= 0).sum() == 1
    assert torch.equal(routing("uneven", T, K, E, seed=4), routing("uneven", T, K, E, seed=4))


def test_rel_err():
    a = torch.tensor([3.0, 4.0])
    assert rel_err(a, a) == 0 and rel_err(torch.zeros(2), torch.zeros(2)) == 0
    assert rel_err(torch.zeros(2), a) == 1 and rel_err(a, torch.zeros(2)) == float("inf")
    assert rel_err(a.bfloat16(), a.double()) == 0
