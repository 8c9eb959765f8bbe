"""No weight quantization in the step's critical path (ops/fp8_weights.py, its hopper side, moe.py,
fp8_allgather.py): the FP8 expert weights are made by the module that owns them, once per
optimizer step, and are never stale.

- Fp8Weights: the transposed copies come from the FP8 copy (bitwise what quantizing the bf16
  weight into the transposed layout gives); through the op they give bitwise the results of
  per-call quantization, eagerly and through the registered op.
- MegaExperts: one make until a weight changes; each way of changing one outside the optimizer
  step (copy_, load_state_dict, .data =, an in-place op) is seen; the post-optimizer hook makes
  them and the next forward and backward make nothing; under bf16 autocast the copies come from
  the fp32 parameter and give the per-call cast's bits; with fp8_free_after_backward (the
  default) each layer's copies live from its forward to the end of its backward.
- The converter's training loop (TorchTitan's Qwen3 at the tiny FP8 flavor's shape, AdamW, the
  post-optimizer hook), cache on against off, bitwise, with quantization counts per step; under
  FSDP on 2 gloo ranks the same, with the FP8 all-gather (and a checkpoint save / load).

The hopper backend runs under Triton's interpreter on CPU (tests/conftest.py), on the GPU
otherwise; the gloo tests run on CPU machines only.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import weakref

import pytest
import torch
import torch.nn.functional as F

from moe_testing import (OpNames, autocast_backward, build_converted, cpu_histc, init_gloo,
                         job_config, make_inputs, op_args, routing, run_ranks, token_batches)

from torchtitan_megamoe import mega_moe
from torchtitan_megamoe.moe import MegaExperts, _StandIns
from torchtitan_megamoe.ops.fp8_weights import Fp8Weights, TransposedWeights, dequantized
from torchtitan_megamoe.ops.hopper import fp8_weights as fw
from torchtitan_megamoe.ops.options import MegaMoEOptions

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
NO_GPU = pytest.mark.skipif(CUDA, reason="gloo ranks with the interpreter; the GPU has its own")
T, K, E, D, H = 24, 2, 4, 128, 128


@contextlib.contextmanager
def counting():
    """Counts of fp8_weights' weight quantizations and FP8 block transposes while inside."""
    seen = {"quant": 0, "transpose": 0}
    real_q, real_t = fw.quant_weight, fw.transpose_blocks

    def quant(*a, **k):
        seen["quant"] += 1
        return real_q(*a, **k)

    def transpose(*a, **k):
        seen["transpose"] += 1
        return real_t(*a, **k)

    fw.quant_weight, fw.transpose_blocks = quant, transpose
    try:
        yield seen
    finally:
        fw.quant_weight, fw.transpose_blocks = real_q, real_t


def _weights(seed=0, dtype=torch.bfloat16):
    inp = make_inputs(T, K, E, D, H, routing("uneven", T, K, E, seed), seed=seed,
                      dtype=torch.float32, device=DEVICE)
    x, ids, tw, w1, w2, w3 = op_args(inp)
    return x.to(dtype), ids, tw.to(dtype), *(w.to(dtype) for w in (w1, w2, w3))


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


# ------------------------------------------------------------------------------ Fp8Weights


