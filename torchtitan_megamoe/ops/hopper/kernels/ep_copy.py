"""Row copies whose length lives on the device: dst[j] = src[index[j]] (or src[j]) for the rows
j < count, count read from device memory. The moves of the selective EP exchange
(ep_dispatch.py): a source sends a peer only the n_d rows of the tokens that go there, and a
receiver returns only the rows it received; n_d is known on the device only, and a copy engine
needs its length on the host, so the rows move by SM stores (into the peer's buffer when
``dst`` is a peer's region: NVLink stores on the symmetric transport).

Rows are moved as 32-bit words (bf16, e4m3, fp32 and int32 rows alike), a [BLOCK_R, BLOCK_W]
tile of each row tensor per program (up to MAX_PAIRS tensors of the same rows per launch: a
transfer's x, or e4m3 rows with their scales); rows at or past ``count`` are neither read nor
written.
Waits on: nothing inside the launch (stream order). Signals: nothing."""

import torch
import triton
import triton.language as tl

from torchtitan_megamoe.ops.hopper.kernels.tiling import cdiv, next_power_of_2


MAX_PAIRS = 3
"""Row tensors moved by one launch (a transfer's rows: x, or e4m3 rows and their scales, and x)."""


@triton.jit
def _move(src_ptr, dst_ptr, W, stride_src, stride_dst, src_rows, rows, in_r, cols):
    m = in_r[:, None] & (cols < W)[None, :]
    v = tl.load(src_ptr + src_rows.to(tl.int64)[:, None] * stride_src + cols[None, :], mask=m)
    tl.store(dst_ptr + rows.to(tl.int64)[:, None] * stride_dst + cols[None, :], v, mask=m)


@triton.jit
def _copy_rows_kernel(src0, dst0, W0, ss0, sd0, src1, dst1, W1, ss1, sd1, src2, dst2, W2, ss2,
                      sd2, index_ptr, count_ptr, N: tl.constexpr, HAS_INDEX: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    n = tl.load(count_ptr)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_r = rows < n
    if HAS_INDEX:
        src_rows = tl.load(index_ptr + rows, mask=in_r, other=0)
    else:
        src_rows = rows
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    _move(src0, dst0, W0, ss0, sd0, src_rows, rows, in_r, cols)
    if N > 1:
        _move(src1, dst1, W1, ss1, sd1, src_rows, rows, in_r, cols)
    if N > 2:
        _move(src2, dst2, W2, ss2, sd2, src_rows, rows, in_r, cols)


def words(t: torch.Tensor) -> torch.Tensor:
    """``t`` [N, W] viewed as 32-bit words per row (its rows must be whole words)."""
    if t.dim() != 2 or t.stride(1) != 1 or (t.shape[1] * t.element_size()) % 4:
        raise ValueError(f"copy_rows: rows of {tuple(t.shape)} {t.dtype} are not whole 32-bit "
                         "words in a unit-stride row")
    if t.element_size() == 4:
        return t.view(torch.int32)
    return t.view(torch.uint8 if t.element_size() == 1 else torch.int16).view(torch.int32)


def copy_rows(pairs, count: torch.Tensor, index: torch.Tensor | None = None) -> None:
    """dst[j] = src[index[j] if index is given else j] for j < count (a 1-element int32 device
    tensor; rows past a dst's rows never: count <= dst rows is the caller's invariant), for each
    (src, dst) of ``pairs``: one launch per MAX_PAIRS of them (a launch costs host time that
    the small per-region moves of the EP exchange do not cover)."""
    moves = []
    for src, dst in pairs:
        s, d = words(src), words(dst)
        if s.shape[1] != d.shape[1]:
            raise ValueError(f"copy_rows: row widths differ, {tuple(src.shape)} vs "
                             f"{tuple(dst.shape)}")
        if d.shape[0] and d.shape[1]:
            moves.append((s, d))
    for first in range(0, len(moves), MAX_PAIRS):
        group = moves[first:first + MAX_PAIRS]
        rows, W = max(d.shape[0] for _, d in group), max(d.shape[1] for _, d in group)
        BLOCK_W = min(1024, next_power_of_2(W))
        BLOCK_R = max(1, 4096 // BLOCK_W)  # ~16 KB of words per program and row tensor
        args = []
        for s, d in group + group[:1] * (MAX_PAIRS - len(group)):  # unused slots: never read
            args += [s, d, d.shape[1], s.stride(0), d.stride(0)]
        _copy_rows_kernel[(cdiv(rows, BLOCK_R), cdiv(W, BLOCK_W))](
            *args, group[0][1] if index is None else index, count, N=len(group),
            HAS_INDEX=index is not None, BLOCK_R=BLOCK_R, BLOCK_W=BLOCK_W, num_warps=4,
        )
