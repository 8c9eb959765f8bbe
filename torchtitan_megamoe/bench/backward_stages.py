"""Per-stage timing of the hopper backend's backward on the GPU (docs/PERF.md, Per-stage breakdown).

    python -m torchtitan_megamoe.bench.backward_stages [--tokens 16384] [--shapes 30b,235b]

Runs the whole backward with each side forced (MEGAMOE_BWD_IMPL = triton, cublas) and with the
tuner's per-stage pick (auto), then times every stage of BOTH sides with CUDA events (median of
--iters) and prints one JSON line per shape: milliseconds and achieved TFLOP/s per stage, each
total, the peak memory each call allocates on top of its inputs, and the tuner's candidate
timings of the auto run (which side it picked per stage).

The backward runs as training runs it: on what forward_ep1(..., save=True) saved (GEMM 1's
pre-activations and the packed plan), so kernel A "A_dgrad_l2_swiglu" is a dgrad GEMM
(2*T*K*D*H flops) and the totals include no plan rebuild. For comparison "total_recompute_ms"
is the tuner's pick with saved=None (what save_activations="never" runs: the plan and GEMM 1
with its a store again, then the same stages; "plan" and "fwd_gemm1_save_a" time those two);
"fwd_gemm1" / "fwd_gemm1_save_a" time the forward's GEMM 1 + SwiGLU without / with the extra
store of a (the forward's cost of saving).

Stage keys: Triton kernels "B_dw2", "B_dw1", "B_dw3", "B_dw13" (dw1 + dw3), "C_dgrad_l1";
their _grouped_mm counterparts "B_dw2_cublas", "B_dw13_cublas", "C_dgrad_l1_cublas" (each with
its gathers / copies, as the tuner times them), and those parts alone: "gather_dy", "gather_x",
"gemm_dw2_cublas", "gemm_dw13_cublas", "gemm_l1_cublas" (two GEMMs + the bf16 add),
"rows_to_slots".
"""

import argparse
import json
import os

import torch

from torchtitan_megamoe.ops.hopper import tune
from torchtitan_megamoe.ops.hopper.cuda.dgrad2_swiglu import dgrad2_swiglu_sm90
from torchtitan_megamoe.ops.hopper.cuda.gemm_rows import gemm_rows_nmajor_sm90
from torchtitan_megamoe.ops.hopper.cuda.wgrad import wgrad_dw2_sm90, wgrad_dw13_sm90
from torchtitan_megamoe.ops.hopper.bf16_backward import (
    A_CANDIDATES, B_CANDIDATES, BLOCK_M, C_CANDIDATES, C_SM90, a_sm90_fits,
    a_sm90_fused_offered, b_sm90_fits, backward_local, c_sm90_fits,
)
from torchtitan_megamoe.ops.hopper.kernels.wgrad import longest_first
from torchtitan_megamoe.ops.hopper.kernels.bwd_combine import bwd_combine
from torchtitan_megamoe.ops.hopper.kernels.grouped_mm import (
    IMPL_ENV, dgrad1_grouped_mm, dgrad2_swiglu_grouped_mm, gather_rows, segment_ends,
    wgrad_dw13_grouped_mm, wgrad_dw2_grouped_mm,
)
from torchtitan_megamoe.ops.hopper.kernels.dgrad1 import dgrad1
from torchtitan_megamoe.ops.hopper.kernels.dgrad2_swiglu import dgrad2_swiglu
from torchtitan_megamoe.ops.hopper.kernels.wgrad import wgrad
from torchtitan_megamoe.ops.hopper.bf16_forward import forward_ep1, interpret_defaults
from torchtitan_megamoe.ops.hopper.kernels.gemm1_swiglu import gemm1_swiglu
from torchtitan_megamoe.ops.hopper.plan import build_plan
from torchtitan_megamoe.ops.hopper.tune import bucket, pick_config
from torchtitan_megamoe.timing import median_ms

SHAPES = {"30b": (2048, 768, 128, 8), "235b": (4096, 1536, 128, 8)}
SIDES = ("triton", "cublas", "auto")


def _chosen(name, key, cands):
    """The config backward_local's tuning picked for this key (it ran first, so it is cached)."""
    return pick_config(name, key, cands, lambda cfg: None)


def _with_side(side, fn):
    old = os.environ.get(IMPL_ENV)
    os.environ[IMPL_ENV] = side
    try:
        return fn()
    finally:
        if old is None:
            del os.environ[IMPL_ENV]
        else:
            os.environ[IMPL_ENV] = old


