"""Per-stage timing of the hopper backend's EP=1 bf16 backward on the GPU.

    python -m torchtitan_megamoe.bench.backward_stages [--tokens 16384] [--shapes 30b,235b]

Runs the whole backward with each side forced (MEGAMOE_BWD_IMPL = triton, cublas: the keys
total_ms, total_grouped_mm_ms) and with the tuner's per-stage pick (auto: total_auto_ms), then times every side of every stage with CUDA events (median of
--iters) and prints one JSON line per shape: milliseconds and achieved TFLOP/s per stage, each
total, the peak memory each call allocates on top of its inputs, and the tuner's candidate
timings of the auto run (which side it picked per stage).

The backward runs as training runs it: on what the forward saved (GEMM 1's pre-activations and
the packed plan), so dgrad2_swiglu is one dgrad GEMM (2*T*K*D*H flops) and the totals include
no plan rebuild. For comparison "total_recompute_ms" is the tuner's pick with nothing saved
(save_activations="never": the plan and GEMM 1 with its a store again, then the same stages;
"plan" and "gemm1_swiglu_save_a" time those two); "gemm1_swiglu" / "gemm1_swiglu_save_a" time
the forward's GEMM 1 + SwiGLU without / with the extra store of a (the forward's cost of saving).

Stage keys (ops/hopper/stages.backward_stages): the glossary's stage names, each side with its
suffix (_grouped_mm, _sm90, _sm90_fused, _sm90_pre_gathered; Triton: none), the Triton
wgrad_dw13 also per weight (wgrad_dw1, wgrad_dw3), the grouped_mm sides' parts alone
(gather_dy, gather_x, *_grouped_mm_gemm, rows_to_slots).
"""

import argparse
import json
import os

import torch

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops.hopper import stages as hopper
from torchtitan_megamoe.timing import median_ms

SHAPES = {"30b": (2048, 768, 128, 8), "235b": (4096, 1536, 128, 8)}
SIDES = {"triton": "", "cublas": "_grouped_mm", "auto": "_auto"}
"""MEGAMOE_BWD_IMPL values timed whole -> their suffix in the result keys (total*_ms, ...)."""


def _with_side(side, fn):
    old = os.environ.get(settings.BWD_IMPL)
    os.environ[settings.BWD_IMPL] = side
    try:
        return fn()
    finally:
        if old is None:
            del os.environ[settings.BWD_IMPL]
        else:
            os.environ[settings.BWD_IMPL] = old


def _whole(side, inputs, iters, saved=True):
    """(ms, peak extra GiB) of the whole backward with MEGAMOE_BWD_IMPL=side, after one
    tuning call."""
    def run():
        hopper.backward(inputs, saved)  # tune + compile
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        ms = median_ms(lambda: hopper.backward(inputs, saved), iters)
        return ms, (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else 0.0

    return _with_side(side, run)


def _cfg_name(cfg):
    return cfg["impl"] if cfg.get("impl") in ("cublas", "sm90") else json.dumps(cfg, sort_keys=True)


def bench_shape(name, tokens, iters, shape=None, device="cuda"):
    """One shape's JSON line (see the module docstring); ``shape``: (D, H, E, K) in place of
    SHAPES[name]. Under the CPU interpreter the stages run with its small tiles."""
    D, H, E, K = shape or SHAPES[name]
    dev = device
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, D, device=dev, generator=g).bfloat16()
    dy = torch.randn(tokens, D, device=dev, generator=g).bfloat16()
    w1 = (torch.randn(E, H, D, device=dev, generator=g) / D**0.5).bfloat16()
    w3 = (torch.randn(E, H, D, device=dev, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, H, device=dev, generator=g) / H**0.5).bfloat16()
    probs = torch.softmax(torch.randn(E, device=dev, generator=g), 0)
    ids = torch.multinomial(probs.expand(tokens, E), K, generator=g)
    tw = torch.softmax(torch.randn(tokens, K, device=dev, generator=g), -1)
    inputs = hopper.prepare_backward(dy, x, ids, tw, w1, w2, w3)

    res = {"shape": name, "tokens": tokens}
    nkdh = tokens * K * D * H
    for side, sfx in SIDES.items():
        ms, peak = _whole(side, inputs, iters)
        res[f"total{sfx}_ms"] = ms
        res[f"total{sfx}_tflops"] = 12 * nkdh / ms / 1e9  # GEMM 1 is not recomputed
        res[f"peak_extra{sfx}_gib"] = peak
    ms, peak = _whole("auto", inputs, iters, saved=False)
    res["total_recompute_ms"] = ms
    res["total_recompute_tflops"] = 16 * nkdh / ms / 1e9
    res["peak_extra_recompute_gib"] = peak
    res["saved_gib"] = sum(t.numel() * t.element_size() for t in inputs.saved) / 2**30

    picks = hopper.backward_picks(inputs, "triton")
    res["configs"] = {stage: cfg.as_dict() for stage, cfg in picks.items()}
    # What the auto run's tuner measured per stage (ms per candidate) and picked.
    auto_key = hopper.backward_key(inputs, "auto")
    timings = hopper.tuner_timings()
    res["tuner_auto"] = {
        stage: {_cfg_name(c): ms for c, ms, _ in timings.get((stage, auto_key), [])}
        for stage in hopper.TUNED_BACKWARD_STAGES
    }
    res["auto_picks"] = {
        stage: _cfg_name(hopper.tuner_pick(stage, auto_key))
        for stage in hopper.TUNED_BACKWARD_STAGES
        if hopper.tuner_pick(stage, auto_key) is not None
    }
    for stage, st in hopper.backward_stages(inputs, picks).items():
        ms = median_ms(st.run, iters)
        res[f"{stage}_ms"] = ms
        if st.flops:
            res[f"{stage}_tflops"] = st.flops / ms / 1e9
    return res


def main():
    p = argparse.ArgumentParser(prog="python -m torchtitan_megamoe.bench.backward_stages",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384, help="tokens of the layer")
    p.add_argument("--shapes", default="30b,235b", help="comma list of: " + ",".join(SHAPES))
    p.add_argument("--iters", type=int, default=10, help="timed calls per stage (median)")
    args = p.parse_args()
    for name in args.shapes.split(","):
        print(json.dumps(bench_shape(name, args.tokens, args.iters)), flush=True)


if __name__ == "__main__":
    main()
