"""EP=1 forward in blockwise FP8: plan -> x quantized per token -> GEMM 1 + SwiGLU (h quantized
in its epilogue) -> GEMM 2 -> the bf16 path's fp32 combine.

    plan          build_plan with 128-row segments (tiles.FP8_BLOCK_M: the backward's
                  weight-gradient scales must not straddle experts)
    quant         x [T, D] -> e4m3 + [T, D/128] scales, once per token (not per expert slot);
                  the weights -> 128 x 128 blocks (fp8_weights.forward_weights)
    fp8_gemm1_swiglu  sides/fp8_gemm.fp8_gemm1_swiglu: token rows gathered by the plan,
                  h [R_max, H] e4m3 with [R_max, H/128] scales, and with ``save`` a = [a1 | a3]
                  bf16 (the same saved layout as the bf16 forward, so the backward is shared)
    fp8_gemm2     sides/fp8_gemm.fp8_gemm_rows: y [R_max, D] bf16 in the row space
    combine       kernels/combine.combine: out[t] = sum_k w[t,k] y[slot_row], fp32, fixed k order
Saved for the backward (``save``): (a, packed plan), as bf16_forward.forward_bf16 saves.
"""

from torchtitan_megamoe.ops.hopper.bf16_forward import checked_plan
from torchtitan_megamoe.ops.hopper.fp8_weights import dense_weights, forward_weights
from torchtitan_megamoe.ops.hopper.tiles import FP8_BLOCK_M
from torchtitan_megamoe.ops.hopper.kernels.combine import combine
from torchtitan_megamoe.ops.hopper.sides.fp8_gemm import fp8_gemm1_swiglu, fp8_gemm_rows
from torchtitan_megamoe.ops.hopper.kernels.fp8_quant import quant_rows
from torchtitan_megamoe.ops.hopper.plan import pack_plan


def forward_fp8(x, topk_ids, topk_weights, w1, w2, w3, weight_cache=False, save=False):
    """out, or (out, (a, packed_plan)) with ``save``; ``weight_cache``: keep the quantized
    weights until the next optimizer step (fp8_weights.py)."""
    xq, xs = quant_rows(x.contiguous())
    return forward_fp8_rows(xq, xs, topk_ids, topk_weights, w1, w2, w3, x.dtype, weight_cache,
                            save)


def forward_fp8_rows(xq, xs, topk_ids, topk_weights, w1, w2, w3, out_dtype, weight_cache=False,
                     save=False, out=None, plan=None, a_out=None, live=None):
    """forward_fp8 of token rows already quantized (e4m3 rows, 1x128 scales: what the EP
    exchange delivers); ``out_dtype``: x's; ``out``: where the combine stores (as combine's);
    ``plan``: topk_ids' plan at FP8_BLOCK_M, already built (ids checked), or None; ``a_out``:
    where GEMM 1's pre-activations go with ``save`` (None: a new tensor); ``live``: as
    combine's."""
    E = w1.shape[0]
    w1, w2, w3 = dense_weights(weight_cache, w1, w2, w3)
    if plan is None:
        plan = checked_plan(topk_ids, E, FP8_BLOCK_M)
    wq = forward_weights(w1, w2, w3, cache=weight_cache, dtype=out_dtype)
    hq, hs, a = fp8_gemm1_swiglu(xq, xs, wq.w1q, wq.w1s, wq.w3q, wq.w3s, plan, save_a=save,
                                 a_out=a_out)
    del xq, xs
    y = fp8_gemm_rows(hq, hs, wq.w2q, wq.w2s, plan, out_dtype=out_dtype, stage="fp8_gemm2")
    del hq, hs, wq
    out = combine(y, topk_weights.contiguous(), plan.slot_row, out_dtype, out=out, live=live)
    if not save:
        return out
    return out, (a, pack_plan(plan))
