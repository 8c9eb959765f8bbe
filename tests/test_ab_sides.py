"""The A/B tool with more than two sides, a chosen baseline, concurrent runs (--jobs) and a
deadline (--deadline-s), on faked trainings (fast; the real CPU runs are in test_ab.py)."""

import json
import math
import os
import sys
import threading
import time

import pytest

from torchtitan_megamoe import ab
from torchtitan_megamoe.ab import driver, schedule

CONFIG = os.path.join(os.path.dirname(__file__), "..", "train_configs", "qwen3_moe_tiny_cpu.toml")
SIDES = "stock,bf16=megamoe,fp8=megamoe,fp8_bwd=megamoe"
FP8_ARGS = "fp8=--megamoe.precision fp8 --megamoe.fp8_weight_cache"
FP8_BWD_ARGS = "fp8_bwd=--megamoe.precision fp8_bwd"


def _arg(cmd, name):
    return cmd[cmd.index(name) + 1] if name in cmd else None


def _log_text(losses, tps=40000):
    lines = ["[titan] 2026-12-02 10:00:00,000 - root - INFO - Training starts at step 1"]
    for i, x in enumerate(losses):
        lines.append(
            f"[titan] 2026-12-02 10:{(1 + i) // 60:02d}:{(1 + i) % 60:02d},000 - root - INFO - "
            f"step: {i + 1:2d}  loss: {x:8.5f}  grad_norm:  0.5000  memory: 30.00GiB(21.00%)  "
            f"tps: {tps:,}  tflops: 100.00  mfu: 10.00%"
        )
    return "\n".join(lines) + "\n"


# Per side: a systematic loss offset (fp8) or per-seed noise only (stock, fp8_bwd), against bf16.
OFFSET = {"stock": 0.0, "bf16": 0.0, "fp8": 0.03, "fp8_bwd": 0.0}
NOISE = {"stock": {11: 0.004, 12: -0.005, 13: 0.0015},
         "fp8_bwd": {11: -0.003, 12: 0.0045, 13: -0.001}}


def _losses(seed, label, steps):
    return [2.0 + 4.0 * math.exp(-t / 8) + 0.05 * (seed - 12) + 0.03 * math.sin(seed * 7 + t)
            + OFFSET.get(label, 0.0) + NOISE.get(label, {}).get(seed, 0.0)
            for t in range(1, steps + 1)]


def _fake_trainer(fail=None):
    calls = []
    lock = threading.Lock()

    def run_one(cmd, log_path, env, timeout):
        seed = int(_arg(cmd, "--debug.seed"))
        label = os.path.basename(_arg(cmd, "--job.dump_folder"))
        with lock:
            calls.append((seed, label, cmd, log_path))
        if (seed, label) == fail:
            open(log_path, "w").write("Traceback (most recent call last):\n  boom\n")
            return 1
        with open(log_path, "w") as f:
            f.write(_log_text(_losses(seed, label, int(_arg(cmd, "--training.steps")))))
        return 0

    return run_one, calls


def _cli(tmp_path, *more, sides=SIDES, steps=30):
    return ["--config", CONFIG, "--out", str(tmp_path / "ab"), "--seeds", "3", "--seed-base",
            "11", "--window", "10", "--sides", sides, *more, "--", "--training.steps",
            str(steps), f"--model.hf_assets_path={tmp_path}/no_assets"]


def _four_sides(tmp_path, *more, steps=30):
    return _cli(tmp_path, "--side-args", FP8_ARGS, "--side-args", FP8_BWD_ARGS, *more,
                steps=steps)


