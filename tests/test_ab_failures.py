"""A failed torchrun in an A/B: the failed ranks and their last lines reach the report, and a
rank killed in gloo's process teardown after every step counts as a finished CPU run."""

import json
import os

from torchtitan_megamoe import ab
from torchtitan_megamoe.ab import driver, failures

from test_ab_sides import CONFIG, _arg, _log_text

SUMMARY = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
torchtitan.train FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-04_20:30:12
  host      : ci
  rank      : 1 (local_rank: 1)
  exitcode  : {code} (pid: 4242)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 4242
============================================================
"""


def test_rank_failures_parse_torchrun_summary():
    assert failures.rank_failures(SUMMARY.format(code=-6)) == [failures.RankFailure(1, -6)]
    assert failures.rank_failures(SUMMARY.format(code=1))[0].signal is False
    assert failures.rank_failures("step: 1 loss: 2.0") == []


def _fake(steps_logged: int, code: int):
    """A trainer whose converter run logs ``steps_logged`` steps, then torchrun reports rank 1
    dead with ``code``; rank 1's own log says why."""

    def run_one(cmd, log_path, env, timeout):
        label = os.path.basename(_arg(cmd, "--job.dump_folder"))
        n = int(_arg(cmd, "--training.steps"))
        losses = [3.0 - 0.1 * i for i in range(n)]
        with open(log_path, "w") as f:
            if label == "stock":
                f.write(_log_text(losses))
                return 0
            f.write(_log_text(losses[:steps_logged]) + SUMMARY.format(code=code))
        rank_dir = os.path.join(_arg(cmd, "--log-dir"), "run_x", "attempt_0", "1")
        os.makedirs(rank_dir)
        with open(os.path.join(rank_dir, "stderr.log"), "w") as f:
            f.write("terminate called after throwing gloo::IoException\n  Connection closed\n")
        return 1

    return run_one


def _run(tmp_path, monkeypatch, fake):
    monkeypatch.setattr(driver, "run_one", fake)
    monkeypatch.setattr(driver, "_cuda_available", lambda: False)
    out = tmp_path / "ab"
    out.mkdir()
    return ab.run_ab(CONFIG, nproc=2, out=str(out),
                     extra=["--training.steps", "6", f"--model.hf_assets_path={tmp_path}/none"]), out


def test_teardown_abort_after_the_last_step_is_a_finished_run(tmp_path, monkeypatch):
    res, out = _run(tmp_path, monkeypatch, _fake(steps_logged=6, code=-6))
    assert res.exit_code == 0 and res.ok
    summary = json.loads((out / "summary.json").read_text())
    assert summary["teardown_aborts"] == ["megamoe"]
    assert "died by a signal in process teardown" in (out / "report.md").read_text()


def test_a_rank_dying_before_the_last_step_fails_and_says_why(tmp_path, monkeypatch):
    res, out = _run(tmp_path, monkeypatch, _fake(steps_logged=4, code=-6))
    assert res.exit_code == 2 and not res.ok
    problem = res.comparison.problems[0]
    assert problem.startswith("the megamoe run exited with status 1 (rank 1 (signal 6): ")
    assert "gloo::IoException | Connection closed" in problem


def test_an_error_exit_after_the_last_step_still_fails(tmp_path, monkeypatch):
    res, _ = _run(tmp_path, monkeypatch, _fake(steps_logged=6, code=1))
    assert res.exit_code == 2 and "rank 1 (exit 1)" in res.comparison.problems[0]
