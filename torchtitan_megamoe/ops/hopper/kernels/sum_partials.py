"""Sum of returned partial rows: out[t] = sum_r part[r, pos[t, r]] over ranks r with
pos[t, r] >= 0, in fp32, ranks in fixed order 0..R-1 (deterministic), stored in out's dtype.

The last step of the EP exchange on the source rank: every expert-owning rank r returned one
partial row per token it served (that token's weighted sum over its experts on r), at the row
the token had in r's receive region. Ranks a token did not go to are skipped, never loaded
(their rows hold stale data from earlier calls).

Tiles: BLOCK_T tokens x BLOCK_D columns per program; the rank loop is unrolled (R constexpr).
Waits on: nothing inside the launch (the exchange's barrier precedes it). Signals: nothing.
"""

import torch
import triton
import triton.language as tl

from torchtitan_megamoe.ops.hopper.kernels.tiling import cdiv, next_power_of_2


@triton.jit
def _sum_partials_kernel(
    part_ptr,
    pos_ptr,
    out_ptr,
    T,
    D,
    stride_part_r,
    stride_part_row,
    stride_pos,
    stride_out,
    R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_t = toks < T
    in_d = cols < D
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for r in tl.static_range(R):  # fixed rank order: the same sum on every call
        row = tl.load(pos_ptr + toks.to(tl.int64) * stride_pos + r, mask=in_t, other=-1)
        live = (row >= 0)[:, None] & in_d[None, :]
        acc += tl.load(part_ptr + r * stride_part_r + row.to(tl.int64)[:, None] * stride_part_row
                       + cols[None, :], mask=live, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + toks.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=in_t[:, None] & in_d[None, :])


def sum_partials(part: torch.Tensor, pos: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """out [T, D] from ``part`` [R, C, D] (rank r's partial rows) and ``pos`` [T, R] (row of
    token t in rank r's region, -1 where t did not go to r)."""
    R, _, D = part.shape
    T = pos.shape[0]
    if pos.shape != (T, R):
        raise ValueError(f"sum_partials: pos must be [T, {R}], got {tuple(pos.shape)}")
    out = torch.empty((T, D), dtype=out_dtype, device=part.device)
    if T == 0:
        return out
    assert part.stride(2) == 1 and pos.stride(1) == 1
    block_d = min(512, next_power_of_2(D))
    block_t = 4
    grid = (cdiv(T, block_t), cdiv(D, block_d))
    _sum_partials_kernel[grid](
        part, pos, out, T, D, part.stride(0), part.stride(1), pos.stride(0), out.stride(0),
        R=R, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4,
    )
    return out
