"""BF16 backward of backend ``hopper``: four kernels over the forward's row layout.

    plan      unpacked from what the forward saved (plan.unpack_plan: views, no work); rebuilt
              with build_plan only when nothing was saved (saved=None)
    GEMM 1    only when nothing was saved: the forward's gemm1_swiglu (same kernel and tuned
              pick) with its a = [a1 | a3] store, h dropped
    kernel A  bwd_dgrad_l2_swiglu: dh = dy@w2 (one dgrad GEMM, K-dim = D) with a1, a3 loaded
              from a; SwiGLU backward with the routing weight ->
              da = [da1 | da3], hw = w*h, and per-H-tile partials of d(topk_weights) = <dh, h>
              (no second GEMM for <dy, y>); on sm90 GPUs usually the one-launch Hopper kernel
              (ops/hopper/cuda/dgrad2_swiglu.py), which also stores the dy rows it gathers for dw2
    kernel B  bwd_wgrad x3 (or _grouped_mm, see below): dw2[e] = sum_r dy_r^T hw_r,
              dw1[e] = sum_r da1_r^T x_r, dw3[e] = sum_r da3_r^T x_r (fp32 accumulate, fixed
              row order, param dtype/layout)
    kernel C  bwd_dgrad_l1 (or _grouped_mm): dx_slot[slot] = da1_r @ w1[e] + da3_r @ w3[e]
    combine   bwd_combine: dx[t] = sum_k dx_slot[t*K+k], dtopk_weights from the partials
x and dy rows are read by indirection (row -> token); nothing is permuted. Weight tiles (A, C)
and row-space tiles (A's a/da/hw, B) come by TMA when the tiles divide D and H. Every reduction
has a fixed order and no atomics, so two runs on the same inputs are bitwise identical.
Per-stage GPU timings: python -m torchtitan_megamoe.bench.backward_stages; offline register/spill
check without a GPU: python -m tools.compile_check.

Saved vs recomputed. At EP=1 the forward (forward_ep1(..., save=True), what the op runs) saves,
besides the op's inputs that autograd keeps anyway:
    a       [R_max, 2H] bf16   GEMM 1's pre-activations [a1 | a3] in the plan's row space
                               (stored by GEMM 1's epilogue next to h; rows past the used rows
                               are left unwritten and never read)
    plan    [R_max + T*K + R_max/block_m + 2E + 1] int32: plan.pack_plan's flat vector
so the backward does neither GEMM 1 again (4*T*K*D*H flops: two thirds of the forward) nor
the plan. Per layer at T = 16384, K = 8, E = 128, block_m = 128 (R_max = 147,328):
    30B  (D=2048, H=768):  a 432 MiB + plan 1.1 MiB = 0.42 GiB
    235B (D=4096, H=1536): a 864 MiB + plan 1.1 MiB = 0.84 GiB
Stock TorchTitan keeps its routed activations per layer instead (at least the permuted input
and a1, a3, h: T*K*(D + 3H) bf16): 1.06 GiB at 30B, 2.13 GiB at 235B, so the saved path keeps
40% of stock's. a is saved in bf16 (as stock autograd saves a1/a3). The recompute path
(saved=None) runs GEMM 1 again, storing a only, and then the same kernels: its gradients equal
the saved path's bit for bit, at the cost of one GEMM 1 (+1.7 ms at the 30B shape, H200) and a
transient a during kernel A. The op returns the saved tensors as extra outputs (api.py): with
selective AC and the op in the save list they live from the forward to the backward (no
recompute of the op); with full AC the layer's forward is recomputed in the backward and they
live only during that layer's backward. The op saves them even under no_grad (the forward
cannot tell); there they are freed as the forward returns. saved=None (save_activations
"never", which "auto" implies under per-op selective AC; the EP path where
ep_forward.keeps_saved says no; direct callers) recomputes GEMM 1 and the plan.

cuBLAS candidates (bwd_cublas.py). The weight-gradient stages (dw2; dw1 + dw3) and kernel C
each also have a torch._grouped_mm candidate: K-grouped GEMMs over the padded segments on
gathered token rows (x_rows / dy_rows, zero padding rows), and two M-grouped GEMMs + a
rows -> slots gather for dx_slot. tune.pick_config times both sides per stage on the first call
per shape (each side's timed launch includes its gathers and copies) and keeps the faster
(kernel C's _grouped_mm side only runs forced: it never won); MEGAMOE_BWD_IMPL=triton|cublas
forces one side (auto, the default, lets the tuner pick; untuned runs - interpreter, graph
capture, MEGAMOE_TUNE=0 - use Triton).

Transient memory inside one backward call (R_max = T*K + E*(block_m-1) rounded up to block_m,
block_m = 128), freed when the call returns (the saved a above stays alive through the call, as
any saved activation does until its node's backward ends):
    da       [R_max, 2H] bf16        live from kernel A to kernel C
    hw       [R_max, H]  bf16        live from kernel A to the dw2 launch (freed before C)
    part     [H/block_n, R_max] fp32 live from kernel A to the combine (block_n = 64)
    dx_slot  [T*K, D]    bf16        live from kernel C to the combine
    a        [R_max, 2H] bf16        recompute path only: from GEMM 1 to the end of kernel A
                                     (GEMM 1's h, [R_max, H], only during GEMM 1)
    Triton side: peak = da + max(hw, dx_slot) + part.
    cuBLAS side adds, per stage (each freed when its stage returns):
      dw2:    dy_rows [R_max, D] bf16          -> da + hw + part + dy_rows
              (kernel A's cuBLAS / sm90 sides, the one-launch sm90 kernel included, gather
              or store dy_rows already: it lives from kernel A to the dw2 launch)
      dw1/3:  x_rows  [R_max, D] bf16 (shared) -> da + part + x_rows
      C:      dx_rows [R_max, D] bf16 + the second GEMM's [R_max, D] output, then dx_slot
              -> da + part + 2 [R_max, D]
    Plus the gradients themselves (dx, dw1, dw2, dw3, dtopk_weights: what any backward returns).
    The first call per shape under auto runs every candidate, so its peak is the larger side's.
At T = 16384 tokens, K = 8, E = 128 (R_max = 147,328; one [R_max, D] bf16 buffer is 576 MiB at
D = 2048, 1.12 GiB at D = 4096):
    30B  (D=2048, H=768):  da 432 MiB, hw 216 MiB, part 6.7 MiB, dx_slot 512 MiB
        Triton peak 0.93 GiB; cuBLAS stages dw2 1.20 / dw1,3 0.99 / C 1.55 GiB
    235B (D=4096, H=1536): da 864 MiB, hw 432 MiB, part 13.5 MiB, dx_slot 1 GiB
        Triton peak 1.86 GiB; cuBLAS stages dw2 2.40 / dw1,3 1.98 / C 3.10 GiB

EP > 1 (ep_backward.py): x and dy are exchanged again to the experts' owners, the EP=1 backward
(backward_local) runs on the received tokens, with the forward's saved tensors (receive
layout) when ep_forward.keeps_saved kept them, and dx / d(topk_weights) return to their
sources. x arrives under kernel A and dw2, which do not read it (backward_local's wait_x
hook); the dx return runs after the combine, not overlapped.

Not implemented here: FP8 backward (precision "fp8" / "fp8_bwd": use backend="reference"),
and overlap of kernel C with the weight-gradient launches on a second stream.
"""

