"""The reference backend of mega_moe against the float64 reference of tests/moe_testing.py.

moe_f64 is written from the formula alone (README's "The op"), independent of ops/reference.py,
and checked slot by slot in test_moe_testing.py; its gradients come from autograd through it. The op is run on
fresh random float64 inputs so every comparison is tight (1e-12 relative), and on fp32 inputs
against the same reference at fp32 tolerance.
"""

import contextlib

import pytest
import torch

from moe_testing import make_inputs as layer_inputs
from moe_testing import moe_f64 as oracle
from moe_testing import op_args, rel_err as rel, routing as routing_ids
from torchtitan_megamoe import mega_moe
from torchtitan_megamoe.ops import reference
from torchtitan_megamoe.ops.options import MegaMoEOptions

REFERENCE = MegaMoEOptions(backend="reference").op_args()
"""The options' trailing arguments of a raw call of the registered op (backend reference)."""

ROUTINGS = ["random", "dropped", "one_expert", "empty_experts", "all_dropped_but_one"]


def make_inputs(T, K, E, D, H, routing, dtype=torch.float64, seed=0):
    """(x, topk_ids, topk_weights, w1, w2, w3) in ``dtype``, ids of the named routing."""
    ids = routing_ids(routing, T, K, E, seed=seed)
    return op_args(layer_inputs(T, K, E, D, H, ids, seed=seed, dtype=dtype))


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("T", [1, 7, 33])
def test_forward_and_grads_match_oracle_fp64(routing, T):
    K, E, D, H = 3, 5, 12, 10
    x, ids, w, w1, w2, w3 = make_inputs(T, K, E, D, H, routing, seed=T)
    leaves = [t.clone().requires_grad_() for t in (x, w, w1, w2, w3)]
    out = mega_moe(leaves[0], ids, *leaves[1:], backend="reference")
    oleaves = [t.clone().requires_grad_() for t in (x, w, w1, w2, w3)]
    ref = oracle(oleaves[0], ids, *oleaves[1:])
    assert out.dtype == torch.float64 and out.shape == (T, D)
    if ref.norm() > 0:
        assert rel(out, ref) < 1e-12
    dy = torch.randn_like(ref)
    out.backward(dy)
    ref.backward(dy)
    for name, a, b in zip(("x", "topk_weights", "w1", "w2", "w3"), leaves, oleaves):
        if b.grad is None or b.grad.norm() == 0:
            assert a.grad is None or a.grad.abs().max() == 0, name
        else:
            assert rel(a.grad, b.grad) < 1e-12, name


def test_fp32_inputs_fp32_output():
    x, ids, w, w1, w2, w3 = make_inputs(64, 4, 8, 32, 16, "dropped", dtype=torch.float32)
    out = mega_moe(x, ids, w, w1, w2, w3, backend="reference")
    assert out.dtype == torch.float32
    assert rel(out, oracle(x, ids, w, w1, w2, w3)) < 1e-6


def test_dropped_slots_are_ignored_not_zero_weighted():
    # a dropped slot whose id would point at a NaN expert must not poison the output
    x, ids, w, w1, w2, w3 = make_inputs(9, 2, 4, 8, 8, "random")
    ids[:, 1] = -1
    w[:, 1] = float("nan")
    out = mega_moe(x, ids, w, w1, w2, w3, backend="reference")
    assert torch.isfinite(out).all()
    assert rel(out, oracle(x, ids, w, w1, w2, w3)) < 1e-12


