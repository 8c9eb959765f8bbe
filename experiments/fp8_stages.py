"""Per-stage GPU times of the FP8 hopper path at the Qwen3 shapes, with DeepGEMM beside each
FP8 GEMM where it is installed, and the whole op in bf16 / fp8 / fp8_bwd: CUDA-event medians
after warm-up, 16384 tokens, top-8 of 128 experts.

Per FP8 GEMM stage three numbers, in ms with TFLOP/s over the real rows:
    ours      the fastest of our own candidates (Triton, csrc/), their fusions included (each
              candidate's time on the line above the stage's)
    dg side   the DeepGEMM side of the stage as the tuner runs it: DeepGEMM's GEMM plus the
              passes that replace our fusion (row gather, SwiGLU + quantization)
    dg plain  DeepGEMM's GEMM alone on operands prepared beforehand
and "bar": dg plain plus the passes our fusion saves, at their bytes over 4 TB/s; ours within
15% of it is the target. The weight gradients: ours in bf16 (each side the tuner offers,
torch's grouped GEMM included), ours in FP8, DeepGEMM's K-grouped FP8 GEMM.

The compass (``--target 30B=5.5,235B=21``: the fp8 fwd+bwd each shape should take, ms): the
rate each GEMM stage of the default fp8 path runs at now and the rate it needs, with every
other part of the op (router, plan, quantization, SwiGLU passes, combines) kept as it is.

    python experiments/fp8_stages.py [--tokens 16384] [--shapes 30B,235B] [--no-op]
        [--target SHAPE=MS,...]
"""

import argparse
import os

import torch

from torchtitan_megamoe.ops import hopper
from torchtitan_megamoe.ops.hopper import deepgemm, tune
from torchtitan_megamoe.ops.hopper.bf16_backward import WeightGrads, tuner_key
from torchtitan_megamoe.ops.hopper.cuda.dgrad2_swiglu import fp8_dgrad2_swiglu_rows_sm90
from torchtitan_megamoe.ops.hopper.fp8_weights import (
    forward_weights, make_fp8_weights, w2_transposed, w13_transposed,
)
from torchtitan_megamoe.ops.hopper.tiles import FP8_BLOCK_M
from torchtitan_megamoe.ops.hopper.configs import DeepGemm
from torchtitan_megamoe.ops.hopper.sides.fp8_gemm import STAGES, Shape
from torchtitan_megamoe.ops.hopper.sides.table import available
from torchtitan_megamoe.ops.hopper.sides.fp8_gemm import (
    fp8_dgrad2_swiglu, fp8_gemm1_swiglu, fp8_gemm_rows,
)
from torchtitan_megamoe.ops.hopper.kernels.fp8_quant import (
    FP8, gather_rows, quant_rows, quant_rows_t, swiglu_quant_rows,
)
from torchtitan_megamoe.ops.hopper.sides.fp8_wgrad import fp8_wgrad
from torchtitan_megamoe.ops.hopper.kernels.swiglu_bwd_rows import swiglu_bwd_rows
from torchtitan_megamoe.ops.hopper.kernels.wgrad import longest_first
from torchtitan_megamoe.ops.hopper.plan import build_plan
from torchtitan_megamoe.ops.options import MegaMoEOptions
from torchtitan_megamoe.ops.recipe import PRECISIONS, recipe_named
from torchtitan_megamoe.timing import median_ms

SHAPES = {"30B": (2048, 768), "235B": (4096, 1536)}
HBM = 4e12  # bytes/s: what a saved pass is worth


def ms(fn):
    return median_ms(fn, warmup=3, iters=20)


def best_of_ours(run, epilogue, a, N, K, out, gather):
    """min over our own candidates (DeepGEMM excluded) of run(config)."""
    shape = Shape(epilogue, N, K, FP8_BLOCK_M, out.dtype == torch.bfloat16, gather)
    cands = [c for c in STAGES["fp8_gemm2"].offer(shape, available(a)).candidates
             if c.side != "deepgemm"]
    times = []
    for c in cands:
        try:
            times.append((ms(lambda c=c: run(c)), c))
        except Exception as err:  # a config this shape rejects
            times.append((float("inf"), f"{c}: {err!r}"[:80]))
    # every candidate's time: what a new variant of a kernel family gains
    print("    " + ", ".join(f"{t:.3f} {c.as_dict() if hasattr(c, 'as_dict') else c}"
                             for t, c in sorted(times, key=lambda t: t[0])))
    return min(times, key=lambda t: t[0])