def test_parse_sides_many_and_side_args():
    sides = ab.parse_sides(SIDES, side_args=[FP8_ARGS, FP8_BWD_ARGS])
    assert [(s.label, s.kind) for s in sides] == [
        ("stock", "stock"), ("bf16", "megamoe"), ("fp8", "megamoe"), ("fp8_bwd", "megamoe")]
    assert sides[2].args == ("--megamoe.precision", "fp8", "--megamoe.fp8_weight_cache")
    assert sides[3].args == ("--megamoe.precision", "fp8_bwd") and sides[1].args == ()
    # --a-args / --b-args still name the first two sides, next to --side-args for others.
    a, b, c = ab.parse_sides("x=megamoe,y=megamoe,z=stock", "--a 1", "--b 2", ["z=--c 3"])
    assert (a.args, b.args, c.args) == (("--a", "1"), ("--b", "2"), ("--c", "3"))
    assert ab.baseline_index(sides, "bf16") == 1 and ab.baseline_index(sides) == 0
    for bad_args in (["nope=--x 1"], ["fp8=--x", "fp8=--y"], ["no equals sign"]):
        with pytest.raises(ValueError, match="--side-args"):
            ab.parse_sides(SIDES, side_args=bad_args)
    with pytest.raises(ValueError, match="both"):
        ab.parse_sides("fp8=megamoe,bf16=megamoe", "--x", "", ["fp8=--y"])
    with pytest.raises(ValueError, match="name more than one side"):
        ab.parse_sides("megamoe,megamoe,stock")
    with pytest.raises(ValueError, match="--baseline"):
        ab.baseline_index(sides, "fp16")


