"""A/B run: the same TorchTitan config trained stock and with the ``megamoe`` converter.

    python -m torchtitan_megamoe.ab [--config X.toml] [--nproc N] [--out DIR] [--rtol R]
        [--atol A] [-- <extra torchtitan args, given to both runs>]

e.g. ``python -m torchtitan_megamoe.ab --nproc 2 -- --parallelism.expert_parallel_degree 2``.

Both runs use stock ``torchrun -m torchtitan.train``, the same TOML (two copies written into the
output dir that differ only in ``[model] converters``: TorchTitan's CLI cannot give an empty
list), the same seed and the same extra arguments. Rank 0's log of each run is kept; its step
lines (loss, grad norm, memory, tokens/s) and their timestamps (step time) are parsed, and the
output dir gets ``report.md`` (per-step table, max |diff|, max relative diff, tokens/s, memory,
step time), ``ab.png`` (loss curves and step times) and ``summary.json``.

Exit status: 0 losses agree within tolerance, 1 they do not, 2 a run failed or logged no steps.

On a machine without CUDA it sets ``MEGAMOE_CPU=1`` (the CPU shims, gloo) unless the caller set
it, and points the Hugging Face caches at a scratch dir with the offline switches on. If the
config reads the generated tiny assets (``<dir>/tokenizer`` and ``<dir>/dataset``) and they are
missing, it generates them (``torchtitan_megamoe.assets``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime

DEFAULT_CONFIG = "train_configs/qwen3_moe_tiny_cpu.toml"
CONVERTER = "megamoe"

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


# --------------------------------------------------------------------------------------------
# Log parsing.

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TIMESTAMP = re.compile(r"(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2},\d{3})")
_STEP = re.compile(
    r"step:\s*(?P<step>\d+)\s+"
    r"loss:\s*(?P<loss>\S+)\s+"
    r"grad_norm:\s*(?P<grad_norm>\S+)\s+"
    r"memory:\s*(?P<mem_gib>[\d.]+)GiB\((?P<mem_pct>[\d.]+)%\)\s+"
    r"tps:\s*(?P<tps>[\d,]+)\s+"
    r"tflops:\s*(?P<tflops>[\d.,]+)\s+"
    r"mfu:\s*(?P<mfu>[\d.]+)%"
)
_START = re.compile(r"Training starts at step (\d+)")


@dataclass
class Step:
    step: int
    loss: float
    grad_norm: float
    memory_gib: float
    memory_pct: float
    tps: float
    tflops: float
    mfu: float
    time_s: float | None = None
    """Wall time per step since the previous logged line (from log timestamps, ms resolution);
    over log_freq steps it is the average. None when no earlier timestamp exists."""


@dataclass
class RunLog:
    steps: list[Step] = field(default_factory=list)
    start_time: datetime | None = None

    def by_step(self) -> dict[int, Step]:
        return {s.step: s for s in self.steps}


def _parse_time(line: str) -> datetime | None:
    m = _TIMESTAMP.search(line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f") if m else None


def parse_log(text: str) -> RunLog:
    """Step lines of one rank's TorchTitan log (``[titan] ... step: N loss: ...``).

    If the log holds several ranks' lines (plain ``torchrun`` without ``--local-ranks-filter``),
    only the first line of each step is kept. ``validate step`` lines are skipped.
    """
    run = RunLog()
    last_time: datetime | None = None
    last_step = 0
    seen: set[int] = set()
    for raw in text.splitlines():
        line = _ANSI.sub("", raw)
        if run.start_time is None and _START.search(line):
            run.start_time = _parse_time(line)
            last_time = run.start_time
            if (m := _START.search(line)) is not None:
                last_step = int(m.group(1)) - 1
            continue
        m = _STEP.search(line)
        if m is None or "validate step" in line:
            continue
        step = int(m.group("step"))
        if step in seen:
            continue
        seen.add(step)
        now = _parse_time(line)
        time_s = None
        if now is not None and last_time is not None and step > last_step:
            time_s = (now - last_time).total_seconds() / (step - last_step)
        run.steps.append(
            Step(
                step=step,
                loss=float(m.group("loss")),
                grad_norm=float(m.group("grad_norm")),
                memory_gib=float(m.group("mem_gib")),
                memory_pct=float(m.group("mem_pct")),
                tps=float(m.group("tps").replace(",", "")),
                tflops=float(m.group("tflops").replace(",", "")),
                mfu=float(m.group("mfu")),
                time_s=time_s,
            )
        )
        if now is not None:
            last_time, last_step = now, step
    return run


# --------------------------------------------------------------------------------------------
# Comparison and report.


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


def compare(stock: RunLog, conv: RunLog, rtol: float, atol: float) -> Comparison:
    """Losses step by step; ok iff both logged the same steps and |a-b| <= atol + rtol*|a|."""
    a, b = stock.by_step(), conv.by_step()
    problems = []
    if not a:
        problems.append("the stock run logged no training step")
    if not b:
        problems.append("the converter run logged no training step")
    if set(a) != set(b) and a and b:
        problems.append(
            f"the runs logged different steps: stock {sorted(a)}, converter {sorted(b)}"
        )
    steps = sorted(set(a) & set(b))
    sl = [a[s].loss for s in steps]
    cl = [b[s].loss for s in steps]
    abs_diff = [abs(x - y) for x, y in zip(sl, cl)]
    rel_diff = [d / max(abs(x), 1e-12) for d, x in zip(abs_diff, sl)]
    for s, x, y, d in zip(steps, sl, cl, abs_diff):
        if not (math.isfinite(x) and math.isfinite(y)):
            problems.append(f"step {s}: non-finite loss (stock {x}, converter {y})")
        elif d > atol + rtol * abs(x):
            problems.append(
                f"step {s}: loss stock {x:.5f} vs converter {y:.5f}, |diff| {d:.2e} > "
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


def _steady(values: list[float | None]) -> list[float]:
    # Step 1 carries lazy init (first allocations, gloo/NCCL connections): leave it out of the
    # averages when there is anything else.
    vals = [v for v in values if v is not None]
    return vals[1:] if len(vals) > 1 else vals


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def run_stats(run: RunLog) -> dict[str, float]:
    return {
        "steps": len(run.steps),
        "mean_tps": _mean(_steady([s.tps for s in run.steps])),
        "mean_step_time_s": _mean(_steady([s.time_s for s in run.steps])),
        "peak_memory_gib": max((s.memory_gib for s in run.steps), default=float("nan")),
        "final_loss": run.steps[-1].loss if run.steps else float("nan"),
    }


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


# --------------------------------------------------------------------------------------------
# Running TorchTitan.


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} value {v!r} to TOML")


def dump_toml(data: dict, prefix: str = "") -> str:
    """TOML text for the nested dict of a TorchTitan config (tables, scalars, lists)."""
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    out = []
    if prefix and (scalars or not tables):
        out.append(f"[{prefix}]")
    out += [f"{k} = {_toml_value(v)}" for k, v in scalars.items()]
    if out:
        out.append("")
    for k, v in tables.items():
        out.append(dump_toml(v, f"{prefix}.{k}" if prefix else k))
    return "\n".join(out)


def variant_configs(config: dict, converter: str = CONVERTER) -> tuple[dict, dict]:
    """(stock, converter) copies of a loaded TOML that differ only in [model] converters."""
    import copy

    stock, conv = copy.deepcopy(config), copy.deepcopy(config)
    base = list(config.get("model", {}).get("converters", []))
    stock.setdefault("model", {})["converters"] = [c for c in base if c != converter]
    conv.setdefault("model", {})["converters"] = (
        base if converter in base else base + [converter]
    )
    if not config.get("job", {}).get("custom_config_module"):
        raise ValueError(
            "the config has no [job] custom_config_module; set it to "
            '"torchtitan_megamoe.config" (it registers the megamoe converter)'
        )
    return stock, conv


def cli_value(extra: list[str], key: str) -> str | None:
    """Value of ``--section.key`` in TorchTitan CLI args (``--a.b v``, ``--a.b=v``, dashes ok)."""
    names = {f"--{key}", f"--{key.replace('_', '-')}"}
    value = None
    for i, arg in enumerate(extra):
        name, eq, rest = arg.partition("=")
        if name in names:
            value = rest if eq else (extra[i + 1] if i + 1 < len(extra) else None)
    return value


def _maybe_make_assets(config: dict, extra: list[str]) -> None:
    from torchtitan_megamoe import assets

    tok = cli_value(extra, "model.hf_assets_path") or config.get("model", {}).get(
        "hf_assets_path"
    )
    data = cli_value(extra, "training.dataset_path") or config.get("training", {}).get(
        "dataset_path"
    )
    if not tok or not data:
        return
    root = os.path.dirname(os.path.normpath(tok))
    if os.path.normpath(tok) != os.path.normpath(assets.tokenizer_dir(root)):
        return
    if os.path.normpath(data) != os.path.normpath(assets.dataset_dir(root)):
        return
    if not (os.path.isdir(tok) and os.path.isdir(data)):
        assets.make_assets(root)


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def run_env(out: str) -> dict[str, str]:
    from torchtitan_megamoe.assets import offline_env

    env = dict(os.environ)
    if not _cuda_available():
        env.setdefault("MEGAMOE_CPU", "1")
        # Keep the dataset's Arrow cache out of the user's HF cache, and never touch the network.
        for k, v in offline_env(os.path.join(out, "hf_home")).items():
            env.setdefault(k, v)
    return env


def torchrun_command(config_path: str, nproc: int, dump: str, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free rendezvous port: concurrent runs do not collide
        f"--nproc_per_node={nproc}",
        "--local-ranks-filter=0",
        "-m",
        "torchtitan.train",
        "--job.config_file",
        config_path,
        "--job.dump_folder",
        dump,
        *extra,
    ]


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) from Linux /proc; empty elsewhere."""
    table = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            table[int(entry)] = (int(fields[1]), fields[19])
        except (OSError, ValueError, IndexError):
            continue
    return table


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of every process below ``pid``."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for p, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(p)
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append((c, table[c][1]))
            todo.append(c)
    return out


