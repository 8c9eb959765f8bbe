"""The EP forward's store of GEMM 1's pre-activations: one static slot of S rows per region, so
GEMM 1 writes a region's rows where the backward reads them (no copy in or out).

Region i (in compute order) owns rows [i*S, (i+1)*S) of the store, and its GEMMs see the view
``slot_view(store, i, S, M)`` = rows [i*S, i*S + M), M the rows one region can need. A region
whose rows in use exceed S spills into the slots after it, which the regions after it then
overwrite with their own: it is not kept, and the backward recomputes it. The store is
(R-1)*S + M rows, so every view lies inside it.

    kept_slots(used, S)                 [R] bool on the device, in the backward's order: region
                                        i is kept when used[i] <= S and no region before it was
                                        written again past i*S (a recomputed region's rows go
                                        back into its view, and may spill too)
    copy_unkept(src, dst, count, kept)  dst[j] = src[j], j < count, unless ``kept`` (the
                                        recomputed rows of a region that was not kept)

Region sizes are known on the device only: both run without a host sync. Rows move as 32-bit
words (kernels/ep_copy.words). Waits on: nothing inside a launch (stream order). Signals:
nothing."""

import torch
import triton
import triton.language as tl

from torchtitan_megamoe.ops.hopper.kernels.ep_copy import words
from torchtitan_megamoe.ops.hopper.kernels.tiling import cdiv, next_power_of_2


def slot_view(store: torch.Tensor, i: int, S: int, M: int) -> torch.Tensor:
    """Region i's rows of the store: [i*S, i*S + M)."""
    if i * S + M > store.shape[0]:
        raise ValueError(f"row_store: slot {i} of {S} rows (views of {M}) is past the store's "
                         f"{store.shape[0]} rows")
    return store[i * S: i * S + M]


@triton.jit
def _kept_slots_kernel(used_ptr, kept_ptr, S, R: tl.constexpr):
    # a recomputed region writes its rows into its view again: where they reach past the next
    # slot's start, that slot's rows are gone too
    reach = (S * 0).to(tl.int64)
    for i in range(R):
        used = tl.load(used_ptr + i).to(tl.int64)
        start = i * S.to(tl.int64)
        keep = (used <= S) & (reach <= start)
        tl.store(kept_ptr + i, keep.to(tl.int8))
        reach = tl.where(keep, reach, tl.maximum(reach, start + used))


def kept_slots(used: torch.Tensor, S: int) -> torch.Tensor:
    """[R] bool: which regions' rows (``used``: [R] int32, rows in use per region, padding
    included, in slot order) the backward finds in their slots."""
    if used.dim() != 1 or used.dtype != torch.int32:
        raise ValueError(f"row_store: used must be [R] int32, got {tuple(used.shape)} {used.dtype}")
    kept = torch.empty(used.shape, dtype=torch.int8, device=used.device)
    _kept_slots_kernel[(1,)](used.contiguous(), kept, S, R=used.numel(), num_warps=1)
    return kept.view(torch.bool)


@triton.jit
def _copy_unkept_kernel(src_ptr, dst_ptr, count_ptr, kept_ptr, W, stride_src, stride_dst,
                        BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    n = tl.where(tl.load(kept_ptr) != 0, 0, tl.load(count_ptr))
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if tl.program_id(0) * BLOCK_R < n:
        cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        m = (rows < n)[:, None] & (cols < W)[None, :]
        v = tl.load(src_ptr + rows.to(tl.int64)[:, None] * stride_src + cols[None, :], mask=m)
        tl.store(dst_ptr + rows.to(tl.int64)[:, None] * stride_dst + cols[None, :], v, mask=m)


def copy_unkept(src: torch.Tensor, dst: torch.Tensor, count: torch.Tensor,
                kept: torch.Tensor) -> None:
    """dst's first ``count`` rows (0-d or 1-element int32 device tensor, at most both tensors'
    rows) from src, unless ``kept`` (0-d or 1-element bool device tensor)."""
    s, d = words(src), words(dst)
    if s.shape[1] != d.shape[1]:
        raise ValueError(f"row_store: row widths differ, {tuple(src.shape)} vs {tuple(dst.shape)}")
    rows, W = min(s.shape[0], d.shape[0]), s.shape[1]
    if rows == 0 or W == 0:
        return
    BLOCK_W = min(1024, next_power_of_2(W))
    BLOCK_R = max(1, 4096 // BLOCK_W)  # ~16 KB of words per program
    _copy_unkept_kernel[(cdiv(rows, BLOCK_R), cdiv(W, BLOCK_W))](
        s, d, count, kept.view(torch.int8), W, s.stride(0), d.stride(0),
        BLOCK_R=BLOCK_R, BLOCK_W=BLOCK_W, num_warps=4,
    )
