"""tools/bench_compare.py: the no-slowdown tables of scripts/bench_compare.sh (layer rows) and
scripts/step_compare.sh (training steps), on files written here."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench_compare  # noqa: E402


def _bench(out: Path, side: str, i: int, ms: float) -> None:
    rows = [{"pass": "fwd", "precision": "bf16", "ours_ms": ms}]
    (out / f"cmp_{side}_{i}.json").write_text(
        json.dumps({"results": [{"shape": "Qwen3-30B-A3B", "rows_b2b": rows}]}))


def _steps_log(path: Path, step_ms: list[int]) -> None:
    """A TorchTitan rank-0 log whose step k ends step_ms[k - 1] ms after the one before."""
    path.parent.mkdir(parents=True, exist_ok=True)
    t, lines = 0, []
    for k, ms in enumerate(step_ms, 1):
        t += ms
        stamp = f"2026-12-04 10:00:{t // 1000:02d},{t % 1000:03d}"
        lines.append(f"[titan] {stamp} - root - INFO - step: {k:2d}  loss:  6.5  grad_norm:  0.8"
                     f"  memory:  0.56GiB(2.38%)  tps: 1,000  tflops: 0.00  mfu: 0.00%")
    path.write_text("\n".join(lines) + "\n")


def test_layer_rows_median_over_repeats_and_the_verdict(tmp_path, capsys):
    for i, (old, new) in enumerate([(2.0, 2.01), (2.0, 2.50), (2.0, 2.02)], 1):
        _bench(tmp_path, "old", i, old)
        _bench(tmp_path, "new", i, new)
    assert bench_compare.main([str(tmp_path)]) == 0  # median 2.02: +1.0%
    assert "1.010" in capsys.readouterr().out
    assert bench_compare.main([str(tmp_path), "--tolerance", "0.005"]) == 1


@pytest.mark.parametrize("new_ms, rc", [(202, 0), (230, 1)])
def test_steps_mean_from_step_3_per_side(tmp_path, capsys, new_ms, rc):
    # steps 1-2 (compilation, tuner) differ wildly and must not count
    for i in (1, 2):
        _steps_log(tmp_path / f"step_old_{i}" / "fp8.log", [9000, 700] + [200] * 6)
        _steps_log(tmp_path / f"step_new_{i}" / "fp8.log", [3000, 300] + [new_ms] * 6)
    assert bench_compare.main([str(tmp_path), "--steps"]) == rc
    row = next(l for l in capsys.readouterr().out.splitlines() if "fp8" in l).split()
    assert row[:2] == ["step", "fp8"] and float(row[2]) == pytest.approx(200.0)
    assert float(row[3]) == pytest.approx(new_ms) and row[-1] == "2/2"


def test_steps_without_logs_fail(tmp_path):
    assert bench_compare.main([str(tmp_path), "--steps"]) == 1
