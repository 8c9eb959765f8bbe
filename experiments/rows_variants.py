"""The sm90 row-space GEMMs (csrc/grouped_gemm_sm90.cu: GEMM 1 + SwiGLU, GEMM 2, the N-major
kernel C) at one Qwen3 shape with and without a compile-time knob, in the same process (the
A/B of a kernel change, e.g. the padding skip). The variants alternate, ROUNDS (default 5)
rounds of a CUDA-event median of 10 each, and the table gives the median of the rounds: a
single median per variant drifted by 5-10% between neighbouring measurements on the H200
(docs/PERF.md at 5e0bafa, padding skip), more than most kernel changes move:

    python3 experiments/rows_variants.py 30b            # default vs MEGAMOE_SM90_PAD_SKIP=0
    KNOB=MEGAMOE_SM90_WGMMA_LAG=1 python3 experiments/rows_variants.py 235b
    KNOB=MEGAMOE_SM90_EPI_BUFFERS=2,MEGAMOE_SM90_STAGES=3 python3 experiments/rows_variants.py 30b
    KNOB=MEGAMOE_SM90_GEMM1_DEFER=0 KERNELS=gemm1_swiglu,gemm1_swiglu+a \
        python3 experiments/rows_variants.py 235b

"gemm1_swiglu+a" is the training forward's GEMM 1 (h and the saved a1/a3 pre-activations).

KERNELS (a comma list of the table's kernel names) picks rows. NCU=1: each kernel of the
variant named by VARIANTS (default, or the knob) is only launched twice, for Nsight Compute:
    SHAPE=30b SCRIPT=experiments/rows_variants.py KERNEL=grouped_gemm_kernel VARIANTS=default \
        KERNELS=gemm2_rows bash experiments/ncu_stalls.sh
"""

import os
import statistics
import sys

import torch

from torchtitan_megamoe.bench.shapes import variant_setup
from torchtitan_megamoe.ops.hopper.cuda.gemm1_swiglu import gemm1_swiglu_sm90
from torchtitan_megamoe.ops.hopper.cuda.gemm_rows import gemm_rows_nmajor_sm90, gemm_rows_sm90
from torchtitan_megamoe.ops.hopper.cuda.sm90 import BULK_STORE
from torchtitan_megamoe.timing import median_ms


def main(shape_name: str = "30b") -> None:
    knob = os.environ.get("KNOB", "MEGAMOE_SM90_PAD_SKIP=0")  # a comma list for several
    variants = {"default": BULK_STORE, knob: BULK_STORE + tuple(knob.split(","))}
    D, H, E, K, T, plan = variant_setup(shape_name)
    R = plan.max_rows
    pad = plan.row_slot < 0
    x = torch.randn(T, D, device="cuda").bfloat16()
    w1 = (torch.randn(E, H, D, device="cuda") / D**0.5).bfloat16()
    w3 = (torch.randn(E, H, D, device="cuda") / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, H, device="cuda") / H**0.5).bfloat16()
    h = torch.randn(R, H, device="cuda").bfloat16()
    h[pad] = 0
    da = torch.randn(R, 2 * H, device="cuda").bfloat16()
    da[pad] = 0
    hout = torch.empty(R, H, device="cuda", dtype=torch.bfloat16)
    aout = torch.empty(R, 2 * H, device="cuda", dtype=torch.bfloat16)  # the training forward's
    y = torch.empty(R, D, device="cuda", dtype=torch.bfloat16)
    dx = torch.empty(R, D, device="cuda", dtype=torch.bfloat16)
    used = int(plan.num_rows_used)
    print(f"{shape_name}: rows used {used} (padding {int(pad[:used].sum())}), knob {knob}")
    kernels = {
        "gemm1_swiglu": lambda d: gemm1_swiglu_sm90(x, w1, w3, plan, hout, cluster=1, defines=d),
        "gemm1_swiglu+a": lambda d: gemm1_swiglu_sm90(x, w1, w3, plan, hout, aout, cluster=1,
                                                      defines=d),
        "gemm2_rows": lambda d: gemm_rows_sm90(h, w2, plan, y, defines=d),
        "dgrad_l1 (C)": lambda d: gemm_rows_nmajor_sm90(da, (w1, w3), plan, dx, defines=d),
    }
    only = os.environ.get("KERNELS")
    if only:
        kernels = {k: v for k, v in kernels.items() if k in only.split(",")}
    if os.environ.get("NCU") == "1":
        defines = variants[os.environ.get("VARIANTS", "default")]
        for name, run in kernels.items():
            run(defines)
            run(defines)
            torch.cuda.synchronize()
            print(f"{shape_name} {name}: launched", flush=True)
        return
    print("| kernel | " + " | ".join(variants) + " | ratio | outputs |")
    print("| --- | " + " | ".join("---" for _ in variants) + " | --- | --- |")
    rounds = int(os.environ.get("ROUNDS", "5"))
    for name, run in kernels.items():
        out = {"gemm1_swiglu": (hout,), "gemm1_swiglu+a": (hout, aout),
               "gemm2_rows": (y,)}.get(name, (dx,))
        outs, samples = [], [[] for _ in variants]
        for defines in variants.values():
            for o in out:
                o.fill_(float("nan"))  # poisoned: every row used must be written by the variant
            run(defines)  # build and warm each variant before the rounds
            outs.append(torch.cat([o[:used] for o in out], 1))
        for _ in range(rounds):
            for i, defines in enumerate(variants.values()):
                samples[i].append(median_ms(lambda d=defines: run(d), 10, 2))
        times = [statistics.median(t) for t in samples]
        same = not outs[0].isnan().any() and all(torch.equal(outs[0], o) for o in outs[1:])
        print(f"| {name} | " + " | ".join(f"{t:.3f}" for t in times)
              + f" | {times[1] / times[0]:.3f} | {'bitwise equal' if same else 'DIFFER'} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
