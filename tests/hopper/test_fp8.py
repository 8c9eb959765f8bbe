"""precision="fp8" / "fp8_bwd" in the hopper backend against the reference backend's emulation of
the same blockwise recipe (tightly) and against float64 (no less accurate than the emulation).

On CPU the kernels run under Triton's interpreter at small sizes; on a GPU (marked ``gpu``) at
larger ones and at the Qwen3-30B-A3B shape. Routings (tests/moe_testing.py): random, uneven (an
empty expert, dropped slots), only two experts used, one expert holding every row; token counts
that are not tile multiples.
"""

import pytest
import torch

from moe_testing import make_inputs, op_args, rel_err, routing

from torchtitan_megamoe import mega_moe
from torchtitan_megamoe.ops.options import MegaMoEOptions
from torchtitan_megamoe.ops.recipe import RECIPES

NAMES = ("out", "dx", "dtopk_weights", "dw1", "dw2", "dw3")
CUDA = torch.cuda.is_available()


def _inputs(T, K, E, D, H, routing_name, device, seed=0):
    ids = routing(routing_name, T, K, E, seed).to(device)
    inp = make_inputs(T, K, E, D, H, ids, seed=seed, dtype=torch.float32, device=device)
    return [*op_args(inp), inp["dy"]]


def _run(inputs, backend, precision, dtype):
    x, ids, tw, w1, w2, w3, grad = inputs
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, tw, w1, w2, w3)]
    xx, tww, a, b, c = leaves
    _poison_cache(inputs[0].device)
    out = mega_moe(xx, ids, tww, a, b, c, backend=backend, precision=precision)
    (out.double() * grad.double()).sum().backward()
    return [out.detach().double()] + [t.grad.double() for t in (xx, tww, a, b, c)]


def _poison_cache(device):
    """Fill free cached GPU memory with NaN, so a kernel output that is read before it is
    written shows up as NaN instead of stale zeros."""
    if device.type == "cuda":
        block = torch.full((64 << 20,), float("nan"), dtype=torch.float32, device=device)
        del block


def _check(inputs, precision, tol_emu):
    got = _run(inputs, "hopper", precision, torch.bfloat16)
    emu = _run(inputs, "reference", precision, torch.bfloat16)
    exact = _run(inputs, "reference", "bf16", torch.float64)
    for name, g, e, r in zip(NAMES, got, emu, exact):
        assert torch.isfinite(g).all(), name
        tol = tol_emu[0] if name == "out" else tol_emu[1]
        assert rel_err(g, e) < tol, (precision, name, rel_err(g, e))
        # as the emulated recipe (a broken scale or block would be far worse)
        assert rel_err(g, r) < 1.15 * rel_err(e, r) + 2e-3, (precision, name, rel_err(g, r), rel_err(e, r))
    again = _run(inputs, "hopper", precision, torch.bfloat16)
    for name, g, a in zip(NAMES, got, again):
        assert torch.equal(g, a), f"{precision} {name}: two identical calls differ"


@pytest.mark.skipif(CUDA, reason="interpreter test; the GPU runs the gpu-marked ones")
@pytest.mark.parametrize("wgrad", ["bf16", "fp8"])
@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_fp8_interpreter_uneven(precision, wgrad, monkeypatch):
    """Both weight-gradient recipes: bf16 (the default) and FP8 (MEGAMOE_FP8_WGRAD=1), each
    against the reference's emulation of the same recipe."""
    monkeypatch.setenv("MEGAMOE_FP8_WGRAD", "1" if wgrad == "fp8" else "0")
    inputs = _inputs(T=21, K=2, E=4, D=256, H=128, routing_name="uneven", device="cpu")
    _check(inputs, precision, (1e-2, 3e-2))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("routing_name", ["random", "uneven", "empty_experts"])
@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_fp8_gpu(precision, routing_name):
    inputs = _inputs(T=999, K=4, E=8, D=512, H=384, routing_name=routing_name, device="cuda")
    _check(inputs, precision, (1e-2, 3e-2))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("wgrad", ["bf16", "fp8"])
def test_fp8_gpu_qwen3_30b_shape(wgrad, monkeypatch):
    monkeypatch.setenv("MEGAMOE_FP8_WGRAD", "1" if wgrad == "fp8" else "0")
    inputs = _inputs(T=2048, K=8, E=128, D=2048, H=768, routing_name="random", device="cuda")
    # out: 2e-2 from the emulation where the tuner picks DeepGEMM's GEMM 1, whose SwiGLU pass
    # quantizes h from the bf16 a (the emulation from fp32): ~3% of h's e4m3 roundings flip.
    # Against float64 the bound of _check (as the emulation) still holds.
    _check(inputs, "fp8", (2e-2, 3e-2))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("routing_name", ["uneven", "one_expert"])
