"""Expert-parallel (EP > 1) forward: the token exchange (ep_dispatch.py) overlapped with the GEMMs.

Receive layout: every rank holds R regions of C rows; region s holds the tokens source s sends
here (kernels/ep_layout.py: compact on a peer, token t at row t in the own region). The received
tokens are computed as one batch of R*C tokens with a
PHASED plan (plan.build_phased_plan): each expert's rows are split into phase 0 (tokens of this
rank's own region, here at once) and phase 1 (the peers' tokens, in transit), so GEMM 1 starts
on phase 0 while the peers' rows still travel:

    current stream                            side stream (symmetric memory only)
    route kernel; counts and meta -> every
    rank; own x -> own region
                                              x rows -> the peers they go to (SM stores of the
                                              n_d rows); barrier (channel 1) -> event x_arrived
    barrier (channel 0): metadata everywhere
    phased plan of the R*C received tokens
    GEMM 1 + SwiGLU, phase 0
    wait x_arrived
    GEMM 1 + SwiGLU, phase 1; GEMM 2, phase 1
    combine of each peer's region into a local
    buffer (HBM-bound)
                                              each buffer's received rows -> that peer's "ret"
                                              region
    GEMM 2, phase 0
    wait for the side stream; barrier (channel 0): every partial row is home
    combine of the own region, adding the peers' partial rows: out[t] = sum over
    ranks in fixed order, fp32 (the own partial never leaves the registers)

So the dispatch hides under GEMM 1 of the own tokens and the return's transfer under GEMM 2
of the own tokens.

FP8 forward (recipe.fp8_forward): x is quantized once at its source (e4m3 rows, 1x128 scales:
the rows FP8 GEMM 1 reads anyway) and travels so, at about half the bytes; the EP=1 FP8 stages
(fp8_forward.forward_fp8_rows) then run on the R*C received rows once all have arrived (not
phased: the FP8 GEMM sides take whole plans), and each received token's partial row goes home. No host sync and no data-dependent shape anywhere, so the call is capturable. Without
symmetric memory (gloo, CPU) the same steps run in order on one stream with all_to_all moves
(that is what the CPU tests cover).

Buffer reuse across calls: a peer's next x / meta copies into this rank's regions follow its
wait on this call's last barrier, which this rank reaches after its GEMM 1 read them; its next
"ret" stores follow its metadata barrier, which this rank reaches after summing.

Saved for backward. The pre-activations a = [a1 | a3] and the packed phased plan, in the
receive layout, which the backward's exchange reproduces exactly (it depends only on topk_ids
and C); the backward runs the phased plan as an ordinary one. Their size is static: R_max rows
for R*C received tokens of K slots, i.e. about R times what the rank really computes. They are
kept only while that is at most what stock TorchTitan saves per MoE layer (T*K*(D + 3H) bf16
values: permuted input, a1, a3, h); otherwise the backward recomputes GEMM 1. At
T = C = 16384, K = 8, E = 128, EP=2: 30B 0.78 GiB kept (stock 1.06 GiB); 235B 1.56 GiB kept
(stock 2.13 GiB); at EP=8 they exceed stock's and are not kept.

Memory. Exchange buffers, shared by all layers (ep_transport.py): 3 x [R, C, D] x.dtype + small
metadata, C = tokens per rank. Per call: h [R_max, H] and GEMM 2's rows y [R_max, D], with R_max
the static bound for R*C*K received slots (any routing may send every slot here): ~R times the
rows a rank computes on average. A capacity below that bound needs an overflow path (not built).
With symmetric memory, the staged return rows: (R - 1) x [C, D] x.dtype until their copies end
(EP=2, C = 16384: 64 MiB at 30B, 128 MiB at 235B; EP=8: 448 / 896 MiB).
"""

import torch

