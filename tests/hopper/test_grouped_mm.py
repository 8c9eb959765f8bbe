"""torch._grouped_mm stages of the hopper backward (kernels/grouped_mm.py) vs float64 math, the whole
backward forced onto them (MEGAMOE_BWD_IMPL=cublas) vs the reference backend, and (marked gpu)
every forced side at the Qwen3-30B shape.

_grouped_mm runs on CPU too, so the cuBLAS stages run natively here; the row gather and the
Triton stages run under the interpreter (tests/conftest.py)."""

from torchtitan_megamoe.ops.options import MegaMoEOptions
import pytest
import torch

from moe_testing import (
    BACKWARD_ROUTINGS, NAMES, POISON, SMALL, grads_f64, make_inputs, op_args, plan_for,
    real_routing, rel_err, routing, routings, same_bits, saved_and_recomputed,
)
from torchtitan_megamoe.ops.hopper import backward
from torchtitan_megamoe.ops.hopper.heuristics import WGRAD_CONFIGS
from torchtitan_megamoe.ops.hopper.sides.backward import shape
from torchtitan_megamoe.ops.hopper.configs import Cublas
from torchtitan_megamoe.ops.hopper.sides.table import Available
from torchtitan_megamoe.ops.hopper.sides.wgrad import DW2
from torchtitan_megamoe.ops.hopper.kernels.grouped_mm import (
    dgrad1_grouped_mm, gather_rows, wgrad_dw13_grouped_mm, wgrad_dw2_grouped_mm,
)
from torchtitan_megamoe.settings import BWD_IMPL as IMPL_ENV

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"),
                                reason="this torch has no torch._grouped_mm")

T, K, E = SMALL["T"], SMALL["K"], SMALL["E"]
D, H = 48, 32  # multiples of 16 (GEMM 1 runs in a recompute), not of the 32-wide tiles
BLOCK_M = 16  # group sizes multiples of 16, as on the GPU (128)


def _cases():
    cases = dict(routings(T, K, E, names=BACKWARD_ROUTINGS))
    cases["t1"] = torch.tensor([[3, -1, 0]])
    return cases


CASES = list(_cases())


def _setup(case, seed=0):
    ids = _cases()[case]
    plan = plan_for(ids, E, BLOCK_M)
    g = torch.Generator().manual_seed(seed)
    t = ids.shape[0]
    S = t * K

    def rnd(*shape):
        return torch.randn(*shape, generator=g).bfloat16()

    return ids, plan, dict(x=rnd(t, D), dy=rnd(t, D), hw=rnd(S, H), da=rnd(S, 2 * H),
                           w1=rnd(E, H, D), w3=rnd(E, H, D))


def _row_space(plan, per_slot):
    """Row-space buffer of per-slot values as kernel A leaves it: zeros in segment padding rows,
    NaN past the used rows (which no grouped GEMM group may read)."""
    rows = torch.full((plan.max_rows, per_slot.shape[1]), POISON, dtype=per_slot.dtype)
    used = int(plan.num_rows_used)
    slot = plan.row_slot.long()[:used]
    rows[:used] = torch.where((slot >= 0)[:, None], per_slot[slot.clamp(min=0)], 0)
    return rows


def _slot_experts(ids):
    return ids.reshape(-1)


def _wgrad64(ids, a_slot, b_slot):
    """out[e] = sum over slots s of expert e of a_s^T b_s, float64."""
    e_of = _slot_experts(ids)
    out = torch.zeros(E, a_slot.shape[1], b_slot.shape[1], dtype=torch.float64)
    for e in range(E):
        m = e_of == e
        out[e] = a_slot[m].double().T @ b_slot[m].double()
    return out


def _check(got, ref, name):
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    if ref.norm() == 0:
        assert (got == 0).all(), f"{name} must be exactly zero"
    else:
        err = rel_err(got, ref)
        assert err <= 1e-2, f"{name}: rel err {err:.2e}"


