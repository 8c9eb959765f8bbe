"""The op end to end at EP=2 on 2 gloo ranks (kernels under the interpreter): mega_moe(...,
group, backend="hopper") forward + autograd backward, at a shape where the EP forward keeps
GEMM 1's pre-activations of every region (ep_forward.keeps_saved), so the backward's
re-dispatch must reproduce that layout exactly; gradients vs float64 of one rank holding all."""

import functools

import pytest
import torch
import torch.distributed as dist

from moe_testing import NAMES, finish_rank, grads_f64, make_inputs, rel_err, run_ranks

R, T, K, E, D, H = 2, 40, 2, 6, 64, 16


def _inputs():
    inp = make_inputs(R * T, K, E, D, H, seed=21)
    ids = inp["topk_ids"]
    ids[::5, 1] = -1
    ids[T:T + 8] = torch.tensor([4, -1])  # some of rank 1's tokens only to its own expert
    return inp


def _worker(rank, init_file, result_file):
    from torchtitan_megamoe import mega_moe
    from torchtitan_megamoe.ops.hopper import ep_forward

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=R)
    inp = _inputs()
    mine = slice(rank * T, (rank + 1) * T)
    ex = slice(rank * E // R, (rank + 1) * E // R)
    leaves = [inp["x"][mine].clone().requires_grad_(), inp["topk_weights"][mine].clone().requires_grad_()]
    ws = [inp[n][ex].clone().requires_grad_() for n in ("w1", "w2", "w3")]
    real = ep_forward.build_plans
    # the plan kernels' batched layout, as on CUDA: the saved packed plans are rows of one tensor
    ep_forward.build_plans = functools.partial(real, use_kernels=True)
    try:
        out = mega_moe(leaves[0], inp["topk_ids"][mine], leaves[1], *ws,
                       group=dist.group.WORLD, backend="hopper")
        out.backward(inp["dy"][mine])
    finally:
        ep_forward.build_plans = real
    grads = [leaves[0].grad, leaves[1].grad, *(w.grad for w in ws)]
    # what compile's fake impl allocates (saved_like) matches what the forward saves
    from torchtitan_megamoe.ops import hopper
    from torchtitan_megamoe.ops.options import MegaMoEOptions

    args = (inp["x"][mine], inp["topk_ids"][mine], inp["topk_weights"][mine],
            *(w.detach() for w in ws), dist.group.WORLD, MegaMoEOptions(precision="bf16"))
    _, saved = hopper.forward(*args, save=True)
    like = hopper.saved_like(*args)
    # a custom op's outputs may not alias (torch checks it on CUDA): one storage per tensor
    assert len({t.untyped_storage().data_ptr() for t in saved}) == len(saved)
    shapes = [[(tuple(t.shape), t.dtype) for t in ts] for ts in (saved, like)]
    torch.save([grads, shapes], f"{result_file}.{rank}")
    finish_rank()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant is for CPU")
def test_ep2_op_saved_receive_layout_backward_matches_f64():
    from torchtitan_megamoe.ops.hopper.ep_forward import keeps_saved
    from torchtitan_megamoe.ops.hopper.tiles import plan_block_m

    block_m = plan_block_m()
    assert keeps_saved(R, T, K, E // R, D, H, block_m), "pick a shape that keeps the saved tensors"
    ranks = run_ranks(_worker, R)
    for r in ranks:  # the saved path taken: (store, [R, N] packed plans) as the fake impl
        got, like = r[1]
        assert got == like and len(got) == 2 and got[1][0][0] == R, (got, like)
    ref = grads_f64(_inputs())
    got = [torch.cat([r[0][i] for r in ranks]) for i in range(2)]
    got += [torch.cat([r[0][i] for r in ranks]) for i in range(2, 5)]  # expert slices in order
    for name, g, r in zip(NAMES, got, ref):
        assert torch.isfinite(g.float()).all(), name
        assert rel_err(g, r) <= 1e-2, f"{name}: rel err {rel_err(g, r):.2e}"
