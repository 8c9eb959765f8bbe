"""TorchTitan step logs: the step lines of one rank's log, and a run's summary numbers."""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from datetime import datetime

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


def parse_log_file(path: str) -> RunLog:
    """``parse_log`` of a log file; a run that never wrote its log has no steps."""
    try:
        with open(path, errors="replace") as f:
            return parse_log(f.read())
    except OSError:
        return parse_log("")


def _steady(values: list[float | None]) -> list[float]:
    # Step 1 carries lazy init (first allocations, gloo/NCCL connections): leave it out of the
    # averages when there is anything else.
    vals = [v for v in values if v is not None]
    return vals[1:] if len(vals) > 1 else vals


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def run_stats(run: RunLog) -> dict[str, float]:
    times = _steady([s.time_s for s in run.steps])
    return {
        "steps": len(run.steps),
        "mean_tps": _mean(_steady([s.tps for s in run.steps])),
        "mean_step_time_s": _mean(times),
        # robust to the few slow steps a mean keeps: step 2's recompiles, a profiled step's dump
        "median_step_time_s": statistics.median(times) if times else float("nan"),
        "peak_memory_gib": max((s.memory_gib for s in run.steps), default=float("nan")),
        "final_loss": run.steps[-1].loss if run.steps else float("nan"),
    }
