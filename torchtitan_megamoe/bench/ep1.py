"""EP=1: stock vs ours on one GPU, with the forward's and the backward's per-stage times."""

from __future__ import annotations

import traceback

import torch

from torchtitan_megamoe.bench.profile import profile_kernels, timeline
from torchtitan_megamoe.bench.shapes import SHAPES, build_stock_moe
from torchtitan_megamoe.timing import back_to_back_ms, host_issue_ms, median_ms, peak_extra_mib
from torchtitan_megamoe.router import route


def _stage_times(x, ids, w, w1, w2, w3, iters, warmup):
    from torchtitan_megamoe.ops.hopper.kernels.combine import combine
    from torchtitan_megamoe.ops.hopper.local_forward import BLOCK_M
    from torchtitan_megamoe.ops.hopper.kernels.gemm1_swiglu import gemm1_swiglu
    from torchtitan_megamoe.ops.hopper.kernels.gemm2_rows import gemm2_rows
    from torchtitan_megamoe.ops.hopper.plan import build_plan

    plan = build_plan(ids, w1.shape[0], BLOCK_M)
    h = gemm1_swiglu(x, w1, w3, plan)
    y = gemm2_rows(h, w2, plan)
    return {
        "plan": median_ms(lambda: build_plan(ids, w1.shape[0], BLOCK_M), iters, warmup),
        "gemm1_swiglu": median_ms(lambda: gemm1_swiglu(x, w1, w3, plan), iters, warmup),
        "gemm2_rows": median_ms(lambda: gemm2_rows(h, w2, plan), iters, warmup),
        "combine": median_ms(lambda: combine(y, w, plan.slot_row, x.dtype), iters, warmup),
        "rows_used": int(plan.num_rows_used),
        "max_rows": plan.max_rows,
        "workspace_bytes": plan.max_rows * w1.shape[1] * x.element_size()
        + y.numel() * y.element_size(),
    }


def bwd_stage_breakdown(key: str, tokens: int, iters: int) -> dict:
    """The triton backward's per-stage times (bench/backward_stages.py) at one shape.

    Without CUDA it runs under Triton's interpreter with the backward's interpreter tiles (a
    smoke test of this wiring; use a tiny shape there).
    """
    from torchtitan_megamoe.bench import backward_stages as bwd_bench

    shape = SHAPES[key]
    dims = (shape["dim"], shape["hidden"], shape["experts"], shape["top_k"])
    if torch.cuda.is_available():
        return bwd_bench.bench_shape(key, tokens, iters, shape=dims)
    from torchtitan_megamoe.ops.hopper.backward_pass import (
        INTERPRET_A, INTERPRET_B, INTERPRET_BLOCK_M, INTERPRET_C,
    )

    return bwd_bench.bench_shape(key, tokens, iters, shape=dims, device="cpu",
                                 block_m=INTERPRET_BLOCK_M,
                                 candidates=([INTERPRET_A], [INTERPRET_B], [INTERPRET_C]))