@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_fp8_fused_dgrad2_swiglu(precision, routing_name, monkeypatch):
    """MEGAMOE_FP8_FUSED_DGRAD2=1: the backward's dgrad2 + SwiGLU backward in one sm90 launch,
    held to the emulation as the two-launch path is."""
    from torchtitan_megamoe.ops.hopper import fp8_backward
    from torchtitan_megamoe.ops.hopper.cuda.sm90 import sm90_usable

    if not sm90_usable(torch.empty(1, device="cuda")):
        pytest.skip("needs the sm90 CUDA kernels (Hopper, nvcc)")
    monkeypatch.setenv("MEGAMOE_FP8_FUSED_DGRAD2", "1")
    calls = []
    fused = fp8_backward.fp8_dgrad2_swiglu_rows_sm90
    monkeypatch.setattr(fp8_backward, "fp8_dgrad2_swiglu_rows_sm90",
                        lambda *a, **k: calls.append(1) or fused(*a, **k))
    inputs = _inputs(T=999, K=4, E=8, D=512, H=384, routing_name=routing_name, device="cuda")
    _check(inputs, precision, (1e-2, 3e-2))
    assert calls, "the fused launch never ran"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_fp8_all_tokens_to_one_expert():
    _check(_inputs(T=300, K=2, E=4, D=256, H=256, routing_name="one_expert", device="cuda"),
           "fp8", (1e-2, 3e-2))


def test_fp8_rejects_shapes_accepts_ep(monkeypatch):
    """hidden 96: the op refuses FP8 (128-wide scaling blocks); an EP group is accepted (the
    exchange moves e4m3 rows; tests/hopper/test_ep_loopback.py runs it)."""
    from torchtitan_megamoe.ops import hopper

    w1 = w3 = torch.zeros(2, 96, 256, dtype=torch.bfloat16)
    w2 = torch.zeros(2, 256, 96, dtype=torch.bfloat16)
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    ids, tw = torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1)
    with pytest.raises(ValueError, match="% 128"):
        mega_moe(x, ids, tw, w1, w2, w3, backend="hopper", precision="fp8")

    class Pair:  # the world size is all check_inputs asks of a group
        pass

    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    for name in ("fp8", "fp8_bwd"):
        hopper.check_inputs(x, torch.zeros(2, 128, 256, dtype=torch.bfloat16), Pair(),
                            RECIPES[name])
        assert hopper._stages(MegaMoEOptions(precision=name), Pair()) == ("ep", "ep")


def test_dgrad1_groups_bound_the_transposed_copy():
    """Without the weight cache the dgrad of linear 1 takes the experts in contiguous groups
    whose transposed [w1 | w3] copy (E_g * D * 2H bytes) stays within rows * H bytes; with the
    cache (the whole copy is held anyway) it is one launch."""
    from torchtitan_megamoe.ops.hopper import fp8_backward

    for E, H, D, rows in ((128, 768, 2048, 147456), (128, 1536, 4096, 147456), (4, 128, 256, 640),
                          (5, 128, 128, 1 << 20), (3, 128, 4096, 128)):
        groups = fp8_backward.dgrad1_groups(E, H, D, rows, weight_cache=False)
        assert groups[0][0] == 0 and groups[-1][1] == E
        assert all(a[1] == b[0] for a, b in zip(groups, groups[1:])), groups
        assert all(hi > lo for lo, hi in groups), groups
        sizes = [hi - lo for lo, hi in groups]
        assert max(sizes) == 1 or max(sizes) * D * 2 * H <= rows * H, (E, H, D, rows, groups)
    assert fp8_backward.dgrad1_groups(128, 768, 2048, 147456, weight_cache=False) == [
        (0, 32), (32, 64), (64, 96), (96, 128)]
    assert fp8_backward.dgrad1_groups(128, 768, 2048, 147456, weight_cache=True) == [(0, 128)]



def test_fused_dgrad2_runs_only_where_asked_and_able(monkeypatch):
    """MEGAMOE_FP8_FUSED_DGRAD2=1 takes the one-launch kernel A only where the sm90 kernels run,
    on bf16 with FP8-block shapes; otherwise (and by default) the two launches."""
    from types import SimpleNamespace

    from torchtitan_megamoe.ops.hopper import fp8_backward
    from torchtitan_megamoe.ops.hopper.sides.table import Available

    gq = torch.empty(4, 256)
    w2t = SimpleNamespace(q=torch.empty(2, 384, 256))
    plan = SimpleNamespace(block_m=128)
    a = torch.empty(8, 768, dtype=torch.bfloat16)
    bf16 = torch.bfloat16

    def fused(sm90=True, env="1", w=w2t, p=plan, saved=a, dtype=bf16):
        monkeypatch.setenv("MEGAMOE_FP8_FUSED_DGRAD2", env)
        monkeypatch.setattr(fp8_backward, "available", lambda t: Available(sm90=sm90))
        return fp8_backward._fused_dgrad2(gq, w, saved, p, dtype)

    assert fused()
    assert not fused(env="0")  # the default
    assert not fused(sm90=False)  # no Hopper GPU, nvcc, or MEGAMOE_CUDA=0
    assert not fused(w=SimpleNamespace(q=torch.empty(2, 320, 256)))  # H not a 128 multiple
    assert not fused(p=SimpleNamespace(block_m=64))
    assert not fused(dtype=torch.float32)
    assert not fused(saved=a.float())
