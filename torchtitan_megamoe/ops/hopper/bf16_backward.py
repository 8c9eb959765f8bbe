"""EP=1 backward of backend ``hopper`` in BF16: four stages over the forward's row layout.

    plan           unpacked from what the forward saved (plan.unpack_plan: views, no work);
                   rebuilt with build_plan only when nothing was saved
    gemm1_swiglu   only when nothing was saved: the forward's kernel and tuned pick, storing
                   a = [a1 | a3] (h dropped), so the gradients equal the saved path's bit for bit
    dgrad2_swiglu  dh = dy @ w2 with a1, a3 loaded from a; the SwiGLU backward with the routing
                   weight -> da = [da1 | da3], hw = w*h and per-H-tile partials of
                   d(topk_weights) = <dh, h>
    wgrad_dw2      dw2[e] = sum_r dy_r^T hw_r
    dgrad1         dx rows = da1_r @ w1[e] + da3_r @ w3[e]
    bwd_combine    dx[t] = sum_k dx rows, d(topk_weights) from the partials
    wgrad_dw13     dw1[e] = sum_r da1_r^T x_r, dw3[e] = sum_r da3_r^T x_r
Each stage has sides (Triton, sm90, grouped_mm): its table in sides/, timed by tune.py.
x and dy rows are read by indirection (row -> token); nothing is permuted. Every reduction has
a fixed order and no atomics, so two runs on the same inputs are bitwise identical. What is
saved, recomputed and live when: docs/ARCHITECTURE.md, "Memory of the bf16 backward".
"""

import torch

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper.heuristics import forward_configs
from torchtitan_megamoe.ops.hopper.tiles import plan_block_m
from torchtitan_megamoe.ops.hopper.kernels.bwd_combine import bwd_combine
from torchtitan_megamoe.ops.hopper.kernels.wgrad import longest_first
from torchtitan_megamoe.ops.hopper.plan import build_plan, unpack_plan
from torchtitan_megamoe.ops.hopper.sides import dgrad1, dgrad2_swiglu, wgrad
from torchtitan_megamoe.ops.hopper.sides.backward import params_ok, shape
from torchtitan_megamoe.ops.hopper.sides.gemm1_swiglu import gemm1_swiglu
from torchtitan_megamoe.ops.hopper.sides.table import available
from torchtitan_megamoe.ops.hopper.sides.wgrad import Into
from torchtitan_megamoe.ops.hopper.tune import bucket, pick_config


def check_backward_dtypes(grad_out, x, w1, weight_dtypes=(torch.bfloat16,)) -> None:
    """``weight_dtypes``: the recipe's (Recipe.weight_dtypes: fp32 too where the weights are
    read only through FP8 copies, their gradients then fp32, api.mega_moe)."""
    for name, t, ok in (("grad_out", grad_out, (torch.bfloat16,)), ("x", x, (torch.bfloat16,)),
                        ("w1", w1, weight_dtypes)):
        if t.dtype not in ok:
            raise TypeError(
                f"mega_moe backend='hopper' backward needs bfloat16 tensors, {name} is "
                f"{t.dtype}; cast to torch.bfloat16 or use backend='reference'"
            )
    if grad_out.shape != x.shape:
        raise ValueError(
            f"grad_out shape {tuple(grad_out.shape)} must equal x shape {tuple(x.shape)}"
        )
    if not settings.triton_interpreting() and not x.is_cuda:
        raise ValueError(
            "mega_moe backend='hopper' needs CUDA tensors; use backend='reference' on CPU"
        )


def tuner_key(R: int, D: int, H: int, E: int, block_m: int, side: str) -> tuple:
    """The tuner's key of every stage of this backward. Bucketed: under EP, R changes every
    step. The forced side (MEGAMOE_BWD_IMPL) is part of it, so a forced run never reuses what
    auto picked (or the reverse)."""
    return (bucket(R), D, H, E, block_m, side)


