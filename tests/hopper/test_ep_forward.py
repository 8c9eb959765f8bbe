"""EP=2 forward of backend ``triton`` (2 gloo ranks on CPU, kernels under the interpreter; or 2
GPUs with NCCL, marked multigpu) against float64 math of one rank holding every expert; and 3
gloo ranks, where each rank returns rows to two peers."""

from torchtitan_megamoe.ops.options import MegaMoEOptions
import pytest
import torch
import torch.distributed as dist

from moe_testing import finish_rank, make_inputs, moe_f64, op_args, rel_err, run_ranks

R = 2


def _inputs(T, K, E, D, H, seed=5, world=R):
    g = torch.Generator().manual_seed(seed)
    x, ids, w, w1, w2, w3 = op_args(make_inputs(world * T, K, E, D, H, generator=g))
    local = E // world
    ids[ids == local + 1] = 1  # one of rank 1's experts empty, one of rank 0's heavy
    ids[:, -1] = torch.where(torch.rand(world * T, generator=g) < 0.4, -1, ids[:, -1])
    # rank 1 sends all to rank 0 (at 3 ranks: to ranks 0 and 2)
    ids[T:2 * T] = torch.where((ids[T:2 * T] >= local) & (ids[T:2 * T] < 2 * local),
                               ids[T:2 * T] - local, ids[T:2 * T])
    w[ids < 0] = float("nan")  # dropped slots must not leak
    return x, ids, w, w1, w2, w3


def _worker(rank, backend, shape, world, init_file, result_file):
    from torchtitan_megamoe.ops import hopper as tb

    dev = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        dev = f"cuda:{rank}"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    T, K, E, D, H = shape
    x, ids, w, w1, w2, w3 = _inputs(*shape, world=world)
    mine = slice(rank * T, (rank + 1) * T)
    experts = slice(rank * E // world, (rank + 1) * E // world)
    args = [t.to(dev) for t in (x[mine], ids[mine], w[mine], w1[experts], w2[experts], w3[experts])]
    out = tb.forward(*args, dist.group.WORLD, MegaMoEOptions(precision="bf16"))
    again = tb.forward(*args, dist.group.WORLD, MegaMoEOptions(precision="bf16"))
    torch.save([out.cpu(), torch.equal(out, again)], f"{result_file}.{rank}")
    finish_rank()


def _run(backend, shape, world=R):
    ranks = run_ranks(_worker, world, backend, shape, world)
    assert all(r[1] for r in ranks), "two runs on the same inputs differ"
    got = torch.cat([r[0] for r in ranks])
    x, ids, w, w1, w2, w3 = _inputs(*shape, world=world)
    ref = moe_f64(x, ids, w, w1, w2, w3)
    assert not got.isnan().any()
    assert rel_err(got, ref) < 1e-2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gloo/interpreter variant is for CPU")
def test_ep2_forward_gloo_matches_single_rank_f64():
    _run("gloo", (9, 3, 6, 32, 16))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gloo/interpreter variant is for CPU")
def test_ep3_forward_gloo_matches_single_rank_f64():
    """Three ranks: every rank stages and returns the partial rows of two peers."""
    _run("gloo", (7, 3, 6, 32, 16), world=3)


@pytest.mark.multigpu
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_ep2_forward_nccl_matches_single_rank_f64():
    _run("nccl", (96, 8, 16, 256, 128))
