"""FP8 accuracy with outliers (CPU): the FP8 recipes' errors against float64 on plain inputs and
on inputs with outlier tokens and an outlier channel, and ablations that locate the cause.

The recipes are the reference backend's emulation (ops/reference.py at precision fp8 / fp8_bwd,
bf16 inputs, through the public op); the truth is the same backend at precision bf16 on the same
values in float64. Inputs (tests/moe_testing.outlier_inputs): "tokens" scales 1% of the tokens
by factors uniform in [20, 100], "channel" scales one of the D channels by 20, "both" does both.
Errors are ||got - exact|| / ||exact||, averaged over seeds; "×" is the ratio to plain inputs.

    python3 experiments/fp8_outliers.py                  # table: T=512 D=256 H=256 E=8 K=2
    python3 experiments/fp8_outliers.py --ablate         # the ablations and the attribution
    python3 experiments/fp8_outliers.py --shape big      # T=2048 D=512 H=256 E=16 K=4

The table runs both weight-gradient recipes: the default (bf16 weight gradients) and
MEGAMOE_FP8_WGRAD=1 (all-FP8). The ablations replace the reference's per-expert backward with a
copy of its math (``variant_backward``) in which parts of GEMM 1's pre-activations come from the
exact (unquantized) forward while everything else stays FP8:

- ``silu'(a1) exact``: only the SwiGLU derivative's silu'(a1) reads the exact a1;
- ``silu(a1) exact``: only silu(a1) (in h and da3) reads it;
- ``a3 exact``: only a3;
- ``a1, a3 exact``: all of them (this is the fp8_bwd backward; checked to match it);
- ``GEMM 1 quantizes x only`` / ``weights only``: the forward's GEMM 1 rounds one operand.

and the attribution splits the error that silu'(a1) brings into da1 by |a1| and by token kind.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from moe_testing import (  # noqa: E402
    OUTLIER_KINDS, RESULT_NAMES as NAMES, op_results, outlier_inputs, rel_err,
)

from torchtitan_megamoe.ops import reference  # noqa: E402
from torchtitan_megamoe.ops.recipe import PRECISIONS, recipe_named  # noqa: E402

# the recipe with a bf16 forward and FP8 data gradients
FP8_DGRAD_ONLY = next(p for p in PRECISIONS
                      if recipe_named(p).fp8_dgrad and not recipe_named(p).fp8_forward)

SHAPES = {"small": dict(T=512, D=256, H=256, E=8, K=2),
          "big": dict(T=2048, D=512, H=256, E=16, K=4)}


@contextlib.contextmanager
def fp8_wgrad(on: bool):
    """MEGAMOE_FP8_WGRAD for the duration (settings read it at each call)."""
    old = os.environ.get("MEGAMOE_FP8_WGRAD")
    os.environ["MEGAMOE_FP8_WGRAD"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MEGAMOE_FP8_WGRAD")
        else:
            os.environ["MEGAMOE_FP8_WGRAD"] = old


def run(inp, precision, backend="reference", exact=False):
    """{name: float64 result} of the op (moe_testing.op_results)."""
    return op_results(inp, precision, backend, exact)


def errors(got, exact):
    return {n: rel_err(got[n], exact[n]) for n in NAMES}


def mean(dicts):
    return {k: sum(d[k] for d in dicts) / len(dicts) for k in dicts[0]}


# ------------------------------------------------------------------------------- the table


def table(shape, seeds):
    rows = {}
    for wgrad in (False, True):
        for kind in OUTLIER_KINDS:
            per = {p: [] for p in PRECISIONS if recipe_named(p).fp8}
            for seed in seeds:
                inp = outlier_inputs(**shape, kind=kind, seed=seed)
                exact = run(inp, "bf16", exact=True)
                with fp8_wgrad(wgrad):
                    for p in per:
                        per[p].append(errors(run(inp, p), exact))
            for p in per:
                rows[(wgrad, kind, p)] = mean(per[p])
    print(f"shape {shape}, seeds {list(seeds)}; rel err vs float64 (× plain input's)\n")
    print("| weight grads | inputs | precision | " + " | ".join(NAMES) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in NAMES) + " |")
    for (wgrad, kind, p), e in rows.items():
        plain = rows[(wgrad, "plain", p)]
        cells = [f"{e[n]:.3f}" + ("" if kind == "plain" else f" ({e[n] / plain[n]:.1f}×)")
                 for n in NAMES]
        print(f"| {'fp8' if wgrad else 'bf16'} | {kind} | {p} | " + " | ".join(cells) + " |")
    return rows


# ------------------------------------------------------------------------------- ablations


def variant_backward(exact_in=(), gemm1="both", record=None):
    """A copy of reference._experts_backward's math at precision fp8, in which the parts named
    in ``exact_in`` ("silu_prime", "silu", "a3") read GEMM 1's pre-activations from the exact
    forward, and GEMM 1 rounds ``gemm1`` ("both", "x", "w", "none") of its operands through
    e4m3. Both pre-activations are rounded to the input dtype, as the kernels save them.
    ``record``: a list that gets, per expert, what the attribution needs."""
    q = reference.quantize_dequantize_fp8

    def gemm(xe, w):
        xq = q(xe, reference.ACT) if gemm1 in ("both", "x") else xe
        wq = q(w, reference.WEIGHT) if gemm1 in ("both", "w") else w
        return xq @ wq.t()

    def experts_backward(rows, grad_rows, row_weights, local_expert, w1, w2, w3, fp8_fwd,
                         fp8_bwd, fp8_wgrad=False):
        assert fp8_fwd and fp8_bwd, "variants of precision fp8 only"
        acc = reference._acc_dtype(rows)
        n = rows.shape[0]
        dx = torch.zeros(n, rows.shape[1], dtype=acc)
        dweight = torch.zeros(n, 1, dtype=acc)
        dw1, dw2, dw3 = (torch.zeros(w.shape, dtype=acc) for w in (w1, w2, w3))
        saved = lambda a: a.to(rows.dtype).to(acc)  # noqa: E731
        for e, idx in reference._by_expert(local_expert, w1.shape[0]):
            xe, ge = rows[idx].to(acc), grad_rows[idx].to(acc)
            w1e, w2e, w3e = w1[e].to(acc), w2[e].to(acc), w3[e].to(acc)
            a1q, a3q = saved(gemm(xe, w1e)), saved(gemm(xe, w3e))
            # unquantized, as the bf16 forward computes them (fp32 accumulation)
            a1x, a3x = xe @ w1e.t(), xe @ w3e.t()
            a1p = saved(a1x) if "silu_prime" in exact_in else a1q  # into silu'
            a1s = saved(a1x) if "silu" in exact_in else a1q  # into silu (h, da3)
            a3 = saved(a3x) if "a3" in exact_in else a3q
            silu_a1 = F.silu(a1s)
            h = silu_a1 * a3
            dy = row_weights[idx].to(acc) * ge
            dh = reference._dgrad(dy, w2e, True)
            dweight[idx] = (reference._dgrad(ge, w2e, True) * h).sum(dim=1, keepdim=True)
            sig = torch.sigmoid(a1p)
            da1 = dh * a3 * sig * (1 + a1p * (1 - sig))
            da3 = dh * silu_a1
            dx[idx] = reference._dgrad(da1, w1e, True) + reference._dgrad(da3, w3e, True)
            dw2[e] = reference._wgrad(dy, h, fp8_wgrad)
            dw1[e] = reference._wgrad(da1, xe, fp8_wgrad)
            dw3[e] = reference._wgrad(da3, xe, fp8_wgrad)
            if record is not None:
                x64 = rows[idx].double()
                dh_x = dy.double() @ w2[e].double()
                record.append(dict(a1x=x64 @ w1[e].double().t(), a1q=a1q.double(),
                                   g=dh_x * (x64 @ w3[e].double().t()),
                                   row_norm=rows[idx].double().norm(dim=1)))
        return dx, dweight, dw1, dw2, dw3

    return experts_backward


def variant_forward(gemm1):
    """reference._experts_forward at precision fp8 with GEMM 1 rounding ``gemm1`` of its
    operands (as in variant_backward); GEMM 2 as the recipe."""
    q = reference.quantize_dequantize_fp8

    def experts_forward(rows, local_expert, w1, w2, w3, fp8):
        acc = reference._acc_dtype(rows)
        y = torch.zeros(rows.shape[0], w2.shape[1], dtype=acc)
        for e, idx in reference._by_expert(local_expert, w1.shape[0]):
            xe = rows[idx].to(acc)
            xq = q(xe, reference.ACT) if gemm1 in ("both", "x") else xe
            wq = [q(w[e].to(acc), reference.WEIGHT) if gemm1 in ("both", "w") else w[e].to(acc)
                  for w in (w1, w3)]
            h = F.silu(xq @ wq[0].t()) * (xq @ wq[1].t())
            y[idx] = reference._mm(h, w2[e].to(acc), fp8)
        return y

    return experts_forward


@contextlib.contextmanager
def patched(backward=None, forward=None):
    old = reference._experts_backward, reference._experts_forward
    reference._experts_backward = backward or old[0]
    reference._experts_forward = forward or old[1]
    try:
        yield
    finally:
        reference._experts_backward, reference._experts_forward = old


VARIANTS = {
    "fp8 (the recipe)": dict(),
    "silu'(a1) exact": dict(exact_in=("silu_prime",)),
    "silu(a1) exact": dict(exact_in=("silu",)),
    "a3 exact": dict(exact_in=("a3",)),
    "a1, a3 exact (= fp8_bwd)": dict(exact_in=("silu_prime", "silu", "a3")),
    "GEMM 1 quantizes x only": dict(gemm1="x"),
    "GEMM 1 quantizes weights only": dict(gemm1="w"),
}


def ablate(shape, seeds, kinds=("plain", "tokens", "both")):
    res = {}
    for name, kw in VARIANTS.items():
        for kind in kinds:
            errs = []
            for seed in seeds:
                inp = outlier_inputs(**shape, kind=kind, seed=seed)
                exact = run(inp, "bf16", exact=True)
                fwd = variant_forward(kw["gemm1"]) if "gemm1" in kw else None
                with fp8_wgrad(False), patched(variant_backward(**kw), fwd):
                    got = run(inp, "fp8")
                errs.append(errors(got, exact))
                if name == "fp8 (the recipe)":  # the copy is the reference's math
                    with fp8_wgrad(False):
                        ref = run(inp, "fp8")
                    assert all(torch.equal(got[n], ref[n]) for n in NAMES), "copy drifted"
                if name.endswith("(= fp8_bwd)"):
                    with fp8_wgrad(False):
                        ref = run(inp, FP8_DGRAD_ONLY)
                    assert all(torch.equal(got[n], ref[n]) for n in NAMES[1:]), "not fp8_bwd"
            res[(name, kind)] = mean(errs)
    shown = ("out", "dx", "dw1", "dw3")
    print(f"\nablations at precision fp8, bf16 weight gradients; shape {shape}\n")
    print("| variant | " + " | ".join(f"{n} {k}" for k in kinds for n in shown) + " |")
    print("| --- | " + " | ".join("---" for _ in kinds for _ in shown) + " |")
    for name in VARIANTS:
        cells = []
        for kind in kinds:
            for n in shown:
                e, p = res[(name, kind)][n], res[(name, "plain")][n]
                cells.append(f"{e:.3f}" + ("" if kind == "plain" else f" ({e / p:.1f}×)"))
        print(f"| {name} | " + " | ".join(cells) + " |")
    return res


BINS = (0.0, 1.0, 2.0, 4.0, 8.0, float("inf"))


def attribution(shape, seed=0, kind="both"):
    """Where silu'(a1)'s error lands: the error it brings into da1, g * (silu'(a1q) - silu'(a1)),
    with g = dh * a3 exact, split by |a1| (exact) and by outlier vs ordinary rows (row norm
    over 5x the median), as shares of ||g * silu'(a1)||^2 summed over all rows, next to each
    bin's mean |a1q - a1|."""
    record = []
    inp = outlier_inputs(**shape, kind=kind, seed=seed)
    with fp8_wgrad(False), patched(variant_backward(record=record)):
        run(inp, "fp8")
    a1x = torch.cat([r["a1x"] for r in record])
    a1q = torch.cat([r["a1q"] for r in record])
    g = torch.cat([r["g"] for r in record])
    norm = torch.cat([r["row_norm"] for r in record])
    big = (norm > 5 * norm.median()).unsqueeze(1).expand_as(a1x)

    def silu_prime(a):
        s = torch.sigmoid(a)
        return s * (1 + a * (1 - s))

    err = (g * (silu_prime(a1q) - silu_prime(a1x))) ** 2
    total = float(((g * silu_prime(a1x)) ** 2).sum())
    print(f"\nsilu'(a1)'s error in da1, inputs {kind!r}, seed {seed}: "
          f"||g (silu'(a1q) - silu'(a1))|| / ||g silu'(a1)|| = "
          f"{(float(err.sum()) / total) ** 0.5:.3f}; shares of the squared error\n")
    print("| rows | \\|a1\\| | share of elements | share of error² | mean \\|a1q - a1\\| |")
    print("| --- | --- | --- | --- | --- |")
    for rows_name, sel in (("outlier", big), ("ordinary", ~big)):
        for lo, hi in zip(BINS, BINS[1:]):
            m = sel & (a1x.abs() >= lo) & (a1x.abs() < hi)
            if not m.any():
                continue
            print(f"| {rows_name} | [{lo:g}, {hi:g}) | {float(m.sum()) / m.numel():.4f} | "
                  f"{float(err[m].sum() / err.sum()):.3f} | "
                  f"{float((a1q - a1x)[m].abs().mean()):.3f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--ablate", action="store_true", help="ablations and attribution only")
    args = ap.parse_args()
    torch.manual_seed(0)
    shape, seeds = SHAPES[args.shape], range(args.seeds)
    if args.ablate:
        ablate(shape, seeds)
        attribution(shape)
    else:
        table(shape, seeds)


if __name__ == "__main__":
    main()
