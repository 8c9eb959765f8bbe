"""Backward kernel A: dgrad of linear 2 fused with the SwiGLU backward and d(topk_weights).

Per (row tile, H tile) of the plan's expert-grouped row space, with e the tile's expert, x_r and
dy_r the rows of the row's token (read by indirection, no permute copy) and w_r its routing
weight:

    a1 = x_r @ w1[e]^T,  a3 = x_r @ w3[e]^T          (recomputed, fp32 accumulators; or loaded)
    dh = dy_r @ w2[e]                               (unweighted, fp32 accumulator)
    h  = silu(a1) * a3
    da1 = w_r * dh * a3 * silu'(a1),  da3 = w_r * dh * silu(a1)
    hw  = w_r * h                                   (the A-operand of dw2, weight folded in)
    dtw_part[n_tile, r] = sum over the tile's H columns of dh * h

d(topk_weights)[t,k] = <dy[t], y_slot> = <dy[t], h_r @ w2[e]^T> = <dh_r, h_r>, so it needs no
second GEMM: each H tile stores its partial dot and the combine kernel sums the partials in fixed
order (deterministic, no atomics).

Two variants (constexpr SAVED, one kernel):
  recompute (saved=None): the K loop runs three GEMMs (x@w1^T, x@w3^T, dy@w2): 6*T*K*D*H flops.
  saved (the forward stored a = [a1 | a3] [R_max, 2H] bf16 in the plan's row space, see
      gemm1_swiglu.py): the K loop is one plain dgrad GEMM dy_r @ w2[e] (2*T*K*D*H flops, one
      accumulator) and the epilogue loads the a1 / a3 tiles at the same (row, column) offsets it
      stores da at. a1/a3 are then the bf16-rounded values the forward stored (as stock
      autograd saves them), not fp32 accumulators: results differ from the recompute variant by
      bf16 rounding, not bitwise.

Tiles: BLOCK_M rows (a divisor of the plan's block_m, so a tile has one expert) x BLOCK_N columns of H,
K-loop over D in BLOCK_K. Three fp32 accumulators of BLOCK_M x BLOCK_N (one when SAVED). Program ids run H tiles
fastest, so the programs in flight share a row tile's x/dy rows and one expert's weights in L2.
Waits on: nothing (stream order after the plan). Signals: nothing (stream order).

Outputs, rows of tiles past the used rows are left untouched (never read):
    da   [R_max, 2H] bf16: da1 in columns [0, H), da3 in [H, 2H)
    hw   [R_max, H]  bf16
    dtw_part [cdiv(H, BLOCK_N), R_max] fp32
Padding rows load zeros, so they store zeros.
"""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from torchtitan_megamoe.ops.triton.bwd_common import interpreting, mma
from torchtitan_megamoe.ops.triton.plan import Plan


