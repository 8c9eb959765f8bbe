"""Grouped GEMM 1 with SwiGLU in the epilogue: h[r] = silu(x_r @ w1[e]^T) * (x_r @ w3[e]^T).

Tiles: BLOCK_M rows x BLOCK_N hidden columns; the K loop walks D in BLOCK_K steps and feeds two
fp32 accumulators (w1 and w3 share the A tile, so x is read once for both). Row r reads its
token x[row_slot[r] // top_k] by indirection (no permuted copy of x); padding rows (slot -1)
load zeros, so their h is exactly 0. Each tile belongs to one expert (segments are padded to
the plan's block_m, a multiple of BLOCK_M); tiles past the used rows exit at once. PERSISTENT:
one program per SM loops over the tiles of the used rows (count read on device).

Optional pre-activation output (``save_a=True``, what the forward saves for the backward so
dgrad2_swiglu need not recompute GEMM 1): a [R_max, 2H] in x.dtype, a1 = x_r @ w1[e]^T in columns
[0, H) and a3 = x_r @ w3[e]^T in [H, 2H) (the layout of the backward's da, so dgrad2_swiglu reads a1
and a3 of an H tile with the same row offsets it stores da with). Both are the fp32 accumulators
rounded once to bf16, stored in the epilogue next to h; padding rows store zeros. Off by default
(then the kernel is the same compiled variant as before: SAVE_A is a constexpr).

Waits on: nothing inside the launch (EP=1; inputs are ready when it starts).
Signals: nothing; h [R_max, H] bf16 (and a) are complete when the launch is.
"""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper.kernels.tiling import (
    cast_out, grouped_tile, launch_config, persistent_programs,
)
from torchtitan_megamoe.ops.hopper.plan import Plan


