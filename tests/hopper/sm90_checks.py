"""What the tests of csrc/grouped_gemm_sm90.cu share: their skip marks, NaN-poisoned outputs,
and the whole backward with some of its stages forced to an sm90 candidate, checked against
the reference backend."""

import importlib

import pytest
import torch

from torchtitan_megamoe.ops.hopper.cuda.sm90 import sm90_buildable

SM90_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not sm90_buildable(torch.empty(1, device="cuda")),
        reason="needs an sm_90 GPU and nvcc",
    ),
]


def nan_tensor(*shape, dtype=torch.bfloat16):
    """An output poisoned before a kernel writes it (unwritten elements stay NaN)."""
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def rel_err(a, ref) -> float:
    a, ref = a.double(), ref.double()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


def forced_backward_matches_reference(monkeypatch, forced: dict, seed: int, saved: bool):
    """backward_local with each tuner stage named in ``forced`` ({stage: attribute of
    ops/hopper/backward_pass.py naming the candidate}) forced to that candidate, which must be
    offered: every gradient against the reference backend within 1e-2, bitwise-equal reruns.
    Inputs: a 4096-token layer (E 32, K 8, D 1024, H 512) with dropped slots and an empty
    expert (3). ``saved``: the backward reads forward_ep1(save=True)'s saved tensors. Returns
    the gradients (dx, dtw, dw1, dw2, dw3)."""
    from torchtitan_megamoe.ops import reference
    from torchtitan_megamoe.ops.hopper.local_forward import forward_ep1

    # the module, not the package's `backward` function of the same name
    bwd = importlib.import_module("torchtitan_megamoe.ops.hopper.backward_pass")
    picked = []
    real_pick = bwd.pick_config

    def force(name, key, cands, launch, outputs=None):
        if name in forced:
            cfg = getattr(bwd, forced[name])
            offered = cands() if callable(cands) else cands  # pick_config's lazy list builder
            assert cfg in offered, f"{forced[name]} must be offered for {name} at this shape"
            picked.append(name)
            return cfg
        return real_pick(name, key, cands, launch, outputs)

    monkeypatch.setattr(bwd, "pick_config", force)
    T, K, E, D, H = 4096, 8, 32, 1024, 512
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    w1 = (torch.randn(E, H, D, device="cuda", generator=g) / D**0.5).bfloat16()
    w3 = (torch.randn(E, H, D, device="cuda", generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, H, device="cuda", generator=g) / H**0.5).bfloat16()
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)])
    ids[::5, 0] = -1
    ids[ids == 3] = -1  # an empty expert
    tw = torch.rand(T, K, device="cuda", generator=g)
    dy = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    kw = dict(saved=forward_ep1(x, ids, tw, w1, w2, w3, save=True)[1]) if saved else {}
    got = bwd.backward_local(dy, x, ids, tw, w1, w2, w3, **kw)
    assert sorted(picked) == sorted(forced)
    ref = reference.backward(dy, x, ids, tw, w1, w2, w3, None, "bf16")
    for name, a, r in zip(("dx", "dtw", "dw1", "dw2", "dw3"), got, ref):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        assert rel_err(a, r) <= 1e-2, (name, rel_err(a, r))
    again = bwd.backward_local(dy, x, ids, tw, w1, w2, w3, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "reruns must be bitwise equal"
    return got


def skewed_ids(T: int, K: int, E: int, generator=None, never: int | None = None) -> torch.Tensor:
    """[T, K] expert ids of the real-shape tests: drawn from a skewed softmax over the experts
    (some hot, some cold), every 17th token's last slot dropped (-1); ``never``: an expert no
    token picks. Draws the same random numbers as the inline form the tests had."""
    probs = torch.softmax(torch.randn(E, device="cuda", generator=generator) * 1.5, 0)
    if never is not None:
        probs[never] = 0
    ids = torch.multinomial(probs.expand(T, E), K, replacement=False, generator=generator)
    ids[::17, -1] = -1
    return ids