GEMM_ROWS = []
"""(label, flop, ours ms) of the current shape's GEMM stages on the default fp8 path (compass)."""


def compass(gemm_rows, op_ms: float, target_ms: float) -> list[str]:
    """Lines: each GEMM stage's TFLOP/s now and what it needs for the op's fwd+bwd to take
    ``target_ms`` instead of ``op_ms``, the op's other work unchanged (all GEMM stages sped up
    alike)."""
    gemm_ms = sum(t for _, _, t in gemm_rows)
    other = op_ms - gemm_ms
    if target_ms <= other:
        return [f"  compass: the op's non-GEMM work alone ({other:.3f} ms) is over the target "
                f"{target_ms:.3f} ms"]
    scale = gemm_ms / (target_ms - other)
    lines = [f"  compass: fwd+bwd {op_ms:.3f} ms (GEMM stages {gemm_ms:.3f}, other {other:.3f})"
             f" -> target {target_ms:.3f} ms: the GEMM stages x{scale:.2f}"]
    lines += [f"    {label:24s} {flop / t / 1e9:5.0f} -> {scale * flop / t / 1e9:5.0f} TFLOP/s"
              for label, flop, t in gemm_rows]
    return lines


def row(label, flop, ours=None, side=None, plain=None, saved_bytes=0.0, note="",
        default_path=True):
    """One stage's line; ``default_path``: a GEMM stage the default fp8 recipe runs (its time
    is the faster of ours and the DeepGEMM side, as the tuner picks)."""
    if default_path and ours is not None:
        GEMM_ROWS.append((label, flop, min(t for t in (ours, side) if t is not None)))

    def f(t):
        return "      -       " if t is None else f"{t:7.3f} ({flop / t / 1e9:5.0f})"
    bar = None if plain is None else plain + saved_bytes / HBM * 1e3
    ratio = "" if (ours is None or bar is None) else f"  ours/bar {ours / bar:4.2f}"
    print(f"  {label:24s} {f(ours)}  {f(side)}  {f(plain)}  bar {'-' if bar is None else f'{bar:6.3f}'}"
          f"{ratio} {note}")


