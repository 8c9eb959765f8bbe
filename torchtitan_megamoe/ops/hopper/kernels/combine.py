"""Combine: out[t] = sum_k w[t,k] * y[slot_row[t*K+k]] in fp32, k in fixed order (deterministic).

Tiles: BLOCK_T tokens x BLOCK_D columns per program; K is unrolled. y is GEMM 2's row-space
output [R_max, D]; slot s's row is slot_row[s]. A slot with slot_row == -1 (dropped, or expert
not local) contributes exactly 0 and nothing is loaded for it.

Waits on: nothing inside the launch (y is complete when GEMM 2's launch is).
Signals: nothing.
"""

import torch
import triton
import triton.language as tl

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper.kernels.tiling import cast_out, cdiv, next_power_of_2


@triton.jit
def _combine_kernel(
    y_ptr,
    w_ptr,
    slot_row_ptr,
    out_ptr,
    T,
    D,
    stride_y,
    stride_w,
    stride_out,
    live_ptr,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
    LIVE: tl.constexpr,
):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    if LIVE:
        in_t = toks < tl.minimum(T, tl.load(live_ptr))
    else:
        in_t = toks < T
    in_d = cols < D
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        slot = toks.to(tl.int64) * TOP_K + k
        row = tl.load(slot_row_ptr + slot, mask=in_t, other=-1)
        live = in_t & (row >= 0)
        w = tl.load(w_ptr + toks.to(tl.int64) * stride_w + k, mask=live, other=0.0).to(tl.float32)
        y = tl.load(
            y_ptr + row.to(tl.int64)[:, None] * stride_y + cols[None, :],
            mask=live[:, None] & in_d[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += w[:, None] * y
    out_ptrs = out_ptr + toks[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out_ptrs, cast_out(acc, out_ptr.dtype.element_ty, EMULATE_RTNE),
             mask=in_t[:, None] & in_d[None, :])


def combine(
    y: torch.Tensor,
    topk_weights: torch.Tensor,
    slot_row: torch.Tensor,
    out_dtype: torch.dtype,
    block_t: int = 4,
    block_d: int = 512,
    out: torch.Tensor | None = None,
    live: torch.Tensor | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """out [T, D] in out_dtype from GEMM 2's rows y [R_max, D] and the slots' rows slot_row
    [T*K]. ``out``: where to store (any [T, D] tensor with unit column stride, e.g. the EP
    forward's own return region). ``live``: a 1-element int32 device count n: only tokens
    t < n are combined, the other rows of out are left as they are (an EP peer region's rows
    past the ones it sent)."""
    T, K = topk_weights.shape
    D = y.shape[1]
    assert slot_row.shape == (T * K,) and y.stride(1) == 1 and topk_weights.stride(1) == 1
    if out is None:
        out = torch.empty((T, D), dtype=out_dtype, device=y.device)
    assert out.shape == (T, D) and out.stride(1) == 1 and out.dtype == out_dtype
    if T == 0:
        return out
    block_d = min(block_d, next_power_of_2(D))
    grid = (cdiv(T, block_t), cdiv(D, block_d))
    _combine_kernel[grid](
        y, topk_weights, slot_row, out, T, D, y.stride(0), topk_weights.stride(0), out.stride(0),
        slot_row if live is None else live,
        TOP_K=K, BLOCK_T=block_t, BLOCK_D=block_d, EMULATE_RTNE=settings.triton_interpreting(),
        LIVE=live is not None, num_warps=num_warps,
    )
    return out
