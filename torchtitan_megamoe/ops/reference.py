"""Reference backend of ``mega_moe``: plain PyTorch, any device, EP through torch.distributed.

Written for clarity; it is the oracle every faster backend is tested against and the CPU path of
CI. Vectorized over tokens (the only Python loop is over local experts). All expert math runs in
fp32 (fp64 for fp64 inputs); only the results are rounded to the input dtypes.

Data flow with an expert-parallel group of R ranks:
  1. valid slots (t, k) sorted by global expert id (stable, so deterministic): this groups them by
     destination rank, then by local expert;
  2. all_to_all of the token rows and their local expert ids (split sizes exchanged first: the
     reference syncs with the host, the hopper backend does not); a rank bringing more tokens
     than ``options.max_tokens_per_rank`` (when set) fails every rank, as on the hopper backend;
  3. each rank runs its local experts on what it received;
  4. the reverse all_to_all returns each row to its source slot; out = sum_k w[t,k] * y[t,k]
     in fp32, in fixed k order.

Backward saves nothing but the inputs: it re-dispatches x, dy and the routing weights the same
way, recomputes linear 1 per expert, and returns dx rows and d(topk_weights) to their source
slots by the reverse exchange; dx is summed over k in fixed order (bitwise deterministic).

precision: ``bf16`` computes in fp32 as above. ``fp8`` rounds the operands of the forward GEMMs
and of the backward's data-gradient GEMMs through e4m3 (1x128 blocks for activations and
gradients, 128x128 blocks for weights, amax scaling); ``fp8_bwd`` does so in the backward's
data-gradient GEMMs only. The weight gradients take unrounded operands (the kernels run them in
bf16), unless MEGAMOE_FP8_WGRAD=1 (settings.fp8_wgrad: the all-FP8 recipe, operands in 1x128
blocks along the token axis). In all FP8 recipes the backward reads GEMM 1's pre-activations
rounded to the input dtype, as the kernels save them. With FP8 data gradients and an EP group,
dy crosses ranks as e4m3 rows (1x128 scales) and is read back in its dtype, so the weight
gradients see it rounded too; x's forward rounding is the forward GEMM's own. This emulates the arithmetic of the FP8
kernels so they can be tested against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.groups import group_size
from torchtitan_megamoe.ops.recipe import SCALE_BLOCK
from torchtitan_megamoe.ops.reference_ep import AllToAllRoute, slot_rows

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_BLOCK = SCALE_BLOCK


def supports(x: torch.Tensor, group) -> bool:
    return True


def forward(x, topk_ids, topk_weights, w1, w2, w3, group, options, save=False):
    """out; with ``save``, (out, []): this backend saves nothing (its backward recomputes)."""
    T, K = topk_ids.shape
    route = AllToAllRoute(topk_ids, w1.shape[0], group, options.max_tokens_per_rank)
    rows = route.dispatch(slot_rows(x, K, route.slots))
    y = route.combine(_experts_forward(rows, route.local_expert, w1, w2, w3,
                                      options.recipe.fp8_forward))
    y_slots = route.to_slots(y, T * K)
    # a dropped slot contributes nothing, whatever its weight holds (even NaN)
    weights = topk_weights.to(y_slots.dtype).masked_fill(topk_ids < 0, 0).unsqueeze(-1)
    # explicit row width: with T = 0 tokens a -1 in view() would be ambiguous
    out = (weights * y_slots.view(T, K, y_slots.shape[-1])).sum(dim=1).to(x.dtype)
    return (out, []) if save else out


def saved_like(x, topk_ids, topk_weights, w1, w2, w3, group, options):
    return []


def backward(grad_out, x, topk_ids, topk_weights, w1, w2, w3, group, options, saved=None):
    if saved:
        raise ValueError("backend 'reference' saves nothing in its forward; pass saved=None")
    recipe = options.recipe
    T, K = topk_ids.shape
    route = AllToAllRoute(topk_ids, w1.shape[0], group, options.max_tokens_per_rank)
    rows = route.dispatch(slot_rows(x, K, route.slots))
    if recipe.fp8_dgrad and group_size(group) > 1:
        # dy travels between ranks as e4m3 rows (1x128 scales), read back in its dtype
        grad_out = quantize_dequantize_fp8(grad_out.float(), ACT).to(grad_out.dtype)
    grad_rows = route.dispatch(slot_rows(grad_out, K, route.slots))
    row_weights = route.dispatch(topk_weights.reshape(-1)[route.slots].unsqueeze(1))
    dx_rows, dweight_rows, dw1, dw2, dw3 = _experts_backward(
        rows, grad_rows, row_weights, route.local_expert, w1, w2, w3,
        fp8_fwd=recipe.fp8_forward, fp8_bwd=recipe.fp8_dgrad,
        fp8_wgrad=recipe.fp8_wgrad(settings.fp8_wgrad()),
    )
    dx_slots = route.to_slots(route.combine(dx_rows), T * K)
    dx = dx_slots.view(T, K, dx_slots.shape[-1]).sum(dim=1)
    dweights = route.to_slots(route.combine(dweight_rows), T * K).view(T, K)
    return (
        dx.to(x.dtype),
        dweights.to(topk_weights.dtype),
        dw1.to(w1.dtype),
        dw2.to(w2.dtype),
        dw3.to(w3.dtype),
    )


# --------------------------------------------------------------------------- expert math


def _acc_dtype(t):
    return torch.promote_types(t.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs


def _by_expert(local_expert, num_local_experts):
    for e in range(num_local_experts):
        idx = torch.nonzero(local_expert == e).squeeze(1)
        if idx.numel():
            yield e, idx


def _experts_forward(rows, local_expert, w1, w2, w3, fp8):
    """SwiGLU MLP of each row's local expert; rows in and out in the same order."""
    acc = _acc_dtype(rows)
    y = torch.zeros(rows.shape[0], w2.shape[1], dtype=acc, device=rows.device)
    for e, idx in _by_expert(local_expert, w1.shape[0]):
        xe = rows[idx].to(acc)
        a1 = _mm(xe, w1[e].to(acc), fp8)
        a3 = _mm(xe, w3[e].to(acc), fp8)
        y[idx] = _mm(F.silu(a1) * a3, w2[e].to(acc), fp8)
    return y


