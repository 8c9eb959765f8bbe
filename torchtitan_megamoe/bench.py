"""MoE layer benchmark: stock TorchTitan MoE vs mega_moe on the same weights and routing.

    python -m torchtitan_megamoe.bench [--shapes 30b,235b] [--tokens 16384] [--json out.json]
    torchrun --nproc_per_node 2 -m torchtitan_megamoe.bench --ep 2 [--json out.json]

For each Qwen3 shape it builds stock ``torchtitan.models.moe.MoE`` with Qwen3's MoEArgs (softmax,
route_norm, no shared experts, score_before_experts=False) in bf16, then times:

- stock: the module's forward (router + permute + grouped GEMMs + unpermute + combine);
- ours: the same module's router, then ``mega_moe`` on its routing and expert weights (the
  layer the converter builds); at EP=1 also the op alone and its forward stages (plan, GEMM1,
  GEMM2, combine);
- with --backward (default on): forward + backward of both, when the backend has a backward;
  at EP=1 with the triton backend also the backward's stages (kernel A: dgrad of layer 2 +
  SwiGLU with GEMM 1 recomputed, the three weight gradients, kernel C: dgrad of layer 1, the
  combine; each with its Triton kernel and its _grouped_mm counterpart where one exists, and
  the totals per forced side and with the tuner's per-stage pick), timed by
  ``ops/triton/bwd_bench.py`` on its own random routing of the same shape.

EP > 1 (under torchrun, one process per GPU, each with --tokens tokens): stock is TorchTitan's
own EP layer, its experts sharded by ``ExpertParallel`` on a 1-D DeviceMesh named "ep" exactly
as ``apply_moe_ep_tp`` does in training (all_to_all dispatch, per-expert padding to
TOKEN_GROUP_ALIGN_SIZE_M, grouped GEMMs, all_to_all combine); ours is ``mega_moe`` with the
mesh's group on the same rank's expert shard and routing; ours at EP=1 (every expert on each
GPU, same tokens) is timed in the same run for the EP=N / EP=1 ratio. Rank 0's times are
reported; output errors are the max over ranks.

Timing: CUDA events around each call after warm-up (which also runs the kernels' tuner), the
median of --iters calls. Flops: 6*T*K*D*H forward (three GEMMs), 3x that forward + backward;
the floor is those flops at --peak-tflops (765: dense bf16 GEMM measured on the H200, DESIGN §5).
On a machine without CUDA only --backend reference runs (a smoke test of the code path, with
wall-clock times, under gloo for --ep > 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

from torchtitan_megamoe.timing import back_to_back_ms, median_ms, peak_extra_mib

SHAPES = {
    "tiny": dict(name="tiny (smoke)", dim=128, hidden=64, experts=8, top_k=2),
    "30b": dict(name="Qwen3-30B-A3B", dim=2048, hidden=768, experts=128, top_k=8),
    "235b": dict(name="Qwen3-235B-A22B", dim=4096, hidden=1536, experts=128, top_k=8),
}

# ops/triton/bwd_bench.py's stage keys in backward order: (label, Triton kernel, _grouped_mm
# counterpart or None). The tuner picks a side per stage; "auto" below is what the layer runs.
BWD_STAGES = [
    ("fwd: GEMM 1 + SwiGLU (inference)", "fwd_gemm1", None),
    ("fwd: GEMM 1 + SwiGLU + store a1/a3 (training)", "fwd_gemm1_save_a", None),
    ("plan (built by the forward, reused)", "plan", None),
    ("A: dgrad L2 + SwiGLU on saved a1/a3", "A_dgrad_l2_swiglu", None),
    ("A with GEMM 1 recomputed (unused path)", "A_dgrad_l2_swiglu_recompute", None),
    ("wgrad dw2", "B_dw2", "B_dw2_cublas"),
    ("wgrad dw1", "B_dw1", None),
    ("wgrad dw3", "B_dw3", None),
    ("wgrad dw1 + dw3", "B_dw13", "B_dw13_cublas"),
    ("C: dgrad L1", "C_dgrad_l1", "C_dgrad_l1_cublas"),
    ("combine (dx, d topk_weights)", "combine", None),
    ("backward total, one side forced", "total", "total_cublas"),
    ("backward total, tuner's pick per stage", "total_auto", None),
    ("backward total, recompute path (no saved a)", "total_recompute", None),
]


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.float(), ref.float()
    return float((got - ref).norm() / ref.norm())


def build_stock_moe(shape: dict, device: torch.device):
    from torchtitan.models.moe import MoE, MoEArgs

    if device.type == "cpu":
        # stock counts int64 expert ids with torch.histc and pads EP dispatch with a Triton
        # kernel, neither of which runs on CPU tensors: the project's CPU shims (this process)
        from torchtitan_megamoe import cpu

        cpu.apply()

    args = MoEArgs(
        num_experts=shape["experts"],
        num_shared_experts=0,
        top_k=shape["top_k"],
        score_func="softmax",
        route_norm=True,
        route_scale=1.0,
        score_before_experts=False,
        # the stock grouped-mm path permutes with a Triton kernel that needs a GPU; the CPU
        # smoke run of this script takes the stock for-loop path instead
        use_grouped_mm=device.type == "cuda",
    )
    with torch.device(device):
        moe = MoE(args, dim=shape["dim"], hidden_dim=shape["hidden"])
    with torch.no_grad():
        moe.init_weights(init_std=0.02, buffer_device=device)
    # Parameters in bf16 (what FSDP mixed precision computes with); router buffers stay fp32.
    for p in moe.parameters():
        p.data = p.data.to(torch.bfloat16)
    return moe


def shard_stock_experts(moe, mesh) -> None:
    """TorchTitan's own EP wiring of a MoE block (what apply_moe_ep_tp does without TP).

    ``mesh`` is 1-D with dim name "ep": GroupedExperts checks that name to skip its own index
    padding, since ExpertParallel's dispatch pads every local expert's rows to the group
    alignment itself. Experts are split evenly: rank r keeps [r*E/N, (r+1)*E/N).
    """
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.distributed.expert_parallel import ExpertParallel

    if mesh.mesh_dim_names != ("ep",):
        raise ValueError(f"stock EP needs a 1-D DeviceMesh named 'ep', got {mesh.mesh_dim_names}; "
                         "build it with init_device_mesh(type, (N,), mesh_dim_names=('ep',))")
    parallelize_module(moe.experts, mesh, ExpertParallel())


def _stage_times(x, ids, w, w1, w2, w3, iters, warmup):
    from torchtitan_megamoe.ops.triton.combine import combine
    from torchtitan_megamoe.ops.triton.forward import BLOCK_M
    from torchtitan_megamoe.ops.triton.gemm1_swiglu import gemm1_swiglu
    from torchtitan_megamoe.ops.triton.gemm2_rows import gemm2_rows
    from torchtitan_megamoe.ops.triton.plan import build_plan

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
    """The triton backward's per-stage times (ops/triton/bwd_bench.py) at one shape.

    Without CUDA it runs under Triton's interpreter with the backward's interpreter tiles (a
    smoke test of this wiring; use a tiny shape there).
    """
    from torchtitan_megamoe.ops.triton import bwd_bench

    shape = SHAPES[key]
    dims = (shape["dim"], shape["hidden"], shape["experts"], shape["top_k"])
    if torch.cuda.is_available():
        return bwd_bench.bench_shape(key, tokens, iters, shape=dims)
    from torchtitan_megamoe.ops.triton.backward import (
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
        scores, ids, _ = moe.router(inp.view(T, D), moe.expert_bias)
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
        }
        if backend == "triton":
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
        res["stock_fwdbwd_peak_mib"] = peak_extra_mib(fresh(stock_step))
        if res.get("ours_fwdbwd_ms"):
            res["ours_fwdbwd_fresh_ms"] = median_ms(fresh(ours_step), iters, warmup)
            res["ours_fwdbwd_peak_mib"] = peak_extra_mib(fresh(ours_step))
        if profile:
            profile_kernels(f"{shape['name']} EP=1 ours fwd+bwd", ours_step, 0)
            profile_kernels(f"{shape['name']} EP=1 stock fwd+bwd", stock_step, 0)
        moe.zero_grad(set_to_none=True)
    from torchtitan_megamoe.ops.triton import tune

    res["tuned"] = {
        f"{name}{list(k)}": [{"config": c, "ms": ms, "err": e} for c, ms, e in v]
        for (name, k), v in tune.TIMINGS.items()
    }
    del moe
    torch.cuda.empty_cache()
    if backward and backend == "triton" and res.get("ours_fwdbwd_ms"):
        # A failure here must not cost the layer numbers above (one GPU run is expensive).
        try:
            res["bwd_stages"] = bwd_stage_breakdown(key, tokens, iters)
        except Exception as err:  # noqa: BLE001 - reported in the JSON and the table
            traceback.print_exc()
            res["bwd_stages_error"] = f"{type(err).__name__}: {err}"
        torch.cuda.empty_cache()
    return res


def _time_pair(fwd, step, iters, warmup, backward, res=None, name=None):
    """(forward ms, forward + backward ms or None) of one layer, each call waited for. With
    ``res`` and ``name``, also res[f"{name}_fwd_b2b_ms"] (and fwdbwd): calls back to back."""
    with torch.no_grad():
        fwd_ms = median_ms(fwd, iters, warmup)
        if res is not None:
            res[f"{name}_fwd_b2b_ms"] = back_to_back_ms(fwd, iters)
            res[f"{name}_fwd_peak_mib"] = peak_extra_mib(fwd)
    step_ms = median_ms(step, iters, warmup) if backward else None
    if res is not None and backward:
        res[f"{name}_fwdbwd_b2b_ms"] = back_to_back_ms(step, iters)
        res[f"{name}_fwdbwd_peak_mib"] = peak_extra_mib(step)
    return fwd_ms, step_ms


def bench_shape_ep(key: str, tokens: int, iters: int, warmup: int, backward: bool,
                   peak_tflops: float, mesh, backend: str = "triton", ep1: bool = True,
                   profile: bool = False) -> dict:
    """Stock TorchTitan EP vs ours, experts split over ``mesh`` (1-D, named "ep").

    Every rank must call this (it communicates). Order: ours at EP=1 (full weights, no
    communication), ours at EP=N, then stock after sharding its experts, so that a failure of the
    stock wiring still leaves ours' numbers.
    """
    import torch.distributed as dist

    from torchtitan_megamoe import mega_moe

    shape = SHAPES[key]
    group = mesh.get_group()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    if shape["experts"] % world:
        raise ValueError(f"{shape['experts']} experts do not split over EP={world}; "
                         "pick an EP degree that divides the expert count")
    torch.manual_seed(0)  # same router and experts on every rank; each keeps its expert slice
    moe = build_stock_moe(shape, dev)
    T, D, H, K = tokens, shape["dim"], shape["hidden"], shape["top_k"]
    E_local = shape["experts"] // world
    mine = slice(rank * E_local, (rank + 1) * E_local)
    torch.manual_seed(1 + rank)
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    xg = x.detach().clone().requires_grad_(True)
    flops_fwd = 6 * T * K * D * H
    res = {
        "shape": shape["name"], "tokens": T, "ep": world, "dim": D, "hidden": H,
        "experts": shape["experts"], "top_k": K, "backend": backend,
        "flops_fwd": flops_fwd, "floor_fwd_ms": flops_fwd / (peak_tflops * 1e12) * 1e3,
    }
    if backward:
        res["floor_fwdbwd_ms"] = 3 * res["floor_fwd_ms"]

    def ours_layer(inp, w1, w2, w3, grp, be=backend):
        scores, ids, _ = moe.router(inp, moe.expert_bias)
        return mega_moe(inp, ids, scores, w1, w2, w3, group=grp, backend=be)

    ex = moe.experts
    if ep1:
        full = (ex.w1, ex.w2, ex.w3)
        res["ours_ep1_fwd_ms"], res["ours_ep1_fwdbwd_ms"] = _time_pair(
            lambda: ours_layer(x, *full, None),
            lambda: ours_layer(xg, *full, None).backward(grad),
            iters, warmup, backward, res, "ours_ep1")
        moe.zero_grad(set_to_none=True)

    mine_w = [getattr(ex, n).detach()[mine].clone().requires_grad_(backward)
              for n in ("w1", "w2", "w3")]
    with torch.no_grad():
        ours_out = ours_layer(x, *mine_w, group)
        errs = [_rel_err(ours_out, ours_layer(x, *mine_w, group, "reference"))]
    res["ours_fwd_ms"], res["ours_fwdbwd_ms"] = _time_pair(
        lambda: ours_layer(x, *mine_w, group),
        lambda: ours_layer(xg, *mine_w, group).backward(grad),
        iters, warmup, backward, res, "ours")
    res["exchange_mib"] = exchange_mib(group, D)
    if profile:
        with torch.no_grad():
            profile_kernels(f"{shape['name']} EP={world} ours fwd",
                            lambda: ours_layer(x, *mine_w, group), rank)
        if backward:
            profile_kernels(f"{shape['name']} EP={world} ours fwd+bwd",
                            lambda: ours_layer(xg, *mine_w, group).backward(grad), rank)
    torch.cuda.empty_cache()

    try:
        shard_stock_experts(moe, mesh)
        local = [getattr(ex, n).to_local() for n in ("w1", "w2", "w3")]
        res["same_expert_weights"] = all(torch.equal(a, b) for a, b in zip(local, mine_w))
        with torch.no_grad():
            errs.append(_rel_err(ours_out, moe(x.view(1, T, D)).view(T, D)))
        res["stock_fwd_ms"], res["stock_fwdbwd_ms"] = _time_pair(
            lambda: moe(x.view(1, T, D)),
            lambda: moe(xg.view(1, T, D)).backward(grad.view(1, T, D)),
            iters, warmup, backward, res, "stock")
    except Exception as err:  # noqa: BLE001 - reported; ours' numbers above stay valid
        traceback.print_exc()
        res["stock_error"] = f"{type(err).__name__}: {err}"
    # worst rank's errors (every rank runs the same number of these collectives, error or not)
    # (-1: not measured on that rank; a NaN error stays NaN)
    err_t = torch.tensor(errs + [-1.0] * (2 - len(errs)), device=dev, dtype=torch.float64)
    dist.all_reduce(err_t, op=dist.ReduceOp.MAX, group=group)
    res["rel_err_vs_reference"] = float(err_t[0])
    if not err_t[1] < 0:
        res["rel_err_vs_stock"] = float(err_t[1])
    del moe, mine_w
    torch.cuda.empty_cache()
    return res


def profile_kernels(title: str, fn, rank: int, calls: int = 3, rows: int = 40) -> None:
    """Rank 0 prints the GPU kernels of ``calls`` calls of fn (per-call time = total / calls):
    where a layer's time goes when no per-stage timer covers it (the EP exchange)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    # Host time to issue one call, outside the profiler: when it exceeds the GPU time per call,
    # the layer is launch-bound, not kernel-bound.
    import cProfile
    import io
    import pstats

    host = cProfile.Profile()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host_ms = (time.perf_counter() - t0) * 1e3 / calls
    torch.cuda.synchronize()
    host.enable()
    for _ in range(calls):
        fn()
    host.disable()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    if rank == 0:
        from torch.autograd import DeviceType

        kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
        gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / calls
        print(f"--- profile: {title}, {calls} calls: host issue {host_ms:.3f} ms per call, "
              f"GPU kernels {gpu_ms:.3f} ms per call", flush=True)
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows,
                                        max_name_column_width=60), flush=True)
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(host, stream=text).sort_stats(order).print_stats(rows)
            print(f"--- host (cProfile, {calls} calls, sorted by {order}):", flush=True)
            print("\n".join(text.getvalue().splitlines()[-rows - 2:]), flush=True)


