"""The grouped_mm side (``torch._grouped_mm``, cuBLAS) of the backward stages, beside the Triton
and sm90 kernels; sides/backward.py offers it (MEGAMOE_BWD_IMPL=cublas forces it).

    dgrad2  dh_rows = dy_rows @ w2[e]                       M-grouped (on the forward's saved a1/a3
                                                            only), then swiglu_bwd_rows.py's
                                                            rows kernel; dy_rows are reused by dw2
    wgrad   dw2[e] = dy_rows[seg e]^T @ hw[seg e]           K-grouped: _grouped_mm(A.t(), B, offs)
            dw1[e] = da1[seg e]^T @ x_rows[seg e]           over the plan's padded segments
            dw3[e] = da3[seg e]^T @ x_rows[seg e]           (x_rows gathered once for dw1 and dw3)
    dgrad1  dx_rows = da1 @ w1[e] + da3 @ w3[e]             M-grouped, twice, summed in bf16;
                                                            rows -> slots by a gather so the
                                                            combine kernel reads dx_slot unchanged

The Triton kernels read x and dy through the plan's row -> token indirection; _grouped_mm needs
the rows materialized, so ``gather_rows`` builds x_rows / dy_rows [R_max, D] with ZERO padding
rows (one small Triton kernel; a torch index op on CPU without the interpreter). Each candidate's
timed launch includes its gathers and copies, so the tuner compares whole stages.

_grouped_mm facts relied on (torch/_meta_registrations.py of torch 2.13, which mirrors the
checks of aten/src/ATen/native/cuda/Blas.cpp; the SM90 kernel setup in cuda/GroupMM.cu and
GroupMMCommon.cuh): bf16 operands only, bf16 output (fp32 accumulate); offs int32, 1-D,
cumulative group ENDS (rows past offs[-1] take part in no group: for M-grouped outputs they are
left unwritten); each 2-D operand row- or column-major with its leading stride a multiple of 16
bytes (so D and H multiples of 8 here; the column slices da[:, :H], da[:, H:] are fine);
2-D x 2-D gives [G, M, N], 2-D x 3-D gives [rows, N]; fewer than 1024 groups. K-grouped calls
must pass A as a column-major (transposed) view and B row-major: that is the one layout whose
setup accepts EMPTY groups (experts without rows; any other layout asserts group size > 0) and
that skips the 16-byte group-size check; the other layouts' group sizes would also have to be
multiples of 8 rows (ours are multiples of block_m anyway). An empty group's output is zeros on
Hopper (pytorch/pytorch#172439 reports Blackwell getting this wrong); the GPU test checks an
unrouted expert's gradients are exactly 0. The SM90 kernels are CUTLASS ptr-array grouped GEMMs,
128x256x64 tiles at these sizes, without split-K.

Determinism: the gathers are plain copies and no stage accumulates with atomics on our side;
that torch's grouped GEMM kernels reduce in a fixed order is checked, not assumed: two calls
must give bitwise-equal results (CPU test; the GPU test at the 30B shape).
"""


import torch
import triton
import triton.language as tl

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper.kernels.fp8_quant import round_to_bf16
from torchtitan_megamoe.ops.hopper.plan import Plan
from torchtitan_megamoe.ops.hopper.kernels.tiling import cdiv, next_power_of_2

# ---------------------------------------------------------------------------- row gather


