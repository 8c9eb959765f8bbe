"""Expert parallelism of the reference backend: 2 gloo ranks vs one rank holding every expert.

Each rank owns half the experts and its own tokens; routing is uneven (one rank's experts get
most rows, some experts none, dropped slots). Outputs and every gradient must equal the
single-rank op on the concatenated tokens with all experts (float64: 1e-12 relative)."""

import torch
import torch.distributed as dist

from moe_testing import finish_rank, init_gloo, make_inputs, op_args, rel_err, run_ranks
from torchtitan_megamoe import mega_moe

R, T, K, E, D, H = 2, 13, 3, 6, 16, 12


def _inputs():
    g = torch.Generator().manual_seed(7)
    inp = make_inputs(R * T, K, E, D, H, dtype=torch.float64, generator=g)
    x, ids, w, w1, w2, w3 = op_args(inp)
    ids[ids == 4] = 1  # expert 4 (rank 1) empty; expert 1 (rank 0) heavy
    ids[:, 2] = torch.where(torch.rand(R * T, generator=g) < 0.4, -1, ids[:, 2])
    ids[T:, :] = torch.where(ids[T:, :] >= 3, ids[T:, :] - 3, ids[T:, :])  # rank 1 sends every row to rank 0
    return x, ids, w, w1, w2, w3, inp["dy"]


def _worker(rank, init_file, result_file):
    init_gloo(rank, R, init_file)
    x, ids, w, w1, w2, w3, dy = _inputs()
    mine = slice(rank * T, (rank + 1) * T)
    experts = slice(rank * E // R, (rank + 1) * E // R)
    leaves = [
        t.clone().requires_grad_()
        for t in (x[mine], w[mine], w1[experts], w2[experts], w3[experts])
    ]
    out = mega_moe(leaves[0], ids[mine], *leaves[1:], group=dist.group.WORLD, backend="reference")
    out.backward(dy[mine])
    torch.save([out.detach()] + [t.grad for t in leaves], f"{result_file}.{rank}")
    finish_rank()


def test_ep2_matches_single_rank():
    ranks = run_ranks(_worker, R)

    x, ids, w, w1, w2, w3, dy = _inputs()
    leaves = [t.clone().requires_grad_() for t in (x, w, w1, w2, w3)]
    out = mega_moe(leaves[0], ids, *leaves[1:], backend="reference")
    out.backward(dy)
    ep = [
        torch.cat([r[0] for r in ranks]),  # out: tokens concatenated
        torch.cat([r[1] for r in ranks]),  # dx
        torch.cat([r[2] for r in ranks]),  # dtopk_weights
        torch.cat([r[3] for r in ranks]),  # dw1: experts concatenated
        torch.cat([r[4] for r in ranks]),  # dw2
        torch.cat([r[5] for r in ranks]),  # dw3
    ]
    single = [out.detach()] + [t.grad for t in leaves]
    for name, a, b in zip(("out", "dx", "dw", "dw1", "dw2", "dw3"), ep, single):
        assert rel_err(a, b) < 1e-12, name


def _capacity_worker(rank, init_file, result_file):
    """Rank 0 brings T tokens, rank 1 five; capacity T - 3, then T."""
    init_gloo(rank, R, init_file)
    x, ids, w, w1, w2, w3, dy = _inputs()
    mine = slice(0, T) if rank == 0 else slice(T, T + 5)
    experts = slice(rank * E // R, (rank + 1) * E // R)
    args = (x[mine], ids[mine], w[mine], w1[experts], w2[experts], w3[experts])
    errors = []
    try:
        mega_moe(*args, group=dist.group.WORLD, backend="reference", max_tokens_per_rank=T - 3)
    except ValueError as e:
        errors.append(str(e))
    leaves = [t.clone().requires_grad_() for t in (args[0], *args[2:])]
    out = mega_moe(leaves[0], args[1], *leaves[1:], group=dist.group.WORLD, backend="reference",
                   max_tokens_per_rank=T)
    out.backward(dy[mine])
    torch.save([errors, out.detach()], f"{result_file}.{rank}")
    finish_rank()


def test_ep2_applies_max_tokens_per_rank_like_hopper():
    """A batch above max_tokens_per_rank fails on every rank (also the one within it, which
    would otherwise wait in the exchange), naming the value needed; one within it runs."""
    ranks = run_ranks(_capacity_worker, R)
    for errors, out in ranks:
        assert len(errors) == 1, errors
        assert f"rank 0 of the group has {T} tokens but the EP exchange takes at most {T - 3}" \
            in errors[0]
        assert f"max_tokens_per_rank (mega_moe(max_tokens_per_rank=...)) to at least {T}" \
            in errors[0]
        assert torch.isfinite(out).all()
    assert [r[1].shape[0] for r in ranks] == [T, 5]
