"""Summarize `ncu --page source --csv --print-source sass`: stall-reason totals over the
kernel and the SASS lines holding the most warp stall samples (see experiments/ncu_stalls.sh)."""

import csv
import sys


def main(path: str, top: int = 25) -> None:
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"#"') or "Source" in l), None)
    if start is None:
        print("\n".join(lines[:20]))
        return
    rows = list(csv.DictReader(lines[start:]))
    if not rows:
        print("no rows")
        return
    cols = list(rows[0].keys())
    sample_col = next((c for c in cols if c.startswith("Warp Stall Sampling (All")), None)
    stall_cols = [c for c in cols if c.startswith("stall_") or "Stall" in c and c != sample_col]

    def num(v):
        try:
            return float(str(v).replace(",", ""))
        except ValueError:
            return 0.0

    print("columns:", ", ".join(cols[:40]))
    if sample_col is None:
        return
    total = sum(num(r[sample_col]) for r in rows) or 1.0
    sums = {c: sum(num(r[c]) for r in rows) for c in stall_cols}
    print("stall samples by column (share of all samples):")
    for c, s in sorted(sums.items(), key=lambda kv: -kv[1])[:14]:
        print(f"  {c:60s} {s / total:6.1%}")
    src = next((c for c in cols if c == "Source"), cols[1])
    print(f"top {top} SASS lines by samples:")
    for r in sorted(rows, key=lambda r: -num(r[sample_col]))[:top]:
        print(f"  {num(r[sample_col]) / total:6.1%}  {r[src][:90]}")


if __name__ == "__main__":
    main(*sys.argv[1:])
