"""Expert-parallel (EP > 1) backward: the forward's token exchange (ep_dispatch.py), run again
for x and dy, around the EP=1 bf16 backward:

    1. dy (with the metadata: local expert ids and weights) goes to every rank owning one of a
       token's experts (same rows as in the forward: the layout depends only on topk_ids);
       x follows on the side stream, under dgrad2_swiglu and wgrad_dw2, which do not read it
       (with the forward's saved pre-activations; without them GEMM 1 is recomputed first and
       waits);
    2. the EP=1 backward (bf16_backward.backward_bf16) runs on the R*C received tokens: dw1/dw2/dw3
       of this rank's experts are complete there (every row of its experts arrives), and a
       received token's dx row is its partial over this rank's experts;
    3. dx partial rows and d(topk_weights) rows go back to the source's regions; the source sums
       the dx partials in fp32, fixed rank order, and takes each slot's d(topk_weight) from the
       rank owning its expert.
No host sync. The return (3) is not overlapped: sending dx under dw1/dw3 would keep dx alive
through them for no measurable gain.
Memory per call: the EP=1 backward's transients for R*C tokens, plus the dx partial rows
[R*C, D] and d(topk_weights) [R*C, K].
"""

import torch

from torchtitan_megamoe.ops.hopper.bf16_backward import backward_bf16
from torchtitan_megamoe.ops.hopper.ep_dispatch import TokenRoute


def backward_ep(grad_out, x, topk_ids, topk_weights, w1, w2, w3, group, max_tokens_per_rank=0,
                saved=None):
    """(dx, dtopk_weights, dw1, dw2, dw3) for an EP group; ``saved``: what
    forward_ep(..., save=True) kept (receive layout), None or empty to recompute."""
    route = TokenRoute(topk_ids, topk_weights, w1.shape[0], group, x.shape[1], x.dtype,
                       max_tokens_per_rank=max_tokens_per_rank)
    route.dispatch({"dy": grad_out.contiguous()})
    x_sent = route.dispatch_async({"x": x.contiguous()})
    ids, weights = route.received()
    dx_part, dtw_part, dw1, dw2, dw3 = backward_bf16(
        route.recv_rows("dy"), route.recv_rows("x"), ids, weights, w1, w2, w3, saved=saved,
        wait_x=lambda: route.wait(x_sent),
    )
    route.wait(x_sent)  # also when backward_bf16 had nothing to compute
    route.give_back({"ret": dx_part, "dtw": dtw_part.to(torch.float32).contiguous()})
    dx = route.sum_returned("ret", x.dtype)
    return dx, route.pick_returned_dtw(topk_weights.dtype), dw1, dw2, dw3
