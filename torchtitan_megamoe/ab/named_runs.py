"""The command line the per-run analyses share (trace.py, memory.py): NAME=PATH arguments, one
file per run, compared side by side in one markdown report."""

from __future__ import annotations

import os
import sys


def load_all(paths: dict, load_one) -> dict:
    """name -> path, to name -> ``load_one(path)``."""
    return {name: load_one(path) for name, path in paths.items()}


def main(argv: list[str], usage: str, load_one, report) -> int:
    """Print ``report`` of every NAME=PATH in ``argv`` loaded by ``load_one``; 2 (and
    ``usage``) when an argument is not NAME=PATH."""
    if not argv or any("=" not in a for a in argv):
        print(usage, file=sys.stderr)
        return 2
    print(report(load_all(dict(a.split("=", 1) for a in argv), load_one)))
    return 0


def section(head: str, paths: dict, what: str, step: int, load_one, report) -> str:
    """A report section: ``head``, then the runs' comparison (name -> path of each run's
    ``what`` of ``step``), or a line naming the missing files."""
    missing = [p for p in paths.values() if not os.path.exists(p)]
    if missing:
        return head + f"No {what}: {', '.join(missing)} (did the runs reach step {step}?)\n"
    return head + report(load_all(paths, load_one)) + "\n"
