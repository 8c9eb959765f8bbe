"""The A/B outputs for people: the markdown report and the PNG plot (loss curves, step times);
for a multi-seed A/B (``--seeds``) its report and ``seeds.png`` (windowed mean losses)."""

from __future__ import annotations

import math
import os

from torchtitan_megamoe.ab.comparison import Comparison
from torchtitan_megamoe.ab.configs import CONVERTER
from torchtitan_megamoe.ab.logs import RunLog, run_stats


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _side_line(meta: dict[str, object]) -> list[str]:
    """``- sides: ...`` for an A/B whose sides are not stock vs megamoe (``meta["sides"]``: one
    dict per side with label, kind, args), else nothing."""
    sides = meta.get("sides")
    if not sides or [(s["label"], s["kind"], list(s["args"])) for s in sides] == [
        ("stock", "stock", []), (CONVERTER, CONVERTER, [])
    ]:
        return []
    desc = [
        f"{ab} = `{s['label']}` ({s['kind']}"
        + (f", `{' '.join(s['args'])}`" if s["args"] else "") + ")"
        for ab, s in zip("AB", sides)
    ]
    return [f"- sides: {', '.join(desc)}"]


def render_report(
    stock: RunLog,
    conv: RunLog,
    cmp: Comparison,
    meta: dict[str, object],
    names: tuple[str, str] = ("stock", CONVERTER),
) -> str:
    """The single-seed report of runs A (``stock``) and B (``conv``), named ``names``."""
    a, b = stock.by_step(), conv.by_step()
    na, nb = names
    sa, sb = run_stats(stock), run_stats(conv)
    ratio = sa["mean_step_time_s"] / sb["mean_step_time_s"] if sb["mean_step_time_s"] else None
    default = tuple(names) == ("stock", CONVERTER)
    lines = [
        "# megamoe A/B: stock vs converter" if default else f"# megamoe A/B: {na} vs {nb}",
        "",
        f"- config: `{meta.get('config')}`, nproc {meta.get('nproc')}, "
        f"extra args: `{' '.join(meta.get('extra_args', [])) or '(none)'}`",
        *_side_line(meta),
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
        f"| | {na} | {nb} |",
        "| --- | ---: | ---: |",
        f"| tokens/s per device (mean, step 2+) | {_fmt(sa['mean_tps'], ',.0f')} | "
        f"{_fmt(sb['mean_tps'], ',.0f')} |",
        f"| step time ms (mean, step 2+) | {_fmt(sa['mean_step_time_s'] * 1e3, '.1f')} | "
        f"{_fmt(sb['mean_step_time_s'] * 1e3, '.1f')} |",
        f"| peak memory GiB (rank 0) | {_fmt(sa['peak_memory_gib'], '.2f')} | "
        f"{_fmt(sb['peak_memory_gib'], '.2f')} |",
        f"| final loss | {_fmt(sa['final_loss'], '.5f')} | {_fmt(sb['final_loss'], '.5f')} |",
        "",
        f"Speed-up ({na} step time / {nb} step time): {_fmt(ratio, '.3f')}",
        "",
        f"| step | loss {na} | loss {nb} | abs diff | rel diff | ms {na} | ms {nb} "
        f"| tps {na} | tps {nb} |",
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


def plot(
    stock: RunLog, conv: RunLog, path: str, names: tuple[str, str] = ("stock", CONVERTER)
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(11, 4))
    for run, label, style in ((stock, names[0], "-o"), (conv, names[1], "--x")):
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


# --- the multi-seed A/B (``--seeds N``, ab/seeds.py; statistics in ab/stats.py)


def _pct(x: float | None, spec: str = "+.3f") -> str:
    """``x`` in percent (``-`` when None or nan)."""
    text = _fmt(None if x is None else 100 * x, spec)
    return text if text == "-" else text + "%"


def _yes(flag: bool | None, yes: str, no: str) -> str:
    return "-" if flag is None else (yes if flag else no)


def render_seed_report(st, pairs: dict, problems: list[str], meta: dict, speeds: dict) -> str:
    """report.md of a multi-seed A/B: ``st`` a stats.SeedStats, ``pairs`` seed -> the seed's
    driver.ABResult, ``speeds`` side -> the run_stats of its kept seeds' runs."""
    from torchtitan_megamoe.ab.stats import rule_text

    na, nb = st.names
    seeds = meta.get("seeds", list(pairs))
    windows = sorted({(r.first_step, r.last_step) for r in st.seeds})
    win = ", ".join(f"steps {a}-{b}" for a, b in windows) or "-"
    verdict = st.verdict.upper()
    if st.verdict == "undetermined":
        why = "one seed has no seed-to-seed spread" if st.n == 1 else "no seed completed"
        test = f"({why})"
    else:
        test = (f"(|mean diff| {_fmt(abs(st.mean_diff), '.5f')} "
                f"{'>' if st.verdict == 'different' else '<='} t {st.t_crit:.2f} x SE "
                f"{_fmt(st.se_diff, '.5f')} = {_fmt(st.threshold, '.5f')}; "
                f"t statistic {_fmt(st.t_stat, '+.2f')})")
    lines = [
        f"# megamoe A/B over {len(seeds)} seeds: {na} vs {nb}",
        "",
        f"- config: `{meta.get('config')}`, nproc {meta.get('nproc')}, "
        f"extra args: `{' '.join(meta.get('extra_args', [])) or '(none)'}`",
    ]
    desc = [
        f"{ab} = `{s['label']}` ({s['kind']}"
        + (f", `{' '.join(s['args'])}`" if s["args"] else "") + ")"
        for ab, s in zip("AB", meta.get("sides", []))
    ]
    if desc:
        lines.append(f"- sides: {', '.join(desc)}")
    lines += [
        f"- device: {meta.get('device')}"
        + (" (analyzed from the logs under this dir; nothing trained)"
           if meta.get("analyzed_only") else ""),
        f"- seeds (`--debug.seed`): {', '.join(str(s) for s in seeds)}; {st.n} in the "
        f"statistics",
        f"- final window: the last {st.window} steps ({win}); per run the mean of the losses "
        f"it logged there",
        f"- **verdict: {verdict}** {test}",
        f"- rule: {rule_text(st.alpha, st.n)}",
        f"- mean difference {nb} - {na}: {_fmt(st.mean_diff, '+.5f')} ({_pct(st.mean_rel_diff)}"
        f" of {na}), sd over seeds {_fmt(st.sd_diff, '.5f')}, SE {_fmt(st.se_diff, '.5f')}",
        f"- against the seed-to-seed spread of each side (sd of its final-window mean: {na} "
        f"{_fmt(st.sd_a, '.5f')}, {nb} {_fmt(st.sd_b, '.5f')}, pooled "
        f"{_fmt(st.spread, '.5f')}): the gap is "
        + _yes(st.gap_within_spread, "within it", "**beyond it**"),
        f"- against {100 * st.gap_limit:g}% of {na}'s loss: the gap is "
        + _yes(st.gap_within_limit, "within it", "**beyond it**"),
        "",
    ]
    if problems:
        lines += ["Problems:", ""] + [f"- {p}" for p in problems] + [""]
    lines += [
        f"| seed | window | {na} | {nb} | {nb} - {na} | ({nb} - {na}) / {na} "
        f"| max rel step diff | tok/s {na} | tok/s {nb} | GiB {na} | GiB {nb} |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    by_seed = {r.seed: r for r in st.seeds}
    for seed in seeds:
        p = pairs.get(seed)
        r = by_seed.get(seed)
        sa = run_stats(p.stock) if p else {}
        sb = run_stats(p.conv) if p else {}
        cells = ([f"{r.first_step}-{r.last_step} ({r.window_steps})", f"{r.mean_a:.5f}",
                  f"{r.mean_b:.5f}", f"{r.diff:+.5f}", _pct(r.rel_diff)]
                 if r else ["left out", "-", "-", "-", "-"])
        lines.append(
            f"| {seed} | " + " | ".join(cells) + " | "
            + " | ".join([
                _fmt(p.comparison.max_rel_diff if p else None, ".1e"),
                _fmt(sa.get("mean_tps"), ",.0f"), _fmt(sb.get("mean_tps"), ",.0f"),
                _fmt(sa.get("peak_memory_gib"), ".2f"), _fmt(sb.get("peak_memory_gib"), ".2f"),
            ]) + " |"
        )
    lines += [
        "",
        f"| over the seeds | {na} | {nb} | {nb} - {na} | ({nb} - {na}) / {na} |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| mean | {_fmt(st.mean_a, '.5f')} | {_fmt(st.mean_b, '.5f')} | "
        f"{_fmt(st.mean_diff, '+.5f')} | {_pct(st.mean_rel_diff)} |",
        f"| sd (N - 1) | {_fmt(st.sd_a, '.5f')} | {_fmt(st.sd_b, '.5f')} | "
        f"{_fmt(st.sd_diff, '.5f')} | {_pct(st.sd_rel_diff, '.3f')} |",
        f"| standard error (sd / sqrt(N)) | | | {_fmt(st.se_diff, '.5f')} | |",
        "",
    ]

    def _mean_of(key, side):
        vals = [s[key] for s in speeds.get(side, []) if not math.isnan(s[key])]
        return sum(vals) / len(vals) if vals else float("nan")

    ta, tb = _mean_of("mean_tps", na), _mean_of("mean_tps", nb)
    lines += [
        f"Tokens/s per device (mean over the seeds, step 2+): {na} {_fmt(ta, ',.0f')}, "
        f"{nb} {_fmt(tb, ',.0f')}, {nb} / {na} {_fmt(tb / ta if ta else None, '.3f')}. "
        f"Peak memory (rank 0, max over the seeds): {na} "
        f"{_fmt(max((s['peak_memory_gib'] for s in speeds.get(na, [])), default=None), '.2f')}"
        f" GiB, {nb} "
        f"{_fmt(max((s['peak_memory_gib'] for s in speeds.get(nb, [])), default=None), '.2f')}"
        " GiB.",
        "",
        "Plot: `seeds.png` (trailing mean losses over the window, every run; per-seed "
        "differences). Each seed's runs, logs, per-step table and commands: "
        "`seed<S>/report.md`.",
    ]
    first = pairs.get(seeds[0]) if seeds else None
    if first is not None:
        sub = os.path.join(first.out, "profile.md")
        if os.path.exists(sub):
            with open(sub) as f:
                lines += ["", f"Profiled: seed {seeds[0]}.", "", f.read().rstrip()]
    lines.append("")
    return "\n".join(lines)


def plot_seeds(runs: list, names: tuple[str, str], window: int, path: str, st=None) -> None:
    """seeds.png: left, each run's trailing ``window``-step mean loss (thin: one seed; thick:
    the mean over the seeds); right, each seed's relative difference (B - A) / A of those means
    in percent, the final window shaded. ``runs``: (seed, RunLog A, RunLog B) triples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from torchtitan_megamoe.ab.stats import trailing_means

    colors = ("tab:blue", "tab:orange")
    fig, (ax_loss, ax_diff) = plt.subplots(1, 2, figsize=(12, 4.5))
    curves: list[list[dict[int, float]]] = [[], []]
    diffs: list[dict[int, float]] = []
    for seed, *pair in runs:
        means = []
        for k, run in enumerate(pair):
            xs, ys = trailing_means(run, window)
            means.append(dict(zip(xs, ys)))
            curves[k].append(means[-1])
            if xs:
                ax_loss.plot(xs, ys, color=colors[k], alpha=0.35, linewidth=1)
        common = sorted(set(means[0]) & set(means[1]))
        d = {s: 100 * (means[1][s] - means[0][s]) / means[0][s] for s in common if means[0][s]}
        diffs.append(d)
        if d:
            ax_diff.plot(list(d), list(d.values()), color="tab:gray", alpha=0.5, linewidth=1)
            ax_diff.annotate(str(seed), (list(d)[-1], list(d.values())[-1]), fontsize=7,
                             color="tab:gray")

    def _mean_curve(ds):
        steps = sorted(set.intersection(*(set(x) for x in ds))) if ds else []
        return steps, [sum(x[s] for x in ds) / len(ds) for s in steps]

    for k in range(2):
        xs, ys = _mean_curve([c for c in curves[k] if c])
        if xs:
            ax_loss.plot(xs, ys, color=colors[k], linewidth=2.2,
                         label=f"{names[k]} (mean of {len(curves[k])} seeds)")
    xs, ys = _mean_curve([d for d in diffs if d])
    if xs:
        ax_diff.plot(xs, ys, color="black", linewidth=2.2, label="mean over seeds")
    ax_diff.axhline(0.0, color="black", linewidth=0.8, linestyle=":")
    if st is not None and st.seeds:
        lo = min(r.first_step for r in st.seeds)
        hi = max(r.last_step for r in st.seeds)
        ax_diff.axvspan(lo, hi, color="tab:green", alpha=0.12, label="final window")
        ax_loss.axvspan(lo, hi, color="tab:green", alpha=0.12)
        title = (f"{names[1]} - {names[0]}: {st.verdict} "
                 f"({_pct(st.mean_rel_diff)} +- {_pct(st.sd_rel_diff, '.3f')} sd, "
                 f"N={st.n})")
    else:
        title = f"({names[1]} - {names[0]}) / {names[0]}"
    ax_loss.set(xlabel="step", ylabel=f"loss, mean over the last {window} steps",
                title="windowed mean loss per run")
    ax_diff.set(xlabel="step", ylabel="relative difference %", title=title)
    for ax in (ax_loss, ax_diff):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
