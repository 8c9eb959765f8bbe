"""dgrad1 (Triton): dgrad of linear 1, dx rows stored into their (token, k) slots.

Per (row tile, D tile) of the plan's row space, e the tile's expert:

    dx_slot[row_slot[r]] = da1_r @ w1[e] + da3_r @ w3[e]        ([BLOCK_M, BLOCK_N] of [.., D])

K-loop over H twice (the da1 half against w1[e], then the da3 half against w3[e]) into one fp32
accumulator. Weight tiles come by TMA (use_tma) or pointer loads; tiles that divide D and H
drop every mask but the row one (EVEN). Rows are stored straight into the slot buffer dx_slot [T*K, D] (the combine kernel
sums each token's K slots in fixed order), so no un-permute copy is needed. Padding rows and
tiles past the used rows store nothing; slots that are dropped are never written and never read.
Program ids run D tiles fastest, so the programs in flight share a row tile's da rows in L2.
Waits on: dgrad2_swiglu's da (stream order). Signals: nothing.
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
def _dgrad1_kernel(
    da_ptr, w1_ptr, w3_ptr, w1_desc, w3_desc, out_ptr,
    row_slot_ptr, tile_expert_ptr,
    H, D,
    s_da,
    s_w1e, s_w1h, s_w1d,
    s_w3e, s_w3h, s_w3d,
    s_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(D, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    e = tl.load(tile_expert_ptr + pid_m)
    if e < 0:
        return
    e = e.to(tl.int64)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < D
    da_rows = da_ptr + rm[:, None].to(tl.int64) * s_da
    w1_cols = w1_ptr + e * s_w1e + rn[None, :].to(tl.int64) * s_w1d
    w3_cols = w3_ptr + e * s_w3e + rn[None, :].to(tl.int64) * s_w3d

    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    # da1 against w1[e], then da3 against w3[e]: one K-loop over 2H, half h picks the operands.
    w_row = (e * H).to(tl.int32)  # first row of w[e] in the [E*H, D] view (TMA path)
    for half in tl.static_range(2):
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + rk
            if EVEN:  # H % BLOCK_K == 0 and D % BLOCK_N == 0: no masks
                a = tl.load(da_rows + half * H + kk[None, :])
            else:
                k_ok = kk < H
                a = tl.load(da_rows + half * H + kk[None, :], mask=k_ok[None, :], other=0.0)
            if USE_TMA:
                if half == 0:
                    w = w1_desc.load([w_row + k0, pid_n * BLOCK_N])
                else:
                    w = w3_desc.load([w_row + k0, pid_n * BLOCK_N])
            else:
                if half == 0:
                    w_ptrs = w1_cols + kk[:, None].to(tl.int64) * s_w1h
                else:
                    w_ptrs = w3_cols + kk[:, None].to(tl.int64) * s_w3h
                if EVEN:
                    w = tl.load(w_ptrs)
                else:
                    w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = mma(a, w, acc, UPCAST)

    slot = tl.load(row_slot_ptr + rm)
    valid = slot >= 0
    out = out_ptr + tl.where(valid, slot, 0).to(tl.int64)[:, None] * s_out + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def dgrad1(
    da: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    plan: Plan,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    block_n: int = 128,
    block_k: int = 64,
    num_warps: int = 8,
    num_stages: int = 3,
    use_tma: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch dgrad1. da: [R_max, 2H] from dgrad2_swiglu; w1, w3: [E, H, D].
    Returns dx_slot [T*K, D] (rows of dropped slots left unwritten). use_tma loads the weight
    tiles with TMA descriptors; it applies only when H % block_k == D % block_n == 0 and the
    weights are contiguous (else pointer loads)."""
    E, H, D = w1.shape
    R = plan.max_rows
    if da.shape != (R, 2 * H) or da.stride(-1) != 1:
        raise ValueError(f"da must be [{R}, {2 * H}] with contiguous rows, got {tuple(da.shape)}")
    S = plan.num_tokens * plan.top_k
    if out is None:
        out = torch.empty(S, D, dtype=out_dtype, device=da.device)
    if out.shape != (S, D) or out.stride(-1) != 1:
        raise ValueError(f"dx_slot must be [{S}, {D}] with contiguous rows")
    even = H % block_k == 0 and D % block_n == 0
    use_tma = use_tma and even and w1.is_contiguous() and w3.is_contiguous()
    if use_tma:
        d1 = TensorDescriptor.from_tensor(w1.view(E * H, D), [block_k, block_n])
        d3 = TensorDescriptor.from_tensor(w3.view(E * H, D), [block_k, block_n])
    else:
        d1, d3 = w1, w3
    grid = (plan.num_tiles * cdiv(D, block_n),)
    _dgrad1_kernel[grid](
        da, w1, w3, d1, d3, out,
        plan.row_slot, plan.tile_expert,
        H, D,
        da.stride(0),
        *w1.stride(), *w3.stride(),
        out.stride(0),
        BLOCK_M=plan.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN=even, USE_TMA=use_tma, UPCAST=settings.triton_interpreting(),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
