"""The router top-k kernel (ops/hopper/kernels/topk.py) against a stable sort and torch.topk, and the
fast router path (router.py) against stock TorchTitan's router: same indices, gating values,
tokens per expert and gradients. Runs under the Triton interpreter on CPU, compiled on GPUs."""

import pytest
import torch
from torchtitan.models.moe.moe import TokenChoiceTopKRouter

from torchtitan_megamoe.ops.hopper.kernels.topk import (router_topk, topk_gate, topk_indices,
                                                        topk_softmax_gate)
from moe_testing import OpNames
from torchtitan_megamoe.router import fast_path_ok, route

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def topk_indices_reference(scores: torch.Tensor, k: int, bias: torch.Tensor | None = None):
    """The kernel's order in plain torch: a stable descending sort, NaN first."""
    s = scores.float() if bias is None else scores.float() + bias.float()
    s = torch.where(torch.isnan(s), torch.full_like(s, float("inf")), s)
    return torch.sort(s, dim=1, descending=True, stable=True).indices[:, :k]


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


@pytest.mark.parametrize("score_func,route_norm", [("softmax", True), ("softmax", False),
                                                   ("sigmoid", False)])
@pytest.mark.parametrize("bias", [False, True])
def test_route_matches_stock_router_values_and_grads(score_func, route_norm, bias):
    r = _router(16, 4, score_func, route_norm)
    x = torch.randn(50, 32, device=DEV, requires_grad=True)
    eb = torch.randn(16, device=DEV) * 0.05 if bias else None
    _check_route_against_stock(r, x, eb)


def _check_route_against_stock(r, x, eb):
    """route (the fast path) and the stock router on the same x: same choice and counts,
    values within an ulp or two, the same gradients of x and of the gate weight (fp32: within
    fp32 rounding; bf16: within a bf16 rounding of the largest)."""
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
    if x.dtype == torch.float32:
        torch.testing.assert_close(x2.grad, x.grad)
        torch.testing.assert_close(r.gate.weight.grad, gw)
    else:
        # the fused backward sums the softmax backward's K products in its own order: d(logits)
        # may round to the neighbouring bf16 value, which the gate's bf16 matmuls carry into
        # both gradients at the scale of their largest entries
        for got, want in ((x2.grad, x.grad), (r.gate.weight.grad, gw)):
            torch.testing.assert_close(got, want, rtol=2 ** -7,
                                       atol=2 ** -6 * want.abs().max().item())


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


def test_route_unwraps_a_compiled_router():
    """TorchTitan's compile wraps moe.router in torch.compile: an eager route runs the module it
    wraps on the fast path (the compiled region never runs), the same bits and gradients as the
    plain router's fast path; a configuration off the fast path still calls the wrapper."""
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    r = _router(16, 4)
    x = torch.randn(24, 32, device=DEV, requires_grad=True)
    eb = torch.randn(16, device=DEV) * 0.05
    want = route(r, x, eb, kernel=True)
    want[0].sum().backward()
    gw, gx = r.gate.weight.grad.clone(), x.grad.clone()
    r.gate.weight.grad, x.grad = None, None
    got = route(torch.compile(r, backend=backend, fullgraph=True), x, eb, kernel=True)
    got[0].sum().backward()
    assert not compiles
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert torch.equal(r.gate.weight.grad, gw) and torch.equal(x.grad, gx)
    grouped = _router(16, 4, groups=4)
    route(torch.compile(grouped, backend=backend, fullgraph=True), x.detach(), None, kernel=True)
    assert len(compiles) == 1


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


def _softmax_gate_reference(logits, idx, norm, scale, dtype=torch.float32):
    """What stock's router computes from the gate's logits at the chosen columns, in ``dtype``:
    softmax(logits.to(dtype)), gather, normalize, scale (differentiable in logits)."""
    s = torch.softmax(logits.to(dtype), dim=1)
    want = s.gather(1, idx)
    if norm:
        want = want / (want.sum(-1, keepdim=True) + 1e-20)
    return s, want * scale