def bench_shape(key: str, tokens: int, iters: int, warmup: int, backward: bool, backend: str,
                peak_tflops: float, profile: bool = False) -> dict:
    from torchtitan_megamoe import mega_moe

    shape = SHAPES[key]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    moe = build_stock_moe(shape, dev)
    T, D, H, K = tokens, shape["dim"], shape["hidden"], shape["top_k"]
    x = torch.randn(1, T, D, device=dev, dtype=torch.bfloat16)
    x2 = x.view(T, D)
    ex = moe.experts

    def ours_layer(inp):
        scores, ids, _ = route(moe.router, inp.view(T, D), moe.expert_bias)
        out = mega_moe(inp.view(T, D), ids, scores, ex.w1, ex.w2, ex.w3, backend=backend)
        return out.view(1, T, D)

    with torch.no_grad():
        scores, ids, _ = moe.router(x2, moe.expert_bias)
        ref = moe(x).float()
        got = ours_layer(x).float()
        rel = float((got - ref).norm() / ref.norm())
        res = {
            "shape": shape["name"], "tokens": T, "dim": D, "hidden": H,
            "experts": shape["experts"], "top_k": K, "backend": backend,
            "rel_err_vs_stock": rel,
            "stock_fwd_ms": median_ms(lambda: moe(x), iters, warmup),
            "ours_fwd_ms": median_ms(lambda: ours_layer(x), iters, warmup),
            "ours_op_fwd_ms": median_ms(
                lambda: mega_moe(x2, ids, scores, ex.w1, ex.w2, ex.w3, backend=backend),
                iters, warmup,
            ),
            "router_ms": median_ms(lambda: moe.router(x2, moe.expert_bias), iters, warmup),
            "ours_router_ms": median_ms(lambda: route(moe.router, x2, moe.expert_bias), iters,
                                        warmup),
            # host time to issue one waited forward (the part of ours_fwd_ms the device may
            # spend idle, waiting for launches)
            "stock_fwd_host_ms": host_issue_ms(lambda: moe(x), iters, warmup),
            "ours_fwd_host_ms": host_issue_ms(lambda: ours_layer(x), iters, warmup),
            # calls back to back, as layers run in training when nothing syncs: GPU-bound, so
            # less moved by a slow host than the waited medians above
            "stock_fwd_b2b_ms": back_to_back_ms(lambda: moe(x), iters),
            "ours_fwd_b2b_ms": back_to_back_ms(lambda: ours_layer(x), iters),
        }
        if profile:
            timeline(f"{shape['name']} EP=1 ours fwd (no grad)", lambda: ours_layer(x), 0)
        if backend == "hopper":
            res["stages_ms"] = _stage_times(x2, ids, scores, ex.w1, ex.w2, ex.w3, iters, warmup)

    flops_fwd = 6 * T * K * D * H
    res["flops_fwd"] = flops_fwd
    res["floor_fwd_ms"] = flops_fwd / (peak_tflops * 1e12) * 1e3
    if backward:
        xg = x.detach().clone().requires_grad_(True)
        grad = torch.randn_like(x)

        def stock_step():
            moe(xg).backward(grad)

        def ours_step():
            ours_layer(xg).backward(grad)

        res["stock_fwdbwd_ms"] = median_ms(stock_step, iters, warmup)
        try:
            ours_step()
            res["ours_fwdbwd_ms"] = median_ms(ours_step, iters, warmup)
        except NotImplementedError as err:
            res["ours_fwdbwd_ms"] = None
            res["ours_fwdbwd_note"] = str(err)
        res["floor_fwdbwd_ms"] = 3 * res["floor_fwd_ms"]

        # The steps above accumulate into existing .grad tensors (an extra pass over the weight
        # gradients each call); a training step's first backward writes them fresh instead.
        def fresh(step):
            def run():
                moe.zero_grad(set_to_none=True)
                xg.grad = None
                step()
            return run

        res["stock_fwdbwd_fresh_ms"] = median_ms(fresh(stock_step), iters, warmup)
        res["stock_fwdbwd_b2b_ms"] = back_to_back_ms(fresh(stock_step), iters)
        res["stock_fwdbwd_peak_mib"] = peak_extra_mib(fresh(stock_step))
        if res.get("ours_fwdbwd_ms"):
            res["ours_fwdbwd_fresh_ms"] = median_ms(fresh(ours_step), iters, warmup)
            res["ours_fwdbwd_b2b_ms"] = back_to_back_ms(fresh(ours_step), iters)
            res["ours_fwdbwd_peak_mib"] = peak_extra_mib(fresh(ours_step))
        if profile:
            profile_kernels(f"{shape['name']} EP=1 ours fwd+bwd", ours_step, 0)
            timeline(f"{shape['name']} EP=1 ours fwd+bwd", fresh(ours_step), 0)
            profile_kernels(f"{shape['name']} EP=1 stock fwd+bwd", stock_step, 0)
        moe.zero_grad(set_to_none=True)
    from torchtitan_megamoe.ops.hopper import tune

    res["tuned"] = {
        f"{name}{list(k)}": [{"config": c, "ms": ms, "err": e} for c, ms, e in v]
        for (name, k), v in tune.TIMINGS.items()
    }
    del moe
    torch.cuda.empty_cache()
    if backward and backend == "hopper" and res.get("ours_fwdbwd_ms"):
        # A failure here must not cost the layer numbers above (one GPU run is expensive).
        try:
            res["bwd_stages"] = bwd_stage_breakdown(key, tokens, iters)
        except Exception as err:  # noqa: BLE001 - reported in the JSON and the table
            traceback.print_exc()
            res["bwd_stages_error"] = f"{type(err).__name__}: {err}"
        torch.cuda.empty_cache()
    return res
