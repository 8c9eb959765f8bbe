"""The EP token exchange: its sum kernel (sum_partials) against plain indexing,
and the protocol on 2 gloo ranks (all_to_all transport) with unequal batches and the capacity
error; on 2 GPUs, that the symmetric-memory transport is the one used and agrees with float64."""

from torchtitan_megamoe.ops.options import MegaMoEOptions
import pytest
import torch
import torch.distributed as dist

from moe_testing import finish_rank, make_inputs, moe_f64, op_args, rel_err, run_ranks
from torchtitan_megamoe.ops.hopper.kernels.sum_partials import sum_partials

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_sum_partials_fp32_rank_order_skips_absent_ranks():
    g = torch.Generator().manual_seed(2)
    R, C, D, T = 3, 10, 24, 9
    part = torch.full((R, C, D), float("nan")).bfloat16()  # rows nobody points at: never read
    pos = torch.full((T, R), -1, dtype=torch.int32)
    for r in range(R):
        takers = [t for t in range(T) if t != 3 and (r != 1 or t % 2)]  # token 3 went nowhere
        pos[takers, r] = torch.arange(len(takers) - 1, -1, -1, dtype=torch.int32)  # any order
        part[r, : len(takers)] = torch.randn(len(takers), D, generator=g).bfloat16()
    got = sum_partials(part.to(DEV), pos.to(DEV), torch.bfloat16).cpu()
    want = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        for r in range(R):
            if pos[t, r] >= 0:
                want[t] += part[r, pos[t, r]].double()
    assert not got.isnan().any()
    assert torch.equal(got, want.float().bfloat16()) or rel_err(got, want) < 4e-3
    assert (got[3] == 0).all()


# ------------------------------------------------------------------ protocol on 2 gloo ranks

R, K, E, D, H = 2, 3, 6, 32, 16
T_RANK = (9, 4)  # unequal batches: capacity is the group's largest


def _inputs(seed=7):
    T = sum(T_RANK)
    x, ids, w, w1, w2, w3 = op_args(make_inputs(T, K, E, D, H, seed=seed))
    ids[2] = torch.tensor([0, 1, 2])  # a token whose experts are all on rank 0
    ids[3] = -1  # a token with every slot dropped
    ids[T_RANK[0]:, 0] = 5  # every rank-1 token uses rank 1's expert 5
    return x, ids, w, w1, w2, w3