import torch
import torch.distributed as dist

from torchtitan_megamoe.ops.hopper.cuda import dgrad2_swiglu as sm90_dgrad
from torchtitan_megamoe.ops.hopper.cuda import gemm_rows as sm90_rows
from torchtitan_megamoe.ops.hopper.cuda import wgrad as sm90_wgrad
from torchtitan_megamoe.ops.hopper.cuda.sm90 import sm90_usable
from torchtitan_megamoe.ops.hopper.kernels.bwd_combine import bwd_combine
from torchtitan_megamoe.ops.hopper.kernels.mma import interpreting
from torchtitan_megamoe.ops.hopper.kernels.grouped_mm import (
    bwd_impl, dgrad1_grouped_mm, dgrad2_swiglu_grouped_mm, gather_rows, is_cublas, stage_candidates,
    wgrad_dw13_grouped_mm, wgrad_dw2_grouped_mm,
)
from torchtitan_megamoe.ops.hopper.kernels.dgrad1 import dgrad1
from torchtitan_megamoe.ops.hopper.kernels.dgrad2_swiglu import dgrad2_swiglu
from torchtitan_megamoe.ops.hopper.ep_backward import backward_ep
from torchtitan_megamoe.ops.hopper.kernels.wgrad import longest_first, wgrad
from torchtitan_megamoe.ops.hopper.bf16_forward import interpret_defaults
from torchtitan_megamoe.ops.hopper.kernels.gemm1_swiglu import gemm1_swiglu
from torchtitan_megamoe.ops.hopper.plan import build_plan, unpack_plan
from torchtitan_megamoe.ops.hopper.tune import bucket, pick_config

