"""backend ``triton`` backward end to end: under the interpreter vs float64 autograd, through the
mega_moe op vs the reference backend, and (marked gpu) at the real 30B shape vs reference."""

from torchtitan_megamoe.ops.options import MegaMoEOptions
import pytest
import torch

from moe_testing import (
    NAMES, grads_f64, make_inputs, op_args, real_routing, rel_err, routing, same_bits,
    saved_and_recomputed,
)
from torchtitan_megamoe.ops.hopper import backward
from torchtitan_megamoe.ops.hopper.bf16_backward import backward_bf16
from torchtitan_megamoe.ops.hopper.sides.wgrad import Into

T, K, E, D, H = 19, 3, 5, 48, 32  # multiples of 16: a recompute runs GEMM 1 (interpreter tiles)


def _inputs(ids, seed=0, device="cpu"):
    inp = make_inputs(ids.shape[0], ids.shape[1], E, D, H, ids, seed=seed, device=device)
    # A dropped slot's routing weight must not reach any gradient.
    inp["topk_weights"][inp["topk_ids"] < 0] = float("nan")
    return inp


def _triton_grads(inp):
    return backward(inp["dy"], inp["x"], inp["topk_ids"], inp["topk_weights"],
                    inp["w1"], inp["w2"], inp["w3"], None, MegaMoEOptions(precision="bf16"))


def _check_vs_f64(inp, grads):
    clean = dict(inp, topk_weights=inp["topk_weights"].nan_to_num(0.0))
    ref = grads_f64(clean)
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
    inp = _inputs(routing(case, T, K, E))
    _check_vs_f64(inp, _triton_grads(inp))


def test_backward_single_token():
    inp = _inputs(torch.tensor([[3, -1, 0]]), seed=7)
    _check_vs_f64(inp, _triton_grads(inp))


def test_backward_deterministic():
    inp = _inputs(routing("uneven", T, K, E, seed=5), seed=5)
    for a, b in zip(_triton_grads(inp), _triton_grads(inp)):
        assert same_bits(a, b)


def test_backward_through_op_matches_reference():
    """mega_moe(backend='hopper') autograd vs mega_moe(backend='reference') autograd."""
    from torchtitan_megamoe import mega_moe

    Dm, Hm = 32, 48  # the triton forward needs multiples of 16 under the interpreter
    ids = routing("uneven", T, K, E, seed=2)
    inp = make_inputs(T, K, E, Dm, Hm, ids, seed=2)
    keys = ("x", "topk_weights", "w1", "w2", "w3")
    grads = {}
    for backend in ("hopper", "reference"):
        leaves = [inp[k].clone().requires_grad_() for k in keys]
        x, tw, w1, w2, w3 = leaves
        out = mega_moe(x, inp["topk_ids"], tw, w1, w2, w3, backend=backend)
        grads[backend] = torch.autograd.grad(out, leaves, inp["dy"])
    for name, got, ref in zip(NAMES, grads["hopper"], grads["reference"]):
        assert rel_err(got, ref) <= 1e-2, name


# ------------------------------------- saved path: the forward's a1/a3 + plan, no recompute

Ds, Hs = 32, 48  # the triton forward needs multiples of 16 under the interpreter


@pytest.mark.parametrize("case", ["uneven", "one_expert", "all_dropped", "t1"])
def test_saved_backward_matches_recompute_and_f64(case):
    """backward_bf16(saved=forward_bf16(..., save=True)[1]) vs float64 on uneven routings
    (dropped slots with NaN weights, empty experts, one expert, T=1), and bitwise equal to the
    recompute path (which runs the forward's GEMM 1 again for a)."""
    ids = torch.tensor([[3, -1, 0]]) if case == "t1" else routing(case, T, K, E, seed=3)
    inp, saved, got, recomputed = saved_and_recomputed(ids, E, Ds, Hs, seed=3)
    a, packed = saved
    assert a.dtype == torch.bfloat16 and a.shape[1] == 2 * Hs and packed.dtype == torch.int32
    _check_vs_f64(inp, got)
    for name, g, r in zip(NAMES, got, recomputed):
        assert same_bits(g, r), f"{name}: saved and recompute paths differ"


