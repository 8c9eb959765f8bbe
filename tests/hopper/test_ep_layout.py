"""The one-launch EP route kernel (ep_route_kernel.py) against a plain-Python reference of
owner, pos and meta on uneven routings: every token to one rank, tokens with every slot
dropped, ranks receiving nothing, T = 1, T not a multiple of the token tile, several slots of a
token on one rank (E_local < K), R = 2 and 4, K = 1 and 8."""

import pytest
import torch

from torchtitan_megamoe.ops.hopper.kernels.ep_layout import ep_route_tensors

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def reference(ids, weights, E_local, R, C):
    """owner, ret_slot, pos [T, R], meta [R, C, 2K] (id half; weights half separately) and the
    tokens per destination, built token by token in Python (identity layout: token t at row t)."""
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
            n[d] += 1
            pos[t, d] = t
            for k in range(K):
                if int(owner[t, k]) == d:
                    meta_ids[d, t, k] = int(ids[t, k]) - d * E_local
                    ret_slot[t, k] = (d * C + t) * K + k
                    meta_w[d, t, k] = float(weights[t, k].double())
    return owner, ret_slot, pos, meta_ids, meta_w, n


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
    owner, ret_slot, pos, meta, _ = ep_route_tensors(
        ids.to(id_dtype).to(DEV), weights.to(DEV), E_local, R, C, block_t=block_t
    )
    w_owner, w_ret, w_pos, w_ids, w_w, n = reference(ids, weights, E_local, R, C)
    assert torch.equal(owner.cpu(), w_owner)
    assert torch.equal(ret_slot.cpu(), w_ret)
    assert torch.equal(pos.cpu(), w_pos)
    meta = meta.cpu()
    assert torch.equal(meta[..., :K], w_ids)
    got_w = meta[..., K:].contiguous().view(torch.float32).double()
    assert torch.equal(got_w, w_w)
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
    owner, ret_slot, pos, meta, _ = ep_route_tensors(ids, weights, E_local, R, C, block_t=8)
    monkeypatch.undo()
    for t in (owner, ret_slot, pos, meta[..., :K]):
        assert not (t == -77).any()
    _, w_ret, _, w_ids, _, _ = reference(ids.cpu(), weights.cpu(), E_local, R, C)
    assert torch.equal(ret_slot.cpu(), w_ret)
    assert torch.equal(meta[..., :K].cpu(), w_ids)
    for d in range(R):
        assert (meta[d, T:, K:] == 0).all()


def test_route_kernel_rejects_short_regions():
    ids = torch.zeros(5, 2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="do not fit"):
        ep_route_tensors(ids, torch.ones(5, 2, device=DEV), 2, 2, 4)


def reference_vectorized(ids, weights, E_local, R, C):
    """The route in vectorized torch ops (for shapes too big for the Python loop)."""
    ids = ids.long()
    T, K = ids.shape
    owner = torch.where(ids >= 0, torch.div(ids, E_local, rounding_mode="floor"), -1)
    goes = (owner.unsqueeze(0) == torch.arange(R, device=ids.device)[:, None, None]).any(2)
    pos_t = torch.where(goes, torch.arange(T, device=ids.device, dtype=torch.int32), -1)
    meta = torch.full((R, C, 2 * K), -1, dtype=torch.int32, device=ids.device)
    meta[..., K:] = 0
    wbits = weights.float().contiguous().view(torch.int32)
    for d in range(R):
        lid = torch.where(owner == d, ids - d * E_local, -1).to(torch.int32)
        meta[d, :T] = torch.cat([lid, torch.where(owner == d, wbits, 0)], 1)
    return owner, pos_t, meta


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
    owner, ret_slot, pos, meta, _ = ep_route_tensors(ids, weights, E_local, R, T)
    w_owner, w_pos_t, w_meta = reference_vectorized(ids, weights, E_local, R, T)
    assert torch.equal(owner, w_owner)
    assert torch.equal(pos, w_pos_t.t())
    assert torch.equal(meta[..., :K], w_meta[..., :K])
    assert torch.equal(meta[..., K:], w_meta[..., K:])
    own = owner.clamp(min=0)
    want_ret = (own * T + torch.arange(T, device="cuda")[:, None]) * K + torch.arange(K, device="cuda")
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
