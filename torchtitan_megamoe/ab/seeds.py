"""``run_seeds``: the multi-seed A/B (``--seeds N``): every side trained from each of N seeds,
judged by the seed-to-seed statistics of their final-window mean losses (``stats``).

Seeds are ``seed_base, seed_base + 1, ...``; each is given to every run as TorchTitan's
``--debug.seed`` (it seeds the initial weights and every RNG draw; TorchTitan's text datasets
read in file order, so all runs see the same batches). Each seed's runs live in
``<out>/seed<S>/`` and make a single-seed A/B of their own there (``driver.analyze_dir``: TOMLs,
logs, dump folders, report.md with the per-step table, ab.png, summary.json); ``--profile-step``
traces the first seed's runs only. The runs go seed by seed, side by side, one at a time or
``jobs`` at once within a deadline (``schedule.run_all``).

Two sides: A against B as before (differences B - A). Three or more: every side X against the
baseline (``baseline``, default the first side), each with its own differences X - baseline,
statistics and verdict; a run of one side and seed serves every comparison it is part of.
``<out>`` gets ``report.md`` (per-seed final-window means, their differences with mean, sd and
standard error, each side's spread across seeds, the verdicts and their rule, the runs and the
missing ones), ``seeds.png`` (trailing W-step mean losses of every run, and the per-seed
differences) and ``summary.json``.

``train=False`` (``--analyze``) trains nothing: it reads the ``seed<S>/<label>.log`` files already
under ``<out>`` (and the exit statuses each ``seed<S>/summary.json`` kept), e.g. one device call
per seed (a 10-minute limit) copied into one directory.

Exit status: 2 a run failed, was stopped or never started, or logged no step (its seed is left
out of the comparisons it is part of), else 1 when a verdict is "different", else 0
("indistinguishable", or "undetermined" with one seed).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field

from torchtitan_megamoe.ab import driver, schedule
from torchtitan_megamoe.ab.comparison import DEFAULT_ATOL, DEFAULT_RTOL
from torchtitan_megamoe.ab.configs import (
    DEFAULT_CONFIG,
    DEFAULT_SIDES,
    Side,
    _maybe_make_assets,
    baseline_index,
    cli_value,
)
from torchtitan_megamoe.ab.logs import run_stats
from torchtitan_megamoe.ab.report import (
    plot_seeds,
    render_runs,
    render_seed_report,
    render_sides_report,
)
from torchtitan_megamoe.ab.runner import _cuda_available, run_env
from torchtitan_megamoe.ab.stats import (
    DEFAULT_ALPHA,
    DEFAULT_GAP_LIMIT,
    DEFAULT_WINDOW,
    SeedStats,
    seed_result,
    seed_stats,
)
from torchtitan_megamoe.ab.trace import profile_args


@dataclass
class SeedsResult:
    exit_code: int
    stats: SeedStats  # the first comparison's (the only one with two sides)
    pairs: dict[int, driver.ABResult]  # seed -> its single-seed A/B (seed<S>/), likewise
    problems: list[str] = field(default_factory=list)
    out: str = ""
    comparisons: dict[str, SeedStats] = field(default_factory=dict)
    """Each side but the baseline -> its statistics against the baseline."""
    comparison_pairs: dict[str, dict] = field(default_factory=dict)  # side -> seed -> ABResult
    records: list = field(default_factory=list)  # schedule.RunRecord of every run


def seed_list(n: int, base: int) -> list[int]:
    if n < 1:
        raise ValueError(f"--seeds must be >= 1, got {n}")
    return [base + i for i in range(n)]


def default_seed_base(config: dict) -> int:
    """The config's ``[debug] seed``, else 0."""
    seed = config.get("debug", {}).get("seed")
    return seed if isinstance(seed, int) else 0


