"""EP=1 backward in blockwise FP8 (precision ``fp8`` and ``fp8_bwd``): the data-gradient GEMMs
in e4m3, the weight gradients in bf16 (faster than FP8 ones at the Qwen3 shapes, and they need
no transposed quantization of x and dy). MEGAMOE_FP8_WGRAD=1 takes them in FP8 too.

    plan       unpacked from what the forward saved, or rebuilt (128-row segments)
    a          the forward's saved [a1 | a3] (bf16), or GEMM 1 again (the forward's own kernel:
               FP8 for ``fp8``, bf16 for ``fp8_bwd``) when nothing was saved
    quant      dy [T, D] per token (1x128); the weights' transposed 128 x 128 copies
               (fp8_weights.w2_transposed, fp8_weights.w13_transposed: each made right before
               its GEMM, so the two are never live together)
    fp8_dgrad2 dh rows = dy_rows @ w2[e] (sides/fp8_gemm.fp8_gemm_rows on the token rows,
               gathered by the plan: our kernels or DeepGEMM, whichever the tuner times faster);
               MEGAMOE_FP8_FUSED_DGRAD2=1: with swiglu_bwd in one sm90 launch, dh never stored
               (cuda/dgrad2_swiglu.fp8_dgrad2_swiglu_rows_sm90)
    swiglu_bwd kernels/swiglu_bwd_rows: da = [da1 | da3] and hw = w*h in bf16 for the weight
               gradients, da again in e4m3 per row for fp8_dgrad1, the d(topk_weights) partials
    wgrad_dw2  bf16_backward.WeightGrads: the bf16 path's weight-gradient stages and picks
    fp8_dgrad1 dx rows [R_max, D] = [da1 | da3] @ [w1; w3] (fp8_gemm_rows), then the bf16
               path's bwd_combine: dx[t] = sum_k in fixed order, d(topk_weights) from the
               partials. Without the weight cache, by groups of experts (dgrad1_groups): the
               transposed copy of one group at a time, so the backward's peak stays under the
               bf16 path's
    wgrad_dw13 last, as in the bf16 path: only da (bf16) is left besides the gradients

All-FP8 (MEGAMOE_FP8_WGRAD=1): sides/fp8_gemm.fp8_dgrad2_swiglu fuses dgrad2 with the SwiGLU
backward and writes da^T and h^T per 128 rows; (w * dy)^T and x^T are quantized per 128 rows
(kernels/fp8_quant.quant_rows_t) for sides/fp8_wgrad.fp8_wgrad.
Deterministic: fixed-order reductions, no atomics.
"""

import torch

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper.bf16_backward import WeightGrads, release, tuner_key
from torchtitan_megamoe.ops.hopper.cuda.dgrad2_swiglu import fp8_dgrad2_swiglu_rows_sm90
from torchtitan_megamoe.ops.hopper.cuda.sm90 import fp8_shape_supported
from torchtitan_megamoe.ops.hopper.fp8_weights import (
    dense_weights, forward_weights, w2_transposed, w13_transposed,
)
from torchtitan_megamoe.ops.hopper.heuristics import forward_configs
from torchtitan_megamoe.ops.hopper.tiles import FP8_BLOCK_M
from torchtitan_megamoe.ops.hopper.kernels.bwd_combine import bwd_combine
from torchtitan_megamoe.ops.hopper.sides.fp8_gemm import (
    fp8_dgrad2_swiglu, fp8_gemm1_swiglu, fp8_gemm_rows,
)
from torchtitan_megamoe.ops.hopper.kernels.fp8_quant import dequant_rows, quant_rows, quant_rows_t
from torchtitan_megamoe.ops.hopper.kernels.grouped_mm import gather_rows
from torchtitan_megamoe.ops.hopper.sides.fp8_wgrad import fp8_wgrad
from torchtitan_megamoe.ops.hopper.sides.table import available
from torchtitan_megamoe.ops.hopper.sides.wgrad import Into
from torchtitan_megamoe.ops.hopper.sides.gemm1_swiglu import gemm1_swiglu
from torchtitan_megamoe.ops.hopper.kernels.swiglu_bwd_rows import swiglu_bwd_rows
from torchtitan_megamoe.ops.hopper.kernels.wgrad import longest_first
from torchtitan_megamoe.ops.hopper.plan import build_plan, unpack_plan


