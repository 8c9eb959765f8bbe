"""The A/B outputs for people: the markdown report and the PNG plot (loss curves, step times);
for a multi-seed A/B (``--seeds``) its report and ``seeds.png`` (windowed mean losses)."""

from __future__ import annotations

import math
import os

from torchtitan_megamoe.ab.comparison import Comparison
from torchtitan_megamoe.ab.configs import CONVERTER
from torchtitan_megamoe.ab.logs import RunLog, run_stats


def _fmt(x: float | None, spec: str) -> str:
    if isinstance(x, str):  # NOT_COMPARABLE
        return x
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _ms(seconds) -> str:
    return _fmt(seconds * 1e3 if isinstance(seconds, (int, float)) else seconds, ".1f")


def sides_line(sides: list[dict], baseline: str | None = None) -> str:
    """``- sides: ...``: two sides as ``A = ..., B = ...``; three or more (or a baseline given)
    by label, the baseline marked."""
    def one(s):
        return (f"`{s['label']}` ({s['kind']}"
                + (f", `{' '.join(s['args'])}`" if s["args"] else "") + ")")

    if len(sides) == 2 and baseline is None:
        return f"- sides: {', '.join(f'{ab} = {one(s)}' for ab, s in zip('AB', sides))}"
    return "- sides: " + ", ".join(
        one(s) + (" **baseline**" if s["label"] == baseline else "") for s in sides)


def _side_line(meta: dict[str, object]) -> list[str]:
    """``- sides: ...`` for an A/B whose sides are not stock vs megamoe (``meta["sides"]``: one
    dict per side with label, kind, args), else nothing."""
    sides = meta.get("sides")
    if not sides or [(s["label"], s["kind"], list(s["args"])) for s in sides] == [
        ("stock", "stock", []), (CONVERTER, CONVERTER, [])
    ]:
        return []
    return [sides_line(sides, meta.get("baseline"))]


NOT_COMPARABLE = "n/c"
"""What the reports print for the tokens/s and step time of a run that overlapped another on
the same GPUs (``--jobs`` > 1): not comparable."""


CPU_TIMING_NOTE = ("CPU run: these step times and tokens/s compare two CPU runs only and say "
                   "nothing about speed on a GPU, where the kernels differ (the reference "
                   "backend here, the hopper backend there)")
"""What the reports add to their speed lines when the runs trained on a CPU."""


def _cpu_note(meta: dict) -> str:
    return f" ({CPU_TIMING_NOTE})" if str(meta.get("device", "")).startswith("CPU") else ""


def _overlap_note(meta: dict) -> list[str]:
    over = meta.get("overlapped")
    if not over:
        return []
    return [f"- tokens/s and step times: **not comparable** ({NOT_COMPARABLE}): "
            f"{', '.join(f'`{x}`' for x in over)} ran at the same time as other runs on the "
            f"same GPUs (`--jobs {meta.get('jobs', '>1')}`); losses and peak memory are "
            "unaffected"]


