"""A bounded store of row blocks whose lengths live on the device: block i of ``count_i`` rows
goes at rows [offs[i], offs[i] + count_i) of ``store`` when it fits, else it is not kept. The EP
forward keeps GEMM 1's pre-activations of every source region so (ep_forward.py): a region's
rows are known on the device only, and a static store sized for what a rank receives at uniform
routing (plus a margin) replaces R worst-case regions; a region that does not fit is
recomputed by the backward instead (so no routing loses a row or overflows the store).

    stash_rows(src, store, offs, i, count)    store[offs[i] + j] = src[j], j < count, if it
                                              fits; offs[i + 1] = offs[i] + count if it fitted,
                                              else offs[i] (a later, smaller block may still fit)
    unstash_rows(store, dst, offs, i, count)  dst[j] = store[offs[i] + j], j < count, if block i
                                              was kept; else dst is left as it is
    kept(offs, i, count)                      0-d bool on the device: block i was kept

Blocks must be stashed in order i = 0, 1, ... on one stream (offs[0] = 0). Rows move as 32-bit
words (kernels/ep_copy.words). Waits on: nothing inside a launch (stream order). Signals:
nothing."""

import torch
import triton
import triton.language as tl

from torchtitan_megamoe.ops.hopper.kernels.ep_copy import words
from torchtitan_megamoe.ops.hopper.kernels.tiling import cdiv, next_power_of_2


@triton.jit
def _row_store_kernel(src_ptr, dst_ptr, offs_ptr, i, count_ptr, cap, W, stride_src, stride_dst,
                      STASH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    off = tl.load(offs_ptr + i)
    n = tl.load(count_ptr)
    if STASH:
        fits = off + n <= cap
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            # only this program writes offs, and no program reads offs[i + 1]
            tl.store(offs_ptr + i + 1, tl.where(fits, off + n, off))
    else:
        fits = tl.load(offs_ptr + i + 1) - off == n
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    m = (rows < tl.where(fits, n, 0))[:, None] & (cols < W)[None, :]
    if STASH:
        src_rows, dst_rows = rows, rows + off
    else:
        src_rows, dst_rows = rows + off, rows
    v = tl.load(src_ptr + src_rows.to(tl.int64)[:, None] * stride_src + cols[None, :], mask=m)
    tl.store(dst_ptr + dst_rows.to(tl.int64)[:, None] * stride_dst + cols[None, :], v, mask=m)


def _launch(src, dst, offs, i, count, cap, stash):
    s, d = words(src), words(dst)
    if s.shape[1] != d.shape[1]:
        raise ValueError(f"row_store: row widths differ, {tuple(src.shape)} vs {tuple(dst.shape)}")
    if offs.dtype != torch.int32 or not 0 <= i < offs.numel() - 1:
        raise ValueError(f"row_store: offs must be int32 with a slot past block {i}")
    block_rows, W = (s if stash else d).shape
    if block_rows == 0 or W == 0:
        if stash:  # nothing to store: the block is kept, empty
            offs[i + 1].copy_(offs[i])
        return
    BLOCK_W = min(1024, next_power_of_2(W))
    BLOCK_R = max(1, 4096 // BLOCK_W)  # ~16 KB of words per program
    _row_store_kernel[(cdiv(block_rows, BLOCK_R), cdiv(W, BLOCK_W))](
        s, d, offs, i, count, cap, W, s.stride(0), d.stride(0),
        STASH=stash, BLOCK_R=BLOCK_R, BLOCK_W=BLOCK_W, num_warps=4,
    )


def stash_rows(src: torch.Tensor, store: torch.Tensor, offs: torch.Tensor, i: int,
               count: torch.Tensor) -> None:
    """Block i: src's first ``count`` rows (0-d or 1-element int32 device tensor, at most
    src's rows) into ``store`` after block i-1, if they fit; sets offs[i + 1]."""
    _launch(src, store, offs, i, count, store.shape[0], stash=True)


def unstash_rows(store: torch.Tensor, dst: torch.Tensor, offs: torch.Tensor, i: int,
                 count: torch.Tensor) -> None:
    """dst's first ``count`` rows from block i, if it was kept (``count``: the stashed one)."""
    _launch(store, dst, offs, i, count, store.shape[0], stash=False)


def kept(offs: torch.Tensor, i: int, count: torch.Tensor) -> torch.Tensor:
    """0-d bool: block i of ``count`` rows is in the store."""
    return (offs[i + 1] - offs[i]) == count.reshape(())
