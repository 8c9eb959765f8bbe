"""What the tests share: the float64 reference of the MoE layer, the routings, the error
measures, the input builders, multi-process runs and the tiny TorchTitan models.

Test files import from here (tests/conftest.py puts this folder on sys.path); no test file
imports another. Nothing here imports the package's backends at module level, so importing
this module costs no Triton or CUDA set-up.

The float64 reference (``moe_f64``, ``grads_f64``, ``per_slot_f64``) is written from the
formula alone, independent of ops/reference.py (the reference backend is tested against it):

    out[t] = sum_k w[t,k] * w2[e] @ (silu(w1[e] @ x[t]) * (w3[e] @ x[t])),  e = ids[t,k],
    a slot with e = -1 contributes nothing, whatever its weight holds (NaN included).
"""

from __future__ import annotations
from torchtitan_megamoe.ops.options import MegaMoEOptions

import contextlib
import copy
import dataclasses
import functools
import math
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

# ------------------------------------------------------------------------------------- sizes

SMALL = dict(T=13, K=3, E=5, D=40, H=24)
"""Kernel test sizes: nothing a tile multiple, small enough for the CPU interpreter."""
BLOCK_M = 8
"""Plan tile height of the kernel tests (plan_for)."""
POISON = float("nan")
"""What buffers hold before a kernel writes them: an unwritten element that is read shows."""
NAMES = ("dx", "dtopk_weights", "dw1", "dw2", "dw3")
"""The op's gradients, in the backward's order."""

# ----------------------------------------------------------------------------------- routings


def distinct_ids(T: int, K: int, E: int, generator=None, experts=None) -> torch.Tensor:
    """[T, K] int64: K distinct experts per token (as top-k gives), uniform over ``experts``
    (default: all E), drawn from ``generator`` on its device."""
    device = generator.device if generator is not None else "cpu"
    if T == 0:
        return torch.empty(0, K, dtype=torch.int64, device=device)
    if experts is None:
        return torch.stack(
            [torch.randperm(E, generator=generator, device=device)[:K] for _ in range(T)]
        )
    pool = torch.tensor(experts, device=device)
    return torch.stack(
        [pool[torch.randperm(len(experts), generator=generator, device=device)[:K]]
         for _ in range(T)]
    )


def routing(name: str, T: int, K: int, E: int, seed: int = 0) -> torch.Tensor:
    """[T, K] int64 expert ids (-1: a dropped slot) of a named case, from its own generator
    seeded with ``seed``:

        random               K distinct random experts per token
        dropped              random, slot 0 of every 3rd token and every 5th token (from 1)
                             wholly dropped
        uneven               random over every expert but 1 (an empty expert), 20% of the
                             slots dropped
        one_expert           every token to expert E-1 in slot 0, other slots dropped: one
                             expert holds every row, the others are empty
        all_dropped          every slot dropped
        empty_experts        only experts 0 and 1 used (K >= 2: one slot each), slots from 2
                             on dropped
        all_dropped_but_one  one slot in the whole batch (token T//2 to expert 1)
        t1                   one token (T is ignored), random experts
    """
    g = torch.Generator().manual_seed(seed)
    if name == "random":
        return distinct_ids(T, K, E, g)
    if name == "dropped":
        ids = distinct_ids(T, K, E, g)
        ids[::3, 0] = -1
        ids[1::5] = -1
        return ids
    if name == "uneven":
        ids = distinct_ids(T, K, E, g, experts=[e for e in range(E) if e != 1])
        ids[torch.rand(T, K, generator=g) < 0.2] = -1
        return ids
    if name == "one_expert":
        ids = torch.full((T, K), -1, dtype=torch.int64)
        ids[:, 0] = E - 1
        return ids
    if name == "all_dropped":
        return torch.full((T, K), -1, dtype=torch.int64)
    if name == "empty_experts":
        ids = torch.full((T, K), -1, dtype=torch.int64)
        ids[:, 0] = distinct_ids(T, 1, 2, g)[:, 0]
        if K > 1:
            ids[:, 1] = 1 - ids[:, 0]
        return ids
    if name == "all_dropped_but_one":
        ids = torch.full((T, K), -1, dtype=torch.int64)
        ids[T // 2, 0] = 1
        return ids
    if name == "t1":
        return distinct_ids(1, K, E, g)
    raise ValueError(f"unknown routing {name!r}")


FORWARD_ROUTINGS = ("random", "dropped", "one_expert", "t1")
"""The forward kernels' cases: dropped slots, one expert with every row, one token."""
BACKWARD_ROUTINGS = ("uneven", "one_expert", "all_dropped")
"""The backward kernels' cases: an empty expert with dropped slots, one expert, nothing."""


def routings(T: int, K: int, E: int, seed: int = 0, names=FORWARD_ROUTINGS):
    """(name, topk_ids) for each of ``names`` (see ``routing``)."""
    for name in names:
        yield name, routing(name, T, K, E, seed)


def skewed_ids(T: int, K: int, E: int, generator=None, never: int | None = None,
               device="cuda") -> torch.Tensor:
    """[T, K] ids of the real-shape tests: K distinct experts drawn from a skewed softmax over
    the experts (some hot, some cold), every 17th token's last slot dropped; ``never``: an
    expert no token picks. On ``generator``'s device (else ``device``, global RNG)."""
    if generator is not None:
        device = generator.device
    probs = torch.softmax(torch.randn(E, device=device, generator=generator) * 1.5, 0)
    if never is not None:
        probs[never] = 0
    ids = torch.multinomial(probs.expand(T, E), K, replacement=False, generator=generator)
    ids[::17, -1] = -1
    return ids


def real_routing(T: int, K: int, E: int, device="cuda") -> torch.Tensor:
    """The whole-backward GPU tests' routing: skewed_ids (seed 0) with expert 7 never chosen
    and also every 23rd token's (from 5) first slot dropped (about 6% of the slots)."""
    ids = skewed_ids(T, K, E, torch.Generator(device=device).manual_seed(0), never=7)
    ids[5::23, 0] = -1
    return ids


# ------------------------------------------------------------------------- inputs and weights


def _draw(generator, dtype, device):
    gen_device = generator.device

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, device=gen_device) * scale).to(
            dtype).to(device)

    return draw


