"""The router top-k kernel (ops/triton/topk.py) against a stable sort and torch.topk, and the
fast router path (router.py) against stock TorchTitan's router: same indices, gating values,
tokens per expert and gradients. Runs under the Triton interpreter on CPU, compiled on GPUs."""

import pytest
import torch
from torchtitan.models.moe.moe import TokenChoiceTopKRouter

from torchtitan_megamoe.ops.triton.topk import (router_topk, topk_gate, topk_indices,
                                                 topk_indices_reference)
from torchtitan_megamoe.router import fast_path_ok, route

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("T,E,K", [(37, 8, 2), (70, 60, 8), (5, 128, 8), (16, 33, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_stable_sort_and_torch_topk(T, E, K, bias):
    g = torch.Generator().manual_seed(T * E + K)
    s = torch.randn(T, E, generator=g).softmax(-1).to(DEV)
    b = (torch.randn(E, generator=g) * 0.01).to(DEV) if bias else None
    got = router_topk(s, K, b)
    assert got.dtype == torch.int64 and got.shape == (T, K)
    assert torch.equal(topk_indices(s, K, b), got)  # the eager entry point, same launch
    assert torch.equal(got, topk_indices_reference(s, K, b))
    want = torch.topk(s if b is None else s + b, K, dim=-1, sorted=True).indices
    assert torch.equal(got, want)  # random floats: no ties, so the order is unique


def test_ties_nan_and_inf():
    s = torch.tensor([
        [1.0, 3.0, 3.0, 0.0, 3.0],            # ties: lower index first
        [float("nan"), 0.0, 5.0, float("nan"), 1.0],  # NaN ranks first (torch.topk's rule)
        [-float("inf")] * 5,                   # all masked: the lowest indices, no repeats
        [0.5, -float("inf"), 0.25, 2.0, -1.0],
    ], device=DEV)
    got = router_topk(s, 3)
    assert got.tolist() == [[1, 2, 4], [0, 3, 2], [0, 1, 2], [3, 0, 2]]
    assert torch.equal(got, topk_indices_reference(s, 3))


def test_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="k <= experts"):
        router_topk(torch.zeros(4, 8, device=DEV), 9)
    with pytest.raises(ValueError, match="bias must be"):
        router_topk(torch.zeros(4, 8, device=DEV), 2, torch.zeros(7, device=DEV))


@pytest.fixture(autouse=True)
def _histc_on_cpu(monkeypatch):
    """Both routers count tokens with torch.histc on int64 ids, which only CUDA implements
    (on CPU TorchTitan runs under torchtitan_megamoe.cpu's shim, which does the same)."""
    if not torch.cuda.is_available():
        original = torch.histc
        monkeypatch.setattr(torch, "histc",
                            lambda input, *a, **kw: original(input.float(), *a, **kw).to(input.dtype))


def _router(E, K, score_func="softmax", route_norm=True, groups=None):
    torch.manual_seed(0)
    r = TokenChoiceTopKRouter(dim=32, num_experts=E, num_expert_groups=groups,
                              num_limited_groups=1 if groups else None, top_k=K,
                              score_func=score_func, route_norm=route_norm, route_scale=1.5,
                              gate_bias=False).to(DEV)
    torch.nn.init.normal_(r.gate.weight, std=0.5)
    return r


@pytest.mark.parametrize("score_func,route_norm", [("softmax", True), ("sigmoid", False)])
@pytest.mark.parametrize("bias", [False, True])
def test_route_matches_stock_router_values_and_grads(score_func, route_norm, bias):
    r = _router(16, 4, score_func, route_norm)
    x = torch.randn(50, 32, device=DEV, requires_grad=True)
    eb = torch.randn(16, device=DEV) * 0.05 if bias else None
    ts, idx, n = r(x, eb)
    x2 = x.detach().clone().requires_grad_()
    ts2, idx2, n2 = route(r, x2, eb, kernel=True)
    # torch.topk(sorted=False) returns the set in its own order: compare per-row sorted sets
    order, order2 = idx.sort(-1), idx2.sort(-1)
    assert torch.equal(order.values, order2.values)
    # the normalizing sum adds the same K values in another order: equal up to an ulp or two
    torch.testing.assert_close(ts.gather(1, order.indices), ts2.gather(1, order2.indices),
                               rtol=1e-6, atol=1e-7)
    assert torch.equal(n, n2)
    w = torch.randn_like(ts)
    (ts.gather(1, order.indices) * w).sum().backward()
    gw = r.gate.weight.grad.clone()
    r.gate.weight.grad = None
    (ts2.gather(1, order2.indices) * w).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad)
    torch.testing.assert_close(r.gate.weight.grad, gw)


def test_other_configurations_take_the_stock_path():
    grouped = _router(16, 4, groups=4)
    x = torch.randn(8, 32, device=DEV)
    assert not fast_path_ok(grouped, x, kernel=True)
    ts, idx, n = route(grouped, x, None, kernel=True)
    ts2, idx2, n2 = grouped(x, None)
    assert torch.equal(idx, idx2) and torch.equal(ts, ts2)
    plain = _router(16, 4)
    assert fast_path_ok(plain, x.cuda() if torch.cuda.is_available() else x, kernel=None) == (
        torch.cuda.is_available())


def test_route_under_torch_compile():
    """The top-k stays one opaque custom op in a compiled graph (TorchTitan compiles each
    block with the router in it)."""
    r = _router(16, 4)
    x = torch.randn(24, 32, device=DEV)
    eb = torch.randn(16, device=DEV) * 0.05
    want = route(r, x, eb, kernel=True)
    got = torch.compile(lambda a, b: route(r, a, b, kernel=True), backend="aot_eager",
                        fullgraph=True)(x, eb)
    # eager sums the K gating values inside its one kernel, the graph with torch ops: the same
    # selection and counts, the values equal up to the sum's rounding
    assert torch.equal(want[1], got[1]) and torch.equal(want[2], got[2])
    torch.testing.assert_close(want[0], got[0], rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_shape_matches_torch_topk():
    torch.manual_seed(0)
    s = torch.randn(16384, 128, device="cuda").softmax(-1)
    b = torch.randn(128, device="cuda") * 1e-3
    got = router_topk(s, 8, b)
    want = torch.topk(s + b, 8, dim=-1, sorted=True).indices
    assert torch.equal(got, want)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("T,E,K", [(37, 8, 2), (70, 60, 8), (5, 128, 6)])
def test_topk_gate_against_torch_ops(T, E, K, bias, norm):
    """The one-launch router tail against the torch ops it replaces: indices, gating values,
    counts (an independent bincount) and the gradient of the scores (through softmax)."""
    g = torch.Generator().manual_seed(T + E + K)
    logits = torch.randn(T, E, generator=g).to(DEV).requires_grad_()
    b = (torch.randn(E, generator=g) * 0.01).to(DEV) if bias else None
    scale = 1.7
    s = logits.softmax(-1)
    vals, idx, counts = topk_gate(s, K, b, norm, scale)
    assert idx.dtype == torch.int64 and counts.dtype == torch.int64 and vals.dtype == torch.float32
    assert torch.equal(idx, topk_indices_reference(s.detach(), K, b))
    s2 = logits.softmax(-1)
    want = s2.gather(1, idx)
    if norm:
        want = want / (want.sum(-1, keepdim=True) + 1e-20)
    want = want * scale
    torch.testing.assert_close(vals, want, rtol=1e-6, atol=1e-7)
    assert torch.equal(counts, torch.bincount(idx.reshape(-1), minlength=E))
    w = torch.randn(T, K, generator=g).to(DEV)
    (grad,) = torch.autograd.grad((vals * w).sum(), logits)
    (grad2,) = torch.autograd.grad((want * w).sum(), logits)
    torch.testing.assert_close(grad, grad2)


def test_topk_gate_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="fp32 scores"):
        topk_gate(torch.zeros(4, 8, device=DEV, dtype=torch.bfloat16), 2, None, True, 1.0)
    with pytest.raises(ValueError, match="bias must be"):
        topk_gate(torch.zeros(4, 8, device=DEV), 2, torch.zeros(7, device=DEV), True, 1.0)