def test_saved_backward_deterministic():
    ids = routing("uneven", T, K, E, seed=9)
    inp, saved, first, _ = saved_and_recomputed(ids, E, Ds, Hs, seed=9)
    from torchtitan_megamoe.ops.hopper.bf16_backward import backward_bf16

    args = [inp[k] for k in ("dy", "x", "topk_ids", "topk_weights", "w1", "w2", "w3")]
    for a, b in zip(first, backward_bf16(*args, saved=saved)):
        assert same_bits(a, b)


def test_op_carries_saved_tensors_with_fake_shapes():
    """megamoe::mega_moe returns (out, saved) whose shapes/dtypes are those the fake impl
    (saved_like) promises, and opcheck (fake vs real, autograd registration) passes."""
    from torchtitan_megamoe.ops import hopper as tb

    ids = routing("uneven", T, K, E, seed=2)
    inp = make_inputs(T, K, E, Ds, Hs, ids, seed=2)
    args = (inp["x"], inp["topk_ids"], inp["topk_weights"], inp["w1"], inp["w2"], inp["w3"])
    options = MegaMoEOptions(backend="hopper").op_args()
    out, saved = torch.ops.megamoe.mega_moe(*args, [], [], True, "", *options)
    fake = tb.saved_like(*args, None, MegaMoEOptions(precision="bf16"))
    assert len(saved) == len(fake) == 2
    for s, f in zip(saved, fake):
        assert s.shape == f.shape and s.dtype == f.dtype
    leaves = (inp["x"].requires_grad_(), *args[1:3], *(w.requires_grad_() for w in args[3:]))
    # Not test_aot_dispatch_*: it compares two runs' outputs elementwise, and the rows of the
    # saved a past the used rows are left unwritten by design (never read; writing them would
    # cost a memset of the whole buffer). The compile test below covers AOT tracing.
    torch.library.opcheck(torch.ops.megamoe.mega_moe.default, (*leaves, [], [], True, "", *options),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_autograd_registration"))


def test_compiled_op_uses_saved_path():
    """torch.compile(fullgraph) through mega_moe(backend='hopper'): the op with its saved
    outputs traces as one op (fake shapes from saved_like) and gives eager's gradients."""
    from torchtitan_megamoe import mega_moe

    ids = routing("uneven", T, K, E, seed=4)
    inp = make_inputs(T, K, E, Ds, Hs, ids, seed=4)
    keys = ("x", "topk_weights", "w1", "w2", "w3")

    def f(x, tw, w1, w2, w3):
        return mega_moe(x, inp["topk_ids"], tw, w1, w2, w3, backend="hopper") * 2

    grads = []
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        leaves = [inp[k].clone().requires_grad_() for k in keys]
        grads.append(torch.autograd.grad(fn(*leaves), leaves, inp["dy"]))
    for name, g, r in zip(NAMES, *grads):
        assert same_bits(g, r), name


class _RegisteredOp(torch.overrides.TorchFunctionMode):
    """Any torch-function mode sends mega_moe through its registered op (as compile and
    selective AC do), not the eager autograd Function."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_eager_backward_frees_saved_a_and_makes_dw1_dw3_last(precision, monkeypatch):
    """The op's eager backward (what training runs) frees GEMM 1's saved pre-activations once
    read, and makes dw1/dw3 after dx (the order that keeps the backward's peak low). A second
    backward of the same graph (retain_graph) recomputes them, with the same bits; the
    registered op's backward (compile, selective AC) leaves them alone."""
    from torchtitan_megamoe import mega_moe
    from torchtitan_megamoe.ops import hopper
    from torchtitan_megamoe.ops.hopper import bf16_backward, fp8_backward

    d, h = (Ds, Hs) if precision == "bf16" else (128, 128)
    ids = routing("uneven", T, K, E, seed=2)
    inp = make_inputs(T, K, E, d, h, ids, seed=2)
    events, held = [], []
    real_backward, real_dw13 = hopper.backward, bf16_backward.WeightGrads.dw13

    def spy_backward(*args, saved=None, **kw):
        held.append(saved[0])
        events.append(("backward", saved[0].untyped_storage().nbytes() > 0))
        return real_backward(*args, saved=saved, **kw)

    def spy_dw13(self, *args, **kw):
        events.append("dw13")
        return real_dw13(self, *args, **kw)

    monkeypatch.setattr(hopper, "backward", spy_backward)
    monkeypatch.setattr(bf16_backward.WeightGrads, "dw13", spy_dw13)
    for mod in (bf16_backward, fp8_backward):
        def spy_combine(*args, _real=mod.bwd_combine, **kw):
            events.append(("combine, a freed", held[-1].untyped_storage().nbytes() == 0))
            return _real(*args, **kw)

        monkeypatch.setattr(mod, "bwd_combine", spy_combine)

    def grads(retain=False):
        leaves = [inp[k].clone().requires_grad_() for k in ("x", "topk_weights", "w1", "w2",
                                                             "w3")]
        out = mega_moe(leaves[0], inp["topk_ids"], *leaves[1:], backend="hopper",
                       precision=precision)
        first = torch.autograd.grad(out, leaves, inp["dy"], retain_graph=retain)
        return first, (torch.autograd.grad(out, leaves, inp["dy"]) if retain else None)

    first, second = grads(retain=True)
    assert events == [("backward", True), ("combine, a freed", True), "dw13",
                      ("backward", False), ("combine, a freed", True), "dw13"], events
    assert all(same_bits(a, b) for a, b in zip(first, second))
    events.clear()
    with _RegisteredOp():
        registered, _ = grads()
    assert events == [("backward", True), ("combine, a freed", False), "dw13"], events
    assert all(same_bits(a, b) for a, b in zip(first, registered))


def test_backward_rejects_what_it_cannot_compute():
    inp = _inputs(routing("uneven", 4, K, E))
    args = [inp[k] for k in ("dy", "x", "topk_ids", "topk_weights", "w1", "w2", "w3")]
    with pytest.raises(TypeError, match="bfloat16"):
        backward(args[0].float(), *args[1:], None, MegaMoEOptions(precision="bf16"))
    with pytest.raises(ValueError, match="grad_out shape"):
        backward(args[0][:2], *args[1:], None, MegaMoEOptions(precision="bf16"))


# ----------------------------------------------------------------------------- GPU, real shape


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
    g = torch.Generator(device=dev).manual_seed(0)
    inp = make_inputs(T_, K_, E_, D_, H_, real_routing(T_, K_, E_, dev), device=dev, generator=g)
    x, ids, _, w1, w2, w3 = op_args(inp)
    tw = torch.softmax(torch.randn(T_, K_, device=dev, generator=g), -1)
    dy = inp["dy"]
    args = (dy, x, ids, tw, w1, w2, w3, None, MegaMoEOptions(precision="bf16"))
    got = backward(*args)
    ref = reference.backward(*args)
    for name, g, r in zip(NAMES, got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        err = rel_err(g, r)
        assert err <= 1e-2, f"{name}: rel err {err:.2e}"
    for name, a, b in zip(NAMES, got, backward(*args)):
        assert same_bits(a, b), f"{name} differs between two runs"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_saved_backward_real_shape_30b():
    """30B layer at 16384 tokens: the saved path (forward_bf16(save=True) -> backward_bf16
    (saved=...), what training runs) vs backend reference (rel err <= 1e-2), bitwise equal to
    the recompute path and to a rerun; the saved a is [R_max, 2H] bf16 (432 MiB here)."""
    from torchtitan_megamoe.ops import reference
    from torchtitan_megamoe.ops.hopper.bf16_backward import backward_bf16
    from torchtitan_megamoe.ops.hopper.bf16_forward import forward_bf16

    T_, K_, E_ = 16384, 8, 128
    D_, H_ = SHAPES["qwen3_30b_a3b"]
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(1)
    inp = make_inputs(T_, K_, E_, D_, H_, real_routing(T_, K_, E_, dev), device=dev, generator=g)
    x, ids, _, w1, w2, w3 = op_args(inp)
    tw = torch.softmax(torch.randn(T_, K_, device=dev, generator=g), -1)
    dy = inp["dy"]
    fwd = (x, ids, tw, w1, w2, w3)
    out, saved = forward_bf16(*fwd, save=True)
    assert saved[0].shape == (147328, 2 * H_)
    assert torch.equal(out, forward_bf16(*fwd))
    got = backward_bf16(dy, *fwd, saved=saved)
    ref = reference.backward(dy, *fwd, None, MegaMoEOptions(precision="bf16"))
    recomputed = backward_bf16(dy, *fwd)
    for name, g, r, rc in zip(NAMES, got, ref, recomputed):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        assert rel_err(g, r) <= 1e-2, f"{name}: rel err vs reference {rel_err(g, r):.2e}"
        assert same_bits(g, rc), f"{name}: saved and recompute paths differ"
    for name, a, b in zip(NAMES, got, backward_bf16(dy, *fwd, saved=saved)):
        assert same_bits(a, b), f"{name} differs between two runs"


# -------------------------------------------- the EP backward's hook (ep_backward.py overlap)

@pytest.mark.parametrize("use_saved", [True, False], ids=["saved", "recompute"])
def test_wait_x_comes_before_the_first_read_of_x(use_saved, monkeypatch):
    """wait_x (x may still be in flight under EP) is called once, before the first kernel that
    reads x: after kernel A and dw2 on the saved path, before GEMM 1 when the backward
    recomputes it. With the hook, the gradients are bitwise those without."""
    import importlib

    from torchtitan_megamoe.ops.hopper.bf16_forward import forward_bf16

    # the module (the package re-exports a function of the same name)
    bwd = importlib.import_module("torchtitan_megamoe.ops.hopper.bf16_backward")
    a_side = importlib.import_module("torchtitan_megamoe.ops.hopper.sides.dgrad2_swiglu")
    w_side = importlib.import_module("torchtitan_megamoe.ops.hopper.sides.wgrad")
    ids = routing("uneven", T, K, E, seed=3)
    inp = make_inputs(T, K, E, Ds, Hs, ids, seed=3)
    args = [inp[k] for k in ("x", "topk_ids", "topk_weights", "w1", "w2", "w3")]
    saved = forward_bf16(*args, save=True)[1] if use_saved else None
    events = []
    real_a, real_wgrad, real_g1 = a_side.dgrad2_swiglu, w_side.wgrad, bwd.gemm1_swiglu
    monkeypatch.setattr(a_side, "dgrad2_swiglu",
                        lambda *a, **kw: events.append("A") or real_a(*a, **kw))
    monkeypatch.setattr(bwd, "gemm1_swiglu",
                        lambda *a, **kw: events.append("G1") or real_g1(*a, **kw))

    def wgrad_spy(a, b, *rest, **kw):
        events.append("dw13" if kw.get("b_gather") else "dw2")
        return real_wgrad(a, b, *rest, **kw)

    monkeypatch.setattr(w_side, "wgrad", wgrad_spy)
    grads = bwd.backward_bf16(inp["dy"], *args, saved=saved,
                               wait_x=lambda: events.append("wait_x"))
    assert events.count("wait_x") == 1 and events.index("wait_x") < events.index("dw13"), events
    if use_saved:
        assert events.index("wait_x") > events.index("dw2"), events  # x not needed before
        assert "G1" not in events, events
    else:
        assert events.index("wait_x") < events.index("G1") < events.index("A"), events
    for a, b in zip(grads, bwd.backward_bf16(inp["dy"], *args, saved=saved)):
        assert same_bits(a, b)


def test_weight_gradients_into_sums_over_two_batches_bitwise():
    """``into`` (the EP backward's fp32 sums over regions): the first batch writes the sums, the
    second adds to them in the GEMMs' epilogue, the bits of two fresh fp32 gradients added after;
    dx and d(topk_weights) are unchanged by it."""
    inp = _inputs(routing("uneven", T, K, E, seed=9), seed=9)
    halves = (slice(0, T // 2), slice(T // 2, T))
    w = [inp[n] for n in ("w1", "w2", "w3")]

    def run(part, into=None):
        return backward_bf16(inp["dy"][part], inp["x"][part], inp["topk_ids"][part],
                             inp["topk_weights"][part], *w, into=into)

    fresh = [run(p, Into(tuple(torch.empty_like(t, dtype=torch.float32) for t in w)))
             for p in halves]
    sums = tuple(torch.full_like(t, float("nan"), dtype=torch.float32) for t in w)
    got = [run(p, Into(sums, accumulate=i > 0)) for i, p in enumerate(halves)]
    for i in range(3):
        assert same_bits(sums[i], fresh[0][2 + i] + fresh[1][2 + i]), NAMES[2 + i]
    for a, b in zip(fresh, got):
        assert same_bits(a[0], b[0]) and same_bits(a[1], b[1])


_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                             reason="needs a CUDA GPU")]


@pytest.mark.parametrize("precision,path,device", [
    ("bf16", "eager", "cpu"), ("bf16", "op", "cpu"), ("bf16", "compile", "cpu"),
    ("fp8_bwd", "eager", "cpu"),
    pytest.param("bf16", "eager", "cuda", marks=_GPU),
    pytest.param("fp8_bwd", "op", "cuda", marks=_GPU)])
def test_autocast_fp32_weights_cast_once_and_fp32_gradients(precision, path, device,
                                                            monkeypatch):
    """fp32 parameters under a bf16 autocast (TorchTitan on one device): the hopper bf16
    forward casts the weights itself once per forward and saves the copies, the backward reads
    them (no second cast) and writes fp32 gradients from its GEMMs (low bits set: no bf16
    rounding, no cast pass). out, dx and d(topk_weights) are bitwise those of casting by hand;
    the weight gradients are those gradients before their bf16 rounding."""
    from torchtitan_megamoe import mega_moe
    from torchtitan_megamoe.ops import api
    from torchtitan_megamoe.ops import hopper as hb

    casts = []
    real_cast = hb.cast_weights
    monkeypatch.setattr(hb, "cast_weights", lambda x, ws: casts.append(1) or real_cast(x, ws))
    if path == "op":
        monkeypatch.setattr(api, "_plain_eager", lambda tensors: False)
    if device == "cpu":  # FP8 needs the 128 scale block
        Tm, Em, Dm, Hm = (T, E) + ((128, 128) if precision == "fp8_bwd" else (Ds, Hs))
    else:  # the 30B layer at 16384 tokens: experts' rows are no tile multiples
        Tm, Em, Dm, Hm = 16384, 128, 2048, 768
    ids = routing("uneven", Tm, K, Em, seed=6).to(device)
    inp = make_inputs(Tm, K, Em, Dm, Hm, ids, seed=6, dtype=torch.float32, device=device)
    dy = torch.randn((Tm, Dm), dtype=torch.bfloat16, device=device)
    keys = ("x", "topk_weights", "w1", "w2", "w3")

    def layer(x, tw, w1, w2, w3):
        return mega_moe(x, inp["topk_ids"], tw, w1, w2, w3, backend="hopper",
                        precision=precision)

    run = torch.compile(layer, backend="aot_eager", fullgraph=True) if path == "compile" else layer
    leaves = [inp[k].clone().requires_grad_() for k in keys]
    with torch.autocast(device, dtype=torch.bfloat16):
        out = run(*leaves)
    grads = torch.autograd.grad(out, leaves, dy)
    if path != "compile":  # aot_eager's trace calls the real forward once more
        assert len(casts) == 1, casts
    by_hand = [inp[k].clone().requires_grad_() for k in keys]
    ref = layer(*(t if i == 1 else t.bfloat16() for i, t in enumerate(by_hand)))
    ref_grads = torch.autograd.grad(ref, by_hand, dy)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    for name, g, r, leaf in zip(NAMES, grads, ref_grads, leaves):
        assert g.dtype == r.dtype == leaf.dtype, name
        if name in ("dx", "dtopk_weights"):
            assert torch.equal(g, r), name
        else:
            assert bool((g.view(torch.int32) & 0xFFFF).any()), f"{name}: bf16-rounded"
            assert rel_err(g, r) < 4e-3, name