from torchtitan_megamoe.ops.groups import group_size
from torchtitan_megamoe.ops.hopper.bf16_forward import saved_like
from torchtitan_megamoe.ops.hopper.ep_dispatch import FP8_ROWS, TokenRoute
from torchtitan_megamoe.ops.hopper.ep_transport import capacity_hint
from torchtitan_megamoe.ops.hopper.fp8_forward import forward_fp8_rows
from torchtitan_megamoe.ops.hopper.heuristics import forward_configs
from torchtitan_megamoe.ops.hopper.kernels.combine import combine
from torchtitan_megamoe.ops.hopper.kernels.fp8_quant import FP8, quant_rows
from torchtitan_megamoe.ops.hopper.sides.gemm1_swiglu import gemm1_swiglu
from torchtitan_megamoe.ops.hopper.sides.gemm2 import gemm2
from torchtitan_megamoe.ops.hopper.plan import build_phased_plan, max_rows, pack_plan
from torchtitan_megamoe.ops.hopper.tiles import FP8_BLOCK_M, plan_block_m

PHASES = 2
"""Phase 0: the own region's tokens; phase 1: the peers' tokens."""

_PHASE_OF_ROW: dict = {}


def phase_of_row(R: int, C: int, rank: int, device) -> torch.Tensor:
    """[R*C] int32: 0 for the rows of region ``rank`` (this rank's own tokens), 1 elsewhere;
    built once per (R, C, rank). Not cached while a CUDA graph captures (see _row_in_region)."""
    key = (R, C, rank, str(device))
    t = _PHASE_OF_ROW.get(key)
    if t is None:
        t = torch.ones(R, C, dtype=torch.int32, device=device)
        t[rank] = 0
        t = t.view(-1)
        if not (t.is_cuda and torch.cuda.is_current_stream_capturing()):
            _PHASE_OF_ROW[key] = t
    return t


def plan_phases(recipe) -> int:
    """Phases of the forward's plan: the bf16 forward computes the own tokens first, the FP8
    forward all received rows at once."""
    return 1 if recipe.fp8_forward else PHASES


def forward_block_m(recipe) -> int:
    """Rows per plan segment of the bf16 forward: the recipe's (an FP8 backward's) or the
    default."""
    return recipe.plan_block_m or plan_block_m()


def keeps_saved(R, C, K, E_local, D, H, block_m, phases=PHASES) -> bool:
    """Whether the EP forward keeps GEMM 1's pre-activations: only while their static size is
    at most stock TorchTitan's saved routed activations per layer."""
    ours = max_rows(R * C * K, E_local, block_m, phases) * 2 * H
    stock = C * K * (D + 3 * H)
    return ours <= stock


def forward_ep(x, topk_ids, topk_weights, w1, w2, w3, group, recipe, max_tokens_per_rank=0,
               block_m=None, gemm1_config=None, gemm2_config=None, save=False,
               weight_cache=False):
    """out, or (out, saved list) with ``save`` (empty when the backward must recompute);
    ``recipe``: the call's (ops/recipe.py); ``max_tokens_per_rank``: the exchange's capacity
    (0: this call's largest batch); ``weight_cache``: the FP8 copies (fp8_forward.py)."""
    x = x.contiguous()
    E_local, H, D = w1.shape
    route = TokenRoute(topk_ids, topk_weights, E_local, group, D, x.dtype, recipe,
                       check_ids=True, max_tokens_per_rank=max_tokens_per_rank)
    if recipe.fp8_forward:
        return _forward_fp8(x, route, w1, w2, w3, save, weight_cache)
    return _forward_bf16(x, route, w1, w2, w3, save, block_m or forward_block_m(recipe),
                         gemm1_config, gemm2_config)


def _forward_fp8(x, route, w1, w2, w3, save, weight_cache):
    """The FP8 forward: e4m3 rows travel, the EP=1 FP8 stages run on what arrived."""
    R, C, K, D, H = route.R, route.C, route.K, x.shape[1], w1.shape[1]
    xq, xs = quant_rows(x)
    route.dispatch({"xq": xq.view(FP8_ROWS), "xs": xs})
    ids, weights = route.received()
    keep = save and keeps_saved(R, C, K, w1.shape[0], D, H, FP8_BLOCK_M, 1)
    res = forward_fp8_rows(route.recv_rows("xq").view(FP8), route.recv_rows("xs"), ids, weights,
                           w1, w2, w3, x.dtype, weight_cache, save=keep)
    part, saved = res if keep else (res, None)
    route.give_back({"ret": part}, "combine")
    out = route.sum_returned("ret", x.dtype)
    if not save:
        return out
    return out, (list(saved) if keep else [])


