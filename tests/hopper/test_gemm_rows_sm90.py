"""csrc/gemm_rows.cu's bf16 modes on an H200 (marked gpu; skipped without an sm_90 GPU
and nvcc): GEMM 2 (out[r] = in[r] @ w[e]^T, K-major weights) and the N-major form (the
backward's kernel C: [da1 | da3] @ [w1; w3][e]) against float64 math on uneven routings with
the output poisoned (NaN) first, rows past the used ones never written, K not a multiple of the
pipeline depth, tile maps with skipped tiles, and the real Qwen3-30B shape against the Triton
kernels (bitwise reruns, static vs dynamic tile order); the backward with the sm90 kernel C
forced against the reference backend."""

import pytest
import torch

from moe_testing import (SM90_GPU, forced_backward_matches_reference, make_weights, nan_tensor,
                         rel_err, routings, skewed_ids)
from torchtitan_megamoe.ops.hopper import heuristics
from torchtitan_megamoe.ops.hopper.cuda.gemm_rows import gemm_rows_nmajor_sm90, gemm_rows_sm90
from torchtitan_megamoe.ops.hopper.sides import gemm2 as g2
from torchtitan_megamoe.ops.hopper.plan import build_plan
from torchtitan_megamoe.ops.hopper.configs import Sm90

pytestmark = SM90_GPU
BM = 128