def run_seeds(
    config_path: str = DEFAULT_CONFIG,
    nproc: int = 1,
    out: str = "outputs/ab",
    extra: list[str] | None = None,
    seeds: int | list[int] = 3,
    sides: tuple[Side, ...] = DEFAULT_SIDES,
    window: int = DEFAULT_WINDOW,
    alpha: float = DEFAULT_ALPHA,
    gap_limit: float = DEFAULT_GAP_LIMIT,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    timeout: float = 1800.0,
    profile_step: int | None = None,
    train: bool = True,
    seed_base: int | None = None,
    baseline: str | None = None,
    jobs: int = 1,
    deadline_s: float | None = None,
    min_run_s: float = 0.0,
) -> SeedsResult:
    """``seeds``: a count (from ``seed_base``, default the config's ``[debug] seed`` or 0) or the
    list of seeds. ``baseline``: the label every other side is compared against (default the
    first side). ``jobs``, ``deadline_s`` (seconds from this call), ``min_run_s``:
    schedule.run_all. The other arguments are ``run_ab``'s and ``stats.seed_stats``'."""
    t0 = time.monotonic()
    config = driver.load_config(config_path, nproc)
    extra = list(extra or [])
    sides = tuple(sides)
    if window < 1:
        raise ValueError(f"--window must be >= 1, got {window}")
    for args in [extra] + [list(s.args) for s in sides]:
        if cli_value(args, "debug.seed") is not None:
            raise ValueError("--seeds sets --debug.seed of every run; do not pass it as well "
                             "(use --seed-base)")
    if isinstance(seeds, int):
        seeds = seed_list(seeds, default_seed_base(config) if seed_base is None else seed_base)
    seeds = list(seeds)
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"the seeds must be distinct and at least one, got {seeds}")
    names = tuple(s.label for s in sides)
    if len(names) < 2 or len(set(names)) != len(names):
        raise ValueError(f"an A/B needs two or more sides of different labels, got {names}")
    bi = baseline_index(sides, baseline)
    base = names[bi]
    others = [n for n in names if n != base]
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    os.makedirs(out, exist_ok=True)
    env = None
    if train:
        _maybe_make_assets(config, extra)
        env = run_env(out)  # one HF cache for all the runs
    dirs, extras, specs = {}, {}, []
    for i, seed in enumerate(seeds):
        d = dirs[seed] = os.path.join(out, f"seed{seed}")
        os.makedirs(d, exist_ok=True)
        extras[seed] = extra + ["--debug.seed", str(seed)] + (
            profile_args(profile_step) if profile_step and i == 0 else [])
        if train:
            driver.write_tomls(config, config_path, d, sides)
        specs += driver.side_specs(d, nproc, extras[seed], sides, seed, f"seed{seed}/")
    if train:
        print(f"[megamoe.ab] {len(specs)} runs ({len(seeds)} seeds x {len(sides)} sides), "
              f"{'one at a time' if jobs == 1 else f'up to {jobs} at a time'}"
              + (f", deadline {deadline_s:g} s" if deadline_s is not None else "")
              + f": {out}", flush=True)
        recs = schedule.run_all(specs, driver.run_one, env, timeout, jobs, deadline_s,
                                min_run_s, t0)
        records = {seed: {r.label: r for r in recs if r.seed == seed} for seed in seeds}
    else:
        records = {seed: driver.previous_records(dirs[seed], sides, f"seed{seed}/", seed)
                   for seed in seeds}
    dir_results: dict[int, driver.ABResult] = {}
    for i, seed in enumerate(seeds):
        cmds = [" ".join(sp.cmd) for sp in specs if sp.seed == seed]
        dir_results[seed] = driver.analyze_dir(
            config_path, nproc, dirs[seed], extras[seed], sides, records[seed], rtol, atol,
            profile_step if i == 0 else None, bi, cmds)
    overlapped = {seed: {lab for lab, r in records[seed].items() if r.overlapped}
                  for seed in seeds}
    all_records = [records[seed][n] for seed in seeds for n in names if n in records[seed]]
    comparisons: dict[str, tuple] = {}
    for other in others:
        pairs = {seed: dir_results[seed].comparisons[other] for seed in seeds}
        problems: list[str] = []
        results = []
        for seed in seeds:
            res = pairs[seed]
            pair = (base, other)
            logs = (res.stock, res.conv)
            failed = [n for n in pair if res.returncodes.get(n) != 0]
            failed += [n for n, run in zip(pair, logs) if not run.steps and n not in failed]
            r = None if failed else seed_result(seed, res.stock, res.conv, window)
            if failed or r is None:
                problems.append(f"seed {seed} left out: {_why(pair, logs, records[seed])}; "
                                f"see seed{seed}/report.md")
                continue
            results.append(r)
        st = seed_stats(results, (base, other), window, alpha, gap_limit)
        lasts = sorted({r.last_step for r in results})
        if len(lasts) > 1:
            problems.append(f"the seeds' final windows end at different steps: {lasts}")
        if results and min(r.window_steps for r in results) < min(window, lasts[0]):
            problems.append("a final window has fewer logged steps than --window (log_freq > "
                            "1, or a short run)")
        comparisons[other] = (st, pairs, problems)
    incomplete = any(st.n < len(seeds) or not st.n for st, _, _ in comparisons.values())
    exit_code = 2 if incomplete else (
        1 if any(st.verdict == "different" for st, _, _ in comparisons.values()) else 0)
    meta = {
        "config": config_path,
        "nproc": nproc,
        "extra_args": extra,
        "sides": driver._side_dicts(sides),
        "seeds": seeds,
        "window": window,
        "alpha": alpha,
        "gap_limit": gap_limit,
        "device": "CUDA" if _cuda_available() else "CPU (gloo, MEGAMOE_CPU shims)",
        "analyzed_only": not train,
        "jobs": max((r.jobs for r in all_records), default=jobs) if not train else jobs,
        "deadline_s": deadline_s if train else None,
        "runs": [r.to_dict() for r in all_records],
    }
    if len(sides) > 2 or bi:
        meta["baseline"] = base
    missing = [f"{r.key} ({r.status})" for r in all_records if not r.ok]
    per_seed_logs = {seed: {n: (dir_results[seed].comparisons[n].conv if n != base
                                else dir_results[seed].stock) for n in names}
                     for seed in seeds}
    with open(os.path.join(out, "report.md"), "w") as f:
        if len(sides) == 2:
            st, pairs, problems = comparisons[others[0]]
            speeds = {n: [run_stats(per_seed_logs[r.seed][n]) for r in st.seeds]
                      for n in (base, others[0])}
            f.write(render_seed_report(st, pairs, problems, meta, speeds, overlapped))
        else:
            f.write(render_sides_report(comparisons, meta, per_seed_logs, overlapped))
        f.write("\n" + render_runs(all_records, {r.key: per_seed_logs[r.seed][r.label]
                                                   for r in all_records}))
    # the plot shows the runs that finished (a stopped run's few steps would skew the means)
    runs = [(seed, *(per_seed_logs[seed][n] if records[seed][n].ok else None for n in names))
            for seed in seeds
            if any(records[seed][n].ok and per_seed_logs[seed][n].steps for n in names)]
    if runs:
        plot_seeds(runs, names, window, os.path.join(out, "seeds.png"),
                   comparisons[others[0]][0] if len(sides) == 2
                   else {k: v[0] for k, v in comparisons.items()}, bi)
    first_st, first_pairs, first_problems = comparisons[others[0]]
    summary = {
        "exit_code": exit_code,
        "baseline": base,
        "verdicts": {k: v[0].verdict for k, v in comparisons.items()},
        "comparisons": {k: {"names": [base, k], "verdict": v[0].verdict, "stats": asdict(v[0]),
                            "problems": v[2]} for k, v in comparisons.items()},
        "missing": missing,
        "per_seed": {str(s): {"returncodes": {n: r.code for n, r in dir_results[s].records.items()},
                              "exit_code": dir_results[s].exit_code,
                              "max_rel_step_diff": {k: dir_results[s].comparisons[k]
                                                    .comparison.max_rel_diff for k in others},
                              **{n: run_stats(per_seed_logs[s][n]) for n in names}}
                     for s in seeds},
        **meta,
    }
    if len(sides) == 2:  # the two-side A/B's keys
        summary.update({"verdict": first_st.verdict, "rule": first_st.rule,
                        "stats": asdict(first_st), "problems": first_problems})
        for s in seeds:
            summary["per_seed"][str(s)]["max_rel_step_diff"] = \
                first_pairs[s].comparison.max_rel_diff
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    all_problems = [p for _, _, probs in comparisons.values() for p in probs]
    if len(sides) > 2:
        all_problems = [f"{k}: {p}" for k, (_, _, probs) in comparisons.items() for p in probs]
    return SeedsResult(exit_code, first_st, first_pairs, all_problems, out,
                       {k: v[0] for k, v in comparisons.items()},
                       {k: v[1] for k, v in comparisons.items()}, all_records)


def _why(pair, logs, recs: dict) -> str:
    parts = []
    for n, run in zip(pair, logs):
        r = recs.get(n)
        if r is None or r.code is None:
            parts.append(f"{n} {r.status if r is not None else 'missing'}")
        else:
            st = "" if r.status in (schedule.OK, schedule.FAILED) else f" ({r.status})"
            parts.append(f"{n} exit {r.code}{st}, {len(run.steps)} steps")
    return ", ".join(parts)
