"""The backward's per-stage benchmark runs end to end (tiny shape under the interpreter)."""

import torch

from torchtitan_megamoe.ops.hopper.bf16_backward import (
    INTERPRET_A, INTERPRET_B, INTERPRET_BLOCK_M, INTERPRET_C,
)
from torchtitan_megamoe.bench.backward_stages import bench_shape


def test_bwd_bench_reports_every_stage():
    if torch.cuda.is_available():
        res = bench_shape("30b", 2048, 2)
    else:
        res = bench_shape("tiny", 9, 1, shape=(32, 16, 3, 2), device="cpu",
                          block_m=INTERPRET_BLOCK_M,
                          candidates=([INTERPRET_A], [INTERPRET_B], [INTERPRET_C]))
    for stage in ("plan", "A_dgrad_l2_swiglu", "B_dw2", "B_dw1",
                  "B_dw3", "C_dgrad_l1", "combine", "B_dw2_cublas", "B_dw13_cublas",
                  "C_dgrad_l1_cublas", "gather_x", "gather_dy", "fwd_gemm1", "fwd_gemm1_save_a"):
        assert res[f"{stage}_ms"] > 0, stage
    # every implementation's whole backward on the saved tensors, and the recompute path
    for side in ("", "_cublas", "_auto", "_recompute"):
        assert res[f"total{side}_ms"] > 0, side
    assert res["saved_gib"] > 0
    assert res["configs"]["A"]