def _teardown_note(meta: dict) -> list[str]:
    aborted = meta.get("teardown_aborts")
    if not aborted:
        return []
    return [f"- {', '.join(f'`{x}`' for x in aborted)}: a rank died by a signal in process "
            "teardown after every step was logged (gloo closing sockets); counted as a "
            "completed run, the rank logs are under `<run>/ranks/`"]


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
    over = set(meta.get("overlapped") or ())
    nc = bool(over & {na, nb})
    for st, n in ((sa, na), (sb, nb)):
        if n in over:
            st["mean_tps"] = st["mean_step_time_s"] = st["median_step_time_s"] = NOT_COMPARABLE
    ratio, median_ratio = (None if nc else sa[k] / sb[k] if sb[k] else None
                           for k in ("mean_step_time_s", "median_step_time_s"))
    default = tuple(names) == ("stock", CONVERTER)
    lines = [
        "# megamoe A/B: stock vs converter" if default else f"# megamoe A/B: {na} vs {nb}",
        "",
        *([] if meta.get("section") else [
            f"- config: `{meta.get('config')}`, nproc {meta.get('nproc')}, "
            f"extra args: `{' '.join(meta.get('extra_args', [])) or '(none)'}`"]),
        *_side_line(meta),
        *([] if meta.get("section") else [f"- device: {meta.get('device')}"]),
        *_overlap_note(meta),
        *_teardown_note(meta),
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
        f"| step time ms (mean, step 2+) | {_ms(sa['mean_step_time_s'])} | "
        f"{_ms(sb['mean_step_time_s'])} |",
        f"| step time ms (median, step 2+) | {_ms(sa['median_step_time_s'])} | "
        f"{_ms(sb['median_step_time_s'])} |",
        f"| peak memory GiB (rank 0) | {_fmt(sa['peak_memory_gib'], '.2f')} | "
        f"{_fmt(sb['peak_memory_gib'], '.2f')} |",
        f"| final loss | {_fmt(sa['final_loss'], '.5f')} | {_fmt(sb['final_loss'], '.5f')} |",
        "",
        f"Speed-up ({na} step time / {nb} step time): "
        + (f"{NOT_COMPARABLE} (overlapped runs)" if nc
           else f"{_fmt(ratio, '.3f')} (median: {_fmt(median_ratio, '.3f')})" + _cpu_note(meta)),
        "",
    ]
    # per step: the step times and tokens/s too, unless a run overlapped another (not comparable)
    timed = ["ms", "tps"] if not nc else []
    lines += [
        f"| step | loss {na} | loss {nb} | abs diff | rel diff"
        + "".join(f" | {k} {n}" for k in timed for n in (na, nb)) + " |",
        "| ---: | ---: | ---: | ---: | ---: |" + " ---: |" * (2 * len(timed)),
    ]
    for s, d, r in zip(cmp.steps, cmp.abs_diff, cmp.rel_diff):
        x, y = a[s], b[s]
        row = f"| {s} | {x.loss:.5f} | {y.loss:.5f} | {d:.1e} | {r:.1e} |"
        if timed:
            row += (f" {_fmt(x.time_s and x.time_s * 1e3, '.1f')} | "
                    f"{_fmt(y.time_s and y.time_s * 1e3, '.1f')} | {x.tps:,.0f} | {y.tps:,.0f} |")
        lines.append(row)
    if meta.get("commands"):
        lines += ["", "Commands:", ""]
        lines += [f"    {c}" for c in meta["commands"]]
    lines.append("")
    return "\n".join(lines)


PLOT_EXTRA = "torchtitan-megamoe[ab]"
"""The package extra that brings matplotlib, which only the A/B tool's plots need."""


