"""What is alive at a training step's memory peak, from the allocator snapshot TorchTitan writes
(``--profiling.enable_memory_snapshot --profiling.profile_freq N``: after step N, one pickle per
rank, ``<dump>/memory_snapshot/iteration_N/rank<r>_memory_snapshot.pickle``; the A/B tool's
``--profile-step N --memory-snapshot``).

The snapshot holds the allocator's blocks at the dump and its last events (TorchTitan keeps
100,000). Walking the events backwards from the dump state gives the allocated bytes before
each event; at the largest, each live block is put into a category by the frames of the call
that allocated it (first match of ``CATEGORIES``), and into its allocation site (the innermost
frame outside torch). Comparing two runs of one config shows which tensors make the difference
between their peaks:

    python -m torchtitan_megamoe.ab.memory stock=<stock pickle> megamoe=<megamoe pickle>
"""

from __future__ import annotations

import os
import pickle
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field

from torchtitan_megamoe.ab import named_runs

SNAPSHOT_FOLDER = "memory_snapshot"  # under each run's dump folder

CATEGORIES = (
    ("megamoe FP8 weight copies", re.compile(r"\b(_make_fp8|fp8_shard|make_fp8_weights)\b")),
    ("optimizer states", re.compile(r"torch/optim/|\b_init_group\b")),
    ("parameter gradients", re.compile(r"AccumulateGrad|accumulate_grad", re.I)),
    ("parameters and buffers", re.compile(r"\b(init_weights|to_empty|_apply|reset_parameters)\b")),
    ("megamoe op", re.compile(r"torchtitan_megamoe/ops/")),
    ("backward (other)", re.compile(r"_engine_run_backward|autograd::Engine", re.I)),
    ("forward (other)", re.compile(r"\bforward\b")),
)
"""(name, pattern) pairs, tried in order against each frame of an allocation's stack (as
``file:name``); the first pattern any frame matches names the block's category, else "other"."""


@dataclass
class Peak:
    """The largest allocated total the snapshot's window saw, and what made it up."""

    peak_bytes: int
    at_dump_bytes: int
    reserved_bytes: int  # the segments' total at the dump
    events: int  # the trace events walked (the window: the last ones before the dump)
    by_category: dict = field(default_factory=dict)  # name -> bytes live at the peak
    top_sites: list = field(default_factory=list)  # (site, blocks, bytes), largest first


def _frames_text(frames) -> list[str]:
    return [f"{f.get('filename', '')}:{f.get('name', '')}" for f in frames or ()]


def category(frames) -> str:
    """The category of a block allocated under ``frames`` (CATEGORIES)."""
    texts = _frames_text(frames)
    for name, pattern in CATEGORIES:
        if any(pattern.search(t) for t in texts):
            return name
    return "other"


def site(frames) -> str:
    """The innermost Python frame outside torch itself (file:line name), where code of the
    model, the trainer or this package asked for the memory."""
    for f in frames or ():
        path = f.get("filename", "")
        if path.endswith(".py") and "/torch/" not in path:
            return f"{_short(path)}:{f.get('line', 0)} {f.get('name', '')}"
    return "(no Python frame outside torch)"


def _short(path: str) -> str:
    for root in ("torchtitan_megamoe/", "torchtitan/", "site-packages/"):
        i = path.rfind(root)
        if i >= 0:
            return path[i:] if root != "site-packages/" else path[i + len(root):]
    return os.path.basename(path)


def _blocks_at_dump(snapshot: dict, device: int) -> dict:
    """address -> (size, frames) of the blocks allocated at the dump."""
    live = {}
    for seg in snapshot.get("segments", ()):
        if seg.get("device", device) != device:
            continue
        addr = seg["address"]
        for b in seg["blocks"]:
            start = b.get("address", addr)
            if b["state"] in ("active_allocated", "active_pending_free"):
                live[start] = (b["size"], b.get("frames", ()))
            addr = start + b["size"]
    return live


