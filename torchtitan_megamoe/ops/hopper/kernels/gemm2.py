"""Grouped GEMM 2 into the row space: y[r] = h_r @ w2[e]^T for every row r of the plan.

Tiles: BLOCK_M rows x BLOCK_N output columns (of D); the K loop walks H in BLOCK_K steps into
one fp32 accumulator. A rows are read contiguously from h and the tile is stored to the same
rows of y [R_max, D] (pointer stores, or one bulk tensor store with TMA_STORE): row space, not
slot space, so every tile is one contiguous store instead of a row scatter, and the combine
finds slot s's row through plan.slot_row. (Memory: y has R_max rows, the static bound, about
as many as the slot buffer it replaced.) Padding rows store zeros (h is 0 there); tiles past the used rows and tiles
whose tile_expert is -1 (skipped by the caller's tile map) store nothing.
PERSISTENT: one program per SM loops over the tiles of the used rows (count read on device).

Waits on: nothing inside the launch (h is complete when GEMM 1's launch is).
Signals: nothing; y is complete when the launch is.
"""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper.kernels.tiling import cast_out, grouped_tile, launch_config
from torchtitan_megamoe.ops.hopper.plan import Plan


@triton.jit
def _gemm2_tile(
    pid_m, pid_n, expert,
    h_ptr, w2_ptr, h_desc, w2_desc, y_ptr, y_desc,
    D, H, stride_h, stride_we, stride_wd, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr, USE_TMA: tl.constexpr, TMA_STORE: tl.constexpr,
):
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_h + offs_k[None, :]
    w_ptrs = (
        w2_ptr
        + expert.to(tl.int64) * stride_we
        + offs_n[None, :].to(tl.int64) * stride_wd
        + offs_k[:, None]
    )
    w_row = expert * D + pid_n * BLOCK_N  # row of the [E*D, H] weight view (TMA path)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, H, BLOCK_K):
        if USE_TMA:
            a = h_desc.load([pid_m * BLOCK_M, k])
            b = w2_desc.load([w_row, k]).T
        else:
            a = tl.load(a_ptrs)
            b = tl.load(w_ptrs)
        if F32_DOT:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    y = cast_out(acc, y_ptr.dtype.element_ty, F32_DOT)
    if TMA_STORE:
        y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], y)
    else:
        tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + offs_n[None, :], y)


@triton.jit
def _gemm2_rows_kernel(
    h_ptr, w2_ptr, h_desc, w2_desc, y_ptr, y_desc, tile_expert_ptr, num_rows_used_ptr,
    num_m_tiles, D, H, stride_h, stride_we, stride_wd, stride_y,
    PLAN_BM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, F32_DOT: tl.constexpr, USE_TMA: tl.constexpr,
    PERSISTENT: tl.constexpr, TMA_STORE: tl.constexpr,
):
    num_n = D // BLOCK_N
    if PERSISTENT:
        num_m = tl.load(num_rows_used_ptr) // BLOCK_M
        for t in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=True):
            pid_m, pid_n = grouped_tile(t, num_m, num_n, GROUP_M)
            expert = tl.load(tile_expert_ptr + (pid_m * BLOCK_M) // PLAN_BM)
            if expert >= 0:  # -1: a tile the caller's tile map skips
                _gemm2_tile(
                    pid_m, pid_n, expert, h_ptr, w2_ptr, h_desc, w2_desc, y_ptr, y_desc,
                    D, H, stride_h, stride_we, stride_wd, stride_y,
                    BLOCK_M, BLOCK_N, BLOCK_K, F32_DOT, USE_TMA, TMA_STORE,
                )
    else:
        pid_m, pid_n = grouped_tile(tl.program_id(0), num_m_tiles, num_n, GROUP_M)
        expert = tl.load(tile_expert_ptr + (pid_m * BLOCK_M) // PLAN_BM)
        if expert >= 0:  # tiles past the used rows exit at once
            _gemm2_tile(
                pid_m, pid_n, expert, h_ptr, w2_ptr, h_desc, w2_desc, y_ptr, y_desc,
                D, H, stride_h, stride_we, stride_wd, stride_y,
                BLOCK_M, BLOCK_N, BLOCK_K, F32_DOT, USE_TMA, TMA_STORE,
            )


def gemm2_triton(h: torch.Tensor, w2: torch.Tensor, plan: Plan, y: torch.Tensor,
                 cfg: dict) -> None:
    """y [R_max, D] = h @ w2[e]^T per row of ``plan`` with the Triton kernel; ``cfg``: a
    TritonGemm's kwargs()."""
    E, D, H = w2.shape
    R = plan.max_rows
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    assert plan.block_m % bm == 0 and D % bn == 0 and H % bk == 0, (cfg, D, H)
    num_m = R // bm
    kw, grid = launch_config(cfg, num_m * (D // bn), h.device,
                             ("use_tma", "persistent", "tma_store"))
    dh, dw, dy = h, w2, y  # placeholders on the pointer paths
    if kw["USE_TMA"]:
        dh = TensorDescriptor.from_tensor(h, [bm, bk])
        dw = TensorDescriptor.from_tensor(w2.view(E * D, H), [bn, bk])
    if kw["TMA_STORE"]:
        dy = TensorDescriptor.from_tensor(y, [bm, bn])
    _gemm2_rows_kernel[grid](
        h, w2, dh, dw, y, dy, plan.tile_expert, plan.num_rows_used,
        num_m, D, H,
        h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        PLAN_BM=plan.block_m, F32_DOT=settings.triton_interpreting(),
        **kw,
    )