def require_matplotlib() -> None:
    """Raise ModuleNotFoundError naming the extra when matplotlib is missing (the CLI calls it
    before any training, so a missing plot library does not cost a run)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ModuleNotFoundError(
            f"the A/B tool plots its runs (ab.png, seeds.png) with matplotlib, which is not "
            f"installed; install the tool's extra: pip install '{PLOT_EXTRA}'",
            name="matplotlib")


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or the error naming the extra."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(
    stock: RunLog, conv: RunLog, path: str, names: tuple[str, str] = ("stock", CONVERTER)
) -> None:
    plot_runs([stock, conv], names, path)


_STYLES = ("-o", "--x", "-.s", ":^", "-d", "--v", "-.p", ":*")


def plot_runs(runs: list, names, path: str, overlapped=()) -> None:
    """ab.png: every run's loss per step (left) and step time (right; runs in ``overlapped``
    shared the GPUs, their times are marked not comparable)."""
    plt = pyplot()
    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(11, 4))
    for k, (run, label) in enumerate(zip(runs, names)):
        style = _STYLES[k % len(_STYLES)]
        steps = [s.step for s in run.steps]
        ax_loss.plot(steps, [s.loss for s in run.steps], style, label=label, markersize=4)
        timed = [(s.step, s.time_s * 1e3) for s in run.steps if s.time_s is not None]
        if timed:
            ax_time.plot(*zip(*timed), style, markersize=4,
                         label=label + (f" ({NOT_COMPARABLE})" if label in overlapped else ""))
    ax_loss.set(xlabel="step", ylabel="loss", title="training loss")
    ax_time.set(xlabel="step", ylabel="ms / step",
                title="step time (rank 0)" + (", overlapped runs not comparable"
                                              if overlapped else ""))
    for ax in (ax_loss, ax_time):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render_runs(records: list, runs_by_key: dict | None = None, title: str = "Runs") -> str:
    """A table of the runs (schedule.RunRecord): status, exit status, when each started and
    how long it took (seconds from the invocation's start; start-up and compile included),
    steps logged, whether it overlapped another run; then the missing ones."""
    runs_by_key = runs_by_key or {}
    lines = [f"## {title}", "",
             "| run | status | exit | started s | wall s | timeout s | steps | overlapped |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in records:
        run = runs_by_key.get(r.key)
        lines.append(
            f"| {r.key} | {r.status} | {_fmt(r.code, 'd')} | {_fmt(r.start_s, '.0f')} | "
            f"{_fmt(r.wall_s, '.1f')} | {_fmt(r.timeout_s, '.0f')} | "
            f"{len(run.steps) if run is not None else '-'} | {'yes' if r.overlapped else 'no'} |")
    missing = [r for r in records if r.status != "ok"]
    lines += ["", f"Missing or failed: {', '.join(f'{r.key} ({r.status})' for r in missing)}"
              if missing else f"All {len(records)} runs finished."]
    return "\n".join(lines) + "\n"


# --- the multi-seed A/B (``--seeds N``, ab/seeds.py; statistics in ab/stats.py)


def _pct(x: float | None, spec: str = "+.3f") -> str:
    """``x`` in percent (``-`` when None or nan)."""
    text = _fmt(None if x is None else 100 * x, spec)
    return text if text == "-" else text + "%"


def _yes(flag: bool | None, yes: str, no: str) -> str:
    return "-" if flag is None else (yes if flag else no)


def _verdict_test(st) -> str:
    if st.verdict == "undetermined":
        why = "one seed has no seed-to-seed spread" if st.n == 1 else "no seed completed"
        return f"({why})"
    return (f"(|mean diff| {_fmt(abs(st.mean_diff), '.5f')} "
            f"{'>' if st.verdict == 'different' else '<='} t {st.t_crit:.2f} x SE "
            f"{_fmt(st.se_diff, '.5f')} = {_fmt(st.threshold, '.5f')}; "
            f"t statistic {_fmt(st.t_stat, '+.2f')})")


def _tps_cell(stats: dict, nc: bool) -> str:
    return NOT_COMPARABLE if nc else _fmt(stats.get("mean_tps"), ",.0f")


def render_seed_report(st, pairs: dict, problems: list[str], meta: dict, speeds: dict,
                       overlapped: dict | None = None, level: int = 1) -> str:
    """report.md of a multi-seed A/B: ``st`` a stats.SeedStats, ``pairs`` seed -> the seed's
    driver.ABResult, ``speeds`` side -> the run_stats of its kept seeds' runs. ``overlapped``:
    seed -> labels of the runs that overlapped others (their tokens/s print as n/c).
    ``level`` 2: one comparison of a report with more sides (``render_sides_report``), without
    the config lines that report already has."""
    from torchtitan_megamoe.ab.stats import rule_text

    overlapped = overlapped or {}
    na, nb = st.names
    seeds = meta.get("seeds", list(pairs))
    windows = sorted({(r.first_step, r.last_step) for r in st.seeds})
    win = ", ".join(f"steps {a}-{b}" for a, b in windows) or "-"
    verdict = st.verdict.upper()
    test = _verdict_test(st)
    if level == 1:
        lines = [
            f"# megamoe A/B over {len(seeds)} seeds: {na} vs {nb}",
            "",
            f"- config: `{meta.get('config')}`, nproc {meta.get('nproc')}, "
            f"extra args: `{' '.join(meta.get('extra_args', [])) or '(none)'}`",
        ]
        if meta.get("sides"):
            lines.append(sides_line(meta["sides"], meta.get("baseline")))
        lines += [
            f"- device: {meta.get('device')}"
            + (" (analyzed from the logs under this dir; nothing trained)"
               if meta.get("analyzed_only") else ""),
            f"- seeds (`--debug.seed`): {', '.join(str(s) for s in seeds)}; {st.n} in the "
            f"statistics",
            *_runs_lines(meta),
        ]
    else:
        lines = [f"## {nb} vs {na} (differences {nb} - {na})", "",
                 f"- seeds in the statistics: {st.n} of {len(seeds)}"]
    lines += [
        f"- final window: the last {st.window} steps ({win}); per run the mean of the losses "
        f"it logged there",
        f"- **verdict: {verdict}** {test}",
    ]
    if level == 1:
        lines.append(f"- rule: {rule_text(st.alpha, st.n)}")
    lines += [
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
        over = overlapped.get(seed, ())
        cells = ([f"{r.first_step}-{r.last_step} ({r.window_steps})", f"{r.mean_a:.5f}",
                  f"{r.mean_b:.5f}", f"{r.diff:+.5f}", _pct(r.rel_diff)]
                 if r else ["left out", "-", "-", "-", "-"])
        lines.append(
            f"| {seed} | " + " | ".join(cells) + " | "
            + " | ".join([
                _fmt(p.comparison.max_rel_diff if p else None, ".1e"),
                _tps_cell(sa, na in over), _tps_cell(sb, nb in over),
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
    if level == 1:
        lines += [_speed_line(speeds, (na, nb), any(overlapped.values()), meta), "",
                  "Plot: `seeds.png` (trailing mean losses over the window, every run; per-seed "
                  "differences). Each seed's runs, logs, per-step table and commands: "
                  "`seed<S>/report.md`."]
        lines += _profile_lines(pairs, seeds)
    lines.append("")
    return "\n".join(lines)


def _mean_of(speeds: dict, key: str, side: str) -> float:
    vals = [s[key] for s in speeds.get(side, []) if not math.isnan(s[key])]
    return sum(vals) / len(vals) if vals else float("nan")


def _peak(speeds: dict, side: str):
    return max((s["peak_memory_gib"] for s in speeds.get(side, [])), default=None)


def _speed_line(speeds: dict, names, overlapped: bool, meta: dict) -> str:
    mem = ", ".join(f"{n} {_fmt(_peak(speeds, n), '.2f')} GiB" for n in names)
    if overlapped:
        return (f"Tokens/s per device: {NOT_COMPARABLE}, runs overlapped on the same GPUs "
                f"(`--jobs {meta.get('jobs', '>1')}`); compare speed with `--jobs 1`. Peak "
                f"memory (rank 0, max over the seeds): {mem}.")
    tps = {n: _mean_of(speeds, "mean_tps", n) for n in names}
    ratios = ""
    if len(names) == 2:
        ta, tb = tps[names[0]], tps[names[1]]
        ratios = f", {names[1]} / {names[0]} {_fmt(tb / ta if ta else None, '.3f')}"
    return ("Tokens/s per device (mean over the seeds, step 2+): "
            + ", ".join(f"{n} {_fmt(tps[n], ',.0f')}" for n in names) + ratios
            + f". Peak memory (rank 0, max over the seeds): {mem}." + _cpu_note(meta))


def _profile_lines(pairs: dict, seeds: list) -> list[str]:
    first = pairs.get(seeds[0]) if seeds else None
    if first is None:
        return []
    sub = os.path.join(first.out, "profile.md")
    if not os.path.exists(sub):
        return []
    with open(sub) as f:
        return ["", f"Profiled: seed {seeds[0]}.", "", f.read().rstrip()]


def _runs_lines(meta: dict) -> list[str]:
    """The runs line of a multi-seed report: how many finished, how they were scheduled, which
    are missing (``meta["runs"]``: schedule.RunRecord dicts)."""
    recs = meta.get("runs") or []
    if not recs:
        return []
    done = [r for r in recs if r["status"] == "ok"]
    how = (f"up to {meta['jobs']} at a time on the same GPUs (`--jobs {meta['jobs']}`)"
           if meta.get("jobs", 1) > 1 else "one at a time")
    if meta.get("deadline_s") is not None:
        how += f", deadline {meta['deadline_s']:g} s"
    line = f"- runs: {len(done)} of {len(recs)} finished ({how})"
    missing = [r for r in recs if r["status"] != "ok"]
    if missing:
        line += "; **missing: " + ", ".join(f"{r['key']} ({r['status']})" for r in missing) + "**"
    return [line]


def render_sides_report(comparisons: dict, meta: dict, per_seed: dict,
                        overlapped: dict | None = None) -> str:
    """report.md of a multi-seed A/B of three or more sides: every side against the baseline.
    ``comparisons``: other side's label -> (stats.SeedStats, pairs, problems) as
    ``render_seed_report`` takes them; ``per_seed``: seed -> {label: RunLog}."""
    from torchtitan_megamoe.ab.stats import rule_text

    overlapped = overlapped or {}
    base = meta["baseline"]
    labels = [s["label"] for s in meta["sides"]]
    seeds = meta.get("seeds", list(per_seed))
    n_max = max((st.n for st, _, _ in comparisons.values()), default=0)
    lines = [
        f"# megamoe A/B over {len(seeds)} seeds: {', '.join(labels)} against {base}",
        "",
        f"- config: `{meta.get('config')}`, nproc {meta.get('nproc')}, "
        f"extra args: `{' '.join(meta.get('extra_args', [])) or '(none)'}`",
        sides_line(meta["sides"], base),
        f"- device: {meta.get('device')}"
        + (" (analyzed from the logs under this dir; nothing trained)"
           if meta.get("analyzed_only") else ""),
        f"- seeds (`--debug.seed`): {', '.join(str(s) for s in seeds)}",
        *_runs_lines(meta),
        f"- each side X against {base}: per seed d = X - {base} of the final-window mean losses "
        f"(the last {meta.get('window')} steps both logged); rule: "
        f"{rule_text(meta.get('alpha', 0.05), n_max)}",
        "",
        f"| X | verdict (X vs {base}) | seeds | mean X - {base} | (X - {base}) / {base} | "
        "sd of d | SE | t statistic | t x SE | within the spread | within "
        f"{100 * meta.get('gap_limit', 0.01):g}% |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for lab, (st, _, _) in comparisons.items():
        lines.append(
            f"| {lab} | **{st.verdict.upper()}** | {st.n} | {_fmt(st.mean_diff, '+.5f')} | "
            f"{_pct(st.mean_rel_diff)} | {_fmt(st.sd_diff, '.5f')} | {_fmt(st.se_diff, '.5f')} "
            f"| {_fmt(st.t_stat, '+.2f')} | {_fmt(st.threshold, '.5f')} | "
            f"{_yes(st.gap_within_spread, 'yes', '**no**')} | "
            f"{_yes(st.gap_within_limit, 'yes', '**no**')} |")
    # per seed and side: the final-window mean (window of the comparison with the baseline)
    means: dict = {}
    for lab, (st, _, _) in comparisons.items():
        for r in st.seeds:
            means.setdefault(r.seed, {})[lab] = r.mean_b
            means[r.seed].setdefault(base, r.mean_a)
    lines += ["", "Final-window mean loss per seed and side:", "",
              "| seed | " + " | ".join(labels) + " |",
              "| ---: |" + " ---: |" * len(labels)]
    for seed in seeds:
        row = means.get(seed, {})
        lines.append(f"| {seed} | " + " | ".join(_fmt(row.get(lab), ".5f") for lab in labels)
                     + " |")
    speeds = {lab: [run_stats(per_seed[s][lab]) for s in seeds
                    if s in per_seed and per_seed[s].get(lab) is not None
                    and per_seed[s][lab].steps] for lab in labels}
    lines += ["", _speed_line(speeds, labels, any(overlapped.values()), meta), "",
              "Plot: `seeds.png` (trailing mean losses of every run per side; each side's "
              f"relative difference to {base} per seed). Each seed's runs, logs, per-step "
              "tables and commands: `seed<S>/report.md`.", ""]
    for lab, (st, pairs, problems) in comparisons.items():
        lines.append(render_seed_report(st, pairs, problems, meta, speeds, overlapped, level=2))
    first = next(iter(comparisons.values()), None)
    if first is not None:
        lines += _profile_lines(first[1], seeds)
    lines.append("")
    return "\n".join(lines)


_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
           "tab:pink", "tab:olive")


def plot_seeds(runs: list, names, window: int, path: str, st=None, baseline: int = 0) -> None:
    """seeds.png: left, each run's trailing ``window``-step mean loss (thin: one seed; thick:
    the mean over the seeds), one colour per side; right, each seed's relative difference
    (X - baseline) / baseline of those means in percent for every other side X, the final
    window shaded. ``runs``: (seed, RunLog of each side in ``names``' order) tuples, None for a
    run left out (failed, stopped, not started); ``st``: the stats.SeedStats of a two-side A/B,
    or {label: SeedStats} of each other side."""
    from torchtitan_megamoe.ab.stats import trailing_means

    plt = pyplot()

    names = list(names)
    stats = st if isinstance(st, dict) else ({names[1 - baseline]: st} if st is not None
                                              else {})
    two = len(names) == 2
    fig, (ax_loss, ax_diff) = plt.subplots(1, 2, figsize=(12, 4.5))
    curves: list[list[dict[int, float]]] = [[] for _ in names]
    diffs: dict[int, list[dict[int, float]]] = {k: [] for k in range(len(names))}
    for seed, *logs in runs:
        means = []
        for k, run in enumerate(logs):
            xs, ys = trailing_means(run, window) if run is not None else ([], [])
            means.append(dict(zip(xs, ys)))
            curves[k].append(means[-1])
            if xs:
                ax_loss.plot(xs, ys, color=_COLORS[k % len(_COLORS)], alpha=0.35, linewidth=1)
        b = means[baseline]
        for k in range(len(names)):
            if k == baseline:
                continue
            common = sorted(set(b) & set(means[k]))
            d = {s: 100 * (means[k][s] - b[s]) / b[s] for s in common if b[s]}
            diffs[k].append(d)
            if d:
                color = "tab:gray" if two else _COLORS[k % len(_COLORS)]
                ax_diff.plot(list(d), list(d.values()), color=color, alpha=0.5, linewidth=1)
                ax_diff.annotate(str(seed), (list(d)[-1], list(d.values())[-1]), fontsize=7,
                                 color=color)

    def _mean_curve(ds):
        steps = sorted(set.intersection(*(set(x) for x in ds))) if ds else []
        return steps, [sum(x[s] for x in ds) / len(ds) for s in steps]

    for k in range(len(names)):
        xs, ys = _mean_curve([c for c in curves[k] if c])
        if xs:
            ax_loss.plot(xs, ys, color=_COLORS[k % len(_COLORS)], linewidth=2.2,
                         label=f"{names[k]} (mean of {len([c for c in curves[k] if c])} seeds)")
        if k == baseline:
            continue
        xs, ys = _mean_curve([d for d in diffs[k] if d])
        if xs:
            s_k = stats.get(names[k])
            tag = f": {s_k.verdict}" if s_k is not None and not two else ""
            ax_diff.plot(xs, ys, color="black" if two else _COLORS[k % len(_COLORS)],
                         linewidth=2.2,
                         label="mean over seeds" if two else f"{names[k]}{tag}")
    ax_diff.axhline(0.0, color="black", linewidth=0.8, linestyle=":")
    done = [r for s in stats.values() if s is not None for r in s.seeds]
    if done:
        lo = min(r.first_step for r in done)
        hi = max(r.last_step for r in done)
        ax_diff.axvspan(lo, hi, color="tab:gray", alpha=0.15, label="final window")
        ax_loss.axvspan(lo, hi, color="tab:gray", alpha=0.15)
    nb, na = names[1 - baseline] if two else "X", names[baseline]
    s1 = stats.get(nb) if two else None
    if s1 is not None and s1.seeds:
        title = (f"{nb} - {na}: {s1.verdict} ({_pct(s1.mean_rel_diff)} +- "
                 f"{_pct(s1.sd_rel_diff, '.3f')} sd, N={s1.n})")
    else:
        title = f"({nb} - {na}) / {na}"
    ax_loss.set(xlabel="step", ylabel=f"loss, mean over the last {window} steps",
                title="windowed mean loss per run")
    ax_diff.set(xlabel="step", ylabel="relative difference %", title=title)
    for ax in (ax_loss, ax_diff):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