def backward_fp8(grad_out, x, topk_ids, topk_weights, w1, w2, w3, recipe, weight_cache=False,
                 saved=None, grad_fp8=None, into=None, release_saved=False, on_dx=None,
                 live=None, keep=None, grads_like=None):
    """(dx, dtopk_weights, dw1, dw2, dw3); ``recipe``: the call's (ops/recipe.py): whether
    the forward's GEMM 1 ran in FP8, for the recompute when nothing was ``saved``, and whether
    the weight gradients run in FP8. ``grad_fp8``: grad_out already quantized (e4m3 rows, 1x128
    scales: what the EP exchange delivers); grad_out is then None (the weight gradients read
    their dequantized values, gathered into the row space in one pass) or those values.
    ``into``, ``release_saved``, ``on_dx``, ``live``, ``keep``, ``grads_like``: as in
    bf16_backward.backward_bf16 (``keep``: bf16 weight gradients only), and the same stage
    order (dw1 and dw3 last)."""
    T, D = x.shape
    E, H, _ = w1.shape
    if T == 0:
        return (torch.empty_like(x), torch.empty_like(topk_weights),
                *Into.zeros(into, grads_like or (w1, w2, w3)))
    params = into.outs if into else (grads_like or (w1, w2, w3))
    dy = None if grad_out is None else grad_out.contiguous()
    x = x.contiguous()
    w1, w2, w3 = dense_weights(weight_cache, w1, w2, w3)
    if saved:
        a_saved, packed = saved
        plan = unpack_plan(packed, T, topk_ids.shape[1], E, FP8_BLOCK_M)
    else:
        plan = build_plan(topk_ids, E, FP8_BLOCK_M)
        a_saved = recompute_a(x, w1, w2, w3, plan, recipe.fp8_forward, weight_cache)
    tw = topk_weights.contiguous()

    gq, gs = quant_rows(dy) if grad_fp8 is None else grad_fp8
    w2t = w2_transposed(w2, cache=weight_cache, dtype=x.dtype)
    if recipe.fp8_wgrad(settings.fp8_wgrad()):  # fused dgrad2 + SwiGLU backward writing the FP8 wgrad operands
        if keep is not None:
            raise ValueError("backward_fp8: keep needs the bf16 weight gradients")
        daq, das, daTq, daTs, hTq, hTs, part = fp8_dgrad2_swiglu(gq, gs, w2t.q, w2t.s,
                                                                 a_saved, tw, plan)
        if release_saved:
            release(a_saved)
        if dy is None:
            dy = dequant_rows(gq, gs)
        del gq, gs, a_saved, w2t
        dw1, dw2, dw3 = _fp8_weight_grads(daTq, daTs, hTq, hTs, dy, x, tw, params, plan, into)
        del daTq, daTs, hTq, hTs
        grads = None
    else:
        # dw2's dy rows without a dequantized dy: dequantized in the gather
        dy_rows = None if dy is not None else gather_rows(gq, plan, scales=gs)
        if _fused_dgrad2(gq, w2t, a_saved, plan, x.dtype):
            da, hw, part, daq, das = fp8_dgrad2_swiglu_rows_sm90(
                gq, gs, w2t.q, w2t.s, a_saved, tw.reshape(-1).to(torch.float32), plan,
                out=None if keep is None else (keep.da, None, None))
            del gq, gs, w2t
        else:
            dh = fp8_gemm_rows(gq, gs, w2t.q, w2t.s, plan, out_dtype=x.dtype, gather=True,
                               stage="fp8_dgrad2")
            del gq, gs, w2t
            out = None
            if keep is not None:  # keep.da is a: swiglu_bwd_rows reads each block first
                out = (keep.da, torch.empty_like(dh),
                       torch.empty((1, plan.max_rows), dtype=torch.float32, device=dh.device))
            da, hw, part, daq, das = swiglu_bwd_rows(dh, a_saved, tw, plan, quant=True, out=out)
            del dh
        if release_saved:
            release(a_saved)
        del a_saved
        acts = {"hw": hw, "dy_rows": dy_rows}
        del hw, dy_rows
        key = tuner_key(plan.max_rows, D, H, E, FP8_BLOCK_M, settings.bwd_impl())
        grads = WeightGrads(dy, x, da, acts, plan, params, key, FP8_BLOCK_M, into, keep)
        del da
        dw2 = grads.dw2()
    dx_rows = torch.empty((plan.max_rows, D), dtype=x.dtype, device=x.device)
    groups = dgrad1_groups(E, H, D, plan.max_rows, weight_cache)
    for lo, hi in groups:
        w13t = w13_transposed(w1, w3, lo, hi, cache=weight_cache, dtype=x.dtype)
        fp8_gemm_rows(daq, das, w13t.q, w13t.s, plan, out_dtype=x.dtype, out=dx_rows,
                      expert_base=lo if len(groups) > 1 else None, stage="fp8_dgrad1")
        del w13t
    del daq, das
    dx, dtw = bwd_combine(dx_rows, part, plan, dx_dtype=x.dtype, dtw_dtype=topk_weights.dtype,
                          rows=True, live=live)
    if on_dx is not None:
        on_dx(dx, dtw)
    if grads is not None:
        del dx_rows, part
        dw1, dw3 = grads.dw13()
    return dx, dtw, dw1, dw2, dw3


