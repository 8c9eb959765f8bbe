"""Expert-parallel (EP > 1) backward: the forward's token exchange (ep_dispatch.py), run again
for dy and x, around the EP=1 backward of each source region in turn (as the forward,
ep_forward.py):

    current stream                            side stream (symmetric memory only)
    route kernels; counts and meta -> every
    rank; own dy and x -> own region
                                              for d = me-1, me-2, ...: dy and x rows -> d,
                                              signal d
    barrier (channel 0): metadata everywhere
    own region: EP=1 backward (its rows are
    here), dx and d(topk_weights) into its
    own return regions
    for each peer s = me+1, me+2, ...: wait
    for s's signal; EP=1 backward of region s
    (dx and d(topk_weights) before wgrad_dw13)
                                              its dx and d(topk_weights) rows -> s's regions
    wait for the side stream; barrier (channel 0): every returned row is home
    dx = sum of the ranks' partial rows (fp32, rank order); d(topk_weights) from the owners

So dy and x travel under the regions computed before theirs (shift order, as in the forward),
and each region's dx under its own wgrad_dw13 (dw1 and dw3: a quarter to a third of its GEMM
work) and the regions after it: the last region's return is hidden too. dy travels as e4m3
rows with their 1x128 scales when the recipe's data gradients are FP8 (the quantization those
GEMMs apply anyway; the weight gradients read the dequantized values, as the reference backend
does at EP > 1, dequantized in dw2's row gather); x travels in bf16 (the weight gradients read
it unrounded). The weight gradients are fp32 sums over the regions in order 0..R-1: the first
region's GEMMs write them, each later one's add to them in their epilogue (sides/wgrad.Into:
no add pass, no per-region gradient), then they are rounded once: the same precision as one
GEMM over all rows, deterministic. No host sync. In the op's eager backward (release_saved),
dw1|dw3 of the regions the store kept are one launch after the last region instead, over their
da (written over their a) and their x rows in the receive buffer: ep_wgrad.py.

Saved from the forward: GEMM 1's pre-activations of every region in its slot of one store
(kernels/row_store.py), read there (``_Restore``: no copy); GEMM 1 runs again only for the
regions the store did not keep, and their rows go back into their slots.

Memory per call: the EP=1 backward's transients for ONE region of C tokens (reused region
after region), the fp32 weight-gradient sums (the local experts' weights in fp32), and the
staged dx rows, [C, D] per peer until sent (with the one dw1|dw3 launch: no region's x rows
or da buffer).
"""

import torch

from torchtitan_megamoe.ops.fp8_weights import Fp8Weights
from torchtitan_megamoe.ops.hopper import deepgemm
from torchtitan_megamoe.ops.hopper.bf16_backward import backward_bf16, release
from torchtitan_megamoe.ops.hopper.ep_dispatch import FP8_ROWS, TokenRoute
from torchtitan_megamoe.ops.hopper.ep_forward import forward_block_m, region_order
from torchtitan_megamoe.ops.hopper.ep_wgrad import KeptRows
from torchtitan_megamoe.ops.hopper.fp8_backward import backward_fp8, recompute_a
from torchtitan_megamoe.ops.hopper.fp8_weights import (
    dense_weights, make_fp8_weights, transposed_w2, transposed_w13,
)
from torchtitan_megamoe.ops.hopper.kernels.fp8_quant import FP8, quant_rows
from torchtitan_megamoe.ops.hopper.kernels.row_store import copy_unkept, kept_slots, slot_view
from torchtitan_megamoe.ops.hopper.plan import max_rows, unpack_plan
from torchtitan_megamoe.ops.hopper.sides.wgrad import Into, sm90_dw13_offered
from torchtitan_megamoe import settings


