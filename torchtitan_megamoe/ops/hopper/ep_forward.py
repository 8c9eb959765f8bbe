"""Expert-parallel (EP > 1) forward: the token exchange (ep_dispatch.py) overlapped with the GEMMs,
one source region at a time.

Receive layout: every rank holds R regions of C rows; region s holds the tokens source s sends
here (kernels/ep_layout.py: compact on a peer, token t at row t in the own region). Each region
is computed on its own, as a batch of C tokens with its own plan: its own region first (here at
once), then the peers' in order me+1, me+2, ... A token of source s has all its slots on this
rank in region s, so each region's combine gives complete partial rows, which go home while the
next region computes:

    current stream                            side stream (symmetric memory only)
    route kernels; counts and meta -> every
    rank; own x -> own region
                                              for d = me-1, me-2, ...: x rows -> d (SM
                                              stores of the n_d rows), signal d
    barrier (channel 0): metadata everywhere
    every region's plan (plan.build_plans)
    own region: GEMM 1 + SwiGLU, GEMM 2,
    combine into ret[me]
    for each peer s = me+1, me+2, ...: wait
    for s's signal; GEMM 1 + SwiGLU, GEMM 2,
    combine into a buffer
                                              the buffer's rows -> s's "ret" region
    wait for the side stream; barrier (channel 0): every partial row is home
    sum of the ranks' partial rows, fixed rank order, fp32

The sends run in shift order (at step i every rank sends to the rank i below and receives from
the rank i above: no rank takes two sources at once), and a region is computed as soon as its
own rows are here: the dispatch hides under the regions computed before, each region's return
under the next region. The per-call buffers (h, y) are sized for ONE region, C tokens of K slots,
whatever the routing (no region can hold more), and reused region after region: the transient
memory is about what the rank computes on average (C*K received slots at uniform routing),
not R times it, and no routing overflows it.

FP8 forward (recipe.fp8_forward): x is quantized once at its source (e4m3 rows, 1x128 scales:
the rows FP8 GEMM 1 reads anyway) and travels so, at about half the bytes; each region runs the
EP=1 FP8 stages (fp8_forward.forward_fp8_rows), on weight copies made once per call where the
layer gives none (not once per region). No host sync and no data-dependent shape
anywhere, so the call is capturable. Without symmetric memory (gloo, CPU) the same steps run in
order on one stream with all_to_all moves (that is what the CPU tests cover).

Buffer reuse across calls: a peer's next x / meta copies into this rank's regions follow its
wait on this call's last barrier, which this rank reaches after its GEMMs read them; its next
"ret" stores follow its metadata barrier, which this rank reaches after summing.

Saved for backward: GEMM 1's pre-activations a = [a1 | a3] of every region, in ONE store
(kernels/row_store.py) of a static slot per region: S rows, what a region holds at uniform
routing (C*K/R slots) times SAVE_MARGIN, plus its segments' padding. GEMM 1 writes a region's
a straight into its slot's view (no copy); a region with more rows (a skewed routing) spills
into the slots after it, is not kept, and the backward recomputes its GEMM 1 (the same kernel
and pick: the same bits). Besides the store: each region's packed plan, which the backward's
exchange reproduces exactly (the layout depends only on topk_ids and C). The store, (R-1)*S
rows plus one region's most, stays below what stock TorchTitan saves per MoE layer
(T*K*(D + 3H) bf16 values: permuted input, a1, a3, h): at T = C = 16384, K = 8, E = 128,
EP=8: 30B 0.89 GB (stock 1.14 GB), 235B 1.79 GB (stock 2.3). Where it would exceed stock's,
nothing is saved and the backward recomputes every region.

Memory. Exchange buffers, shared by all layers (ep_transport.py): [R, C, D] per row name +
metadata, C = tokens per rank. Per call: h [M, H] and y [M, D] with M = max_rows(C*K) for one
region; a peer region's partial rows, [C, D], until the side stream has sent them.
"""

import torch

from torchtitan_megamoe.ops.fp8_weights import Fp8Weights
from torchtitan_megamoe.ops.groups import group_size
from torchtitan_megamoe.ops.hopper.ep_dispatch import FP8_ROWS, TokenRoute
from torchtitan_megamoe.ops.hopper.ep_transport import capacity_hint
from torchtitan_megamoe.ops.hopper.fp8_forward import forward_fp8_rows
from torchtitan_megamoe.ops.hopper.fp8_weights import dense_weights, make_fp8_weights
from torchtitan_megamoe.ops.hopper.heuristics import forward_configs
from torchtitan_megamoe.ops.hopper.kernels.combine import combine
from torchtitan_megamoe.ops.hopper.kernels.fp8_quant import FP8, quant_rows
from torchtitan_megamoe.ops.hopper.kernels.row_store import slot_view
from torchtitan_megamoe.ops.hopper.sides.gemm1_swiglu import gemm1_swiglu
from torchtitan_megamoe.ops.hopper.sides.gemm2 import gemm2
from torchtitan_megamoe.ops.hopper.plan import build_plans, max_rows, packed_plan_numel
from torchtitan_megamoe.ops.hopper.tiles import FP8_BLOCK_M, plan_block_m

