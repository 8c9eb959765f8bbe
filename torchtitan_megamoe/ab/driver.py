"""``run_ab``: the whole A/B, i.e. write each side's TOML, run them, compare, write the outputs
(``run_pair`` does one directory's runs, e.g. one seed's; ``seeds.run_seeds`` calls the same
parts for every seed).

A directory holds one run per side (``<label>.toml``, ``<label>.log``, dump folder
``<label>/``). With two sides its report.md, ab.png and summary.json are the A/B of A and B;
with more, every side is compared against the baseline (``--baseline``, default the first side)
and report.md has one such A/B per other side."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field

from torchtitan_megamoe.ab import failures, schedule
from torchtitan_megamoe.ab.comparison import DEFAULT_ATOL, DEFAULT_RTOL, Comparison, compare
from torchtitan_megamoe.ab.configs import (
    CONVERTER,
    DEFAULT_CONFIG,
    DEFAULT_SIDES,
    Side,
    _maybe_make_assets,
    baseline_index,
    dump_toml,
    side_configs,
)
from torchtitan_megamoe.ab.logs import RunLog, parse_log_file, run_stats
from torchtitan_megamoe.ab.report import plot_runs, render_report, render_runs
from torchtitan_megamoe.ab.runner import _cuda_available, run_env, run_one, torchrun_command
from torchtitan_megamoe.ab.memory import ab_memory, snapshot_args
from torchtitan_megamoe.ab.trace import ab_profile, profile_args


@dataclass
class ABResult:
    ok: bool
    exit_code: int
    comparison: Comparison
    stock: RunLog  # side A (stock in a stock vs megamoe A/B; the baseline with more sides)
    conv: RunLog  # side B (the other side)
    returncodes: dict[str, int | None]  # None: the run never started
    out: str
    names: tuple[str, str] = ("stock", CONVERTER)
    comparisons: dict = field(default_factory=dict)
    """Other side's label -> its ABResult against the baseline (every side but the baseline;
    this result is the first of them)."""
    records: dict = field(default_factory=dict)  # label -> schedule.RunRecord


def load_config(config_path: str, nproc: int) -> dict:
    """The TOML at ``config_path``, after checking the arguments every A/B needs."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"config {config_path!r} not found; pass --config PATH.toml")
    with open(config_path, "rb") as f:
        return tomllib.load(f)


def run_ab(
    config_path: str = DEFAULT_CONFIG,
    nproc: int = 1,
    out: str = "outputs/ab",
    extra: list[str] | None = None,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    timeout: float = 1800.0,
    profile_step: int | None = None,
    sides: tuple[Side, ...] = DEFAULT_SIDES,
    baseline: str | None = None,
    jobs: int = 1,
    deadline_s: float | None = None,
    min_run_s: float = 0.0,
) -> ABResult:
    """``profile_step``: every run traces that training step with TorchTitan's profiler, and
    report.md (and profile.md) gain rank 0's kernel time per category side by side
    (ab/trace.py). ``sides``: what A and B (and more) are (configs.Side; default stock vs
    megamoe); ``baseline`` the label the others are compared against (default the first).
    ``jobs``, ``deadline_s``, ``min_run_s``: schedule.run_all."""
    t0 = time.monotonic()
    config = load_config(config_path, nproc)
    extra = list(extra or [])
    os.makedirs(out, exist_ok=True)
    _maybe_make_assets(config, extra)
    return run_pair(config, config_path, nproc, out, extra, sides, rtol, atol, timeout,
                    profile_step, baseline=baseline, jobs=jobs, deadline_s=deadline_s,
                    min_run_s=min_run_s, t0=t0)


def _side_dicts(sides) -> list[dict]:
    return [{"label": s.label, "kind": s.kind, "args": list(s.args)} for s in sides]


def _previous_summary(out: str) -> dict:
    try:
        with open(os.path.join(out, "summary.json")) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _previous_codes(out: str) -> dict[str, int]:
    try:
        codes = _previous_summary(out).get("returncodes", {})
        return {k: int(v) for k, v in codes.items() if v is not None}
    except (ValueError, AttributeError, TypeError):
        return {}


