"""MoE layer benchmark: stock TorchTitan MoE vs mega_moe on the same weights and routing.

    python -m torchtitan_megamoe.bench [--shapes 30b,235b] [--tokens 16384] [--json out.json]

For each Qwen3 shape it builds stock ``torchtitan.models.moe.MoE`` with Qwen3's MoEArgs (softmax,
route_norm, no shared experts, score_before_experts=False) in bf16 on one GPU, then times:

- stock: the module's forward (router + permute + grouped GEMMs + unpermute + combine);
- ours: the same module's router, then ``mega_moe`` on its routing and expert weights (the
  layer the converter builds); also the op alone and its stages (plan, GEMM1, GEMM2, combine);
- with --backward (default on): forward + backward of both, when the backend has a backward.

Timing: CUDA events around each call after warm-up (which also runs the kernels' tuner), the
median of --iters calls. Flops: 6*T*K*D*H forward (three GEMMs), 3x that forward + backward;
the floor is those flops at --peak-tflops (765: dense bf16 GEMM measured on the H200, DESIGN §5).
EP > 1: ``torchrun --nproc_per_node N -m torchtitan_megamoe.bench --ep N`` times our layer
with experts split over the N ranks (16384 tokens per GPU, all_to_all EP path of the Triton
backend) and checks it against the reference backend's EP path; stock TorchTitan's EP layer
needs its ExpertParallel/DeviceMesh wiring and is not timed by this script (DESIGN §5 has it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

SHAPES = {
    "tiny": dict(name="tiny (smoke)", dim=128, hidden=64, experts=8, top_k=2),
    "30b": dict(name="Qwen3-30B-A3B", dim=2048, hidden=768, experts=128, top_k=8),
    "235b": dict(name="Qwen3-235B-A22B", dim=4096, hidden=1536, experts=128, top_k=8),
}


def _time_ms(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():  # CPU smoke runs of this script only
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def build_stock_moe(shape: dict, device: torch.device):
    from torchtitan.models.moe import MoE, MoEArgs

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


def _stage_times(x, ids, w, w1, w2, w3, iters, warmup):
    from torchtitan_megamoe.ops.triton.combine import combine
    from torchtitan_megamoe.ops.triton.forward import BLOCK_M
    from torchtitan_megamoe.ops.triton.gemm1_swiglu import gemm1_swiglu
    from torchtitan_megamoe.ops.triton.gemm2_scatter import gemm2_scatter
    from torchtitan_megamoe.ops.triton.plan import build_plan

    plan = build_plan(ids, w1.shape[0], BLOCK_M)
    h = gemm1_swiglu(x, w1, w3, plan)
    y = gemm2_scatter(h, w2, plan)
    return {
        "plan": _time_ms(lambda: build_plan(ids, w1.shape[0], BLOCK_M), iters, warmup),
        "gemm1_swiglu": _time_ms(lambda: gemm1_swiglu(x, w1, w3, plan), iters, warmup),
        "gemm2_scatter": _time_ms(lambda: gemm2_scatter(h, w2, plan), iters, warmup),
        "combine": _time_ms(lambda: combine(y, w, plan.slot_row, x.dtype), iters, warmup),
        "rows_used": int(plan.num_rows_used),
        "max_rows": plan.max_rows,
        "workspace_bytes": plan.max_rows * w1.shape[1] * x.element_size()
        + y.numel() * y.element_size(),
    }


def bench_shape(key: str, tokens: int, iters: int, warmup: int, backward: bool, backend: str,
                peak_tflops: float) -> dict:
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
            "stock_fwd_ms": _time_ms(lambda: moe(x), iters, warmup),
            "ours_fwd_ms": _time_ms(lambda: ours_layer(x), iters, warmup),
            "ours_op_fwd_ms": _time_ms(
                lambda: mega_moe(x2, ids, scores, ex.w1, ex.w2, ex.w3, backend=backend),
                iters, warmup,
            ),
            "router_ms": _time_ms(lambda: moe.router(x2, moe.expert_bias), iters, warmup),
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

        res["stock_fwdbwd_ms"] = _time_ms(stock_step, iters, warmup)
        try:
            ours_step()
            res["ours_fwdbwd_ms"] = _time_ms(ours_step, iters, warmup)
        except NotImplementedError as err:
            res["ours_fwdbwd_ms"] = None
            res["ours_fwdbwd_note"] = str(err)
        res["floor_fwdbwd_ms"] = 3 * res["floor_fwd_ms"]
        moe.zero_grad(set_to_none=True)
    from torchtitan_megamoe.ops.triton import tune

    res["tuned"] = {
        f"{name}{list(k)}": [{"config": c, "ms": ms, "err": e} for c, ms, e in v]
        for (name, k), v in tune.TIMINGS.items()
    }
    del moe
    torch.cuda.empty_cache()
    return res


def bench_shape_ep(key: str, tokens: int, iters: int, warmup: int, backward: bool,
                   peak_tflops: float) -> dict:
    """Our layer with experts split over the torchrun world (one process per GPU)."""
    import torch.distributed as dist

    from torchtitan_megamoe import mega_moe

    shape = SHAPES[key]
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)  # same router and experts on every rank; each keeps its expert slice
    moe = build_stock_moe(shape, dev)
    T, D, H, K = tokens, shape["dim"], shape["hidden"], shape["top_k"]
    E_local = shape["experts"] // world
    mine = slice(rank * E_local, (rank + 1) * E_local)
    w1, w2, w3 = (getattr(moe.experts, n).detach()[mine].contiguous() for n in ("w1", "w2", "w3"))
    torch.manual_seed(1 + rank)
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    group = dist.group.WORLD

    def ours_layer(inp, backend="triton"):
        scores, ids, _ = moe.router(inp, moe.expert_bias)
        return mega_moe(inp, ids, scores, w1, w2, w3, group=group, backend=backend)

    with torch.no_grad():
        got = ours_layer(x).float()
        ref = ours_layer(x, "reference").float()
        res = {
            "shape": shape["name"], "tokens": T, "ep": world, "dim": D, "hidden": H,
            "rel_err_vs_reference": float((got - ref).norm() / ref.norm()),
            "ours_fwd_ms": _time_ms(lambda: ours_layer(x), iters, warmup),
        }
    flops_fwd = 6 * T * K * D * H
    res["flops_fwd"] = flops_fwd
    res["floor_fwd_ms"] = flops_fwd / (peak_tflops * 1e12) * 1e3
    if backward:
        w1.requires_grad_(True), w2.requires_grad_(True), w3.requires_grad_(True)
        xg = x.detach().clone().requires_grad_(True)
        grad = torch.randn_like(x)
        res["ours_fwdbwd_ms"] = _time_ms(lambda: ours_layer(xg).backward(grad), iters, warmup)
        res["floor_fwdbwd_ms"] = 3 * res["floor_fwd_ms"]
    del moe
    torch.cuda.empty_cache()
    return res


def main_ep(args) -> int:
    import os

    import torch.distributed as dist

    if "RANK" not in os.environ:
        print(f"bench: --ep {args.ep} runs under torchrun: torchrun --nproc_per_node "
              f"{args.ep} -m torchtitan_megamoe.bench --ep {args.ep}", file=sys.stderr)
        return 2
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    if dist.get_world_size() != args.ep:
        print(f"bench: world size {dist.get_world_size()} != --ep {args.ep}", file=sys.stderr)
        return 2
    results = []
    for key in args.shapes.split(","):
        r = bench_shape_ep(key, args.tokens, args.iters, args.warmup, args.backward,
                           args.peak_tflops)
        results.append(r)
        if dist.get_rank() == 0:
            print(json.dumps(r), flush=True)
    if dist.get_rank() == 0:
        print("| shape | EP | pass | ours ms (rank 0) | ours TFLOP/s per GPU | floor/ours |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in results:
            for tag, mult in (("fwd", 1), ("fwdbwd", 3)):
                ms = r.get(f"ours_{tag}_ms")
                if ms:
                    tf = mult * r["flops_fwd"] / (ms * 1e-3) / 1e12
                    print(f"| {r['shape']} | {r['ep']} | {tag} | {ms:.3f} | {tf:.0f} | "
                          f"{r[f'floor_{tag}_ms'] / ms:.2f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": {"device": torch.cuda.get_device_name(),
                                    "torch": torch.__version__,
                                    "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                                    "argv": sys.argv},
                           "results": results}, f, indent=1)
    dist.destroy_process_group()
    return 0


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
                tflops = mult * r["flops_fwd"] / (ours * 1e-3) / 1e12
                cells = f"{ours:.3f} | {stock / ours:.2f}x | {tflops:.0f} | {floor:.2f} | {floor / ours:.2f}"
            else:
                cells = f"n/a | n/a | n/a | {floor:.2f} | n/a"
            lines.append(f"| {r['shape']} | {tag} | {stock:.3f} | {cells} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="30b,235b", help="comma list of: " + ",".join(SHAPES))
    p.add_argument("--tokens", type=int, default=16384, help="tokens per GPU")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-backward", dest="backward", action="store_false")
    p.add_argument("--backend", default="triton", choices=["triton", "reference", "auto"])
    p.add_argument("--peak-tflops", type=float, default=765.0)
    p.add_argument("--ep", type=int, default=1,
                   help="EP degree (GPUs); > 1 runs under torchrun, ours only")
    p.add_argument("--json", default=None, help="write results here")
    args = p.parse_args(argv)
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
                        args.peak_tflops)
        r["wall_s"] = round(time.time() - t0, 1)
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "tuned"}), flush=True)
    meta = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "argv": sys.argv,
    }
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
