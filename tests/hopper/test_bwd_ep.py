"""EP=2 backward of backend ``triton`` (2 gloo ranks, kernels under the interpreter) vs float64
autograd of one rank holding every expert and every token."""

from torchtitan_megamoe.ops.options import MegaMoEOptions
import pytest
import torch
import torch.distributed as dist

from moe_testing import (
    NAMES, finish_rank, grads_f64, make_inputs, make_weights, rel_err, run_ranks, same_bits,
)

R, T, K, E, D, H = 2, 11, 3, 6, 32, 16  # multiples of 16: the recompute runs GEMM 1


def _inputs():
    g = torch.Generator().manual_seed(11)
    inp = make_inputs(R * T, K, E, D, H, generator=g)
    ids = inp["topk_ids"]
    ids[ids == 4] = 1  # expert 4 (rank 1) empty, expert 1 (rank 0) heavy
    ids[:, 2] = torch.where(torch.rand(R * T, generator=g) < 0.4, -1, ids[:, 2])
    ids[T:] = torch.where(ids[T:] >= 3, ids[T:] - 3, ids[T:])  # rank 1 sends every row to rank 0
    return inp


def _worker(rank, init_file, result_file):
    from torchtitan_megamoe.ops.hopper import backward

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=R)
    inp = _inputs()
    mine = slice(rank * T, (rank + 1) * T)
    experts = slice(rank * E // R, (rank + 1) * E // R)
    args = (inp["dy"][mine], inp["x"][mine], inp["topk_ids"][mine], inp["topk_weights"][mine],
            inp["w1"][experts], inp["w2"][experts], inp["w3"][experts], dist.group.WORLD, MegaMoEOptions(precision="bf16"))
    first = backward(*args)
    second = backward(*args)
    torch.save([first, all(same_bits(a, b) for a, b in zip(first, second))],
               f"{result_file}.{rank}")
    finish_rank()


def test_ep2_backward_matches_single_rank_f64():
    ranks = run_ranks(_worker, R)
    assert all(r[1] for r in ranks), "two runs on the same inputs differ"
    ref = grads_f64(_inputs())
    for i, name in enumerate(NAMES):
        got = torch.cat([r[0][i] for r in ranks])
        assert got.dtype == (torch.float32 if name == "dtopk_weights" else torch.bfloat16), name
        err = rel_err(got, ref[i])
        assert err <= 1e-2, f"{name}: rel err {err:.2e}"
    ids = _inputs()["topk_ids"]
    dtw = torch.cat([r[0][1] for r in ranks])
    assert (dtw[ids < 0] == 0).all()
    # Rank 1's experts 3..5: expert 4 gets no rows, so its gradients are exactly zero.
    for i in (2, 3, 4):
        assert (ranks[1][0][i][1] == 0).all()


# ----------------------------------------------------------------------------- 2 GPUs, real shape


def _gpu_worker(rank, init_file, result_file):
    from torchtitan_megamoe.ops import reference
    from torchtitan_megamoe.ops.hopper import backward

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=R)
    T_, K_, E_, D_, H_ = 16384, 8, 128, 2048, 768  # Qwen3-30B-A3B layer, 64 experts per rank
    El = E_ // R
    g = torch.Generator(device="cuda").manual_seed(100 + rank)
    x = torch.randn(T_, D_, device="cuda", generator=g).bfloat16()
    dy = torch.randn(T_, D_, device="cuda", generator=g).bfloat16()
    w1, w2, w3 = make_weights(El, D_, H_, device="cuda",
                              generator=torch.Generator(device="cuda").manual_seed(rank))
    logits = torch.randn(E_, device="cuda", generator=g) * 1.5
    logits[5] = float("-inf")  # one empty expert
    ids = torch.multinomial(torch.softmax(logits, 0).expand(T_, E_), K_, generator=g)
    ids[::17, -1] = -1
    tw = torch.softmax(torch.randn(T_, K_, device="cuda", generator=g), -1)
    args = (dy, x, ids, tw, w1, w2, w3, dist.group.WORLD, MegaMoEOptions(precision="bf16"))
    got = backward(*args)
    ref = reference.backward(*args)
    errs = [rel_err(a, b) for a, b in zip(got, ref)]
    same = all(same_bits(a, b) for a, b in zip(got, backward(*args)))
    torch.save([errs, same], f"{result_file}.{rank}")
    finish_rank()


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_ep2_backward_30b_shape_vs_reference_gpu():
    ranks = run_ranks(_gpu_worker, R)
    for r, (errs, same) in enumerate(ranks):
        assert same, f"rank {r}: two runs differ"
        for name, err in zip(NAMES, errs):
            assert err <= 1e-2, f"rank {r} {name}: rel err {err:.2e}"
