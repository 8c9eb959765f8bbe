"""Per-stage timing of the triton backward on the GPU (the breakdown the perf notes need).

    python -m torchtitan_megamoe.ops.triton.bwd_bench [--tokens 16384] [--shapes 30b,235b]

Runs backward once to tune and compile, then times each stage with CUDA events (median of
--iters) and prints one JSON line per shape: milliseconds and achieved TFLOP/s per stage, the
whole backward, and the peak memory the call allocates on top of its inputs.
"""

import argparse
import json
import time

import torch

from torchtitan_megamoe.ops.triton.backward import (
    A_CANDIDATES, B_CANDIDATES, BLOCK_M, C_CANDIDATES, backward_local,
)
from torchtitan_megamoe.ops.triton.bwd_combine import bwd_combine
from torchtitan_megamoe.ops.triton.bwd_dgrad_l1 import dgrad_l1
from torchtitan_megamoe.ops.triton.bwd_dgrad_l2_swiglu import dgrad_l2_swiglu
from torchtitan_megamoe.ops.triton.bwd_wgrad import wgrad
from torchtitan_megamoe.ops.triton.plan import build_plan
from torchtitan_megamoe.ops.triton.tune import pick_config

SHAPES = {"30b": (2048, 768, 128, 8), "235b": (4096, 1536, 128, 8)}


def _time(fn, iters):
    if not torch.cuda.is_available():  # interpreter smoke runs: wall time
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _chosen(name, key, cands):
    """The config backward_local's tuning picked for this key (it ran first, so it is cached)."""
    return pick_config(name, key, cands, lambda cfg: None)


def bench_shape(name, tokens, iters, shape=None, device="cuda", block_m=BLOCK_M,
                candidates=(A_CANDIDATES, B_CANDIDATES, C_CANDIDATES)):
    D, H, E, K = shape or SHAPES[name]
    dev = device
    a_cands, b_cands, c_cands = candidates
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, D, device=dev, generator=g).bfloat16()
    dy = torch.randn(tokens, D, device=dev, generator=g).bfloat16()
    w1 = (torch.randn(E, H, D, device=dev, generator=g) / D**0.5).bfloat16()
    w3 = (torch.randn(E, H, D, device=dev, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, H, device=dev, generator=g) / H**0.5).bfloat16()
    probs = torch.softmax(torch.randn(E, device=dev, generator=g), 0)
    ids = torch.multinomial(probs.expand(tokens, E), K, generator=g)
    tw = torch.softmax(torch.randn(tokens, K, device=dev, generator=g), -1)

    backward_local(dy, x, ids, tw, w1, w2, w3)  # tune + compile
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    total = _time(lambda: backward_local(dy, x, ids, tw, w1, w2, w3), iters)
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0

    plan = build_plan(ids, E, block_m)
    key = (plan.max_rows, D, H, E, block_m)
    cfg_a = _chosen("bwd_dgrad_l2_swiglu", key, a_cands)
    cfg_w2 = _chosen("bwd_wgrad", ("dw2",) + key, b_cands)
    cfg_w13 = _chosen("bwd_wgrad", ("dw13",) + key, b_cands)
    cfg_c = _chosen("bwd_dgrad_l1", key, c_cands)
    da, hw, part = dgrad_l2_swiglu(dy, x, tw, w1, w2, w3, plan, **cfg_a)
    dw = torch.empty_like(w1)
    dw2 = torch.empty_like(w2)
    dx_slot = dgrad_l1(da, w1, w3, plan, **cfg_c)
    nkdh = tokens * K * D * H
    stages = {
        "plan": (lambda: build_plan(ids, E, block_m), 0),
        "A_dgrad_l2_swiglu": (lambda: dgrad_l2_swiglu(dy, x, tw, w1, w2, w3, plan, **cfg_a), 6 * nkdh),
        "B_dw2": (lambda: wgrad(dy, hw, dw2, plan, a_gather=True, b_gather=False, **cfg_w2), 2 * nkdh),
        "B_dw1": (lambda: wgrad(da[:, :H], x, dw, plan, a_gather=False, b_gather=True, **cfg_w13), 2 * nkdh),
        "B_dw3": (lambda: wgrad(da[:, H:], x, dw, plan, a_gather=False, b_gather=True, **cfg_w13), 2 * nkdh),
        "C_dgrad_l1": (lambda: dgrad_l1(da, w1, w3, plan, out=dx_slot, **cfg_c), 4 * nkdh),
        "combine": (lambda: bwd_combine(dx_slot, part, plan, dx_dtype=x.dtype,
                                        dtw_dtype=tw.dtype), 0),
    }
    res = {"shape": name, "tokens": tokens, "total_ms": total,
           "total_tflops": 16 * nkdh / total / 1e9, "peak_extra_gib": peak / 2**30,
           "configs": {"A": cfg_a, "dw2": cfg_w2, "dw13": cfg_w13, "C": cfg_c}}
    for stage, (fn, flops) in stages.items():
        ms = _time(fn, iters)
        res[f"{stage}_ms"] = ms
        if flops:
            res[f"{stage}_tflops"] = flops / ms / 1e9
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--shapes", default="30b,235b")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    for name in args.shapes.split(","):
        print(json.dumps(bench_shape(name, args.tokens, args.iters)), flush=True)


if __name__ == "__main__":
    main()
