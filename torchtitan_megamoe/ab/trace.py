"""Where a training step's GPU time goes, from the Chrome trace TorchTitan's profiler writes
(``--profiling.enable_profiling --profiling.profile_freq N``: one trace per rank of step N,
``<dump>/profile_traces/iteration_N/rank<r>_trace.json``).

Kernels are put into categories by name (first match of ``CATEGORIES``), summed per category,
and set against the step's wall time and the time at least one kernel ran (the union of the
kernel intervals, over all streams). Where no kernel runs, the GPU idles: each gap is charged to
the host op that issued the kernel ending it (the innermost CPU op around that kernel's launch,
and the outermost one inside the step), and the blocking runtime calls (cudaFree, synchronize,
...) that overlap a gap are summed. Comparing the stock and the converter trace of the same
config shows how much of the step the MoE layers still take and what the rest is:

    python -m torchtitan_megamoe.ab.trace stock=<stock trace.json> megamoe=<megamoe trace.json>
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torchtitan_megamoe
from torchtitan_megamoe.ab import named_runs


def _our_triton_kernels() -> str:
    """The package's Triton kernels' names (each ``def _<name>_kernel`` in its sources), as
    one alternation: read from the sources, so a new kernel is never counted as another's.
    Row copies (the EP exchange's transfers) and the link's pacing are left to the copies and
    "other": they stand for the link, not for our compute."""
    names = set()
    for path in Path(torchtitan_megamoe.__file__).parent.rglob("*.py"):
        names.update(re.findall(r"^def _(\w+)_kernel\(", path.read_text(), re.M))
    return "|".join(sorted(n for n in names if "copy" not in n and n != "pace"))


CATEGORIES = (
    # csrc/'s kernels live in namespace megamoe (the bf16 grouped GEMMs, the FP8 GEMMs)
    ("megamoe sm90 GEMMs", re.compile(r"megamoe::|grouped_gemm_kernel")),
    ("megamoe Triton kernels", re.compile(rf"^_({_our_triton_kernels()})_kernel")),
    ("DeepGEMM (FP8 GEMMs)", re.compile(r"deep_gemm")),
    # the EP exchange's symmetric-memory barriers: mostly one rank waiting for the other
    ("symmetric-memory barriers (EP sync)", re.compile(r"symmetric_memory.*barrier", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn", re.I)),
    ("NCCL", re.compile(r"nccl", re.I)),
    ("optimizer (multi-tensor apply)", re.compile(r"multi_tensor_apply")),
    ("FSDP packing (chunk_cat, split)", re.compile(r"chunk_cat|split_with_sizes")),
    # torch._grouped_mm's CUTLASS kernels carry GroupProblemShape in their mangled names
    ("grouped GEMMs (stock experts)", re.compile(r"grouped|group_?mm|GroupProblemShape", re.I)),
    ("dense GEMMs", re.compile(r"gemm|xmma|nvjet|cutlass|sm90_|cublas", re.I)),
    ("torch.compile Triton kernels", re.compile(r"^triton_")),
    ("copies and fills", re.compile(r"memcpy|memset|copy|fill", re.I)),
)
"""(name, pattern) pairs; the first whose pattern matches a kernel's name takes it, else
"other". Our own kernels come first so that a name like _wgrad_kernel is not counted as a
dense GEMM."""


@dataclass
class StepProfile:
    step_ms: float  # wall time of the profiled step (its ProfilerStep annotation)
    busy_ms: float  # time at least one kernel ran, within the step
    by_category: dict = field(default_factory=dict)  # category -> summed kernel ms
    top: list = field(default_factory=list)  # (kernel name, calls, summed ms), largest first
    # GPU idle gaps by the host op that issued the kernel ending them: (op, gaps, idle ms),
    # largest first; by the innermost op, and by the outermost one inside the step
    idle_inner: list = field(default_factory=list)
    idle_outer: list = field(default_factory=list)
    blocking: list = field(default_factory=list)  # (runtime call, calls, ms within gaps)
    # median µs of the step's kernel launch calls: the host's speed in that run (the same
    # launches took ~30% longer in one run than another on one machine: idle time compares
    # across runs only where this does)
    launch_us: float = 0.0


MIN_GAP_US = 5.0
"""Shorter gaps between kernels are launch latency, not idle time worth charging."""

BLOCKING = re.compile(r"^(cudaFree|cudaMalloc|cu(da)?.*Synchronize|cudaMemcpy$|cudaMemcpy2D$|"
                      r"cuMem(Map|Unmap|Create|Release|SetAccess|AddressFree)|cudaHostAlloc|"
                      r"cudaFreeHost)")
"""Runtime and driver calls that can hold the host while the GPU drains."""


def category(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if pattern.search(name):
            return cat
    return "other"


def _union_ms(intervals: list) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total / 1e3


def summarize(trace: dict, top: int = 15) -> StepProfile:
    """The profile of the last ProfilerStep in ``trace`` (a loaded Chrome trace; times in µs).
    Without a ProfilerStep annotation every kernel counts and the step is their span."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(
        "ProfilerStep#")]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    if steps:
        step = max(steps, key=lambda e: e["ts"])
        lo, hi = step["ts"], step["ts"] + step["dur"]
        # a step's kernels may run past its CPU span (queued work): keep those launched in it
        kernels = [k for k in kernels if k["ts"] >= lo]
        hi = max([hi] + [k["ts"] + k["dur"] for k in kernels])
    elif kernels:
        lo = min(k["ts"] for k in kernels)
        hi = max(k["ts"] + k["dur"] for k in kernels)
    else:
        return StepProfile(0.0, 0.0)
    by_cat: dict = {}
    by_name: dict = {}
    for k in kernels:
        ms = k["dur"] / 1e3
        cat = category(k["name"])
        by_cat[cat] = by_cat.get(cat, 0.0) + ms
        calls, total = by_name.get(k["name"], (0, 0.0))
        by_name[k["name"]] = (calls + 1, total + ms)
    ranked = sorted(((n, c, t) for n, (c, t) in by_name.items()), key=lambda r: -r[2])
    inner, outer, blocking = _idle(events, kernels, lo, top)
    launches = sorted(e["dur"] for e in events if e.get("ph") == "X"
                      and e.get("cat") in ("cuda_runtime", "cuda_driver")
                      and "Launch" in str(e.get("name", "")) and e["ts"] >= lo)
    return StepProfile(
        step_ms=(hi - lo) / 1e3,
        busy_ms=_union_ms([(k["ts"], k["ts"] + k["dur"]) for k in kernels]),
        by_category=dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
        top=ranked[:top],
        idle_inner=inner,
        idle_outer=outer,
        blocking=blocking,
        launch_us=launches[len(launches) // 2] if launches else 0.0,
    )


def _gaps(kernels: list, lo: float) -> list:
    """(start, end, kernel ending it) of every idle stretch >= MIN_GAP_US from ``lo`` on."""
    gaps, end = [], lo
    for k in sorted(kernels, key=lambda k: k["ts"]):
        if k["ts"] - end >= MIN_GAP_US:
            gaps.append((end, k["ts"], k))
        end = max(end, k["ts"] + k["dur"])
    return gaps


def _ranked(acc: dict, top: int) -> list:
    return sorted(((n, c, t / 1e3) for n, (c, t) in acc.items()), key=lambda r: -r[2])[:top]


def _add(acc: dict, name: str, us: float) -> None:
    calls, total = acc.get(name, (0, 0.0))
    acc[name] = (calls + 1, total + us)


def _idle(events: list, kernels: list, lo: float, top: int):
    """The step's GPU idle gaps charged to host ops and blocking calls (module docstring)."""
    runtime = [e for e in events if e.get("ph") == "X"
               and e.get("cat") in ("cuda_runtime", "cuda_driver")]
    launch = {e.get("args", {}).get("correlation"): e for e in runtime}
    host = {}  # tid -> its CPU ops in the step, by start
    for e in events:
        if (e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation",
                                                    "python_function")
                and not str(e.get("name", "")).startswith("ProfilerStep#")):
            host.setdefault(e.get("tid"), []).append(e)
    inner, outer, blocking = {}, {}, {}
    gaps = _gaps(kernels, lo)
    for g0, g1, k in gaps:
        call = launch.get(k.get("args", {}).get("correlation"))
        at = call["ts"] if call else None
        around = [e for e in host.get(call["tid"], []) if e["ts"] <= at <= e["ts"] + e["dur"]] \
            if call else []
        around.sort(key=lambda e: (e["ts"], -e["dur"]))
        _add(inner, around[-1]["name"] if around else "(no host op)", g1 - g0)
        _add(outer, around[0]["name"] if around else "(no host op)", g1 - g0)
    for e in runtime:
        if not BLOCKING.match(str(e.get("name", ""))):
            continue
        us = sum(max(0.0, min(g1, e["ts"] + e["dur"]) - max(g0, e["ts"])) for g0, g1, _ in gaps)
        if us > 0:
            _add(blocking, e["name"], us)
    return _ranked(inner, top), _ranked(outer, top), _ranked(blocking, top)