def backward_ep(grad_out, x, topk_ids, topk_weights, w1, w2, w3, group, recipe,
                max_tokens_per_rank=0, saved=None, weight_cache=False, release_saved=False):
    """(dx, dtopk_weights, dw1, dw2, dw3) for an EP group; ``saved``: what
    forward_ep(..., save=True) kept (per region), None or empty to recompute; ``recipe`` and
    ``weight_cache`` as in forward_ep. ``release_saved``: ``saved`` is this call's alone (the
    op's eager backward): the kept regions' da goes over their a, for one dw1|dw3 launch
    after the last region (ep_wgrad.py), and the store is freed at the end (a backward of the
    same graph again, retain_graph, then recomputes)."""
    route = TokenRoute(topk_ids, topk_weights, w1.shape[0], group, x.shape[1], x.dtype, recipe,
                       max_tokens_per_rank=max_tokens_per_rank)
    ex, R, C, me = route.ex, route.R, route.C, route.me
    if recipe.fp8_dgrad and not isinstance(weight_cache, Fp8Weights):
        # quantized once per call, not once per region (the transposed copies whole: a rank's
        # local experts)
        weight_cache = make_fp8_weights(w1, w2, w3, forward=recipe.fp8_forward, dtype=x.dtype)
    elif recipe.fp8_dgrad and weight_cache.fwd is not None and None in (weight_cache.w2t,
                                                                        weight_cache.w13t):
        # the forward copies only (the FSDP FP8 all-gather's): transposed once per call, not
        # once per region
        fwd = weight_cache.fwd
        weight_cache = Fp8Weights(fwd, weight_cache.w2t or transposed_w2(fwd),
                                  weight_cache.w13t or transposed_w13(fwd))
    if recipe.fp8_dgrad:
        gq, gs = quant_rows(grad_out.contiguous())
        dy_rows = {"dyq": gq.view(FP8_ROWS), "dys": gs}
    else:
        dy_rows = {"dy": grad_out.contiguous()}
    rows = {**{n: ("dispatch dy", t) for n, t in dy_rows.items()},
            "x": ("dispatch x", x.contiguous())}
    route.send_meta("dispatch dy")
    route.send_own({n: t for n, (_, t) in rows.items()})
    if ex.overlaps:  # each peer is signalled once its dy and x rows are there
        ex.run_async(lambda: route.send_peers(rows, signal=True))
        ex.exchange(["cnt", "meta"])
    else:
        route.send_peers(rows)
        ex.exchange(["cnt", "meta", *rows])
    ids, weights = route.received()
    # the weight gradients' fp32 sums over regions: each region's GEMMs add to them
    sums = tuple(torch.empty(w.shape, dtype=torch.float32, device=w.device) for w in (w1, w2, w3))
    restore = _Restore(saved, route, w1, w2, w3, recipe, weight_cache) if saved else None
    # dw1|dw3 of the regions the store kept: one launch after the last region (ep_wgrad.py)
    kept_rows = None
    x_recv = ex.recv.get("x")
    if release_saved and restore and restore.defers_dw13(x, x_recv):
        kept_rows = restore.kept_rows(x_recv)
    sends = []
    for i, s in enumerate(region_order(R, me)):
        if s != me and ex.overlaps:
            ex.wait_from(s)  # region s's dy and x are here (the others may still travel)
        region = slice(s * C, (s + 1) * C)
        x_rows = route.region_rows("x", s)
        region_saved = restore(i, s, x_rows) if restore else None
        keep = kept_rows.region(i) if kept_rows else None
        # summed in this rank's fixed region order: the same sums on every call
        into = Into(sums, accumulate=i > 0)

        def send_home(dx_s, dtw_s, s=s):
            # region s's dx partial rows go home under this region's wgrad_dw13
            back = {"ret": dx_s, "dtw": dtw_s.to(torch.float32).contiguous()}
            if s == me or not ex.overlaps:
                route.return_rows(s, back, "return dx")
                return

            def send():
                for t in back.values():
                    t.record_stream(torch.cuda.current_stream(x.device))  # used on this stream
                route.return_rows(s, back, "return dx")

            sends.append(ex.run_async(send))

        live = route.live_rows(s)
        if recipe.fp8_dgrad:
            q, sc = route.region_rows("dyq", s).view(FP8), route.region_rows("dys", s)
            backward_fp8(None, x_rows, ids[region], weights[region], w1,
                         w2, w3, recipe, weight_cache, saved=region_saved, grad_fp8=(q, sc),
                         into=into, on_dx=send_home, live=live, keep=keep)
        else:
            backward_bf16(route.region_rows("dy", s), x_rows,
                          ids[region], weights[region], w1, w2, w3, saved=region_saved,
                          into=into, on_dx=send_home, live=live, keep=keep)
    if kept_rows:
        kept_rows.dw13(sums[0], sums[2])
    if release_saved and restore:
        release(restore.store)
    del restore, kept_rows
    route.count_returned(x.shape[1] * x.element_size() + 4 * route.K, "return dx")
    if sends:
        torch.cuda.current_stream(x.device).wait_event(sends[-1])
    ex.exchange(["ret", "dtw"])
    dx = route.sum_returned("ret", x.dtype)
    dws = [acc.to(w.dtype) for acc, w in zip(sums, (w1, w2, w3))]
    return dx, route.pick_returned_dtw(topk_weights.dtype), *dws


