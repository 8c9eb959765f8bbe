"""mega_moe with T = 0 tokens (x [0, D], topk_ids [0, K]) on every backend, forward and
backward: out [0, D], dx [0, D], d(topk_weights) [0, K], and weight gradients of the weights'
shapes, zero where no token reached the expert.

EP=1: the reference backend on CPU, the hopper backend under Triton's interpreter on CPU and
(marked gpu) on an sm_90 GPU; each in bf16 and the FP8 precisions. EP=2: a rank with no tokens still takes part in the exchange (its
experts serve the other rank's tokens, so its weight gradients are not zero): 2 gloo ranks on
CPU for both backends (hopper under the interpreter), and (marked multigpu) 2 GPUs with the
hopper backend's symmetric-memory exchange.
"""

from torchtitan_megamoe.ops.options import MegaMoEOptions
import pytest
import torch
import torch.distributed as dist

from moe_testing import (
    NAMES, finish_rank, grads_f64, init_gloo, make_inputs, moe_f64, op_args, rel_err, routing,
    run_ranks,
)
from torchtitan_megamoe import mega_moe

K, E, D, H = 3, 6, 32, 16  # D, H multiples of 16: the hopper kernels' tiles under the interpreter
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(),
                            reason="the CPU interpreter variant; a GPU runs the gpu-marked one")


def _empty_layer(dtype, device="cpu", D=D, H=H, E=E):
    inp = make_inputs(0, K, E, D, H, torch.empty(0, K, dtype=torch.int64), dtype=dtype,
                      device=device)
    assert inp["x"].shape == (0, D) and inp["topk_weights"].shape == (0, K)
    return inp


def _check_zero_token_call(inp, backend, precision="bf16", save="keep"):
    """Forward (no_grad, and with autograd) and backward of one T = 0 call."""
    x, ids, tw, w1, w2, w3 = op_args(inp)
    options = dict(backend=backend, precision=precision, save_activations=save)
    with torch.no_grad():
        out = mega_moe(x, ids, tw, w1, w2, w3, **options)
    assert out.shape == x.shape and out.dtype == x.dtype
    leaves = [t.clone().requires_grad_() for t in (x, tw, w1, w2, w3)]
    out = mega_moe(leaves[0], ids, *leaves[1:], **options)
    assert out.shape == x.shape and out.dtype == x.dtype
    grads = torch.autograd.grad(out, leaves, torch.empty_like(out))
    for name, g, like in zip(NAMES, grads, leaves):
        assert g.shape == like.shape and g.dtype == like.dtype, name
        assert (g == 0).all(), f"{name}: no token, so no gradient"
    return grads


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["eager", "op"])
def test_reference_backend(dtype, path, monkeypatch):
    """Both call paths: the plain eager one (_EagerMegaMoE) and the registered op."""
    from torchtitan_megamoe.ops import api

    if path == "op":
        monkeypatch.setattr(api, "_plain_eager", lambda tensors: False)
    _check_zero_token_call(_empty_layer(dtype), "reference")


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_reference_backend_fp8_emulation(precision):
    _check_zero_token_call(_empty_layer(torch.float32, D=128, H=128), "reference", precision)


def test_reference_backend_opcheck():
    """Fake and real impls agree at T = 0 (the shapes a compiled graph is traced with)."""
    inp = _empty_layer(torch.float64)
    x, ids, tw, w1, w2, w3 = op_args(inp)
    args = (x.requires_grad_(), ids, tw.requires_grad_(), w1, w2, w3, [], [], True, "",
            *MegaMoEOptions(backend="reference").op_args())
    torch.library.opcheck(torch.ops.megamoe.mega_moe.default, args)


@NO_GPU
@pytest.mark.parametrize("save", ["keep", "never"])
def test_hopper_backend_under_the_interpreter(save, monkeypatch):
    """The EP=1 forward and backward return at once (nothing to plan or launch); with
    save_activations "keep" the saved tensors are saved_like's (empty at T = 0)."""
    import importlib

    from torchtitan_megamoe.ops.hopper import bf16_forward

    def no_plan(*args, **kwargs):
        raise AssertionError("planned (and launched) for zero tokens")

    monkeypatch.setattr(bf16_forward, "build_plan", no_plan)
    monkeypatch.setattr(importlib.import_module("torchtitan_megamoe.ops.hopper.bf16_backward"),
                        "build_plan", no_plan)
    _check_zero_token_call(_empty_layer(torch.bfloat16), "hopper", save=save)


@NO_GPU
@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_hopper_backend_fp8_under_the_interpreter(precision):
    _check_zero_token_call(_empty_layer(torch.bfloat16, D=128, H=128), "hopper", precision)