def previous_records(out: str, sides, key_prefix: str = "", seed: int | None = None) -> dict:
    """label -> schedule.RunRecord of the runs already in ``out`` (``--analyze``): the records
    its summary.json kept, else its exit statuses, else 0 for a log that exists and "missing"
    for one that does not."""
    summary = _previous_summary(out)
    kept = summary.get("runs") if isinstance(summary.get("runs"), dict) else {}
    codes = _previous_codes(out)
    records = {}
    for s in sides:
        log_path = os.path.join(out, f"{s.label}.log")
        if isinstance(kept.get(s.label), dict):
            rec = schedule.RunRecord.from_dict(kept[s.label])
            rec.log_path = log_path
        elif s.label in codes:
            c = codes[s.label]
            rec = schedule.RunRecord(key_prefix + s.label, s.label, seed, log_path,
                                     schedule.status_of(c, None, 0.0), c)
        elif os.path.exists(log_path):
            rec = schedule.RunRecord(key_prefix + s.label, s.label, seed, log_path,
                                     schedule.OK, 0)
        else:
            rec = schedule.RunRecord(key_prefix + s.label, s.label, seed, log_path,
                                     schedule.MISSING, None)
        records[s.label] = rec
    return records


def write_tomls(config: dict, config_path: str, out: str, sides) -> None:
    """``<out>/<label>.toml`` of each side: the config with or without the converter."""
    for side, variant in zip(sides, side_configs(config, sides)):
        with open(os.path.join(out, f"{side.label}.toml"), "w") as f:
            f.write(f"# written by torchtitan_megamoe.ab from {config_path}\n")
            f.write(dump_toml(variant))


def side_specs(out: str, nproc: int, extra: list[str], sides, seed: int | None = None,
               key_prefix: str = "") -> list[schedule.RunSpec]:
    """One run per side in ``out``: its torchrun command (the common args, then the side's),
    log path and key (``key_prefix + label``)."""
    specs = []
    for side in sides:
        cmd = torchrun_command(os.path.join(out, f"{side.label}.toml"), nproc,
                               os.path.join(out, side.label), list(extra) + list(side.args))
        specs.append(schedule.RunSpec(key_prefix + side.label, side.label, seed, cmd,
                                      os.path.join(out, f"{side.label}.log")))
    return specs


def _exit_code(codes: dict, runs: dict, ok: bool) -> int:
    failed = any(c != 0 for c in codes.values()) or not all(r.steps for r in runs.values())
    return 2 if failed else (0 if ok else 1)


def _run_problem(name: str, rec, out: str) -> str:
    if rec is None or rec.code is None:
        why = rec.status if rec is not None else "missing"
        return f"the {name} run did not run: {why}"
    extra = "" if rec.status in (schedule.OK, schedule.FAILED) else f" ({rec.status})"
    ranks = failures.describe(_read(os.path.join(out, f"{name}.log")), os.path.join(out, name))
    return (f"the {name} run exited with status {rec.code}{extra}"
            + (f" ({ranks})" if ranks else "") + f"; see {name}.log and {name}/ranks/")


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def configured_steps(out: str, label: str, extra: list[str]) -> int:
    """``training.steps`` of side ``label``'s run: its TOML, unless ``extra`` overrides it."""
    for i, a in enumerate(extra):
        if a == "--training.steps" and i + 1 < len(extra):
            return int(extra[i + 1])
        if a.startswith("--training.steps="):
            return int(a.split("=", 1)[1])
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        with open(os.path.join(out, f"{label}.toml"), "rb") as f:
            return int(tomllib.load(f).get("training", {}).get("steps", 0))
    except (OSError, ValueError):
        return 0


def _teardown_aborts(out: str, extra: list[str], runs: dict, codes: dict) -> list[str]:
    """Labels whose nonzero exit was a gloo teardown abort after every step (CPU runs only);
    their codes become 0 in ``codes``."""
    if _cuda_available():
        return []
    done = []
    for lab, code in codes.items():
        if code in (None, 0):
            continue
        steps = max((s.step for s in runs[lab].steps), default=0)
        if failures.teardown_abort(_read(os.path.join(out, f"{lab}.log")), steps,
                                   configured_steps(out, lab, extra)):
            codes[lab] = 0
            done.append(lab)
    return done


