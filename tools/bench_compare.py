"""Table of scripts/bench_compare.sh and scripts/step_compare.sh: per row, the median over the
repeats for the old and the new checkout, and new/old (times: above 1 is slower).

    python tools/bench_compare.py OUT_DIR [--tolerance 0.02]            layer rows (bench JSONs)
    python tools/bench_compare.py WORK_DIR --steps [--from-step 3]      training steps (A/B logs)

Layer rows: our back-to-back ms per (shape, pass, precision), from OUT_DIR/cmp_{old,new}_*.json.
Steps: the mean step time in ms over steps >= --from-step of each run log
WORK_DIR/step_{old,new}_*/<side>.log (the A/B tool's run logs; the first steps carry compilation
and the tuner).
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


def load_steps(work: Path, side: str, from_step: int) -> dict:
    """("step", A/B side, "") -> [mean step ms per repeat] of the run logs of one checkout."""
    from torchtitan_megamoe.ab.logs import parse_log_file

    times: dict = {}
    for f in sorted(glob.glob(str(work / f"step_{side}_*" / "*.log"))):
        steps = [s.time_s for s in parse_log_file(f).steps
                 if s.step >= from_step and s.time_s is not None]
        if steps:
            key = ("step", Path(f).stem, "")
            times.setdefault(key, []).append(1e3 * sum(steps) / len(steps))
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/bench_compare.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--tolerance", type=float, default=0.02)
    p.add_argument("--steps", action="store_true", help="compare training-step logs")
    p.add_argument("--from-step", type=int, default=3)
    a = p.parse_args(argv)
    if a.steps:
        old, new = (load_steps(a.out, s, a.from_step) for s in ("old", "new"))
    else:
        old, new = load(a.out, "old"), load(a.out, "new")
    worst = 0.0 if old or new else float("inf")
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