def analyze(snapshot: dict, device: int = 0, top: int = 12) -> Peak:
    """The peak within ``snapshot``'s trace window on ``device`` (a loaded
    ``torch.cuda.memory._snapshot()``) and what was alive there."""
    live = _blocks_at_dump(snapshot, device)
    traces = snapshot.get("device_traces", ())
    events = traces[device] if device < len(traces) else []
    total = at_dump = sum(size for size, _ in live.values())
    reserved = sum(s["total_size"] for s in snapshot.get("segments", ())
                   if s.get("device", device) == device)
    # walk back: before an alloc its block was not there, before a completed free it was
    peak, peak_at = total, len(events)
    for i in range(len(events) - 1, -1, -1):
        e = events[i]
        if e["action"] == "alloc":
            total -= e["size"]
        elif e["action"] == "free_completed":
            total += e["size"]
        else:
            continue
        if total > peak:
            peak, peak_at = total, i
    # a free event may carry the stack of the free: a block freed in the window takes its
    # allocation's frames where the window saw the allocation
    allocated_by, freed_frames = {}, {}
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            allocated_by[e["addr"]] = e.get("frames", ())
        elif e["action"] == "free_completed":
            freed_frames[i] = allocated_by.pop(e["addr"], e.get("frames", ()))
    for i in range(len(events) - 1, peak_at - 1, -1):
        e = events[i]
        if e["action"] == "alloc":
            live.pop(e["addr"], None)
        elif e["action"] == "free_completed":
            live[e["addr"]] = (e["size"], freed_frames[i])
    by_category, sites = defaultdict(int), defaultdict(lambda: [0, 0])
    for size, frames in live.values():
        by_category[category(frames)] += size
        s = sites[site(frames)]
        s[0] += 1
        s[1] += size
    ranked = sorted(((k, n, b) for k, (n, b) in sites.items()), key=lambda r: -r[2])
    return Peak(peak, at_dump, reserved, len(events),
                dict(sorted(by_category.items(), key=lambda kv: -kv[1])), ranked[:top])


def report(peaks: dict) -> str:
    """A markdown table of categories (one column per run, GiB at its peak) and each run's
    largest allocation sites."""
    gib = 2 ** 30
    names = list(peaks)
    cats = []
    for p in peaks.values():
        cats += [c for c in p.by_category if c not in cats]
    lines = ["| GiB | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
    lines.append("| peak allocated (trace window) | "
                 + " | ".join(f"{p.peak_bytes / gib:.2f}" for p in peaks.values()) + " |")
    for c in cats:
        lines.append(f"| {c} | " + " | ".join(f"{p.by_category.get(c, 0) / gib:.2f}"
                                              for p in peaks.values()) + " |")
    lines.append("| reserved at the dump | "
                 + " | ".join(f"{p.reserved_bytes / gib:.2f}" for p in peaks.values()) + " |")
    for name, p in peaks.items():
        lines += ["", f"Largest allocation sites live at the peak, {name} ({p.events} events "
                  "walked):", "", "| site | blocks | GiB |", "| --- | ---: | ---: |"]
        lines += [f"| `{s[:100]}` | {n} | {b / gib:.2f} |" for s, n, b in p.top_sites]
    return "\n".join(lines)


def snapshot_args() -> list[str]:
    """TorchTitan arguments that record the allocator's history and dump it after the
    profiled step (``--profiling.profile_freq``, trace.profile_args). The recording slows
    every step's host side: such a run's timings are not its speed."""
    return ["--profiling.enable_memory_snapshot", "--profiling.save_memory_snapshot_folder",
            SNAPSHOT_FOLDER]


def ab_memory(out: str, step: int, runs: tuple = ("stock", "megamoe")) -> str:
    """The markdown section comparing rank 0's peak of ``step`` across an A/B's runs (each
    run's dump folder is ``<out>/<run>``), or a line saying which snapshot is missing."""
    paths = {r: f"{out}/{r}/{SNAPSHOT_FOLDER}/iteration_{step}/rank0_memory_snapshot.pickle"
             for r in runs}
    head = f"## What is alive at step {step}'s memory peak (rank 0, allocator snapshot)\n\n"
    return named_runs.section(head, paths, "snapshot", step, load, report)


def load(path: str) -> Peak:
    """The Peak of one snapshot pickle."""
    with open(path, "rb") as f:
        return analyze(pickle.load(f))


def main(argv: list[str]) -> int:
    return named_runs.main(argv, __doc__.strip().splitlines()[-1].strip(), load, report)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