BLOCK_M = 128
"""Plan tile height on the GPU (row tile of kernels A and C)."""

# Hopper candidates, timed once per shape by tune.pick_config (the first one is used as is under
# the interpreter, during graph capture or with MEGAMOE_TUNE=0). Each Triton config is
# offered because it was the fastest Triton config of its stage at a Qwen3 shape in at least one
# H200 bench run of 2026-11-30/12-01 (the tuner tables of the bench JSONs in docs/perf at
# 5e0bafa; what runs with MEGAMOE_BWD_IMPL=triton, and where neither the CUDA kernels nor
# _grouped_mm can).
# TMA applies only when the tiles divide D and H; otherwise the same config runs with pointer
# loads, and the *_UNEVEN pointer-load config (smaller K step) is offered too, only there.
# Kernel A is one plain dgrad GEMM (dy rows @ w2[e], K-dim = D) plus an epilogue that loads the
# a1/a3 tiles by TMA: one fp32 accumulator. 128x128 with 4 stages won every run, 40-60% ahead
# of 128x64 (which spills nothing in offline sm_90a compiles, where 128x128 spills 248 bytes of
# the epilogue's elementwise tiles: tools/compile_check.py); the pointer-load config 236 bytes.
A_CANDIDATES = [
    dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, use_tma=True),
]
A_UNEVEN = dict(block_m=128, block_n=64, block_k=32, num_warps=8, num_stages=4, use_tma=False)
# Kernel B (dw2, dw1|dw3): 128x128 is the usual pick, 128x256 takes dw2 at 235B. Their TMA loads
# do not depend on D and H, so no pointer-load config is needed (it never won).
B_CANDIDATES = [
    dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, use_tma=True),
    dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, use_tma=True),
]
# Kernel C: 128x256 is the usual pick, 128x128 wins some runs at both shapes.
C_CANDIDATES = [
    dict(block_n=128, block_k=64, num_warps=8, num_stages=3, use_tma=True),
    dict(block_n=256, block_k=64, num_warps=8, num_stages=3, use_tma=True),
]
C_UNEVEN = dict(block_n=128, block_k=32, num_warps=8, num_stages=4, use_tma=False)


def with_uneven(a_cands: list, c_cands: list, D: int, H: int) -> tuple[list, list]:
    """The candidate lists of kernels A and C, plus their pointer-load config where none of
    their TMA configs' tiles divide the shape."""
    if not any(D % c["block_k"] == 0 and H % c["block_n"] == 0 for c in a_cands):
        a_cands = a_cands + [A_UNEVEN]
    if not any(H % c["block_k"] == 0 and D % c["block_n"] == 0 for c in c_cands):
        c_cands = c_cands + [C_UNEVEN]
    return a_cands, c_cands


