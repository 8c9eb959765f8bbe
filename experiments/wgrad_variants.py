"""The sm90 weight-gradient kernels (csrc/grouped_gemm_sm90.cu, WGRAD mode) at one Qwen3 shape,
with the token rows gathered inside the kernel ("default") or gathered first ("pre_gathered",
the tuner's candidate), next to the _grouped_mm side (gathers included), CUDA-event medians of
10; NCU=1 launches each once after a warm-up instead, for Nsight Compute:

    python3 experiments/wgrad_variants.py 30b
    # the dw1|dw3 launch of the default variant (launches: dw2, dw1|dw3, dw2, dw1|dw3)
    NCU=1 VARIANTS=default ncu --clock-control none --kernel-name grouped_gemm_kernel \
        --launch-skip 3 --launch-count 1 --import-source no --section SpeedOfLight \
        --section WarpStateStats --section SourceCounters -f -o $OUT/dw13 \
        python3 experiments/wgrad_variants.py 30b
    # then, as experiments/ncu_stalls.sh does: ncu -i $OUT/dw13.ncu-rep --page source --csv
    # --print-source sass > dw13.sass.csv; python3 experiments/ncu_stalls_summary.py dw13.sass.csv
"""

import os
import sys

import torch

from torchtitan_megamoe.ops.hopper.cuda.wgrad import wgrad_dw2_sm90, wgrad_dw13_sm90
from torchtitan_megamoe.ops.hopper.kernels.grouped_mm import gather_rows, wgrad_dw13_grouped_mm, wgrad_dw2_grouped_mm
from torchtitan_megamoe.ops.hopper.kernels.wgrad import longest_first
from torchtitan_megamoe.timing import median_ms

from routing import variant_setup  # experiments/routing.py

def main(shape_name: str = "30b") -> None:
    D, H, E, K, T, plan = variant_setup(shape_name)
    dy = torch.randn(T, D, device="cuda").bfloat16()
    x = torch.randn(T, D, device="cuda").bfloat16()
    hw = torch.randn(plan.max_rows, H, device="cuda").bfloat16()
    da = torch.randn(plan.max_rows, 2 * H, device="cuda").bfloat16()
    hw[plan.row_slot < 0] = 0
    da[plan.row_slot < 0] = 0
    w2 = torch.empty(E, D, H, device="cuda", dtype=torch.bfloat16)
    w1 = torch.empty(E, H, D, device="cuda", dtype=torch.bfloat16)
    w3 = torch.empty_like(w1)
    order = longest_first(plan)
    runs = {"cublas": (lambda: wgrad_dw2_grouped_mm(dy, hw, plan, w2),
                       lambda: wgrad_dw13_grouped_mm(da, x, plan, w1, w3))}
    runs["default"] = (lambda: wgrad_dw2_sm90(dy, hw, plan, w2, order),
                       lambda: wgrad_dw13_sm90(da, x, plan, w1, w3, order))
    dy_rows, x_rows = gather_rows(dy, plan), gather_rows(x, plan)
    runs["pre_gathered"] = (  # the rows gathered first (included in the time), then TMA only
        lambda: wgrad_dw2_sm90(gather_rows(dy, plan, out=dy_rows), hw, plan, w2, order,
                               pre_gathered=True),
        lambda: wgrad_dw13_sm90(da, gather_rows(x, plan, out=x_rows), plan, w1, w3, order,
                                pre_gathered=True))
    # every padding row in the K loop (plan.count = the padded segments), as before the kernels
    # stopped after each expert's last real 64-row step
    full = type(plan)(**{**plan.__dict__, "count": plan.seg_start.diff().contiguous()})
    runs["pre_gathered_all_rows"] = (
        lambda: wgrad_dw2_sm90(gather_rows(dy, plan, out=dy_rows), hw, full, w2, order,
                               pre_gathered=True),
        lambda: wgrad_dw13_sm90(da, gather_rows(x, plan, out=x_rows), full, w1, w3, order,
                                pre_gathered=True))
    only = os.environ.get("VARIANTS")
    flops = 2 * plan.num_tokens * K * D * H  # per weight: dw2 once, dw1|dw3 twice
    for name, (dw2, dw13) in runs.items():
        if only and name not in only.split(","):
            continue
        if os.environ.get("NCU") == "1":
            for fn in (dw2, dw13, dw2, dw13):
                fn()
            torch.cuda.synchronize()
            print(f"{shape_name} {name}: launched", flush=True)
            continue
        t2, t13 = median_ms(dw2, 10, 2), median_ms(dw13, 10, 2)
        print(f"{shape_name} {name}: dw2 {t2:.3f} ms ({flops / t2 / 1e9:.0f} TFLOP/s), "
              f"dw1|dw3 {t13:.3f} ms ({2 * flops / t13 / 1e9:.0f})", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
