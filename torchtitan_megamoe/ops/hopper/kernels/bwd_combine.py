"""Backward combine: dx[t] = sum_k dx_slot[t*K + k] and dtopk_weights[t, k] = sum_j part[j, row].

(With ``rows``, dgrad1's output is in the plan's row space, [R_max, D], and slot s's row is
dx_rows[slot_row[s]]: the sm90 dgrad1 writes whole tiles by bulk stores instead of
scattering rows into slots.)

Both sums run in fp32 in a fixed order (k ascending; H tiles ascending), so the result is
bitwise deterministic without atomics. Slots that are dropped (or whose expert is not local:
slot_row == -1) contribute 0 and their dx_slot rows are never read (they were never written).

Tiles: one program per (BLOCK_T tokens, BLOCK_D columns of D); the programs of the first D
column block also reduce the d(topk_weights) partials of their tokens (NUM_PART rows of part).
Waits on: dgrad1's dx_slot and dgrad2_swiglu's partials (stream order). Signals: nothing.
"""

import torch
import triton
import triton.language as tl

from torchtitan_megamoe.ops.hopper.plan import Plan
from torchtitan_megamoe.ops.hopper.kernels.tiling import cdiv


@triton.jit
def _bwd_combine_kernel(
    dx_slot_ptr, part_ptr, slot_row_ptr, dx_ptr, dtw_ptr,
    T, D, R_MAX,
    s_slot, s_dx, live_ptr,
    TOPK: tl.constexpr, NUM_PART: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, LIVE: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rd = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    if LIVE:
        t_ok = rt < tl.minimum(T, tl.load(live_ptr))
    else:
        t_ok = rt < T
    d_ok = rd < D
    rt64 = rt.to(tl.int64)

    acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    for k in tl.static_range(TOPK):
        s = rt64 * TOPK + k
        row = tl.load(slot_row_ptr + s, mask=t_ok, other=-1)
        ok = row >= 0
        src = tl.where(ok, row, 0).to(tl.int64) if ROWS else s
        v = tl.load(dx_slot_ptr + src[:, None] * s_slot + rd[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0)
        acc += v.to(tl.float32)
    tl.store(dx_ptr + rt64[:, None] * s_dx + rd[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=t_ok[:, None] & d_ok[None, :])

    if pid_d == 0:
        for k in tl.static_range(TOPK):
            s = rt64 * TOPK + k
            row = tl.load(slot_row_ptr + s, mask=t_ok, other=-1)
            ok = row >= 0
            row64 = tl.where(ok, row, 0).to(tl.int64)
            g = tl.zeros((BLOCK_T,), tl.float32)
            for j in tl.static_range(NUM_PART):
                g += tl.load(part_ptr + j * R_MAX + row64, mask=ok, other=0.0)
            tl.store(dtw_ptr + s, g.to(dtw_ptr.dtype.element_ty), mask=t_ok)


def bwd_combine(
    dx_slot: torch.Tensor,
    part: torch.Tensor,
    plan: Plan,
    *,
    dx_dtype: torch.dtype,
    dtw_dtype: torch.dtype,
    block_t: int = 8,
    block_d: int = 256,
    num_warps: int = 4,
    rows: bool = False,
    live: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum each token's slots. dx_slot: [T*K, D] (or, with ``rows``, [R_max, D] in the plan's
    row space); part: [n_h_tiles, R_max] fp32 from dgrad2_swiglu. Returns dx [T, D] in dx_dtype and
    dtopk_weights [T, K] in dtw_dtype. ``live``: a 1-element int32 device count n: the rows of
    tokens t >= n are left unwritten (an EP peer region's rows past the ones it sent)."""
    T, K = plan.num_tokens, plan.top_k
    D = dx_slot.shape[1]
    n = plan.max_rows if rows else T * K
    if dx_slot.shape[0] != n or dx_slot.stride(-1) != 1:
        raise ValueError(f"dx_slot must be [{n}, D] with contiguous rows")
    if part.dim() != 2 or part.shape[1] != plan.max_rows or not part.is_contiguous():
        raise ValueError(f"part must be a contiguous [n, {plan.max_rows}] buffer")
    dx = torch.empty(T, D, dtype=dx_dtype, device=dx_slot.device)
    dtw = torch.empty(T, K, dtype=dtw_dtype, device=dx_slot.device)
    if T == 0:
        return dx, dtw
    grid = (cdiv(T, block_t), cdiv(D, block_d))
    _bwd_combine_kernel[grid](
        dx_slot, part, plan.slot_row, dx, dtw,
        T, D, plan.max_rows,
        dx_slot.stride(0), dx.stride(0), plan.slot_row if live is None else live,
        TOPK=K, NUM_PART=part.shape[0],
        BLOCK_T=block_t, BLOCK_D=block_d, ROWS=rows, LIVE=live is not None,
        num_warps=num_warps,
    )
    return dx, dtw
