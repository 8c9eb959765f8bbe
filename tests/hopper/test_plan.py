"""build_plan against a plain-Python construction of the same layout."""

import pytest
import torch

from torchtitan_megamoe.ops.hopper.plan import build_plan, max_rows


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
    # the kernels' plan packs without a copy (a view of its own storage), the torch path with
    # one; both give the same vector
    from torchtitan_megamoe.ops.hopper.plan import pack_plan

    pa, pb = pack_plan(a), pack_plan(b)
    assert torch.equal(pa, pb)
    assert pb.untyped_storage().data_ptr() == b.row_slot.untyped_storage().data_ptr()


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
    from torchtitan_megamoe.ops.hopper.kernels import plan_kernels

    monkeypatch.setattr(plan_kernels, "TARGET_CHUNKS", 2)
    g = torch.Generator().manual_seed(4)
    E = 8
    ids = torch.randint(-1, E, (171, 5), generator=g)
    a = build_plan(ids, E, 16)
    b = build_plan(ids, E, 16, use_kernels=True)
    for f in ("row_slot", "slot_row", "tile_expert", "seg_start", "count"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f


@pytest.mark.parametrize("use_kernels", [False, True], ids=["torch", "kernels"])
@pytest.mark.parametrize("bad,ok", [(None, 1), (9, 0), (-2, 0), (8, 0), (7, 1), (-1, 1)])
def test_plan_checks_the_id_range(monkeypatch, use_kernels, bad, ok):
    # id_limit 8: ids must lie in [-1, 8); the bad id sits in the last sub-block of a chunk
    # after the first (TARGET_CHUNKS 2 gives several chunks with SUB > 1)
    from torchtitan_megamoe.ops.hopper.kernels import plan_kernels

    monkeypatch.setattr(plan_kernels, "TARGET_CHUNKS", 2)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(-1, 8, (171, 5), generator=g)
    if bad is not None:
        ids[170, 4] = bad
    plan = build_plan(ids, 8, 16, use_kernels=use_kernels, id_limit=8)
    assert plan.ids_ok.dtype == torch.int32 and plan.ids_ok.dim() == 0
    assert int(plan.ids_ok) == ok
    assert build_plan(ids.clamp(-1, 7), 8, 16, use_kernels=use_kernels).ids_ok is None


def test_forward_asserts_on_out_of_range_ids():
    # the Triton forward's plan check, as the op's CUDA path relies on (on CPU the assert
    # fails at once; on a GPU it fails the stream with the same message)
    from torchtitan_megamoe.ops.hopper.bf16_forward import forward_bf16

    T, K, E, D, H = 8, 2, 4, 16, 16
    x = torch.randn(T, D)
    ids = torch.randint(0, E, (T, K))
    ids[3, 1] = E
    w1, w3 = torch.randn(E, H, D), torch.randn(E, H, D)
    w2 = torch.randn(E, D, H)
    with pytest.raises(RuntimeError, match=r"topk_ids must lie in \[-1, 4\)"):
        forward_bf16(x, ids, torch.rand(T, K), w1, w2, w3)


@pytest.mark.parametrize("use_kernels", [False, True], ids=["torch", "kernels"])
def test_build_plans_equals_one_build_plan_per_batch(use_kernels, monkeypatch):
    """build_plans (the EP forward's regions, one launch pair): each batch's plan is build_plan's
    of that batch bit for bit, its packed plan a view that unpacks to it; batches with other
    routings (one empty, one skewed) do not disturb each other. Several chunks per batch."""
    from torchtitan_megamoe.ops.hopper.kernels import plan_kernels
    from torchtitan_megamoe.ops.hopper.plan import (build_plans, pack_plan, packed_plan_numel,
                                                     unpack_plan)

    monkeypatch.setattr(plan_kernels, "TARGET_CHUNKS", 3)
    g = torch.Generator().manual_seed(11)
    B, T, K, E, bm = 3, 70, 4, 5, 16
    ids = torch.randint(0, E, (B, T, K), generator=g)
    ids[torch.rand(B, T, K, generator=g) < 0.3] = -1
    ids[1] = -1  # nothing of batch 1 is here
    ids[2][ids[2] >= 0] = 3  # batch 2: one expert
    plans, packed = build_plans(ids, E, bm, use_kernels=use_kernels)
    assert len(plans) == B and packed.shape == (B, packed_plan_numel(T, K, E, bm))
    for b, plan in enumerate(plans):
        ref = build_plan(ids[b], E, bm)
        for f in ("row_slot", "slot_row", "tile_expert", "seg_start", "count"):
            assert torch.equal(getattr(plan, f).int(), getattr(ref, f).int()), (b, f)
        assert int(plan.num_rows_used) == int(ref.num_rows_used)
        back = unpack_plan(pack_plan(plan), T, K, E, bm)
        assert torch.equal(back.row_slot, plan.row_slot.int())
        assert torch.equal(packed[b], pack_plan(plan))  # the saved form: batch b's row
