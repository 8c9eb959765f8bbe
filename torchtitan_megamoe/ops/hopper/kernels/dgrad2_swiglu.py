"""dgrad2_swiglu (Triton): dgrad of linear 2 fused with the SwiGLU backward and d(topk_weights).

Per (row tile, H tile) of the plan's expert-grouped row space, with e the tile's expert, dy_r the
row of the row's token (read by indirection, no permute copy), w_r its routing weight and
a = [a1 | a3] GEMM 1's pre-activations in the same row space (bf16; the forward's saved copy,
or the backward's recompute with the forward's own kernel, bf16_backward.py):

    dh = dy_r @ w2[e]                               (unweighted, fp32 accumulator)
    h  = silu(a1) * a3
    da1 = w_r * dh * a3 * silu'(a1),  da3 = w_r * dh * silu(a1)
    hw  = w_r * h                                   (the A-operand of dw2, weight folded in)
    dtw_part[n_tile, r] = sum over the tile's H columns of dh * h

d(topk_weights)[t,k] = <dy[t], y_slot> = <dy[t], h_r @ w2[e]^T> = <dh_r, h_r>, so it needs no
second GEMM: each H tile stores its partial dot and the combine kernel sums the partials in fixed
order (deterministic, no atomics).

The K loop is one plain dgrad GEMM dy_r @ w2[e] (2*T*K*D*H flops, one accumulator); the
epilogue loads the a1 / a3 tiles at the same (row, column) offsets it stores da at. (Recomputing
a1/a3 in the K loop instead takes three accumulators and three times the flops; rerunning
GEMM 1 with its a store before this kernel is faster.)

Tiles: BLOCK_M rows (a divisor of the plan's block_m, so a tile has one expert) x BLOCK_N columns
of H, K-loop over D in BLOCK_K. Program ids run H tiles fastest, so the programs in flight share
a row tile's dy rows and one expert's weights in L2.
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

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper.kernels.mma import mma
from torchtitan_megamoe.ops.hopper.plan import Plan
from torchtitan_megamoe.ops.hopper.kernels.tiling import cdiv


@triton.jit
def _dgrad2_swiglu_kernel(
    dy_ptr, tw_ptr, w2_ptr, w2_desc,
    row_slot_ptr, tile_expert_ptr, a_ptr, a_desc,
    da_ptr, hw_ptr, da_desc, hw_desc, part_ptr,
    H, D, TOPK, R_MAX,
    s_dy, s_a,
    s_w2e, s_w2d, s_w2h,
    s_da, s_hw,
    PLAN_BM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr,
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

    dy_rows = dy_ptr + tok[:, None] * s_dy
    w2_cols = w2_ptr + e * s_w2e + rn[None, :].to(tl.int64) * s_w2h

    dh = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    w2_row = (e * D).to(tl.int32)  # first row of w2[e] in the [E*D, H] view (TMA path)
    for k0 in range(0, D, BLOCK_K):
        kk = k0 + rk
        if EVEN:  # D % BLOCK_K == 0 and H % BLOCK_N == 0: only padding rows need a mask
            row_mask = valid[:, None]
        else:
            k_ok = kk < D
            row_mask = valid[:, None] & k_ok[None, :]
            w_mask = k_ok[:, None] & n_ok[None, :]
        dya = tl.load(dy_rows + kk[None, :], mask=row_mask, other=0.0)
        # The weight tile as a [BLOCK_K, BLOCK_N] view of w2[e].
        if USE_TMA:  # bulk tensor copies; only with EVEN, so a tile never crosses experts
            w2t = w2_desc.load([w2_row + k0, pid_n * BLOCK_N])
        elif EVEN:
            w2t = tl.load(w2_cols + kk[:, None].to(tl.int64) * s_w2d)
        else:
            w2t = tl.load(w2_cols + kk[:, None].to(tl.int64) * s_w2d, mask=w_mask, other=0.0)
        dh = mma(dya, w2t, dh, UPCAST)

    tw = tl.load(tw_ptr + slot, mask=valid, other=0.0).to(tl.float32)[:, None]
    out_mask = None if EVEN else n_ok[None, :]
    row_off = rm[:, None].to(tl.int64)
    # Row-space tiles (a, da, hw) are whole [BLOCK_M, BLOCK_N] blocks of contiguous rows: with
    # USE_TMA they move by descriptor, which also keeps [BLOCK_M, BLOCK_N] 64-bit pointer
    # tensors out of the registers (they made the 128-wide tiles spill kilobytes).
    # GEMM 1 stored every row of the used tiles (padding rows as zeros), so no row mask;
    # columns past H (uneven H only) read as 0. a1 becomes silu and silu' before a3 is loaded,
    # so fewer tiles are live at once; each result is stored as it exists.
    row0 = (pid_m * BLOCK_M).to(tl.int32)
    col0 = (pid_n * BLOCK_N).to(tl.int32)
    a_rows = a_ptr + row_off * s_a + rn[None, :]
    if USE_TMA:
        a1 = a_desc.load([row0, col0]).to(tl.float32)
    elif EVEN:
        a1 = tl.load(a_rows).to(tl.float32)
    else:
        a1 = tl.load(a_rows, mask=out_mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(a1)
    silu = a1 * sig
    dsilu = sig * (1.0 + a1 * (1.0 - sig))
    if USE_TMA:
        a3 = a_desc.load([row0, H + col0]).to(tl.float32)
    elif EVEN:
        a3 = tl.load(a_rows + H).to(tl.float32)
    else:
        a3 = tl.load(a_rows + H, mask=out_mask, other=0.0).to(tl.float32)
    h = silu * a3
    # Columns past H hold zeros in every tile, so they add nothing to the partial dot.
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


def dgrad2_swiglu(
    dy: torch.Tensor,
    a: torch.Tensor,
    topk_weights: torch.Tensor,
    w2: torch.Tensor,
    plan: Plan,
    *,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
    num_warps: int = 8,
    num_stages: int = 3,
    use_tma: bool = False,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch dgrad2_swiglu. Returns (da [R_max, 2H], hw [R_max, H], dtw_part [n_h_tiles, R_max]).

    dy: [T, D] (rows contiguous in D); a: [R_max, 2H] GEMM 1's pre-activations [a1 | a3] for
    this plan (gemm1_swiglu(..., save_a=True)); topk_weights: [T, K]; w2: [E, D, H].
    block_m (default: the plan's) must divide plan.block_m. use_tma loads the w2 tiles and the
    row-space tiles with TMA descriptors; it applies only when D % block_k == H % block_n == 0
    and w2 is contiguous (else pointer loads). ``out`` optionally supplies the three buffers
    (tests poison them to prove every read row is written)."""
    T, D = dy.shape
    E, _, H = w2.shape
    R = plan.max_rows
    n_tiles_h = cdiv(H, block_n)
    if out is None:
        da = torch.empty(R, 2 * H, dtype=dy.dtype, device=dy.device)
        hw = torch.empty(R, H, dtype=dy.dtype, device=dy.device)
        part = torch.empty(n_tiles_h, R, dtype=torch.float32, device=dy.device)
    else:
        da, hw, part = out
    if a.shape != (R, 2 * H) or a.dtype != dy.dtype:
        raise ValueError(f"a must be [{R}, {2 * H}] {dy.dtype}, got {tuple(a.shape)} {a.dtype}")
    for name, t in (("dy", dy), ("da", da), ("hw", hw), ("a", a)):
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
    use_tma = use_tma and even and w2.is_contiguous()
    d2, a_d, da_d, hw_d = w2, a, da, hw  # placeholders on the pointer path
    if use_tma:
        d2 = TensorDescriptor.from_tensor(w2.view(E * D, H), [block_k, block_n])
        a_d = TensorDescriptor.from_tensor(a, [block_m, block_n])
        da_d = TensorDescriptor.from_tensor(da, [block_m, block_n])
        hw_d = TensorDescriptor.from_tensor(hw, [block_m, block_n])
    grid = (R // block_m * n_tiles_h,)
    _dgrad2_swiglu_kernel[grid](
        dy, tw, w2, d2,
        plan.row_slot, plan.tile_expert, a, a_d,
        da, hw, da_d, hw_d, part,
        H, D, plan.top_k, R,
        dy.stride(0), a.stride(0),
        *w2.stride(),
        da.stride(0), hw.stride(0),
        PLAN_BM=plan.block_m, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN=even, USE_TMA=use_tma, UPCAST=settings.triton_interpreting(),
        num_warps=num_warps, num_stages=num_stages,
    )
    return da, hw, part
