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


@pytest.mark.parametrize("use_kernels", [False, True])
def test_phased_plan_layout(use_kernels):
    """build_phased_plan (the EP forward's): each expert's segment holds one sub-segment per
    phase, each padded to block_m and in slot order; every tile belongs to one (expert, phase),
    phase_tiles partition the used tiles; the packed plan unpacks with its phase count. Both
    the torch-op path and the plan kernels with the phase folded in."""
    from torchtitan_megamoe.ops.hopper.plan import build_phased_plan, pack_plan, unpack_plan

    g = torch.Generator().manual_seed(5)
    T, K, E, bm, P = 60, 3, 4, 8, 2
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[torch.rand(T, K, generator=g) < 0.25] = -1
    ids[:, :][ids == 3] = -1  # expert 3 empty
    ids[40:] = torch.where(ids[40:] >= 0, 1, -1)  # phase-1-heavy expert 1
    phase = (torch.arange(T) >= 30).to(torch.int32)
    plan, tiles = build_phased_plan(ids, E, bm, phase, P, use_kernels=use_kernels)
    assert plan.max_rows == max_rows(T * K, E, bm, P)
    seg = plan.seg_start.tolist()
    assert plan.count.tolist() == [seg[e + 1] - seg[e] for e in range(E)]
    rows_of = {}
    for s, gid in enumerate(ids.reshape(-1).tolist()):
        r = int(plan.slot_row[s])
        if gid < 0:
            assert r == -1
            continue
        assert int(plan.row_slot[r]) == s and seg[gid] <= r < seg[gid + 1]
        p = int(phase[s // K])
        assert int(plan.tile_expert[r // bm]) == gid
        assert int(tiles[p][r // bm]) == gid and int(tiles[1 - p][r // bm]) == -1
        rows_of.setdefault((gid, p), []).append((r, s))
    for (gid, p), rs in rows_of.items():
        rows = [r for r, _ in rs]
        assert rows == sorted(rows) and [s for _, s in rs] == sorted(s for _, s in rs)
        assert rows == list(range(rows[0], rows[0] + len(rows)))  # contiguous sub-segment
        assert rows[0] % bm == 0  # each sub-segment starts a tile
    used = plan.tile_expert >= 0
    assert torch.equal((tiles[0] >= 0) | (tiles[1] >= 0), used)
    assert not ((tiles[0] >= 0) & (tiles[1] >= 0)).any()
    assert seg[3] == seg[4]  # the empty expert has no rows
    back = unpack_plan(pack_plan(plan), T, K, E, bm)
    for name in ("row_slot", "slot_row", "tile_expert", "seg_start", "count"):
        assert torch.equal(getattr(back, name), getattr(plan, name)), name


@pytest.mark.parametrize("P,E,case", [(2, 5, "random"), (3, 4, "skewed"), (2, 64, "random")])
def test_phased_plan_kernels_match_torch_path(P, E, case, monkeypatch):
    """The plan kernels with phases give the torch path's tensors bit for bit, with several
    chunks and sub-blocks per chunk (TARGET_CHUNKS lowered)."""
    from torchtitan_megamoe.ops.hopper.kernels import plan_kernels
    from torchtitan_megamoe.ops.hopper.plan import build_phased_plan

    monkeypatch.setattr(plan_kernels, "TARGET_CHUNKS", 3)
    g = torch.Generator().manual_seed(P * 100 + E)
    T, K, bm = 150, 4, 16
    ids = torch.randint(0, E, (T, K), generator=g)
    if case == "skewed":
        ids[ids % 2 == 1] = 0
    ids[torch.rand(T, K, generator=g) < 0.2] = -1
    phase = torch.randint(0, P, (T,), generator=g).to(torch.int32)
    a, ta = build_phased_plan(ids, E, bm, phase, P)
    b, tb = build_phased_plan(ids, E, bm, phase, P, use_kernels=True)
    for name in ("row_slot", "slot_row", "tile_expert", "seg_start", "count"):
        assert torch.equal(getattr(a, name).int(), getattr(b, name).int()), name
    assert int(a.num_rows_used) == int(b.num_rows_used)
    for x, y in zip(ta, tb):
        assert torch.equal(x.int(), y.int())


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