def make_weights(E, D, H, dtype=torch.bfloat16, device="cpu", seed=0, generator=None):
    """(w1 [E, H, D], w2 [E, D, H], w3 [E, H, D]) in TorchTitan's GroupedExperts layout, unit
    variance outputs (w1, w3 scaled by D^-1/2, w2 by H^-1/2); drawn (w1, w3, w2) from
    ``generator`` (on its device) or a CPU generator seeded with ``seed``."""
    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    draw = _draw(g, dtype, device)
    w1 = draw(E, H, D, scale=D**-0.5)
    w3 = draw(E, H, D, scale=D**-0.5)
    w2 = draw(E, D, H, scale=H**-0.5)
    return w1, w2, w3


def make_inputs(T, K, E, D, H, ids=None, seed=0, dtype=torch.bfloat16, device="cpu",
                generator=None) -> dict:
    """One layer's inputs: x [T, D], topk_ids [T, K] (``ids``, else distinct random experts),
    topk_weights [T, K] uniform in [0, 1) (fp32; fp64 with fp64 ``dtype``), the weights of
    make_weights and an output gradient dy [T, D]. Drawn in that order from ``generator``
    (which the caller may go on drawing from) or a CPU generator seeded with ``seed``."""
    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    draw = _draw(g, dtype, device)
    x = draw(T, D)
    w1, w2, w3 = make_weights(E, D, H, dtype, device, generator=g)
    tw_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    tw = torch.rand(T, K, generator=g, device=g.device).to(tw_dtype).to(device)
    if ids is None:
        ids = distinct_ids(T, K, E, g)
    dy = draw(T, D)
    return dict(x=x, topk_ids=ids.to(device), topk_weights=tw, w1=w1, w2=w2, w3=w3, dy=dy)


OUTLIER_KINDS = ("plain", "tokens", "channel", "both")
RESULT_NAMES = ("out", "dx", "dw1", "dw2", "dw3", "dtopk_weights")


def op_results(inp, precision, backend="reference", exact=False) -> dict:
    """{name: float64 result} (RESULT_NAMES) of mega_moe on make_inputs-style ``inp`` with the
    output gradient inp["dy"]; ``exact``: every input in float64 (the truth, at bf16 precision)."""
    from torchtitan_megamoe import mega_moe

    x, ids, tw, w1, w2, w3 = op_args(inp)
    leaves = [(t.double() if exact else t).detach().requires_grad_() for t in (x, tw, w1, w2, w3)]
    xx, tww, a, b, c = leaves
    out = mega_moe(xx, ids, tww, a, b, c, backend=backend, precision=precision)
    (out.double() * inp["dy"].double()).sum().backward()
    return dict(zip(RESULT_NAMES, [out.detach().double()] + [t.grad.double()
                                                              for t in (xx, a, b, c, tww)]))


