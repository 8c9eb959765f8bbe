"""SwiGLU backward over rows, after a separate dgrad GEMM: the grouped_mm and sm90 sides of
dgrad2_swiglu.

The Triton dgrad2_swiglu (dgrad2_swiglu.py) fuses dh = dy_r @ w2[e] with this epilogue. Its
grouped_mm side (grouped_mm.dgrad2_swiglu_grouped_mm) instead runs dh as one M-grouped
torch._grouped_mm on gathered dy rows (dh in bf16) and then this kernel, per row r of the plan's
row space, with w_r the routing weight of the row's slot and a = [a1 | a3] the forward's saved
pre-activations:

    h   = silu(a1) * a3
    da1 = w_r * dh * a3 * silu'(a1),  da3 = w_r * dh * silu(a1),  hw = w_r * h
    part[0, r] = sum_h dh * h        (d(topk_weights) of the row's slot: <dy, y> = <dh, h>)

With ``quant`` (the FP8 backward: dh from an FP8 dgrad GEMM) it also writes da in e4m3 per
row and 128 columns (daq, das: the A operand of the FP8 dgrad1) from the same registers; da
and hw stay bf16 for the bf16 weight gradients.

Tiles: BLOCK_R rows per program, an inner loop over H in BLOCK_H columns (the row's dot product
accumulates in fp32 across it, in fixed column order: deterministic). Programs wholly past the
used rows exit; padding rows have dh = 0 (zero dy rows) and store zeros.
Waits on: dh and the plan (stream order). Signals: nothing.
"""

import math

import torch
import triton
import triton.language as tl

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper.kernels.fp8_quant import FP8, quantize_block
from torchtitan_megamoe.ops.hopper.kernels.tiling import next_power_of_2
from torchtitan_megamoe.ops.hopper.plan import Plan


@triton.jit
def _swiglu_bwd_rows_kernel(
    dh_ptr, a_ptr, tw_ptr, row_slot_ptr, used_ptr,
    da_ptr, hw_ptr, part_ptr, daq_ptr, das_ptr,
    H, s_dh, s_a, s_da, s_hw, s_daq, s_das,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, QUANT: tl.constexpr, EMULATE: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid * BLOCK_R >= tl.load(used_ptr):
        return
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    r64 = r.to(tl.int64)
    slot = tl.load(row_slot_ptr + r)
    w = tl.load(tw_ptr + tl.where(slot >= 0, slot, 0), mask=slot >= 0, other=0.0).to(tl.float32)
    dot = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        c = h0 + tl.arange(0, BLOCK_H)
        m = c[None, :] < H
        dh = tl.load(dh_ptr + r64[:, None] * s_dh + c[None, :], mask=m, other=0.0).to(tl.float32)
        a1 = tl.load(a_ptr + r64[:, None] * s_a + c[None, :], mask=m, other=0.0).to(tl.float32)
        a3 = tl.load(a_ptr + r64[:, None] * s_a + H + c[None, :], mask=m, other=0.0).to(tl.float32)
        sig = tl.sigmoid(a1)
        silu = a1 * sig
        h = silu * a3
        dot += tl.sum(dh * h, axis=1)
        dhw = dh * w[:, None]
        da1 = dhw * a3 * (sig + silu * (1.0 - sig))
        da3 = dhw * silu
        out_t = da_ptr.dtype.element_ty
        tl.store(da_ptr + r64[:, None] * s_da + c[None, :], da1.to(out_t), mask=m)
        tl.store(da_ptr + r64[:, None] * s_da + H + c[None, :], da3.to(out_t), mask=m)
        tl.store(hw_ptr + r64[:, None] * s_hw + c[None, :], (h * w[:, None]).to(out_t), mask=m)
        if QUANT:  # BLOCK_H == 128: this block is one scale block of da1 and of da3
            q1, sc1 = quantize_block(da1, 1, EMULATE)
            q3, sc3 = quantize_block(da3, 1, EMULATE)
            tl.store(daq_ptr + r64[:, None] * s_daq + c[None, :], q1.to(daq_ptr.dtype.element_ty))
            tl.store(daq_ptr + r64[:, None] * s_daq + H + c[None, :],
                     q3.to(daq_ptr.dtype.element_ty))
            tl.store(das_ptr + r64 * s_das + h0 // 128, sc1)
            tl.store(das_ptr + r64 * s_das + (H + h0) // 128, sc3)
    tl.store(part_ptr + r, dot)


def swiglu_bwd_rows(dh: torch.Tensor, a: torch.Tensor, topk_weights: torch.Tensor, plan: Plan,
                    out: tuple | None = None, block_r: int | None = None,
                    block_h: int = 256, quant: bool = False):
    """(da [R_max, 2H], hw [R_max, H], part [1, R_max] fp32) from dh [R_max, H] and the saved
    a [R_max, 2H]; with ``quant`` also (daq [R_max, 2H] e4m3, das [R_max, 2H/128]) appended.
    Rows past the used ones are left unwritten (never read). ``block_r``: rows per program,
    default 8; under the CPU interpreter, whose cost goes by the programs it walks, the largest
    power of two up to 64 that divides R (at least 8)."""
    R, H = dh.shape
    if block_r is None:
        block_r = max(8, math.gcd(R, 64)) if settings.triton_interpreting() else 8
    if a.shape != (R, 2 * H) or plan.max_rows != R:
        raise ValueError(f"a must be [{R}, {2 * H}] for dh {tuple(dh.shape)} and the plan's "
                         f"{plan.max_rows} rows, got {tuple(a.shape)}")
    if R % block_r:
        raise ValueError(f"block_r {block_r} must divide the row space ({R} rows)")
    if out is None:
        out = (torch.empty(R, 2 * H, dtype=dh.dtype, device=dh.device),
               torch.empty(R, H, dtype=dh.dtype, device=dh.device),
               torch.empty(1, R, dtype=torch.float32, device=dh.device))
    da, hw, part = out
    assert part.shape == (1, R) and part.is_contiguous()
    for t in (dh, a, da, hw):
        assert t.stride(-1) == 1
    tw = topk_weights.reshape(-1).contiguous()
    block_h = min(block_h, next_power_of_2(H))
    daq = das = None
    if quant:
        if H % 128:
            raise ValueError(f"quant needs hidden {H} to be a multiple of 128")
        block_h = 128
        daq = torch.empty(R, 2 * H, dtype=FP8, device=dh.device)
        das = torch.empty(R, 2 * H // 128, dtype=torch.float32, device=dh.device)
    _swiglu_bwd_rows_kernel[(R // block_r,)](
        dh, a, tw, plan.row_slot, plan.num_rows_used, da, hw, part,
        daq if quant else da, das if quant else part,
        H, dh.stride(0), a.stride(0), da.stride(0), hw.stride(0),
        daq.stride(0) if quant else 0, das.stride(0) if quant else 0,
        BLOCK_R=block_r, BLOCK_H=block_h, QUANT=quant,
        EMULATE=quant and settings.triton_interpreting(), num_warps=4,
    )
    if quant:
        return da, hw, part, daq, das
    return da, hw, part
