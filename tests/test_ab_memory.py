"""torchtitan_megamoe.ab.memory on a hand-written allocator snapshot: the peak found by walking
the events back from the dump, what was alive there by category and by allocation site (a block
freed in the window keeps its allocation's frames), and the A/B tool's --memory-snapshot path
(runs faked: the allocator's history needs a GPU)."""

import os
import pickle

import pytest

from torchtitan_megamoe.ab import memory

MiB = 2 ** 20


def _frames(*pairs):
    return [{"filename": f, "line": i + 1, "name": n} for i, (f, n) in enumerate(pairs)]


PARAM = _frames(("/x/torch/nn/modules/module.py", "_apply"), ("/x/torchtitan/train.py", "to_empty"))
STATE = _frames(("/x/torch/optim/adamw.py", "_init_group"), ("/x/torchtitan/train.py", "step"))
COPY = _frames(("/x/torchtitan_megamoe/ops/hopper/fp8_weights.py", "make_fp8_weights"),
               ("/x/torchtitan_megamoe/moe.py", "_make_fp8"))
ACT = _frames(("/x/torch/nn/functional.py", "linear"), ("/x/torchtitan/models/qwen3.py", "forward"))
FREE_STACK = _frames(("/x/torch/autograd/graph.py", "_engine_run_backward"))

# at the dump: parameters 100 MiB, optimizer states 200 MiB, one 8 MiB activation
SNAPSHOT = {
    "segments": [{"device": 0, "address": 0, "total_size": 512 * MiB, "blocks": [
        {"address": 0, "size": 100 * MiB, "state": "active_allocated", "frames": PARAM},
        {"address": 100 * MiB, "size": 200 * MiB, "state": "active_allocated", "frames": STATE},
        {"address": 300 * MiB, "size": 8 * MiB, "state": "active_allocated", "frames": ACT},
        {"address": 308 * MiB, "size": 204 * MiB, "state": "inactive"},
    ]}],
    # in the window: FP8 copies (64 MiB) and an activation (32 MiB) made and freed (the free
    # events carry the freeing stack), then the 8 MiB activation made
    "device_traces": [[
        {"action": "alloc", "addr": 400 * MiB, "size": 64 * MiB, "frames": COPY},
        {"action": "alloc", "addr": 464 * MiB, "size": 32 * MiB, "frames": ACT},
        {"action": "free_requested", "addr": 464 * MiB, "size": 32 * MiB, "frames": FREE_STACK},
        {"action": "free_completed", "addr": 464 * MiB, "size": 32 * MiB, "frames": FREE_STACK},
        {"action": "free_completed", "addr": 400 * MiB, "size": 64 * MiB, "frames": FREE_STACK},
        {"action": "alloc", "addr": 300 * MiB, "size": 8 * MiB, "frames": ACT},
    ]],
}


def test_peak_walks_back_from_the_dump():
    p = memory.analyze(SNAPSHOT)
    assert p.at_dump_bytes == 308 * MiB and p.reserved_bytes == 512 * MiB and p.events == 6
    # before the two frees: 300 (params, states) + 64 + 32; the late 8 MiB is not there yet
    assert p.peak_bytes == 396 * MiB
    assert p.by_category == {"optimizer states": 200 * MiB, "parameters and buffers": 100 * MiB,
                             "megamoe FP8 weight copies": 64 * MiB,
                             "forward (other)": 32 * MiB}
    sites = {s: (n, b) for s, n, b in p.top_sites}
    assert sites["torchtitan_megamoe/ops/hopper/fp8_weights.py:1 make_fp8_weights"] == (1, 64 * MiB)
    assert sites["torchtitan/models/qwen3.py:2 forward"] == (1, 32 * MiB)
    assert p.top_sites[0][2] == 200 * MiB  # largest first


def test_peak_at_the_dump_and_categories():
    empty = dict(SNAPSHOT, device_traces=[[]])
    p = memory.analyze(empty)
    assert p.peak_bytes == p.at_dump_bytes == 308 * MiB
    assert memory.category([]) == "other"
    assert memory.category(_frames(("/x/torch/csrc/autograd/x.cpp", "AccumulateGrad::apply"))) \
        == "parameter gradients"
    assert memory.site(_frames(("/x/torch/a.py", "f"))) == "(no Python frame outside torch)"


def test_report_and_command_line(tmp_path, capsys):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(SNAPSHOT))
    assert memory.main([f"stock={path}", f"megamoe={path}"]) == 0
    text = capsys.readouterr().out
    assert "| peak allocated (trace window) | 0.39 | 0.39 |" in text
    assert "| megamoe FP8 weight copies | 0.06 | 0.06 |" in text
    assert memory.main([str(path)]) == 2
    assert "No snapshot" in memory.ab_memory(str(tmp_path), 8)


def test_run_ab_reports_the_memory_peak(tmp_path, monkeypatch):
    """--profile-step N --memory-snapshot: TorchTitan's snapshot arguments reach both runs and
    report.md gains the peak's comparison next to the kernel-time one."""
    from moe_testing import fake_ab_run
    from torchtitan_megamoe.ab import cli, driver

    seen = []
    snapshot = {f"{memory.SNAPSHOT_FOLDER}/iteration_5/rank0_memory_snapshot.pickle":
                pickle.dumps(SNAPSHOT)}
    monkeypatch.setattr(driver, "run_one", fake_ab_run(seen, snapshot))
    out = str(tmp_path / "ab")
    cli.main(["--config", "train_configs/qwen3_moe_tiny_cpu.toml", "--out", out,
              "--profile-step", "5", "--memory-snapshot", "--", "--training.steps", "5"])
    assert len(seen) == 2 and all("--profiling.enable_memory_snapshot" in c for c in seen)
    report = open(os.path.join(out, "report.md")).read()
    assert "## What is alive at step 5's memory peak" in report
    assert "| optimizer states | 0.20 | 0.20 |" in report
    with pytest.raises(SystemExit):
        cli.main(["--memory-snapshot", "--", "--training.steps", "5"])  # no --profile-step