def k_grouped_fp8(colsT, colsTs, rowsT, rowsTs, plan, out):
    """DeepGEMM's K-grouped FP8 GEMM out[e] = A_e @ B_e^T contracting over expert e's rows,
    A/B given as our transposed [C, R_max] operands (per-128-row scales); each expert's
    columns made contiguous first (not timed)."""
    counts = (plan.seg_start[1:] - plan.seg_start[:-1]).tolist()
    starts = plan.seg_start[:-1].tolist()
    keep = [i for i, c in enumerate(counts) if c]

    def flat(q, s):
        qs = torch.cat([q[:, st:st + c].contiguous().view(-1) for st, c in zip(starts, counts) if c])
        ss = torch.cat([s[:, st // 128:(st + c) // 128].t().contiguous() for st, c in zip(starts, counts) if c])
        return qs, ss

    a, b = flat(colsT, colsTs), flat(rowsT, rowsTs)
    ks = [counts[i] for i in keep]
    layout = torch.tensor(ks, dtype=torch.int32, device=out.device)
    d = out[keep].contiguous()
    c = torch.zeros_like(d, dtype=torch.float32)
    d32 = torch.empty_like(c)

    def run():
        deepgemm._module().k_grouped_fp8_gemm_nt_contiguous(a, b, d32, ks, layout, c)
    return run


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384, help="tokens of the layer")
    p.add_argument("--shapes", default="30B,235B", help="comma list of: 30B, 235B")
    p.add_argument("--no-op", action="store_true", help="skip the whole-op rows")
    p.add_argument("--target", default="", metavar="SHAPE=MS,...",
                   help="fp8 fwd+bwd targets per shape for the compass, e.g. 30B=5.5,235B=21")
    args = p.parse_args()
    targets = {k: float(v) for k, v in (kv.split("=") for kv in args.target.split(",") if kv)}
    dev = "cuda"
    have_dg = deepgemm.available(torch.zeros(1, device=dev))
    print(f"DeepGEMM: {deepgemm.version() if have_dg else 'not installed (its columns stay empty)'}")
    for name in args.shapes.split(","):
        D, H = SHAPES[name]
        T, K, E = args.tokens, 8, 128
        torch.manual_seed(0)
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
        scores = torch.randn(T, E, device=dev).softmax(-1)
        tw, ids = scores.topk(K, dim=-1)
        w1 = (torch.randn(E, H, D, device=dev) * D ** -0.5).bfloat16()
        w3 = (torch.randn(E, H, D, device=dev) * D ** -0.5).bfloat16()
        w2 = (torch.randn(E, D, H, device=dev) * H ** -0.5).bfloat16()
        g = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
        plan = build_plan(ids, E, FP8_BLOCK_M)
        GEMM_ROWS.clear()
        R = plan.max_rows
        rows = T * K
        xq, xs = quant_rows(x)
        gq, gs = quant_rows(g)
        wq = forward_weights(w1, w2, w3)
        w2t, w13t = w2_transposed(w2), w13_transposed(w1, w3)
        hq, hs, a = fp8_gemm1_swiglu(xq, xs, wq.w1q, wq.w1s, wq.w3q, wq.w3s, plan, save_a=True)
        xr, xrs = gather_rows(xq, xs, plan)
        gr, grs = gather_rows(gq, gs, plan)
        dh = fp8_gemm_rows(gq, gs, w2t.q, w2t.s, plan, torch.bfloat16, gather=True,
                           stage="fp8_dgrad2")
        da, hw, part, daq, das = swiglu_bwd_rows(dh, a, tw, plan, quant=True)
        f1, f2 = 2 * rows * D * 2 * H, 2 * rows * D * H  # GEMM 1 / dgrad1, GEMM 2 / dgrad2
        print(f"\n== {name}: T={T} D={D} H={H} E={E} top-{K}, {rows} real rows, R_max {R}")
        print(f"  {'stage':24s} {'ours ms (TFLOP/s)':15s}  {'dg side':15s}  {'dg plain':15s}")

        layout = deepgemm.grouped_layout(plan) if have_dg else None
        hq2 = torch.empty((R, H), dtype=FP8, device=dev)
        hs2 = torch.empty((R, H // 128), dtype=torch.float32, device=dev)
        y = torch.empty((R, D), dtype=torch.bfloat16, device=dev)
        dxr = torch.empty((R, D), dtype=torch.bfloat16, device=dev)
        a2 = torch.empty_like(a)

        # GEMM 1 + SwiGLU (+ h quantized, a saved)
        o, _ = best_of_ours(lambda c: fp8_gemm1_swiglu(xq, xs, wq.w1q, wq.w1s, wq.w3q, wq.w3s,
                                                       plan, True, c),
                            "gemm1_swiglu", xq, H, D, hq, True)
        side = plain = None
        if have_dg:
            side = ms(lambda: fp8_gemm1_swiglu(xq, xs, wq.w1q, wq.w1s, wq.w3q, wq.w3s, plan, True,
                                               DeepGemm()))
            w13q = torch.cat([wq.w1q, wq.w3q], 1)
            w13s = torch.cat([wq.w1s, wq.w3s], 1)
            plain = ms(lambda: deepgemm.gemm_rows(xr, xrs, w13q, w13s, layout, a2))
        # our fusion saves: the row gather (R*D read + write) and the SwiGLU pass (a read, h write)
        row("fp8_gemm1_swiglu", f1, o, side, plain, saved_bytes=2 * R * D + R * 2 * H * 2 + R * H)
        if have_dg:
            print(f"  {'  passes: gather x rows':24s} {ms(lambda: gather_rows(xq, xs, plan)):7.3f}"
                  f"   swiglu+quant {ms(lambda: swiglu_quant_rows(a, plan, hq2, hs2)):7.3f}")
        # GEMM 2
        o, _ = best_of_ours(lambda c: fp8_gemm_rows(hq, hs, wq.w2q, wq.w2s, plan, torch.bfloat16,
                                                    config=c, out=y),
                            "gemm_rows", hq, D, H, y, False)
        plain = ms(lambda: deepgemm.gemm_rows(hq, hs, wq.w2q, wq.w2s, layout, y)) if have_dg else None
        row("fp8_gemm2", f2, o, plain, plain)
        # dgrad2 (the GEMM of kernel A) on token rows, then the SwiGLU backward pass
        o, _ = best_of_ours(lambda c: fp8_gemm_rows(gq, gs, w2t.q, w2t.s, plan, torch.bfloat16,
                                                    gather=True, config=c, out=dh,
                                                    stage="fp8_dgrad2"),
                            "gemm_rows", gq, H, D, dh, True)
        side = plain = None
        if have_dg:
            side = ms(lambda: fp8_gemm_rows(gq, gs, w2t.q, w2t.s, plan, torch.bfloat16,
                                            gather=True, config=DeepGemm(), out=dh))
            plain = ms(lambda: deepgemm.gemm_rows(gr, grs, w2t.q, w2t.s, layout, dh))
        row("fp8_dgrad2", f2, o, side, plain, saved_bytes=2 * R * D)
        sw = ms(lambda: swiglu_bwd_rows(dh, a, tw, plan, quant=True))
        print(f"  {'swiglu_bwd (+ da e4m3)':24s} {sw:7.3f}")
        # MEGAMOE_FP8_FUSED_DGRAD2's one launch: dgrad2 + SwiGLU backward, the rows' outputs
        if available(gq).sm90:
            tw32 = tw.reshape(-1).to(torch.float32)
            rows_fused = ms(lambda: fp8_dgrad2_swiglu_rows_sm90(gq, gs, w2t.q, w2t.s, a, tw32,
                                                                plan))
            print(f"  {'dgrad2 + swiglu_bwd, 1 launch':24s} {rows_fused:7.3f}   (against "
                  f"fp8_dgrad2 + swiglu_bwd above; MEGAMOE_FP8_FUSED_DGRAD2=1)")
        # the all-FP8 recipe's fused kernel A, for comparison: dgrad2 + SwiGLU backward + da, da^T, h^T
        fused = ms(lambda: fp8_dgrad2_swiglu(gq, gs, w2t.q, w2t.s, a, tw, plan))
        print(f"  {'fp8_dgrad2_swiglu (fused)':24s} {fused:7.3f}   (all-FP8 recipe's kernel A; "
              f"bar for it: dg plain + swiglu pass)")
        # dgrad1
        o, _ = best_of_ours(lambda c: fp8_gemm_rows(daq, das, w13t.q, w13t.s, plan, torch.bfloat16,
                                                    config=c, out=dxr, stage="fp8_dgrad1"),
                            "gemm_rows", daq, D, 2 * H, dxr, False)
        plain = ms(lambda: deepgemm.gemm_rows(daq, das, w13t.q, w13t.s, layout, dxr)) if have_dg else None
        row("fp8_dgrad1", f1, o, plain, plain)

        # weight gradients: bf16 (each side the tuner offers), FP8 (ours, DeepGEMM K-grouped)
        params = (w1, w2, w3)
        key = tuner_key(R, D, H, E, FP8_BLOCK_M, "auto")
        def weight_grads():
            grads = WeightGrads(g, x, da, {"hw": hw, "dy_rows": None}, plan, params, key,
                                FP8_BLOCK_M)
            return grads.dw2(), grads.dw13()

        weight_grads()
        bf = ms(weight_grads)
        for stage in ("wgrad_dw2", "wgrad_dw13"):
            for c, t, why in tune.TIMINGS.get((stage, key), []):
                side_name = c.side
                print(f"  {stage + ' bf16 ' + side_name:24s} {t:7.3f} "
                      f"({(f2 if stage == 'wgrad_dw2' else f1) / t / 1e9:5.0f}) {why[:60]}")
        print(f"  {'wgrad bf16 (picked, all)':24s} {bf:7.3f} ({(f2 + f1) / bf / 1e9:5.0f})")
        GEMM_ROWS.append(("wgrad bf16 (dw2, dw1, dw3)", f2 + f1, bf))
        order = longest_first(plan)
        dyT = quant_rows_t(g, plan, gather=True, row_weight=tw.reshape(-1))
        xT = quant_rows_t(x, plan, gather=True)
        _, _, daTq, daTs, hTq, hTs, _ = fp8_dgrad2_swiglu(gq, gs, w2t.q, w2t.s, a, tw, plan)
        q2 = ms(lambda: quant_rows_t(g, plan, gather=True, row_weight=tw.reshape(-1)))
        qx = ms(lambda: quant_rows_t(x, plan, gather=True))
        o2 = ms(lambda: fp8_wgrad(*dyT, hTq, hTs, plan, torch.empty_like(w2), order))
        o13 = ms(lambda: [fp8_wgrad(daTq[sl], daTs[sl], *xT, plan, torch.empty_like(w1), order)
                          for sl in (slice(0, H), slice(H, 2 * H))])
        dg2 = dg13 = None
        if have_dg:
            try:
                run2 = k_grouped_fp8(*dyT, hTq, hTs, plan, torch.empty_like(w2))
                dg2 = ms(run2)
                run1 = k_grouped_fp8(daTq[:H], daTs[:H], *xT, plan, torch.empty_like(w1))
                run3 = k_grouped_fp8(daTq[H:], daTs[H:], *xT, plan, torch.empty_like(w1))
                dg13 = ms(lambda: (run1(), run3()))
            except Exception as err:  # the layout this bench assumes for its operands
                print(f"  DeepGEMM K-grouped FP8: {err!r}"[:160])
        row("fp8_wgrad dw2", f2, o2, None, dg2, note=f"+ quant dy^T {q2:.3f}",
            default_path=False)
        row("fp8_wgrad dw1 + dw3", f1, o13, None, dg13, note=f"+ quant x^T {qx:.3f}",
            default_path=False)
        print(f"  {'quant weights fwd':24s} {ms(lambda: forward_weights(w1, w2, w3)):7.3f}"
              f"   bwd {ms(lambda: (w2_transposed(w2), w13_transposed(w1, w3))):7.3f}")
        del dyT, xT, daTq, daTs, hTq, hTs, a2, y, dxr

        if args.no_op:
            if name in targets:  # no op time: the GEMM stages' sum stands for it
                print("\n".join(compass(GEMM_ROWS, sum(t for *_, t in GEMM_ROWS),
                                         targets[name])))
            continue
        runs = [(p, p, {}) for p in PRECISIONS]
        runs += [(f"{p} cached", p, {}) for p in PRECISIONS if recipe_named(p).fp8]
        runs += [("fp8 cached fp8-wgrad", "fp8", {"MEGAMOE_FP8_WGRAD": "1"}),
                ("fp8 cached no-DeepGEMM", "fp8", {"MEGAMOE_DEEPGEMM": "0"})]
        op_ms = None
        for label, prec, env in runs:
            cached = "cached" in label
            old = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            opts = MegaMoEOptions(backend="hopper", precision=prec)
            op_args = (x, ids, tw, w1, w2, w3, None, opts)
            # the copies a layer's module makes once per optimizer step (moe.MegaExperts)
            fw = make_fp8_weights(w1, w2, w3, forward=recipe_named(prec).forward_copies) \
                if cached else None

            def fwdbwd():
                _, saved = hopper.forward(*op_args, save=True, fp8_weights=fw)
                hopper.backward(g, *op_args, saved=saved, fp8_weights=fw)

            f = ms(lambda: hopper.forward(*op_args, fp8_weights=fw))
            torch.cuda.reset_peak_memory_stats()
            fb = ms(fwdbwd)
            # the held copies are allocated before the reset: counted in the peak as they are
            peak = torch.cuda.max_memory_allocated() / 2**30
            held = 0 if fw is None else fw.nbytes() / 2**30
            print(f"  op {label:24s} fwd {f:7.3f} ms   fwd+bwd {fb:7.3f} ms "
                  f"({3 * f1 / fb / 1e9:5.0f} TFLOP/s)   peak {peak:6.2f} GiB "
                  f"(FP8 copies held {held:.2f})")
            if label == "fp8 cached":  # the default: the module's copies, DeepGEMM where it wins
                op_ms = fb
            del fw
            for k, v in old.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        if name in targets and op_ms is not None:
            print("\n".join(compass(GEMM_ROWS, op_ms, targets[name])))
        for (kname, key), timings in tune.TIMINGS.items():
            if kname.startswith("fp8"):
                best = sorted(timings, key=lambda t: t[1])[:3]
                print(f"  tuner {kname} {key[:4]}: " + "; ".join(
                    f"{c.side}{(c.block_m, c.block_n) if c.side == 'triton' else ''} {t:.3f}"
                    for c, t, *_ in best))
        tune.TIMINGS.clear()


if __name__ == "__main__":
    main()
