"""The backward's per-stage benchmark runs end to end (tiny shape under the interpreter)."""

import torch

from torchtitan_megamoe.bench.backward_stages import bench_shape


def test_bwd_bench_reports_every_stage():
    if torch.cuda.is_available():
        res = bench_shape("30b", 2048, 2)
    else:
        res = bench_shape("tiny", 9, 1, shape=(32, 16, 3, 2), device="cpu")
    for stage in ("plan", "dgrad2_swiglu", "wgrad_dw2", "wgrad_dw1", "wgrad_dw3", "dgrad1",
                  "bwd_combine", "wgrad_dw2_grouped_mm", "wgrad_dw13_grouped_mm",
                  "dgrad1_grouped_mm", "gather_x", "gather_dy", "gemm1_swiglu",
                  "gemm1_swiglu_save_a"):
        assert res[f"{stage}_ms"] > 0, stage
    # every implementation's whole backward on the saved tensors, and the recompute path
    for side in ("", "_grouped_mm", "_auto", "_recompute"):
        assert res[f"total{side}_ms"] > 0, side
    assert res["saved_gib"] > 0
    assert set(res["configs"]) == {"dgrad2_swiglu", "wgrad_dw2", "wgrad_dw13", "dgrad1"}
    assert res["configs"]["dgrad2_swiglu"]