def test_deterministic():
    x, ids, w, w1, w2, w3 = make_inputs(40, 4, 6, 16, 8, "dropped", dtype=torch.float32)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (x, w, w1, w2, w3)]
        out = mega_moe(leaves[0], ids, *leaves[1:], backend="reference")
        out.backward(torch.ones_like(out))
        runs.append([out] + [t.grad for t in leaves])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_fp8_emulation_close_to_exact_and_not_identical():
    x, ids, w, w1, w2, w3 = make_inputs(48, 2, 4, 128, 128, "dropped", dtype=torch.float32)
    exact = mega_moe(x, ids, w, w1, w2, w3, backend="reference")
    fp8 = mega_moe(x, ids, w, w1, w2, w3, backend="reference", precision="fp8")
    fp8_bwd = mega_moe(x, ids, w, w1, w2, w3, backend="reference", precision="fp8_bwd")
    assert torch.equal(fp8_bwd, exact)  # fp8_bwd: the forward is the bf16/exact path
    err = rel(fp8, exact)
    assert 1e-4 < err < 0.1  # e4m3 has a 3-bit mantissa: a few % per GEMM, never exact

    leaves = [t.clone().requires_grad_() for t in (x, w, w1, w2, w3)]
    mega_moe(leaves[0], ids, *leaves[1:], backend="reference", precision="fp8_bwd").sum().backward()
    exact_leaves = [t.clone().requires_grad_() for t in (x, w, w1, w2, w3)]
    mega_moe(exact_leaves[0], ids, *exact_leaves[1:], backend="reference").sum().backward()
    for i, (a, b) in enumerate(zip(leaves, exact_leaves)):
        if i == 3:  # dw2 = (w dy)^T h: a bf16 weight gradient of operands no FP8 GEMM touched
            assert torch.equal(a.grad, b.grad)
        else:
            assert 0 < rel(a.grad, b.grad) < 0.15


def test_fp8_wgrad_switch_rounds_the_weight_gradients(monkeypatch):
    """MEGAMOE_FP8_WGRAD=1: the weight-gradient GEMMs' operands go through e4m3 too."""
    x, ids, w, w1, w2, w3 = make_inputs(48, 2, 4, 128, 128, "dropped", dtype=torch.float32)
    grads = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("MEGAMOE_FP8_WGRAD", flag)
        leaves = [t.clone().requires_grad_() for t in (x, w, w1, w2, w3)]
        mega_moe(leaves[0], ids, *leaves[1:], backend="reference", precision="fp8_bwd").sum().backward()
        grads[flag] = [t.grad for t in leaves]
    assert torch.equal(grads["0"][0], grads["1"][0])  # dx: the dgrads are FP8 in both
    for i in (2, 3, 4):
        assert 0 < rel(grads["1"][i], grads["0"][i]) < 0.15


def test_quantize_dequantize_blocks():
    t = torch.randn(3, 256)
    t[0, :128] *= 1000  # one block with a large amax must not change the other blocks' scale
    q = reference.quantize_dequantize_fp8(t, (1, 128))
    assert rel(q[0, 128:], t[0, 128:]) < 0.1
    assert rel(q[1:], t[1:]) < 0.1
    # values exactly representable after scaling survive unchanged
    exact = torch.tensor([[448.0, -448.0, 0.0, 1.75] + [0.0] * 124])
    assert torch.equal(reference.quantize_dequantize_fp8(exact, (1, 128)), exact)


def test_torch_compile_sees_one_op():
    x, ids, w, w1, w2, w3 = make_inputs(16, 2, 4, 8, 8, "dropped", dtype=torch.float32)

    def f(x, w, w1, w2, w3):
        return mega_moe(x, ids, w, w1, w2, w3, backend="reference") * 2

    leaves = [t.clone().requires_grad_() for t in (x, w, w1, w2, w3)]
    out = torch.compile(f, backend="aot_eager", fullgraph=True)(*leaves)
    out.sum().backward()
    ref_leaves = [t.clone().requires_grad_() for t in (x, w, w1, w2, w3)]
    f(*ref_leaves).sum().backward()
    assert torch.allclose(out, f(x, w, w1, w2, w3))
    for a, b in zip(leaves, ref_leaves):
        assert torch.allclose(a.grad, b.grad)


def test_op_contract_saved_outputs():
    """megamoe::mega_moe returns (out, saved); the reference backend saves nothing, the public
    mega_moe() returns out alone, and mega_moe_backward takes the saved list."""
    x, ids, w, w1, w2, w3 = make_inputs(8, 2, 3, 8, 8, "dropped", dtype=torch.float32)
    out, saved = torch.ops.megamoe.mega_moe(x, ids, w, w1, w2, w3, [], [], True, "", *REFERENCE)
    assert saved == []
    public = mega_moe(x, ids, w, w1, w2, w3, backend="reference")
    assert isinstance(public, torch.Tensor) and torch.equal(public, out)
    schema = str(torch.ops.megamoe.mega_moe.default._schema)
    assert schema.endswith("-> (Tensor, Tensor[])"), schema
    bwd_schema = str(torch.ops.megamoe.mega_moe_backward.default._schema)
    assert "Tensor[] saved" in bwd_schema, bwd_schema


