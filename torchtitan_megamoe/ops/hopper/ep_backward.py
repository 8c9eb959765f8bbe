"""Expert-parallel (EP > 1) backward: the forward's token exchange (ep_dispatch.py), run again
for dy and x, around the EP=1 backward of each source region in turn (as the forward,
ep_forward.py):

    current stream                            side stream (symmetric memory only)
    route kernels; counts and meta -> every
    rank; own dy and x -> own region
                                              dy rows, then x rows -> the peers they go to;
                                              barrier (channel 1) -> rows_arrived
    barrier (channel 0): metadata everywhere
    own region: EP=1 backward (its rows are
    here), dx and d(topk_weights) into its
    own return regions
    wait rows_arrived
    for each peer s: EP=1 backward of region s
                                              its dx and d(topk_weights) rows -> s's regions
    wait for the side stream; barrier (channel 0): every returned row is home
    dx = sum of the ranks' partial rows (fp32, rank order); d(topk_weights) from the owners

So dy and x travel under the own region's backward, and each region's dx under the next
region's. dy travels as e4m3 rows with their 1x128 scales when the recipe's data gradients are
FP8 (the quantization those GEMMs apply anyway; the weight gradients read the dequantized
values, as the reference backend does at EP > 1); x travels in bf16 (the weight gradients read
it unrounded). Each region's weight gradients are computed in fp32 (fp32 stand-ins as the
gradients' "parameters") and summed in region order 0..R-1, then rounded once: the same
precision as one GEMM over all rows, deterministic. No host sync.

Memory per call: the EP=1 backward's transients for ONE region of C tokens (reused region
after region), the fp32 weight-gradient sums and one region's fp32 weight gradients (2 x the
local experts' weights in fp32), and the staged dx rows, [C, D] per peer until sent.
"""

import torch

from torchtitan_megamoe.ops.hopper.bf16_backward import backward_bf16
from torchtitan_megamoe.ops.hopper.ep_dispatch import FP8_ROWS, TokenRoute
from torchtitan_megamoe.ops.hopper.ep_forward import region_order
from torchtitan_megamoe.ops.hopper.fp8_backward import backward_fp8
from torchtitan_megamoe.ops.hopper.kernels.fp8_quant import FP8, dequant_rows, quant_rows


def backward_ep(grad_out, x, topk_ids, topk_weights, w1, w2, w3, group, recipe,
                max_tokens_per_rank=0, saved=None, weight_cache=False):
    """(dx, dtopk_weights, dw1, dw2, dw3) for an EP group; ``saved``: what
    forward_ep(..., save=True) kept (per region), None or empty to recompute; ``recipe`` and
    ``weight_cache`` as in forward_ep."""
    route = TokenRoute(topk_ids, topk_weights, w1.shape[0], group, x.shape[1], x.dtype, recipe,
                       max_tokens_per_rank=max_tokens_per_rank)
    ex, R, C, me = route.ex, route.R, route.C, route.me
    if recipe.fp8_dgrad:
        gq, gs = quant_rows(grad_out.contiguous())
        dy_rows = {"dyq": gq.view(FP8_ROWS), "dys": gs}
    else:
        dy_rows = {"dy": grad_out.contiguous()}
    x_rows = {"x": x.contiguous()}
    route.send_meta("dispatch dy")
    route.send_own({**dy_rows, **x_rows})

    def send_peers():
        route.send_peers(dy_rows, "dispatch dy")
        route.send_peers(x_rows, "dispatch x")

    if ex.overlaps:
        arrived = ex.run_async(send_peers, barrier=True), (dy_rows, x_rows)
        ex.exchange(["cnt", "meta"])
    else:
        send_peers()
        ex.exchange(["cnt", "meta", *dy_rows, *x_rows])
        arrived = None
    ids, weights = route.received()
    stand_ins = tuple(torch.zeros((), dtype=torch.float32, device=w.device).expand(w.shape)
                      for w in (w1, w2, w3))
    sums, sends = None, []
    for s in region_order(R, me):
        rows = slice(s * C, (s + 1) * C)
        wait = None if s == me else (lambda: route.wait(arrived))
        region_saved = list(saved[2 * s:2 * s + 2]) if saved else None
        if recipe.fp8_dgrad:
            if wait is not None:
                wait()  # the FP8 backward reads dy and x from its first stage on
            q, sc = route.recv_rows("dyq")[rows].view(FP8), route.recv_rows("dys")[rows]
            dx_s, dtw_s, *dws = backward_fp8(
                dequant_rows(q, sc), route.recv_rows("x")[rows], ids[rows], weights[rows], w1,
                w2, w3, recipe, weight_cache, saved=region_saved, grad_fp8=(q, sc),
                grad_params=stand_ins)
        else:
            if wait is not None:
                wait()  # dy is read first (x only from wgrad_dw13 on)
            dx_s, dtw_s, *dws = backward_bf16(
                route.recv_rows("dy")[rows], route.recv_rows("x")[rows], ids[rows],
                weights[rows], w1, w2, w3, saved=region_saved, grad_params=stand_ins)
        # summed in this rank's fixed region order: the same sums on every call
        sums = dws if sums is None else [acc.add_(g) for acc, g in zip(sums, dws)]
        del dws
        back = {"ret": dx_s, "dtw": dtw_s.to(torch.float32).contiguous()}
        if s == me or not ex.overlaps:
            route.return_rows(s, back)
        else:
            def send(s=s, back=back):
                for t in back.values():
                    t.record_stream(torch.cuda.current_stream(x.device))  # used on this stream
                route.return_rows(s, back)

            sends.append(ex.run_async(send))
    route.count_returned(x.shape[1] * x.element_size() + 4 * route.K, "return dx")
    if sends:
        torch.cuda.current_stream(x.device).wait_event(sends[-1])
    ex.exchange(["ret", "dtw"])
    dx = route.sum_returned("ret", x.dtype)
    dws = [acc.to(w.dtype) for acc, w in zip(sums, (w1, w2, w3))]
    return dx, route.pick_returned_dtw(topk_weights.dtype), *dws
