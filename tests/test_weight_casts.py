"""The bf16 casts of fp32 expert weights made once per step by their module (moe.MegaExperts,
``bf16_weight_cache``) instead of in every forward and recompute of the op:

- the op takes them (``weight_casts``) instead of casting, with the bits of its own cast, and
  checks them; where it casts nothing they are ignored;
- the module makes them once (ahead, in the converter's model pre-hook), its forward and an
  activation checkpoint's recompute take those, its backward frees them, a weight change is
  seen; off, nothing is cached;
- the converter's training loop (TorchTitan's Qwen3, one layer, bf16 autocast over fp32
  parameters, AdamW, the post-optimizer hook) is bitwise the same with the cache off, with one
  cast per weight per step against one per forward and recompute.

The hopper backend runs under Triton's interpreter on CPU (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from moe_testing import (autocast_backward, build_converted, cpu_histc, job_config, make_inputs,
                         op_args, routing, token_batches)
from torchtitan_megamoe import mega_moe
from torchtitan_megamoe.moe import MegaExperts
from torchtitan_megamoe.ops import hopper as hb
from torchtitan_megamoe.ops.options import MegaMoEOptions

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
T, K, E, D, H = 24, 2, 4, 128, 128


@contextlib.contextmanager
def op_casts():
    """How many times the hopper forward cast the weights itself while inside."""
    seen = []
    real = hb.cast_weights

    def spy(x, weights):
        out = real(x, weights)
        seen.append(len(out))
        return out

    hb.cast_weights = spy
    try:
        yield seen
    finally:
        hb.cast_weights = real


def _inputs(seed=0):
    inp = make_inputs(T, K, E, D, H, routing("uneven", T, K, E, seed), seed=seed,
                      dtype=torch.float32, device=DEVICE)
    return op_args(inp)  # x, ids, tw, w1, w2, w3, all fp32


def _experts(cache=True, precision="bf16"):
    m = MegaExperts(D, H, E, options=MegaMoEOptions(backend="hopper", precision=precision,
                                                    bf16_weight_cache=cache))
    _x, _ids, _tw, w1, w2, w3 = _inputs()
    with torch.no_grad():
        for p, w in zip((m.w1, m.w2, m.w3), (w1, w2, w3)):
            p.data = w.clone()
    return m.to(DEVICE)


def _grads(run, leaves):
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = run(*leaves)
    grads = torch.autograd.grad(out.float().square().sum(), [t for t in leaves
                                                            if t.requires_grad])
    return out.detach(), grads


def test_op_takes_the_casts_and_checks_them():
    x, ids, tw, w1, w2, w3 = _inputs()
    leaves = [t.clone().requires_grad_() for t in (x, tw, w1, w2, w3)]
    casts = tuple(w.detach().bfloat16() for w in leaves[2:])

    def layer(weight_casts):
        return lambda x, tw, *w: mega_moe(x, ids, tw, *w, backend="hopper",
                                          weight_casts=weight_casts)

    with op_casts() as cast:
        own = _grads(layer(None), leaves)
    with op_casts() as given:
        took = _grads(layer(casts), leaves)
    assert cast == [3] and given == [], (cast, given)
    assert torch.equal(own[0], took[0]) and all(torch.equal(a, b) for a, b in zip(own[1],
                                                                                   took[1]))
    assert all(g.dtype == torch.float32 for g in took[1][2:])  # fp32 weights' gradients
    bad = (casts[0], casts[1].float(), casts[2])
    with pytest.raises(ValueError, match=r"weight_casts w2 is .* torch.float32 on .*, expected"):
        _grads(layer(bad), leaves)
    # where the op casts nothing (no autocast: every tensor in one dtype) they are ignored
    b16 = [t.detach().bfloat16() for t in (x, tw, w1, w2, w3)]
    plain = mega_moe(b16[0], ids, b16[1], *b16[2:], backend="hopper")
    assert torch.equal(plain, mega_moe(b16[0], ids, b16[1], *b16[2:], backend="hopper",
                                       weight_casts=bad))


def test_module_casts_once_and_frees_them_after_backward():
    """Made ahead (the converter's pre-hook), taken by the forward and by an activation
    checkpoint's recompute, freed by the backward; a weight change is seen; bitwise the
    results of the per-call cast."""
    on, off = _experts(), _experts(cache=False)
    x, ids, tw, *_ = _inputs(seed=1)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        assert on.make_weight_copies_ahead() and not off.make_weight_copies_ahead()
    assert on.weight_casts_made == 1 and off._casts is None
    results = []
    for m, xi in ((on, xs[0]), (off, xs[1])):
        with op_casts() as cast:
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                out = checkpoint(m, xi, ids, tw, use_reentrant=False)
            held = m._casts is not None
            out.float().square().sum().backward()
        results.append((out.detach(), xi.grad, *(p.grad for p in (m.w1, m.w2, m.w3))))
        assert (cast, held, m._casts) == (([], True, None) if m is on else ([3, 3], False,
                                                                            None)), m
    assert on.weight_casts_made == 1
    assert all(torch.equal(a, b) for a, b in zip(*results))
    with torch.no_grad():
        on.w2.mul_(0.5)
        off.w2.mul_(0.5)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        assert torch.equal(on(x, ids, tw), off(x, ids, tw))  # made again from the new w2
    assert on.weight_casts_made == 2
    on.refresh_weight_copies()  # the post-optimizer hook: a fused step moves no version
    assert on._casts is None


def test_no_cast_cache_where_the_op_casts_nothing():
    """bf16 parameters (FSDP's mixed precision casts them), an FP8 forward (its copies are
    quantized from the fp32 values): nothing to cast, nothing cached."""
    x, ids, tw, *_ = _inputs()
    half, fp8 = _experts().to(torch.bfloat16), _experts(precision="fp8")
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        for m in (half, fp8):
            assert not m.make_weight_copies_ahead() or m is fp8
            m(x, ids, tw)
    assert half._casts is None and fp8._casts is None and fp8.weight_casts_made == 0


def _train(cache: bool, steps: int = 2, seed: int = 0):
    """TorchTitan's way on one device (meta build, convert, materialize, init), one layer,
    bf16 autocast over fp32 parameters, full activation checkpointing of the layer, AdamW and
    the converter's post-optimizer hook."""
    from torchtitan.models.qwen3 import qwen3_args

    import torchtitan_megamoe.flavors  # noqa: F401  (registers megamoe_tiny_fp8)
    from torchtitan_megamoe.converter import MegaMoEConverter

    args = dataclasses.replace(copy.deepcopy(qwen3_args["megamoe_tiny_fp8"]), n_layers=1)
    jc = job_config(backend="hopper", bf16_weight_cache=cache)
    model = build_converted(args, seed, jc, DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, casts = [], []
    for tokens, labels in token_batches(args.vocab_size, steps, seed + 1, DEVICE):
        opt.zero_grad()
        with op_casts() as cast:
            losses.append(autocast_backward(model, tokens, labels, DEVICE, checkpointed=True))
        opt.step()
        MegaMoEConverter(jc, None).post_optimizer_hook([model])
        casts.append(len(cast))
    experts = [m for m in model.modules() if isinstance(m, MegaExperts)]
    return losses, [p.detach().clone() for p in model.parameters()], casts, experts


def test_training_cache_on_is_bitwise_cache_off():
    with cpu_histc():
        on_losses, on_params, on_casts, on_experts = _train(True)
        off_losses, off_params, off_casts, _ = _train(False)
    assert all(torch.equal(a, b) for a, b in zip(on_losses, off_losses)), (on_losses,
                                                                            off_losses)
    assert all(torch.equal(a, b) for a, b in zip(on_params, off_params))
    # off: the op casts in the forward and again in the recompute; on: the module cast once
    # per step (the pre-hook), freed by the backward
    assert off_casts == [2, 2] and on_casts == [0, 0], (off_casts, on_casts)
    assert [m.weight_casts_made for m in on_experts] == [2] and on_experts[0]._casts is None
