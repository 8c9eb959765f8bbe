"""Blockwise FP8 (e4m3) quantization into the layout each FP8 GEMM reads.

The recipe (DeepSeek-V3's, emulated by ops/reference.py): one fp32 scale per 128 values along
the contraction axis, scale = amax / 448, q = e4m3(v / scale); an all-zero block gets the scale
1e-12 / 448 (its values stay 0). FP8 wgmma reads both operands K-major from shared memory, so
every operand is stored with its contraction axis contiguous:

    quant_rows      [N, K] -> q [N, K], s [N, K/128]            activations / gradients along a
                                                                row (x and dy per token: once
                                                                per token, not per expert slot)
    quant_weight    [E, N, K] -> q [E, N, K], s [E, N/128, K/128]          forward GEMMs
                    and / or q^T [E, K, N(+offset)], s^T [E, K/128, ...]  dgrad GEMMs (the same
                                                                block scales, transposed)
    gather_rows     per-token q, s -> the plan's row space (for GEMMs that read A rows
                    contiguously)
    swiglu_quant_rows  a = [a1 | a3] rows -> h = silu(a1) * a3 quantized per row (GEMM 2's A)
    quant_rows_t    rows r of src (gathered by the plan, times an optional per-row weight) ->
                    q^T [C, R_max], s [C, R_max/128]            weight-gradient operands, which
                                                                contract over rows: scales per
                                                                128 rows of one column

Tiles: one program per [BLOCK_R, 128] block (quant_rows), per 128 x 128 block (quant_weight,
quant_rows_t). Waits on / signals: nothing inside a launch (stream order).
"""

import torch
import triton
import triton.language as tl

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper.plan import Plan
from torchtitan_megamoe.ops.hopper.kernels.tiling import cdiv

SCALE_BLOCK = 128
FP8 = torch.float8_e4m3fn