def outlier_inputs(T, K, E, D, H, kind="both", seed=0, device="cpu", token_share=0.01,
                   token_scale=(20.0, 100.0), channel_scale=20.0) -> dict:
    """make_inputs (fp32 draws) with outliers in x, every tensor then rounded to bf16 (x, the
    weights, dy) or fp32 (topk_weights), so float64 sees the same values as a bf16 run.
    ``kind``: "tokens" scales ``token_share`` of the tokens by factors uniform in
    ``token_scale``; "channel" scales one of the D channels by ``channel_scale``; "both" does
    both; "plain" neither. Adds "outlier_tokens" (indices) and "outlier_channel" (-1: none)."""
    if kind not in OUTLIER_KINDS:
        raise ValueError(f"kind {kind!r} not in {OUTLIER_KINDS}")
    inp = make_inputs(T, K, E, D, H, seed=seed, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 7919)
    tokens, channel = torch.zeros(0, dtype=torch.long), -1
    if kind in ("tokens", "both"):
        tokens = torch.randperm(T, generator=g)[:max(1, round(token_share * T))]
        lo, hi = token_scale
        inp["x"][tokens] *= lo + (hi - lo) * torch.rand(len(tokens), 1, generator=g)
    if kind in ("channel", "both"):
        channel = int(torch.randint(D, (1,), generator=g))
        inp["x"][:, channel] *= channel_scale
    for k in ("x", "w1", "w2", "w3", "dy"):
        inp[k] = inp[k].to(torch.bfloat16)
    inp = {k: v.to(device) for k, v in inp.items()}
    return dict(inp, outlier_tokens=tokens.to(device), outlier_channel=channel)


def op_args(inp: dict) -> tuple:
    """(x, topk_ids, topk_weights, w1, w2, w3): the op's tensor arguments, in order."""
    return tuple(inp[k] for k in ("x", "topk_ids", "topk_weights", "w1", "w2", "w3"))


def nan_tensor(*shape, dtype=torch.bfloat16, device="cuda") -> torch.Tensor:
    """An output poisoned before a kernel writes it (unwritten elements stay NaN)."""
    return torch.full(shape, POISON, dtype=dtype, device=device)


# ------------------------------------------------------------------------ float64 reference


