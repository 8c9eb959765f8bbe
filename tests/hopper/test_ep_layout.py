"""The EP route (kernels/ep_layout.py) against a plain-Python reference of owner, pos, counts,
src_tok and meta on uneven routings: every token to one rank, tokens with every slot dropped,
ranks receiving nothing, T = 1, T not a multiple of the token tile, several slots of a token on
one rank (E_local < K), R = 2 and 4, K = 1 and 8, the own region first, last or between; and
the device-counted row copies (kernels/ep_copy.py)."""

import pytest
import torch

from torchtitan_megamoe.ops.hopper.kernels.ep_copy import copy_rows
from torchtitan_megamoe.ops.hopper.kernels.ep_layout import ep_route_tensors

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def reference(ids, weights, E_local, R, C, me=0):
    """owner, ret_slot, pos [T, R], meta [R, C, 2K] (id half; weights half separately) and the
    rows per destination, built token by token in Python: a peer's rows compact in token order,
    the own region (rank ``me``) token t at row t."""
    T, K = ids.shape
    owner = torch.full((T, K), -1, dtype=torch.int64)
    ret_slot = torch.full((T, K), -1, dtype=torch.int64)
    pos = torch.full((T, R), -1, dtype=torch.int32)
    meta_ids = torch.full((R, C, K), -1, dtype=torch.int32)
    meta_w = torch.zeros((R, C, K), dtype=torch.float64)
    n = [0] * R
    for t in range(T):
        for k in range(K):
            g = int(ids[t, k])
            owner[t, k] = g // E_local if g >= 0 else -1
        for d in range(R):
            if not any(int(owner[t, k]) == d for k in range(K)):
                continue
            row = t if d == me else n[d]
            n[d] += 1
            pos[t, d] = row
            for k in range(K):
                if int(owner[t, k]) == d:
                    meta_ids[d, row, k] = int(ids[t, k]) - d * E_local
                    ret_slot[t, k] = (d * C + row) * K + k
                    meta_w[d, row, k] = float(weights[t, k].double())
    return owner, ret_slot, pos, meta_ids, meta_w, n


def check_route(got, ids, weights, E_local, R, C, me):
    """The route's outputs against reference(): meta compared on the rows the receiver reads
    (a peer's first n_d rows, the whole own region)."""
    owner, ret_slot, pos, counts, src_tok, meta, _ = got
    T, K = ids.shape
    w_owner, w_ret, w_pos, w_ids, w_w, n = reference(ids.cpu(), weights.cpu(), E_local, R, C, me)
    assert torch.equal(owner.cpu(), w_owner)
    assert torch.equal(ret_slot.cpu(), w_ret)
    assert torch.equal(pos.cpu(), w_pos)
    assert counts.tolist() == [T if d == me else n[d] for d in range(R)]
    meta = meta.cpu()
    for d in range(R):
        rows = C if d == me else n[d]
        assert torch.equal(meta[d, :rows, :K], w_ids[d, :rows])
        got_w = meta[d, :rows, K:].contiguous().view(torch.float32).double()
        assert torch.equal(got_w, w_w[d, :rows])
        if d != me:  # the compact rows name their tokens, in token order
            toks = [t for t in range(T) if int(w_pos[t, d]) >= 0]
            assert src_tok[d, : n[d]].tolist() == toks
    return n


