"""Grouped FP8 weight gradient (K-grouped: the contraction runs over each expert's rows).

    dw[e][m, n] = sum_{r in segment(e)} A^T[m, r] * B^T[n, r]      e4m3 operands, fp32 accumulate

A^T [M, R_max] and B^T [N, R_max] hold the plan's rows transposed (rows contiguous: K-major for
FP8 wgmma), each with one scale per column and 128 rows ([M, R_max/128], [N, R_max/128]): the
quantization the weight gradients need, since they contract over tokens (fp8_quant.quant_rows_t,
or dgrad2_swiglu's epilogue). Expert segments start on 128-row boundaries, so a scale block never
mixes experts; rows past an expert's real count are zeros. The K loop stops at the last
128-row step holding a real row (all-padding steps are skipped) and promotes each step's
partial product into the fp32 accumulator with its two scale vectors.

Tiles: one program per (expert, BLOCK_M x BLOCK_N tile of dw), experts longest first, so the
long K loops start early. Output in the parameters' dtype and layout [E, M, N]; an expert with
no rows gets zeros. Fixed row order, no atomics: deterministic.
Waits on: nothing inside the launch (stream order). Signals: nothing.
"""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper.kernels.tiling import constexprs, grouped_tile
from torchtitan_megamoe.ops.hopper.plan import Plan


@triton.jit
def _fp8_wgrad_kernel(
    at_desc, ats_ptr, bt_desc, bts_ptr, out_desc, seg_start_ptr, count_ptr, order_ptr,
    M, N, stride_ats, stride_bts,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, F32_DOT: tl.constexpr,
):
    # Both operands and the output by TMA: pointer tiles of [128, 128] 64-bit addresses spill.
    num_m = M // BLOCK_M
    num_n = N // BLOCK_N
    per_expert = num_m * num_n
    e = tl.load(order_ptr + tl.program_id(0) // per_expert)
    pid_m, pid_n = grouped_tile(tl.program_id(0) % per_expert, num_m, num_n, GROUP_M)
    m0 = (pid_m * BLOCK_M).to(tl.int32)
    n0 = (pid_n * BLOCK_N).to(tl.int32)
    m64 = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    n64 = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
    start = tl.load(seg_start_ptr + e)
    steps = (tl.load(count_ptr + e) + 127) // 128
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, steps):
        r0 = start + i * 128
        a = at_desc.load([m0, r0])
        b = bt_desc.load([n0, r0]).T
        sa = tl.load(ats_ptr + m64 * stride_ats + r0 // 128)
        sb = tl.load(bts_ptr + n64 * stride_bts + r0 // 128)
        if F32_DOT:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
    out_desc.store([(e * M + m0).to(tl.int32), n0], acc.to(out_desc.dtype))


def fp8_wgrad_triton(at, ats, bt, bts, plan: Plan, out: torch.Tensor, order: torch.Tensor,
                     cfg: dict) -> None:
    """out [E, M, N] (written whole) = per expert A^T[:, seg] @ B^T[:, seg]^T, experts in
    ``order``; ``cfg``: a TritonGemm's kwargs()."""
    E, M, N = out.shape
    bm, bn = cfg["block_m"], cfg["block_n"]
    assert M % bm == 0 and N % bn == 0, (M, N, cfg)
    desc = TensorDescriptor.from_tensor
    _fp8_wgrad_kernel[(E * (M // bm) * (N // bn),)](
        desc(at, [bm, 128]), ats, desc(bt, [bn, 128]), bts,
        desc(out.view(E * M, N), [bm, bn]), plan.seg_start, plan.count, order, M, N,
        ats.stride(0), bts.stride(0), F32_DOT=settings.triton_interpreting(),
        **constexprs(cfg))