def _rows_input(plan, K, seed=0):
    """in [R_max, K] as GEMM 1 leaves it: random used rows, zero padding rows, NaN past them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    used = int(plan.num_rows_used)
    inp = nan_tensor(plan.max_rows, K)
    inp[:used] = torch.randn(used, K, device="cuda", generator=g).bfloat16()
    inp[:used][plan.row_slot[:used] < 0] = 0
    return inp


def _check(out, inp, w, plan, tol=1e-2):
    """w: [E, N, K] (K-major), or a tuple of [E, Ks, N] weights (N-major, K split among them)."""
    used = int(plan.num_rows_used)
    expert = plan.tile_expert.repeat_interleave(plan.block_m)[:used].long()
    n_major = isinstance(w, tuple)
    N = w[0].shape[2] if n_major else w.shape[1]
    ref = torch.zeros(used, N, dtype=torch.float64, device="cuda")
    for e in expert.unique().tolist():
        m = expert == e
        we = torch.cat([wi[e] for wi in w]) if n_major else w[e].T
        ref[m] = inp[:used][m].double() @ we.double()
    assert not torch.isnan(out[:used]).any(), "used rows left unwritten"
    err = rel_err(out[:used], ref)
    assert err <= tol, err
    assert torch.all(out[:used][plan.row_slot[:used] < 0] == 0), "padding rows must be exactly 0"
    assert torch.isnan(out[used:]).all(), "wrote rows past the used ones"


@pytest.mark.parametrize("group_m", [8, 1])
@pytest.mark.parametrize("T,K,E,N,KD", [(700, 4, 8, 256, 256), (333, 2, 5, 512, 640)],
                         ids=["k_blocks_4", "k_blocks_10"])
def test_vs_float64_on_uneven_routings(T, K, E, N, KD, group_m):
    w = (torch.randn(E, N, KD, device="cuda") / KD**0.5).bfloat16()
    for name, ids in routings(T, K, E):
        plan = build_plan(ids.cuda(), E, BM)
        inp = _rows_input(plan, KD)
        out = nan_tensor(plan.max_rows, N)
        gemm_rows_sm90(inp, w, plan, out, group_m=group_m)
        torch.cuda.synchronize()
        _check(out, inp, w, plan)


def test_tile_map_launches_write_only_their_tiles():
    """Two launches with complementary tile maps (-1: skipped) write only their own tiles,
    together the whole output."""
    T, K, E, N, KD = 600, 4, 6, 256, 256
    w = (torch.randn(E, N, KD, device="cuda") / KD**0.5).bfloat16()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).cuda()
    plan = build_plan(ids, E, BM)
    first = torch.arange(plan.num_tiles, device="cuda") % 3 == 0
    maps = [torch.where(m, plan.tile_expert, -1) for m in (first, ~first)]
    inp = _rows_input(plan, KD, seed=3)
    out = nan_tensor(plan.max_rows, N)
    tile_of_row = lambda tiles: tiles.repeat_interleave(BM)[: plan.max_rows]  # noqa: E731
    gemm_rows_sm90(inp, w, plan.with_tiles(maps[0]), out)
    torch.cuda.synchronize()
    assert torch.isnan(out[tile_of_row(maps[0]) < 0]).all(), "wrote a skipped tile"
    gemm_rows_sm90(inp, w, plan.with_tiles(maps[1]), out)
    _check(out, inp, w, plan)


def test_bad_shapes_name_the_requirement():
    ids = torch.randint(0, 4, (64, 2), device="cuda")
    plan = build_plan(ids, 4, BM)
    w = torch.randn(4, 192, 128, device="cuda").bfloat16()  # N not a multiple of 256
    with pytest.raises(ValueError, match="out columns % 256"):
        gemm_rows_sm90(_rows_input(plan, 128), w, plan, nan_tensor(plan.max_rows, 192))
    w = torch.randn(4, 256, 128, device="cuda")
    with pytest.raises(TypeError, match="w must be bfloat16"):
        gemm_rows_sm90(_rows_input(plan, 128), w, plan, nan_tensor(plan.max_rows, 256))


def test_real_30b_shape_matches_triton_and_float64():
    T, K, E, D, H = 16384, 8, 128, 2048, 768
    torch.manual_seed(0)
    w2 = (torch.randn(E, D, H, device="cuda") / H**0.5).bfloat16()
    ids = skewed_ids(T, K, E)
    plan = build_plan(ids, E, BM)
    h = _rows_input(plan, H)
    y = nan_tensor(plan.max_rows, D)
    gemm_rows_sm90(h, w2, plan, y)
    _check(y, h, w2, plan)
    used = int(plan.num_rows_used)
    tri = g2.gemm2(h, w2, plan, config=heuristics.GEMM2_CONFIGS[0])
    assert rel_err(y[:used], tri[:used]) < 1e-2
    y2 = nan_tensor(plan.max_rows, D)
    gemm_rows_sm90(h, w2, plan, y2)
    assert torch.equal(y2[:used], y[:used]), "two runs must be bitwise identical"
    y3 = nan_tensor(plan.max_rows, D)
    gemm_rows_sm90(h, w2, plan, y3, dynamic=False)
    assert torch.equal(y3[:used], y[:used]), "static and dynamic tile orders differ"
    assert torch.isnan(y3[used:]).all(), "wrote rows past the used ones"


@pytest.mark.parametrize("n_weights", [1, 2])
@pytest.mark.parametrize("T,K,E,N,KS", [(700, 4, 8, 256, 128), (333, 2, 5, 512, 320)],
                         ids=["k_blocks_2_per_weight", "k_blocks_5_per_weight"])
def test_nmajor_vs_float64_on_uneven_routings(T, K, E, N, KS, n_weights):
    ws = tuple((torch.randn(E, KS, N, device="cuda") / (KS * n_weights) ** 0.5).bfloat16()
               for _ in range(n_weights))
    for name, ids in routings(T, K, E):
        plan = build_plan(ids.cuda(), E, BM)
        inp = _rows_input(plan, KS * n_weights, seed=1)
        out = nan_tensor(plan.max_rows, N)
        gemm_rows_nmajor_sm90(inp, ws, plan, out)
        torch.cuda.synchronize()
        _check(out, inp, ws, plan)


def test_nmajor_real_30b_kernel_c_matches_triton():
    """Kernel C at the 30B shape: [da1 | da3] [R, 2H] against w1, w3 [E, H, D] as stored; the
    row-space result equals the Triton kernel C's slot rows (within bf16), reruns bitwise."""
    from torchtitan_megamoe.ops.hopper.kernels.dgrad1 import dgrad1

    T, K, E, D, H = 16384, 8, 128, 2048, 768
    g = torch.Generator(device="cuda").manual_seed(0)
    w1, _, w3 = make_weights(E, D, H, device="cuda", generator=g)
    ids = skewed_ids(T, K, E, generator=g)
    plan = build_plan(ids, E, BM)
    da = _rows_input(plan, 2 * H, seed=2)
    dx_rows = nan_tensor(plan.max_rows, D)
    gemm_rows_nmajor_sm90(da, (w1, w3), plan, dx_rows)
    _check(dx_rows, da, (w1, w3), plan)
    tri = dgrad1(da, w1, w3, plan, use_tma=True)  # [T*K, D] by slot
    live = plan.slot_row >= 0
    ours = dx_rows[plan.slot_row[live].long()].float()
    assert rel_err(ours, tri[live]) < 1e-2
    again = nan_tensor(plan.max_rows, D)
    gemm_rows_nmajor_sm90(da, (w1, w3), plan, again)
    used = int(plan.num_rows_used)
    assert torch.equal(again[:used], dx_rows[:used]), "two runs must be bitwise identical"


def test_backward_with_the_sm90_kernel_c_matches_the_reference(monkeypatch):
    """The whole backward with kernel C forced to the sm90 candidate (row-space dx, combine
    through slot_row): every gradient against the reference backend, and bitwise reruns."""
    forced_backward_matches_reference(monkeypatch, {"dgrad1": Sm90()}, seed=7,
                                      saved=False)


def test_saved_backward_with_the_sm90_kernel_a_matches_the_reference(monkeypatch):
    """Kernel A's saved path with its dh GEMM forced to the sm90 N-major gemm_rows mode (w2 as
    stored, on the gathered dy rows, then the SwiGLU rows kernel): every gradient against the
    reference backend, and bitwise reruns."""
    forced_backward_matches_reference(monkeypatch, {"dgrad2_swiglu": Sm90()},
                                      seed=11, saved=True)
