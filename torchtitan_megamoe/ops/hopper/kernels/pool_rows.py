"""pool_rows: one EP region's row-space rows into the weight-gradient pool (ep_wgrad_pool.py).

The pool is laid out by ONE plan over the slots of all R regions (region s's slots are
[s*S, (s+1)*S), S = C*K); region s's rows sit in its own plan's row space. So

    dst[c] = src[region_slot_row[g - s*S]]   for the pool's used rows c whose slot
                                             g = pool_row_slot[c] is one of region s's
    dst[c] = 0                               for the pool's padding rows (slot -1), with
                                             ``zero_pad`` (once per call: the weight gradients
                                             read whole 64-row steps, padding included)

Other rows are neither read nor written. Rows move as 32-bit words (kernels/ep_copy.words).
Waits on: the region's src (stream order). Signals: nothing."""

import torch
import triton
import triton.language as tl

from torchtitan_megamoe.ops.hopper.kernels.ep_copy import words
from torchtitan_megamoe.ops.hopper.kernels.tiling import cdiv, next_power_of_2
from torchtitan_megamoe.ops.hopper.plan import Plan


@triton.jit
def _pool_rows_kernel(src_ptr, dst_ptr, pool_row_slot_ptr, used_ptr, region_slot_row_ptr, s0,
                      S, W, stride_src, stride_dst, ZERO_PAD: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < tl.load(used_ptr)
    g = tl.load(pool_row_slot_ptr + rows, mask=r_ok, other=-1)
    mine = r_ok & (g >= s0) & (g < s0 + S)
    src_rows = tl.load(region_slot_row_ptr + (g - s0), mask=mine, other=0)
    if ZERO_PAD:
        write = mine | (r_ok & (g < 0))
    else:
        write = mine
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    c_ok = (cols < W)[None, :]
    v = tl.load(src_ptr + src_rows.to(tl.int64)[:, None] * stride_src + cols[None, :],
                mask=mine[:, None] & c_ok, other=0)
    tl.store(dst_ptr + rows.to(tl.int64)[:, None] * stride_dst + cols[None, :], v,
             mask=write[:, None] & c_ok)


def pool_rows(src: torch.Tensor, dst: torch.Tensor, pool: Plan, region: Plan, s: int,
              zero_pad: bool = False) -> None:
    """Region s's rows of ``src`` (its plan ``region``'s row space) into ``dst`` (the row space
    of ``pool``, a plan over R regions of region.num_tokens tokens each)."""
    S = region.num_tokens * region.top_k
    if pool.num_tokens % region.num_tokens or pool.top_k != region.top_k:
        raise ValueError(f"pool_rows: the pool's {pool.num_tokens} x {pool.top_k} slots are not "
                         f"whole regions of {region.num_tokens} x {region.top_k}")
    sw, dw = words(src), words(dst)
    if sw.shape[1] != dw.shape[1] or dst.shape[0] != pool.max_rows:
        raise ValueError(f"pool_rows: src {tuple(src.shape)} and dst {tuple(dst.shape)} must "
                         f"have one row width, dst the pool's {pool.max_rows} rows")
    W = sw.shape[1]
    BLOCK_W = min(512, next_power_of_2(W))
    BLOCK_R = max(1, 8192 // BLOCK_W)
    _pool_rows_kernel[(cdiv(pool.max_rows, BLOCK_R), cdiv(W, BLOCK_W))](
        sw, dw, pool.row_slot, pool.num_rows_used, region.slot_row, s * S, S, W,
        sw.stride(0), dw.stride(0), ZERO_PAD=zero_pad, BLOCK_R=BLOCK_R, BLOCK_W=BLOCK_W,
        num_warps=4,
    )