def _experts_backward(rows, grad_rows, row_weights, local_expert, w1, w2, w3, fp8_fwd, fp8_bwd,
                      fp8_wgrad=False):
    """Gradients of ``sum_rows <grad_row, weight_row * y_row>``: per row dx and d(weight), and
    the summed weight gradients of each local expert (fp32 or wider). ``fp8_bwd``: the dgrad
    GEMMs' operands through e4m3; ``fp8_wgrad``: the weight-gradient GEMMs' too."""
    acc = _acc_dtype(rows)
    n = rows.shape[0]
    dx = torch.zeros(n, rows.shape[1], dtype=acc, device=rows.device)
    dweight = torch.zeros(n, 1, dtype=acc, device=rows.device)
    dw1 = torch.zeros(w1.shape, dtype=acc, device=rows.device)
    dw2 = torch.zeros(w2.shape, dtype=acc, device=rows.device)
    dw3 = torch.zeros(w3.shape, dtype=acc, device=rows.device)
    for e, idx in _by_expert(local_expert, w1.shape[0]):
        xe, ge = rows[idx].to(acc), grad_rows[idx].to(acc)
        w1e, w2e, w3e = w1[e].to(acc), w2[e].to(acc), w3[e].to(acc)
        a1, a3 = _mm(xe, w1e, fp8_fwd), _mm(xe, w3e, fp8_fwd)
        if fp8_bwd:
            # the FP8 recipe keeps GEMM 1's pre-activations in the input dtype (what the
            # kernels save for the backward), so the backward's quantizations see those values
            a1, a3 = a1.to(rows.dtype).to(acc), a3.to(rows.dtype).to(acc)
        silu_a1 = F.silu(a1)
        h = silu_a1 * a3
        dy = row_weights[idx].to(acc) * ge  # gradient reaching this slot's expert output
        dh = _dgrad(dy, w2e, fp8_bwd)
        # d(weight) = <grad, y> = <grad @ w2e, h>: reuses the dgrad GEMM instead of recomputing y
        dweight[idx] = (_dgrad(ge, w2e, fp8_bwd) * h).sum(dim=1, keepdim=True)
        sig = torch.sigmoid(a1)
        da1 = dh * a3 * sig * (1 + a1 * (1 - sig))  # silu'(a) = sig(a) * (1 + a * (1 - sig(a)))
        da3 = dh * silu_a1
        dx[idx] = _dgrad(da1, w1e, fp8_bwd) + _dgrad(da3, w3e, fp8_bwd)
        dw2[e] = _wgrad(dy, h, fp8_wgrad)
        dw1[e] = _wgrad(da1, xe, fp8_wgrad)
        dw3[e] = _wgrad(da3, xe, fp8_wgrad)
    return dx, dweight, dw1, dw2, dw3


# --------------------------------------------------------------------------- fp8 emulation


def quantize_dequantize_fp8(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Round a 2-D tensor through e4m3 with one amax scale per ``block`` (rows x cols).

    Edges that do not fill a block are zero-padded, as the kernels' tiles are."""
    rows, cols = t.shape
    br, bc = block
    pr, pc = (-rows) % br, (-cols) % bc
    tp = F.pad(t, (0, pc, 0, pr)) if (pr or pc) else t
    blocks = tp.reshape(tp.shape[0] // br, br, tp.shape[1] // bc, bc)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (blocks / scale).to(torch.float8_e4m3fn).to(t.dtype) * scale
    return q.reshape(tp.shape)[:rows, :cols]


ACT = (1, FP8_BLOCK)  # activations and gradients: one scale per 128 values along a row
WEIGHT = (FP8_BLOCK, FP8_BLOCK)  # weights: one scale per 128x128 tile


def _mm(a, w, fp8):
    """Forward GEMM ``a @ w.T``: a in 1x128 blocks along the contraction, w in 128x128."""
    if fp8:
        return quantize_dequantize_fp8(a, ACT) @ quantize_dequantize_fp8(w, WEIGHT).t()
    return a @ w.t()


def _dgrad(g, w, fp8):
    """Data-gradient GEMM ``g @ w``: g in 1x128 blocks, w in 128x128 blocks."""
    if fp8:
        return quantize_dequantize_fp8(g, ACT) @ quantize_dequantize_fp8(w, WEIGHT)
    return g @ w


def _wgrad(g, a, fp8):
    """Weight-gradient GEMM ``g.T @ a``, contracting over rows: both in 1x128 blocks along
    the row (token) dim."""
    if fp8:
        return quantize_dequantize_fp8(g.t(), ACT) @ quantize_dequantize_fp8(a.t(), ACT).t()
    return g.t() @ a
