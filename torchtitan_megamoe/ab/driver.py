"""``run_ab``: the whole A/B, i.e. write both TOMLs, run both, compare, write the outputs
(``run_pair`` does one seed's pair; ``seeds.run_seeds`` calls it once per seed)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

from torchtitan_megamoe.ab.comparison import DEFAULT_ATOL, DEFAULT_RTOL, Comparison, compare
from torchtitan_megamoe.ab.configs import (
    CONVERTER,
    DEFAULT_CONFIG,
    DEFAULT_SIDES,
    Side,
    _maybe_make_assets,
    dump_toml,
    side_configs,
)
from torchtitan_megamoe.ab.logs import RunLog, parse_log_file, run_stats
from torchtitan_megamoe.ab.report import plot, render_report
from torchtitan_megamoe.ab.runner import _cuda_available, run_env, run_one, torchrun_command
from torchtitan_megamoe.ab.trace import ab_profile, profile_args


@dataclass
class ABResult:
    ok: bool
    exit_code: int
    comparison: Comparison
    stock: RunLog  # side A (stock in a stock vs megamoe A/B)
    conv: RunLog  # side B
    returncodes: dict[str, int]
    out: str
    names: tuple[str, str] = ("stock", CONVERTER)


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
    sides: tuple[Side, Side] = DEFAULT_SIDES,
) -> ABResult:
    """``profile_step``: both runs trace that training step with TorchTitan's profiler, and
    report.md (and profile.md) gain rank 0's kernel time per category of the two side by side
    (ab/trace.py). ``sides``: what A and B are (configs.Side; default stock vs megamoe)."""
    config = load_config(config_path, nproc)
    extra = list(extra or [])
    os.makedirs(out, exist_ok=True)
    _maybe_make_assets(config, extra)
    return run_pair(config, config_path, nproc, out, extra, sides, rtol, atol, timeout,
                    profile_step)


def _side_dicts(sides) -> list[dict]:
    return [{"label": s.label, "kind": s.kind, "args": list(s.args)} for s in sides]


def _previous_codes(out: str) -> dict[str, int]:
    try:
        with open(os.path.join(out, "summary.json")) as f:
            return {k: int(v) for k, v in json.load(f).get("returncodes", {}).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def run_pair(
    config: dict,
    config_path: str,
    nproc: int,
    out: str,
    extra: list[str],
    sides: tuple[Side, Side] = DEFAULT_SIDES,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    timeout: float = 1800.0,
    profile_step: int | None = None,
    train: bool = True,
    env: dict[str, str] | None = None,
) -> ABResult:
    """One A/B in ``out`` (which exists): each side's TOML, run (its log, dump folder), the
    comparison, report.md, ab.png and summary.json. ``train=False`` runs nothing: it reads the
    logs already in ``out`` (exit statuses from the summary.json there, else 0). ``env``: the
    runs' environment (default ``run_env(out)``)."""
    sides = tuple(sides)
    names = tuple(s.label for s in sides)
    if len(sides) != 2 or names[0] == names[1]:
        raise ValueError(f"an A/B needs two sides of different labels, got {names}")
    extra = list(extra) + (profile_args(profile_step) if profile_step else [])
    previous = {} if train else _previous_codes(out)
    env = run_env(out) if env is None and train else env
    runs: dict[str, RunLog] = {}
    codes: dict[str, int] = {}
    commands: list[str] = []
    for side, variant in zip(sides, side_configs(config, sides)):
        name = side.label
        toml_path = os.path.join(out, f"{name}.toml")
        if train:
            with open(toml_path, "w") as f:
                f.write(f"# written by torchtitan_megamoe.ab from {config_path}\n")
                f.write(dump_toml(variant))
        cmd = torchrun_command(toml_path, nproc, os.path.join(out, name), extra + list(side.args))
        commands.append(" ".join(cmd))
        log_path = os.path.join(out, f"{name}.log")
        if train:
            t0 = time.monotonic()
            codes[name] = run_one(cmd, log_path, env, timeout)
            print(
                f"[megamoe.ab] {name}: exit {codes[name]} in {time.monotonic() - t0:.1f} s, "
                f"log {log_path}",
                flush=True,
            )
        else:
            codes[name] = previous.get(name, 0 if os.path.exists(log_path) else 2)
        runs[name] = parse_log_file(log_path)
    a, b = names
    default = sides == DEFAULT_SIDES
    cmp = compare(runs[a], runs[b], rtol, atol, ("stock", "converter") if default else names)
    for name, code in codes.items():
        if code != 0:
            cmp.problems.insert(0, f"the {name} run exited with status {code}; see {name}.log")
            cmp.ok = False
    meta = {
        "config": config_path,
        "nproc": nproc,
        "extra_args": extra,
        "device": "CUDA" if _cuda_available() else "CPU (gloo, MEGAMOE_CPU shims)",
        "commands": commands,
    }
    if not default:
        meta["sides"] = _side_dicts(sides)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(render_report(runs[a], runs[b], cmp, meta, names))
        if profile_step:
            section = ab_profile(out, profile_step, names)
            f.write("\n" + section)
            with open(os.path.join(out, "profile.md"), "w") as g:
                g.write(section)
    if runs[a].steps or runs[b].steps:
        plot(runs[a], runs[b], os.path.join(out, "ab.png"), names)
    failed_run = any(codes.values()) or not runs[a].steps or not runs[b].steps
    exit_code = 2 if failed_run else (0 if cmp.ok else 1)
    summary = {
        "ok": cmp.ok,
        "exit_code": exit_code,
        "returncodes": codes,
        "comparison": asdict(cmp),
        a: run_stats(runs[a]),
        b: run_stats(runs[b]),
        **meta,
    }
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return ABResult(cmp.ok, exit_code, cmp, runs[a], runs[b], codes, out, names)