# Kernel C as csrc/grouped_gemm_sm90.cu's N-major ROWS mode ([da1 | da3] against w1 and w3 as
# stored, TMA for both, bulk-store epilogue): it writes dx in the plan's row space [R_max, D]
# (whole tiles; the combine then reads slot s's row through slot_row) instead of scattering
# rows into slots. Offered under MEGAMOE_BWD_IMPL=auto where it builds and the shape fits. Kernel
# C's _grouped_mm side is not offered under auto: it never won (40-70% behind Triton's).
C_SM90 = dict(impl="sm90")


def c_sm90_fits(da: torch.Tensor, w1: torch.Tensor) -> bool:
    E, H, D = w1.shape
    return (bwd_impl() == "auto" and da.dtype == w1.dtype == torch.bfloat16
            and sm90_rows.shape_supported(D, 2 * H, BLOCK_M) and H % sm90_rows.BK == 0
            and sm90_usable(da))


# Kernel A's saved path with its dh GEMM as the sm90 N-major ROWS mode (w2 [E, D, H] as stored)
# on the gathered dy rows, then the SwiGLU backward rows kernel: the cuBLAS side's structure.
A_SM90 = dict(impl="sm90")


def a_sm90_fits(x: torch.Tensor, w2: torch.Tensor) -> bool:
    E, D, H = w2.shape
    return (bwd_impl() == "auto" and x.dtype == w2.dtype == torch.bfloat16
            and sm90_rows.shape_supported(H, D, BLOCK_M) and sm90_usable(x))


# Kernel A's saved path in one sm90 launch (DGRAD_SWIGLU mode: dy rows gathered inside, the
# SwiGLU backward in the epilogue; ops/hopper/cuda/dgrad2_swiglu.py). It also stores the dy rows it
# gathers, so like the two-step sides it leaves dw2 its gathered dy rows and the tuner compares
# like with like. Offered where A_SM90 is (the usual pick; A_SM90 wins some 235B runs).
A_SM90_FUSED = dict(impl="sm90_fused", block_n=256)


def a_sm90_fused_offered(x: torch.Tensor, w2: torch.Tensor) -> bool:
    # the same tiles as the dh GEMM of A_SM90 (a_sm90_fits checks them)
    return a_sm90_fits(x, w2)


# Weight gradients as csrc/grouped_gemm_sm90.cu's WGRAD mode (longest expert first) on the
# token-indexed operand gathered into the row space first (as the _grouped_mm side does; dw2
# reuses kernel A's dy rows), both operands read by TMA. Candidates of dw2 and of dw1|dw3 under
# MEGAMOE_BWD_IMPL=auto where the kernel builds, the shapes fit and the parameters are
# contiguous bf16 (the gradients are written in their layout). The kernel's in-kernel gather
# (no gathered copy) is not offered: 7-26% behind _grouped_mm, it never won.
B_SM90_PRE_GATHERED = dict(impl="sm90", pre_gathered=True)


def b_sm90_fits(x: torch.Tensor, params: tuple) -> bool:
    _, H, D = params[0].shape
    return (bwd_impl() == "auto" and x.dtype == torch.bfloat16
            and all(p.dtype == torch.bfloat16 and p.is_contiguous() for p in params)
            and sm90_wgrad.shapes_supported(D, H, BLOCK_M) and sm90_usable(x))


# The CPU interpreter runs numpy per program: small tiles keep CI quick and still cover several
# tiles per expert and partial tiles; shapes the tiles divide take the TMA path.
INTERPRET_BLOCK_M = 16
INTERPRET_A = dict(block_m=16, block_n=16, block_k=32, num_warps=1, num_stages=1, use_tma=True)
INTERPRET_B = dict(block_m=32, block_n=32, block_k=16, num_warps=1, num_stages=1, use_tma=True)
INTERPRET_C = dict(block_n=32, block_k=16, num_warps=1, num_stages=1, use_tma=True)


