"""Loss comparison of the stock and converter runs, step by step, within a tolerance."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchtitan_megamoe.ab.logs import RunLog

DEFAULT_RTOL = 1e-5
"""Relative loss tolerance. The default fits fp32 on CPU: both runs do the same math, only in a
different order (per-expert loops vs the fused op's gather/scatter), which moves an fp32 loss by
~1e-7 relative and a few steps of AdamW keep it well below 1e-5. bf16 GPU runs need ~1e-2.

One caveat: a token whose 2nd and 3rd router scores tie to ~1e-7 can pick a different expert in
the two runs (the router input differs in the last bits), which moves that step's loss by about
1/(tokens per step), e.g. 5e-4 on the tiny config with EP=2. With
``--debug.moe_force_load_balance`` (routing fixed) the tiny CPU runs agree to the printed digit;
use it for an exact check, or a looser --rtol (1e-3) with natural routing."""

DEFAULT_ATOL = 1e-5
"""Absolute loss tolerance. TorchTitan prints losses with 5 decimals, so two runs that agree to
1e-7 can still print values 1e-5 apart (rounding on either side of a last digit)."""


@dataclass
class Comparison:
    steps: list[int]
    stock_loss: list[float]
    conv_loss: list[float]
    abs_diff: list[float]
    rel_diff: list[float]
    max_abs_diff: float
    max_rel_diff: float
    rtol: float
    atol: float
    ok: bool
    problems: list[str]


def compare(
    stock: RunLog,
    conv: RunLog,
    rtol: float,
    atol: float,
    names: tuple[str, str] = ("stock", "converter"),
) -> Comparison:
    """Losses step by step; ok iff both logged the same steps and |a-b| <= atol + rtol*|a|.
    ``names`` name the two runs (A, B) in the problems."""
    a, b = stock.by_step(), conv.by_step()
    na, nb = names
    problems = []
    if not a:
        problems.append(f"the {na} run logged no training step")
    if not b:
        problems.append(f"the {nb} run logged no training step")
    if set(a) != set(b) and a and b:
        problems.append(
            f"the runs logged different steps: {na} {sorted(a)}, {nb} {sorted(b)}"
        )
    steps = sorted(set(a) & set(b))
    sl = [a[s].loss for s in steps]
    cl = [b[s].loss for s in steps]
    abs_diff = [abs(x - y) for x, y in zip(sl, cl)]
    rel_diff = [d / max(abs(x), 1e-12) for d, x in zip(abs_diff, sl)]
    for s, x, y, d in zip(steps, sl, cl, abs_diff):
        if not (math.isfinite(x) and math.isfinite(y)):
            problems.append(f"step {s}: non-finite loss ({na} {x}, {nb} {y})")
        elif d > atol + rtol * abs(x):
            problems.append(
                f"step {s}: loss {na} {x:.5f} vs {nb} {y:.5f}, |diff| {d:.2e} > "
                f"atol {atol:g} + rtol {rtol:g} * |loss|"
            )
    return Comparison(
        steps=steps,
        stock_loss=sl,
        conv_loss=cl,
        abs_diff=abs_diff,
        rel_diff=rel_diff,
        max_abs_diff=max(abs_diff, default=float("nan")),
        max_rel_diff=max(rel_diff, default=float("nan")),
        rtol=rtol,
        atol=atol,
        ok=not problems,
        problems=problems,
    )