def backward_bf16(grad_out, x, topk_ids, topk_weights, w1, w2, w3, saved=None, wait_x=None,
                  into=None, release_saved=False, on_dx=None, live=None, keep=None,
                  grads_like=None):
    """(dx, dtopk_weights, dw1, dw2, dw3); every expert of topk_ids is in w1/w2/w3. ``saved`` =
    (a, packed_plan) from forward_bf16(..., save=True) on the same inputs: dgrad2_swiglu loads
    a1/a3 instead of recomputing GEMM 1 and the plan is unpacked instead of rebuilt. None (or
    an empty sequence) recomputes both. ``release_saved``: the caller's saved a is dead after
    this call (the op's eager backward): its memory is freed right after dgrad2_swiglu.

    Stage order: dgrad2_swiglu, wgrad_dw2, dgrad1, bwd_combine, wgrad_dw13: dw1 and dw3, the
    largest gradients, are made last, when only da is left (release_saved: the peak is then
    max(a + da + hw + dy rows, da + dw1 + dw2 + dw3), not a + da + dx rows + all three).
    ``wait_x()`` (the EP backward's hook, ep_backward.py) is called right before the first
    kernel that reads x (wgrad_dw13, or the recompute's GEMM 1), so x can still be in flight
    under the stages before. ``into``: a sides.wgrad.Into, where dw1, dw2, dw3 go (default:
    fresh tensors like the weights; the EP backward's fp32 sums over regions, added to).
    ``on_dx(dx, dtopk_weights)``: called once they are queued, before wgrad_dw13 (the EP
    backward sends them home under it). ``live``: a 1-element int32 device count n: dx and
    d(topk_weights) are made for tokens t < n only (an EP peer region: the rows that go home).
    ``keep``: an ep_wgrad.KeptRegion (the EP backward's kept regions): da is written into
    ``keep.da`` (the saved a) and the region's row slots into ``keep.row_slot``, from which one
    wgrad_dw13 over all kept regions gathers x after the last region; this call's wgrad_dw13
    adds the rows of a region the store did not keep only. ``grads_like``: what fresh
    gradients are shaped and typed like where w1, w2, w3 are bf16 copies of fp32 parameters
    (the hopper backend's own cast, ops/hopper/__init__.py): the parameters; None: w1, w2, w3."""
    block_m = plan_block_m()
    T, D = x.shape
    if T == 0:  # e.g. an EP rank that receives no rows
        return (torch.empty_like(x), torch.empty_like(topk_weights),
                *Into.zeros(into, grads_like or (w1, w2, w3)))
    # Gradients take the parameters' own layout; the kernels read contiguous copies.
    params = into.outs if into else (grads_like or (w1, w2, w3))
    dy = grad_out.contiguous()
    x = x.contiguous()
    w1, w2, w3 = w1.contiguous(), w2.contiguous(), w3.contiguous()
    E, H, _ = w1.shape
    if saved:
        a_saved, packed = saved
        plan = unpack_plan(packed, T, topk_ids.shape[1], E, block_m)
    else:
        plan = build_plan(topk_ids, E, block_m)
        if wait_x is not None:
            wait_x()  # GEMM 1 reads x
            wait_x = None
        # GEMM 1 again with the forward's kernel and tuned pick (the same key), so a is bitwise
        # the forward's and the gradients equal the saved path's bit for bit; h is not needed.
        g1_config, _ = forward_configs(None, None, block_m, D, H)
        _h, a_saved = gemm1_swiglu(x, w1, w3, plan, config=g1_config, save_a=True)
        del _h
    R = plan.max_rows
    key = tuner_key(R, D, H, E, block_m, settings.bwd_impl())

    # dgrad2_swiglu. Buffers are allocated once so that tuning candidates write the same
    # outputs. The grouped_mm and sm90 sides gather dy rows, which wgrad_dw2 then reuses.
    ops_a = dgrad2_swiglu.Operands(dy, a_saved, topk_weights, w2, plan, x.dtype, {}, {})
    bf16 = x.dtype == w2.dtype == torch.bfloat16

    # Each stage's offer is a function, built only until the tuner has picked (host time: the
    # backward's stages run back to back, nothing hides their issue cost).
    # checked on the used rows (the sides' buffers past them differ) and on d(topk_weights)'s
    # per-row sum of partials (the sides keep different numbers of partials)
    def a_outputs(res):
        used = int(plan.num_rows_used)
        return res[0][:used], res[1][:used], res[2].sum(0)[:used]

    a_cfg = pick_config(dgrad2_swiglu.STAGE, key,
                        lambda: (shape(D, H, E, block_m, bf16), available(x)),
                        lambda cfg: dgrad2_swiglu.STAGE.launch(cfg, ops_a), outputs=a_outputs)
    if keep is not None:  # the candidates above read a; the picked side writes da over it
        ops_a = ops_a._replace(bufs={}, da_out=keep.da)
    da, hw, part = dgrad2_swiglu.STAGE.launch(a_cfg, ops_a)
    if release_saved:
        release(a_saved)
    shared = ops_a.shared
    if a_cfg.side not in dgrad2_swiglu.GATHERS_DY:
        shared.clear()  # no dy rows for dw2 to reuse
    del ops_a, a_saved

    # dgrad2_swiglu's gathered dy rows (its sm90 and grouped_mm sides) serve wgrad_dw2 too
    acts = {"hw": hw, "dy_rows": shared.pop("dy_rows", None)}
    del hw
    shared.clear()
    grads = WeightGrads(dy, x, da, acts, plan, params, key, block_m, into, keep)
    dw2 = grads.dw2()

    # dgrad1, then bwd_combine. Each side allocates its dx rows itself (the grouped_mm side
    # only after its second GEMM's output is freed): [T*K, D] by slot, or [R_max, D] in the
    # row space (sm90; the second value says which).
    ops_c = dgrad1.Operands(da, w1, w3, plan, x.dtype)

    # checked on a sample of the live slots' rows, wherever each side keeps them
    def c_outputs(res):
        live = torch.nonzero(plan.slot_row >= 0).squeeze(1)[::61]
        return (res[0][plan.slot_row[live].long()] if res[1] else res[0][live],)

    c_cfg = pick_config(dgrad1.STAGE, key,
                        lambda: (shape(D, H, E, block_m, da.dtype == w1.dtype == torch.bfloat16),
                                 available(da)),
                        lambda cfg: dgrad1.STAGE.launch(cfg, ops_c), outputs=c_outputs)
    dx_slot, in_rows = dgrad1.STAGE.launch(c_cfg, ops_c)
    del ops_c
    dx, dtw = bwd_combine(dx_slot, part, plan, dx_dtype=x.dtype, dtw_dtype=topk_weights.dtype,
                          rows=in_rows, live=live)
    del dx_slot, part
    if on_dx is not None:
        on_dx(dx, dtw)
    dw1, dw3 = grads.dw13(wait_x)
    return dx, dtw, dw1, dw2, dw3