def analyze_dir(
    config_path: str,
    nproc: int,
    out: str,
    extra: list[str],
    sides,
    records: dict,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    profile_step: int | None = None,
    baseline: int = 0,
    commands: list[str] | None = None,
) -> ABResult:
    """The A/B of the runs in ``out`` from their logs and ``records`` (label ->
    schedule.RunRecord): every side against side ``baseline``; writes report.md, ab.png and
    summary.json. Returns the first comparison's ABResult, all of them in ``.comparisons``,
    ``exit_code`` over all (2 a run failed or logged no step, 1 a comparison failed, else 0)."""
    sides = tuple(sides)
    labels = [s.label for s in sides]
    base = sides[baseline]
    runs = {s.label: parse_log_file(os.path.join(out, f"{s.label}.log")) for s in sides}
    codes = {s.label: records[s.label].code if s.label in records else None for s in sides}
    aborted = _teardown_aborts(out, list(extra), runs, codes)
    default = sides == DEFAULT_SIDES and baseline == 0
    overlapped = sorted(lab for lab, r in records.items() if r.overlapped)
    meta = {
        "config": config_path,
        "nproc": nproc,
        "extra_args": list(extra),
        "device": "CUDA" if _cuda_available() else "CPU (gloo, MEGAMOE_CPU shims)",
        "commands": list(commands or []),
    }
    if not default:
        meta["sides"] = _side_dicts(sides)
    if len(sides) > 2 or baseline:
        meta["baseline"] = base.label
    if overlapped:
        meta["overlapped"] = overlapped
        meta["jobs"] = max(r.jobs for r in records.values())
    if aborted:
        meta["teardown_aborts"] = aborted
    results: dict[str, ABResult] = {}
    sections = []
    for other in sides:
        if other.label == base.label:
            continue
        names = (base.label, other.label)
        cmp = compare(runs[names[0]], runs[names[1]], rtol, atol,
                      ("stock", "converter") if default else names)
        for name in reversed(names):
            if codes[name] != 0:
                cmp.problems.insert(0, _run_problem(name, records.get(name), out))
                cmp.ok = False
        pair_codes = {n: codes[n] for n in names}
        res = ABResult(cmp.ok, _exit_code(pair_codes, {n: runs[n] for n in names}, cmp.ok),
                       cmp, runs[names[0]], runs[names[1]], pair_codes, out, names,
                       records={n: records[n] for n in names if n in records})
        results[other.label] = res
        pair_meta = dict(meta)
        pair_meta.pop("baseline", None)
        if len(sides) > 2:  # a section of the directory's report: its head has the rest
            pair_meta.update(commands=[], sides=_side_dicts((base, other)), section=True)
        if overlapped:
            pair_meta["overlapped"] = [n for n in names if n in overlapped]
        sections.append(render_report(runs[names[0]], runs[names[1]], cmp, pair_meta, names))
    first = next(iter(results.values()))
    exit_code = max((r.exit_code for r in results.values()),
                    key=lambda c: (c == 2, c == 1))
    with open(os.path.join(out, "report.md"), "w") as f:
        if len(sides) == 2:
            f.write(sections[0])
        else:
            f.write(render_runs_header(meta, sides, baseline, results))
            for text in sections:
                f.write("\n" + ("#" + text if text.startswith("# ") else text))
            if meta["commands"]:
                f.write("\nCommands:\n\n" + "".join(f"    {c}\n" for c in meta["commands"]))
        if any(r.start_s is not None for r in records.values()) or len(sides) > 2:
            f.write("\n" + render_runs([records[lab] for lab in labels if lab in records],
                                       runs_by_key={records[lab].key: runs[lab]
                                                    for lab in labels if lab in records}))
        if profile_step:
            section = ab_profile(out, profile_step, tuple(labels))
            if snapshot_args()[0] in extra:  # --memory-snapshot
                section += "\n" + ab_memory(out, profile_step, tuple(labels))
            f.write("\n" + section)
            with open(os.path.join(out, "profile.md"), "w") as g:
                g.write(section)
    if any(r.steps for r in runs.values()):
        plot_runs([runs[lab] for lab in labels], labels, os.path.join(out, "ab.png"),
                  overlapped=overlapped)
    summary = {"ok": all(r.ok for r in results.values()), "exit_code": exit_code,
               "returncodes": codes}
    if len(sides) == 2:
        summary["comparison"] = asdict(first.comparison)
    else:
        summary["baseline"] = base.label
        summary["comparisons"] = {lab: {"ok": r.ok, "exit_code": r.exit_code,
                                        "comparison": asdict(r.comparison)}
                                  for lab, r in results.items()}
    summary.update({lab: run_stats(runs[lab]) for lab in labels})
    summary["runs"] = {lab: records[lab].to_dict() for lab in labels if lab in records}
    summary.update({k: v for k, v in meta.items() if k not in summary})
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    first.exit_code = exit_code
    first.comparisons = results
    first.records = dict(records)
    return first