@pytest.mark.parametrize("bias,norm", [(False, False), (True, True), (True, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,K,strided", [(37, 8, 2, False), (70, 60, 8, True),
                                           (9, 33, 33, True)])
def test_topk_softmax_gate_against_torch_ops(T, E, K, strided, dtype, bias, norm):
    """The fused cast + softmax + router tail against torch.softmax(logits.float()) and the
    torch ops after it: indices, gating values, counts, and d(logits) (against stock's autograd
    in fp32 and a float64 reference). E not a power of 2, T not a multiple of the block, k = E,
    a row stride other than E."""
    g = torch.Generator().manual_seed(T + E + K + (dtype == torch.bfloat16))
    base = (torch.randn(T, E + 7 if strided else E, generator=g) * 2).to(DEV, dtype)
    logits = (base[:, 3:3 + E] if strided else base).requires_grad_()
    assert logits.is_contiguous() != strided
    b = (torch.randn(E, generator=g) * 0.01).to(DEV) if bias else None
    scale = 1.7
    vals, idx, counts = topk_softmax_gate(logits, K, b, norm, scale)
    assert idx.dtype == torch.int64 and counts.dtype == torch.int64 and vals.dtype == torch.float32
    s, want = _softmax_gate_reference(logits, idx, norm, scale)
    assert torch.equal(idx, topk_indices_reference(s.detach(), K, b))
    if dtype == torch.float32:  # bf16 logits tie (8-bit mantissas), torch.topk's order is its own
        sb = s.detach() if b is None else s.detach() + b
        assert torch.equal(idx, torch.topk(sb, K, dim=-1, sorted=True).indices)
    assert torch.equal(counts, torch.bincount(idx.reshape(-1), minlength=E))
    torch.testing.assert_close(vals, want, rtol=1e-6, atol=1e-7)
    logits64 = logits.detach().double().requires_grad_()
    _, want64 = _softmax_gate_reference(logits64, idx, norm, scale, torch.float64)
    torch.testing.assert_close(vals.double(), want64, rtol=1e-6, atol=1e-7)

    w = torch.randn(T, K, generator=g).to(DEV)
    (grad,) = torch.autograd.grad((vals * w).sum(), logits)
    (grad_stock,) = torch.autograd.grad((want * w).sum(), logits)
    (grad64,) = torch.autograd.grad((want64 * w.double()).sum(), logits64)
    assert grad.dtype == dtype and grad.shape == (T, E)
    # with norm the unchosen columns' gradient is 0 mathematically (shift invariance): rounding
    # noise there (~1e-8 of the largest), so an absolute term relative to the largest
    atol = 1e-6 * grad64.abs().max().item()
    if dtype == torch.float32:
        torch.testing.assert_close(grad, grad_stock)
        torch.testing.assert_close(grad.double(), grad64, rtol=1e-5, atol=atol)
    else:  # the fp32 gradient rounded to bf16 once: at most a bf16 ulp from either reference
        torch.testing.assert_close(grad, grad_stock, rtol=2 ** -7, atol=atol)
        torch.testing.assert_close(grad.double(), grad64, rtol=2 ** -7, atol=atol)


@pytest.mark.parametrize("bias", [False, True])
def test_topk_softmax_gate_infinite_logits(bias):
    """-inf logits get score 0 (softmax's exp(-inf)), take no part in the max and sum, get no
    gradient, and rank below every finite score; a row of -inf only is NaN as in torch."""
    g = torch.Generator().manual_seed(5)
    T, E, K = 11, 12, 4
    logits = torch.randn(T, E, generator=g)
    logits[0, :5] = -float("inf")
    logits[1, ::2] = -float("inf")
    logits[2, 1:10] = -float("inf")  # three finite: the fourth pick is a tied 0
    logits[3, 0] = -float("inf")
    logits = logits.to(DEV).requires_grad_()
    b = (torch.randn(E, generator=g) * 1e-3).to(DEV) if bias else None
    vals, idx, counts = topk_softmax_gate(logits, K, b, True, 2.0)
    s, want = _softmax_gate_reference(logits, idx, True, 2.0)
    assert torch.equal(idx, topk_indices_reference(s.detach(), K, b))
    assert (logits.detach().gather(1, idx[:, :3]) > -float("inf")).all()
    assert torch.equal(counts, torch.bincount(idx.reshape(-1), minlength=E))
    torch.testing.assert_close(vals, want, rtol=1e-6, atol=1e-7)
    w = torch.randn(T, K, generator=g).to(DEV)
    (grad,) = torch.autograd.grad((vals * w).sum(), logits)
    (grad_stock,) = torch.autograd.grad((want * w).sum(), logits)
    assert torch.isfinite(grad).all() and (grad[torch.isinf(logits.detach())] == 0).all()
    torch.testing.assert_close(grad, grad_stock)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf-inf
def test_topk_softmax_gate_row_of_minus_inf_is_nan():
    E, K = 12, 4
    logits = torch.full((3, E), -float("inf"), device=DEV)
    logits[1] = 0.0
    vals, idx, counts = topk_softmax_gate(logits, K, None, False, 1.0)
    assert torch.isnan(vals[0]).all() and torch.isnan(vals[2]).all()  # as torch.softmax
    assert idx[0].tolist() == list(range(K))  # NaN ranks first, ties to the lower index
    assert torch.equal(idx, topk_indices_reference(torch.softmax(logits, 1), K))
    torch.testing.assert_close(vals[1], torch.full((K,), 1.0 / E, device=DEV))


def test_topk_softmax_gate_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="fp32/bf16/fp16 logits"):
        topk_softmax_gate(torch.zeros(4, 8, device=DEV, dtype=torch.float64), 2, None, True, 1.0)
    with pytest.raises(ValueError, match="k <= experts"):
        topk_softmax_gate(torch.zeros(4, 8, device=DEV), 9, None, True, 1.0)
    with pytest.raises(ValueError, match="bias must be"):
        topk_softmax_gate(torch.zeros(4, 8, device=DEV), 2, torch.zeros(7, device=DEV), True, 1.0)
    vals, idx, counts = topk_softmax_gate(torch.zeros(0, 8, device=DEV, dtype=torch.bfloat16),
                                          2, None, True, 1.0)
    assert vals.shape == idx.shape == (0, 2) and counts.tolist() == [0] * 8