def moe_f64(x, topk_ids, topk_weights, w1, w2, w3) -> torch.Tensor:
    """float64 out [T, D] of the formula in this module's docstring, expert by expert over the
    slots routed to it (differentiable in x, topk_weights and the weights)."""
    x = x.double()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64, device=x.device)
    for e in range(w1.shape[0]):
        tok, k = torch.nonzero(topk_ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        h = F.silu(xe @ w1[e].double().T) * (xe @ w3[e].double().T)
        y = h @ w2[e].double().T
        out = out.index_add(0, tok, topk_weights[tok, k].double().unsqueeze(1) * y)
    return out


def grads_f64(inp: dict):
    """float64 autograd gradients (dx, dtopk_weights, dw1, dw2, dw3) of ``moe_f64`` for the
    output gradient inp["dy"] (inputs as make_inputs returns them)."""
    leaves = [inp[k].double().cpu().detach().requires_grad_()
              for k in ("x", "topk_weights", "w1", "w2", "w3")]
    x, tw, w1, w2, w3 = leaves
    out = moe_f64(x, inp["topk_ids"].cpu(), tw, w1, w2, w3)
    if out.grad_fn is None:  # no slot routed anywhere: every gradient is zero
        return tuple(torch.zeros_like(l) for l in leaves)
    grads = torch.autograd.grad(out, leaves, inp["dy"].double().cpu(), allow_unused=True)
    return tuple(torch.zeros_like(l) if g is None else g for g, l in zip(grads, leaves))


def per_slot_f64(inp: dict) -> dict:
    """Closed-form per-slot intermediates of the backward in float64, keyed by slot
    s = t*K + k: da1, da3, hw [T*K, H]; dtw [T*K]; dx_slot [T*K, D]. Dropped slots hold zeros.
    (tests/test_moe_testing.py checks them against grads_f64.)"""
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
    """The hopper backend's plan of ``ids`` at the kernel tests' tile height."""
    from torchtitan_megamoe.ops.hopper.plan import build_plan

    return build_plan(ids, E, block_m)


# ----------------------------------------------------------------------------- error measures


def rel_err(got, ref) -> float:
    """||got - ref|| / ||ref|| (Frobenius, float64): 0 when both are zero, inf when only ref
    is. On got's device when both share it, else on the CPU."""
    if got.device != ref.device:
        got, ref = got.cpu(), ref.cpu()
    got, ref = got.detach().reshape(-1), ref.detach().reshape(-1)
    num = den = 0.0
    step = 1 << 24  # float64 a chunk at a time: a 235B weight gradient whole would be 6 GB
    for i in range(0, max(ref.numel(), 1), step):
        g, r = got[i:i + step].double(), ref[i:i + step].double()
        num += float((g - r).square().sum())
        den += float(r.square().sum())
    num, den = math.sqrt(num), math.sqrt(den)
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return num / den


def assert_close(got, ref, tol=1e-2, name=""):
    """max |got - ref| <= tol * max |ref| (a scale-aware bound suited to bf16 outputs); got
    must be finite (an unwritten, poisoned element fails)."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values (an unwritten row was read?)"
    err = (got - ref).abs().max().item() if got.numel() else 0.0
    scale = ref.abs().max().item() if ref.numel() else 0.0
    assert err <= tol * scale + 1e-6, f"{name}: max abs err {err:.3e} > {tol} * {scale:.3e}"


def same_bits(a, b) -> bool:
    """Bitwise equality (NaN-safe): the determinism tests compare raw bytes."""
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


# ------------------------------------------------------------------- hopper backward helpers


def saved_and_recomputed(ids, E, D, H, seed):
    """The hopper EP=1 backward on make_inputs(ids, seed) (NaN weights on dropped slots) both
    ways: (inputs, forward_bf16's saved tuple, gradients from it, gradients recomputing)."""
    from torchtitan_megamoe.ops.hopper.bf16_backward import backward_bf16
    from torchtitan_megamoe.ops.hopper.bf16_forward import forward_bf16

    inp = make_inputs(ids.shape[0], ids.shape[1], E, D, H, ids, seed=seed)
    inp["topk_weights"][inp["topk_ids"] < 0] = float("nan")
    args = op_args(inp)
    out, saved = forward_bf16(*args, save=True)
    assert torch.equal(out, forward_bf16(*args))  # saving changes nothing in the forward
    saved_grads = backward_bf16(inp["dy"], *args, saved=saved)
    return inp, saved, saved_grads, backward_bf16(inp["dy"], *args)


@functools.cache
def sm90_ready() -> bool:
    """An sm_90 GPU and nvcc that builds csrc/ (the ``sm90`` marker's condition, checked by
    tests/conftest.py when such a test is about to run)."""
    if not torch.cuda.is_available():
        return False
    from torchtitan_megamoe.ops.hopper.cuda.sm90 import sm90_buildable

    return sm90_buildable(torch.empty(1, device="cuda"))


SM90_GPU = [pytest.mark.gpu, pytest.mark.sm90]
"""pytestmark of the csrc/ kernel tests: gpu, and skipped unless sm90_ready()."""


def forced_backward_matches_reference(monkeypatch, forced: dict, seed: int, saved: bool):
    """backward_bf16 with each tuner stage named in ``forced`` ({stage: a config of its table,
    ops/hopper/sides/}) forced to that config, which must be offered: every gradient against the reference backend within 1e-2, bitwise-equal reruns.
    Inputs: a 4096-token layer (E 32, K 8, D 1024, H 512) with dropped slots and an empty
    expert (3). ``saved``: the backward reads forward_bf16(save=True)'s saved tensors. Returns
    the gradients (dx, dtw, dw1, dw2, dw3)."""
    import importlib

    from torchtitan_megamoe.ops import reference
    from torchtitan_megamoe.ops.hopper.bf16_forward import forward_bf16

    bwd = importlib.import_module("torchtitan_megamoe.ops.hopper.bf16_backward")
    picked = []
    real_pick = bwd.pick_config

    def force(stage, key, problem, launch, outputs=None):
        if stage.name in forced:
            cfg = forced[stage.name]
            offered = stage.offer(*problem()).candidates
            assert cfg in offered, f"{cfg} must be offered for {stage.name} at this shape"
            picked.append(stage.name)
            return cfg
        return real_pick(stage, key, problem, launch, outputs)

    monkeypatch.setattr(bwd, "pick_config", force)
    T, K, E, D, H = 4096, 8, 32, 1024, 512
    g = torch.Generator(device="cuda").manual_seed(seed)
    inp = make_inputs(T, K, E, D, H, device="cuda", generator=g)
    ids = inp["topk_ids"]
    ids[::5, 0] = -1
    ids[ids == 3] = -1  # an empty expert
    x, _, tw, w1, w2, w3 = op_args(inp)
    dy = inp["dy"]
    kw = dict(saved=forward_bf16(x, ids, tw, w1, w2, w3, save=True)[1]) if saved else {}
    got = bwd.backward_bf16(dy, x, ids, tw, w1, w2, w3, **kw)
    assert sorted(picked) == sorted(forced)
    ref = reference.backward(dy, x, ids, tw, w1, w2, w3, None, MegaMoEOptions(precision="bf16"))
    for name, a, r in zip(NAMES, got, ref):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        assert rel_err(a, r) <= 1e-2, (name, rel_err(a, r))
    again = bwd.backward_bf16(dy, x, ids, tw, w1, w2, w3, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "reruns must be bitwise equal"
    return got


# ------------------------------------------------------------------------------ several ranks


def run_ranks(worker, nprocs: int, *args) -> list:
    """Spawn ``worker(rank, *args, init_file, result_file)`` on ``nprocs`` processes (init_file
    for ``init_method="file://..."``; each rank torch.saves its result to
    ``f"{result_file}.{rank}"``) and return the results in rank order."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        result = os.path.join(d, "result")
        try:
            mp.spawn(worker, args=(*args, os.path.join(d, "init"), result), nprocs=nprocs,
                     join=True)
        except mp.ProcessExitedException as err:
            # gloo can abort a process in its own teardown (std::terminate on a joinable
            # thread) after the rank's work is done: a rank that saved its result finished
            if not err.signal_name or not all(os.path.exists(f"{result}.{r}")
                                              for r in range(nprocs)):
                raise
        return [torch.load(f"{result}.{r}") for r in range(nprocs)]


def finish_rank() -> None:
    """The end of a rank of run_ranks: every rank's collectives done, then the group torn down
    (a rank tearing gloo down while a peer still talks to it can abort)."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def init_gloo(rank: int, world: int, init_file: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)


# ------------------------------------------------------------- tiny TorchTitan Qwen3-MoE models


def tiny_args(n_layers: int = 2, dim: int = 64, moe_inter_dim: int = 32, **moe):
    """Qwen3ModelArgs with Qwen3-MoE semantics at toy size (flavors.QWEN3_TINY_MOE_ARGS);
    ``moe`` overrides MoEArgs fields."""
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3 import Qwen3ModelArgs

    from torchtitan_megamoe.flavors import QWEN3_TINY_MOE_ARGS

    moe_args = dict(QWEN3_TINY_MOE_ARGS)
    moe_args.update(moe)
    return Qwen3ModelArgs(
        vocab_size=128,
        max_seq_len=64,
        head_dim=16,
        dim=dim,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=96,
        moe_enabled=True,
        moe_inter_dim=moe_inter_dim,
        moe_args=MoEArgs(**moe_args),
    )


def job_config(converters=("megamoe",), **megamoe):
    """A JobConfig with ``converters`` and [megamoe] settings (backend reference unless set)."""
    from torchtitan.config import JobConfig

    from torchtitan_megamoe.config import MegaMoEConfig

    jc = JobConfig()
    jc.model.converters = list(converters)
    jc.megamoe = MegaMoEConfig(**{"backend": "reference", **megamoe})
    return jc


def with_parallelism(jc, **degrees):
    jc.parallelism = dataclasses.replace(jc.parallelism, **degrees)
    return jc


def init_model(model: torch.nn.Module, seed: int, device="cpu") -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))
    return model


def build_stock(args, seed: int = 0):
    from torchtitan.models.qwen3 import Qwen3Model

    with torch.device("meta"):
        model = Qwen3Model(copy.deepcopy(args))
    model.to_empty(device="cpu")
    return init_model(model, seed)


def build_converted(args, seed: int = 0, jc=None, device="cpu"):
    """What TorchTitan's trainer does: build on meta, convert, materialize, init."""
    from torchtitan.models.qwen3 import Qwen3Model

    from torchtitan_megamoe.converter import MegaMoEConverter

    with torch.device("meta"):
        model = Qwen3Model(copy.deepcopy(args))
    MegaMoEConverter(jc or job_config(), None).convert(model)
    model.to_empty(device=device)
    return init_model(model, seed, device)


def autocast_backward(model, tokens, labels, device="cpu", checkpointed=False) -> torch.Tensor:
    """One training step's forward under a bf16 autocast (TorchTitan on one device), the
    cross-entropy loss in fp32 and its backward; returns the loss. ``checkpointed``: the
    forward under full activation checkpointing (non-reentrant, as TorchTitan's)."""
    from torch.utils.checkpoint import checkpoint

    with torch.autocast(device, dtype=torch.bfloat16):
        logits = (checkpoint(model, tokens, use_reentrant=False) if checkpointed
                  else model(tokens))
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    return loss.detach()


def token_batches(vocab_size: int, steps: int, seed: int, device="cpu", shape=(2, 16)):
    """``steps`` (tokens, labels) pairs of random token ids, from one generator."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield (torch.randint(0, vocab_size, shape, generator=gen).to(device),
               torch.randint(0, vocab_size, shape, generator=gen).to(device))


@contextlib.contextmanager
def cpu_histc():
    """The stock router counts int64 expert ids with torch.histc, which has no integer CPU
    kernel; count in float32 (exact at these sizes) and return the input dtype, as CUDA does."""
    original = torch.histc

    def histc(input, bins=100, min=0, max=0):  # noqa: A002
        if not input.is_floating_point():
            return original(input.float(), bins=bins, min=min, max=max).to(input.dtype)
        return original(input, bins=bins, min=min, max=max)

    torch.histc = histc
    try:
        yield
    finally:
        torch.histc = original


# --------------------------------------------------------------------------- captured logs

TITAN_LOG_SAMPLE = """\
[titan] 2026-11-29 22:12:36,985 - root - INFO - Building device mesh with parallelism: pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=2, etp=1
[titan] 2026-11-29 22:12:37,102 - root - INFO - Applied FSDP to the model
[titan] 2026-11-29 22:12:37,338 - root - INFO - Training starts at step 1
[titan] 2026-11-29 22:12:38,129 - root - INFO - step:  1  loss:  6.80345  grad_norm:  0.8245  memory:  0.56GiB(2.38%)  tps: 239  tflops: 0.00  mfu: 0.00%
[titan] 2026-11-29 22:12:38,130 - root - INFO - Synchronizing and adjusting timeout for all ProcessGroups to 0:01:40
[titan] 2026-11-29 22:12:38,236 - root - INFO - step:  2  loss:  6.71143  grad_norm:  0.7650  memory:  0.56GiB(2.38%)  tps: 2,410  tflops: 0.00  mfu: 0.00%
[titan] 2026-11-29 22:12:38,318 - root - INFO - \x1b[31mstep:  3  \x1b[32mloss:  6.59527  \x1b[38;2;180;60;0mgrad_norm:  0.8820  \x1b[38;2;54;234;195mmemory:  0.56GiB(2.39%)  \x1b[34mtps: 3,134  \x1b[36mtflops: 0.00  \x1b[35mmfu: 0.00%\x1b[39m
[titan] 2026-11-29 22:12:38,319 - root - INFO - validate step:  3  loss:  6.9000  memory:  0.56GiB(2.39%)  tps: 9,999
[titan] 2026-11-29 22:12:38,502 - root - INFO - step:  5  loss:  6.32579  grad_norm:  0.8398  memory:  0.57GiB(2.40%)  tps: 1,474  tflops: 1,234.50  mfu: 12.50%
[titan] 2026-11-29 22:12:39,002 - root - INFO - Sleeping 2 seconds for other ranks to complete
"""
"""Rank 0 of a real 2-rank FSDP + EP=2 CPU run of train_configs/qwen3_moe_tiny_cpu.toml
(stock), trimmed, plus one colored line as TorchTitan prints it by default and a validation
line (the A/B tool's log parser reads it)."""


def fake_ab_run(seen: list, files: dict):
    """A stand-in for ab.driver.run_one (a GPU run's outputs without the GPU): records each
    command in ``seen``, writes ``files`` (path under the run's dump folder -> bytes) and
    TITAN_LOG_SAMPLE as the run's log."""

    def run(cmd, log_path, env, timeout):
        seen.append(cmd)
        dump = cmd[cmd.index("--job.dump_folder") + 1]
        for rel, data in files.items():
            path = os.path.join(dump, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        with open(log_path, "w") as f:
            f.write(TITAN_LOG_SAMPLE)
        return 0

    return run


class OpNames(TorchDispatchMode):
    """Records the name of every aten op dispatched while active (``.names``)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))
