"""Float64 oracle of the MoE backward shared by the test_bwd_* kernel tests, and its own checks.

The per-slot closed forms (the SwiGLU backward and d(topk_weights) = <dh, h>) that the kernels
implement are checked here against float64 autograd of the plain forward math, so each kernel
test can compare against per-slot intermediates it can index directly.
"""

import pytest
import torch
import torch.nn.functional as F

from torchtitan_megamoe.ops.hopper.plan import build_plan

# Kernel test sizes: nothing a tile multiple, small enough for the CPU interpreter.
SMALL = dict(T=13, K=3, E=5, D=40, H=24)
BLOCK_M = 8
POISON = float("nan")


def routings(T, K, E, seed=0):
    """(name, topk_ids) cases: uneven routing with dropped slots and an empty expert, every
    token on one expert, and all slots dropped."""
    g = torch.Generator().manual_seed(seed)
    # Random distinct experts per token, expert 1 never chosen (empty), some slots dropped.
    choices = [e for e in range(E) if e != 1]
    ids = torch.stack(
        [torch.tensor(choices)[torch.randperm(len(choices), generator=g)[:K]] for _ in range(T)]
    )
    ids[torch.rand(T, K, generator=g) < 0.2] = -1
    yield "uneven", ids
    one = torch.full((T, K), -1, dtype=torch.int64)
    one[:, 0] = E - 1
    yield "one_expert", one
    yield "all_dropped", torch.full((T, K), -1, dtype=torch.int64)


def make_inputs(T, K, E, D, H, ids, seed=0, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    x = r(T, D)
    w1 = r(E, H, D, scale=D**-0.5)
    w3 = r(E, H, D, scale=D**-0.5)
    w2 = r(E, D, H, scale=H**-0.5)
    tw_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    tw = torch.rand(T, K, generator=g).to(tw_dtype).to(device)
    dy = r(T, D)
    return dict(x=x, topk_ids=ids.to(device), topk_weights=tw, w1=w1, w2=w2, w3=w3, dy=dy)


def forward64(x, ids, tw, w1, w2, w3):
    """out[t] = sum_k w[t,k] * w2[e] @ (silu(w1[e] @ x[t]) * (w3[e] @ x[t])), dropped slots 0."""
    T, K = ids.shape
    valid = ids >= 0
    e = ids.clamp(min=0)
    a1 = torch.einsum("td,tkhd->tkh", x, w1[e])
    a3 = torch.einsum("td,tkhd->tkh", x, w3[e])
    y = torch.einsum("tkh,tkdh->tkd", F.silu(a1) * a3, w2[e])
    return (tw.unsqueeze(-1) * y * valid.unsqueeze(-1)).sum(1)


def grads64(inp):
    """float64 autograd gradients (dx, dtw, dw1, dw2, dw3) of ``forward64`` for grad dy."""
    leaves = [inp[k].double().detach().requires_grad_() for k in ("x", "topk_weights", "w1", "w2", "w3")]
    x, tw, w1, w2, w3 = leaves
    out = forward64(x, inp["topk_ids"], tw, w1, w2, w3)
    return torch.autograd.grad(out, leaves, inp["dy"].double())


def per_slot64(inp):
    """Closed-form per-slot intermediates in float64, keyed by slot s = t*K + k:
    da1, da3, hw [T*K, H]; dtw [T*K]; dx_slot [T*K, D]. Dropped slots hold zeros."""
    ids = inp["topk_ids"]
    T, K = ids.shape
    x, dy = inp["x"].double(), inp["dy"].double()
    w1, w2, w3 = (inp[k].double() for k in ("w1", "w2", "w3"))
    tw = inp["topk_weights"].double()
    valid = (ids >= 0).unsqueeze(-1).double()
    e = ids.clamp(min=0)
    a1 = torch.einsum("td,tkhd->tkh", x, w1[e])
    a3 = torch.einsum("td,tkhd->tkh", x, w3[e])
    dh = torch.einsum("td,tkdh->tkh", dy, w2[e])
    sig = torch.sigmoid(a1)
    h = a1 * sig * a3
    w = tw.unsqueeze(-1)
    da1 = w * dh * a3 * sig * (1 + a1 * (1 - sig)) * valid
    da3 = w * dh * a1 * sig * valid
    dx_slot = torch.einsum("tkh,tkhd->tkd", da1, w1[e]) + torch.einsum("tkh,tkhd->tkd", da3, w3[e])
    out = dict(
        da1=da1, da3=da3, hw=w * h * valid, dtw=(dh * h * valid).sum(-1), dx_slot=dx_slot,
    )
    return {k: v.reshape(T * K, *v.shape[2:]) for k, v in out.items()}


def plan_for(ids, E, block_m=BLOCK_M):
    return build_plan(ids, E, block_m)


def assert_close(got, ref, tol=1e-2, name=""):
    """max |got - ref| <= tol * max |ref| (a scale-aware bound suited to bf16 outputs)."""
    got, ref = got.double().cpu(), ref.double().cpu()
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values (an unwritten row was read?)"
    err = (got - ref).abs().max().item() if got.numel() else 0.0
    scale = ref.abs().max().item() if ref.numel() else 0.0
    assert err <= tol * scale + 1e-6, f"{name}: max abs err {err:.3e} > {tol} * {scale:.3e}"


def same_bits(a, b):
    """Bitwise equality (NaN-safe): the determinism tests compare raw bytes."""
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def rel_err(got, ref):
    """||got - ref|| / ||ref|| (Frobenius), 0 when both are zero."""
    got, ref = got.double().cpu(), ref.double().cpu()
    den = ref.norm().item()
    num = (got - ref).norm().item()
    return num / den if den > 0 else num


@pytest.mark.parametrize("case", [0, 1])
def test_closed_forms_match_autograd(case):
    """The per-slot formulas the kernels implement reproduce float64 autograd of the forward."""
    T, K, E, D, H = 5, 2, 3, 6, 4
    name, ids = list(routings(T, K, E, seed=case))[case]
    inp = make_inputs(T, K, E, D, H, ids, seed=case, dtype=torch.float64)
    dx, dtw, dw1, dw2, dw3 = grads64(inp)
    ps = per_slot64(inp)
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


def test_forward64_gradcheck():
    """forward64 itself is differentiable as written (finite differences)."""
    T, K, E, D, H = 3, 2, 2, 3, 2
    ids = torch.tensor([[0, 1], [1, -1], [1, 0]])
    inp = make_inputs(T, K, E, D, H, ids, dtype=torch.float64)
    args = [inp[k].requires_grad_() for k in ("x", "topk_weights", "w1", "w2", "w3")]
    assert torch.autograd.gradcheck(
        lambda x, tw, w1, w2, w3: forward64(x, ids, tw, w1, w2, w3), args
    )
