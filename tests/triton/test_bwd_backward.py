"""backend ``triton`` backward end to end: under the interpreter vs float64 autograd, through the
mega_moe op vs the reference backend, and (marked gpu) at the real 30B shape vs reference."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_bwd_oracle import grads64, make_inputs, rel_err, routings, same_bits  # noqa: E402

from torchtitan_megamoe.ops.triton.backward import backward  # noqa: E402

NAMES = ("dx", "dtopk_weights", "dw1", "dw2", "dw3")
T, K, E, D, H = 19, 3, 5, 40, 24


def _inputs(ids, seed=0, device="cpu"):
    inp = make_inputs(ids.shape[0], ids.shape[1], E, D, H, ids, seed=seed, device=device)
    # A dropped slot's routing weight must not reach any gradient.
    inp["topk_weights"][inp["topk_ids"] < 0] = float("nan")
    return inp


def _triton_grads(inp):
    return backward(inp["dy"], inp["x"], inp["topk_ids"], inp["topk_weights"],
                    inp["w1"], inp["w2"], inp["w3"], None, "bf16")


def _check_vs_f64(inp, grads):
    clean = dict(inp, topk_weights=inp["topk_weights"].nan_to_num(0.0))
    ref = grads64(clean)
    for name, got, r, like in zip(NAMES, grads, ref, (inp["x"], inp["topk_weights"],
                                                     inp["w1"], inp["w2"], inp["w3"])):
        assert got.shape == like.shape and got.dtype == like.dtype, name
        assert torch.isfinite(got).all(), name
        if r.norm() == 0:
            assert (got == 0).all(), f"{name} must be exactly zero"
        else:
            err = rel_err(got, r)
            assert err <= 1e-2, f"{name}: rel err {err:.2e}"
    dropped = inp["topk_ids"] < 0
    assert (grads[1][dropped] == 0).all(), "dropped slots get a zero weight gradient"


@pytest.mark.parametrize("case", ["uneven", "one_expert", "all_dropped"])
def test_backward_matches_f64(case):
    inp = _inputs(dict(routings(T, K, E))[case])
    _check_vs_f64(inp, _triton_grads(inp))


def test_backward_single_token():
    inp = _inputs(torch.tensor([[3, -1, 0]]), seed=7)
    _check_vs_f64(inp, _triton_grads(inp))


def test_backward_deterministic():
    inp = _inputs(dict(routings(T, K, E, seed=5))["uneven"], seed=5)
    for a, b in zip(_triton_grads(inp), _triton_grads(inp)):
        assert same_bits(a, b)


def test_backward_through_op_matches_reference():
    """mega_moe(backend='triton') autograd vs mega_moe(backend='reference') autograd."""
    from torchtitan_megamoe import mega_moe

    Dm, Hm = 32, 48  # the triton forward needs multiples of 16 under the interpreter
    ids = dict(routings(T, K, E, seed=2))["uneven"]
    inp = make_inputs(T, K, E, Dm, Hm, ids, seed=2)
    keys = ("x", "topk_weights", "w1", "w2", "w3")
    grads = {}
    for backend in ("triton", "reference"):
        leaves = [inp[k].clone().requires_grad_() for k in keys]
        x, tw, w1, w2, w3 = leaves
        out = mega_moe(x, inp["topk_ids"], tw, w1, w2, w3, backend=backend)
        grads[backend] = torch.autograd.grad(out, leaves, inp["dy"])
    for name, got, ref in zip(NAMES, grads["triton"], grads["reference"]):
        assert rel_err(got, ref) <= 1e-2, name


def test_backward_rejects_what_it_cannot_compute():
    inp = _inputs(dict(routings(4, K, E))["uneven"])
    args = [inp[k] for k in ("dy", "x", "topk_ids", "topk_weights", "w1", "w2", "w3")]
    with pytest.raises(NotImplementedError, match="backend='reference'"):
        backward(*args, None, "fp8_bwd")
    with pytest.raises(TypeError, match="bfloat16"):
        backward(args[0].float(), *args[1:], None, "bf16")
    with pytest.raises(ValueError, match="grad_out shape"):
        backward(args[0][:2], *args[1:], None, "bf16")


# ----------------------------------------------------------------------------- GPU, real shape


def _real_routing(T_, K_, E_, device):
    """Skewed expert popularity, one expert never chosen, about 6% of slots dropped."""
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(E_, device=device, generator=g) * 1.5
    logits[7] = float("-inf")
    probs = torch.softmax(logits, 0)
    ids = torch.multinomial(probs.expand(T_, E_), K_, replacement=False, generator=g)
    ids[::17, -1] = -1
    ids[5::23, 0] = -1
    return ids


SHAPES = {"qwen3_30b_a3b": (2048, 768), "qwen3_235b_a22b": (4096, 1536)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", list(SHAPES))
def test_backward_real_shape_vs_reference(shape):
    """One Qwen3 MoE layer (E=128, K=8) at 16384 tokens vs backend reference: rel err <= 1e-2
    for every gradient, and bitwise-identical reruns."""
    from torchtitan_megamoe.ops import reference

    T_, K_, E_ = 16384, 8, 128
    D_, H_ = SHAPES[shape]
    dev = "cuda"
    torch.manual_seed(0)
    x = torch.randn(T_, D_, device=dev).bfloat16()
    w1 = (torch.randn(E_, H_, D_, device=dev) / D_**0.5).bfloat16()
    w3 = (torch.randn(E_, H_, D_, device=dev) / D_**0.5).bfloat16()
    w2 = (torch.randn(E_, D_, H_, device=dev) / H_**0.5).bfloat16()
    ids = _real_routing(T_, K_, E_, dev)
    tw = torch.softmax(torch.randn(T_, K_, device=dev), -1)
    dy = torch.randn(T_, D_, device=dev).bfloat16()
    args = (dy, x, ids, tw, w1, w2, w3, None, "bf16")
    got = backward(*args)
    ref = reference.backward(*args)
    for name, g, r in zip(NAMES, got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        err = rel_err(g, r)
        assert err <= 1e-2, f"{name}: rel err {err:.2e}"
    for name, a, b in zip(NAMES, got, backward(*args)):
        assert same_bits(a, b), f"{name} differs between two runs"