def _forward_bf16(x, route, w1, w2, w3, save, block_m, gemm1_config, gemm2_config):
    gemm1_config, gemm2_config = forward_configs(gemm1_config, gemm2_config)
    w1, w2, w3 = w1.contiguous(), w2.contiguous(), w3.contiguous()
    E_local, H, D = w1.shape
    T = x.shape[0]
    ex, R, C, K, me, peers = route.ex, route.R, route.C, route.K, route.me, route.peers

    # 1. counts and metadata everywhere, own rows home; the peers' rows on the side stream
    route.send_meta()
    route.send_own({"x": x})
    if ex.overlaps:
        x_arrived = ex.run_async(lambda: route.send_peers({"x": x}), barrier=True)
        ex.exchange(["cnt", "meta"])
    else:
        route.send_peers({"x": x})
        ex.exchange(["cnt", "meta", "x"])
    ids, weights = route.received()
    plan, phase_tiles = build_phased_plan(ids, E_local, block_m,
                                          phase_of_row(R, C, me, ids.device), PHASES)
    own, others = (plan.with_tiles(t) for t in phase_tiles)
    xr = route.recv_rows("x")
    keep = save and keeps_saved(R, C, K, E_local, D, H, block_m)
    # 2. GEMM 1: own tokens first, the peers' once they are here
    h = torch.empty((plan.max_rows, H), dtype=x.dtype, device=x.device)
    a = torch.empty((plan.max_rows, 2 * H), dtype=x.dtype, device=x.device) if keep else None
    h_out = (h, a) if keep else h
    gemm1_swiglu(xr, w1, w3, own, config=gemm1_config, save_a=keep, out=h_out)
    if ex.overlaps:
        torch.cuda.current_stream(x.device).wait_event(x_arrived)
    gemm1_swiglu(xr, w1, w3, others, config=gemm1_config, save_a=keep, out=h_out)

    # 3. GEMM 2 and the combine, peers' tokens first: their partial rows go home while the
    # own tokens' GEMM 2 runs
    y = torch.empty((plan.max_rows, D), dtype=x.dtype, device=x.device)
    gemm2(h, w2, others, config=gemm2_config, out=y)

    # The peers' rows: combined here (HBM-bound, every SM), then their received rows stored
    # into the peers' regions on the side stream beside GEMM 2 (a combine storing straight into
    # the peers' regions would run at NVLink speed on every SM between the two GEMM 2
    # launches). Without symmetric memory the same steps run in order.
    staged = []
    for s in peers:
        slots = slice(s * C * K, (s + 1) * C * K)
        staged.append(combine(y, weights[s * C:(s + 1) * C], plan.slot_row[slots], x.dtype))

    def send_staged():
        for s, rows in zip(peers, staged):
            if ex.overlaps:
                rows.record_stream(torch.cuda.current_stream(x.device))  # used on this stream
            route.return_rows(s, {"ret": rows})

    returned = ex.run_async(send_staged) if ex.overlaps else send_staged()
    route.count_returned({"ret": y}, "combine")
    gemm2(h, w2, own, config=gemm2_config, out=y)
    if ex.overlaps:
        torch.cuda.current_stream(x.device).wait_event(returned)
    ex.exchange(["ret"])
    # 4. the own tokens' combine adds the partial rows the peers returned (rank order)
    slots = slice(me * C * K, me * C * K + T * K)
    out = combine(y, weights[me * C:me * C + T], plan.slot_row[slots], x.dtype,
                  returned=(ex.recv["ret"], route.pos, me))
    if not save:
        return out
    return out, ([a, pack_plan(plan)] if keep else [])


def saved_like_ep(x, topk_ids, w1, group, recipe, max_tokens_per_rank=0):
    """Empty tensors shaped like forward_ep(..., save=True)'s saved list (fake impls)."""
    block_m = FP8_BLOCK_M if recipe.fp8_forward else forward_block_m(recipe)
    phases = plan_phases(recipe)
    R = group_size(group)
    T, K = topk_ids.shape
    E_local, H, D = w1.shape
    C = capacity_hint(group, T, max_tokens_per_rank)
    if not keeps_saved(R, C, K, E_local, D, H, block_m, phases):
        return []
    return saved_like(x.new_empty((R * C, D)), topk_ids.new_empty((R * C, K)), w1, phases,
                      block_m)
