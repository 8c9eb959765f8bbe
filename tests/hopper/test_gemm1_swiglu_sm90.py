"""csrc/gemm1_swiglu.cu's bf16 mode on an H200 (marked gpu; skipped without an sm_90 GPU and nvcc):
h and the saved [a1 | a3] against float64 math on uneven routings, with every output poisoned
(NaN) first, at sizes that are and are not multiples of the kernel's tiles and of its pipeline
depth, tile maps with skipped tiles (left untouched), and the real Qwen3-30B shape."""

import pytest
import torch
import torch.nn.functional as F

from moe_testing import SM90_GPU, make_weights, nan_tensor, rel_err, routings, skewed_ids
from torchtitan_megamoe.ops.hopper import heuristics
from torchtitan_megamoe.ops.hopper.cuda.gemm1_swiglu import gemm1_swiglu_sm90
from torchtitan_megamoe.ops.hopper.sides import gemm1_swiglu as g1
from torchtitan_megamoe.ops.hopper.plan import build_plan

pytestmark = SM90_GPU
BM = 128


def _ref_rows(x, ids_k, plan, w1, w3):
    """float64 (a1, a3) of every used row (zeros for padding rows) and each row's expert."""
    used = int(plan.num_rows_used)
    slot = plan.row_slot[:used].long()
    expert = plan.tile_expert.repeat_interleave(plan.block_m)[:used].long()
    tok = torch.where(slot >= 0, slot // ids_k, 0)
    xr = x[tok].double() * (slot >= 0)[:, None]
    a1 = torch.empty(used, w1.shape[1], dtype=torch.float64, device=x.device)
    a3 = torch.empty_like(a1)
    for e in expert.unique().tolist():
        m = expert == e
        a1[m] = xr[m] @ w1[e].double().T
        a3[m] = xr[m] @ w3[e].double().T
    return a1, a3, slot


def _check(h, a, a1, a3, slot, tol=1e-2):
    used = a1.shape[0]
    ref_h = F.silu(a1) * a3
    err = rel_err
    assert not torch.isnan(h[:used]).any(), "rows left unwritten"
    assert err(h[:used], ref_h) <= tol
    assert torch.all(h[:used][slot < 0] == 0), "padding rows must be exactly 0"
    if a is not None:
        assert err(a[:used, : a1.shape[1]], a1) <= tol and err(a[:used, a1.shape[1]:], a3) <= tol
        assert torch.all(a[:used][slot < 0] == 0)



GROUPS = pytest.mark.parametrize("group_m", [8, 0], ids=["group8", "wave"])


@GROUPS
@pytest.mark.parametrize("T,K,E,D,H", [(700, 4, 8, 256, 256), (333, 2, 5, 640, 384)],
                         ids=["k_blocks_4", "k_blocks_10"])
def test_vs_float64_on_uneven_routings(T, K, E, D, H, group_m):
    w1, _, w3 = make_weights(E, D, H, device="cuda")
    x = torch.randn(T, D, device="cuda").bfloat16()
    for name, ids in routings(T, K, E):
        ids = ids.cuda()
        plan = build_plan(ids, E, BM)
        h, a = nan_tensor(plan.max_rows, H), nan_tensor(plan.max_rows, 2 * H)
        gemm1_swiglu_sm90(x[: ids.shape[0]], w1, w3, plan, h, a, group_m)
        torch.cuda.synchronize()
        a1, a3, slot = _ref_rows(x[: ids.shape[0]], K, plan, w1, w3)
        _check(h, a, a1, a3, slot)
        h2 = nan_tensor(plan.max_rows, H)
        gemm1_swiglu_sm90(x[: ids.shape[0]], w1, w3, plan, h2, None, group_m)
        used = int(plan.num_rows_used)
        assert torch.equal(h2[:used], h[:used]), name


def test_tile_map_launches_write_only_their_tiles():
    """Two launches with complementary tile maps (-1: skipped; the EP backward's recompute of
    the regions its store did not keep) write only their own tiles, together the whole h."""
    T, K, E, D, H = 600, 4, 6, 256, 256
    w1, _, w3 = make_weights(E, D, H, device="cuda", seed=2)
    x = torch.randn(T, D, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).cuda()
    plan = build_plan(ids, E, BM)
    first = torch.arange(plan.num_tiles, device="cuda") % 3 == 0
    maps = [torch.where(m, plan.tile_expert, -1) for m in (first, ~first)]
    h = nan_tensor(plan.max_rows, H)
    tile_of_row = lambda tiles: tiles.repeat_interleave(BM)[: plan.max_rows]  # noqa: E731
    gemm1_swiglu_sm90(x, w1, w3, plan.with_tiles(maps[0]), h)
    torch.cuda.synchronize()
    assert torch.isnan(h[tile_of_row(maps[0]) < 0]).all(), "wrote a skipped tile"
    gemm1_swiglu_sm90(x, w1, w3, plan.with_tiles(maps[1]), h)
    a1, a3, slot = _ref_rows(x, K, plan, w1, w3)
    _check(h, None, a1, a3, slot)


def test_real_30b_shape_matches_triton_and_float64():
    T, K, E, D, H = 16384, 8, 128, 2048, 768
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    w1, _, w3 = make_weights(E, D, H, device="cuda", generator=g)
    ids = skewed_ids(T, K, E, generator=g)
    plan = build_plan(ids, E, BM)
    h, a = nan_tensor(plan.max_rows, H), nan_tensor(plan.max_rows, 2 * H)
    gemm1_swiglu_sm90(x, w1, w3, plan, h, a)
    a1, a3, slot = _ref_rows(x, K, plan, w1, w3)
    _check(h, a, a1, a3, slot)
    used = int(plan.num_rows_used)
    tri = g1.gemm1_swiglu(x, w1, w3, plan, config=heuristics.GEMM1_SWIGLU_CONFIGS[0])
    assert rel_err(h[:used], tri[:used]) < 1e-2
    h2 = nan_tensor(plan.max_rows, H)
    gemm1_swiglu_sm90(x, w1, w3, plan, h2)
    assert torch.equal(h2[:used], h[:used]), "two runs must be bitwise identical"
    # the tile order (global ticket or static stride) must not change any tile's result
    h3 = nan_tensor(plan.max_rows, H)
    gemm1_swiglu_sm90(x, w1, w3, plan, h3, dynamic=False)
    assert torch.equal(h3[:used], h[:used]), "static and dynamic tile orders differ"


def test_ticket_left_zeroed_for_the_next_launch():
    """Launches on one stream share its ticket (ops/hopper/cuda/sm90.launch_context): each must leave
    it at zero, or the next launch would skip tiles (left NaN here). Also on a second stream,
    with another routing, and with launches of different unit counts back to back."""
    from torchtitan_megamoe.ops.hopper.cuda.sm90 import launch_context

    T, K, E, D, H = 1000, 4, 8, 256, 256
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    w1, _, w3 = make_weights(E, D, H, device="cuda", generator=g)
    plans = [build_plan(skewed_ids(T, K, E, generator=g), E, BM),
             build_plan(torch.randint(0, E, (T // 3, K), device="cuda", generator=g), E, BM)]
    ref = []
    for plan in plans:
        h = nan_tensor(plan.max_rows, H)
        gemm1_swiglu_sm90(x, w1, w3, plan, h, dynamic=False)  # static order: no ticket
        ref.append(h)
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            for i in (0, 1, 0, 0, 1):
                plan = plans[i]
                used = int(plan.num_rows_used)
                h = nan_tensor(plan.max_rows, H)
                gemm1_swiglu_sm90(x, w1, w3, plan, h)
                assert torch.equal(h[:used], ref[i][:used]), "a launch skipped tiles"
            ticket = launch_context(x.device)[2]
            assert int(ticket) == 0, "the ticket was not left zeroed"
    torch.cuda.synchronize()
