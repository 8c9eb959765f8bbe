"""Python side of csrc/fp8_gemm_sm90.cu: the blockwise-FP8 grouped GEMMs, warp-specialized
(tiles of 128 rows x 128 columns, K steps of 128, the partial product promoted into fp32 per
step with its scales; see the .cu file).

- ``fp8_gemm_rows_sm90``: out [R_max, N] bf16 = aq[r] @ bq[e]^T, scaled (GEMM 2; the backward's
  dgrad of linear 1 with the transposed [w1 | w3] copy). Same contract as
  kernels/fp8_gemm_rows.fp8_gemm_rows without the gather, so the two are candidates of one
  tuner entry.
- ``fp8_gemm1_swiglu_sm90``: GEMM 1 + SwiGLU on the plan's token rows of xq, h in e4m3 with
  per-row scales per 128 columns, optionally a = [a1 | a3] bf16 (kernels/fp8_gemm_rows.
  fp8_gemm1_swiglu's contract).
- ``fp8_wgrad_sm90``: the weight gradients, K-grouped over each expert's segment
  (kernels/fp8_wgrad.fp8_wgrad's contract), units handed out by a dynamic ticket.
- ``fp8_dgrad2_swiglu_sm90``: the backward's kernel A (kernels/fp8_gemm_rows.fp8_dgrad2_swiglu's
  contract): dy rows @ w2[e], the SwiGLU backward, da per row, da^T and h^T per 128 rows, the
  d(topk_weights) partials.

The row-space kernels write only the used rows; tiles whose tile_expert is -1 are skipped.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from torchtitan_megamoe.ops.hopper.cuda.build import load
from torchtitan_megamoe.ops.hopper.cuda.sm90 import check_plan, launch_context, raise_on_error
from torchtitan_megamoe.ops.hopper.kernels.fp8_quant import FP8

if TYPE_CHECKING:
    from torchtitan_megamoe.ops.hopper.plan import Plan

SOURCE = "fp8_gemm_sm90"
BM, BN, BK = 128, 128, 128


def fp8_gemm_library() -> ctypes.CDLL:
    lib = load(SOURCE)
    if not getattr(lib, "_megamoe_typed", False):
        p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        lib.megamoe_fp8_gemm_rows.argtypes = [p, p, ll, p, p, ll, ll, p, p, p, p, i, i, i, i, i,
                                              i, ll, i, p]
        lib.megamoe_fp8_gemm_rows.restype = i
        lib.megamoe_fp8_gemm1_swiglu.argtypes = [p, ll, p, ll, p, p, p, p, ll, ll, p, p, p, p, p,
                                                 p, i, i, i, i, i, i, i, p]
        lib.megamoe_fp8_gemm1_swiglu.restype = i
        lib.megamoe_fp8_dswiglu.argtypes = [p, ll, p, ll, p, p, ll, ll, p, p, p, p, p, p, p, p,
                                            p, p, p, p, i, i, i, i, i, i, ll, i, p]
        lib.megamoe_fp8_dswiglu.restype = i
        lib.megamoe_fp8_wgrad.argtypes = [p, p, ll, p, p, ll, p, p, p, p, i, i, i, ll, i, i, p, p]
        lib.megamoe_fp8_wgrad.restype = i
        lib.megamoe_error_string.argtypes = [i]
        lib.megamoe_error_string.restype = ctypes.c_char_p
        lib._megamoe_typed = True
    return lib


def shape_supported(N: int, K: int, block_m: int) -> bool:
    return N % BN == 0 and K % BK == 0 and block_m % BM == 0


def _check_common(who, plan, N, K, weights, scales):
    if not shape_supported(N, K, plan.block_m):
        raise ValueError(f"{who} needs N % {BN} == 0, K % {BK} == 0 and a plan block_m multiple "
                         f"of {BM}; got N={N}, K={K}, block_m={plan.block_m}")
    for name, w in weights.items():
        if w.dtype != FP8 or not w.is_contiguous() or w.data_ptr() % 16:
            raise ValueError(f"{who}: {name} must be contiguous, 16-byte aligned e4m3")
    for name, s in scales.items():
        if s.dtype != torch.float32 or s.stride(-1) != 1:
            raise ValueError(f"{who}: {name} must be fp32 with unit-stride rows")


def _check_token_rows(who, q_name, q, s_name, s, D):
    """The token rows a gathering kernel reads by cp.async: e4m3 [T, D], 16-byte aligned rows,
    with their [T, D/128] scales."""
    if q.dtype != FP8 or q.stride(1) != 1 or q.stride(0) % 16 or q.data_ptr() % 16:
        raise ValueError(f"{who}: {q_name} must be e4m3 with unit-stride, 16-byte aligned rows")
    if q.shape[1] != D or s.shape != (q.shape[0], D // BK):
        raise ValueError(f"{who}: {q_name} {tuple(q.shape)} / {s_name} {tuple(s.shape)} do not "
                         f"match D={D}")


def fp8_gemm_rows_sm90(aq, a_s, bq, b_s, plan: Plan, out: torch.Tensor, group_m: int = 8,
                  expert_base: int | None = None) -> None:
    """Writes the used rows of out [R_max, N] (bf16) = (aq [R_max, K] @ bq[e]^T [E, N, K]),
    scaled by a_s [R_max, K/128] and b_s [E, N/128, K/128]. With ``expert_base`` e0: bq, b_s
    hold experts [e0, e0 + E) only, and only their rows are written."""
    who = "fp8_gemm_rows_sm90"
    E, N, K = bq.shape
    if expert_base is not None and not 0 <= expert_base <= plan.num_local_experts - E:
        raise ValueError(f"{who}: experts [{expert_base}, {expert_base + E}) are not within "
                         f"the plan's {plan.num_local_experts}")
    R = plan.max_rows
    _check_common(who, plan, N, K, {"aq": aq, "bq": bq}, {"a_s": a_s, "b_s": b_s})
    if aq.shape != (R, K) or out.shape != (R, N) or a_s.shape != (R, K // BK):
        raise ValueError(f"{who}: aq {tuple(aq.shape)}, a_s {tuple(a_s.shape)} and out "
                         f"{tuple(out.shape)} must be [{R}, {K}], [{R}, {K // BK}], [{R}, {N}]")
    if out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"{who}: out must be contiguous bfloat16")
    check_plan(plan, aq.device, who, ("tile_expert", "num_rows_used", "seg_start"))
    lib = fp8_gemm_library()
    num_sms, stream, _ = launch_context(aq.device, ticket=False)
    rc = lib.megamoe_fp8_gemm_rows(
        aq.data_ptr(), a_s.data_ptr(), a_s.stride(0), bq.data_ptr(), b_s.data_ptr(),
        b_s.stride(0), b_s.stride(1), out.data_ptr(), plan.tile_expert.data_ptr(),
        plan.num_rows_used.data_ptr(),
        plan.seg_start.data_ptr() if expert_base is not None else None, expert_base or 0, E, N,
        K, plan.block_m, group_m, R, num_sms, stream)
    raise_on_error(lib, rc, who)


def fp8_gemm1_swiglu_sm90(xq, xs, w1q, w1s, w3q, w3s, plan: Plan, hq, hs, a=None,
                          group_m: int = 8) -> None:
    """Writes the used rows of hq [R_max, H] e4m3, hs [R_max, H/128] and (unless None) a
    [R_max, 2H] bf16: GEMM 1 + SwiGLU on the token rows of xq [T, D] (scales xs [T, D/128])."""
    who = "fp8_gemm1_swiglu_sm90"
    E, H, D = w1q.shape
    R = plan.max_rows
    _check_common(who, plan, H, D, {"w1q": w1q, "w3q": w3q, "hq": hq},
                  {"xs": xs, "w1s": w1s, "w3s": w3s, "hs": hs})
    if w3q.shape != w1q.shape or w1s.stride() != w3s.stride() or w1s.shape != w3s.shape:
        raise ValueError(f"{who}: w1 and w3 (and their scales) must have one shape and layout")
    _check_token_rows(who, "xq", xq, "xs", xs, D)
    if hq.shape != (R, H) or not hs.is_contiguous() or hs.shape != (R, H // BN):
        raise ValueError(f"{who}: hq / hs must be [{R}, {H}] / [{R}, {H // BN}] contiguous")
    if a is not None and (a.shape != (R, 2 * H) or a.dtype != torch.bfloat16
                          or not a.is_contiguous()):
        raise ValueError(f"{who}: a must be contiguous bfloat16 [{R}, {2 * H}]")
    check_plan(plan, xq.device, who, ("row_slot", "tile_expert", "num_rows_used"))
    lib = fp8_gemm_library()
    num_sms, stream, _ = launch_context(xq.device, ticket=False)
    rc = lib.megamoe_fp8_gemm1_swiglu(
        xq.data_ptr(), xq.stride(0), xs.data_ptr(), xs.stride(0), w1q.data_ptr(), w1s.data_ptr(),
        w3q.data_ptr(), w3s.data_ptr(), w1s.stride(0), w1s.stride(1), hq.data_ptr(),
        hs.data_ptr(), a.data_ptr() if a is not None else None, plan.row_slot.data_ptr(),
        plan.tile_expert.data_ptr(), plan.num_rows_used.data_ptr(), E, H, D, plan.top_k,
        plan.block_m, group_m, num_sms, stream)
    raise_on_error(lib, rc, who)


def fp8_dgrad2_swiglu_sm90(gq, gs, w2tq, w2ts, a_saved, tw, plan: Plan, daq, das, daTq, daTs, hTq,
                     hTs, part, group_m: int = 8) -> None:
    """Writes the used rows of daq [R_max, 2H] e4m3 / das [R_max, 2H/128], the used columns of
    daTq [2H, R_max] / daTs [2H, R_max/128] and hTq [H, R_max] / hTs [H, R_max/128], and part
    [H/128, R_max] (fp32): kernel A on the token rows of gq [T, D] (dy, scales gs [T, D/128])
    against w2tq [E, H, D] (w2^T), with a_saved [R_max, 2H] bf16 and tw [T * top_k] fp32."""
    who = "fp8_dgrad2_swiglu_sm90"
    E, H, D = w2tq.shape
    R = plan.max_rows
    _check_common(who, plan, H, D, {"w2tq": w2tq, "daq": daq, "daTq": daTq, "hTq": hTq},
                  {"gs": gs, "w2ts": w2ts, "das": das, "daTs": daTs, "hTs": hTs, "part": part})
    _check_token_rows(who, "gq", gq, "gs", gs, D)
    shapes = {"daq": (daq, (R, 2 * H)), "das": (das, (R, 2 * H // BN)),
              "daTq": (daTq, (2 * H, R)), "daTs": (daTs, (2 * H, R // BM)),
              "hTq": (hTq, (H, R)), "hTs": (hTs, (H, R // BM)), "part": (part, (H // BN, R))}
    for name, (t, shape) in shapes.items():
        if tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{who}: {name} must be contiguous {list(shape)}, got "
                             f"{list(t.shape)}")
    if a_saved.shape != (R, 2 * H) or a_saved.dtype != torch.bfloat16 or not a_saved.is_contiguous():
        raise ValueError(f"{who}: a_saved must be contiguous bfloat16 [{R}, {2 * H}]")
    if tw.dtype != torch.float32 or not tw.is_contiguous() or tw.numel() != gq.shape[0] * plan.top_k:
        raise ValueError(f"{who}: tw must be contiguous float32 [T * top_k]")
    if R % 16:
        raise ValueError(f"{who}: the plan's max_rows ({R}) must be a multiple of 16 (the "
                         "transposed outputs' rows are written by TMA)")
    check_plan(plan, gq.device, who, ("row_slot", "tile_expert", "num_rows_used"))
    lib = fp8_gemm_library()
    num_sms, stream, _ = launch_context(gq.device, ticket=False)
    rc = lib.megamoe_fp8_dswiglu(
        gq.data_ptr(), gq.stride(0), gs.data_ptr(), gs.stride(0), w2tq.data_ptr(),
        w2ts.data_ptr(), w2ts.stride(0), w2ts.stride(1), a_saved.data_ptr(), tw.data_ptr(),
        daq.data_ptr(), das.data_ptr(), daTq.data_ptr(), daTs.data_ptr(), hTq.data_ptr(),
        hTs.data_ptr(), part.data_ptr(), plan.row_slot.data_ptr(), plan.tile_expert.data_ptr(),
        plan.num_rows_used.data_ptr(), E, H, D, plan.top_k, plan.block_m, group_m, R, num_sms,
        stream)
    raise_on_error(lib, rc, who)


def wgrad_supported(M: int, N: int, out_dtype: torch.dtype) -> bool:
    return M % BM == 0 and N % BN == 0 and out_dtype == torch.bfloat16


def fp8_wgrad_sm90(at, ats, bt, bts, plan: Plan, out: torch.Tensor, order: torch.Tensor,
                   group_m: int = 8) -> None:
    """Writes out [E, M, N] bf16 whole: per expert e, at[:, seg(e)] @ bt[:, seg(e)]^T with at
    [M, R_max], bt [N, R_max] e4m3 scaled per column and 128 rows (ats [M, R_max/128], bts [N,
    R_max/128]); order: the experts' order (longest first), int32 on the device."""
    who = "fp8_wgrad_sm90"
    E, M, N = out.shape
    R = plan.max_rows
    if not wgrad_supported(M, N, out.dtype) or not out.is_contiguous():
        raise ValueError(f"{who} needs M % {BM} == 0, N % {BN} == 0 and a contiguous bfloat16 "
                         f"out; got M={M}, N={N}, {out.dtype}")
    for name, t, rows in (("at", at, M), ("bt", bt, N)):
        if (t.dtype != FP8 or t.shape != (rows, R) or t.stride(1) != 1 or t.stride(0) % 16
                or t.data_ptr() % 16):
            raise ValueError(f"{who}: {name} must be e4m3 [{rows}, {R}] with unit-stride, "
                             f"16-byte aligned rows")
    for name, t, rows in (("ats", ats, M), ("bts", bts, N)):
        if t.dtype != torch.float32 or t.shape != (rows, R // BM) or t.stride(1) != 1:
            raise ValueError(f"{who}: {name} must be fp32 [{rows}, {R // BM}], unit-stride rows")
    if order.dtype != torch.int32 or order.numel() != E or not order.is_contiguous():
        raise ValueError(f"{who}: order must be {E} contiguous int32 expert ids")
    check_plan(plan, at.device, who, ("seg_start", "count"))
    lib = fp8_gemm_library()
    num_sms, stream, ticket = launch_context(at.device)
    rc = lib.megamoe_fp8_wgrad(
        at.data_ptr(), ats.data_ptr(), ats.stride(0), bt.data_ptr(), bts.data_ptr(),
        bts.stride(0), out.data_ptr(), plan.seg_start.data_ptr(), plan.count.data_ptr(),
        order.data_ptr(), E, M, N, R, group_m, num_sms, ticket.data_ptr(), stream)
    raise_on_error(lib, rc, who)