@triton.jit
def _gather_rows_kernel(
    src_ptr, dst_ptr, row_slot_ptr, used_ptr, scale_ptr,
    R, C, TOPK, s_src, s_dst, s_scale,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, SCALED: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """One program per (BLOCK_R rows, BLOCK_C columns) of dst [R, C]: dst[r] = src[token of r],
    zeros for padding rows; programs wholly past the used rows exit. SCALED: src e4m3 rows with
    1x128 scales, dst their bf16 values (dequant_rows' bits). Waits on: the plan and src
    (stream order). Signals: nothing."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    # Rows past the used ones belong to no group (offs end there): leave them unwritten.
    if pid_r * BLOCK_R >= tl.load(used_ptr):
        return
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    r_ok = r < R
    c_ok = c < C
    slot = tl.load(row_slot_ptr + r, mask=r_ok, other=-1)
    ok = slot >= 0
    tok = tl.where(ok, slot // TOPK, 0).to(tl.int64)
    m = ok[:, None] & c_ok[None, :]
    v = tl.load(src_ptr + tok[:, None] * s_src + c[None, :], mask=m,
                other=0.0)  # padding rows of a segment: zeros
    if SCALED:
        sc = tl.load(scale_ptr + tok[:, None] * s_scale + (c // 128)[None, :], mask=m, other=0.0)
        v = round_to_bf16(v.to(tl.float32) * sc, EMULATE).to(dst_ptr.dtype.element_ty)
    tl.store(dst_ptr + r[:, None].to(tl.int64) * s_dst + c[None, :], v,
             mask=r_ok[:, None] & c_ok[None, :])


def gather_rows(src: torch.Tensor, plan: Plan, block_r: int = 16, block_c: int = 256,
                num_warps: int = 4, out: torch.Tensor | None = None,
                scales: torch.Tensor | None = None) -> torch.Tensor:
    """rows[r] = src[row_slot[r] // K] for the plan's rows, zeros in segment padding rows.

    src: [T, C] token rows. Returns [R_max, C] in src's dtype (``out`` if given, contiguous);
    rows past the used ones are not written (no grouped GEMM group reaches them). ``scales``
    [T, C/128]: src is e4m3 rows with these 1x128 scales and the rows are their bf16 values,
    fp8_quant.dequant_rows' bits (the EP backward's dy travels so: no dequantized copy first).
    """
    T, C = src.shape
    if T != plan.num_tokens or src.stride(-1) != 1:
        raise ValueError(f"src must be [{plan.num_tokens}, C] with contiguous rows, "
                         f"got {tuple(src.shape)}")
    dtype = torch.bfloat16 if scales is not None else src.dtype
    if scales is not None and (C % 128 or scales.shape != (T, C // 128)
                               or scales.stride(-1) != 1):
        raise ValueError(f"scales must be [{T}, {C // 128}] with contiguous rows (C % 128 == "
                         f"0), got {tuple(scales.shape)} for src {tuple(src.shape)}")
    R = plan.max_rows
    if out is None:
        out = torch.empty(R, C, dtype=dtype, device=src.device)
    elif out.shape != (R, C) or not out.is_contiguous() or out.dtype != dtype:
        raise ValueError(f"out must be a contiguous [{R}, {C}] {dtype} tensor")
    if not (src.is_cuda or settings.triton_interpreting()):
        # CPU without Triton: the same rows by torch indexing.
        if scales is not None:
            src = (src.float() * scales.repeat_interleave(128, dim=1)).to(dtype)
        slot = plan.row_slot.long()
        torch.index_select(src, 0, slot.clamp(min=0) // plan.top_k, out=out)
        return out.masked_fill_((slot < 0)[:, None], 0)
    dst = out
    block_c = min(block_c, next_power_of_2(C))
    grid = (cdiv(R, block_r), cdiv(C, block_c))
    _gather_rows_kernel[grid](
        src, dst, plan.row_slot, plan.num_rows_used, src if scales is None else scales,
        R, C, plan.top_k, src.stride(0), dst.stride(0),
        0 if scales is None else scales.stride(0),
        BLOCK_R=block_r, BLOCK_C=block_c, SCALED=scales is not None,
        EMULATE=settings.triton_interpreting(), num_warps=num_warps,
    )
    return dst


# ---------------------------------------------------------------------------- stages


def segment_ends(plan: Plan) -> torch.Tensor:
    """offs for _grouped_mm: cumulative ends of the padded expert segments, int32 [E]."""
    return plan.seg_start[1:]


def _as_param(res: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """res as the gradient of parameter ``like``: itself when it already has like's dtype and
    strides (no copy, no second buffer), else copied into a tensor of like's layout."""
    if res.dtype == like.dtype and res.stride() == like.stride():
        return res
    return torch.empty_like(like).copy_(res)


def grouped_wgrad(a_rows: torch.Tensor, b_rows: torch.Tensor, plan: Plan,
                  like: torch.Tensor) -> torch.Tensor:
    """[E, M, N]: out[e] = a_rows[seg e]^T @ b_rows[seg e] for [R_max, M] / [R_max, N] row-space
    operands whose segment padding rows are zero (or finite against zeros), in the dtype and
    layout of the parameter ``like``."""
    res = torch._grouped_mm(a_rows.t(), b_rows, offs=segment_ends(plan))
    return _as_param(res, like)


def wgrad_dw2_grouped_mm(dy: torch.Tensor, hw: torch.Tensor, plan: Plan,
                     w2: torch.Tensor, dy_rows: torch.Tensor | None = None) -> torch.Tensor:
    """dw2[e] = sum_r dy_r^T hw_r (layout of w2): one K-grouped GEMM on dy rows (``dy_rows`` if
    dgrad2_swiglu's grouped_mm or sm90 side already gathered them, else gathered here and freed on return)."""
    if dy_rows is None:
        dy_rows = gather_rows(dy, plan)
    return grouped_wgrad(dy_rows, hw, plan, w2)


def dgrad2_swiglu_grouped_mm(dy: torch.Tensor, a: torch.Tensor, topk_weights: torch.Tensor,
                           w2: torch.Tensor, plan: Plan, out: tuple | None = None,
                           dy_rows: torch.Tensor | None = None):
    """dgrad2_swiglu's grouped_mm side, on the forward's saved a = [a1 | a3]: dh = dy_rows @ w2[e]
    as one M-grouped GEMM (bf16 dh), then the SwiGLU backward rows kernel (swiglu_bwd_rows.py). Returns
    (da, hw, part [1, R_max], dy_rows); dy_rows (zero padding rows) can feed the dw2 GEMM."""
    from torchtitan_megamoe.ops.hopper.kernels.swiglu_bwd_rows import swiglu_bwd_rows

    dy_rows = gather_rows(dy, plan, out=dy_rows)
    dh = torch._grouped_mm(dy_rows, w2, offs=segment_ends(plan))
    return (*swiglu_bwd_rows(dh, a, topk_weights, plan, out=out), dy_rows)


def wgrad_dw13_grouped_mm(da: torch.Tensor, x: torch.Tensor, plan: Plan, w1: torch.Tensor,
                      w3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dw1, dw3 (layouts of w1, w3) from da = [da1 | da3]: x rows gathered ONCE for both
    K-grouped GEMMs."""
    H = da.shape[1] // 2
    x_rows = gather_rows(x, plan)
    return (grouped_wgrad(da[:, :H], x_rows, plan, w1),
            grouped_wgrad(da[:, H:], x_rows, plan, w3))


def dgrad1_grouped_mm(da: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, plan: Plan,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """dx_slot[slot] = da1_r @ w1[e] + da3_r @ w3[e] via two M-grouped GEMMs over the row space,
    then rows -> slots by a gather into out [T*K, D] (allocated after the second GEMM's output
    is freed unless given; dropped slots' rows hold junk that the combine never reads, as with
    dgrad1's Triton side)."""
    H = w1.shape[1]
    ends = segment_ends(plan)
    dx_rows = torch._grouped_mm(da[:, :H], w1, offs=ends)
    dx_rows += torch._grouped_mm(da[:, H:], w3, offs=ends)
    if out is None:
        out = torch.empty(plan.num_tokens * plan.top_k, dx_rows.shape[1], dtype=dx_rows.dtype,
                          device=dx_rows.device)
    torch.index_select(dx_rows, 0, plan.slot_row.clamp(min=0), out=out)
    return out