def _kill_group(proc: subprocess.Popen) -> None:
    # SIGTERM lets torchrun stop its workers. Each worker runs in a session of its own, so a
    # signal to torchrun's group does not reach them: whatever is still alive after the grace
    # period is killed by pid (checked against its start time), so that no worker keeps holding
    # the GPUs and NCCL ports into the next run.
    import signal

    workers = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    if proc.poll() is None:
        proc.kill()
    table = _proc_table()
    for pid, started in workers:
        if pid in table and table[pid][1] == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()


def run_one(cmd: list[str], log_path: str, env: dict[str, str], timeout: float) -> int:
    with open(log_path, "w") as log:
        # Own session: a timeout (or an interrupted ab) ends torchrun and all its workers.
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            log.write(f"\n[megamoe.ab] timed out after {timeout:.0f} s\n")
            return 124
        except BaseException:
            _kill_group(proc)
            raise


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
) -> ABResult:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"config {config_path!r} not found; pass --config PATH.toml")
    extra = list(extra or [])
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
        with open(log_path, errors="replace") as f:
            runs[name] = parse_log(f.read())
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_megamoe.ab",
        description="Train one TorchTitan config stock and with the megamoe converter; compare.",
        epilog="Arguments after -- go to torchtitan.train in both runs.",
    )
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"TOML (default {DEFAULT_CONFIG})")
    p.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per run (default 1)")
    p.add_argument("--out", default="outputs/ab", help="output dir (default outputs/ab)")
    p.add_argument("--rtol", type=float, default=DEFAULT_RTOL, help="relative loss tolerance")
    p.add_argument("--atol", type=float, default=DEFAULT_ATOL, help="absolute loss tolerance")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    args = p.parse_args(argv)
    # A SIGTERM (e.g. from `timeout`) becomes SystemExit, so the running torchrun is stopped too.
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    res = run_ab(args.config, args.nproc, args.out, extra, args.rtol, args.atol, args.timeout)
    with open(os.path.join(args.out, "report.md")) as f:
        print(f.read())
    return res.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