SAVE_MARGIN = 1.25
"""A region's slot of the saved store holds this many times the slots it receives at uniform
routing: room for a skewed routing before a region falls back to recomputing GEMM 1."""


def slot_rows(R, C, K, E_local, block_m) -> int:
    """S, the rows of one region's slot in the store of GEMM 1's pre-activations: the margin
    over the C*K/R slots a region receives at uniform routing, plus its segments' padding."""
    rows = int(SAVE_MARGIN * C * K / R) + E_local * (block_m - 1)
    return -(-rows // block_m) * block_m


def saved_rows(R, C, K, E_local, block_m) -> int:
    """Rows of the store (see the module's doc): R - 1 slots, then the last one's view of the
    most rows a region can use."""
    return (R - 1) * slot_rows(R, C, K, E_local, block_m) + max_rows(C * K, E_local, block_m)


def keeps_saved(R, C, K, E_local, D, H, block_m) -> bool:
    """Whether the EP forward keeps GEMM 1's pre-activations: while the store is at most stock
    TorchTitan's saved routed activations per layer."""
    return saved_rows(R, C, K, E_local, block_m) * 2 * H <= C * K * (D + 3 * H)


def forward_block_m(recipe) -> int:
    """Rows per plan segment: FP8's 128 for an FP8 forward, else the recipe's (an FP8
    backward's) or the default."""
    return FP8_BLOCK_M if recipe.fp8_forward else (recipe.plan_block_m or plan_block_m())


def region_order(R: int, me: int) -> list[int]:
    """The regions in compute order: the own first, then the peers me+1, me+2, ... (each rank
    starts on a different peer's rows)."""
    return [(me + i) % R for i in range(R)]


def forward_ep(x, topk_ids, topk_weights, w1, w2, w3, group, recipe, max_tokens_per_rank=0,
               gemm1_config=None, gemm2_config=None, save=False, weight_cache=False):
    """out, or (out, saved list) with ``save`` (empty when the backward must recompute);
    ``recipe``: the call's (ops/recipe.py); ``max_tokens_per_rank``: the exchange's capacity
    (0: this call's largest batch); ``weight_cache``: the FP8 copies (fp8_forward.py)."""
    x = x.contiguous()
    E_local, H, D = w1.shape
    if recipe.fp8_forward and not isinstance(weight_cache, Fp8Weights):
        # quantized once per call, not once per region
        weight_cache = make_fp8_weights(w1, w2, w3, transposed=False, dtype=x.dtype)
    route = TokenRoute(topk_ids, topk_weights, E_local, group, D, x.dtype, recipe,
                       check_ids=True, max_tokens_per_rank=max_tokens_per_rank)
    ex, R, C, K, me = route.ex, route.R, route.C, route.K, route.me
    block_m = forward_block_m(recipe)
    keep = save and keeps_saved(R, C, K, E_local, D, H, block_m)

    # 1. counts and metadata everywhere, own rows home; the peers' rows on the side stream
    if recipe.fp8_forward:
        xq, xs = quant_rows(x)
        rows = {"xq": xq.view(FP8_ROWS), "xs": xs}
    else:
        rows = {"x": x}
    route.send_meta()
    route.send_own(rows)
    if ex.overlaps:  # each peer is signalled once its rows are there
        ex.run_async(lambda: route.send_peers(rows, signal=True))
        ex.exchange(["cnt", "meta"])
    else:
        route.send_peers(rows)
        ex.exchange(["cnt", "meta", *rows])
    ids, weights = route.received()
    compute = _Regions(route, ids, weights, w1, w2, w3, recipe, block_m, keep, weight_cache,
                       gemm1_config, gemm2_config, x.dtype)

    # 2. the own region, then each peer's; a peer's partial rows go home under the next region
    sends = []
    for i, s in enumerate(region_order(R, me)):
        if s != me and ex.overlaps:
            ex.wait_from(s)  # region s's rows are here (the others may still travel)
        if s == me:
            compute.region(i, s, out=ex.send_region(me, "ret"))
            continue
        part = torch.empty((C, D), dtype=x.dtype, device=x.device)
        compute.region(i, s, out=part)

        def send(s=s, part=part):
            if ex.overlaps:
                part.record_stream(torch.cuda.current_stream(x.device))  # used on this stream
            route.return_rows(s, {"ret": part}, "combine")

        # record_stream keeps part's memory from reuse until the side stream sent it
        sends.append(ex.run_async(send) if ex.overlaps else send())
    route.count_returned(D * x.element_size(), "combine")
    if ex.overlaps and sends:
        torch.cuda.current_stream(x.device).wait_event(sends[-1])
    ex.exchange(["ret"])
    # 3. out[t] = sum over the ranks t went to of their partial rows, fp32, rank order
    out = route.sum_returned("ret", x.dtype)
    if not save:
        return out
    return out, ([compute.store, compute.packed] if keep else [])


class _Regions:
    """One region's forward: C received tokens with their own plan; bf16 (GEMM 1 + SwiGLU,
    GEMM 2, combine) or FP8 (fp8_forward.forward_fp8_rows). The bf16 h and y (and a, when
    kept) are allocated once and reused region after region (stream order keeps the regions
    apart); a kept region's a goes into the saved store (kernels/row_store.py)."""

    def __init__(self, route, ids, weights, w1, w2, w3, recipe, block_m, keep, weight_cache,
                 gemm1_config, gemm2_config, dtype):
        self.route, self.C, self.K = route, route.C, route.K
        self.ids, self.weights = ids, weights
        # zero-stride stand-ins where the layer gave FP8 copies: never made dense
        self.w1, self.w2, self.w3 = dense_weights(weight_cache, w1, w2, w3)
        self.recipe, self.block_m, self.keep, self.weight_cache = recipe, block_m, keep, weight_cache
        self.dtype = dtype
        E_local, H, D = w1.shape
        self.g1, self.g2 = forward_configs(gemm1_config, gemm2_config, block_m, D, H)
        dev = ids.device
        # every region's plan from one launch pair (the ids are all here once the metadata is)
        self.plans, self.packed = build_plans(ids.view(route.R, self.C, self.K), E_local,
                                              block_m)
        M = max_rows(self.C * self.K, E_local, block_m)
        self.M, self.S = M, slot_rows(route.R, self.C, self.K, E_local, block_m)
        if keep:
            self.store = torch.empty((saved_rows(route.R, self.C, self.K, E_local, block_m),
                                      2 * H), dtype=dtype, device=dev)
        if not recipe.fp8_forward:
            self.h = torch.empty((M, H), dtype=dtype, device=dev)
            self.y = torch.empty((M, D), dtype=dtype, device=dev)

    def region(self, i: int, s: int, out: torch.Tensor):
        """Region s (the i-th computed) into ``out`` [C, D]; a kept region's pre-activations
        go straight into slot i of the store."""
        C = self.C
        ids, weights = self.ids[s * C:(s + 1) * C], self.weights[s * C:(s + 1) * C]
        plan = self.plans[s]
        a = slot_view(self.store, i, self.S, self.M) if self.keep else None
        live = self.route.live_rows(s)
        if self.recipe.fp8_forward:
            forward_fp8_rows(self.route.region_rows("xq", s).view(FP8),
                             self.route.region_rows("xs", s), ids, weights,
                             self.w1, self.w2, self.w3, self.dtype, self.weight_cache,
                             save=self.keep, out=out, plan=plan, a_out=a, live=live)
            return
        xr = self.route.region_rows("x", s)
        gemm1_swiglu(xr, self.w1, self.w3, plan, config=self.g1, save_a=self.keep,
                     out=(self.h, a) if self.keep else self.h)
        gemm2(self.h, self.w2, plan, config=self.g2, out=self.y)
        combine(self.y, weights, plan.slot_row, self.dtype, out=out, live=live)


def saved_like_ep(x, topk_ids, w1, group, recipe, max_tokens_per_rank=0):
    """Empty tensors shaped like forward_ep(..., save=True)'s saved list (fake impls)."""
    block_m = forward_block_m(recipe)
    R = group_size(group)
    T, K = topk_ids.shape
    E_local, H, D = w1.shape
    C = capacity_hint(group, T, max_tokens_per_rank)
    if not keeps_saved(R, C, K, E_local, D, H, block_m):
        return []
    return [x.new_empty((saved_rows(R, C, K, E_local, block_m), 2 * H)),
            topk_ids.new_empty((R, packed_plan_numel(C, K, E_local, block_m)), dtype=torch.int32)]
