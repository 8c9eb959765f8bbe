"""GEMM 1 variants at one Qwen3 shape, each launched twice, for Nsight Compute to read counters
from (tensor-pipe utilization, L2 hit rate and throughput, DRAM bytes) next to their times:

    NCU=1 ncu --clock-control none --kernel-name regex:gemm1 --metrics ... \
        python3 experiments/ncu_gemm1.py 235b

Without ncu it prints CUDA-event times of each variant (median of 10). SAVE_A=1: with the
pre-activation store of the training forward."""

import os
import sys

import torch

from torchtitan_megamoe.bench.shapes import SHAPES, uniform_routing
from torchtitan_megamoe.ops.hopper.kernels import gemm1_swiglu as g1
from torchtitan_megamoe.ops.hopper.plan import build_plan
from torchtitan_megamoe.timing import median_ms


def _triton(**match) -> dict:
    """The Triton GEMM 1 candidate with TMA, 3 stages, 128x128 tiles and these fields."""
    base = dict(BLOCK_N=128, BLOCK_K=64, num_stages=3, USE_TMA=True)
    for c in g1.GPU_CONFIGS:
        if all(c.get(k, False) == v for k, v in {**base, **match}.items()) and (
                "PERSISTENT" in match or not c.get("PERSISTENT")) and not c.get("WARP_SPEC"):
            return dict(c)
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
    sm90 = dict(IMPL="sm90", BLOCK_M=128, BLOCK_N=128, BLOCK_K=64)
    c1 = dict(sm90, GROUP_M=8, CLUSTER=1)
    c2 = dict(sm90, GROUP_M=4, CLUSTER=2)
    measured = [c2, dict(sm90, GROUP_M=8, CLUSTER=2), c1, dict(sm90, GROUP_M="wave", CLUSTER=1),
                dict(sm90, GROUP_M="wave", CLUSTER=2)]
    variants = {
        "triton_persistent": _triton(GROUP_M=8, PERSISTENT=True),
        "triton_persistent_wave": _triton(GROUP_M="wave", PERSISTENT=True),
        "triton_wave": _triton(GROUP_M="wave"),
        **{f"sm90_c{c['CLUSTER']}_g{c['GROUP_M']}": c for c in measured},
        # compile-time knobs of csrc/grouped_gemm_sm90.cu, one cached build each
        "sm90_c1_promo_none": dict(c1, DEFINES=("MEGAMOE_SM90_L2_PROMOTION=0",)),
        "sm90_c1_promo_128": dict(c1, DEFINES=("MEGAMOE_SM90_L2_PROMOTION=2",)),
        "sm90_c1_stages3": dict(c1, DEFINES=("MEGAMOE_SM90_STAGES=3",)),
        "sm90_c1_no_store": dict(c1, DEFINES=("MEGAMOE_SM90_STORE=0",)),
        "sm90_c1_no_store_lag1": dict(c1, DEFINES=("MEGAMOE_SM90_STORE=0", "MEGAMOE_SM90_WGMMA_LAG=1")),
        "sm90_c1_tma": dict(c1, DEFINES=("MEGAMOE_SM90_TMA_STORE=1",)),
        # measuring only: the bulk-store epilogue stages its tiles but stores none of them
        "sm90_c1_tma_no_store": dict(c1, DEFINES=("MEGAMOE_SM90_TMA_STORE=1", "MEGAMOE_SM90_STORE=0")),
        # SwiGLU with the IEEE division (the default's sigmoid divides approximately)
        "sm90_c1_tma_exact_div": dict(c1, DEFINES=("MEGAMOE_SM90_TMA_STORE=1",
                                                   "MEGAMOE_SM90_SIGMOID=0")),
        "sm90_c1_tma_tanh": dict(c1, DEFINES=("MEGAMOE_SM90_TMA_STORE=1", "MEGAMOE_SM90_SIGMOID=2")),
        # two staging tiles per warpgroup (the training forward's three stores per tile), 3 stages
        "sm90_c1_tma_2_buffers": dict(c1, DEFINES=("MEGAMOE_SM90_TMA_STORE=1",
                                                   "MEGAMOE_SM90_EPI_BUFFERS=2",
                                                   "MEGAMOE_SM90_STAGES=3")),
        "sm90_c1_tma_stages3": dict(c1, DEFINES=("MEGAMOE_SM90_TMA_STORE=1", "MEGAMOE_SM90_STAGES=3")),
        "sm90_c1_tma_lag1": dict(c1, DEFINES=("MEGAMOE_SM90_TMA_STORE=1", "MEGAMOE_SM90_WGMMA_LAG=1")),
        "sm90_c1_tma_bk32_lag1": dict(c1, DEFINES=(
            "MEGAMOE_SM90_TMA_STORE=1", "MEGAMOE_SM90_BK=32", "MEGAMOE_SM90_STAGES=8",
            "MEGAMOE_SM90_WGMMA_LAG=1")),
        "sm90_c2_promo_none": dict(c2, DEFINES=("MEGAMOE_SM90_L2_PROMOTION=0",)),
        "sm90_c1_lag0": dict(c1, DEFINES=("MEGAMOE_SM90_WGMMA_LAG=0",)),
        "sm90_c1_preg56": dict(c1, DEFINES=("MEGAMOE_SM90_PRODUCER_REGS=56",)),
        "sm90_c1_pfence": dict(c1, DEFINES=("MEGAMOE_SM90_PRODUCER_FENCE=1",)),
        "sm90_c1_pfence_lag1": dict(c1, DEFINES=("MEGAMOE_SM90_PRODUCER_FENCE=1", "MEGAMOE_SM90_WGMMA_LAG=1")),
        "sm90_c2_pfence": dict(c2, DEFINES=("MEGAMOE_SM90_PRODUCER_FENCE=1",)),
        "sm90_c1_lag1": dict(c1, DEFINES=("MEGAMOE_SM90_WGMMA_LAG=1",)),
        # every gridDim-th tile instead of the global ticket (the order before 2026-11-30 06:xx)
        "sm90_c1_static": dict(c1, STATIC=True),
        "sm90_c1_static_lag1": dict(c1, STATIC=True, DEFINES=("MEGAMOE_SM90_WGMMA_LAG=1",)),
        "sm90_c1_g16_lag1": dict(c1, GROUP_M=16, DEFINES=("MEGAMOE_SM90_WGMMA_LAG=1",)),
        "sm90_c1_g4_lag1": dict(c1, GROUP_M=4, DEFINES=("MEGAMOE_SM90_WGMMA_LAG=1",)),
        "sm90_c2_lag1": dict(c2, DEFINES=("MEGAMOE_SM90_WGMMA_LAG=1",)),
        "sm90_c2_pfence_lag1": dict(c2, DEFINES=(
            "MEGAMOE_SM90_PRODUCER_FENCE=1", "MEGAMOE_SM90_WGMMA_LAG=1")),
        "sm90_c1_bk32_lag1": dict(c1, DEFINES=(
            "MEGAMOE_SM90_BK=32", "MEGAMOE_SM90_STAGES=8", "MEGAMOE_SM90_WGMMA_LAG=1")),
        "sm90_c1_wave_lag1": dict(measured[3], DEFINES=("MEGAMOE_SM90_WGMMA_LAG=1",)),
        "sm90_c1_bk32": dict(c1, DEFINES=("MEGAMOE_SM90_BK=32", "MEGAMOE_SM90_STAGES=8")),
        "sm90_c1_bk32_lag1_pfence": dict(c1, DEFINES=(
            "MEGAMOE_SM90_BK=32", "MEGAMOE_SM90_STAGES=8", "MEGAMOE_SM90_WGMMA_LAG=1",
            "MEGAMOE_SM90_PRODUCER_FENCE=1")),
        "sm90_c1_lag0_preg56": dict(c1, DEFINES=("MEGAMOE_SM90_WGMMA_LAG=0", "MEGAMOE_SM90_PRODUCER_REGS=56")),
        # measuring only (wrong results): which operand's loads miss L2
        "sm90_c1_no_a": dict(c1, DEFINES=("MEGAMOE_SM90_LOAD=2",)),
        "sm90_c1_no_b": dict(c1, DEFINES=("MEGAMOE_SM90_LOAD=1",)),
        "sm90_c1_g16": dict(c1, GROUP_M=16),
        "sm90_c1_g4": dict(c1, GROUP_M=4),
        # the tuner's bulk-store build with other tile orders (one group per wave: "wave")
        **{f"sm90_c1_tma_g{g}": dict(c1, GROUP_M=g, DEFINES=("MEGAMOE_SM90_TMA_STORE=1",))
           for g in (4, 16, 32, "wave")},
    }
    save_a = os.environ.get("SAVE_A") == "1"  # the training forward's a1/a3 store too
    only = os.environ.get("VARIANTS")
    if only:
        variants = {k: v for k, v in variants.items() if k in only.split(",")}
    for name, cfg in variants.items():
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