@triton.jit
def _gemm1_tile(
    pid_m, pid_n, expert,
    x_ptr, w1_ptr, w3_ptr, w1_desc, w3_desc, h_ptr, a_ptr, h_desc, a_desc, row_slot_ptr,
    H, D, stride_x, stride_we, stride_wh, stride_h, stride_a,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr, USE_TMA: tl.constexpr, SAVE_A: tl.constexpr,
):
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(row_slot_ptr + rows)
    has_row = slot >= 0
    tok = tl.where(has_row, slot // TOP_K, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)

    a_ptrs = x_ptr + tok[:, None] * stride_x + offs_k[None, :]
    w_off = expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wh + offs_k[:, None]
    w_row = expert * H + pid_n * BLOCK_N  # row of the [E*H, D] weight view (TMA path)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, D, BLOCK_K):
        a = tl.load(a_ptrs, mask=has_row[:, None], other=0.0)
        if USE_TMA:
            # bulk tensor copies of the weight tiles; A rows are gathered, so they stay
            # pointer loads (Hopper's TMA has no row gather)
            b1 = w1_desc.load([w_row, k]).T
            b3 = w3_desc.load([w_row, k]).T
        else:
            b1 = tl.load(w1_ptr + w_off)
            b3 = tl.load(w3_ptr + w_off)
        if F32_DOT:
            a, b1, b3 = a.to(tl.float32), b1.to(tl.float32), b3.to(tl.float32)
        acc1 = tl.dot(a, b1, acc1)
        acc3 = tl.dot(a, b3, acc3)
        a_ptrs += BLOCK_K
        w_off += BLOCK_K

    h = acc1 * tl.sigmoid(acc1) * acc3
    if SAVE_A and USE_TMA:
        # The tile's rows are contiguous in the row space: descriptor stores keep three
        # [BLOCK_M, BLOCK_N] 64-bit pointer tensors out of the registers (they spilled).
        row0 = (pid_m * BLOCK_M).to(tl.int32)
        col0 = (pid_n * BLOCK_N).to(tl.int32)
        a_desc.store([row0, col0], cast_out(acc1, a_ptr.dtype.element_ty, F32_DOT))
        a_desc.store([row0, H + col0], cast_out(acc3, a_ptr.dtype.element_ty, F32_DOT))
        h_desc.store([row0, col0], cast_out(h, h_ptr.dtype.element_ty, F32_DOT))
    else:
        if SAVE_A:
            a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_a + offs_n[None, :]
            tl.store(a_ptrs, cast_out(acc1, a_ptr.dtype.element_ty, F32_DOT))
            tl.store(a_ptrs + H, cast_out(acc3, a_ptr.dtype.element_ty, F32_DOT))
        h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_h + offs_n[None, :]
        tl.store(h_ptrs, cast_out(h, h_ptr.dtype.element_ty, F32_DOT))


@triton.jit
def _gemm1_swiglu_kernel(
    x_ptr, w1_ptr, w3_ptr, w1_desc, w3_desc, h_ptr, a_ptr, h_desc, a_desc, row_slot_ptr,
    tile_expert_ptr,
    num_rows_used_ptr, num_m_tiles, H, D, stride_x, stride_we, stride_wh, stride_h, stride_a,
    TOP_K: tl.constexpr, PLAN_BM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, F32_DOT: tl.constexpr,
    USE_TMA: tl.constexpr, PERSISTENT: tl.constexpr,
    SAVE_A: tl.constexpr,
):
    num_n = H // BLOCK_N
    if PERSISTENT:
        # one program per SM walks the tiles of the USED rows only (read on device), so tiles
        # past the end cost nothing and the next tile's loads overlap this tile's epilogue
        num_m = tl.load(num_rows_used_ptr) // BLOCK_M
        for t in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=True):
            pid_m, pid_n = grouped_tile(t, num_m, num_n, GROUP_M)
            expert = tl.load(tile_expert_ptr + (pid_m * BLOCK_M) // PLAN_BM)
            if expert >= 0:  # -1: a tile the caller's tile map skips
                _gemm1_tile(
                    pid_m, pid_n, expert, x_ptr, w1_ptr, w3_ptr, w1_desc, w3_desc, h_ptr, a_ptr,
                    h_desc, a_desc, row_slot_ptr, H, D, stride_x, stride_we, stride_wh, stride_h,
                    stride_a, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, F32_DOT, USE_TMA, SAVE_A,
                )
    else:
        pid_m, pid_n = grouped_tile(tl.program_id(0), num_m_tiles, num_n, GROUP_M)
        expert = tl.load(tile_expert_ptr + (pid_m * BLOCK_M) // PLAN_BM)
        if expert >= 0:  # tiles past the used rows exit at once
            _gemm1_tile(
                pid_m, pid_n, expert, x_ptr, w1_ptr, w3_ptr, w1_desc, w3_desc, h_ptr, a_ptr,
                h_desc, a_desc, row_slot_ptr, H, D, stride_x, stride_we, stride_wh, stride_h, stride_a,
                TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, F32_DOT, USE_TMA, SAVE_A,
            )


def gemm1_swiglu_triton(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, plan: Plan,
                        h: torch.Tensor, a_out: torch.Tensor | None, cfg: dict) -> None:
    """h (and [a1 | a3] into ``a_out`` unless None) for the rows of ``plan`` with the Triton
    kernel; ``cfg``: a TritonGemm's kwargs()."""
    E, H, D = w1.shape
    R = plan.max_rows
    store_a = a_out is not None
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    assert plan.block_m % bm == 0 and H % bn == 0 and D % bk == 0, (cfg, H, D)
    num_m = R // bm
    kw, grid = launch_config(cfg, num_m * (H // bn), x.device)
    if kw["GROUP_M"] == "wave":
        kw["GROUP_M"] = max(1, persistent_programs(x.device) // (H // bn))
    a_ptr = a_out if store_a else h  # a placeholder when nothing is stored
    d1, d3, dh, da = w1, w3, h, a_ptr  # placeholders on the pointer path
    if kw["USE_TMA"]:
        d1 = TensorDescriptor.from_tensor(w1.view(E * H, D), [bn, bk])
        d3 = TensorDescriptor.from_tensor(w3.view(E * H, D), [bn, bk])
        if store_a:
            dh = TensorDescriptor.from_tensor(h, [bm, bn])
            da = TensorDescriptor.from_tensor(a_out, [bm, bn])
    _gemm1_swiglu_kernel[grid](
        x, w1, w3, d1, d3, h, a_ptr, dh, da, plan.row_slot, plan.tile_expert,
        plan.num_rows_used, num_m, H, D,
        x.stride(0), w1.stride(0), w1.stride(1), h.stride(0), a_ptr.stride(0),
        TOP_K=plan.top_k, PLAN_BM=plan.block_m, F32_DOT=settings.triton_interpreting(),
        SAVE_A=store_a, **kw,
    )