def test_opcheck():
    x, ids, w, w1, w2, w3 = make_inputs(8, 2, 3, 8, 8, "dropped", dtype=torch.float64)
    args = (x.requires_grad_(), ids, w.requires_grad_(), w1, w2, w3, [], [], True, "", *REFERENCE)
    torch.library.opcheck(torch.ops.megamoe.mega_moe.default, args)
    fp8 = MegaMoEOptions("reference", "fp8", "never", 4096, True).op_args()
    x, ids, w, w1, w2, w3 = make_inputs(8, 2, 3, 128, 128, "dropped", dtype=torch.float64)
    args = (x.requires_grad_(), ids, w.requires_grad_(), w1, w2, w3, [], [], False, "", *fp8)
    torch.library.opcheck(torch.ops.megamoe.mega_moe.default, args)


def test_op_schemas_carry_every_option_typed():
    """Both registered ops end with MegaMoEOptions' fields, in its order, with their types."""
    import dataclasses

    expected = [(f.name, {bool: "bool", int: "int"}.get(type(f.default), "str"))
                for f in dataclasses.fields(MegaMoEOptions)]
    for op in (torch.ops.megamoe.mega_moe.default, torch.ops.megamoe.mega_moe_backward.default):
        args = op._schema.arguments[-len(expected):]
        assert [(a.name, str(a.type)) for a in args] == expected, op._schema


def test_options_are_checked_and_interned():
    """mega_moe()'s keyword arguments become one validated MegaMoEOptions per distinct set."""
    a = MegaMoEOptions.of("reference", "fp8", "never", 64, True)
    assert a is MegaMoEOptions.of("reference", "fp8", "never", 64, True)
    assert a == MegaMoEOptions(backend="reference", precision="fp8", save_activations="never",
                               max_tokens_per_rank=64, fp8_weight_cache=True)
    assert MegaMoEOptions.of(*a.op_args()) is a and a.with_backend("hopper").backend == "hopper"
    assert MegaMoEOptions(**a.as_kwargs()) == a
    # True == 1 and hash(True) == hash(1): the cache must not hand back a checked 1 for True
    MegaMoEOptions.of("reference", "bf16", "keep", 1, False)
    with pytest.raises(TypeError, match=r"max_tokens_per_rank=True is a bool, expected an int"):
        MegaMoEOptions.of("reference", "bf16", "keep", True, False)
    with pytest.raises(TypeError, match=r"backend=\['reference'\] is a list"):
        MegaMoEOptions.of(["reference"])


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda a: a.update(x=a["x"].view(1, *a["x"].shape)), ValueError, r"x must be \[tokens, dim\]"),
        (lambda a: a.update(topk_ids=a["topk_ids"].float()), TypeError, "topk_ids must be int32 or int64"),
        (lambda a: a.update(topk_ids=a["topk_ids"][:-1]), ValueError, "topk_ids must be"),
        (lambda a: a.update(topk_weights=a["topk_weights"][:, :1]), ValueError, "topk_weights shape"),
        (lambda a: a.update(w1=a["w1"].float()), TypeError, "w1 dtype .* differs from x dtype"),
        (lambda a: a.update(w2=a["w2"].transpose(1, 2)), ValueError, r"w2 shape .* must be \[E, D, H\]"),
        (lambda a: a.update(w3=a["w3"][:2]), ValueError, "w3 shape"),
        (lambda a: a["topk_ids"].__setitem__((0, 0), 99), ValueError, r"topk_ids must lie in \[-1, 4\)"),
        (lambda a: a["topk_ids"].__setitem__((0, 0), -2), ValueError, r"topk_ids must lie in \[-1, 4\)"),
        (lambda a: a.update(precision="int4"), ValueError, "precision='int4' is not one of"),
        (lambda a: a.update(backend="cuda"), ValueError, "backend='cuda' is not one of"),
        (lambda a: a.update(precision="fp8"), ValueError, r"dim and hidden % 128 == 0"),
        (lambda a: a.update(backend="triton"), ValueError, "backend='triton' is not one of"),
        (lambda a: a.update(fp8_weight_cache="false"), TypeError,
         "fp8_weight_cache='false' is a str, expected a bool"),
        (lambda a: a.update(max_tokens_per_rank=1.5), TypeError,
         r"max_tokens_per_rank=1.5 is a float, expected an int"),
        (lambda a: a.update(max_tokens_per_rank=-1), ValueError, "max_tokens_per_rank=-1 must be"),
        (lambda a: a.update(save_activations=False), TypeError,
         "save_activations=False is a bool, expected a str: one of 'keep', 'never'"),
    ],
)
def test_bad_arguments_raise_clear_errors(mutate, exc, match):
    x, ids, w, w1, w2, w3 = make_inputs(4, 2, 4, 8, 16, "random")
    args = dict(x=x, topk_ids=ids, topk_weights=w, w1=w1, w2=w2, w3=w3, backend="reference", precision="bf16")
    mutate(args)
    with pytest.raises(exc, match=match):
        mega_moe(**args)