def check_backward_inputs(grad_out, x, w1, precision) -> None:
    """Raise, naming the fix, for what these kernels do not compute."""
    if precision != "bf16":
        raise ValueError(
            f"the bf16 backward got precision={precision!r}; the FP8 precisions run "
            "fp8_backward.backward_fp8 (ops/hopper/__init__.py dispatches)"
        )
    check_backward_dtypes(grad_out, x, w1)


def check_backward_dtypes(grad_out, x, w1) -> None:
    for name, t in (("grad_out", grad_out), ("x", x), ("w1", w1)):
        if t.dtype != torch.bfloat16:
            raise TypeError(
                f"mega_moe backend='hopper' backward needs bfloat16 tensors, {name} is "
                f"{t.dtype}; cast to torch.bfloat16 or use backend='reference'"
            )
    if grad_out.shape != x.shape:
        raise ValueError(
            f"grad_out shape {tuple(grad_out.shape)} must equal x shape {tuple(x.shape)}"
        )
    if not interpreting() and not x.is_cuda:
        raise ValueError(
            "mega_moe backend='hopper' needs CUDA tensors; use backend='reference' on CPU"
        )


def backward(grad_out, x, topk_ids, topk_weights, w1, w2, w3, group, options, saved=None):
    precision = options.precision
    """(dx, dtopk_weights, dw1, dw2, dw3) of mega_moe for grad_out, BF16; with an EP group of
    more than one rank, rows are exchanged around the EP=1 kernels (ep_backward.py). ``saved``: what
    the forward saved (forward.forward_ep1(..., save=True)); None or empty recomputes."""
    check_backward_inputs(grad_out, x, w1, precision)
    if group is not None and dist.get_world_size(group) > 1:
        return backward_ep(grad_out, x, topk_ids, topk_weights, w1, w2, w3, group, backward_local,
                           saved=saved)
    return backward_local(grad_out, x, topk_ids, topk_weights, w1, w2, w3, saved=saved)


