"""The transposed 128 x 128-block FP8 copy of a weight, made from its FP8 copy (not from bf16).

    transpose_blocks   q [E, N, K] e4m3, s [E, N/128, K/128]  ->  q^T [E, K, N_total] at column
                       t_col0, s^T [E, K/128, N_total/128] at scale column t_col0 / 128

A block's scale serves both layouts (fp8_weights.py), so the transpose moves bytes and scales
only: q^T and s^T are bitwise what quant_weight(w, qt=..., st=...) writes from the bf16 weight.
The bytes travel as uint8, so no float conversion can touch them. One program per 128 x 128
block; it reads 16 KiB and writes 16 KiB (a third of a quantization pass's traffic, which reads
the bf16 weight). Waits on / signals: nothing inside a launch (stream order).
"""

import torch
import triton
import triton.language as tl

from torchtitan_megamoe.ops.hopper.kernels.fp8_quant import FP8, SCALE_BLOCK


@triton.jit
def _transpose_blocks_kernel(q_ptr, s_ptr, qt_ptr, st_ptr,
                             stride_qe, stride_qn, stride_se, stride_sn,
                             stride_qte, stride_qtk, stride_ste, stride_stk, t_col0, t_sblk0):
    e = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    kb = tl.program_id(2)
    n = nb * 128 + tl.arange(0, 128)
    k = kb * 128 + tl.arange(0, 128)
    v = tl.load(q_ptr + e * stride_qe + n[:, None].to(tl.int64) * stride_qn + k[None, :])
    # q^T [K, N]: row k, column t_col0 + n
    tl.store(qt_ptr + e * stride_qte + k[:, None].to(tl.int64) * stride_qtk
             + (t_col0 + n[None, :]), tl.trans(v))
    tl.store(st_ptr + e * stride_ste + kb * stride_stk + t_sblk0 + nb,
             tl.load(s_ptr + e * stride_se + nb * stride_sn + kb))


def transpose_blocks(q: torch.Tensor, s: torch.Tensor, qt: torch.Tensor, st: torch.Tensor,
                     t_col0: int = 0) -> None:
    """Write the transpose of q [E, N, K] / s [E, N/128, K/128] into qt [E, K, N_total] /
    st [E, K/128, N_total/128] from column ``t_col0`` (so w1 and w3 share one [E, D, 2H]
    operand, as in quant_weight)."""
    E, N, K = q.shape
    assert q.dtype == FP8 and qt.dtype == FP8, (q.dtype, qt.dtype)
    assert N % SCALE_BLOCK == 0 and K % SCALE_BLOCK == 0 and t_col0 % SCALE_BLOCK == 0
    assert qt.shape[0] == E and qt.shape[1] == K and qt.shape[2] >= t_col0 + N, qt.shape
    assert tuple(s.shape) == (E, N // SCALE_BLOCK, K // SCALE_BLOCK), s.shape
    assert q.stride(2) == 1 and qt.stride(2) == 1 and s.stride(2) == 1 and st.stride(2) == 1
    if E == 0:
        return
    qb, qtb = q.view(torch.uint8), qt.view(torch.uint8)
    _transpose_blocks_kernel[(E, N // SCALE_BLOCK, K // SCALE_BLOCK)](
        qb, s, qtb, st, qb.stride(0), qb.stride(1), s.stride(0), s.stride(1),
        qtb.stride(0), qtb.stride(1), st.stride(0), st.stride(1),
        t_col0, t_col0 // SCALE_BLOCK, num_warps=4)