def test_copies_come_from_one_pass_per_weight():
    _x, _ids, _tw, w1, w2, w3 = _weights()
    with counting() as seen:
        made = fw.make_fp8_weights(w1, w2, w3)
    # one quantization pass per weight writes both layouts; nothing is transposed afterwards
    assert seen == {"quant": 3, "transpose": 0}
    want_w2t, want_w13t = fw._w2_transposed(w2), fw._w13_transposed(w1, w3)
    want_fwd = fw._forward_weights(w1, w2, w3)
    for name in ("w1q", "w1s", "w2q", "w2s", "w3q", "w3s"):
        assert torch.equal(_bytes(getattr(made.fwd, name)), _bytes(getattr(want_fwd, name)))
    for got, want in ((made.w2t, want_w2t), (made.w13t, want_w13t)):
        assert torch.equal(_bytes(got.q), _bytes(want.q)) and torch.equal(got.s, want.s)
    part = fw.w13_transposed(w1, w3, 1, 3, cache=made)
    assert torch.equal(_bytes(part.q), _bytes(want_w13t.q[1:3]))
    # only the forward copy held (what the FSDP all-gather brings): made from it on demand
    fwd_only = Fp8Weights(made.fwd)
    for got, want in ((fw.w2_transposed(w2, cache=fwd_only), want_w2t),
                      (fw.w13_transposed(w1, w3, 1, 3, cache=fwd_only),
                       TransposedWeights(want_w13t.q[1:3], want_w13t.s[1:3]))):
        assert torch.equal(_bytes(got.q), _bytes(want.q)) and torch.equal(got.s, want.s)
    assert fw.make_fp8_weights(w1, w2, w3, forward=False).fwd is None  # fp8_bwd
    assert made.nbytes() == 2 * 3 * E * H * D + 2 * 3 * E * (H // 128) * (D // 128) * 4
    with pytest.raises(ValueError, match="neither"):
        fw.make_fp8_weights(w1, w2, w3, forward=False, transposed=False)


def test_copies_of_fp32_weights_round_to_the_compute_dtype_in_the_pass():
    """Under a bf16 autocast the copies are made from the fp32 parameters: bitwise the copies of
    their bf16 cast, without a cast pass."""
    _x, _ids, _tw, w1, w2, w3 = _weights(dtype=torch.float32)
    # values bf16 cannot hold, so a missing rounding would show
    w1, w2, w3 = (w * (1 + 2.0 ** -12) for w in (w1, w2, w3))
    got = fw.make_fp8_weights(w1, w2, w3, dtype=torch.bfloat16)
    want = fw.make_fp8_weights(*(w.to(torch.bfloat16) for w in (w1, w2, w3)))
    for a, b in zip(got.tensors(), want.tensors()):
        assert torch.equal(_bytes(a), _bytes(b))


def test_op_with_copies_is_bitwise_per_call_quantization():
    """mega_moe(fp8_weights=...) against the same call quantizing per call: forward and every
    gradient bitwise, eager and through the registered op (a dispatch mode forces it), with the
    zero-stride stand-ins MegaExperts gives the op in fp8."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x, ids, tw, w1, w2, w3 = _weights()
    dy = torch.randn(T, D, device=DEVICE).to(torch.bfloat16)
    for precision in ("fp8", "fp8_bwd"):
        copies = fw.make_fp8_weights(w1, w2, w3, forward=precision == "fp8")
        results = []
        for given, stand_ins, mode in ((False, False, None), (True, False, None),
                                       (True, precision == "fp8", Passthrough)):
            leaves = [t.detach().clone().requires_grad_() for t in (x, tw, w1, w2, w3)]
            xx, tww, *ws = leaves
            if stand_ins:
                ws = [torch.zeros((), dtype=w.dtype, device=w.device).expand(w.shape)
                      .requires_grad_() for w in ws]
                leaves[2:] = ws
            with mode() if mode else contextlib.nullcontext():
                out = mega_moe(xx, ids, tww, *ws, backend="hopper", precision=precision,
                               fp8_weights=copies if given else None)
            (out.float() * dy.float()).sum().backward()
            results.append([out.detach()] + [t.grad for t in leaves])
        for other in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(results[0], other)), precision


def test_op_checks_the_copies():
    x, ids, tw, w1, w2, w3 = _weights()
    copies = fw.make_fp8_weights(w1, w2, w3)
    with pytest.raises(ValueError, match="precision='bf16'"):
        mega_moe(x, ids, tw, w1, w2, w3, backend="hopper", fp8_weights=copies)
    bad = Fp8Weights(copies.fwd, TransposedWeights(copies.w13t.q, copies.w13t.s))
    with pytest.raises(ValueError, match=r"fp8_weights w2t_q is \(4, 128, 256\)"):
        mega_moe(x, ids, tw, w1, w2, w3, backend="hopper", precision="fp8", fp8_weights=bad)


def test_reference_backend_reads_stand_ins_through_the_copies():
    """A call that ends up on the reference backend with stand-ins (only the FP8 copy gathered)
    computes from the copies' values, and the gradients reach the stand-ins."""
    x, ids, tw, w1, w2, w3 = _weights()
    copies = fw.make_fp8_weights(w1, w2, w3)
    deq = [dequantized(q, s, torch.bfloat16) for q, s in
           ((copies.fwd.w1q, copies.fwd.w1s), (copies.fwd.w2q, copies.fwd.w2s),
            (copies.fwd.w3q, copies.fwd.w3s))]
    stand = [torch.zeros((), dtype=torch.bfloat16, device=DEVICE).expand(w.shape)
             .requires_grad_() for w in (w1, w2, w3)]
    got = mega_moe(x, ids, tw, *stand, backend="reference", precision="fp8", fp8_weights=copies)
    want = mega_moe(x, ids, tw, *deq, backend="reference", precision="fp8")
    assert torch.equal(got, want)
    got.float().sum().backward()
    assert all(s.grad is not None and s.grad.shape == s.shape for s in stand)


# ------------------------------------------------------------------------------ MegaExperts


def _experts(precision="fp8", cache=True, dtype=torch.bfloat16, seed=0, keep_transposed=True,
             free=True):
    m = MegaExperts(D, H, E, options=MegaMoEOptions(backend="hopper", precision=precision,
                                                    fp8_weight_cache=cache,
                                                    fp8_keep_transposed=keep_transposed,
                                                    fp8_free_after_backward=free))
    _x, _ids, _tw, w1, w2, w3 = _weights(seed)
    with torch.no_grad():
        for p, w in zip((m.w1, m.w2, m.w3), (w1, w2, w3)):
            p.data = w.to(dtype).clone()
    return m


def _call(m, seed=0, autocast=False):
    x, ids, tw, *_ = _weights(seed)
    x = x.float() if autocast else x
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        return m(x, ids, tw.to(x.dtype))


def test_module_makes_its_copies_once_and_sees_every_change():
    m, ref = _experts(free=False), _experts(cache=False)
    with counting() as seen:
        first = _call(m)
        _call(m, seed=1)
    assert m.fp8_weights_made == 1 and seen["quant"] == 3
    assert torch.equal(first, _call(ref))

    def changed(write):
        before = m.fp8_weights_made
        with torch.no_grad():
            write(m)
            write(ref)
        out = _call(m)
        assert m.fp8_weights_made == before + 1, write
        assert torch.equal(out, _call(ref)), write  # made from the new values

    changed(lambda e: e.w1.copy_(e.w1 * 0.5))  # a manual copy_
    changed(lambda e: e.w2.mul_(2))  # any in-place op
    sd = {k: v.clone() * 0.25 for k, v in _experts(seed=3).state_dict().items()}
    changed(lambda e: e.load_state_dict(sd))  # a checkpoint load
    new = torch.randn_like(m.w3) * 0.01
    changed(lambda e: setattr(e.w3, "data", new.clone()))  # new storage
    changed(lambda e: setattr(e, "w1", torch.nn.Parameter(e.w1.detach().clone())))  # new param
    # the optimizer step: the post-optimizer hook makes them, the next calls make nothing
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x, ids, tw, *_ = _weights()
    m(x, ids, tw).float().sum().backward()
    opt.step()
    made = m.fp8_weights_made
    m.refresh_weight_copies()
    assert m.fp8_weights_made == made + 1
    with counting() as seen:
        m(x, ids, tw).float().sum().backward()
    assert seen == {"quant": 0, "transpose": 0} and m.fp8_weights_made == made + 1


def test_copies_made_ahead_are_the_ones_the_call_takes():
    """The converter's model pre-hook (make_weight_copies_ahead) makes the copies of the dtype
    the layer computes in: its call then makes none; where copies do not apply, nothing."""
    m = _experts(dtype=torch.float32)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        assert m.make_weight_copies_ahead()
    assert m.fp8_weights_made == 1
    with counting() as seen:
        _call(m, autocast=True)
    assert seen["quant"] == 0 and m.fp8_weights_made == 1
    for off in (_experts(precision="bf16"), _experts(cache=False)):
        assert not off.make_weight_copies_ahead() and off._fp8 is None


def test_stand_ins_cost_no_kernel():
    """Precision fp8 hands the op zero-stride stand-ins of its weights: expanded from one cached
    zero, no fill kernel per weight and call."""
    m = _experts()
    ws = (m.w1, m.w2, m.w3)
    _StandIns.apply(*ws)  # the first call per dtype and device makes the zero
    with OpNames() as ops:
        stand = _StandIns.apply(*ws)
    assert not [n for n in ops.names if "fill" in n or "zero" in n], ops.names
    assert all(t.shape == w.shape and not any(t.stride()) and not t.any()
               for t, w in zip(stand, ws))


def test_fused_optimizer_step_is_seen_through_the_hook():
    """torch's fused AdamW (TorchTitan's default on GPUs) writes the weights without moving
    their version counters: only the post-optimizer hook can see its step, so it re-makes the
    copies every time, and the next call computes with the stepped weights."""
    m, ref = _experts(free=False), _experts(cache=False)
    x, ids, tw, *_ = _weights()
    opts = [torch.optim.AdamW(e.parameters(), lr=1e-2, fused=True) for e in (m, ref)]
    for e, opt in zip((m, ref), opts):
        e(x, ids, tw).float().sum().backward()
        versions = [p._version for p in e.parameters()]
        opt.step()
        assert [p._version for p in e.parameters()] == versions  # the step is invisible
    made = m.fp8_weights_made
    m.refresh_weight_copies()
    assert m.fp8_weights_made == made + 1
    assert torch.equal(_call(m), _call(ref))  # the stepped weights, not the old copies


def test_forward_copies_only_transpose_in_the_backward():
    """fp8_keep_transposed=False: half the memory kept; the backward makes the transposed
    copies from the held FP8 copy (3 block transposes per call, no quantization), same bits."""
    x, ids, tw, *_ = _weights()
    grads = []
    for keep in (True, False):
        m = _experts(keep_transposed=keep)
        m(x, ids, tw)  # makes the copies
        assert (m._fp8.w2t is None) is (not keep)
        with counting() as seen:
            m(x, ids, tw).float().sum().backward()
        assert seen == {"quant": 0, "transpose": 0 if keep else 3}
        grads.append([p.grad for p in (m.w1, m.w2, m.w3)])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


class _Probe(torch.autograd.Function):
    """Identity whose backward records, per layer, whether any of the FP8 copies the layers
    held after their forward (``alive``: weak references) still exists at that moment."""

    @staticmethod
    def forward(ctx, seen, alive, t):
        ctx.seen, ctx.alive = seen, alive
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        ctx.seen.append([any(r() is not None for r in refs) for refs in ctx.alive])
        return None, None, grad


def _copies(m) -> list:
    """Weak references to the FP8 copy tensors ``m`` holds now."""
    return [weakref.ref(t) for t in m._fp8.tensors() if t is not None] if m._fp8 else []


def test_copies_live_from_the_forward_to_the_end_of_the_backward():
    """fp8_free_after_backward (the default): two layers in a chain; each layer's copies are
    gone (no tensor of them left, while the step's graph is still alive) right after its own
    backward, before the earlier layer's backward runs; the next forward makes them again, once
    per layer and step as with the hook, and the results are bitwise the per-call
    quantization's. Without a backward (no_grad) they stay; with x not needing a gradient the
    weights' path frees them."""
    x, ids, tw, *_ = _weights()
    layers, refs = [_experts(seed=s) for s in (0, 1)], [_experts(cache=False, seed=s)
                                                        for s in (0, 1)]

    def step(chain, seen):
        """One fwd+bwd through the chain: the gradients, the quantization counts."""
        xx = x.detach().clone().requires_grad_()
        for m in chain:
            m.zero_grad(set_to_none=True)
        alive = [[], []]
        with counting() as made:
            first = chain[0](xx, ids, tw)
            alive[0] += _copies(chain[0])
            out = chain[1](_Probe.apply(seen, alive, first), ids, tw)
            alive[1] += _copies(chain[1])
            seen.append([any(r() is not None for r in refs) for refs in alive])
            loss = out.float().sum()
            loss.backward()  # loss (and the graph) stays alive past the probe
        return [xx.grad] + [p.grad for m in chain for p in (m.w1, m.w2, m.w3)], made

    seen = []
    want, _ = step(refs, seen)
    assert seen == [[False, False]] * 2, seen  # no copies held without the cache
    seen = []
    for n in (1, 2):  # the weights do not change: the same gradients each time
        got, made = step(layers, seen)
        assert made == {"quant": 6, "transpose": 0}, made
        assert all(m.fp8_weights_made == n for m in layers)
        for m in layers:
            m.refresh_weight_copies()  # the hook finds nothing to re-make
        assert all(m.fp8_weights_made == n and m._fp8 is None for m in layers)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert seen == [[True, True], [True, False]] * 2, seen

    m = layers[0]
    with torch.no_grad():
        m(x, ids, tw)
    assert m._fp8 is not None  # no backward to follow: kept (the hook re-makes them)
    m(x.detach(), ids, tw).float().sum().backward()  # x without a gradient: w1 carries it
    assert m._fp8 is None and m.w1.grad is not None


def test_off_precision_and_backend_make_nothing():
    for m in (_experts(cache=False), _experts(precision="bf16")):
        _call(m)
        assert m.fp8_weights_made == 0 and m._fp8 is None
    m = _experts()
    m.options = MegaMoEOptions(backend="reference", precision="fp8")
    _call(m)
    assert m.fp8_weights_made == 0


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_autocast_copies_come_from_the_parameter(precision):
    """fp32 parameters under a bf16 autocast (TorchTitan without FSDP): the copies are made
    from the parameter (the bits the op's per-call cast would give), outputs and fp32
    gradients bitwise those of per-call quantization; fp8 gives the op stand-ins, not a cast."""
    from torchtitan_megamoe.ops import api

    on = _experts(precision, dtype=torch.float32, free=False)
    off = _experts(precision, False, torch.float32)
    seen = []
    real = api._run_forward

    def spy(*args):
        seen.append(all(not any(w.stride()) for w in args[3:6]))
        return real(*args)

    api._run_forward = spy
    try:
        outs = []
        for m in (on, off):
            out = _call(m, autocast=True)
            out.float().sum().backward()
            outs.append([out.detach()] + [p.grad for p in (m.w1, m.w2, m.w3)])
    finally:
        api._run_forward = real
    assert seen == [precision == "fp8", False]
    assert on.fp8_weights_made == 1 and (on._fp8.fwd is not None) == (precision == "fp8")
    assert all(g.dtype == torch.float32 for g in outs[0][1:])
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    # both write the fp32 gradients themselves (no bf16 rounding, no cast pass): fp8 through
    # the stand-ins, fp8_bwd from the bf16 forward's own cast of the weights
    assert all(bool((g.view(torch.int32) & 0xFFFF).any()) for g in outs[0][1:])


def test_inference_mode_first_call_then_training():
    m = _experts()
    with torch.inference_mode():
        _call(m)
    x, ids, tw, *_ = _weights()
    m(x, ids, tw).float().sum().backward()  # the copies made under inference_mode are normal
    assert m.fp8_weights_made == 1 and m.w1.grad is not None


# ------------------------------------------------------------------ the converter's training


def _train(cache, precision, steps=3, seed=0):
    """TorchTitan's way on one device: meta build, convert, materialize, init; bf16 autocast
    over fp32 parameters; AdamW; the converter's post-optimizer hook after each step."""
    from torchtitan.models.qwen3 import qwen3_args

    import torchtitan_megamoe.flavors  # noqa: F401  (registers megamoe_tiny_fp8)
    from torchtitan_megamoe.converter import MegaMoEConverter

    # one layer: the copies are made and freed per layer, and each interpreted layer costs ~a
    # minute per step (fp8_bwd)
    args = dataclasses.replace(copy.deepcopy(qwen3_args["megamoe_tiny_fp8"]), n_layers=1)
    jc = job_config(backend="hopper", precision=precision, fp8_weight_cache=cache)
    conv = MegaMoEConverter(jc, None)
    model = build_converted(args, seed, jc, DEVICE)
    experts = [m for m in model.modules() if isinstance(m, MegaExperts)]
    ready = []  # per layer call: were its copies there before it ran?
    for m in experts:
        m.register_forward_pre_hook(lambda mod, _args: ready.append(mod._fp8 is not None))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, counts = [], []
    for tokens, labels in token_batches(args.vocab_size, steps, seed + 1, DEVICE):
        opt.zero_grad()
        with counting() as in_step:
            loss = autocast_backward(model, tokens, labels, DEVICE)
        opt.step()
        with counting() as in_hook:
            conv.post_optimizer_hook([model])
        losses.append(loss.detach())
        counts.append((dict(in_step), dict(in_hook)))
    return losses, [p.detach().clone() for p in model.parameters()], counts, ready


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_training_cache_on_is_bitwise_cache_off(precision):
    # two steps, each making the copies in its forward and freeing them in its backward
    # (each step of the CPU interpreter costs a minute and more)
    with cpu_histc():
        on_losses, on_params, on_counts, on_ready = _train(True, precision, steps=2)
        off_losses, off_params, off_counts, off_ready = _train(False, precision, steps=2)
    layers = len(on_ready) // 2
    assert all(torch.equal(a, b) for a, b in zip(on_losses, off_losses)), (on_losses, off_losses)
    assert all(torch.equal(a, b) for a, b in zip(on_params, off_params))
    # on: each step's forward makes each layer's copies (one pass per weight writes both
    # layouts) before the first layer runs (the converter's model pre-hook), its backward
    # frees them (fp8_free_after_backward), so the optimizer hook has none to re-make: one
    # make per layer per optimizer step
    assert all(on_ready) and not any(off_ready), (on_ready, off_ready)
    once = {"quant": 3 * layers, "transpose": 0}
    none = {"quant": 0, "transpose": 0}
    assert all(c == (once, none) for c in on_counts), on_counts
    # off: every call quantizes, the hook makes nothing
    assert all(step["quant"] > 0 and hook == none for step, hook in off_counts), off_counts


# ----------------------------------------------------------- FSDP (2 gloo ranks, EP = 1)


def _fsdp_worker(rank, world, precision, ep, init_file, result_file):
    """TorchTitan's parallelize_qwen3 with FSDP over both ranks (bf16 params in the
    all-gather), the tiny FP8 flavor's shape, cache on (FP8 all-gather) against off; then a
    checkpoint save, a change, and a load: the shard's FP8 copy follows each. ``ep``: expert
    parallelism over the ranks too (FSDP then shards the experts over the ranks EP leaves)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, set_model_state_dict,
    )

    import torchtitan_megamoe.cpu as cpu
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.qwen3 import Qwen3Model, parallelize_qwen3

    from moe_testing import build_stock, tiny_args
    from torchtitan_megamoe.converter import MegaMoEConverter
    from torchtitan_megamoe.fp8_allgather import ExpertWeight, Fp8Gathered

    cpu.apply()
    init_gloo(rank, world, init_file)
    out = {}
    try:
        pd = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=ep, etp=1,
                          world_size=world)
        pd.build_mesh()
        args = tiny_args(dim=128, moe_inter_dim=128)
        full_sd = build_stock(args, seed=0).state_dict()

        def build(cache):
            jc = job_config(backend="hopper", precision=precision, fp8_weight_cache=cache)
            jc.parallelism = dataclasses.replace(jc.parallelism, expert_parallel_degree=ep)
            jc.training = dataclasses.replace(jc.training, seq_len=16,
                                              mixed_precision_param="bfloat16",
                                              mixed_precision_reduce="float32")
            with torch.device("meta"):
                model = Qwen3Model(copy.deepcopy(args))
            conv = MegaMoEConverter(jc, pd)
            conv.convert(model)
            model = parallelize_qwen3(model, pd, jc)
            model.to_empty(device="cpu")
            with torch.no_grad():
                model.init_weights(buffer_device=torch.device("cpu"))
            set_model_state_dict(model, full_sd,
                                 options=StateDictOptions(full_state_dict=True))
            return model, conv

        gather_bytes, fp8_gathers = [], []
        real_ag, real_pre = dist.all_gather_single, ExpertWeight.fsdp_pre_all_gather

        def spy_ag(output, inp, *a, **k):
            gather_bytes[-1] += inp.numel() * inp.element_size()
            return real_ag(output, inp, *a, **k)

        def spy_pre(self, mesh, outer_size, outer_stride, module, mp_policy):
            fp8_gathers[-1] += 1
            return real_pre(self, mesh, outer_size, outer_stride, module, mp_policy)

        for cache in (True, False):
            model, conv = build(cache)
            experts = [m for m in model.modules() if isinstance(m, MegaExperts)]
            out[(cache, "installed")] = all(
                isinstance(e.w1._local_tensor, ExpertWeight) for e in experts)
            gathered = []
            hook = experts[0].register_forward_pre_hook(
                lambda mod, a: gathered.append(type(getattr(mod.w1, "_local_tensor", mod.w1))
                                               is Fp8Gathered))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            gen = torch.Generator().manual_seed(200 + rank)
            losses, made = [], []
            dist.all_gather_single, ExpertWeight.fsdp_pre_all_gather = spy_ag, spy_pre
            for _ in range(2):  # the second step sees the first optimizer step's weights
                gather_bytes.append(0)
                fp8_gathers.append(0)
                tokens = torch.randint(0, args.vocab_size, (2, 16), generator=gen)
                labels = torch.randint(0, args.vocab_size, (2, 16), generator=gen)
                opt.zero_grad()
                before = sum(e.fp8_shards_made for e in experts)
                loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten())
                loss.backward()
                in_step = sum(e.fp8_shards_made for e in experts) - before
                opt.step()
                conv.post_optimizer_hook([model])
                made.append((in_step, sum(e.fp8_shards_made for e in experts) - before
                             - in_step))
                losses.append(loss.detach())
            dist.all_gather_single, ExpertWeight.fsdp_pre_all_gather = real_ag, real_pre
            hook.remove()
            out[(cache, "gathered")] = gathered
            out[(cache, "losses")] = losses
            out[(cache, "made")] = made
            out[(cache, "gather_bytes")] = gather_bytes[-1]
            out[(cache, "fp8_gathers")] = fp8_gathers[-1]
            out[(cache, "sd")] = get_model_state_dict(
                model, options=StateDictOptions(full_state_dict=True))

            tokens = torch.randint(0, args.vocab_size, (2, 16),
                                   generator=torch.Generator().manual_seed(7))

            def fwd():
                with torch.no_grad():
                    return model(tokens).float()

            saved = fwd()
            ckpt = f"{init_file}.ckpt{cache}"
            dcp.save(get_model_state_dict(model), checkpoint_id=ckpt)
            with torch.no_grad():
                for e in experts:
                    e.w1.mul_(0.5)  # a change outside the optimizer step (no hook after it)
            changed = fwd()
            sd = get_model_state_dict(model)
            dcp.load(sd, checkpoint_id=ckpt)
            set_model_state_dict(model, sd)
            out[(cache, "ckpt")] = (not torch.equal(saved, changed), torch.equal(saved, fwd()))
        out["sd_plain"] = all(type(v) is torch.Tensor for v in out[(True, "sd")].values())
        torch.save(out, f"{result_file}.{rank}")
    finally:
        dist.destroy_process_group()


@NO_GPU
def test_fsdp_fp8_allgather_trains_bitwise_like_bf16_allgather():
    for out in run_ranks(_fsdp_worker, 2, 2, "fp8", 1):
        assert out[(True, "installed")] and not out[(False, "installed")]
        on, off = out[(True, "losses")], out[(False, "losses")]
        assert all(torch.equal(a, b) for a, b in zip(on, off)), (on, off)
        sd_on, sd_off = out[(True, "sd")], out[(False, "sd")]
        assert sd_on.keys() == sd_off.keys() and out["sd_plain"]
        assert all(torch.equal(sd_on[k], sd_off[k]) for k in sd_on)
        # the first layer's experts saw the gathered FP8 copies at each of the 2 forwards
        assert out[(True, "gathered")] == [True] * 2 and out[(False, "gathered")] == [False] * 2
        # each rank's shard quantized at the first forward, then once per step in the hook
        # (2 layers x 3 weights), never inside forward or backward after the first
        assert out[(True, "made")] == [(6, 6), (0, 6)], out[(True, "made")]
        assert out[(False, "made")] == [(0, 0)] * 2
        # the experts' gather moves e4m3 and scales instead of bf16: per weight and rank
        # E / 2 x D x H elements, 1 byte and a 4-byte scale per 16384 instead of 2 bytes
        per_weight = (8 // 2) * 128 * 128
        saved = per_weight * 2 - (per_weight + per_weight // 16384 * 4)
        gathers = out[(True, "fp8_gathers")]  # weights gathered in the last step
        assert gathers >= 6 and out[(False, "fp8_gathers")] == 0
        assert out[(False, "gather_bytes")] - out[(True, "gather_bytes")] == gathers * saved
        # a change outside the step is seen (the output moves), the load restores it exactly
        assert out[(True, "ckpt")] == out[(False, "ckpt")] == (True, True)


@NO_GPU
def test_fsdp_fp8_allgather_under_expert_parallelism():
    """EP=2 over both ranks: FSDP wraps each rank's experts over the one rank EP leaves (as
    EP=8 on one 8-GPU node), where FSDP2 moves a single input: the shard's FP8 copy travels as
    one byte buffer. Losses bitwise those of the bf16 gather, copies made once per step."""
    for out in run_ranks(_fsdp_worker, 2, 2, "fp8", 2):
        assert out[(True, "installed")] and not out[(False, "installed")]
        on, off = out[(True, "losses")], out[(False, "losses")]
        assert all(torch.equal(a, b) for a, b in zip(on, off)), (on, off)
        assert out[(True, "gathered")] == [True] * 2 and out[(False, "gathered")] == [False] * 2
        assert out[(True, "made")] == [(6, 6), (0, 6)], out[(True, "made")]
        assert out[(True, "fp8_gathers")] >= 6 and out[(False, "fp8_gathers")] == 0
        assert out[(True, "ckpt")] == out[(False, "ckpt")] == (True, True)


def test_per_op_selective_checkpointing_with_module_copies():
    """Per-op SAC (the op saved, or recomputed) around MegaExperts in fp8: the registered op
    carries the copies through the recompute; gradients bitwise the plain call's."""
    from functools import partial

    from torch.utils.checkpoint import (
        CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
    )

    x, ids, tw, *_ = _weights()
    grads = []
    for save_op in (None, True, False):
        m = _experts()

        def policy(ctx, op, *args, **kwargs):
            if op is torch.ops.megamoe.mega_moe.default and save_op:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        xx = x.detach().clone().requires_grad_()
        if save_op is None:
            out = m(xx, ids, tw)
        else:
            out = checkpoint(m, xx, ids, tw, use_reentrant=False,
                             context_fn=partial(create_selective_checkpoint_contexts, policy))
        out.float().sum().backward()
        grads.append([xx.grad, m.w1.grad, m.w2.grad, m.w3.grad])
        assert m.fp8_weights_made == 1
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other))