def _whole(side, args, iters, saved=None):
    """(ms, peak extra GiB) of backward_local(saved=saved) with MEGAMOE_BWD_IMPL=side, after one
    tuning call."""
    def run():
        backward_local(*args, saved=saved)  # tune + compile
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        ms = median_ms(lambda: backward_local(*args, saved=saved), iters)
        return ms, (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else 0.0

    return _with_side(side, run)


TUNED_STAGES = ("bwd_dgrad_l2_swiglu", "bwd_wgrad_dw2", "bwd_wgrad_dw13", "bwd_dgrad_l1")
"""Backward stages with a Triton and a cuBLAS side, as the tuner names them."""


def _cfg_name(cfg):
    return cfg["impl"] if cfg.get("impl") in ("cublas", "sm90") else json.dumps(cfg, sort_keys=True)


def bench_shape(name, tokens, iters, shape=None, device="cuda", block_m=BLOCK_M,
                candidates=(A_CANDIDATES, B_CANDIDATES, C_CANDIDATES)):
    """``candidates``: the lists backward_local tunes over (A, B, C), to read its picks."""
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
    args = (dy, x, ids, tw, w1, w2, w3)
    _, saved = forward_ep1(x, ids, tw, w1, w2, w3, block_m=block_m, save=True)
    a_saved = saved[0]

    res = {"shape": name, "tokens": tokens}
    nkdh = tokens * K * D * H
    for side in SIDES:
        ms, peak = _whole(side, args, iters, saved=saved)
        sfx = "" if side == "triton" else f"_{side}"
        res[f"total{sfx}_ms"] = ms
        res[f"total{sfx}_tflops"] = 12 * nkdh / ms / 1e9  # GEMM 1 is not recomputed
        res[f"peak_extra{sfx}_gib"] = peak
    ms, peak = _whole("auto", args, iters)
    res["total_recompute_ms"] = ms
    res["total_recompute_tflops"] = 16 * nkdh / ms / 1e9
    res["peak_extra_recompute_gib"] = peak
    res["saved_gib"] = sum(t.numel() * t.element_size() for t in saved) / 2**30

    plan = build_plan(ids, E, block_m)
    R = plan.max_rows
    base_key = (bucket(R), D, H, E, block_m)
    key = base_key + ("triton",)
    cfg_a = _chosen("bwd_dgrad_l2_swiglu", key, a_cands)
    cfg_w2 = _chosen("bwd_wgrad_dw2", key, b_cands)
    cfg_w13 = _chosen("bwd_wgrad_dw13", key, b_cands)
    cfg_c = _chosen("bwd_dgrad_l1", key, c_cands)
    res["configs"] = {"A": cfg_a, "dw2": cfg_w2, "dw13": cfg_w13,
                      "C": cfg_c}
    # What the auto run's tuner measured per stage (ms per candidate) and picked.
    auto_key = base_key + ("auto",)
    res["tuner_auto"] = {
        stage: {_cfg_name(c): ms for c, ms, _ in tune.TIMINGS.get((stage, auto_key), [])}
        for stage in TUNED_STAGES
    }
    res["auto_picks"] = {
        stage: _cfg_name(tune._CHOSEN[(stage, auto_key)])
        for stage in TUNED_STAGES
        if (stage, auto_key) in tune._CHOSEN
    }

    da, hw, part = dgrad2_swiglu(dy, a_saved, tw, w2, plan, **cfg_a)
    g1_cfg = interpret_defaults(block_m, None, None)[1]  # None on the GPU: the tuner's pick
    dw = torch.empty_like(w1)
    dw_b = torch.empty_like(w3)
    dw2 = torch.empty_like(w2)
    dx_slot = dgrad1(da, w1, w3, plan, **cfg_c)
    ends = segment_ends(plan)
    x_rows, dy_rows = gather_rows(x, plan), gather_rows(dy, plan)
    da1, da3 = da[:, :H], da[:, H:]

    def gemm_l1():
        out = torch._grouped_mm(da1, w1, offs=ends)
        out += torch._grouped_mm(da3, w3, offs=ends)
        return out

    dx_rows = gemm_l1()

    def dw13_triton():
        wgrad(da1, x, dw, plan, a_gather=False, b_gather=True, **cfg_w13)
        wgrad(da3, x, dw_b, plan, a_gather=False, b_gather=True, **cfg_w13)

    def kernel_b(a, b, out, a_gather, cfg):
        return lambda: wgrad(a, b, out, plan, a_gather=a_gather, b_gather=not a_gather, **cfg)

    stages = {
        "fwd_gemm1": (lambda: gemm1_swiglu(x, w1, w3, plan, config=g1_cfg), 4 * nkdh),
        "fwd_gemm1_save_a": (lambda: gemm1_swiglu(x, w1, w3, plan, config=g1_cfg, save_a=True),
                             4 * nkdh),
        "plan": (lambda: build_plan(ids, E, block_m), 0),
        "A_dgrad_l2_swiglu": (lambda: dgrad2_swiglu(dy, a_saved, tw, w2, plan, **cfg_a),
                              2 * nkdh),
        "A_dgrad_l2_swiglu_cublas": (
            lambda: dgrad2_swiglu_grouped_mm(dy, a_saved, tw, w2, plan, dy_rows=dy_rows), 2 * nkdh),
        "B_dw2": (kernel_b(dy, hw, dw2, True, cfg_w2), 2 * nkdh),
        "B_dw1": (kernel_b(da1, x, dw, False, cfg_w13), 2 * nkdh),
        "B_dw3": (kernel_b(da3, x, dw, False, cfg_w13), 2 * nkdh),
        "B_dw13": (dw13_triton, 4 * nkdh),
        "B_dw2_cublas": (lambda: wgrad_dw2_grouped_mm(dy, hw, plan, dw2), 2 * nkdh),
        "B_dw13_cublas": (lambda: wgrad_dw13_grouped_mm(da, x, plan, dw, dw_b), 4 * nkdh),
        "gather_dy": (lambda: gather_rows(dy, plan, out=dy_rows), 0),
        "gather_x": (lambda: gather_rows(x, plan, out=x_rows), 0),
        "gemm_dw2_cublas": (lambda: torch._grouped_mm(dy_rows.t(), hw, offs=ends), 2 * nkdh),
        "gemm_dw13_cublas": (lambda: (torch._grouped_mm(da1.t(), x_rows, offs=ends),
                                      torch._grouped_mm(da3.t(), x_rows, offs=ends)), 4 * nkdh),
        "C_dgrad_l1": (lambda: dgrad1(da, w1, w3, plan, out=dx_slot, **cfg_c), 4 * nkdh),
        "C_dgrad_l1_cublas": (lambda: dgrad1_grouped_mm(da, w1, w3, plan, out=dx_slot), 4 * nkdh),
        "gemm_l1_cublas": (gemm_l1, 4 * nkdh),
        "rows_to_slots": (lambda: torch.index_select(dx_rows, 0, plan.slot_row.clamp(min=0),
                                                     out=dx_slot), 0),
        "combine": (lambda: bwd_combine(dx_slot, part, plan, dx_dtype=x.dtype,
                                        dtw_dtype=tw.dtype), 0),
    }
    if block_m == BLOCK_M and c_sm90_fits(da, w1):
        dx_rows_sm90 = torch.empty(R, D, dtype=x.dtype, device=x.device)
        stages["C_dgrad_l1_sm90"] = (
            lambda: gemm_rows_nmajor_sm90(da, (w1, w3), plan, dx_rows_sm90), 4 * nkdh)
        stages["combine_rows"] = (
            lambda: bwd_combine(dx_rows_sm90, part, plan, dx_dtype=x.dtype, dtw_dtype=tw.dtype,
                                rows=True), 0)
    if block_m == BLOCK_M and a_sm90_fits(x, w2):
        stages["A_dgrad_l2_swiglu_sm90"] = (
            lambda: dgrad2_swiglu_grouped_mm(dy, a_saved, tw, w2, plan, dy_rows=dy_rows, sm90=True),
            2 * nkdh)
    if block_m == BLOCK_M and a_sm90_fused_offered(x, w2):
        # with the dy rows stored for dw2, as the tuner times it
        stages["A_dgrad_l2_swiglu_sm90_fused"] = (
            lambda: dgrad2_swiglu_sm90(dy, a_saved, tw, w2, plan, dy_rows=dy_rows), 2 * nkdh)
    if block_m == BLOCK_M and b_sm90_fits(x, (w1, w2, w3)):
        order = longest_first(plan)
        stages["B_dw2_sm90"] = (lambda: wgrad_dw2_sm90(dy, hw, plan, dw2, order), 2 * nkdh)
        stages["B_dw13_sm90"] = (lambda: wgrad_dw13_sm90(da, x, plan, dw, dw_b, order), 4 * nkdh)
        # the same kernels on rows gathered first (the gathers included, as the tuner times it)
        stages["B_dw2_sm90_pre"] = (
            lambda: wgrad_dw2_sm90(gather_rows(dy, plan, out=dy_rows), hw, plan, dw2, order,
                                   pre_gathered=True), 2 * nkdh)
        stages["B_dw13_sm90_pre"] = (
            lambda: wgrad_dw13_sm90(da, gather_rows(x, plan, out=x_rows), plan, dw, dw_b, order,
                                    pre_gathered=True), 4 * nkdh)
    for stage, (fn, flops) in stages.items():
        ms = median_ms(fn, iters)
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
