"""Table of scripts/bench_compare.sh: per (shape, pass, precision) of ours, the median over the
repeats of the back-to-back time for the old and the new checkout, and new/old.

    python tools/bench_compare.py OUT_DIR [--tolerance 0.02]
"""

import argparse
import glob
import json
import statistics
import sys
from pathlib import Path


def load(out: Path, side: str) -> dict:
    """(shape, pass, precision) -> [ms per repeat] of our back-to-back rows."""
    times: dict = {}
    for f in sorted(glob.glob(str(out / f"cmp_{side}_*.json"))):
        for rec in json.loads(Path(f).read_text())["results"]:
            for row in rec.get("rows_b2b", []):
                key = (rec["shape"], row["pass"], row["precision"])
                times.setdefault(key, []).append(row["ours_ms"])
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/bench_compare.py", description=__doc__)
    p.add_argument("out", type=Path)
    p.add_argument("--tolerance", type=float, default=0.02)
    a = p.parse_args(argv)
    old, new = load(a.out, "old"), load(a.out, "new")
    worst = 0.0
    print(f"{'shape':18} {'pass':7} {'precision':9} {'old ms':>8} {'new ms':>8} {'new/old':>8}  runs")
    for key in sorted(set(old) | set(new)):
        o, n = old.get(key, []), new.get(key, [])
        if not o or not n:
            print(f"{key[0]:18} {key[1]:7} {key[2]:9} missing on one side ({len(o)} / {len(n)})")
            worst = float("inf")
            continue
        mo, mn = statistics.median(o), statistics.median(n)
        worst = max(worst, mn / mo - 1)
        print(f"{key[0]:18} {key[1]:7} {key[2]:9} {mo:8.3f} {mn:8.3f} {mn / mo:8.3f}  {len(o)}/{len(n)}")
    verdict = "PASS" if worst <= a.tolerance else "FAIL"
    print(f"worst slowdown {worst * 100:+.1f}% (tolerance {a.tolerance * 100:.0f}%): {verdict}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