def test_converter_installs_the_fp8_allgather_only_where_it_applies(caplog):
    from torchtitan.models.qwen3 import Qwen3Model

    from moe_testing import tiny_args, with_parallelism
    from torchtitan_megamoe.converter import MegaMoEConverter, fp8_allgather_applies
    from torchtitan_megamoe.fp8_allgather import ExpertWeight, installed

    def convert(experts=8, shard=2, **megamoe):
        jc = with_parallelism(job_config(**{"backend": "hopper", "precision": "fp8", **megamoe}),
                              data_parallel_shard_degree=shard)
        with torch.device("meta"):
            model = Qwen3Model(tiny_args(dim=128, moe_inter_dim=128, num_experts=experts))
        MegaMoEConverter(jc, None).convert(model)
        blocks = [m for m in model.modules() if isinstance(m, MegaExperts)]
        return [installed(e) for e in blocks]

    assert convert() == [True, True]
    assert convert(shard=1) == convert(fp8_weight_cache=False) == [False, False]
    assert convert(precision="fp8_bwd") == convert(backend="reference") == [False, False]
    with caplog.at_level("WARNING"):
        assert convert(experts=6, shard=4) == [False, False]
    assert "the 6 experts of a rank are not divisible by the experts' FSDP degree 4" in caplog.text
    o = MegaMoEOptions(backend="hopper", precision="fp8")
    # at EP > 1 FSDP shards a rank's experts over the ranks EP leaves (efsdp)
    assert fp8_allgather_applies(o, 8, 4, 2) is None
    assert "the 2 experts of a rank are not divisible by the experts' FSDP degree 4" in (
        fp8_allgather_applies(o, 8, 16, 4))
    assert fp8_allgather_applies(o, 8, 1, 1) == "FSDP does not shard the experts"
    assert fp8_allgather_applies(o, 8, 2, 1) is None
    # EP=8 over 8 ranks: FSDP wraps each rank's experts over one rank; the FP8 "gather" hands
    # it its own copies, made once per step
    caplog.clear()
    with caplog.at_level("WARNING"):
        jc = with_parallelism(job_config(backend="hopper", precision="fp8"),
                              data_parallel_shard_degree=8, expert_parallel_degree=8)
        with torch.device("meta"):
            model = Qwen3Model(tiny_args(dim=128, moe_inter_dim=128, num_experts=8))
        MegaMoEConverter(jc, None).convert(model)
    assert all(installed(m) for m in model.modules() if isinstance(m, MegaExperts))
    assert "gathered in bf16" not in caplog.text
    # the extension keeps everything else plain: the state dict, its values' types
    with torch.device("meta"):
        m = MegaExperts(128, 128, 4, options=o)
    from torchtitan_megamoe import fp8_allgather

    fp8_allgather.install(m)
    assert isinstance(m.w1, ExpertWeight)
    assert all(type(v) is torch.Tensor for v in m.state_dict().values())


