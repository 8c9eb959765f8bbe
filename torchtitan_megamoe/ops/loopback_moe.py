"""mega_moe at EP=R as R loopback ranks in one process (ops/loopback.py): what tests and the bench
call to run the real expert-parallel path on one device.

``shard`` cuts one batch with all experts into R ranks' shares (rank r: its tokens, experts
``[r*E_local, (r+1)*E_local)``); ``loopback_moe`` runs the op on every rank, forward and,
given ``grad_outs``, backward.
"""

from __future__ import annotations

import torch

from torchtitan_megamoe.ops.loopback import run_ranks
from torchtitan_megamoe.ops.options import MegaMoEOptions


def shard(R: int, x, topk_ids, topk_weights, w1, w2, w3, tokens=None) -> list[tuple]:
    """R tuples (x, topk_ids, topk_weights, w1, w2, w3) of each rank; ``tokens``: the ranks'
    token counts (default: T/R each), global expert ids kept."""
    T, E = x.shape[0], w1.shape[0]
    if E % R:
        raise ValueError(f"loopback: {E} experts do not split over {R} ranks")
    tokens = tokens or [T // R] * R
    if sum(tokens) != T or len(tokens) != R:
        raise ValueError(f"loopback: token counts {tokens} do not split {T} tokens over {R} ranks")
    starts = [sum(tokens[:r]) for r in range(R)]
    el = E // R
    return [(x[s:s + n], topk_ids[s:s + n], topk_weights[s:s + n],
             w1[r * el:(r + 1) * el], w2[r * el:(r + 1) * el], w3[r * el:(r + 1) * el])
            for r, (s, n) in enumerate(zip(starts, tokens))]


def _rank_step(group, args, grad_out, autograd, options):
    x, ids, w, w1, w2, w3 = args
    if grad_out is None:
        with torch.no_grad():
            return (torch.ops.megamoe.mega_moe(*args, [], [], False, group.group_name,
                                               *MegaMoEOptions.of(**options).op_args())[0],)
    if autograd:
        from torchtitan_megamoe.ops.api import mega_moe

        leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in args]
        out = mega_moe(*leaves, group=group, **options)
        out.backward(grad_out)
        return (out.detach(), *(leaves[i].grad for i in (0, 2, 3, 4, 5)))
    # the forward op by name and the backward as the op's eager autograd backward runs it
    # (its saved tensors are this call's alone: release_saved), on this rank's thread (on CUDA
    # autograd's device thread is not a rank thread)
    from torchtitan_megamoe.ops.api import _run_backward

    opts = MegaMoEOptions.of(**options)
    out, saved = torch.ops.megamoe.mega_moe(*args, [], [], True, group.group_name, *opts.op_args())
    grads = _run_backward(grad_out, *args, None, saved, group.group_name, opts,
                          release_saved=True)
    return (out, *grads)


def loopback_moe(shards, grad_outs=None, *, device=None, autograd=None, **options) -> list[tuple]:
    """Per rank: (out,) or, with ``grad_outs`` (one per rank), (out, dx, dtopk_weights, dw1,
    dw2, dw3). ``autograd``: run the backward with ``out.backward`` (default on CPU) or the
    op's eager backward on the rank's thread (default on CUDA, see _rank_step); ``options``:
    mega_moe's, e.g. backend="hopper", precision="bf16"."""
    R = len(shards)
    device = torch.device(device) if device is not None else shards[0][0].device
    if autograd is None:
        autograd = device.type != "cuda"
    options.setdefault("backend", "hopper")
    return run_ranks(R, lambda g: _rank_step(
        g, shards[g.rank], None if grad_outs is None else grad_outs[g.rank], autograd, options),
        device)
