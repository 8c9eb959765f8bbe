"""The A/B outputs for people: the markdown report and the PNG plot (loss curves, step times)."""

from __future__ import annotations

import math

from torchtitan_megamoe.ab.comparison import Comparison
from torchtitan_megamoe.ab.configs import CONVERTER
from torchtitan_megamoe.ab.logs import RunLog, run_stats


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def render_report(
    stock: RunLog, conv: RunLog, cmp: Comparison, meta: dict[str, object]
) -> str:
    a, b = stock.by_step(), conv.by_step()
    sa, sb = run_stats(stock), run_stats(conv)
    ratio = sa["mean_step_time_s"] / sb["mean_step_time_s"] if sb["mean_step_time_s"] else None
    lines = [
        "# megamoe A/B: stock vs converter",
        "",
        f"- config: `{meta.get('config')}`, nproc {meta.get('nproc')}, "
        f"extra args: `{' '.join(meta.get('extra_args', [])) or '(none)'}`",
        f"- device: {meta.get('device')}",
        f"- verdict: **{'PASS' if cmp.ok else 'FAIL'}** (|diff| <= {cmp.atol:g} + "
        f"{cmp.rtol:g} * |loss|)",
        f"- max |loss diff| {_fmt(cmp.max_abs_diff, '.2e')}, max relative diff "
        f"{_fmt(cmp.max_rel_diff, '.2e')} over {len(cmp.steps)} steps",
        "",
    ]
    if cmp.problems:
        lines += ["Problems:", ""] + [f"- {p}" for p in cmp.problems] + [""]
        extra = meta.get("extra_args", [])
        if stock.steps and conv.steps and "--debug.moe_force_load_balance" not in extra:
            lines += [
                "Hint: with learned routing, a token whose router scores tie to ~1e-7 can pick "
                "another expert in one run; that moves a single step's loss by ~1/(tokens per "
                "step) while the steps around it agree. Rerun with "
                "`-- --debug.moe_force_load_balance` (fixed routing) for an exact check.",
                "",
            ]
    lines += [
        "| | stock | megamoe |",
        "| --- | ---: | ---: |",
        f"| tokens/s per device (mean, step 2+) | {_fmt(sa['mean_tps'], ',.0f')} | "
        f"{_fmt(sb['mean_tps'], ',.0f')} |",
        f"| step time ms (mean, step 2+) | {_fmt(sa['mean_step_time_s'] * 1e3, '.1f')} | "
        f"{_fmt(sb['mean_step_time_s'] * 1e3, '.1f')} |",
        f"| peak memory GiB (rank 0) | {_fmt(sa['peak_memory_gib'], '.2f')} | "
        f"{_fmt(sb['peak_memory_gib'], '.2f')} |",
        f"| final loss | {_fmt(sa['final_loss'], '.5f')} | {_fmt(sb['final_loss'], '.5f')} |",
        "",
        f"Speed-up (stock step time / megamoe step time): {_fmt(ratio, '.3f')}",
        "",
        "| step | loss stock | loss megamoe | abs diff | rel diff | ms stock | ms megamoe "
        "| tps stock | tps megamoe |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s, d, r in zip(cmp.steps, cmp.abs_diff, cmp.rel_diff):
        x, y = a[s], b[s]
        lines.append(
            f"| {s} | {x.loss:.5f} | {y.loss:.5f} | {d:.1e} | {r:.1e} | "
            f"{_fmt(x.time_s and x.time_s * 1e3, '.1f')} | {_fmt(y.time_s and y.time_s * 1e3, '.1f')} | "
            f"{x.tps:,.0f} | {y.tps:,.0f} |"
        )
    if meta.get("commands"):
        lines += ["", "Commands:", ""]
        lines += [f"    {c}" for c in meta["commands"]]
    lines.append("")
    return "\n".join(lines)


def plot(stock: RunLog, conv: RunLog, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(11, 4))
    for run, label, style in ((stock, "stock", "-o"), (conv, CONVERTER, "--x")):
        steps = [s.step for s in run.steps]
        ax_loss.plot(steps, [s.loss for s in run.steps], style, label=label, markersize=4)
        timed = [(s.step, s.time_s * 1e3) for s in run.steps if s.time_s is not None]
        if timed:
            ax_time.plot(*zip(*timed), style, label=label, markersize=4)
    ax_loss.set(xlabel="step", ylabel="loss", title="training loss")
    ax_time.set(xlabel="step", ylabel="ms / step", title="step time (rank 0)")
    for ax in (ax_loss, ax_time):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