@triton.jit
def _dgrad_l2_swiglu_kernel(
    x_ptr, dy_ptr, tw_ptr, w1_ptr, w2_ptr, w3_ptr, w1_desc, w2_desc, w3_desc,
    row_slot_ptr, tile_expert_ptr, a_ptr, a_desc,
    da_ptr, hw_ptr, da_desc, hw_desc, part_ptr,
    H, D, TOPK, R_MAX,
    s_x, s_dy, s_a,
    s_w1e, s_w1h, s_w1d,
    s_w2e, s_w2d, s_w2h,
    s_w3e, s_w3h, s_w3d,
    s_da, s_hw,
    PLAN_BM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr, SAVED: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(H, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    # BLOCK_M divides the plan's tile height, so a row tile lies inside one plan tile.
    e = tl.load(tile_expert_ptr + (pid_m * BLOCK_M) // PLAN_BM)
    if e < 0:
        return
    e = e.to(tl.int64)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < H

    slot = tl.load(row_slot_ptr + rm)
    valid = slot >= 0
    tok = tl.where(valid, slot // TOPK, 0).to(tl.int64)

    x_rows = x_ptr + tok[:, None] * s_x
    dy_rows = dy_ptr + tok[:, None] * s_dy
    w1_cols = w1_ptr + e * s_w1e + rn[None, :].to(tl.int64) * s_w1h
    w3_cols = w3_ptr + e * s_w3e + rn[None, :].to(tl.int64) * s_w3h
    w2_cols = w2_ptr + e * s_w2e + rn[None, :].to(tl.int64) * s_w2h

    if not SAVED:
        a1 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        a3 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    dh = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    # Rows of the [E*H, D] / [E*D, H] weight views that this tile reads (TMA path).
    w13_row = (e * H + pid_n * BLOCK_N).to(tl.int32)
    w2_row = (e * D).to(tl.int32)
    for k0 in range(0, D, BLOCK_K):
        kk = k0 + rk
        if EVEN:  # D % BLOCK_K == 0 and H % BLOCK_N == 0: only padding rows need a mask
            row_mask = valid[:, None]
        else:
            k_ok = kk < D
            row_mask = valid[:, None] & k_ok[None, :]
            w_mask = k_ok[:, None] & n_ok[None, :]
        dya = tl.load(dy_rows + kk[None, :], mask=row_mask, other=0.0)
        # Weight tiles as [BLOCK_K, BLOCK_N] views of w1[e]^T, w3[e]^T and w2[e].
        if USE_TMA:  # bulk tensor copies; only with EVEN, so a tile never crosses experts
            w2t = w2_desc.load([w2_row + k0, pid_n * BLOCK_N])
        elif EVEN:
            w2t = tl.load(w2_cols + kk[:, None].to(tl.int64) * s_w2d)
        else:
            w2t = tl.load(w2_cols + kk[:, None].to(tl.int64) * s_w2d, mask=w_mask, other=0.0)
        dh = mma(dya, w2t, dh, UPCAST)
        if not SAVED:
            xa = tl.load(x_rows + kk[None, :], mask=row_mask, other=0.0)
            if USE_TMA:
                w1t = w1_desc.load([w13_row, k0]).T
                w3t = w3_desc.load([w13_row, k0]).T
            elif EVEN:
                w1t = tl.load(w1_cols + kk[:, None].to(tl.int64) * s_w1d)
                w3t = tl.load(w3_cols + kk[:, None].to(tl.int64) * s_w3d)
            else:
                w1t = tl.load(w1_cols + kk[:, None].to(tl.int64) * s_w1d, mask=w_mask, other=0.0)
                w3t = tl.load(w3_cols + kk[:, None].to(tl.int64) * s_w3d, mask=w_mask, other=0.0)
            a1 = mma(xa, w1t, a1, UPCAST)
            a3 = mma(xa, w3t, a3, UPCAST)

    # Epilogue ordered so that each result is stored as soon as it exists (register pressure:
    # three BLOCK_M x BLOCK_N fp32 accumulators are live on entry).
    tw = tl.load(tw_ptr + slot, mask=valid, other=0.0).to(tl.float32)[:, None]
    out_mask = None if EVEN else n_ok[None, :]
    row_off = rm[:, None].to(tl.int64)
    # Row-space tiles (a, da, hw) are whole [BLOCK_M, BLOCK_N] blocks of contiguous rows: with
    # USE_TMA they move by descriptor, which also keeps [BLOCK_M, BLOCK_N] 64-bit pointer
    # tensors out of the registers (they made the 128-wide SAVED tiles spill kilobytes).
    # The forward stored every row of the used tiles (padding rows as zeros), so no row mask;
    # columns past H (uneven H only) read as 0 like the recompute's accumulators. a1 becomes
    # silu and silu' before a3 is loaded, so fewer tiles are live at once.
    row0 = (pid_m * BLOCK_M).to(tl.int32)
    col0 = (pid_n * BLOCK_N).to(tl.int32)
    a_rows = a_ptr + row_off * s_a + rn[None, :]
    if SAVED:
        if USE_TMA:
            a1 = a_desc.load([row0, col0]).to(tl.float32)
        elif EVEN:
            a1 = tl.load(a_rows).to(tl.float32)
        else:
            a1 = tl.load(a_rows, mask=out_mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(a1)
    silu = a1 * sig
    dsilu = sig * (1.0 + a1 * (1.0 - sig))
    if SAVED:
        if USE_TMA:
            a3 = a_desc.load([row0, H + col0]).to(tl.float32)
        elif EVEN:
            a3 = tl.load(a_rows + H).to(tl.float32)
        else:
            a3 = tl.load(a_rows + H, mask=out_mask, other=0.0).to(tl.float32)
    h = silu * a3
    # Columns past H hold zeros in every accumulator, so they add nothing to the partial dot.
    tl.store(part_ptr + pid_n.to(tl.int64) * R_MAX + rm, tl.sum(dh * h, axis=1))
    hw = (h * tw).to(hw_ptr.dtype.element_ty)
    g = dh * tw
    da3 = (g * silu).to(da_ptr.dtype.element_ty)
    da1 = (g * a3 * dsilu).to(da_ptr.dtype.element_ty)
    if USE_TMA:
        hw_desc.store([row0, col0], hw)
        da_desc.store([row0, H + col0], da3)
        da_desc.store([row0, col0], da1)
    else:
        da_rows = da_ptr + row_off * s_da + rn[None, :]
        tl.store(hw_ptr + row_off * s_hw + rn[None, :], hw, mask=out_mask)
        tl.store(da_rows + H, da3, mask=out_mask)
        tl.store(da_rows, da1, mask=out_mask)


def dgrad_l2_swiglu(
    dy: torch.Tensor,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    plan: Plan,
    *,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
    num_warps: int = 8,
    num_stages: int = 3,
    use_tma: bool = False,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    a: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch kernel A. Returns (da [R_max, 2H], hw [R_max, H], dtw_part [n_h_tiles, R_max]).

    dy, x: [T, D] (rows contiguous in D); topk_weights: [T, K]; w1, w3: [E, H, D]; w2: [E, D, H].
    block_m (default: the plan's) must divide plan.block_m. use_tma loads the weight tiles with
    TMA descriptors; it applies only when D % block_k == H % block_n == 0 and the weights are
    contiguous (else pointer loads). ``out`` optionally supplies the three buffers (tests poison
    them to prove every read row is written). ``a``: the forward's saved [R_max, 2H]
    pre-activations [a1 | a3] (gemm1_swiglu(..., save_a=True) with this plan); given, the kernel
    loads them instead of recomputing (x, w1, w3 are then not read)."""
    T, D = x.shape
    E, H, _ = w1.shape
    R = plan.max_rows
    n_tiles_h = triton.cdiv(H, block_n)
    if out is None:
        da = torch.empty(R, 2 * H, dtype=x.dtype, device=x.device)
        hw = torch.empty(R, H, dtype=x.dtype, device=x.device)
        part = torch.empty(n_tiles_h, R, dtype=torch.float32, device=x.device)
    else:
        da, hw, part = out
    if a is not None and (a.shape != (R, 2 * H) or a.dtype != x.dtype):
        raise ValueError(f"saved a must be [{R}, {2 * H}] {x.dtype}, got {tuple(a.shape)} {a.dtype}")
    saved = a is not None
    a = da if a is None else a  # placeholder pointer when recomputing (never read)
    for name, t in (("x", x), ("dy", dy), ("da", da), ("hw", hw), ("a", a)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have contiguous rows (stride(-1) == 1); call .contiguous()")
    if part.shape != (n_tiles_h, R) or not part.is_contiguous():
        raise ValueError(f"dtw_part must be a contiguous [{n_tiles_h}, {R}] buffer")
    tw = topk_weights.reshape(-1)
    if not tw.is_contiguous():
        tw = tw.contiguous()
    block_m = block_m or plan.block_m
    if plan.block_m % block_m:
        raise ValueError(f"block_m {block_m} must divide the plan's block_m {plan.block_m}")
    even = D % block_k == 0 and H % block_n == 0
    use_tma = use_tma and even and all(w.is_contiguous() for w in (w1, w2, w3))
    d1, d2, d3, a_d, da_d, hw_d = w1, w2, w3, a, da, hw  # placeholders on the pointer path
    if use_tma:
        d2 = TensorDescriptor.from_tensor(w2.view(E * D, H), [block_k, block_n])
        da_d = TensorDescriptor.from_tensor(da, [block_m, block_n])
        hw_d = TensorDescriptor.from_tensor(hw, [block_m, block_n])
        if saved:
            a_d = TensorDescriptor.from_tensor(a, [block_m, block_n])
        else:
            d1 = TensorDescriptor.from_tensor(w1.view(E * H, D), [block_n, block_k])
            d3 = TensorDescriptor.from_tensor(w3.view(E * H, D), [block_n, block_k])
    grid = (R // block_m * n_tiles_h,)
    _dgrad_l2_swiglu_kernel[grid](
        x, dy, tw, w1, w2, w3, d1, d2, d3,
        plan.row_slot, plan.tile_expert, a, a_d,
        da, hw, da_d, hw_d, part,
        H, D, plan.top_k, R,
        x.stride(0), dy.stride(0), a.stride(0),
        *w1.stride(), *w2.stride(), *w3.stride(),
        da.stride(0), hw.stride(0),
        PLAN_BM=plan.block_m, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN=even, USE_TMA=use_tma, UPCAST=interpreting(), SAVED=saved,
        num_warps=num_warps, num_stages=num_stages,
    )
    return da, hw, part