def release(t: torch.Tensor) -> None:
    """Free ``t``'s memory now, though autograd still holds it as a saved tensor: its last
    reader has been queued on this stream (the allocator reuses the block for work queued
    after). ``released`` tells a later backward of the same graph (retain_graph) to recompute."""
    t.untyped_storage().resize_(0)


def released(saved) -> bool:
    """Whether an earlier backward freed ``saved``'s a (release): the backward must recompute."""
    return bool(saved) and saved[0].numel() > 0 and saved[0].untyped_storage().nbytes() == 0


class WeightGrads:
    """(dw1, dw2, dw3) in the parameters' dtype (bf16, or fp32 for the stand-ins of fp32
    parameters, moe.py) from da = [da1 | da3] and acts = {"hw": w*h rows, "dy_rows": dy
    gathered into the row space or None}, as two stages the data gradients can run between:
    ``dw2()`` (wgrad_dw2; empties acts, so hw is freed: the caller keeps no reference), then
    ``dw13(wait_x)`` (wgrad_dw13; ``wait_x()`` runs before its first read of x). The tuner
    picks each GEMM's side. Shared by the FP8 backward (its weight gradients are bf16 GEMMs
    too). ``into``: a sides.wgrad.Into (None: fresh gradients); the tuner's candidates write
    fresh ones, never into it. ``keep``: an ep_wgrad.KeptRegion: dw13 runs the csrc/ kernel on
    the rows of an unkept region only (ep_wgrad.KeptRegion.dw13)."""

    def __init__(self, dy, x, da, acts: dict, plan, params, key, block_m, into=None, keep=None):
        self.keep = keep
        E, H, D = params[0].shape
        # fp32 gradients (fp32 parameters) change the sides' costs
        self.key = key + (params[0].dtype,)
        self.trial = wgrad.Operands(dy, x, da, acts, plan, params, longest_first(plan))
        self.ops = self.trial._replace(into=into)
        self.problem = lambda: (shape(D, H, E, block_m, x.dtype == torch.bfloat16,
                                      params_ok(params)), available(x))

    def dw2(self):
        dw2 = wgrad.DW2.launch(pick_config(wgrad.DW2, self.key, self.problem,
                                           lambda cfg: wgrad.DW2.launch(cfg, self.trial),
                                           outputs=lambda r: (r,)), self.ops)
        self.ops.acts.clear()
        return dw2

    def dw13(self, wait_x=None):
        if wait_x is not None:
            wait_x()
        if self.keep is not None:
            dw1, dw3 = self.keep.dw13(self.ops)
            self.trial = self.ops = None
            return dw1, dw3
        dw1, dw3 = wgrad.DW13.launch(pick_config(wgrad.DW13, self.key, self.problem,
                                                 lambda cfg: wgrad.DW13.launch(cfg, self.trial),
                                                 outputs=lambda r: r), self.ops)
        self.trial = self.ops = None  # da goes with them
        return dw1, dw3
