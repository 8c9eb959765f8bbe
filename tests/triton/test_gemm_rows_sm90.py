"""csrc/grouped_gemm_sm90.cu's ROWS mode (GEMM 2: out[r] = in[r] @ w[e]^T over a plan's row
space) on an H200 (marked gpu; skipped without an sm_90 GPU and nvcc): against float64 math on
uneven routings with the output poisoned (NaN) first, rows past the used ones never written,
K not a multiple of the pipeline depth, phased plans, both epilogues, and the real Qwen3-30B
shape against the Triton kernel (bitwise reruns, static vs dynamic tile order)."""

import pytest
import torch

from moe_math import routings
from torchtitan_megamoe.ops.cuda.gemm_rows import gemm_rows_sm90
from torchtitan_megamoe.ops.cuda.sm90 import sm90_buildable
from torchtitan_megamoe.ops.triton import gemm2_rows as g2
from torchtitan_megamoe.ops.triton.plan import build_phased_plan, build_plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not sm90_buildable(torch.empty(1, device="cuda")),
        reason="needs an sm_90 GPU and nvcc",
    ),
]
BM = 128
EPILOGUES = pytest.mark.parametrize(
    "defines", [(), ("MEGAMOE_SM90_TMA_STORE=1",), ("MEGAMOE_SM90_TMA_STORE=1", "MEGAMOE_SM90_WGMMA_LAG=1")],
    ids=["registers", "tma_store", "tma_store_lag1"])


def _nan(shape):
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")


def _rows_input(plan, K, seed=0):
    """in [R_max, K] as GEMM 1 leaves it: random used rows, zero padding rows, NaN past them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    used = int(plan.num_rows_used)
    inp = _nan((plan.max_rows, K))
    inp[:used] = torch.randn(used, K, device="cuda", generator=g).bfloat16()
    inp[:used][plan.row_slot[:used] < 0] = 0
    return inp


def _check(out, inp, w, plan, tol=1e-2):
    used = int(plan.num_rows_used)
    expert = plan.tile_expert.repeat_interleave(plan.block_m)[:used].long()
    ref = torch.zeros(used, w.shape[1], dtype=torch.float64, device="cuda")
    for e in expert.unique().tolist():
        m = expert == e
        ref[m] = inp[:used][m].double() @ w[e].double().T
    assert not torch.isnan(out[:used]).any(), "used rows left unwritten"
    err = float((out[:used].double() - ref).norm() / ref.norm().clamp_min(1e-30))
    assert err <= tol, err
    assert torch.all(out[:used][plan.row_slot[:used] < 0] == 0), "padding rows must be exactly 0"
    assert torch.isnan(out[used:]).all(), "wrote rows past the used ones"


@EPILOGUES
@pytest.mark.parametrize("group_m", [8, 1])
@pytest.mark.parametrize("T,K,E,N,KD", [(700, 4, 8, 256, 256), (333, 2, 5, 512, 640)],
                         ids=["k_blocks_4", "k_blocks_10"])
def test_vs_float64_on_uneven_routings(T, K, E, N, KD, group_m, defines):
    w = (torch.randn(E, N, KD, device="cuda") / KD**0.5).bfloat16()
    for name, ids in routings(T, K, E):
        plan = build_plan(ids.cuda(), E, BM)
        inp = _rows_input(plan, KD)
        out = _nan((plan.max_rows, N))
        gemm_rows_sm90(inp, w, plan, out, group_m=group_m, defines=defines)
        torch.cuda.synchronize()
        _check(out, inp, w, plan)


def test_phased_plan_writes_only_its_phase():
    T, K, E, N, KD = 600, 4, 6, 256, 256
    w = (torch.randn(E, N, KD, device="cuda") / KD**0.5).bfloat16()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).cuda()
    phase = (torch.arange(T, device="cuda") % 3 == 0).int()
    plan, phase_tiles = build_phased_plan(ids, E, BM, phase, 2)
    inp = _rows_input(plan, KD, seed=3)
    out = _nan((plan.max_rows, N))
    tile_of_row = lambda tiles: tiles.repeat_interleave(BM)[: plan.max_rows]  # noqa: E731
    p0 = type(plan)(**{**plan.__dict__, "tile_expert": phase_tiles[0]})
    gemm_rows_sm90(inp, w, p0, out)
    torch.cuda.synchronize()
    assert torch.isnan(out[tile_of_row(phase_tiles[0]) < 0]).all(), "wrote another phase's tiles"
    p1 = type(plan)(**{**plan.__dict__, "tile_expert": phase_tiles[1]})
    gemm_rows_sm90(inp, w, p1, out)
    _check(out, inp, w, plan)


def test_bad_shapes_name_the_requirement():
    ids = torch.randint(0, 4, (64, 2), device="cuda")
    plan = build_plan(ids, 4, BM)
    w = torch.randn(4, 192, 128, device="cuda").bfloat16()  # N not a multiple of 256
    with pytest.raises(ValueError, match="out columns % 256"):
        gemm_rows_sm90(_rows_input(plan, 128), w, plan, _nan((plan.max_rows, 192)))
    w = torch.randn(4, 256, 128, device="cuda")
    with pytest.raises(TypeError, match="w must be bfloat16"):
        gemm_rows_sm90(_rows_input(plan, 128), w, plan, _nan((plan.max_rows, 256)))


@pytest.mark.parametrize("defines", [(), ("MEGAMOE_SM90_TMA_STORE=1",)], ids=["registers", "tma_store"])
def test_real_30b_shape_matches_triton_and_float64(defines):
    T, K, E, D, H = 16384, 8, 128, 2048, 768
    torch.manual_seed(0)
    w2 = (torch.randn(E, D, H, device="cuda") / H**0.5).bfloat16()
    probs = torch.softmax(torch.randn(E, device="cuda") * 1.5, 0)
    ids = torch.multinomial(probs.expand(T, E), K, replacement=False)
    ids[::17, -1] = -1
    plan = build_plan(ids, E, BM)
    h = _rows_input(plan, H)
    y = _nan((plan.max_rows, D))
    gemm_rows_sm90(h, w2, plan, y, defines=defines)
    _check(y, h, w2, plan)
    used = int(plan.num_rows_used)
    tri = g2.gemm2_rows(h, w2, plan, config=g2.GPU_CONFIGS[0])
    assert float((y[:used].float() - tri[:used].float()).norm() / tri[:used].float().norm()) < 1e-2
    y2 = _nan((plan.max_rows, D))
    gemm_rows_sm90(h, w2, plan, y2, defines=defines)
    assert torch.equal(y2[:used], y[:used]), "two runs must be bitwise identical"
    y3 = _nan((plan.max_rows, D))
    gemm_rows_sm90(h, w2, plan, y3, defines=defines, dynamic=False)
    assert torch.equal(y3[:used], y[:used]), "static and dynamic tile orders differ"