def test_four_sides_against_bf16_and_analyze(tmp_path, monkeypatch):
    fake, calls = _fake_trainer()
    monkeypatch.setattr(driver, "run_one", fake)
    assert ab.main(_four_sides(tmp_path, "--baseline", "bf16")) == 1  # fp8 is different
    labels = ("stock", "bf16", "fp8", "fp8_bwd")
    # One run per side and seed (12, not 3 pairs x 2 x 3 = 18): bf16's serve all comparisons.
    assert [(s, l) for s, l, _, _ in calls] == [(s, l) for s in (11, 12, 13) for l in labels]
    by = {(s, l): cmd for s, l, cmd, _ in calls}
    assert by[(11, "fp8")][-3:] == ["--megamoe.precision", "fp8", "--megamoe.fp8_weight_cache"]
    assert by[(12, "fp8_bwd")][-2:] == ["--megamoe.precision", "fp8_bwd"]
    assert "--megamoe.precision" not in by[(13, "bf16")] + by[(13, "stock")]
    out = tmp_path / "ab"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["baseline"] == "bf16" and summary["exit_code"] == 1
    assert summary["verdicts"] == {"stock": "indistinguishable", "fp8": "different",
                                   "fp8_bwd": "indistinguishable"}
    comps = summary["comparisons"]
    assert all(comps[k]["names"] == ["bf16", k] for k in comps)
    # X - bf16: fp8's offset +0.03 exactly (its losses are bf16's plus 0.03 at every step).
    assert comps["fp8"]["stats"]["mean_diff"] == pytest.approx(0.03, abs=1e-5)
    assert comps["stock"]["stats"]["mean_diff"] == pytest.approx(0.0005 / 3, abs=1e-6)
    assert comps["stock"]["stats"]["n"] == 3 and summary["missing"] == []
    assert len(summary["runs"]) == 12 and all(r["status"] == "ok" for r in summary["runs"])
    report = (out / "report.md").read_text()
    assert "# megamoe A/B over 3 seeds: stock, bf16, fp8, fp8_bwd against bf16" in report
    assert "`bf16` (megamoe) **baseline**" in report
    assert "| fp8 | **DIFFERENT** | 3 | +0.03000 |" in report
    assert "| stock | **INDISTINGUISHABLE** | 3 |" in report
    assert "## fp8 vs bf16 (differences fp8 - bf16)" in report
    assert "- runs: 12 of 12 finished (one at a time)" in report
    assert "Tokens/s per device (mean over the seeds, step 2+): stock 40,000" in report
    assert (out / "seeds.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    seed_report = (out / "seed12" / "report.md").read_text()
    assert "# megamoe A/B: 4 sides against bf16" in seed_report
    for lab in ("stock", "fp8", "fp8_bwd"):
        assert f"## megamoe A/B: bf16 vs {lab}" in seed_report
    seed_summary = json.loads((out / "seed12" / "summary.json").read_text())
    assert set(seed_summary["comparisons"]) == {"stock", "fp8", "fp8_bwd"}
    assert seed_summary["returncodes"] == {lab: 0 for lab in labels}

    # --analyze trains nothing and gives the same statistics and report from the stored runs.
    def no_training(*a, **k):
        raise AssertionError("--analyze must not train")

    monkeypatch.setattr(driver, "run_one", no_training)
    assert ab.main(_four_sides(tmp_path, "--baseline", "bf16", "--analyze")) == 1
    again = json.loads((out / "summary.json").read_text())
    assert again["analyzed_only"] and again["verdicts"] == summary["verdicts"]
    for k in comps:
        assert again["comparisons"][k]["stats"] == comps[k]["stats"]
    analyzed = (out / "report.md").read_text()
    strip = lambda text: [line for line in text.splitlines() if "device" not in line]
    assert strip(analyzed) == strip(report)


def test_default_baseline_is_the_first_side_and_two_sides_can_swap(tmp_path, monkeypatch):
    fake, _ = _fake_trainer()
    monkeypatch.setattr(driver, "run_one", fake)
    res = ab.run_seeds(CONFIG, 1, str(tmp_path / "ab"),
                       ["--training.steps", "30", f"--model.hf_assets_path={tmp_path}/x"],
                       seeds=[11, 12, 13], sides=ab.parse_sides(SIDES, side_args=[FP8_ARGS]),
                       window=10)
    assert list(res.comparisons) == ["bf16", "fp8", "fp8_bwd"]  # all against stock
    assert res.comparisons["bf16"].names == ("stock", "bf16")
    assert res.comparisons["bf16"].mean_diff == pytest.approx(-0.0005 / 3, abs=1e-6)
    assert res.stats is res.comparisons["bf16"]
    # Two sides, baseline B: the differences are A - B (the sign of the default's flips).
    sides = ab.parse_sides("fp8=megamoe,bf16=megamoe")
    extra = ["--training.steps", "30", f"--model.hf_assets_path={tmp_path}/x"]
    ab_default = ab.run_seeds(CONFIG, 1, str(tmp_path / "d"), extra, seeds=[11, 12, 13],
                              sides=sides, window=10)
    swapped = ab.run_seeds(CONFIG, 1, str(tmp_path / "s"), extra, seeds=[11, 12, 13],
                           sides=sides, window=10, baseline="bf16")
    assert ab_default.stats.names == ("fp8", "bf16") and swapped.stats.names == ("bf16", "fp8")
    assert swapped.stats.mean_diff == pytest.approx(-ab_default.stats.mean_diff)
    assert swapped.stats.mean_diff == pytest.approx(0.03, abs=1e-5)
    summary = json.loads((tmp_path / "s" / "summary.json").read_text())
    assert summary["verdict"] == "different" and summary["baseline"] == "bf16"
    assert "**baseline**" in (tmp_path / "s" / "report.md").read_text()
    with pytest.raises(SystemExit):
        ab.main(_cli(tmp_path, "--baseline", "nope"))


def test_a_failed_run_leaves_its_seed_out_of_its_comparisons_only(tmp_path, monkeypatch):
    fake, _ = _fake_trainer(fail=(12, "fp8"))
    monkeypatch.setattr(driver, "run_one", fake)
    res = ab.run_seeds(CONFIG, 1, str(tmp_path / "ab"),
                       ["--training.steps", "30", f"--model.hf_assets_path={tmp_path}/x"],
                       seeds=3, seed_base=11, window=10, baseline="bf16",
                       sides=ab.parse_sides(SIDES, side_args=[FP8_ARGS]))
    assert res.exit_code == 2
    assert [r.seed for r in res.comparisons["fp8"].seeds] == [11, 13]
    assert [r.seed for r in res.comparisons["stock"].seeds] == [11, 12, 13]
    assert any(p.startswith("fp8: seed 12 left out: bf16 exit 0, 30 steps, fp8 exit 1, 0 steps")
               for p in res.problems)
    report = (tmp_path / "ab" / "report.md").read_text()
    assert "**missing: seed12/fp8 (failed)**" in report


class FakeClock:
    """A monotonic clock that only the fake runs move: each takes ``run_s`` (or its timeout,
    whichever is shorter; then it exits 124 like a timed-out torchrun)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_deadline_stops_the_last_run_and_starts_no_more(tmp_path, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(schedule.time, "monotonic", clock)
    calls = []

    def run_one(cmd, log_path, env, timeout):
        calls.append((int(_arg(cmd, "--debug.seed")), os.path.basename(log_path), timeout))
        took = min(50.0, timeout)
        clock.now += took
        label = os.path.basename(_arg(cmd, "--job.dump_folder"))
        losses = _losses(int(_arg(cmd, "--debug.seed")), label, 30)
        with open(log_path, "w") as f:
            f.write(_log_text(losses if took == 50.0 else losses[:12]))
        return 0 if took == 50.0 else 124

    monkeypatch.setattr(driver, "run_one", run_one)
    # 6 runs of 50 s against a 230 s deadline: 4 finish, the 5th starts at 200 s with 30 s
    # left (its timeout is cut to 30 s) and is stopped, the 6th never starts.
    code = ab.main(_cli(tmp_path, "--deadline-s", "230", "--timeout", "420",
                        sides="fp8=megamoe,bf16=megamoe"))
    assert code == 2
    assert [t for *_, t in calls] == [230, 180, 130, 80, 30]  # each ends by the deadline
    out = tmp_path / "ab"
    summary = json.loads((out / "summary.json").read_text())
    runs = {r["key"]: r for r in summary["runs"]}
    assert runs["seed13/fp8"]["status"] == schedule.STOPPED and runs["seed13/fp8"]["code"] == 124
    assert runs["seed13/bf16"]["status"] == schedule.NOT_STARTED
    assert runs["seed13/bf16"]["code"] is None
    assert summary["missing"] == ["seed13/fp8 (stopped at the deadline)",
                                  "seed13/bf16 (not started (deadline))"]
    assert summary["stats"]["n"] == 2 and summary["deadline_s"] == 230
    report = (out / "report.md").read_text()
    assert "- runs: 4 of 6 finished (one at a time, deadline 230 s); **missing: seed13/fp8 " \
           "(stopped at the deadline), seed13/bf16 (not started (deadline))**" in report
    assert "| 13 | left out |" in report
    assert "Missing or failed: seed13/fp8 (stopped at the deadline)" in report
    assert "seed13/bf16 did not run" not in report

    # --min-run-s: the 5th run would get 30 s < 40 s, so it is not started either.
    calls.clear()
    code = ab.main(_cli(tmp_path, "--deadline-s", "230", "--min-run-s", "40",
                        sides="fp8=megamoe,bf16=megamoe"))
    assert code == 2 and len(calls) == 4
    summary = json.loads((out / "summary.json").read_text())
    assert [r["status"] for r in summary["runs"]][4:] == [schedule.NOT_STARTED] * 2


def test_run_all_schedules_jobs_within_the_deadline():
    clock = FakeClock()
    lock = threading.Lock()
    live, peak, got = [0], [0], []

    def run_one(cmd, log_path, env, timeout):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
            got.append((cmd[0], timeout))
        time.sleep(0.05)
        with lock:
            live[0] -= 1
        return 0 if cmd[0] != "bad" else 3

    specs = [schedule.RunSpec(f"r{i}", f"r{i}", None, ["bad" if i == 1 else f"c{i}"],
                              f"/nonexistent/r{i}.log") for i in range(5)]
    logs = []
    recs = schedule.run_all(specs, run_one, None, 100.0, jobs=2, log=logs.append)
    assert peak[0] == 2 and sorted(c for c, _ in got) == ["bad", "c0", "c2", "c3", "c4"]
    assert [r.status for r in recs] == ["ok", "failed", "ok", "ok", "ok"]
    assert recs[1].code == 3 and all(r.jobs == 2 for r in recs)
    assert all(r.overlapped for r in recs[:2])  # the first two ran together
    assert any(m.startswith("[megamoe.ab] start r0") for m in logs)
    # The deadline already passed: nothing starts.
    recs = schedule.run_all(specs, run_one, None, 100.0, jobs=2, deadline_s=-1.0,
                            clock=clock, log=logs.append)
    assert [r.status for r in recs] == [schedule.NOT_STARTED] * 5
    # A run's exception reaches the caller, after the others finished.
    specs[3].cmd = ["raise"]

    def raising(cmd, log_path, env, timeout):
        if cmd[0] == "raise":
            raise RuntimeError("boom")
        return run_one(cmd, log_path, env, timeout)

    with pytest.raises(RuntimeError, match="boom"):
        schedule.run_all(specs, raising, None, 100.0, jobs=3, log=logs.append)
    with pytest.raises(ValueError, match="--jobs"):
        schedule.run_all(specs, run_one, None, 1.0, jobs=0)


_TRAINER = r"""
import os, sys, time
args = sys.argv[1:]
arg = lambda n: args[args.index(n) + 1]
seed, steps = int(arg("--debug.seed")), int(arg("--training.steps"))
os.makedirs(arg("--job.dump_folder"), exist_ok=True)
print("[titan] 2026-12-02 10:00:00,000 - root - INFO - Training starts at step 1", flush=True)
for t in range(1, steps + 1):
    time.sleep(float(os.environ.get("FAKE_STEP_S", "0.01")))
    loss = 3.0 + 0.01 * seed + 1.0 / t + (0.02 if "fp8" in args else 0.0)
    print(f"[titan] 2026-12-02 10:00:{t:02d},000 - root - INFO - step: {t:2d}  loss: {loss:8.5f}"
          "  grad_norm:  0.5000  memory: 30.00GiB(21.00%)  tps: 40,000  tflops: 100.00  "
          "mfu: 10.00%", flush=True)
"""


def test_jobs_run_real_processes_at_once_with_distinct_dirs_logs_and_ports(tmp_path,
                                                                           monkeypatch):
    """--jobs 3 with real processes (a stand-in trainer instead of torchrun): they overlap, each
    has its own TOML, log and dump folder, every command a torchrun --standalone one (its own
    rendezvous store on an OS-picked port) without a fixed port; tokens/s print as n/c."""
    real_cmd = driver.torchrun_command
    commands = []

    def fake_torchrun(config_path, nproc, dump, extra):
        commands.append(real_cmd(config_path, nproc, dump, extra))
        return [sys.executable, "-c", _TRAINER, "--job.config_file", config_path,
                "--job.dump_folder", dump, *extra]

    monkeypatch.setattr(driver, "torchrun_command", fake_torchrun)
    monkeypatch.setenv("FAKE_STEP_S", "0.02")
    code = ab.main(_four_sides(tmp_path, "--baseline", "bf16", "--jobs", "3", steps=20))
    assert code == 1  # fp8 and fp8_bwd are 0.02 above bf16 at every step: different
    out = tmp_path / "ab"
    summary = json.loads((out / "summary.json").read_text())
    runs = summary["runs"]
    assert len(runs) == 12 and all(r["status"] == "ok" and r["jobs"] == 3 for r in runs)
    assert any(r["overlapped"] for r in runs)
    starts = sorted(r["start_s"] for r in runs)
    ends = sorted(r["end_s"] for r in runs)
    assert starts[2] < ends[0]  # three ran at once
    for key in ("--job.dump_folder", "--job.config_file"):
        assert len({_arg(c, key) for c in commands}) == 12
    assert len({r["log_path"] for r in runs}) == 12
    for cmd in commands:
        assert "--standalone" in cmd
        assert not any(a.split("=")[0] in ("--master-port", "--master_port", "--rdzv-endpoint",
                                           "--rdzv_endpoint") for a in cmd)
    for seed in (11, 12, 13):
        for lab in ("stock", "bf16", "fp8", "fp8_bwd"):
            assert (out / f"seed{seed}" / f"{lab}.toml").is_file()
            assert "step: 20" in (out / f"seed{seed}" / f"{lab}.log").read_text()
    report = (out / "report.md").read_text()
    assert "Tokens/s per device: n/c, runs overlapped on the same GPUs (`--jobs 3`)" in report
    assert "up to 3 at a time on the same GPUs (`--jobs 3`)" in report
    assert "40,000" not in report
    seed_report = (out / "seed11" / "report.md").read_text()
    assert "**not comparable** (n/c)" in seed_report
    assert "| tokens/s per device (mean, step 2+) | n/c | n/c |" in seed_report


def test_torchrun_standalone_gives_every_run_its_own_rendezvous(monkeypatch):
    """What --standalone means to the installed torchrun: a c10d rendezvous on localhost:0
    (the OS picks a free port) under a fresh run id, so concurrent runs cannot collide."""
    import torch.distributed.run as trun

    seen = []
    monkeypatch.setattr(trun, "elastic_launch",
                        lambda config, entrypoint: (lambda *a: seen.append(config)))
    for dump in ("a", "b"):
        cmd = ab.torchrun_command("x.toml", 1, dump, [])
        trun.run(trun.get_args_parser().parse_args(cmd[3:]))
    assert [c.rdzv_endpoint for c in seen] == ["localhost:0", "localhost:0"]
    assert seen[0].run_id != seen[1].run_id and seen[0].rdzv_backend == "c10d"


def test_one_seed_many_sides_judged_step_by_step(tmp_path, monkeypatch):
    """Without --seeds: every side against the baseline step by step, in one directory."""
    seen = []

    def fake(cmd, log_path, env, timeout):
        label = os.path.basename(_arg(cmd, "--job.dump_folder"))
        seen.append(label)
        with open(log_path, "w") as f:
            f.write(_log_text(_losses(12, label, 20)))
        return 0

    monkeypatch.setattr(driver, "run_one", fake)
    code = ab.main(["--config", CONFIG, "--out", str(tmp_path / "ab"), "--sides",
                    "stock,bf16=megamoe,fp8=megamoe", "--side-args", FP8_ARGS, "--baseline",
                    "bf16", "--rtol", "1e-2", "--atol", "1e-3", "--jobs", "2", "--",
                    f"--model.hf_assets_path={tmp_path}/x", "--training.steps", "20"])
    assert code == 1 and sorted(seen) == ["bf16", "fp8", "stock"]  # fp8 is 0.03 off
    out = tmp_path / "ab"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["baseline"] == "bf16" and summary["exit_code"] == 1
    assert {k: v["ok"] for k, v in summary["comparisons"].items()} == {"stock": True,
                                                                        "fp8": False}
    report = (out / "report.md").read_text()
    assert "| stock | PASS | 20 |" in report and "| fp8 | FAIL | 20 |" in report
    assert "## megamoe A/B: bf16 vs fp8" in report and "Commands:" in report
    assert (out / "ab.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stop_all_ends_the_runs_of_other_threads(tmp_path):
    """An interrupted ab with --jobs > 1 stops every torchrun the worker threads wait on."""
    from torchtitan_megamoe.ab import runner

    codes = []
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    threads = [threading.Thread(target=lambda i=i: codes.append(runner.run_one(
        cmd, str(tmp_path / f"r{i}.log"), dict(os.environ), 120.0))) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(runner._LIVE) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    t0 = time.monotonic()
    runner.stop_all()
    for t in threads:
        t.join(timeout=30)
    assert len(codes) == 2 and all(c != 0 for c in codes)
    assert time.monotonic() - t0 < 15 and not runner._LIVE
