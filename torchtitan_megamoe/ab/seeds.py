"""``run_seeds``: the multi-seed A/B (``--seeds N``): both sides trained from each of N seeds,
judged by the seed-to-seed statistics of their final-window mean losses (``stats``).

Seeds are ``seed_base, seed_base + 1, ...``; each is given to every run as TorchTitan's
``--debug.seed`` (it seeds the initial weights and every RNG draw; TorchTitan's text datasets
read in file order, so all runs see the same batches). Seed by seed, A then B, each pair is a
single-seed A/B of its own in ``<out>/seed<S>/`` (``driver.run_pair``: TOMLs, logs, dump
folders, report.md with the per-step table, ab.png, summary.json); ``--profile-step`` traces the
first seed's pair only. ``<out>`` gets ``report.md`` (per-seed final-window means, their
differences with mean, sd and standard error, each side's spread across seeds, the verdict and
its rule), ``seeds.png`` (trailing W-step mean losses of every run, and the per-seed
differences) and ``summary.json``.

``train=False`` (``--analyze``) trains nothing: it reads the ``seed<S>/<label>.log`` files already
under ``<out>``, e.g. one device call per seed (a 10-minute limit) copied into one directory.

Exit status: 2 a run failed or logged no step (its seed is left out of the statistics), else 1
when the verdict is "different", else 0 ("indistinguishable", or "undetermined" with one seed).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from torchtitan_megamoe.ab import driver
from torchtitan_megamoe.ab.comparison import DEFAULT_ATOL, DEFAULT_RTOL
from torchtitan_megamoe.ab.configs import (
    DEFAULT_CONFIG,
    DEFAULT_SIDES,
    Side,
    _maybe_make_assets,
    cli_value,
)
from torchtitan_megamoe.ab.logs import run_stats
from torchtitan_megamoe.ab.report import plot_seeds, render_seed_report
from torchtitan_megamoe.ab.runner import _cuda_available, run_env
from torchtitan_megamoe.ab.stats import (
    DEFAULT_ALPHA,
    DEFAULT_GAP_LIMIT,
    DEFAULT_WINDOW,
    SeedStats,
    seed_result,
    seed_stats,
)


@dataclass
class SeedsResult:
    exit_code: int
    stats: SeedStats
    pairs: dict[int, driver.ABResult]  # seed -> its single-seed A/B (seed<S>/)
    problems: list[str] = field(default_factory=list)
    out: str = ""


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
    sides: tuple[Side, Side] = DEFAULT_SIDES,
    window: int = DEFAULT_WINDOW,
    alpha: float = DEFAULT_ALPHA,
    gap_limit: float = DEFAULT_GAP_LIMIT,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    timeout: float = 1800.0,
    profile_step: int | None = None,
    train: bool = True,
    seed_base: int | None = None,
) -> SeedsResult:
    """``seeds``: a count (from ``seed_base``, default the config's ``[debug] seed`` or 0) or the
    list of seeds. The other arguments are ``run_ab``'s and ``stats.seed_stats``'."""
    config = driver.load_config(config_path, nproc)
    extra = list(extra or [])
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
    os.makedirs(out, exist_ok=True)
    env = None
    if train:
        _maybe_make_assets(config, extra)
        env = run_env(out)  # one HF cache for all the runs
    pairs: dict[int, driver.ABResult] = {}
    problems: list[str] = []
    results = []
    for i, seed in enumerate(seeds):
        d = os.path.join(out, f"seed{seed}")
        os.makedirs(d, exist_ok=True)
        if train:
            print(f"[megamoe.ab] seed {seed} ({i + 1} of {len(seeds)}): {d}", flush=True)
        res = driver.run_pair(
            config, config_path, nproc, d, extra + ["--debug.seed", str(seed)], sides, rtol,
            atol, timeout, profile_step if i == 0 else None, train, env,
        )
        pairs[seed] = res
        failed = [n for n, c in res.returncodes.items() if c != 0]
        failed += [n for n, run in zip(names, (res.stock, res.conv)) if not run.steps and
                   n not in failed]
        r = None if failed else seed_result(seed, res.stock, res.conv, window)
        if failed or r is None:
            why = ", ".join(f"{n} exit {res.returncodes.get(n)}, {len(run.steps)} steps"
                            for n, run in zip(names, (res.stock, res.conv)))
            problems.append(f"seed {seed} left out: {why}; see seed{seed}/report.md")
            continue
        results.append(r)
    st = seed_stats(results, names, window, alpha, gap_limit)
    lasts = sorted({r.last_step for r in results})
    if len(lasts) > 1:
        problems.append(f"the seeds' final windows end at different steps: {lasts}")
    if results and min(r.window_steps for r in results) < min(window, lasts[0]):
        problems.append("a final window has fewer logged steps than --window (log_freq > 1, or "
                        "a short run)")
    exit_code = 2 if (len(results) < len(seeds) or not results) else (
        1 if st.verdict == "different" else 0)
    meta = {
        "config": config_path,
        "nproc": nproc,
        "extra_args": extra,
        "sides": driver._side_dicts(sides),
        "seeds": seeds,
        "device": "CUDA" if _cuda_available() else "CPU (gloo, MEGAMOE_CPU shims)",
        "analyzed_only": not train,
    }
    kept = [r.seed for r in results]
    speeds = {names[0]: [run_stats(pairs[s].stock) for s in kept],
              names[1]: [run_stats(pairs[s].conv) for s in kept]}
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(render_seed_report(st, pairs, problems, meta, speeds))
    runs = [(s, pairs[s].stock, pairs[s].conv) for s in seeds if pairs[s].stock.steps or
            pairs[s].conv.steps]
    if runs:
        plot_seeds(runs, names, window, os.path.join(out, "seeds.png"), st)
    summary = {
        "exit_code": exit_code,
        "verdict": st.verdict,
        "rule": st.rule,
        "stats": asdict(st),
        "problems": problems,
        "per_seed": {str(s): {"returncodes": p.returncodes, "exit_code": p.exit_code,
                              "max_rel_step_diff": p.comparison.max_rel_diff,
                              names[0]: run_stats(p.stock), names[1]: run_stats(p.conv)}
                     for s, p in pairs.items()},
        **meta,
    }
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    return SeedsResult(exit_code, st, pairs, problems, out)