def test_route_softmax_runs_no_cast_or_softmax_ops():
    """The eager softmax route: the gate's matmul, the counts' zero fill and the fused kernel,
    no cast and no softmax kernels; its backward is the fused backward kernel, no softmax
    backward, gather, scatter or cast of autograd's."""
    r = _router(16, 4)
    x = torch.randn(20, 32, device=DEV, requires_grad=True)
    with OpNames() as ops:
        ts, _, _ = route(r, x, torch.zeros(16, device=DEV), kernel=True)
    assert not [n for n in ops.names if "softmax" in n or "_to_copy" in n], ops.names
    with OpNames() as ops:
        ts.sum().backward()
    assert not [n for n in ops.names
                if any(op in n for op in ("softmax", "gather", "scatter", "_to_copy"))], ops.names


def test_route_bf16_softmax_matches_stock_router():
    """A bf16 gate (logits in bf16, cast to fp32 by stock): same choice, values, gradients."""
    r = _router(24, 6).to(torch.bfloat16)
    x = torch.randn(40, 32, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    _check_route_against_stock(r, x, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_shape_softmax_gate_matches_torch():
    """16384 tokens x 128 experts, k = 8, bf16 logits (the 30B layer's router), compiled."""
    torch.manual_seed(0)
    T, E, K = 16384, 128, 8
    logits = (torch.randn(T, E, device="cuda") * 2).bfloat16().requires_grad_()
    b = torch.randn(E, device="cuda") * 1e-3
    vals, idx, counts = topk_softmax_gate(logits, K, b, True, 2.5)
    s = torch.softmax(logits.float(), dim=1)
    # bf16 logits tie often; the bias (distinct per expert) orders the tied scores
    assert torch.equal(idx, torch.topk(s.detach() + b, K, dim=-1, sorted=True).indices)
    assert torch.equal(counts, torch.bincount(idx.reshape(-1), minlength=E))
    _, want = _softmax_gate_reference(logits, idx, True, 2.5)
    torch.testing.assert_close(vals, want, rtol=1e-6, atol=1e-7)
    w = torch.randn(T, K, device="cuda")
    (grad,) = torch.autograd.grad((vals * w).sum(), logits)
    (grad_stock,) = torch.autograd.grad((want * w).sum(), logits)
    # unchosen columns: 0 up to rounding noise (see test_topk_softmax_gate_against_torch_ops)
    torch.testing.assert_close(grad, grad_stock, rtol=2 ** -7,
                               atol=1e-6 * grad_stock.abs().max().item())