def _fused_dgrad2(gq, w2t, a_saved, plan, dtype) -> bool:
    """Whether fp8_dgrad2 and swiglu_bwd run as one sm90 launch (MEGAMOE_FP8_FUSED_DGRAD2=1,
    the CUDA kernels usable here, shapes and dtypes they take); with ``keep``, da then goes
    over a as well (keep.da is a: each element is read before its thread writes it)."""
    return (settings.fp8_fused_dgrad2() and available(gq).sm90
            and dtype == torch.bfloat16 and a_saved.dtype == torch.bfloat16
            and fp8_shape_supported(w2t.q.shape[1], w2t.q.shape[2], plan.block_m))


def _fp8_weight_grads(daTq, daTs, hTq, hTs, dy, x, tw, params, plan, into=None):
    """(dw1, dw2, dw3) of the all-FP8 recipe, from fp8_dgrad2_swiglu's transposed operands
    (bf16 GEMM outputs, then moved into or added to ``into``'s)."""
    H = params[0].shape[1]
    order = longest_first(plan)
    dyTq, dyTs = quant_rows_t(dy, plan, gather=True, row_weight=tw.reshape(-1))
    dw2 = fp8_wgrad(dyTq, dyTs, hTq, hTs, plan, torch.empty_like(params[1]), order)
    del dyTq, dyTs
    xTq, xTs = quant_rows_t(x, plan, gather=True)
    dw1 = fp8_wgrad(daTq[:H], daTs[:H], xTq, xTs, plan, torch.empty_like(params[0]), order)
    dw3 = fp8_wgrad(daTq[H:], daTs[H:], xTq, xTs, plan, torch.empty_like(params[2]), order)
    if into is None:
        return dw1, dw2, dw3
    for out, g in zip(into.outs, (dw1, dw2, dw3)):
        if into.accumulate:
            out.add_(g)
        else:
            out.copy_(g)
    return into.outs


def dgrad1_groups(E: int, H: int, D: int, rows: int, weight_cache) -> list[tuple[int, int]]:
    """Expert ranges of fp8_dgrad1: each group's transposed [w1 | w3] copy (E_g * D * 2H bytes)
    at most rows * H bytes, half of what da in e4m3 saves over bf16. One group where the layer's
    copies are given (``weight_cache``: an Fp8Weights): its transposed copy is held, or made
    whole from the forward copy in one byte transpose, and DeepGEMM (offered for one launch
    only) runs it."""
    if weight_cache:
        return [(0, E)]
    n = min(E, -(-(E * D * 2 * H) // max(rows * H, 1)))
    size = -(-E // n)
    return [(lo, min(lo + size, E)) for lo in range(0, E, size)]


def recompute_a(x, w1, w2, w3, plan, fp8_forward, weight_cache, out=None, skip=None):
    """GEMM 1's [a1 | a3] as the forward computed it (same kernel, same arithmetic); ``out``:
    the a to write (the rows of tiles whose tile_expert is -1 are then left as they are by our
    kernels, zeroed by DeepGEMM's). ``skip``: a 0-d device bool, true where every tile of the
    plan is -1 (x is then not quantized)."""
    if fp8_forward:
        xq, xs = quant_rows(x, skip=skip)
        wq = forward_weights(w1, w2, w3, cache=weight_cache, dtype=x.dtype)
        _hq, _hs, a = fp8_gemm1_swiglu(xq, xs, wq.w1q, wq.w1s, wq.w3q, wq.w3s, plan, save_a=True,
                                       a_out=out)
        return a
    g1_config, _ = forward_configs(None, None, plan.block_m, w1.shape[2], w1.shape[1])
    if out is not None:
        out = (torch.empty((plan.max_rows, w1.shape[1]), dtype=x.dtype, device=x.device), out)
    _h, a = gemm1_swiglu(x, w1, w3, plan, config=g1_config, save_a=True, out=out)
    return a