def report(profiles: dict) -> str:
    """A markdown table per category (one column per profile) and each profile's top kernels."""
    names = list(profiles)
    cats = []
    for p in profiles.values():
        cats += [c for c in p.by_category if c not in cats]
    lines = ["| | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    lines.append("| step wall ms | " + " | ".join(f"{p.step_ms:.1f}" for p in profiles.values())
                 + " |")
    lines.append("| GPU busy ms (any kernel running) | "
                 + " | ".join(f"{p.busy_ms:.1f}" for p in profiles.values()) + " |")
    lines.append("| GPU idle ms (no kernel running) | "
                 + " | ".join(f"{p.step_ms - p.busy_ms:.1f}" for p in profiles.values()) + " |")
    lines.append("| kernel launch call, median µs (the host's speed) | "
                 + " | ".join(f"{p.launch_us:.1f}" for p in profiles.values()) + " |")
    for c in cats:
        lines.append(f"| {c} (summed kernel ms) | "
                     + " | ".join(f"{p.by_category.get(c, 0.0):.1f}" for p in profiles.values())
                     + " |")
    for name, p in profiles.items():
        lines += ["", f"Top kernels, {name}:", "", "| kernel | calls | ms |", "| --- | ---: | ---: |"]
        lines += [f"| `{n[:90]}` | {c} | {t:.2f} |" for n, c, t in p.top]
    for name, p in profiles.items():
        for title, rows in ((f"GPU idle by the host op that issued the next kernel, {name} "
                             "(innermost op)", p.idle_inner),
                            (f"... by the outermost op in the step, {name}", p.idle_outer),
                            (f"Blocking runtime calls during the idle gaps, {name}",
                             p.blocking)):
            if rows:
                head = "| call | calls | ms in gaps |" if title.startswith("Blocking") else \
                    "| host op | gaps | idle ms |"
                lines += ["", f"{title}:", "", head, "| --- | ---: | ---: |"]
                lines += [f"| `{n[:90]}` | {c} | {t:.2f} |" for n, c, t in rows]
    return "\n".join(lines)


def profile_args(step: int) -> list[str]:
    """TorchTitan arguments that trace step ``step`` (>= 4: its profiler warms up 3 steps)."""
    if step < 4:
        raise ValueError(f"the profiled step must be >= 4 (TorchTitan's profiler warms up for "
                         f"3 steps before it), got {step}")
    return ["--profiling.enable_profiling", "--profiling.profile_freq", str(step)]


def ab_profile(out: str, step: int, runs: tuple = ("stock", "megamoe")) -> str:
    """The markdown section comparing rank 0's traced ``step`` of an A/B's runs (each run's
    dump folder is ``<out>/<run>``), or a line saying which trace is missing."""
    traces = {r: f"{out}/{r}/profile_traces/iteration_{step}/rank0_trace.json" for r in runs}
    head = f"## Where step {step}'s GPU time goes (rank 0, TorchTitan's profiler)\n\n"
    return named_runs.section(head, traces, "trace", step, load, report)


def load(path: str) -> StepProfile:
    """The StepProfile of one Chrome trace file."""
    with open(path) as f:
        return summarize(json.load(f))


def main(argv: list[str]) -> int:
    return named_runs.main(argv, __doc__.strip().splitlines()[-1].strip(), load, report)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