@pytest.mark.parametrize("case", CASES)
def test_gather_rows(case, monkeypatch):
    """Token rows in row order, zeros in padding rows; Triton kernel (interpreted) and the torch
    fallback agree bit for bit. Rows past the used ones are not part of the contract."""
    ids, plan, v = _setup(case)
    used = int(plan.num_rows_used)
    slot = plan.row_slot.long()[:used]
    ref = torch.where((slot >= 0)[:, None], v["x"][slot.clamp(min=0) // K], 0)
    outs = []
    for fallback in (False, True):
        if fallback:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        out = torch.full((plan.max_rows, D), POISON).bfloat16()
        got = gather_rows(v["x"], plan, block_r=8, block_c=16, out=out)
        assert got is out
        assert same_bits(got[:used], ref), f"fallback={fallback}"
        outs.append(got[:used])
    assert same_bits(*outs)


@pytest.mark.parametrize("case", CASES)
def test_wgrad_dw2_cublas(case):
    ids, plan, v = _setup(case, seed=1)
    hw = _row_space(plan, v["hw"])
    dy_slot = v["dy"].repeat_interleave(K, 0)
    w2 = torch.zeros(E, D, H).bfloat16()
    got = wgrad_dw2_grouped_mm(v["dy"], hw, plan, w2)
    assert got.shape == (E, D, H) and got.dtype == torch.bfloat16
    _check(got, _wgrad64(ids, dy_slot, v["hw"]), "dw2")


@pytest.mark.parametrize("case", CASES)
def test_wgrad_dw13_cublas(case):
    ids, plan, v = _setup(case, seed=2)
    da = _row_space(plan, v["da"])
    x_slot = v["x"].repeat_interleave(K, 0)
    # w1 in a non-contiguous parameter layout: dw1 must come back in that layout.
    w1 = torch.zeros(E, D, H).bfloat16().transpose(1, 2)
    w3 = torch.zeros(E, H, D).bfloat16()
    got1, got3 = wgrad_dw13_grouped_mm(da, v["x"], plan, w1, w3)
    assert got1.shape == w1.shape and got1.stride() == w1.stride()
    assert got3.shape == w3.shape and got3.stride() == w3.stride()
    assert got1.dtype == got3.dtype == torch.bfloat16
    _check(got1, _wgrad64(ids, v["da"][:, :H], x_slot), "dw1")
    _check(got3, _wgrad64(ids, v["da"][:, H:], x_slot), "dw3")


@pytest.mark.parametrize("case", CASES)
def test_dgrad_l1_cublas(case):
    ids, plan, v = _setup(case, seed=3)
    da = _row_space(plan, v["da"])
    S = ids.numel()
    out = torch.full((S, D), POISON).bfloat16()
    got = dgrad1_grouped_mm(da, v["w1"], v["w3"], plan, out=out)
    assert got is out
    e_of = _slot_experts(ids)
    live = e_of >= 0
    if not live.any():
        return  # every slot dropped: nothing is defined (the combine reads no row)
    e = e_of.clamp(min=0)
    da64 = v["da"].double()
    ref = (torch.einsum("sh,shd->sd", da64[:, :H], v["w1"].double()[e])
           + torch.einsum("sh,shd->sd", da64[:, H:], v["w3"].double()[e]))
    _check(got[live], ref[live], "dx_slot")


def test_k_grouped_calls_use_the_layout_that_accepts_empty_groups(monkeypatch):
    """On SM90 only A column-major x B row-major K-grouped calls accept empty groups (any other
    layout trips a device assert on an expert without rows): check every 2-D x 2-D call."""
    calls = []
    real = torch._grouped_mm

    def spy(a, b, offs=None, **kw):
        if a.dim() == 2 and b.dim() == 2:
            calls.append((a.stride(0) == 1 and a.stride(1) > 1, b.stride(1) == 1))
        assert offs.dtype == torch.int32 and offs.dim() == 1
        return real(a, b, offs=offs, **kw)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    ids, plan, v = _setup("uneven")
    wgrad_dw2_grouped_mm(v["dy"], _row_space(plan, v["hw"]), plan, torch.zeros(E, D, H).bfloat16())
    wgrad_dw13_grouped_mm(_row_space(plan, v["da"]), v["x"], plan, v["w1"], v["w3"])
    assert calls == [(True, True)] * 3


# ----------------------------------------------------------------------------- whole backward


def _inputs(case, seed=0):
    ids = _cases()[case]
    inp = make_inputs(ids.shape[0], K, E, D, H, ids, seed=seed)
    inp["topk_weights"][inp["topk_ids"] < 0] = float("nan")  # must not reach any gradient
    return inp


def _grads(inp):
    return backward(inp["dy"], inp["x"], inp["topk_ids"], inp["topk_weights"],
                    inp["w1"], inp["w2"], inp["w3"], None, MegaMoEOptions(precision="bf16"))


@pytest.mark.parametrize("case", CASES)
def test_backward_cublas_vs_reference_and_f64(case, monkeypatch):
    from torchtitan_megamoe.ops import reference

    monkeypatch.setenv(IMPL_ENV, "cublas")
    inp = _inputs(case)
    got = _grads(inp)
    clean = dict(inp, topk_weights=inp["topk_weights"].nan_to_num(0.0))
    ref = reference.backward(clean["dy"], clean["x"], clean["topk_ids"], clean["topk_weights"],
                             clean["w1"], clean["w2"], clean["w3"], None, MegaMoEOptions(precision="bf16"))
    for name, g, r, r64 in zip(NAMES, got, ref, grads_f64(clean)):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        _check(g, r64, name)
        if r64.norm() > 0:
            assert rel_err(g, r) <= 1e-2, f"{name} vs reference"
    assert (got[1][inp["topk_ids"] < 0] == 0).all(), "dropped slots get a zero weight gradient"


def test_backward_cublas_deterministic(monkeypatch):
    monkeypatch.setenv(IMPL_ENV, "cublas")
    inp = _inputs("uneven", seed=5)
    for name, a, b in zip(NAMES, _grads(inp), _grads(inp)):
        assert same_bits(a, b), name


def test_forced_sides_agree(monkeypatch):
    """triton and cublas sides give the same gradients up to bf16 rounding."""
    inp = _inputs("uneven", seed=4)
    res = {}
    for impl in ("triton", "cublas"):
        monkeypatch.setenv(IMPL_ENV, impl)
        res[impl] = _grads(inp)
    for name, a, b in zip(NAMES, res["triton"], res["cublas"]):
        assert rel_err(a, b) <= 1e-2, name


def test_stage_candidates_follow_the_env(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the GPU's Triton lists
    gpu = Available(cublas=True)

    def cands(D, H, E=1):
        return list(DW2.offer(shape(D, H, E, 128, True), gpu).candidates)

    tri = WGRAD_CONFIGS
    monkeypatch.delenv(IMPL_ENV, raising=False)
    assert cands(64, 32) == tri + [Cublas()]  # auto: Triton first (the tuner's reference)
    assert cands(60, 32) == tri  # auto skips what _grouped_mm cannot run
    monkeypatch.setenv(IMPL_ENV, "triton")
    assert cands(64, 32) == tri
    monkeypatch.setenv(IMPL_ENV, "cublas")
    assert cands(64, 32) == [Cublas()]
    with pytest.raises(ValueError, match="multiples of 8"):
        cands(64, 36)
    with pytest.raises(ValueError, match="1024 groups"):
        cands(64, 32, 1024)
    monkeypatch.setenv(IMPL_ENV, "cutlass")
    with pytest.raises(ValueError, match=IMPL_ENV):
        cands(64, 32)


# ----------------------------------------------------------------------------- GPU, 30B shape


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("impl", ["triton", "cublas", "auto"])
def test_backward_30b_each_side_vs_reference(impl, monkeypatch):
    """Qwen3-30B layer (T=16384, K=8, E=128, D=2048, H=768) with each side forced (auto: the
    tuner's per-stage pick): rel err <= 1e-2 vs backend reference, an expert nobody routes to
    gets exactly zero weight gradients, and two runs are bitwise equal."""
    from torchtitan_megamoe.ops import reference

    monkeypatch.setenv(IMPL_ENV, impl)
    T_, K_, E_, D_, H_ = 16384, 8, 128, 2048, 768
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    ids = real_routing(T_, K_, E_, dev)  # expert 7 never chosen
    inp = make_inputs(T_, K_, E_, D_, H_, ids, device=dev, generator=g)
    x, ids, _, w1, w2, w3 = op_args(inp)
    tw = torch.softmax(torch.randn(T_, K_, device=dev, generator=g), -1)
    dy = inp["dy"]
    args = (dy, x, ids, tw, w1, w2, w3, None, MegaMoEOptions(precision="bf16"))
    got = backward(*args)
    ref = reference.backward(*args)
    for name, g, r in zip(NAMES, got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        err = rel_err(g, r)
        assert err <= 1e-2, f"{impl} {name}: rel err {err:.2e}"
    for name, dw in zip(("dw1", "dw2", "dw3"), got[2:]):
        assert (dw[7] == 0).all(), f"{impl} {name}: unrouted expert 7 must get zero gradient"
    for name, a, b in zip(NAMES, got, backward(*args)):
        assert same_bits(a, b), f"{impl} {name} differs between two runs"


@pytest.mark.parametrize("case", ["uneven", "one_expert", "all_dropped", "t1"])
def test_saved_backward_cublas_kernel_a(case, monkeypatch):
    """The saved path with every stage forced onto cuBLAS (kernel A = grouped dgrad GEMM + the
    SwiGLU rows kernel; dw2 reusing its gathered dy rows) vs float64 and the Triton side,
    bitwise repeatable."""
    from torchtitan_megamoe.ops.hopper.bf16_backward import backward_bf16

    ids = torch.tensor([[3, -1, 0]]) if case == "t1" else routing(case, T, K, E, seed=3)
    monkeypatch.setenv(IMPL_ENV, "cublas")
    inp, saved, got, _ = saved_and_recomputed(ids, E, 32, 48, seed=3)  # D, H: forward tiles
    clean = dict(inp, topk_weights=inp["topk_weights"].nan_to_num(0.0))
    args = [inp[k] for k in ("dy", "x", "topk_ids", "topk_weights", "w1", "w2", "w3")]
    for name, a, b in zip(NAMES, got, backward_bf16(*args, saved=saved)):
        assert same_bits(a, b), name
    monkeypatch.setenv(IMPL_ENV, "triton")
    tri = backward_bf16(*args, saved=saved)
    for name, g, t, r64 in zip(NAMES, got, tri, grads_f64(clean)):
        assert torch.isfinite(g).all(), name
        if r64.norm() == 0:
            assert (g == 0).all(), name
            continue
        _check(g, r64, name)
        assert rel_err(g, t) <= 1e-2, f"{name}: cublas vs triton side {rel_err(g, t):.2e}"
    assert (got[1][inp["topk_ids"] < 0] == 0).all()


def test_gather_rows_dequantizes_fp8_rows_bitwise():
    """gather_rows with scales (the EP backward's FP8 dy): each row is dequant_rows' bf16 row of
    its token, padding rows zero, and the rows without scales the plain gather of those values."""
    from torchtitan_megamoe.ops.hopper.kernels.fp8_quant import dequant_rows, quant_rows

    T, C = 37, 256
    ids = routing("uneven", T, K, E, seed=3)
    plan = plan_for(ids, E)
    x = torch.randn(T, C, generator=torch.Generator().manual_seed(3)).bfloat16() * 3
    q, s = quant_rows(x)
    got = gather_rows(q, plan, scales=s)
    want = gather_rows(dequant_rows(q, s), plan)
    used = int(plan.num_rows_used)
    assert got.dtype == torch.bfloat16 and torch.equal(got[:used], want[:used])
    with pytest.raises(ValueError, match="scales"):
        gather_rows(q, plan, scales=s[:, :1])