def exchange_mib(group, dim: int) -> float:
    """Symmetric (or staging) memory of the group's EP exchange for this dim: outside the
    caching allocator, so max_memory_allocated does not see it."""
    from torchtitan_megamoe.ops.exchange import _CACHE

    return sum(ex.nbytes() for ex in _CACHE.values()
               if ex.group is group and ex.widths["x"][0] == dim) / 2**20


def _tflops(flops: float, ms: float | None) -> str:
    return f"{flops / (ms * 1e-3) / 1e12:.0f}" if ms else "n/a"


def table(results: list[dict]) -> str:
    lines = [
        "| shape | pass | stock ms | ours ms | speedup | ours TFLOP/s | floor ms | floor/ours |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        for tag, mult in (("fwd", 1), ("fwdbwd", 3)):
            stock, ours = r.get(f"stock_{tag}_ms"), r.get(f"ours_{tag}_ms")
            if stock is None:
                continue
            floor = r[f"floor_{tag}_ms"]
            if ours:
                tflops = _tflops(mult * r["flops_fwd"], ours)
                cells = (f"{ours:.3f} | {stock / ours:.2f}x | {tflops} | {floor:.2f} | "
                         f"{floor / ours:.2f}")
            else:
                cells = f"n/a | n/a | n/a | {floor:.2f} | n/a"
            lines.append(f"| {r['shape']} | {tag} | {stock:.3f} | {cells} |")
    for r in results:
        st, o = r.get("stock_fwdbwd_fresh_ms"), r.get("ours_fwdbwd_fresh_ms")
        if st and o:
            lines.append(f"{r['shape']} fwd+bwd with fresh .grad (set to None before each "
                         f"step, as a training step's first backward): stock {st:.3f}, ours "
                         f"{o:.3f} ({st / o:.2f}x); peak memory above the inputs during "
                         f"the step: stock {r['stock_fwdbwd_peak_mib']:.0f} MiB, ours "
                         f"{r['ours_fwdbwd_peak_mib']:.0f} MiB")
    return "\n".join(lines)


def bwd_table(results: list[dict]) -> str:
    """Backward stages: per shape, the Triton kernel's and the _grouped_mm side's "ms (TFLOP/s)";
    '' when no result has a breakdown."""
    cols = [r for r in results if "bwd_stages" in r or "bwd_stages_error" in r]
    if not cols:
        return ""

    def cell(b, key):
        ms = b.get(f"{key}_ms") if key else None
        if ms is None:
            return "-"
        tf = b.get(f"{key}_tflops")
        return f"{ms:.3f}" + (f" ({tf:.0f})" if tf else "")

    head = "| backward stage, ms (TFLOP/s) | " + " | ".join(
        f"{r['shape']} Triton | {r['shape']} _grouped_mm" for r in cols) + " |"
    lines = [head, "| --- |" + " --- | --- |" * len(cols)]
    for label, tri, cub in BWD_STAGES:
        cells = []
        for r in cols:
            b = r.get("bwd_stages")
            if b is None:
                cells.append("error | " + r["bwd_stages_error"].replace("|", "/")[:80])
            else:
                cells.append(f"{cell(b, tri)} | {cell(b, cub)}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    cells = []
    for r in cols:  # the layer's own backward share (other routing), to cross-check the totals
        fb, f = r.get("ours_fwdbwd_ms"), r.get("ours_fwd_ms")
        cells.append((f"{fb - f:.3f}" if fb and f else "n/a") + " | -")
    lines.append("| layer: ours fwd+bwd - fwd (its own routing) | " + " | ".join(cells) + " |")
    picks = [f"{r['shape']}: {r['bwd_stages']['auto_picks']}" for r in cols
             if r.get("bwd_stages", {}).get("auto_picks")]
    return "\n".join(lines + [f"tuner's side per stage, {p}" for p in picks])


def ep_table(results: list[dict]) -> str:
    lines = [
        "| shape | EP | pass | stock ms | ours ms | speedup | stock TFLOP/s | ours TFLOP/s "
        "| floor/ours | ours EP=1 ms | EP=N / EP=1 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        for tag, mult in (("fwd", 1), ("fwdbwd", 3)):
            ours = r.get(f"ours_{tag}_ms")
            if ours is None:
                continue
            flops = mult * r["flops_fwd"]
            stock = r.get(f"stock_{tag}_ms")
            ep1 = r.get(f"ours_ep1_{tag}_ms")
            lines.append(
                f"| {r['shape']} | {r['ep']} | {tag} | "
                + (f"{stock:.3f}" if stock else "n/a") + f" | {ours:.3f} | "
                + (f"{stock / ours:.2f}x" if stock else "n/a")
                + f" | {_tflops(flops, stock)} | {_tflops(flops, ours)} | "
                + f"{r[f'floor_{tag}_ms'] / ours:.2f} | "
                + (f"{ep1:.3f} | {ours / ep1:.2f}x" if ep1 else "n/a | n/a") + " |")
    errs = [f"{r['shape']}: {r['stock_error']}" for r in results if "stock_error" in r]
    b2b = []
    for r in results:
        for tag in ("fwd", "fwdbwd"):
            o, st, e1 = (r.get(f"{who}_{tag}_b2b_ms") for who in ("ours", "stock", "ours_ep1"))
            if o:
                b2b.append(f"{r['shape']} {tag}: stock {st or float('nan'):.3f}, ours {o:.3f}"
                           + (f" ({st / o:.2f}x)" if st else "")
                           + (f", ours EP=1 {e1:.3f} (EP=N/EP=1 {o / e1:.2f}x)" if e1 else ""))
    if b2b:
        lines.append("calls back to back (no wait per call; ms per call): " + "; ".join(b2b))
    peaks = []
    for r in results:
        for tag in ("fwd", "fwdbwd"):
            o, st = (r.get(f"{who}_{tag}_peak_mib") for who in ("ours", "stock"))
            if o is not None and st is not None:
                peaks.append(f"{r['shape']} {tag}: stock {st:.0f}, ours {o:.0f}")
    if peaks:
        lines.append("peak memory above the inputs during one call (MiB; caching allocator, "
                     "rank 0): " + "; ".join(peaks))
    mem = [f"{r['shape']}: {r['exchange_mib']:.0f} MiB" for r in results if "exchange_mib" in r]
    notes = [f"stock EP failed: {e}" for e in errs]
    if mem:
        notes.append("EP exchange buffers per rank (outside the caching allocator): "
                     + ", ".join(mem))
    return "\n".join(lines + notes)


def _meta() -> dict:
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "argv": sys.argv,
    }


def main_ep(args) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if "RANK" not in os.environ:
        print(f"bench: --ep {args.ep} runs under torchrun: torchrun --nproc_per_node "
              f"{args.ep} -m torchtitan_megamoe.bench --ep {args.ep}", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    if not cuda and args.backend != "reference":
        print("bench: needs CUDA GPUs (on CPU only --backend reference runs, as a smoke test)",
              file=sys.stderr)
        return 2
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # a caller that already joined a process group (tests) keeps it; torchrun runs start one here
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl" if cuda else "gloo")
    try:
        if dist.get_world_size() != args.ep:
            print(f"bench: world size {dist.get_world_size()} != --ep {args.ep}",
                  file=sys.stderr)
            return 2
        mesh = init_device_mesh("cuda" if cuda else "cpu", (args.ep,), mesh_dim_names=("ep",))
        results = []
        for key in args.shapes.split(","):
            t0 = time.time()
            r = bench_shape_ep(key, args.tokens, args.iters, args.warmup, args.backward,
                               args.peak_tflops, mesh, args.backend, args.ep1, args.profile)
            r["wall_s"] = round(time.time() - t0, 1)
            results.append(r)
            if dist.get_rank() == 0:
                print(json.dumps(r), flush=True)
        if dist.get_rank() == 0:
            print(ep_table(results))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"meta": _meta(), "results": results}, f, indent=1)
        return 0
    finally:
        if own_group:
            dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="30b,235b", help="comma list of: " + ",".join(SHAPES))
    p.add_argument("--tokens", type=int, default=16384, help="tokens per GPU")
    p.add_argument("--iters", type=int, default=None, help="timed calls (30; 20 with --ep > 1)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-backward", dest="backward", action="store_false")
    p.add_argument("--backend", default="triton", choices=["triton", "reference", "auto"])
    p.add_argument("--peak-tflops", type=float, default=765.0)
    p.add_argument("--ep", type=int, default=1,
                   help="EP degree (GPUs); > 1 runs under torchrun")
    p.add_argument("--no-ep1", dest="ep1", action="store_false",
                   help="with --ep > 1: skip timing our EP=1 layer in the same run")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--profile", action="store_true",
                   help="print (rank 0's) top GPU kernels and host profile of ours (fwd+bwd; at EP=1 "
                        "also stock's fwd+bwd, at EP > 1 also ours' fwd)")
    args = p.parse_args(argv)
    for key in args.shapes.split(","):
        if key not in SHAPES:
            p.error(f"unknown shape {key!r}; pick from {','.join(SHAPES)}")
    if args.iters is None:
        args.iters = 30 if args.ep == 1 else 20
    if args.ep != 1:
        return main_ep(args)
    if not torch.cuda.is_available() and args.backend != "reference":
        print("bench: needs a CUDA GPU (on CPU only --backend reference runs, as a smoke test)",
              file=sys.stderr)
        return 2
    results = []
    for key in args.shapes.split(","):
        t0 = time.time()
        r = bench_shape(key, args.tokens, args.iters, args.warmup, args.backward, args.backend,
                        args.peak_tflops, args.profile)
        r["wall_s"] = round(time.time() - t0, 1)
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "tuned"}), flush=True)
    print(table(results))
    bwd = bwd_table(results)
    if bwd:
        print(bwd)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": _meta(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