def render_runs_header(meta: dict, sides, baseline: int, results: dict) -> str:
    """The head of a directory's report.md with three or more sides: the sides, and one line
    per comparison against the baseline."""
    from torchtitan_megamoe.ab.report import sides_line

    base = sides[baseline].label
    lines = [
        f"# megamoe A/B: {len(sides)} sides against {base}",
        "",
        f"- config: `{meta.get('config')}`, nproc {meta.get('nproc')}, "
        f"extra args: `{' '.join(meta.get('extra_args', [])) or '(none)'}`",
        sides_line(meta["sides"], base),
        f"- device: {meta.get('device')}",
        "",
        f"| {base} vs | verdict | steps | max abs diff | max rel diff |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for lab, r in results.items():
        c = r.comparison
        verdict = "RUN FAILED" if r.exit_code == 2 else ("PASS" if r.ok else "FAIL")
        lines.append(f"| {lab} | {verdict} | {len(c.steps)} | {c.max_abs_diff:.2e} | "
                     f"{c.max_rel_diff:.2e} |")
    return "\n".join(lines) + "\n"


def run_pair(
    config: dict,
    config_path: str,
    nproc: int,
    out: str,
    extra: list[str],
    sides: tuple[Side, ...] = DEFAULT_SIDES,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    timeout: float = 1800.0,
    profile_step: int | None = None,
    train: bool = True,
    env: dict[str, str] | None = None,
    baseline: str | None = None,
    jobs: int = 1,
    deadline_s: float | None = None,
    min_run_s: float = 0.0,
    t0: float | None = None,
) -> ABResult:
    """One A/B in ``out`` (which exists): each side's TOML, run (its log, dump folder), the
    comparisons, report.md, ab.png and summary.json (``analyze_dir``). ``train=False`` runs
    nothing: it reads the logs already in ``out`` (exit statuses from the summary.json there,
    else 0). ``env``: the runs' environment (default ``run_env(out)``); ``jobs``,
    ``deadline_s``, ``min_run_s``, ``t0``: schedule.run_all."""
    sides = tuple(sides)
    names = [s.label for s in sides]
    if len(sides) < 2 or len(set(names)) != len(names):
        raise ValueError(f"an A/B needs two or more sides of different labels, got {names}")
    bi = baseline_index(sides, baseline)
    extra = list(extra) + (profile_args(profile_step) if profile_step else [])
    specs = side_specs(out, nproc, extra, sides)
    if train:
        write_tomls(config, config_path, out, sides)
        env = run_env(out) if env is None else env
        recs = schedule.run_all(specs, run_one, env, timeout, jobs, deadline_s, min_run_s, t0)
        records = {r.label: r for r in recs}
    else:
        records = previous_records(out, sides)
    return analyze_dir(config_path, nproc, out, extra, sides, records, rtol, atol, profile_step,
                       bi, [" ".join(s.cmd) for s in specs])
