"""The hopper backend's bf16 forward end to end: under the interpreter on CPU at small sizes,
and (marked gpu) compiled at the real Qwen3 shapes against the reference backend."""

import pytest
import torch

from moe_testing import make_inputs, make_weights, moe_f64, op_args, rel_err, routings, skewed_ids
from torchtitan_megamoe import mega_moe
from torchtitan_megamoe.ops import hopper as tb
from torchtitan_megamoe.ops import reference
from torchtitan_megamoe.ops.options import MegaMoEOptions

T, K, E, D, H = 21, 3, 5, 32, 48


@pytest.mark.parametrize("name,ids", list(routings(T, K, E)), ids=lambda v: v if isinstance(v, str) else "")
def test_forward_matches_f64(name, ids):
    if not torch.cuda.is_available():
        dev = "cpu"
    else:
        dev = "cuda"
    w1, w2, w3 = make_weights(E, D, H, device=dev)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ids.shape[0], D, generator=g).to(torch.bfloat16).to(dev)
    w = torch.rand(ids.shape, generator=g)
    w[ids < 0] = float("nan")  # a dropped slot's weight must not leak into the output
    ids, w = ids.to(dev), w.to(dev)
    out = tb.forward(x, ids, w, w1, w2, w3, None, MegaMoEOptions(precision="bf16"))
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    ref = moe_f64(x.cpu(), ids.cpu(), w.cpu(), w1.cpu(), w2.cpu(), w3.cpu())
    assert not out.isnan().any()
    if ref.norm() == 0:
        assert torch.all(out == 0)
    else:
        assert rel_err(out.cpu(), ref) < 1e-2
    # deterministic: a second call gives identical bits
    assert torch.equal(out, tb.forward(x, ids, w, w1, w2, w3, None, MegaMoEOptions(precision="bf16")))


def test_forward_rejects_what_kernels_cannot_take():
    w1, w2, w3 = make_weights(E, D, H)
    x = torch.randn(4, D).to(torch.bfloat16)
    ids = torch.zeros(4, K, dtype=torch.long)
    w = torch.rand(4, K)
    with pytest.raises(TypeError, match="bfloat16"):
        tb.forward(x.float(), ids, w, w1.float(), w2.float(), w3.float(), None, MegaMoEOptions(precision="bf16"))
    with pytest.raises(ValueError, match="% 128"):  # FP8's scaling blocks: the op checks it
        mega_moe(x, ids, w, w1, w2, w3, backend="hopper", precision="fp8")
    w1o, w2o, w3o = make_weights(E, D, 40)
    with pytest.raises(ValueError, match="multiples"):
        tb.forward(x, ids, w, w1o, w2o, w3o, None, MegaMoEOptions(precision="bf16"))


# ----------------------------------------------------------------------------- GPU, real shapes

