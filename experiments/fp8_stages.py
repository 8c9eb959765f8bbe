"""Per-stage GPU times of the FP8 hopper path at the Qwen3 shapes, next to the whole op in
bf16 / fp8 / fp8_bwd (the backend's forward, forward + backward, as the op runs them):
CUDA-event medians after warm-up.

    python experiments/fp8_stages.py [--tokens 16384] [--shapes 30B,235B]
"""

import argparse

import torch

from torchtitan_megamoe.ops import hopper
from torchtitan_megamoe.ops.hopper import tune
from torchtitan_megamoe.ops.hopper.fp8_backward import dgrad1_groups
from torchtitan_megamoe.ops.hopper.fp8_weights import forward_weights, w2_transposed, w13_transposed
from torchtitan_megamoe.ops.hopper.heuristics import FP8_BLOCK_M
from torchtitan_megamoe.ops.hopper.kernels.fp8_gemm import (
    fp8_dgrad2_swiglu, fp8_gemm1_swiglu, fp8_gemm_rows,
)
from torchtitan_megamoe.ops.hopper.kernels.fp8_quant import quant_rows, quant_rows_t
from torchtitan_megamoe.ops.hopper.kernels.fp8_wgrad import fp8_wgrad
from torchtitan_megamoe.ops.hopper.kernels.wgrad import longest_first
from torchtitan_megamoe.ops.hopper.plan import build_plan
from torchtitan_megamoe.ops.hopper.tune import bucket
from torchtitan_megamoe.ops.options import MegaMoEOptions
from torchtitan_megamoe.timing import median_ms

SHAPES = {"30B": (2048, 768), "235B": (4096, 1536)}


def grouped_dgrad1(daq, das, w1, w3, plan):
    E, H, D = w1.shape
    out = torch.empty((plan.max_rows, D), dtype=torch.bfloat16, device=daq.device)
    for lo, hi in dgrad1_groups(E, H, D, plan.max_rows, weight_cache=False):
        t = w13_transposed(w1, w3, lo, hi)
        fp8_gemm_rows(daq, das, t.q, t.s, plan, torch.bfloat16, expert_base=lo, out=out,
                      stage="fp8_dgrad1")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384, help="tokens of the layer")
    p.add_argument("--shapes", default="30B,235B", help="comma list of: 30B, 235B")
    args = p.parse_args()
    for name in args.shapes.split(","):
        D, H = SHAPES[name]
        T, K, E = args.tokens, 8, 128
        torch.manual_seed(0)
        dev = "cuda"
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
        scores = torch.randn(T, E, device=dev).softmax(-1)
        tw, ids = scores.topk(K, dim=-1)
        w1 = (torch.randn(E, H, D, device=dev) * D ** -0.5).bfloat16()
        w3 = (torch.randn(E, H, D, device=dev) * D ** -0.5).bfloat16()
        w2 = (torch.randn(E, D, H, device=dev) * H ** -0.5).bfloat16()
        g = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
        plan = build_plan(ids, E, FP8_BLOCK_M)
        xq, xs = quant_rows(x)
        wq = forward_weights(w1, w2, w3)
        w2t, w13t = w2_transposed(w2), w13_transposed(w1, w3)
        hq, hs, a = fp8_gemm1_swiglu(xq, xs, wq.w1q, wq.w1s, wq.w3q, wq.w3s, plan, save_a=True)
        gq, gs = quant_rows(g)
        res = fp8_dgrad2_swiglu(gq, gs, w2t.q, w2t.s, a, tw, plan)
        daq, das, daTq, daTs, hTq, hTs, part = res
        order = longest_first(plan)
        dyT = quant_rows_t(g, plan, gather=True, row_weight=tw.reshape(-1))
        xT = quant_rows_t(x, plan, gather=True)
        stages = {
            "plan": lambda: build_plan(ids, E, FP8_BLOCK_M),
            "quant x rows": lambda: quant_rows(x),
            "quant weights fwd": lambda: forward_weights(w1, w2, w3),
            "quant weights bwd": lambda: (w2_transposed(w2), w13_transposed(w1, w3)),
            "fp8_gemm1_swiglu (save a)": lambda: fp8_gemm1_swiglu(
                xq, xs, wq.w1q, wq.w1s, wq.w3q, wq.w3s, plan, save_a=True),
            "fp8_gemm2": lambda: fp8_gemm_rows(hq, hs, wq.w2q, wq.w2s, plan, torch.bfloat16),
            "fp8_dgrad2_swiglu": lambda: fp8_dgrad2_swiglu(gq, gs, w2t.q, w2t.s, a, tw, plan),
            "quant dy^T": lambda: quant_rows_t(g, plan, gather=True, row_weight=tw.reshape(-1)),
            "quant x^T": lambda: quant_rows_t(x, plan, gather=True),
            "fp8_wgrad dw2": lambda: fp8_wgrad(*dyT, hTq, hTs, plan, torch.empty_like(w2), order),
            "fp8_wgrad dw1 + dw3": lambda: [fp8_wgrad(daTq[sl], daTs[sl], *xT, plan, torch.empty_like(w1),
                                            order) for sl in (slice(0, H), slice(H, 2 * H))],
            "fp8_dgrad1": lambda: fp8_gemm_rows(daq, das, w13t.q, w13t.s, plan, torch.bfloat16,
                                                stage="fp8_dgrad1"),
            # what the backward runs without the weight cache: per group of experts, its
            # transposed [w1 | w3] copy quantized, then its rows
            "fp8_dgrad1 by groups + quant": lambda: grouped_dgrad1(daq, das, w1, w3, plan),
        }
        flop_row = 2 * D * H
        rows = T * K
        print(f"\n== {name}: T={T} D={D} H={H} (GEMM FLOP per row-matrix: {flop_row})")
        for label, fn in stages.items():
            ms = median_ms(fn, warmup=3, iters=20)
            print(f"  {label:28s} {ms:8.3f} ms")
        for prec in ("bf16", "fp8", "fp8_bwd", "fp8 cached", "fp8_bwd cached"):
            cached = prec.endswith("cached")
            prec = prec.split()[0]
            opts = MegaMoEOptions(backend="hopper", precision=prec, fp8_weight_cache=cached)
            args = (x, ids, tw, w1, w2, w3, None, opts)

            def fwd():
                return hopper.forward(*args)

            def fwdbwd():
                _, saved = hopper.forward(*args, save=True)
                hopper.backward(g, *args, saved=saved)

            f = median_ms(fwd, warmup=3, iters=20)
            fb = median_ms(fwdbwd, warmup=3, iters=20)
            tf_f = 3 * rows * flop_row / f / 1e9
            tf_fb = 9 * rows * flop_row / fb / 1e9
            prec = prec + (" cached" if cached else "")
            print(f"  op {prec:15s} fwd {f:7.3f} ms ({tf_f:5.0f} TFLOP/s)   fwd+bwd {fb:7.3f} ms "
                  f"({tf_fb:5.0f} TFLOP/s)")
        for (kname, key), timings in tune.TIMINGS.items():
            if kname.startswith("fp8") and key[0] == bucket(plan.max_rows):
                best = sorted(timings, key=lambda t: t[1])[:3]
                print(f"  tuner {kname} {key[1:4]}: " + "; ".join(
                    f"{ {k: v for k, v in c.items() if k != 'group_m'} } {ms:.3f}"
                    for c, ms, *_ in best))


if __name__ == "__main__":
    main()
