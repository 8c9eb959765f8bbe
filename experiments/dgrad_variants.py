"""dgrad2_swiglu at one Qwen3 shape: the sm90 one-launch kernel (the dgrad2_swiglu CUDA family),
alone and while storing the dy rows it gathers (as the backward runs it),
next to the two-step sm90 side (dy rows gathered, the dh GEMM, the SwiGLU rows kernel; the
gather included, as the tuner times it) and that side's parts alone. CUDA-event medians of 10:

    source scripts/_device_env.sh; install_wheels  # the package and wheels on PYTHONPATH
    python3 experiments/dgrad_variants.py 30b [235b ...]
    VARIANTS=default python3 experiments/dgrad_variants.py 30b
    SCRIPT=experiments/dgrad_variants.py KERNEL=<regex of the kernel's name> VARIANTS=default \
        bash experiments/ncu_stalls.sh  # where its warps stall

Each variant's outputs are checked against the first one's (relative Frobenius error of da) so a
fast but wrong variant shows up as such.
"""

import os
import sys

import torch

from torchtitan_megamoe.ops.hopper.cuda.dgrad2_swiglu import dgrad2_swiglu_sm90
from torchtitan_megamoe.ops.hopper.cuda.gemm_rows import gemm_rows_nmajor_sm90
from torchtitan_megamoe.ops.hopper.kernels.grouped_mm import dgrad2_swiglu_grouped_mm, gather_rows
from torchtitan_megamoe.timing import median_ms

from routing import variant_setup  # experiments/routing.py

def main(shape_name: str) -> None:
    D, H, E, K, T, plan = variant_setup(shape_name)
    dy = torch.randn(T, D, device="cuda").bfloat16()
    w2 = (torch.randn(E, D, H, device="cuda") / D**0.5).bfloat16()
    a = torch.randn(plan.max_rows, 2 * H, device="cuda").bfloat16()
    a[plan.row_slot < 0] = 0
    tw = torch.rand(T, K, device="cuda")
    used = int(plan.num_rows_used)
    flops = 2 * T * K * D * H
    dy_rows = gather_rows(dy, plan)
    dh = torch.empty(plan.max_rows, H, device="cuda", dtype=torch.bfloat16)
    runs = {
        "two_step_sm90": lambda: dgrad2_swiglu_grouped_mm(dy, a, tw, w2, plan, dy_rows=dy_rows,
                                                        sm90=True)[0],
        "part_gather_dy": lambda: gather_rows(dy, plan, out=dy_rows),
        "part_dh_gemm_sm90": lambda: gemm_rows_nmajor_sm90(dy_rows, (w2,), plan, dh),
        "default": lambda: dgrad2_swiglu_sm90(dy, a, tw, w2, plan)[0],
    }
    # what the tuner times: the dy rows stored for dw2 as well
    runs["default_storing_dy_rows"] = lambda: dgrad2_swiglu_sm90(dy, a, tw, w2, plan,
                                                                   dy_rows=dy_rows)[0]
    only = os.environ.get("VARIANTS")
    ncu = os.environ.get("NCU") == "1"
    ref = None
    for name, fn in runs.items():
        if only and name not in only.split(",") and not (name.startswith("two_step") and not ncu):
            continue
        if ncu:  # under ncu (experiments/ncu_stalls.sh): a warm-up and one profiled launch each
            fn()
            fn()
            torch.cuda.synchronize()
            print(f"{shape_name} {name}: launched", flush=True)
            continue
        ms = median_ms(fn, 10, 2)
        out = fn()
        note = ""
        if not name.startswith("part_"):
            da = out[:used].double()
            if ref is None:
                ref = da
            else:
                note = f", da rel err vs {next(iter(runs))} {((da - ref).norm() / ref.norm()).item():.1e}"
        print(f"{shape_name} {name}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s){note}",
              flush=True)


if __name__ == "__main__":
    for s in sys.argv[1:] or ["30b"]:
        main(s)