@NO_GPU
def test_hopper_backend_op_saved_outputs_match_the_fake():
    from torchtitan_megamoe.ops import hopper

    x, ids, tw, w1, w2, w3 = op_args(_empty_layer(torch.bfloat16))
    hopper_args = MegaMoEOptions(backend="hopper").op_args()
    out, saved = torch.ops.megamoe.mega_moe(x, ids, tw, w1, w2, w3, [], [], True, "", *hopper_args)
    assert out.shape == (0, D)
    fake = hopper.saved_like(x, ids, tw, w1, w2, w3, None, MegaMoEOptions(precision="bf16"))
    assert [(s.shape, s.dtype) for s in saved] == [(f.shape, f.dtype) for f in fake]
    args = (x.requires_grad_(), ids, tw.requires_grad_(), w1.requires_grad_(), w2, w3, [], [],
            True, "", *hopper_args)
    torch.library.opcheck(torch.ops.megamoe.mega_moe.default, args,
                          test_utils=("test_schema", "test_faketensor",
                                      "test_autograd_registration", "test_aot_dispatch_dynamic"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["hopper", "auto"])
@pytest.mark.parametrize("precision", ["bf16", "fp8", "fp8_bwd"])
@pytest.mark.parametrize("save", ["keep", "never"])
def test_hopper_backend_on_the_gpu(backend, precision, save):
    for b in (backend, "reference"):
        _check_zero_token_call(_empty_layer(torch.bfloat16, "cuda", D=256, H=128, E=8), b,
                               precision, save)


# ------------------------------------------------------------------ EP=2: a rank with no tokens

R = 2


def _global_inputs(counts, dims, dtype, device="cpu"):
    """Every rank's tokens (rank r: counts[r] of them, in rank order) and every expert."""
    T, (D_, H_) = sum(counts), dims
    return make_inputs(T, K, E, D_, H_, routing("dropped", T, K, E, seed=3), seed=3,
                       dtype=dtype, device=device)


def _ep_worker(rank, backend, counts, dims, dist_backend, init_file, result_file):
    device = "cpu"
    if dist_backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                                world_size=R)
    else:
        init_gloo(rank, R, init_file)
    dtype = torch.float64 if backend == "reference" else torch.bfloat16
    inp = _global_inputs(counts, dims, dtype, device)
    start = sum(counts[:rank])
    mine = slice(start, start + counts[rank])
    experts = slice(rank * E // R, (rank + 1) * E // R)
    x, ids, tw, w1, w2, w3 = op_args(inp)
    leaves = [t.clone().requires_grad_()
              for t in (x[mine], tw[mine], w1[experts], w2[experts], w3[experts])]
    outs = []
    for _ in range(2):  # a second call reuses the exchange sized on the first
        for t in leaves:
            t.grad = None
        out = mega_moe(leaves[0], ids[mine], *leaves[1:], group=dist.group.WORLD,
                       backend=backend)
        out.backward(inp["dy"][mine])
        outs.append([out.detach().cpu()] + [t.grad.cpu() for t in leaves])
    torch.save(outs, f"{result_file}.{rank}")
    finish_rank()


def _check_ep(backend, counts, dims=(D, H), dist_backend="gloo"):
    ranks = run_ranks(_ep_worker, R, backend, counts, dims, dist_backend)
    for r, (first, second) in enumerate(ranks):
        assert counts[r] or first[0].shape == (0, dims[0])
        for name, a, b in zip(("out",) + NAMES, first, second):
            assert torch.equal(a, b), f"rank {r} {name}: the second call differs"
    got = [torch.cat([r[0][i] for r in ranks]) for i in range(6)]  # tokens, then experts
    dtype = torch.float64 if backend == "reference" else torch.bfloat16
    inp = _global_inputs(counts, dims, dtype)
    x, ids, tw, w1, w2, w3 = op_args(inp)
    if backend == "reference":  # one rank holding every token and expert: 1e-12
        leaves = [t.clone().requires_grad_() for t in (x, tw, w1, w2, w3)]
        out = mega_moe(leaves[0], ids, *leaves[1:], backend="reference")
        want = [out.detach(), *torch.autograd.grad(out, leaves, inp["dy"])]
        tol = 1e-12
    else:
        want = [moe_f64(x, ids, tw, w1, w2, w3), *grads_f64(inp)]
        tol = 1e-2
    for name, a, b in zip(("out",) + NAMES, got, want):
        assert a.shape == b.shape, name
        assert rel_err(a, b) <= tol, f"{name}: rel err {rel_err(a, b):.2e}"
    if sum(counts):
        # a tokenless rank's experts served the other rank's tokens
        for r in range(R):
            assert got[3][r * E // R:(r + 1) * E // R].abs().sum() > 0, f"rank {r}'s experts"


@pytest.mark.parametrize("counts", [(0, 9), (9, 0), (0, 0)], ids=["rank0_empty", "rank1_empty",
                                                                  "both_empty"])
def test_ep2_reference_backend_gloo(counts):
    _check_ep("reference", counts)


@NO_GPU
@pytest.mark.parametrize("counts", [(0, 9), (0, 0)], ids=["rank0_empty", "both_empty"])
def test_ep2_hopper_backend_gloo(counts):
    _check_ep("hopper", counts)


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_ep2_hopper_backend_nccl():
    _check_ep("hopper", (0, 96), dims=(256, 128), dist_backend="nccl")
