"""``run_ab``: the whole A/B, i.e. write both TOMLs, run both, compare, write the outputs."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

from torchtitan_megamoe.ab.comparison import DEFAULT_ATOL, DEFAULT_RTOL, Comparison, compare
from torchtitan_megamoe.ab.configs import (
    CONVERTER,
    DEFAULT_CONFIG,
    _maybe_make_assets,
    dump_toml,
    variant_configs,
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
    stock: RunLog
    conv: RunLog
    returncodes: dict[str, int]
    out: str


def run_ab(
    config_path: str = DEFAULT_CONFIG,
    nproc: int = 1,
    out: str = "outputs/ab",
    extra: list[str] | None = None,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    timeout: float = 1800.0,
    profile_step: int | None = None,
) -> ABResult:
    """``profile_step``: both runs trace that training step with TorchTitan's profiler, and
    report.md (and profile.md) gain rank 0's kernel time per category of the two side by side
    (ab/trace.py)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"config {config_path!r} not found; pass --config PATH.toml")
    extra = list(extra or []) + (profile_args(profile_step) if profile_step else [])
    with open(config_path, "rb") as f:
        config = tomllib.load(f)
    os.makedirs(out, exist_ok=True)
    _maybe_make_assets(config, extra)
    env = run_env(out)
    runs: dict[str, RunLog] = {}
    codes: dict[str, int] = {}
    commands: list[str] = []
    for name, variant in zip(("stock", CONVERTER), variant_configs(config)):
        toml_path = os.path.join(out, f"{name}.toml")
        with open(toml_path, "w") as f:
            f.write(f"# written by torchtitan_megamoe.ab from {config_path}\n")
            f.write(dump_toml(variant))
        cmd = torchrun_command(toml_path, nproc, os.path.join(out, name), extra)
        commands.append(" ".join(cmd))
        log_path = os.path.join(out, f"{name}.log")
        t0 = time.monotonic()
        codes[name] = run_one(cmd, log_path, env, timeout)
        print(
            f"[megamoe.ab] {name}: exit {codes[name]} in {time.monotonic() - t0:.1f} s, "
            f"log {log_path}",
            flush=True,
        )
        runs[name] = parse_log_file(log_path)
    cmp = compare(runs["stock"], runs[CONVERTER], rtol, atol)
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
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(render_report(runs["stock"], runs[CONVERTER], cmp, meta))
        if profile_step:
            section = ab_profile(out, profile_step, ("stock", CONVERTER))
            f.write("\n" + section)
            with open(os.path.join(out, "profile.md"), "w") as g:
                g.write(section)
    if runs["stock"].steps or runs[CONVERTER].steps:
        plot(runs["stock"], runs[CONVERTER], os.path.join(out, "ab.png"))
    failed_run = any(codes.values()) or not runs["stock"].steps or not runs[CONVERTER].steps
    exit_code = 2 if failed_run else (0 if cmp.ok else 1)
    summary = {
        "ok": cmp.ok,
        "exit_code": exit_code,
        "returncodes": codes,
        "comparison": asdict(cmp),
        "stock": run_stats(runs["stock"]),
        CONVERTER: run_stats(runs[CONVERTER]),
        **meta,
    }
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return ABResult(cmp.ok, exit_code, cmp, runs["stock"], runs[CONVERTER], codes, out)