def routing(T, K, R, E_local, case, g):
    E = R * E_local
    ids = torch.randint(0, E, (T, K), generator=g)
    if case == "one_rank":  # every slot on rank R-1: ranks 0..R-2 receive nothing
        ids = torch.randint((R - 1) * E_local, E, (T, K), generator=g)
    elif case == "dropped":  # some slots dropped, token 0 (and every 5th) entirely
        ids[torch.rand(T, K, generator=g) < 0.3] = -1
        ids[::5] = -1
    elif case == "skip_rank1":  # rank 1 receives nothing, others random
        ids = torch.where(ids // E_local == 1, ids - E_local, ids)
    return ids


CASES = [
    # T, K, R, E_local, case, block_t
    (1, 1, 2, 3, "random", None),
    (1, 8, 4, 2, "dropped", None),
    (37, 8, 2, 3, "random", 16),
    (50, 8, 4, 2, "dropped", 16),
    (29, 1, 4, 5, "one_rank", 8),
    (45, 8, 4, 1, "skip_rank1", 16),
    (300, 6, 2, 4, "random", None),
]


@pytest.mark.parametrize("T,K,R,E_local,case,block_t", CASES)
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_route_kernel_matches_reference(T, K, R, E_local, case, block_t, id_dtype):
    g = torch.Generator().manual_seed(T * 100 + K * 10 + R)
    ids = routing(T, K, R, E_local, case, g)
    weights = torch.rand(T, K, generator=g, dtype=torch.float64)
    w_dtype = torch.bfloat16 if id_dtype == torch.int32 else torch.float32
    weights = weights.to(w_dtype)
    C = T + 3  # regions longer than this batch: unused rows must read as "no slot"
    me = T % R  # the own region first, last or between
    got = ep_route_tensors(ids.to(id_dtype).to(DEV), weights.to(DEV), E_local, R, C, me=me,
                           block_t=block_t)
    n = check_route(got, ids, weights, E_local, R, C, me)
    if case == "one_rank":
        assert n[: R - 1] == [0] * (R - 1)
    if case == "skip_rank1":
        assert n[1] == 0


def test_route_kernel_overwrites_stale_outputs(monkeypatch):
    """Outputs come from torch.empty: poison the allocator's memory so a row the kernel skips
    would show. Every element of owner/ret_slot/pos and the id half of meta must be written."""
    g = torch.Generator().manual_seed(7)
    T, K, R, E_local, C = 23, 4, 2, 3, 40
    ids = routing(T, K, R, E_local, "dropped", g).to(DEV)
    weights = torch.rand(T, K, generator=g).to(DEV)
    real_empty = torch.empty

    def poisoned_empty(*shape, dtype=None, device=None):
        t = real_empty(*shape, dtype=dtype, device=device)
        return t.fill_(-77) if not t.is_floating_point() else t.fill_(float("nan"))

    import torchtitan_megamoe.ops.hopper.kernels.ep_layout as mod

    monkeypatch.setattr(mod.torch, "empty", poisoned_empty)
    got = ep_route_tensors(ids, weights, E_local, R, C, me=1, block_t=8)
    monkeypatch.undo()
    owner, ret_slot, pos, counts, src_tok, meta, _ = got
    for t in (owner, ret_slot, pos, meta[1, :, :K]):
        assert not (t == -77).any()
    check_route(got, ids, weights, E_local, R, C, 1)
    assert (meta[1, T:, K:] == 0).all() and (meta[1, T:, :K] == -1).all()


def test_route_kernel_rejects_short_regions():
    ids = torch.zeros(5, 2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="do not fit"):
        ep_route_tensors(ids, torch.ones(5, 2, device=DEV), 2, 2, 4)


def reference_vectorized(ids, weights, E_local, R, C, me):
    """The route in vectorized torch ops (for shapes too big for the Python loop): owner,
    pos [T, R], meta (rows the receiver reads; -1 / 0 elsewhere) and counts."""
    ids = ids.long()
    T, K = ids.shape
    owner = torch.where(ids >= 0, torch.div(ids, E_local, rounding_mode="floor"), -1)
    goes = (owner.unsqueeze(0) == torch.arange(R, device=ids.device)[:, None, None]).any(2)
    pos = torch.where(goes, goes.int().cumsum(1, dtype=torch.int32) - 1, -1)
    pos[me] = torch.where(goes[me], torch.arange(T, device=ids.device, dtype=torch.int32), -1)
    counts = goes.sum(1).int()
    counts[me] = T
    meta = torch.full((R, C, 2 * K), -1, dtype=torch.int32, device=ids.device)
    meta[..., K:] = 0
    wbits = weights.float().contiguous().view(torch.int32)
    for d in range(R):
        lid = torch.where(owner == d, ids - d * E_local, -1).to(torch.int32)
        rows = torch.cat([lid, torch.where(owner == d, wbits, 0)], 1)
        if d == me:
            meta[d, :T] = rows
        else:
            meta[d, : int(counts[d])] = rows[goes[d]]
    return owner, pos.t(), meta, counts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("R,E_local", [(2, 64), (8, 16)])
def test_route_kernel_gpu_30b_shape(R, E_local):
    """The compiled kernel at the 30B EP shape (T = C = 16384, K = 8), dropped slots included."""
    g = torch.Generator(device="cuda").manual_seed(3)
    T, K = 16384, 8
    ids = torch.randint(0, R * E_local, (T, K), device="cuda", generator=g)
    ids[torch.rand(T, K, device="cuda", generator=g) < 0.05] = -1
    weights = torch.rand(T, K, device="cuda", generator=g).bfloat16()
    me = R - 1
    owner, ret_slot, pos, counts, src_tok, meta, _ = ep_route_tensors(ids, weights, E_local, R,
                                                                      T, me=me)
    w_owner, w_pos, w_meta, w_counts = reference_vectorized(ids, weights, E_local, R, T, me)
    assert torch.equal(owner, w_owner)
    assert torch.equal(pos, w_pos)
    assert torch.equal(counts, w_counts)
    for d in range(R):
        n = int(counts[d])
        assert torch.equal(meta[d, :n], w_meta[d, :n])
    own = owner.clamp(min=0)
    row = pos.long().gather(1, own)
    want_ret = (own * T + row) * K + torch.arange(K, device="cuda")
    assert torch.equal(ret_slot, torch.where(owner >= 0, want_ret, -1))


@pytest.mark.parametrize("bad,ok", [(None, 1), (8, 0), (-2, 0), (7, 1)])
def test_route_kernel_checks_the_id_range(bad, ok):
    # R 2 x E_local 4: ids must lie in [-1, 8); the bad id in the last of several token tiles
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(-1, 8, (37, 3), generator=g).to(DEV)
    if bad is not None:
        ids[36, 2] = bad
    weights = torch.rand(37, 3, generator=g).to(DEV)
    *_, ids_ok = ep_route_tensors(ids, weights, 4, 2, 40, block_t=8, check_ids=True)
    assert ids_ok.dtype == torch.int32 and int(ids_ok) == ok
    assert ep_route_tensors(ids.clamp(-1, 7), weights, 4, 2, 40, block_t=8)[-1] is None


@pytest.mark.parametrize("dtype,W", [(torch.bfloat16, 6), (torch.float32, 5), (torch.int32, 16),
                                     (torch.uint8, 12)])
@pytest.mark.parametrize("indexed", [False, True])
def test_copy_rows_moves_count_rows_only(dtype, W, indexed):
    """Rows j < count are copied (through ``index`` when given); rows past count keep their
    poison: a peer's region past n_d is never written, so no bytes travel for it."""
    g = torch.Generator().manual_seed(W)
    src = torch.randint(0, 100, (20, W), generator=g).to(dtype).to(DEV)
    dst = torch.full((17, W), 77, dtype=dtype, device=DEV)
    index = torch.randperm(20, generator=g)[:17].int().to(DEV)
    count = torch.tensor([11], dtype=torch.int32, device=DEV)
    copy_rows([(src, dst)], count, index if indexed else None)
    want = src[index[:11].long()] if indexed else src[:11]
    assert torch.equal(dst[:11], want)
    assert (dst[11:] == 77).all()
    copy_rows([(src, dst)], torch.zeros(1, dtype=torch.int32, device=DEV))  # count 0: nothing
    assert torch.equal(dst[:11], want)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_copy_rows_moves_several_row_tensors_in_one_launch(monkeypatch, n):
    """Row tensors of other widths and dtypes (e4m3 rows with fp32 scales, x, metadata) move
    together, MAX_PAIRS per launch, each exactly as alone; past count, nothing."""
    from torchtitan_megamoe.ops.hopper.kernels import ep_copy

    launches = []
    real = ep_copy._copy_rows_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(ep_copy, "_copy_rows_kernel", Spy())
    g = torch.Generator().manual_seed(n)
    kinds = [(torch.uint8, 64), (torch.float32, 2), (torch.bfloat16, 40), (torch.int32, 6)][:n]
    srcs = [torch.randint(0, 100, (20, w), generator=g).to(dt).to(DEV) for dt, w in kinds]
    dsts = [torch.full((17, w), 77, dtype=dt, device=DEV) for dt, w in kinds]
    index = torch.randperm(20, generator=g)[:17].int().to(DEV)
    count = torch.tensor([9], dtype=torch.int32, device=DEV)
    copy_rows(list(zip(srcs, dsts)), count, index)
    assert len(launches) == -(-n // ep_copy.MAX_PAIRS)
    for src, dst in zip(srcs, dsts):
        assert torch.equal(dst[:9], src[index[:9].long()])
        assert (dst[9:] == 77).all()


def test_copy_rows_refuses_rows_of_partial_words():
    with pytest.raises(ValueError, match="whole 32-bit"):
        copy_rows([(torch.zeros(4, 3, dtype=torch.bfloat16),
                    torch.zeros(4, 3, dtype=torch.bfloat16))], torch.ones(1, dtype=torch.int32))


def test_route_counts_match_the_traffic_model_at_ep8():
    """Uniform top-8 of 128 experts over 8 ranks, 16384 tokens (30B at EP=8): the rows a rank
    sends its peers are T times the model's remote ranks per token (bench/ep_loopback.py) within
    1%, i.e. 4.67 rows per token where broadcasting would send 7."""
    from torchtitan_megamoe.bench.ep_loopback import model_bytes, remote_ranks_per_token

    T, R, E, K = 16384, 8, 128, 8
    g = torch.Generator().manual_seed(0)
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    weights = torch.rand(T, K, generator=g)
    me = 3
    counts = ep_route_tensors(ids.to(DEV), weights.to(DEV), E // R, R, T, me=me)[3].cpu()
    per_token = (int(counts.sum()) - int(counts[me])) / T
    model = remote_ranks_per_token(R, E, K)
    assert abs(per_token / model - 1) < 0.01 and 4.6 < model < 4.7
    assert abs(model_bytes(R, T, 2048, E, K, "bf16")["dispatch"] / 313.5e6 - 1) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pace_spins_for_the_rows_time():
    """kernels/ep_pace.py: 2000 rows of 1000 ns hold the stream ~2 ms; 0 rows do not."""
    from torchtitan_megamoe.ops.hopper.kernels.ep_pace import pace

    def timed(rows):
        count = torch.tensor([rows], dtype=torch.int32, device="cuda")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        pace(count, 1000.0)  # compiled before the timed call
        start.record()
        pace(count, 1000.0)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    assert 1.9 <= timed(2000) <= 2.5
    assert timed(0) < 0.1
