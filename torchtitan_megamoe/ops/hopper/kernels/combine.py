"""Combine: out[t] = sum_k w[t,k] * y[slot_row[t*K+k]] in fp32, k in fixed order (deterministic).

Tiles: BLOCK_T tokens x BLOCK_D columns per program; K is unrolled. y is GEMM 2's row-space
output [R_max, D]; slot s's row is slot_row[s]. A slot with slot_row == -1 (dropped, or expert
not local) contributes exactly 0 and nothing is loaded for it.

With ``returned`` (the EP forward's own region, after the exchange's barrier) it also adds the
partial rows the other ranks returned, in rank order: sum_partials.py folded into this launch.

Waits on: nothing inside the launch (y is complete when GEMM 2's launch is).
Signals: nothing.
"""

import torch
import triton
import triton.language as tl

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper.kernels.sum_partials import add_partials
from torchtitan_megamoe.ops.hopper.kernels.tiling import cast_out, cdiv, next_power_of_2


@triton.jit
def _combine_kernel(
    y_ptr,
    w_ptr,
    slot_row_ptr,
    out_ptr,
    part_ptr,
    pos_ptr,
    T,
    D,
    stride_y,
    stride_w,
    stride_out,
    stride_part_r,
    stride_part_row,
    stride_pos,
    ME,
    R: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
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
    if R > 1:
        # EP: add the partial rows the other ranks returned, ranks in fixed order 0..R-1 (this
        # rank's own partial, acc, at position ME); ranks a token did not go to are skipped
        acc = add_partials(acc, part_ptr, pos_ptr, toks, cols, in_t, in_d, stride_part_r,
                           stride_part_row, stride_pos, ME, R)
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
    returned: tuple | None = None,
) -> torch.Tensor:
    """out [T, D] in out_dtype from GEMM 2's rows y [R_max, D] and the slots' rows slot_row
    [T*K]. ``out``: where to store (any [T, D] tensor with unit column stride, e.g. a peer
    rank's receive region: the stores then travel over NVLink). ``returned`` = (part [R, C, D],
    pos [T, R], me): the EP source's last step folded in, out[t] = sum over ranks r in order of
    (this combine's fp32 row if r == me, else part[r, pos[t, r]] where pos[t, r] >= 0)."""
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
    part, pos, me = returned if returned is not None else (out, slot_row, 0)
    R = part.shape[0] if returned is not None else 1
    if returned is not None:
        assert part.dim() == 3 and part.stride(2) == 1 and pos.shape == (T, R) and pos.stride(1) == 1
    _combine_kernel[grid](
        y, topk_weights, slot_row, out, part, pos,
        T, D, y.stride(0), topk_weights.stride(0), out.stride(0),
        part.stride(0) if R > 1 else 0, part.stride(1) if R > 1 else 0,
        pos.stride(0) if R > 1 else 0, me, R=R,
        TOP_K=K, BLOCK_T=block_t, BLOCK_D=block_d, EMULATE_RTNE=settings.triton_interpreting(),
        num_warps=4,
    )
    return out
