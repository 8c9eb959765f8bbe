"""Why a torchrun failed: the ranks torchrun names in its failure summary, with their exit codes
and the last lines each rank wrote (torchrun tees every rank's output under ``<dump>/ranks``,
while the run's log keeps rank 0 only)."""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass

RANK_LOGS = "ranks"  # torchrun --log-dir, under the run's dump folder

_FAILURE = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


@dataclass(frozen=True)
class RankFailure:
    rank: int
    exitcode: int  # negative: killed by that signal

    @property
    def signal(self) -> bool:
        return self.exitcode < 0


def rank_failures(log_text: str) -> list[RankFailure]:
    """The failed ranks of torchrun's ChildFailedError summary in ``log_text``, in its order."""
    seen, out = set(), []
    for m in _FAILURE.finditer(log_text):
        f = RankFailure(int(m.group(1)), int(m.group(2)))
        if f not in seen:
            seen.add(f)
            out.append(f)
    return out


def rank_tail(dump: str, rank: int, lines: int = 4) -> str:
    """The last non-empty lines rank ``rank`` wrote (stderr, else stdout) in the newest attempt
    under ``<dump>/ranks``; "" when torchrun kept none."""
    for stream in ("stderr.log", "stdout.log"):
        paths = glob.glob(os.path.join(dump, RANK_LOGS, "*", "attempt_*", str(rank), stream))
        if not paths:
            continue
        with open(max(paths, key=os.path.getmtime), errors="replace") as f:
            kept = [ln.strip() for ln in f if ln.strip()]
        if kept:
            return " | ".join(kept[-lines:])
    return ""


def describe(log_text: str, dump: str) -> str:
    """One line per failed rank: its exit code and last lines; "" when torchrun named none."""
    parts = []
    for f in rank_failures(log_text):
        how = f"signal {-f.exitcode}" if f.signal else f"exit {f.exitcode}"
        tail = rank_tail(dump, f.rank)
        parts.append(f"rank {f.rank} ({how})" + (f": {tail}" if tail else ""))
    return "; ".join(parts)


def teardown_abort(log_text: str, steps: int, expected_steps: int) -> bool:
    """True when every rank torchrun names died by a signal after the run logged all
    ``expected_steps`` steps: gloo aborting a rank whose peers already closed their sockets
    in process teardown, which says nothing of the training."""
    fails = rank_failures(log_text)
    return bool(fails) and all(f.signal for f in fails) and 0 < expected_steps <= steps