@pytest.mark.slow
@NO_GPU
def test_tiny_fp8_config_trains_the_same_with_and_without_the_cache(tmp_path, monkeypatch):
    """train_configs/qwen3_moe_tiny_fp8_cpu.toml as a user runs it (torchrun, one rank, bf16
    autocast over fp32 parameters), on the hopper backend: the logged losses with
    fp8_weight_cache on and off agree to the printed digit."""
    import os

    from torchtitan_megamoe import ab, assets

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = str(tmp_path)
    assets.make_assets(out + "/assets")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", MEGAMOE_CPU="1",
               **assets.offline_env(out + "/hf"))
    runs = {}
    for flag in ("--megamoe.fp8_weight_cache", "--megamoe.no_fp8_weight_cache"):
        cmd = ab.torchrun_command(
            os.path.join(root, "train_configs", "qwen3_moe_tiny_fp8_cpu.toml"), 1,
            out + "/dump", ["--model.hf_assets_path", assets.tokenizer_dir(out + "/assets"),
                            "--training.dataset_path", assets.dataset_dir(out + "/assets"),
                            "--megamoe.backend", "hopper",
                            "--training.mixed_precision_param", "bfloat16",
                            "--training.steps", "2", "--training.local_batch_size", "1",
                            "--training.seq_len", "32", flag])
        log = out + f"/{flag.rsplit('.', 1)[1]}.log"
        code = ab.run_one(cmd, log, env, 900)
        with open(log, errors="replace") as f:
            text = f.read()
        assert code == 0, text[-4000:]
        assert "backend=hopper, precision=fp8" in text
        runs[flag] = [(s.step, s.loss) for s in ab.parse_log(text).steps]
    on, off = runs.values()
    assert len(on) == 2 and on == off, runs


@pytest.mark.parametrize("keep", [True, False])
def test_config_fp8_keep_transposed_reaches_every_layer(keep):
    """[megamoe] fp8_keep_transposed: part of the options every layer's MegaExperts is built
    with; false holds only the forward copies (half the bytes), and the layer still computes
    the same."""
    from torchtitan.models.qwen3 import Qwen3Model, qwen3_args

    import torchtitan_megamoe.flavors  # noqa: F401  (registers megamoe_tiny_fp8)
    from torchtitan_megamoe.converter import MegaMoEConverter

    jc = job_config(backend="hopper", precision="fp8", fp8_keep_transposed=keep)
    with torch.device("meta"):
        model = Qwen3Model(copy.deepcopy(qwen3_args["megamoe_tiny_fp8"]))
    MegaMoEConverter(jc, None).convert(model)
    experts = [m for m in model.modules() if isinstance(m, MegaExperts)]
    assert experts and all(m.options.fp8_keep_transposed is keep for m in experts)
    m, ref = _experts(keep_transposed=keep), _experts(cache=False)
    out = _call(m)
    held = m._fp8
    assert (held.w2t is not None) is keep and (held.w13t is not None) is keep
    assert torch.equal(out, _call(ref))
