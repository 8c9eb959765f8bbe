"""wgrad (Triton): grouped weight gradients, out[e] = sum over expert e's rows of A_r^T B_r.

One kernel serves all three weight gradients (three launches):
    dw2[e] [D, H] = sum_r dy_r^T hw_r        A = dy gathered by token, B = hw (row space)
    dw1[e] [H, D] = sum_r da1_r^T x_r        A = da[:, :H] (row space), B = x gathered
    dw3[e] [H, D] = sum_r da3_r^T x_r        A = da[:, H:] (row space), B = x gathered
"Gathered" operands are read by indirection, row r -> token row_slot[r] // K, so neither dy nor
x is ever permuted into the row space.

Row-space operands can come by TMA (whole [BLOCK_K, BLOCK_C] tiles of the padded segment);
gathered ones are pointer loads (Hopper's TMA has no row gather). Tiles that divide M and N
drop the column masks (EVEN).

Tiles: one program per (expert, BLOCK_M x BLOCK_N tile of out[e]); program ids run an expert's
tiles consecutively so they share its rows in L2, experts largest first (skewed routing would
otherwise leave a heavy expert's long K-loops running alone at the end of the grid). K-loop over the expert's real rows
[seg_start[e], seg_start[e] + count[e]) in BLOCK_K steps, in increasing row order, fp32
accumulator, one store (with ``accumulate``: added to what out holds): no atomics and a fixed
reduction order, so results are bitwise deterministic. An expert without rows stores zeros. Output in the out tensor's dtype (the
parameter's), any strides (the parameter's layout).
Waits on: dgrad2_swiglu's da / hw (stream order). Signals: nothing.
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
def _load_rows(ptr, desc, stride, r0, r, r_ok, c0, cols, col_ok, row_slot_ptr, TOPK,
               GATHER: tl.constexpr, TMA: tl.constexpr, EVEN: tl.constexpr):
    """[BLOCK_K, BLOCK_C] tile of rows r = r0 + arange: row-space rows (pointer loads or TMA),
    or token rows by indirection."""
    if TMA:
        # Whole tile of the row-space buffer: rows past the expert's count are padding rows of
        # its segment (finite zeros from dgrad2_swiglu) and meet zeros of the gathered operand.
        return desc.load([r0, c0])
    if GATHER:
        slot = tl.load(row_slot_ptr + r, mask=r_ok, other=-1)
        ok = slot >= 0
        idx = tl.where(ok, slot // TOPK, 0).to(tl.int64)
    else:
        ok = r_ok
        idx = r.to(tl.int64)
    if EVEN:
        mask = ok[:, None]
    else:
        mask = ok[:, None] & col_ok[None, :]
    return tl.load(ptr + idx[:, None] * stride + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _wgrad_kernel(
    a_ptr, b_ptr, a_desc, b_desc, out_ptr,
    seg_start_ptr, count_ptr, row_slot_ptr, order_ptr,
    M, N, TOPK,
    s_a, s_b,
    s_oe, s_om, s_on,
    A_GATHER: tl.constexpr, B_GATHER: tl.constexpr, A_TMA: tl.constexpr, B_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr, UPCAST: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_e = num_m * num_n
    # Experts in order_ptr's order (largest first): the longest K-loops start first instead of
    # running alone at the end of the grid. Each tile's result does not depend on the order.
    e = tl.load(order_ptr + pid // per_e)
    t = pid % per_e
    pid_m = t // num_n
    pid_n = t % num_n

    start = tl.load(seg_start_ptr + e)
    n_rows = tl.load(count_ptr + e)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, n_rows, BLOCK_K):
        r0 = start + k0
        r = r0 + rk
        r_ok = k0 + rk < n_rows
        a = _load_rows(a_ptr, a_desc, s_a, r0, r, r_ok, pid_m * BLOCK_M, rm, m_ok,
                       row_slot_ptr, TOPK, A_GATHER, A_TMA, EVEN)
        b = _load_rows(b_ptr, b_desc, s_b, r0, r, r_ok, pid_n * BLOCK_N, rn, n_ok,
                       row_slot_ptr, TOPK, B_GATHER, B_TMA, EVEN)
        acc = mma(tl.trans(a), b, acc, UPCAST)

    out = (out_ptr + e.to(tl.int64) * s_oe
           + rm[:, None].to(tl.int64) * s_om + rn[None, :].to(tl.int64) * s_on)
    o_ok = m_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:  # out + acc: one add in the out's dtype, as an add pass after would do
        acc = tl.load(out, mask=o_ok, other=0.0).to(tl.float32) + acc
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=o_ok)


def wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    plan: Plan,
    *,
    a_gather: bool,
    b_gather: bool,
    block_m: int = 128,
    block_n: int = 128,
    block_k: int = 64,
    num_warps: int = 8,
    num_stages: int = 3,
    use_tma: bool = False,
    expert_order: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Launch wgrad: out[e] = sum over expert e's rows of a_r^T b_r, for every local expert.

    a: [rows, M], b: [rows, N] with rows contiguous in the last dim; a "gathered" operand is a
    [T, C] token tensor read through the plan, otherwise a [R_max, C] row-space buffer (column
    slices of a larger buffer are fine). out: [E, M, N], written in its own dtype and strides.
    use_tma loads the row-space operand with a TMA descriptor when block_k divides the plan's
    block_m (so a tile never leaves the expert's padded segment); that path reads the padding
    rows of the segment, which must be finite (dgrad2_swiglu stores zeros there). expert_order
    ([E] int32, a permutation; default ``expert_order(plan)``) is the order in which experts'
    tiles are launched. ``accumulate``: out += the gradient (fp32 out only: one fp32 add, the
    bits of ``out.add_(gradient)``).
    """
    E, M, N = out.shape
    if accumulate and out.dtype != torch.float32:
        raise ValueError(f"wgrad accumulates into fp32 gradients only, out is {out.dtype}")
    if E != plan.num_local_experts:
        raise ValueError(f"out has {E} experts, the plan {plan.num_local_experts}")
    for name, t, gather, cols in (("a", a, a_gather, M), ("b", b, b_gather, N)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have contiguous rows (stride(-1) == 1)")
        rows = plan.num_tokens if gather else plan.max_rows
        if t.shape != (rows, cols):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({rows}, {cols})")
    tma_ok = use_tma and plan.block_m % block_k == 0
    descs = []
    for t, gather, cols in ((a, a_gather, block_m), (b, b_gather, block_n)):
        if tma_ok and not gather and _tma_compatible(t):
            descs.append(TensorDescriptor.from_tensor(t, [block_k, cols]))
        else:
            descs.append(None)
    a_desc, b_desc = descs
    if expert_order is None:
        expert_order = longest_first(plan)
    grid = (E * cdiv(M, block_m) * cdiv(N, block_n),)
    _wgrad_kernel[grid](
        a, b, a if a_desc is None else a_desc, b if b_desc is None else b_desc, out,
        plan.seg_start, plan.count, plan.row_slot, expert_order,
        M, N, plan.top_k,
        a.stride(0), b.stride(0),
        *out.stride(),
        A_GATHER=a_gather, B_GATHER=b_gather,
        A_TMA=a_desc is not None, B_TMA=b_desc is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN=M % block_m == 0 and N % block_n == 0, UPCAST=settings.triton_interpreting(),
        ACCUMULATE=accumulate,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def longest_first(plan: Plan) -> torch.Tensor:
    """Experts by decreasing row count (ties by id), on the device, no host sync."""
    return torch.argsort(plan.count, descending=True, stable=True).to(torch.int32)


def _tma_compatible(t: torch.Tensor) -> bool:
    """TMA needs a 16-byte aligned base and row stride (and a unit last stride)."""
    es = t.element_size()
    return t.stride(-1) == 1 and (t.data_ptr() % 16 == 0) and (t.stride(0) * es) % 16 == 0
