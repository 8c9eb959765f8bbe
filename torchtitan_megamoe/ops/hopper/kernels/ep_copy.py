"""Row copies whose length lives on the device: dst[j] = src[index[j]] (or src[j]) for the rows
j < count, count read from device memory. The moves of the selective EP exchange
(ep_dispatch.py): a source sends a peer only the n_d rows of the tokens that go there, and a
receiver returns only the rows it received; n_d is known on the device only, and a copy engine
needs its length on the host, so the rows move by SM stores (into the peer's buffer when
``dst`` is a peer's region: NVLink stores on the symmetric transport).

Rows are moved as 32-bit words (bf16, e4m3, fp32 and int32 rows alike), a [BLOCK_R, BLOCK_W]
tile per program; rows at or past ``count`` are neither read nor written.
Waits on: nothing inside the launch (stream order). Signals: nothing."""

import torch
import triton
import triton.language as tl

from torchtitan_megamoe.ops.hopper.kernels.tiling import cdiv, next_power_of_2


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, index_ptr, count_ptr, W, stride_src, stride_dst,
                      HAS_INDEX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    n = tl.load(count_ptr)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_r = rows < n
    if HAS_INDEX:
        src_rows = tl.load(index_ptr + rows, mask=in_r, other=0)
    else:
        src_rows = rows
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    m = in_r[:, None] & (cols < W)[None, :]
    v = tl.load(src_ptr + src_rows.to(tl.int64)[:, None] * stride_src + cols[None, :], mask=m)
    tl.store(dst_ptr + rows.to(tl.int64)[:, None] * stride_dst + cols[None, :], v, mask=m)


def words(t: torch.Tensor) -> torch.Tensor:
    """``t`` [N, W] viewed as 32-bit words per row (its rows must be whole words)."""
    if t.dim() != 2 or t.stride(1) != 1 or (t.shape[1] * t.element_size()) % 4:
        raise ValueError(f"copy_rows: rows of {tuple(t.shape)} {t.dtype} are not whole 32-bit "
                         "words in a unit-stride row")
    if t.element_size() == 4:
        return t.view(torch.int32)
    return t.view(torch.uint8 if t.element_size() == 1 else torch.int16).view(torch.int32)


def copy_rows(src: torch.Tensor, dst: torch.Tensor, count: torch.Tensor,
              index: torch.Tensor | None = None) -> None:
    """dst[j] = src[index[j] if index is given else j] for j < count (a 1-element int32 device
    tensor; rows past dst.shape[0] never: count <= dst rows is the caller's invariant)."""
    s, d = words(src), words(dst)
    if s.shape[1] != d.shape[1]:
        raise ValueError(f"copy_rows: row widths differ, {tuple(src.shape)} vs {tuple(dst.shape)}")
    rows, W = d.shape
    if rows == 0 or W == 0:
        return
    BLOCK_W = min(1024, next_power_of_2(W))
    BLOCK_R = max(1, 4096 // BLOCK_W)  # ~16 KB of words per program
    _copy_rows_kernel[(cdiv(rows, BLOCK_R), cdiv(W, BLOCK_W))](
        s, d, d if index is None else index, count, W, s.stride(0), d.stride(0),
        HAS_INDEX=index is not None, BLOCK_R=BLOCK_R, BLOCK_W=BLOCK_W, num_warps=4,
    )
