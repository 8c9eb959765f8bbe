"""Expert-parallel (EP > 1) backward: the forward's token exchange (ep_dispatch.py), run again
for dy and x, around the EP=1 backward:

    1. dy (with the metadata: local expert ids and weights) goes to every rank owning one of a
       token's experts (same rows as in the forward: the layout depends only on topk_ids); with
       FP8 data gradients (recipe.fp8_dgrad) as e4m3 rows with their 1x128 scales, the
       quantization the FP8 dgrad GEMMs apply anyway, at about half the bytes; the weight
       gradients then read their dequantized values. x follows in bf16 (the weight gradients
       read it unrounded), on the side stream under dgrad2_swiglu and wgrad_dw2 in bf16, which
       do not read it (with the forward's saved pre-activations; without them GEMM 1 is
       recomputed first and waits);
    2. the EP=1 backward (bf16_backward.backward_bf16, or fp8_backward.backward_fp8) runs on the
       R*C received tokens: dw1/dw2/dw3 of this rank's experts are complete there (every row of
       its experts arrives), and a received token's dx row is its partial over this rank's
       experts;
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
from torchtitan_megamoe.ops.hopper.ep_dispatch import FP8_ROWS, TokenRoute
from torchtitan_megamoe.ops.hopper.fp8_backward import backward_fp8
from torchtitan_megamoe.ops.hopper.kernels.fp8_quant import FP8, dequant_rows, quant_rows


def backward_ep(grad_out, x, topk_ids, topk_weights, w1, w2, w3, group, recipe,
                max_tokens_per_rank=0, saved=None, weight_cache=False):
    """(dx, dtopk_weights, dw1, dw2, dw3) for an EP group; ``saved``: what
    forward_ep(..., save=True) kept (receive layout), None or empty to recompute; ``recipe``
    and ``weight_cache`` as in forward_ep."""
    route = TokenRoute(topk_ids, topk_weights, w1.shape[0], group, x.shape[1], x.dtype, recipe,
                       max_tokens_per_rank=max_tokens_per_rank)
    if recipe.fp8_dgrad:
        gq, gs = quant_rows(grad_out.contiguous())
        route.dispatch({"dyq": gq.view(FP8_ROWS), "dys": gs}, "dispatch dy")
    else:
        route.dispatch({"dy": grad_out.contiguous()}, "dispatch dy")
    x_sent = route.dispatch_async({"x": x.contiguous()}, "dispatch x")
    ids, weights = route.received()
    if recipe.fp8_dgrad:
        route.wait(x_sent)  # the FP8 backward reads x from its first stage on
        rows_q, rows_s = route.recv_rows("dyq").view(FP8), route.recv_rows("dys")
        dx_part, dtw_part, dw1, dw2, dw3 = backward_fp8(
            dequant_rows(rows_q, rows_s), route.recv_rows("x"), ids, weights, w1, w2, w3,
            recipe, weight_cache, saved=saved, grad_fp8=(rows_q, rows_s),
        )
    else:
        dx_part, dtw_part, dw1, dw2, dw3 = backward_bf16(
            route.recv_rows("dy"), route.recv_rows("x"), ids, weights, w1, w2, w3, saved=saved,
            wait_x=lambda: route.wait(x_sent),
        )
    route.wait(x_sent)  # also when the backward had nothing to compute
    route.give_back({"ret": dx_part, "dtw": dtw_part.to(torch.float32).contiguous()},
                    "return dx")
    dx = route.sum_returned("ret", x.dtype)
    return dx, route.pick_returned_dtw(topk_weights.dtype), dw1, dw2, dw3
