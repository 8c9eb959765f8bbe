"""GEMM 1 variants at one Qwen3 shape, each launched twice, for Nsight Compute to read counters
from (tensor-pipe utilization, L2 hit rate and throughput, DRAM bytes) next to their times;
``fp8_*``: the FP8 GEMM 1 (fp8_gemm1_swiglu, h quantized) by the sm90 kernel, token rows
gathered inside or first (ncu's kernel regex: fp8_gemm_kernel):

    NCU=1 ncu --clock-control none --kernel-name regex:gemm1 --metrics ... \
        python3 experiments/ncu_gemm1.py 235b

Without ncu it prints CUDA-event times of each variant (median of 10). SAVE_A=1: with the
pre-activation store of the training forward."""

import os
import sys

import torch

from torchtitan_megamoe.bench.shapes import SHAPES
from torchtitan_megamoe.ops.hopper import heuristics
from torchtitan_megamoe.ops.hopper.configs import Sm90
from torchtitan_megamoe.ops.hopper.fp8_weights import forward_weights
from torchtitan_megamoe.ops.hopper.kernels.fp8_quant import quant_rows
from torchtitan_megamoe.ops.hopper.sides import fp8_gemm as fg
from torchtitan_megamoe.ops.hopper.sides import gemm1_swiglu as g1
from torchtitan_megamoe.ops.hopper.plan import build_plan
from torchtitan_megamoe.timing import median_ms

from routing import uniform_routing  # experiments/routing.py


def _triton(**match):
    """The Triton GEMM 1 candidate with TMA, 3 stages, 128x128 tiles and these fields."""
    base = dict(block_n=128, block_k=64, num_stages=3, use_tma=True)
    for c in heuristics.GEMM1_SWIGLU_CONFIGS:
        if all(getattr(c, k) == v for k, v in {**base, **match}.items()) and (
                "persistent" in match or not c.persistent):
            return c
    raise KeyError(match)


def main(shape_name: str = "235b") -> None:
    shape = SHAPES[shape_name]
    D, H, E, K, T = shape["dim"], shape["hidden"], shape["experts"], shape["top_k"], 16384
    torch.manual_seed(0)
    x = torch.randn(T, D, device="cuda").bfloat16()
    w1 = (torch.randn(E, H, D, device="cuda") / D**0.5).bfloat16()
    w3 = (torch.randn(E, H, D, device="cuda") / D**0.5).bfloat16()
    ids = uniform_routing(E, K, T)
    plan = build_plan(ids, E, 128)
    variants = {
        "triton_persistent": _triton(group_m=8, persistent=True),
        "triton_persistent_wave": _triton(group_m="wave", persistent=True),
        "triton_wave": _triton(group_m="wave"),
        # the tuner's sm90 candidate (group_m 8), and other tile orders: group_m M tiles sweep
        # one N tile together ("wave": one group per wave of resident CTAs)
        **{f"sm90_g{g}": Sm90(group_m=g) for g in (8, 4, 16, 32, "wave")},
        # every gridDim-th tile instead of the global ticket
        "sm90_static": Sm90(group_m=8, static=True),
        "fp8_sm90": Sm90(group_m=8),
        "fp8_sm90_rows_first": Sm90(group_m=8, gather_first=True),
    }
    save_a = os.environ.get("SAVE_A") == "1"  # the training forward's a1/a3 store too
    only = os.environ.get("VARIANTS")
    if only:
        variants = {k: v for k, v in variants.items() if k in only.split(",")}
    fp8 = None
    for name, cfg in variants.items():
        if name.startswith("fp8_"):
            if fp8 is None:
                xq, xs = quant_rows(x)
                fp8 = (xq, xs, forward_weights(w1, w1.transpose(1, 2).contiguous(), w3))
            xq, xs, wq = fp8
            run = lambda: fg.fp8_gemm1_swiglu(  # noqa: E731
                xq, xs, wq.w1q, wq.w1s, wq.w3q, wq.w3s, plan, save_a, config=cfg)
        else:
            run = lambda: g1.gemm1_swiglu(x, w1, w3, plan, config=cfg, save_a=save_a)  # noqa: E731
        if os.environ.get("NCU") == "1":  # under ncu: a warm-up and one profiled launch each
            run()
            run()
            torch.cuda.synchronize()
            print(f"{shape_name} {name}: launched  {cfg}", flush=True)
            continue
        print(f"{shape_name} {name}: {median_ms(run, 10, 2):.3f} ms  {cfg}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