def recompute_writes_every_row(recipe, t: torch.Tensor) -> bool:
    """Whether GEMM 1 run again may write rows of skipped tiles (DeepGEMM's FP8 GEMM, where it
    may run): then it cannot run in a slot's view of the store."""
    return recipe.fp8_forward and deepgemm.available(t)


class _Restore:
    """Region s's saved (a, packed plan) for its EP=1 backward: a is its slot's view of the
    forward's store (kernels/row_store.py); where the region was not kept, GEMM 1 runs again
    (the forward's kernel and pick: the same bits) into that view. DeepGEMM's FP8 GEMM 1
    writes every row of its output (zeros where tiles are skipped), so with it the rows go to
    one region's buffer first and only a recomputed region's into the view."""

    def __init__(self, saved, route, w1, w2, w3, recipe, weight_cache):
        self.store, self.packed = saved  # packed: [R, N], region-indexed
        self.C, self.K, self.E_local = route.C, route.K, w1.shape[0]
        self.w = dense_weights(weight_cache, w1, w2, w3)  # stand-ins stay zero-stride
        self.recipe, self.weight_cache = recipe, weight_cache
        self.block_m = forward_block_m(recipe)
        self.M = max_rows(self.C * self.K, self.E_local, self.block_m)
        # the forward's slot rows, from the store it sized: slots and one region's most
        self.S = (self.store.shape[0] - self.M) // (route.R - 1)
        self.plans = [unpack_plan(self.packed[s], self.C, self.K, self.E_local, self.block_m)
                      for s in range(route.R)]
        self.order = region_order(route.R, route.me)
        self.kept = kept_slots(torch.stack([self.plans[s].num_rows_used for s in self.order]),
                               self.S)
        self.a = None  # our GEMM 1 kernels leave skipped tiles' rows as they are
        if recompute_writes_every_row(recipe, self.store):
            self.a = torch.empty((self.M, self.store.shape[1]), dtype=self.store.dtype,
                                 device=self.store.device)

    def defers_dw13(self, x: torch.Tensor, x_recv: torch.Tensor | None) -> bool:
        """Whether dw1|dw3 of the kept regions wait for one launch after the last region: bf16
        weight gradients (not the all-FP8 ones) by the csrc/ kernel, the peers' x rows in one
        [R, C, D] receive buffer of x's dtype."""
        E, H, D = self.w[0].shape
        return (not (self.recipe.fp8_dgrad and self.recipe.fp8_wgrad(settings.fp8_wgrad()))
                and x_recv is not None and x_recv.is_contiguous() and x_recv.dtype == x.dtype
                and x_recv.shape[1:] == (self.C, D)
                and sm90_dw13_offered(D, H, E, self.block_m, x))

    def kept_rows(self, x_recv: torch.Tensor) -> KeptRows:
        return KeptRows(self.store, [self.plans[s] for s in self.order], self.order, self.kept,
                        self.S, self.M, x_recv)

    def __call__(self, i: int, s: int, x_rows: torch.Tensor) -> list:
        plan, kept = self.plans[s], self.kept[i]
        a = slot_view(self.store, i, self.S, self.M)
        # GEMM 1 only for a region the store did not keep: a kept one's tiles are all skipped
        fresh = plan.with_tiles(torch.where(kept, -1, plan.tile_expert))
        recompute_a(x_rows.contiguous(), *self.w, fresh, self.recipe.fp8_forward,
                    self.weight_cache, out=a if self.a is None else self.a, skip=kept)
        if self.a is not None:
            copy_unkept(self.a, a, plan.num_rows_used, kept)
        return [a, self.packed[s]]
