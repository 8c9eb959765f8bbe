"""build_plan against a plain-Python construction of the same layout."""

import pytest
import torch

from torchtitan_megamoe.ops.triton.plan import build_plan, max_rows


def _expected(ids, E, bm, rank):
    T, K = ids.shape
    per_e = [[] for _ in range(E)]
    for s, g in enumerate(ids.reshape(-1).tolist()):
        e = g - rank * E
        if g >= 0 and 0 <= e < E:
            per_e[e].append(s)
    count = [len(p) for p in per_e]
    seg = [0]
    for c in count:
        seg.append(seg[-1] + (c + bm - 1) // bm * bm)
    R = max_rows(T * K, E, bm)
    row_slot = [-1] * R
    slot_row = [-1] * (T * K)
    for e, p in enumerate(per_e):
        for i, s in enumerate(p):
            row_slot[seg[e] + i] = s
            slot_row[s] = seg[e] + i
    tile_expert = [-1] * (R // bm)
    for e in range(E):
        for r in range(seg[e], seg[e + 1], bm):
            tile_expert[r // bm] = e
    return row_slot, slot_row, tile_expert, seg, count


def _routings():
    g = torch.Generator().manual_seed(0)
    yield "random", torch.randint(0, 6, (37, 3), generator=g), 6, 4, 0, 1
    ids = torch.randint(0, 6, (37, 3), generator=g)
    ids[::4, 1] = -1
    yield "dropped", ids, 6, 4, 0, 1
    yield "one_expert", torch.full((20, 2), 3), 5, 8, 0, 1
    yield "t1", torch.tensor([[2, 0]]), 4, 16, 0, 1
    yield "empty_experts", torch.tensor([[0, 7], [7, 0], [0, -1]]), 8, 2, 0, 1
    yield "all_dropped", torch.full((6, 2), -1), 3, 4, 0, 1
    yield "ep_rank1", torch.randint(0, 8, (50, 4), generator=g), 4, 4, 1, 2
    yield "no_tokens", torch.zeros((0, 4), dtype=torch.long), 3, 4, 0, 1


@pytest.mark.parametrize("case", list(_routings()), ids=lambda c: c[0])
def test_plan_matches_python(case):
    _, ids, E, bm, rank, ep = case
    plan = build_plan(ids, E, bm, rank=rank, ep_size=ep)
    row_slot, slot_row, tile_expert, seg, count = _expected(ids, E, bm, rank)
    assert plan.row_slot.dtype == torch.int32
    assert plan.row_slot.tolist() == row_slot
    assert plan.slot_row.tolist() == slot_row
    assert plan.tile_expert.tolist() == tile_expert
    assert plan.seg_start.tolist() == seg
    assert plan.count.tolist() == count
    assert int(plan.num_rows_used) == seg[-1]
    assert plan.max_rows % bm == 0 and plan.num_tiles == plan.max_rows // bm
    assert seg[-1] <= plan.max_rows


def test_plan_int32_ids_and_bounds():
    ids = torch.tensor([[1, 1], [1, 1]], dtype=torch.int32)
    plan = build_plan(ids, 2, 4)
    assert plan.tile_expert.tolist()[0] == 1
    assert plan.row_slot.tolist()[:4] == [0, 1, 2, 3]


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        build_plan(torch.zeros(4, dtype=torch.long), 2, 4)
    with pytest.raises(ValueError, match="integer"):
        build_plan(torch.zeros(4, 2), 2, 4)
    with pytest.raises(ValueError, match="rank"):
        build_plan(torch.zeros(4, 2, dtype=torch.long), 2, 4, rank=2, ep_size=2)


@pytest.mark.parametrize("case", list(_routings()), ids=lambda c: c[0])
def test_plan_kernels_match_torch_path(case):
    # The Triton plan (the GPU path) under the interpreter on CPU, against the torch-op path.
    _, ids, E, bm, rank, ep = case
    a = build_plan(ids, E, bm, rank=rank, ep_size=ep)
    b = build_plan(ids, E, bm, rank=rank, ep_size=ep, use_kernels=True)
    for f in ("row_slot", "slot_row", "tile_expert", "seg_start", "count"):
        assert getattr(b, f).dtype == torch.int32
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert int(a.num_rows_used) == int(b.num_rows_used)


def test_plan_kernels_many_chunks_and_experts():
    # several chunks per launch, E not a power of two, E_PAD > E, skewed load
    g = torch.Generator().manual_seed(3)
    E = 100
    ids = (torch.rand(300, 4, generator=g) ** 3 * E).long()
    ids[::7, 2] = -1
    a = build_plan(ids, E, 8)
    b = build_plan(ids, E, 8, use_kernels=True)
    for f in ("row_slot", "slot_row", "tile_expert", "seg_start", "count"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f


def test_plan_kernels_sub_blocks(monkeypatch):
    # each chunk walks several sub-blocks (SUB > 1), the last one partly past the end
    from torchtitan_megamoe.ops.triton import plan_kernels

    monkeypatch.setattr(plan_kernels, "TARGET_CHUNKS", 2)
    g = torch.Generator().manual_seed(4)
    E = 8
    ids = torch.randint(-1, E, (171, 5), generator=g)
    a = build_plan(ids, E, 16)
    b = build_plan(ids, E, 16, use_kernels=True)
    for f in ("row_slot", "slot_row", "tile_expert", "seg_start", "count"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