SHAPES = {"qwen3_30b_a3b": (2048, 768), "qwen3_235b_a22b": (4096, 1536)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", list(SHAPES))
def test_forward_real_shape_vs_reference(shape):
    D_, H_ = SHAPES[shape]
    T_, K_, E_ = 16384, 8, 128
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    ids = skewed_ids(T_, K_, E_, generator=g)  # expert popularity varies, some slots dropped
    x, ids, _, w1, w2, w3 = op_args(make_inputs(T_, K_, E_, D_, H_, ids, device=dev, generator=g))
    w = torch.softmax(torch.randn(T_, K_, device=dev, generator=g), -1)
    assert tb.supports(x, None)
    out = tb.forward(x, ids, w, w1, w2, w3, None, MegaMoEOptions(precision="bf16"))
    ref = reference.forward(x, ids, w, w1, w2, w3, None, MegaMoEOptions(precision="bf16"))
    err = rel_err(out.float(), ref.float())
    assert err <= 1e-2, err
    assert torch.equal(out, tb.forward(x, ids, w, w1, w2, w3, None, MegaMoEOptions(precision="bf16")))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_tuner_candidate_is_correct():
    """The tuner may pick any candidate, so each one (TMA or not) must be right on its own."""
    from torchtitan_megamoe.ops.hopper import heuristics
    from torchtitan_megamoe.ops.hopper.bf16_forward import forward_bf16
    from torchtitan_megamoe.ops.hopper.configs import Sm90

    D_, H_, T_, K_, E_ = 2048, 768, 3000, 8, 16
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(1)
    x, ids, w, w1, w2, w3 = op_args(make_inputs(T_, K_, E_, D_, H_, device=dev, generator=g))
    ids[ids == 3] = -1  # an empty expert and dropped slots
    ref = reference.forward(x, ids, w, w1, w2, w3, None, MegaMoEOptions(precision="bf16")).float()
    c1s = list(heuristics.GEMM1_SWIGLU_CONFIGS)
    from torchtitan_megamoe.ops.hopper.cuda.sm90 import sm90_buildable

    if sm90_buildable(x):  # the CUDA kernels' candidates (offered unless MEGAMOE_CUDA=0)
        c1s.append(Sm90())
    c2s = list(heuristics.GEMM2_CONFIGS)
    if sm90_buildable(x):
        c2s.append(Sm90())
    for i in range(max(len(c1s), len(c2s))):
        c1, c2 = c1s[i % len(c1s)], c2s[i % len(c2s)]
        out = forward_bf16(x, ids, w, w1, w2, w3, gemm1_config=c1, gemm2_config=c2)
        err = rel_err(out.float(), ref)
        assert err <= 1e-2, (c1, c2, err)
        # the same candidate storing the pre-activations (what training runs)
        out_s, (a, packed) = forward_bf16(x, ids, w, w1, w2, w3, gemm1_config=c1, gemm2_config=c2,
                                         save=True)
        assert torch.equal(out_s, out), c1
        _check_saved_rows(x, ids, w1, w3, a, packed, rows=range(0, 3000 * 8, 97))


def _check_saved_rows(x, ids, w1, w3, a, packed, rows):
    """Rows of the saved a = [a1 | a3] against float64 x @ w^T (padding rows exactly 0)."""
    from torchtitan_megamoe.ops.hopper.tiles import plan_block_m
    from torchtitan_megamoe.ops.hopper.plan import unpack_plan

    T_, K_ = ids.shape
    E_, H_, _ = w1.shape
    plan = unpack_plan(packed, T_, K_, E_, plan_block_m())
    used = int(plan.num_rows_used)
    row_slot = plan.row_slot.long().cpu()
    tile_e = plan.tile_expert.long().cpu()
    for r in rows:
        if r >= used:
            break
        s = int(row_slot[r])
        if s < 0:
            assert (a[r] == 0).all(), r
            continue
        e = int(tile_e[r // plan.block_m])
        xr = x[s // K_].double()
        assert rel_err(a[r, :H_], w1[e].double() @ xr) < 1e-2, r
        assert rel_err(a[r, H_:], w3[e].double() @ xr) < 1e-2, r


@pytest.mark.parametrize("name,ids", list(routings(T, K, E)), ids=lambda v: v if isinstance(v, str) else "")
def test_forward_save(name, ids):
    """forward_bf16(save=True): the same out; saved = (a, packed plan) where the packed plan
    unpacks to build_plan's tensors and a holds [a1 | a3]; shapes as saved_like (fake) says."""
    from torchtitan_megamoe.ops.hopper.bf16_forward import forward_bf16, saved_like
    from torchtitan_megamoe.ops.hopper.tiles import plan_block_m
    from torchtitan_megamoe.ops.hopper.plan import build_plan, unpack_plan

    w1, w2, w3 = make_weights(E, D, H, seed=5)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(ids.shape[0], D, generator=g).to(torch.bfloat16)
    w = torch.rand(ids.shape, generator=g)
    out, saved = forward_bf16(x, ids, w, w1, w2, w3, save=True)
    assert torch.equal(out, forward_bf16(x, ids, w, w1, w2, w3))
    a, packed = saved
    for got, like in zip(saved, saved_like(x, ids, w1)):
        assert got.shape == like.shape and got.dtype == like.dtype
    block_m = plan_block_m()
    plan = build_plan(ids, E, block_m)
    unpacked = unpack_plan(packed, ids.shape[0], ids.shape[1], E, block_m)
    for f in ("row_slot", "slot_row", "tile_expert", "seg_start", "count", "num_rows_used"):
        assert torch.equal(getattr(unpacked, f), getattr(plan, f)), f
    with pytest.raises(ValueError, match="block_m"):
        unpack_plan(packed, ids.shape[0], ids.shape[1], E, block_m * 2)
    _check_saved_rows(x, ids, w1, w3, a, packed, rows=range(plan.max_rows))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dims_that_are_only_multiples_of_64():
    """Tiles of the tuned candidates need D % 256 / H % 128; other multiples of 64 must still
    run (on the fallback candidate)."""
    D_, H_, T_, K_, E_ = 320, 192, 500, 4, 8
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(2)
    ids = torch.randint(0, E_, (T_, K_), device=dev, generator=g)  # repeated experts too
    x, ids, w, w1, w2, w3 = op_args(make_inputs(T_, K_, E_, D_, H_, ids, device=dev, generator=g))
    out = tb.forward(x, ids, w, w1, w2, w3, None, MegaMoEOptions(precision="bf16"))
    ref = reference.forward(x, ids, w, w1, w2, w3, None, MegaMoEOptions(precision="bf16"))
    assert rel_err(out.float(), ref.float()) <= 1e-2