def _gloo_worker(rank, init_file, result_file):
    from torchtitan_megamoe.ops import hopper as tb
    from torchtitan_megamoe.ops.hopper.ep_transport import AllToAllExchange, _CACHE

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=R)
    x, ids, w, w1, w2, w3 = _inputs()
    start = sum(T_RANK[:rank])
    mine = slice(start, start + T_RANK[rank])
    experts = slice(rank * E // R, (rank + 1) * E // R)
    args = [x[mine], ids[mine], w[mine], w1[experts], w2[experts], w3[experts]]
    out = tb.forward(*args, dist.group.WORLD, MegaMoEOptions(precision="bf16"))
    out = out[0] if isinstance(out, tuple) else out
    (ex,) = _CACHE.values()
    transport = (type(ex) is AllToAllExchange, ex.capacity)
    # More tokens than the exchange was sized for (both ranks: 27 and 12 > 9): a clear error
    # before anything is sent.
    big = [torch.cat([a, a, a]) for a in args[:3]] + args[3:]
    try:
        tb.forward(*big, dist.group.WORLD, MegaMoEOptions(precision="bf16"))
        error = ""
    except ValueError as e:
        error = str(e)
    # A later call with fewer tokens and another routing reuses the same buffers: rows and
    # metadata of the first call still sit in the regions and must not leak into this one.
    x2, ids2, w2_, *_ = _inputs(seed=8)
    n2 = (2, 3)[rank]
    start2 = sum((2, 3)[:rank])
    later = [t[start2:start2 + n2] for t in (x2, ids2, w2_)] + args[3:]
    out2 = tb.forward(*later, dist.group.WORLD, MegaMoEOptions(precision="bf16"))
    torch.save([out, transport, error, out2], f"{result_file}.{rank}")
    finish_rank()


def _capacity_worker(rank, init_file, result_file):
    from torchtitan_megamoe.ops import hopper as tb
    from torchtitan_megamoe.ops.hopper.ep_transport import _CACHE

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=R)
    x, ids, w, w1, w2, w3 = _inputs()
    start = sum(T_RANK[:rank])
    mine = slice(start, start + T_RANK[rank])
    experts = slice(rank * E // R, (rank + 1) * E // R)
    args = [x[mine], ids[mine], w[mine], w1[experts], w2[experts], w3[experts]]
    opts = MegaMoEOptions(precision="bf16", max_tokens_per_rank=3 * max(T_RANK))
    big = [torch.cat([a, a, a]) for a in args[:3]] + args[3:]
    tb.forward(*args, dist.group.WORLD, opts)
    tb.forward(*big, dist.group.WORLD, opts)  # within the capacity the options set
    (ex,) = _CACHE.values()
    torch.save(ex.capacity, f"{result_file}.{rank}")
    finish_rank()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gloo/interpreter variant is for CPU")
def test_ep2_capacity_from_the_options():
    """MegaMoEOptions.max_tokens_per_rank sizes the exchange, not the first call's batch."""
    assert run_ranks(_capacity_worker, R) == [3 * max(T_RANK)] * R


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gloo/interpreter variant is for CPU")
def test_ep2_exchange_unequal_batches_and_capacity_error():
    ranks = run_ranks(_gloo_worker, R)
    x, ids, w, w1, w2, w3 = _inputs()
    got = torch.cat([r[0] for r in ranks])
    ref = moe_f64(x, ids, w, w1, w2, w3)
    assert rel_err(got, ref) < 1e-2
    assert (got[3] == 0).all()
    x2, ids2, w2_, *_ = _inputs(seed=8)
    got2 = torch.cat([r[3] for r in ranks])
    assert rel_err(got2, moe_f64(x2[:5], ids2[:5], w2_[:5], w1, w2, w3)) < 1e-2
    for r, (_, (is_a2a, capacity), error, _) in enumerate(ranks):
        assert is_a2a and capacity == max(T_RANK), (r, capacity)
    for r, n in enumerate(T_RANK):
        assert "max_tokens_per_rank" in ranks[r][2] and f"{3 * n} tokens" in ranks[r][2]


# ------------------------------------------------------------------ 2 GPUs: symmetric memory


def _nccl_worker(rank, init_file, result_file):
    from torchtitan_megamoe.ops import hopper as tb
    from torchtitan_megamoe.ops.hopper.ep_transport import SymmetricExchange, _CACHE

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=R)
    Tg, Kg, Eg, Dg, Hg = 200, 8, 16, 256, 128
    x, ids, w, w1, w2, w3 = op_args(make_inputs(R * Tg, Kg, Eg, Dg, Hg, seed=3))
    ids[::7, 1] = -1
    ref = moe_f64(x[rank * Tg:(rank + 1) * Tg], ids[rank * Tg:(rank + 1) * Tg],
                  w[rank * Tg:(rank + 1) * Tg], w1, w2, w3)
    mine = slice(rank * Tg, (rank + 1) * Tg)
    ex_ = slice(rank * Eg // R, (rank + 1) * Eg // R)
    args = [t.cuda() for t in (x[mine], ids[mine], w[mine], w1[ex_], w2[ex_], w3[ex_])]
    outs = [tb.forward(*args, dist.group.WORLD, MegaMoEOptions(precision="bf16")) for _ in range(3)]
    outs = [o[0] if isinstance(o, tuple) else o for o in outs]
    symm = all(type(e) is SymmetricExchange for e in _CACHE.values())
    same = all(torch.equal(outs[0], o) for o in outs[1:])
    torch.save([rel_err(outs[0].cpu(), ref), symm, same], f"{result_file}.{rank}")
    finish_rank()


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_ep2_symmetric_memory_exchange_gpu():
    ranks = run_ranks(_nccl_worker, R)
    for r, (err, symm, same) in enumerate(ranks):
        assert symm, f"rank {r}: the symmetric-memory transport was not used"
        assert same, f"rank {r}: repeated calls differ"
        assert err < 1e-2, f"rank {r}: rel err {err:.2e}"


def test_capacity_hint_and_knob(monkeypatch):
    """What fake impls assume the capacity is: the group's exchange's, else the knob, else T."""
    from torchtitan_megamoe.ops.hopper import ep_transport as exchange

    class Group:
        group_name = "g"

    monkeypatch.setattr(exchange, "_CACHE", {})
    assert exchange.capacity_hint(Group(), 300) == 300
    assert exchange.capacity_hint(Group(), 300, max_tokens_per_rank=512) == 512

    class Existing:
        group = Group()
        capacity = 1024

    monkeypatch.setattr(exchange, "_CACHE", {("g",): Existing()})
    assert exchange.capacity_hint(Group(), 300) == 1024
