"""Row scatter: dst[dst_row[i]] = src[i] for every i with dst_row[i] >= 0.

The EP exchange's one data-movement kernel: a sender stores its token rows (or routing
metadata, or returned partial rows) straight into a receive region, which with symmetric memory
is the peer GPU's own buffer (NVLink peer stores through a UVA pointer). Rows whose destination
is -1 (the token has no expert on that rank) are neither loaded nor stored, so only the rows
the receiver needs cross the link. Any dtype: bf16 token rows, int32 metadata, fp32 weights.

Tiles: BLOCK_N rows x BLOCK_W columns per program, 2-D grid (rows, columns).
Waits on: nothing (stream order). Signals: nothing; the exchange's barrier publishes the stores.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _scatter_rows_kernel(
    src_ptr,
    dst_ptr,
    dst_row_ptr,
    N,
    W,
    stride_src,
    stride_dst,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    dest = tl.load(dst_row_ptr + rows, mask=rows < N, other=-1)
    live = (dest >= 0)[:, None] & (cols < W)[None, :]
    vals = tl.load(src_ptr + rows.to(tl.int64)[:, None] * stride_src + cols[None, :], mask=live)
    tl.store(dst_ptr + dest.to(tl.int64)[:, None] * stride_dst + cols[None, :], vals, mask=live)


def scatter_rows(src: torch.Tensor, dst: torch.Tensor, dst_row: torch.Tensor) -> torch.Tensor:
    """Store row i of ``src`` [N, W] into row ``dst_row[i]`` of ``dst`` [M, W] (skipped where
    dst_row[i] < 0). Destinations must be unique among live rows (the result is then
    deterministic); ``dst`` may live on a peer GPU. Returns ``dst``."""
    N, W = src.shape
    if dst.dim() != 2 or dst.shape[1] != W or dst.dtype != src.dtype:
        raise ValueError(
            f"scatter_rows: dst {tuple(dst.shape)} {dst.dtype} does not take rows of src "
            f"{tuple(src.shape)} {src.dtype}"
        )
    if dst_row.shape != (N,):
        raise ValueError(f"scatter_rows: dst_row must be [{N}], got {tuple(dst_row.shape)}")
    if N == 0:
        return dst
    assert src.stride(1) == 1 and dst.stride(1) == 1 and dst_row.is_contiguous()
    # 16-byte vectors per thread on wide rows; a whole short metadata row in one tile.
    block_w = min(triton.next_power_of_2(W), 1024)
    block_n = max(1, min(16, 4096 // block_w))
    grid = (triton.cdiv(N, block_n), triton.cdiv(W, block_w))
    _scatter_rows_kernel[grid](
        src, dst, dst_row, N, W, src.stride(0), dst.stride(0),
        BLOCK_N=block_n, BLOCK_W=block_w, num_warps=4,
    )
    return dst