@triton.jit
def round_to_bf16(v, EMULATE: tl.constexpr):
    """v (fp32, finite) rounded to the nearest bf16 value, ties to even, still in fp32: what
    torch's cast gives. GPUs convert in hardware (cvt.rn); the CPU interpreter's cast truncates,
    so there the rounding is done on the bits."""
    if EMULATE:
        bits = v.to(tl.uint32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return v.to(tl.bfloat16).to(tl.float32)


@triton.jit
def round_to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32. The
    CPU interpreter's fp32 -> e4m3 cast (seen with Triton 3.9) loses the carry when rounding
    up crosses a power of two (125.5 -> 64, not 128); after this rounding its cast is exact.
    GPUs convert in hardware (cvt.rn.satfinite) and skip it."""
    bits = v.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # below 2^-6 e4m3 is subnormal with a fixed step of 2^-9: round v * 512 to an integer
    sub = ((v * 512.0 + 12582912.0) - 12582912.0) / 512.0
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


@triton.jit
def quantize_block(v, AXIS: tl.constexpr, EMULATE: tl.constexpr = False):
    """(q fp32 holding e4m3 values, scale) of fp32 block v with one scale per line along AXIS
    (the reduced axis): the reference emulation's arithmetic (division, not a reciprocal).
    EMULATE: under the CPU interpreter (round_to_e4m3)."""
    amax = tl.maximum(tl.max(tl.abs(v), axis=AXIS), 1e-12)
    scale = amax / 448.0
    if AXIS == 1:
        q = v / scale[:, None]
    else:
        q = v / scale[None, :]
    if EMULATE:
        q = round_to_e4m3(q)
    return q, scale


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, skip_ptr, N, K, stride_x, stride_q, stride_s,
                       BLOCK_R: tl.constexpr, EMULATE: tl.constexpr, SKIP: tl.constexpr):
    if SKIP:
        if tl.load(skip_ptr) != 0:
            return
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    ok = rows < N
    r64 = rows.to(tl.int64)
    v = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=ok[:, None], other=0.0)
    q, scale = quantize_block(v.to(tl.float32), 1, EMULATE)
    tl.store(q_ptr + r64[:, None] * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty),
             mask=ok[:, None])
    tl.store(s_ptr + r64 * stride_s + tl.program_id(1), scale, mask=ok)


@triton.jit
def _dequant_rows_kernel(q_ptr, s_ptr, y_ptr, N, K, stride_q, stride_s, stride_y,
                         BLOCK_R: tl.constexpr, EMULATE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    ok = rows < N
    r64 = rows.to(tl.int64)
    q = tl.load(q_ptr + r64[:, None] * stride_q + cols[None, :], mask=ok[:, None],
                other=0.0).to(tl.float32)
    scale = tl.load(s_ptr + r64 * stride_s + tl.program_id(1), mask=ok, other=0.0)
    v = round_to_bf16(q * scale[:, None], EMULATE)
    tl.store(y_ptr + r64[:, None] * stride_y + cols[None, :], v.to(y_ptr.dtype.element_ty),
             mask=ok[:, None])


def dequant_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 = q [N, K] e4m3 times its 1x128 scales s [N, K/128], rounded once (the
    values quant_rows' GEMMs multiply, for the weight gradients that read unquantized rows)."""
    N, K = q.shape
    assert K % SCALE_BLOCK == 0 and s.shape == (N, K // SCALE_BLOCK), (q.shape, s.shape)
    y = torch.empty((N, K), dtype=torch.bfloat16, device=q.device)
    if N:
        block_r = 32
        _dequant_rows_kernel[(cdiv(N, block_r), K // SCALE_BLOCK)](
            q, s, y, N, K, q.stride(0), s.stride(0), y.stride(0), BLOCK_R=block_r,
            EMULATE=settings.triton_interpreting(), num_warps=4)
    return y


def quant_rows(x: torch.Tensor, skip: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] e4m3, s [N, K/128] fp32): one scale per row and 128 columns. ``skip``: a 0-d
    device bool; when true, q and s are left unwritten (the EP backward's recompute of a region
    its store kept: decided on the device, no host sync)."""
    N, K = x.shape
    assert K % SCALE_BLOCK == 0, K
    q = torch.empty((N, K), dtype=FP8, device=x.device)
    s = torch.empty((N, K // SCALE_BLOCK), dtype=torch.float32, device=x.device)
    if N:
        block_r = 32
        _quant_rows_kernel[(cdiv(N, block_r), K // SCALE_BLOCK)](
            x, q, s, x if skip is None else skip, N, K, x.stride(0), q.stride(0), s.stride(0),
            BLOCK_R=block_r, EMULATE=settings.triton_interpreting(), SKIP=skip is not None,
            num_warps=4)
    return q, s


@triton.jit
def _quant_weight_kernel(w_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, N, K,
                         stride_we, stride_wn, stride_qe, stride_qn, stride_se, stride_sn,
                         stride_qte, stride_qtk, stride_ste, stride_stk, t_col0, t_sblk0,
                         STORE_Q: tl.constexpr, STORE_T: tl.constexpr, ROUND_BF16: tl.constexpr,
                         EMULATE: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    kb = tl.program_id(2)
    n = nb * 128 + tl.arange(0, 128)
    k = kb * 128 + tl.arange(0, 128)
    v = tl.load(w_ptr + e * stride_we + n[:, None].to(tl.int64) * stride_wn + k[None, :])
    v = v.to(tl.float32)
    if ROUND_BF16:  # the values of w.to(bf16), the autocast cast, without its pass
        v = round_to_bf16(v, EMULATE)
    amax = tl.maximum(tl.max(tl.max(tl.abs(v), axis=1), axis=0), 1e-12)
    scale = amax / 448.0
    q = v / scale
    if EMULATE:
        q = round_to_e4m3(q)
    q = q.to(tl.float8e4nv)
    if STORE_Q:
        tl.store(q_ptr + e * stride_qe + n[:, None].to(tl.int64) * stride_qn + k[None, :], q)
        tl.store(s_ptr + e * stride_se + nb * stride_sn + kb, scale)
    if STORE_T:
        # q^T [K, N]: row k, column t_col0 + n; its block scale at [kb, t_sblk0 + nb]
        tl.store(qt_ptr + e * stride_qte + k[:, None].to(tl.int64) * stride_qtk
                 + (t_col0 + n[None, :]), tl.trans(q))
        tl.store(st_ptr + e * stride_ste + kb * stride_stk + t_sblk0 + nb, scale)


def quant_weight(w: torch.Tensor, q=None, s=None, qt=None, st=None, t_col0: int = 0,
                 dtype: torch.dtype | None = None):
    """Quantize w [E, N, K] in 128 x 128 blocks into q [E, N, K] / s [E, N/128, K/128] and / or
    its transpose qt [E, K, N_total] / st [E, K/128, N_total/128] at column ``t_col0`` (so w1
    and w3 can share one transposed [E, D, 2H] operand), from one read of w. Pass the outputs
    to fill. ``dtype``: quantize the values of ``w.to(dtype)`` (an fp32 weight under a bf16
    autocast is rounded to bf16 in the kernel, not by a cast pass)."""
    round_bf16 = dtype == torch.bfloat16 and w.dtype != torch.bfloat16
    if dtype is not None and dtype != w.dtype and not round_bf16:
        w = w.to(dtype)
    E, N, K = w.shape
    assert N % SCALE_BLOCK == 0 and K % SCALE_BLOCK == 0, (N, K)
    assert w.stride(2) == 1
    store_q, store_t = q is not None, qt is not None
    qq, ss = (q, s) if store_q else (qt, st)  # placeholders
    tt, sst = (qt, st) if store_t else (qq, ss)
    _quant_weight_kernel[(E, N // SCALE_BLOCK, K // SCALE_BLOCK)](
        w, qq, ss, tt, sst, N, K, w.stride(0), w.stride(1),
        qq.stride(0), qq.stride(1), ss.stride(0), ss.stride(1),
        tt.stride(0), tt.stride(1), sst.stride(0), sst.stride(1),
        t_col0, t_col0 // SCALE_BLOCK, STORE_Q=store_q, STORE_T=store_t, ROUND_BF16=round_bf16,
        EMULATE=settings.triton_interpreting(), num_warps=8)


def weight_blocks(E: int, N: int, K: int, device, transposed_n: int | None = None):
    """Empty (q, s) for a [E, N, K] weight, or for its transpose with ``transposed_n`` total
    columns ([E, K, transposed_n])."""
    if transposed_n is None:
        return (torch.empty((E, N, K), dtype=FP8, device=device),
                torch.empty((E, N // SCALE_BLOCK, K // SCALE_BLOCK), dtype=torch.float32,
                            device=device))
    return (torch.empty((E, K, transposed_n), dtype=FP8, device=device),
            torch.empty((E, K // SCALE_BLOCK, transposed_n // SCALE_BLOCK), dtype=torch.float32,
                        device=device))


@triton.jit
def _quant_rows_t_kernel(src_ptr, w_ptr, row_slot_ptr, num_rows_used_ptr, q_ptr, s_ptr, C,
                         stride_src, stride_q, stride_s,
                         TOP_K: tl.constexpr, GATHER: tl.constexpr, WEIGHTED: tl.constexpr,
                         EMULATE: tl.constexpr):
    rb = tl.program_id(0)
    cb = tl.program_id(1)
    if rb * 128 < tl.load(num_rows_used_ptr):
        rows = rb * 128 + tl.arange(0, 128)
        cols = cb * 128 + tl.arange(0, 128)
        slot = tl.load(row_slot_ptr + rows)
        live = slot >= 0
        if GATHER:
            src_row = tl.where(live, slot // TOP_K, 0).to(tl.int64)
        else:
            src_row = rows.to(tl.int64)
        v = tl.load(src_ptr + src_row[:, None] * stride_src + cols[None, :], mask=live[:, None],
                    other=0.0).to(tl.float32)
        if WEIGHTED:
            v = v * tl.load(w_ptr + tl.where(live, slot, 0), mask=live, other=0.0).to(
                tl.float32)[:, None]
        q, scale = quantize_block(v, 0, EMULATE)  # one scale per column over these 128 rows
        # stored as [128 columns, 128 rows], rows contiguous: coalesced after a layout change
        tl.store(q_ptr + cols[:, None].to(tl.int64) * stride_q + rows[None, :],
                 tl.trans(q.to(q_ptr.dtype.element_ty)))
        tl.store(s_ptr + cols.to(tl.int64) * stride_s + rb, scale)


def quant_rows_t(src: torch.Tensor, plan: Plan, gather: bool, row_weight=None):
    """(q^T [C, R_max] e4m3, s [C, R_max/128]) of the plan's rows: row r is src[row_slot[r] //
    top_k] (``gather``) or src[r], times row_weight[row_slot[r]] if given; padding rows are 0.
    Blocks past the used rows are left unwritten (the weight-gradient GEMM never reads them)."""
    C = src.shape[1]
    R = plan.max_rows
    assert plan.block_m % SCALE_BLOCK == 0 and R % SCALE_BLOCK == 0 and C % SCALE_BLOCK == 0
    q = torch.empty((C, R), dtype=FP8, device=src.device)
    s = torch.empty((C, R // SCALE_BLOCK), dtype=torch.float32, device=src.device)
    w = row_weight if row_weight is not None else src
    _quant_rows_t_kernel[(R // SCALE_BLOCK, C // SCALE_BLOCK)](
        src, w, plan.row_slot, plan.num_rows_used, q, s, C, src.stride(0), q.stride(0),
        s.stride(0), TOP_K=plan.top_k, GATHER=gather, WEIGHTED=row_weight is not None,
        EMULATE=settings.triton_interpreting(), num_warps=8)
    return q, s


@triton.jit
def _gather_rows_kernel(q_ptr, s_ptr, row_slot_ptr, num_rows_used_ptr, out_q_ptr, out_s_ptr, K,
                        stride_q, stride_s, stride_oq, stride_os,
                        TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        NUM_SB: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if tl.program_id(0) * BLOCK_R >= tl.load(num_rows_used_ptr):
        return
    slot = tl.load(row_slot_ptr + rows)
    live = slot >= 0
    src = tl.where(live, slot // TOP_K, 0).to(tl.int64)
    r64 = rows.to(tl.int64)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(q_ptr + src[:, None] * stride_q + cols[None, :], mask=live[:, None], other=0)
        tl.store(out_q_ptr + r64[:, None] * stride_oq + cols[None, :], v)
    sb = tl.arange(0, NUM_SB)
    ok = sb[None, :] < K // 128
    s = tl.load(s_ptr + src[:, None] * stride_s + sb[None, :], mask=live[:, None] & ok, other=0.0)
    tl.store(out_s_ptr + r64[:, None] * stride_os + sb[None, :], s, mask=ok)


def gather_rows(q: torch.Tensor, s: torch.Tensor, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(q rows [R_max, K] e4m3, s rows [R_max, K/128]) of per-token quantized rows in the plan's
    row space: row r holds token row_slot[r] // top_k; padding rows are zero (scale 0). For the
    GEMMs that read A row-contiguous (DeepGEMM, the sm90 row GEMM). Rows past the used ones
    are left unwritten (their tiles are skipped)."""
    T, K = q.shape
    R = plan.max_rows
    block_r = 32
    assert K % SCALE_BLOCK == 0 and R % block_r == 0, (K, R)
    out_q = torch.empty((R, K), dtype=q.dtype, device=q.device)
    out_s = torch.empty((R, K // SCALE_BLOCK), dtype=torch.float32, device=q.device)
    # the widest of 512, 256, 128 bytes that divides K (a multiple of 128)
    block_k = next(b for b in (512, 256, 128) if K % b == 0)
    # bytes move as uint8: the copy needs no FP8 arithmetic
    _gather_rows_kernel[(R // block_r,)](
        q.view(torch.uint8), s, plan.row_slot, plan.num_rows_used, out_q.view(torch.uint8),
        out_s, K, q.stride(0), s.stride(0), out_q.stride(0), out_s.stride(0),
        TOP_K=plan.top_k, BLOCK_R=block_r, BLOCK_K=block_k,
        NUM_SB=triton.next_power_of_2(K // SCALE_BLOCK), num_warps=4)
    return out_q, out_s


@triton.jit
def _swiglu_quant_rows_kernel(a_ptr, num_rows_used_ptr, q_ptr, s_ptr, H, stride_a, stride_q,
                              stride_s, BLOCK_R: tl.constexpr, EMULATE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if tl.program_id(0) * BLOCK_R >= tl.load(num_rows_used_ptr):
        return
    cb = tl.program_id(1)
    cols = cb * 128 + tl.arange(0, 128)
    r64 = rows.to(tl.int64)
    a1 = tl.load(a_ptr + r64[:, None] * stride_a + cols[None, :]).to(tl.float32)
    a3 = tl.load(a_ptr + r64[:, None] * stride_a + H + cols[None, :]).to(tl.float32)
    # from the bf16 a (the plain GEMM's only output); the fused GEMM 1 uses its fp32
    # accumulators: the two h differ by bf16 rounding, far below the e4m3 step
    h = a1 * tl.sigmoid(a1) * a3
    q, scale = quantize_block(h, 1, EMULATE)
    tl.store(q_ptr + r64[:, None] * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty))
    tl.store(s_ptr + r64 * stride_s + cb, scale)


def swiglu_quant_rows(a: torch.Tensor, plan: Plan, hq: torch.Tensor, hs: torch.Tensor) -> None:
    """h = silu(a1) * a3 of a = [a1 | a3] [R_max, 2H] (bf16), quantized per row and 128
    columns into hq [R_max, H] e4m3 / hs [R_max, H/128]: the SwiGLU of GEMM 1 when the GEMM
    itself (DeepGEMM) has no such epilogue. Rows past the used ones are left unwritten."""
    R, H2 = a.shape
    H = H2 // 2
    block_r = 32
    assert H % SCALE_BLOCK == 0 and R % block_r == 0 and a.stride(1) == 1
    _swiglu_quant_rows_kernel[(R // block_r, H // SCALE_BLOCK)](
        a, plan.num_rows_used, hq, hs, H, a.stride(0), hq.stride(0), hs.stride(0),
        BLOCK_R=block_r, EMULATE=settings.triton_interpreting(), num_warps=4)