@contextlib.contextmanager
def _save_flags():
    """The ``save`` flag of every forward of the op inside the block (the registered op's and
    the eager path's: both run api._run_forward), in order."""
    from torchtitan_megamoe.ops import api

    seen = []
    real = api._run_forward

    def spy(*args):
        seen.append(args[8])  # (x, topk_ids, topk_weights, w1, w2, w3, fp8_weights, weight_casts,
        #                       save, ...)
        return real(*args)

    api._run_forward = spy
    try:
        yield seen
    finally:
        api._run_forward = real


def test_no_grad_call_saves_nothing():
    """Under no_grad (inference, evaluation) the op is told not to keep activations."""
    x, ids, w, w1, w2, w3 = make_inputs(8, 2, 3, 8, 8, "random", dtype=torch.float32)
    with _save_flags() as seen:
        with torch.no_grad():
            mega_moe(x, ids, w, w1.requires_grad_(), w2, w3, backend="reference")
        mega_moe(x, ids, w, w1, w2, w3, backend="reference")
        mega_moe(x, ids, w, w1.detach(), w2, w3, backend="reference")
    assert seen == [False, True, False]


def test_save_activations_never_keeps_nothing():
    x, ids, w, w1, w2, w3 = make_inputs(8, 2, 3, 8, 8, "random", dtype=torch.float32)
    with _save_flags() as seen:
        out = mega_moe(x, ids, w, w1.requires_grad_(), w2, w3, backend="reference",
                       save_activations="never")
    out.sum().backward()  # the backward still works (recomputing)
    assert w1.grad is not None and torch.isfinite(w1.grad).all()
    assert seen == [False]
    with pytest.raises(ValueError, match="save_activations='sometimes' is not one of"):
        mega_moe(x, ids, w, w1, w2, w3, backend="reference", save_activations="sometimes")


# ------------------------------------------------ plain eager calls skip torch.library's wrapper


@contextlib.contextmanager
def _paths():
    """Which path each mega_moe call inside the block took: "eager" (_EagerMegaMoE), "direct"
    (a plain call no gradient can flow through: the forward alone) or "op" (the registered
    megamoe::mega_moe)."""
    from torchtitan_megamoe.ops import api

    seen, inside = [], []
    real = api._EagerMegaMoE.apply, api._forward_only, api._run_forward

    def recorded(name, fn):
        def call(*args):
            seen.append(name)
            inside.append(True)
            try:
                return fn(*args)
            finally:
                inside.pop()
        return call

    def fwd(*args):
        if not inside:
            seen.append("op")
        return real[2](*args)

    api._EagerMegaMoE.apply = recorded("eager", real[0])
    api._forward_only = recorded("direct", real[1])
    api._run_forward = fwd
    try:
        yield seen
    finally:
        api._EagerMegaMoE.apply, api._forward_only, api._run_forward = real


@pytest.mark.parametrize("backend", ["reference", "hopper"])
def test_eager_path_matches_the_registered_op_bitwise(backend, monkeypatch):
    """A plain eager call (no compile, no dispatch mode, plain tensors) runs the op's forward
    and backward as an autograd Function; forcing the registered op gives the same bits."""
    from torchtitan_megamoe.ops import api

    x, ids, w, w1, w2, w3 = make_inputs(21, 3, 5, 32, 48, "dropped", dtype=torch.float32)
    if backend == "hopper":
        x, w1, w2, w3 = (t.bfloat16() for t in (x, w1, w2, w3))
    dy = torch.randn_like(x)
    results = {}
    for path in ("eager", "op"):
        if path == "op":
            monkeypatch.setattr(api, "_plain_eager", lambda tensors: False)
        leaves = [t.clone().requires_grad_() for t in (x, w, w1, w2, w3)]
        with _paths() as seen:
            out = mega_moe(leaves[0], ids, *leaves[1:], backend=backend)
        assert seen == [path]
        results[path] = (out, *torch.autograd.grad(out, leaves, dy))
    for name, a, b in zip(("out", "dx", "dw", "dw1", "dw2", "dw3"), *results.values()):
        assert torch.equal(a, b), name