def backward_local(grad_out, x, topk_ids, topk_weights, w1, w2, w3, saved=None, wait_x=None):
    """EP=1 backward: every expert of topk_ids is in w1/w2/w3. ``saved`` = (a, packed_plan)
    from forward_ep1(..., save=True) on the same inputs: kernel A loads a1/a3 instead of
    recomputing GEMM 1 and the plan is unpacked instead of rebuilt. None (or an empty
    sequence) recomputes both.

    Stage order: A, dw2, dw1/dw3, C, combine. ``wait_x()`` (the EP backward's hook, ep_backward.py)
    is called right before the first kernel that reads x (dw1/dw3, or the recompute's GEMM 1),
    so x can still be in flight under kernel A and dw2."""
    if interpreting():
        block_m, a_cands, b_cands, c_cands = (
            INTERPRET_BLOCK_M, [INTERPRET_A], [INTERPRET_B], [INTERPRET_C]
        )
    else:
        block_m, a_cands, b_cands, c_cands = BLOCK_M, A_CANDIDATES, B_CANDIDATES, C_CANDIDATES
        a_cands, c_cands = with_uneven(a_cands, c_cands, x.shape[1], w1.shape[1])
    T, D = x.shape
    if T == 0:  # e.g. an EP rank that receives no rows
        return (torch.empty_like(x), torch.empty_like(topk_weights),
                *(torch.zeros_like(w) for w in (w1, w2, w3)))
    # Gradients take the parameters' own layout; the kernels read contiguous copies.
    params = (w1, w2, w3)
    dy = grad_out.contiguous()
    x = x.contiguous()
    w1, w2, w3 = w1.contiguous(), w2.contiguous(), w3.contiguous()
    E, H, _ = w1.shape
    if saved:
        a_saved, packed = saved
        plan = unpack_plan(packed, T, topk_ids.shape[1], E, block_m)
    else:
        plan = build_plan(topk_ids, E, block_m)
        if wait_x is not None:
            wait_x()  # GEMM 1 reads x
            wait_x = None
        # GEMM 1 again with the forward's kernel and tuned pick (the same key), so a is bitwise
        # the forward's and the gradients equal the saved path's bit for bit; h is not needed.
        g1_config = interpret_defaults(block_m, None, None)[1]
        _h, a_saved = gemm1_swiglu(x, w1, w3, plan, config=g1_config, save_a=True)
        del _h
    R = plan.max_rows
    # Bucketed: under EP, R changes every step. The forced side is part of the key, so a
    # forced run never reuses what auto picked (or the reverse).
    key = (bucket(R), D, H, E, block_m, bwd_impl())

    # Kernel A. Buffers are allocated once so that tuning candidates write the same outputs.
    # The cuBLAS side (saved a only) gathers dy rows, which dw2's cuBLAS side then reuses.
    a_bufs, shared = {}, {}

    def launch_a(cfg):
        rows_side = is_cublas(cfg) or cfg.get("impl") == "sm90"  # dh GEMM, then the rows kernel
        n_h = 1 if rows_side else -(-H // cfg["block_n"])
        if a_bufs.get("n_h") != n_h:
            a_bufs.update(n_h=n_h, out=(
                torch.empty(R, 2 * H, dtype=x.dtype, device=x.device),
                torch.empty(R, H, dtype=x.dtype, device=x.device),
                torch.empty(n_h, R, dtype=torch.float32, device=x.device),
            ))
        if cfg.get("impl") == "sm90_fused":
            if shared.get("dy_rows") is None:
                shared["dy_rows"] = torch.empty(R, D, dtype=x.dtype, device=x.device)
            return sm90_dgrad.dgrad2_swiglu_sm90(dy, a_saved, topk_weights, w2, plan,
                                                   out=a_bufs["out"], dy_rows=shared["dy_rows"])
        if rows_side:
            *res, shared["dy_rows"] = dgrad2_swiglu_grouped_mm(
                dy, a_saved, topk_weights, w2, plan, out=a_bufs["out"],
                dy_rows=shared.get("dy_rows"), sm90=not is_cublas(cfg))
            return tuple(res)
        return dgrad2_swiglu(dy, a_saved, topk_weights, w2, plan, out=a_bufs["out"], **cfg)

    # Each stage's candidate list is a function, built only until the tuner has picked (host
    # time: the backward's stages run back to back, nothing hides their issue cost).
    def a_stage():
        stage = stage_candidates(a_cands, D, H, E)
        if block_m == BLOCK_M and a_sm90_fits(x, w2):
            stage = stage + [A_SM90]
        if block_m == BLOCK_M and a_sm90_fused_offered(x, w2):
            stage = stage + [A_SM90_FUSED]
        return stage

    # checked on the used rows (the sides' buffers past them differ) and on d(topk_weights)'s
    # per-row sum of partials (the sides keep different numbers of partials)
    def a_outputs(res):
        used = int(plan.num_rows_used)
        return res[0][:used], res[1][:used], res[2].sum(0)[:used]

    a_cfg = pick_config("bwd_dgrad_l2_swiglu", key, a_stage, launch_a, outputs=a_outputs)
    da, hw, part = launch_a(a_cfg)
    if not (is_cublas(a_cfg) or a_cfg.get("impl") in ("sm90", "sm90_fused")):
        shared.clear()  # no dy rows for dw2 to reuse
    del a_bufs, a_saved

    # Weight gradients (kernel B or _grouped_mm): dw2 first so hw is freed before kernel C
    # allocates dx_slot. (Running dw1/dw3 after the combine, so that under EP the dx rows could
    # travel under them, kept dx alive through dw1/dw3: +256 MiB peak at the 235B shape, EP=2,
    # docs/PERF.md, Tried and rejected; not done.)
    order = longest_first(plan)

    def launch_dw2(cfg):
        if cfg.get("impl") == "sm90":  # on kernel A's gathered dy rows, or gathered here
            rows = shared.get("dy_rows")
            return sm90_wgrad.wgrad_dw2_sm90(
                gather_rows(dy, plan) if rows is None else rows, hw, plan,
                torch.empty_like(params[1]), order, pre_gathered=True)
        if is_cublas(cfg):
            return wgrad_dw2_grouped_mm(dy, hw, plan, params[1], dy_rows=shared.get("dy_rows"))
        return wgrad(dy, hw, torch.empty_like(params[1]), plan, a_gather=True, b_gather=False,
                     expert_order=order, **cfg)

    def launch_dw13(cfg):
        if cfg.get("impl") == "sm90":  # on the gathered x rows
            return sm90_wgrad.wgrad_dw13_sm90(da, gather_rows(x, plan), plan,
                                              torch.empty_like(params[0]),
                                              torch.empty_like(params[2]), order,
                                              pre_gathered=True)
        if is_cublas(cfg):
            return wgrad_dw13_grouped_mm(da, x, plan, params[0], params[2])
        return tuple(wgrad(a, x, torch.empty_like(p), plan, a_gather=False, b_gather=True,
                           expert_order=order, **cfg)
                     for a, p in ((da[:, :H], params[0]), (da[:, H:], params[2])))

    def b_stage():
        stage = stage_candidates(b_cands, D, H, E)
        if block_m == BLOCK_M and b_sm90_fits(x, params):
            stage = stage + [B_SM90_PRE_GATHERED]
        return stage

    dw2 = launch_dw2(pick_config("bwd_wgrad_dw2", key, b_stage, launch_dw2,
                                 outputs=lambda r: (r,)))
    del hw
    shared.clear()
    if wait_x is not None:
        wait_x()
    dw1, dw3 = launch_dw13(pick_config("bwd_wgrad_dw13", key, b_stage, launch_dw13,
                                       outputs=lambda r: r))

    # Kernel C (or _grouped_mm, or the sm90 kernel), then the combine. Each side allocates its
    # dx rows itself (the cuBLAS side only after its second GEMM's output is freed): [T*K, D]
    # by slot, or [R_max, D] in the row space (sm90; the second value says which).
    def launch_c(cfg):
        if is_cublas(cfg):
            return dgrad1_grouped_mm(da, w1, w3, plan), False
        if cfg.get("impl") == "sm90":
            dx_rows = torch.empty(R, D, dtype=x.dtype, device=x.device)
            sm90_rows.gemm_rows_nmajor_sm90(da, (w1, w3), plan, dx_rows)
            return dx_rows, True
        return dgrad1(da, w1, w3, plan, out_dtype=x.dtype, **cfg), False

    def c_stage():
        stage = stage_candidates(c_cands, D, H, E, auto_cublas=False)
        if block_m == BLOCK_M and c_sm90_fits(da, w1):
            stage = stage + [C_SM90]
        return stage

    # checked on a sample of the live slots' rows, wherever each side keeps them
    def c_outputs(res):
        live = torch.nonzero(plan.slot_row >= 0).squeeze(1)[::61]
        return (res[0][plan.slot_row[live].long()] if res[1] else res[0][live],)

    dx_slot, in_rows = launch_c(pick_config("bwd_dgrad_l1", key, c_stage, launch_c,
                                            outputs=c_outputs))
    del da
    dx, dtw = bwd_combine(dx_slot, part, plan, dx_dtype=x.dtype, dtw_dtype=topk_weights.dtype,
                          rows=in_rows)
    return dx, dtw, dw1, dw2, dw3