def test_selective_ac_and_dispatch_modes_see_the_registered_op():
    """Per-op selective AC (a dispatch mode) must see megamoe::mega_moe to keep it; so must any
    TorchDispatchMode, and tensor subclasses; a plain call takes the eager path."""
    import functools

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import (
        CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
    )

    x, ids, w, w1, w2, w3 = make_inputs(8, 2, 3, 8, 8, "random", dtype=torch.float32)
    w1.requires_grad_()

    def layer(inp):
        return mega_moe(inp, ids, w, w1, w2, w3, backend="reference")

    def policy(ctx, op, *args, **kwargs):
        return (CheckpointPolicy.MUST_SAVE if op is torch.ops.megamoe.mega_moe.default
                else CheckpointPolicy.PREFER_RECOMPUTE)

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with _paths() as seen:
        layer(x)
        out = checkpoint(layer, x, use_reentrant=False, context_fn=functools.partial(
            create_selective_checkpoint_contexts, policy))
        out.sum().backward()  # the op was saved: not run again
        with Watch():
            layer(x)
        with torch.no_grad():
            layer(x)
    assert seen == ["eager", "op", "op", "direct"]


@pytest.mark.parametrize("backend", ["reference", "hopper"])
def test_calls_without_gradients_skip_autograd(backend):
    """Under no_grad, or with no input requiring grad, a plain call runs the forward alone (no
    autograd Function, no node): the same bits as the autograd path's output."""
    x, ids, w, w1, w2, w3 = make_inputs(21, 3, 5, 32, 48, "dropped", dtype=torch.float32)
    if backend == "hopper":
        x, w1, w2, w3 = (t.bfloat16() for t in (x, w1, w2, w3))
    with _paths() as seen:
        plain = mega_moe(x, ids, w, w1, w2, w3, backend=backend)
        with torch.no_grad():
            nograd = mega_moe(x, ids, w, w1.requires_grad_(), w2, w3, backend=backend)
        tracked = mega_moe(x, ids, w, w1, w2, w3, backend=backend)
    assert seen == ["direct", "direct", "eager"]
    assert plain.grad_fn is None and nograd.grad_fn is None and tracked.grad_fn is not None
    assert torch.equal(plain, tracked) and torch.equal(nograd, tracked)


@pytest.mark.parametrize("path", ["eager", "op", "compile"])
def test_autocast_computes_in_its_dtype_like_a_matmul(path, monkeypatch):
    """TorchTitan trains one device (and DDP) under torch.autocast, which does not reach a
    custom op: mega_moe casts x and the weights to the autocast dtype itself, returns that
    dtype and gives the fp32 leaves fp32 gradients, the same bits as casting by hand outside
    autocast (before this, the reference backend's matmuls were recast by autocast inside the op
    and the call failed). "op" forces the registered op, "compile" traces the call (aot_eager)."""
    from torchtitan_megamoe.ops import api

    x, ids, w, w1, w2, w3 = make_inputs(19, 3, 5, 32, 48, "dropped", dtype=torch.float32)
    dy = torch.randn(x.shape, dtype=torch.bfloat16)
    if path == "op":
        monkeypatch.setattr(api, "_plain_eager", lambda tensors: False)

    def layer(x, w, w1, w2, w3):
        return mega_moe(x, ids, w, w1, w2, w3, backend="reference")

    run = torch.compile(layer, backend="aot_eager", fullgraph=True) if path == "compile" else layer
    leaves = [t.clone().requires_grad_() for t in (x, w, w1, w2, w3)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run(*leaves)
    grads = torch.autograd.grad(out, leaves, dy)
    ref_leaves = [t.clone().requires_grad_() for t in (x, w, w1, w2, w3)]
    cast = [t.bfloat16() if i != 1 else t for i, t in enumerate(ref_leaves)]  # w stays fp32
    ref = layer(*cast)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dy)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    for name, a, b in zip(("dx", "dw", "dw1", "dw2", "dw3"), grads, ref_grads):
        assert a.dtype == torch.float32 and torch.equal(a, b), name
    assert rel(out, oracle(x, ids, w, w1, w2, w3)) < 2e-2
