"""The A/B tool's parts on captured TorchTitan output (fast; the end-to-end runs of
``torchtitan_megamoe.ab`` are in test_smoke_train.py)."""

import json
import os

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from torchtitan_megamoe import ab

# Rank 0 of a real 2-rank FSDP + EP=2 CPU run of train_configs/qwen3_moe_tiny_cpu.toml (stock),
# trimmed, plus one colored line as TorchTitan prints it by default and a validation line.
SAMPLE = """\
[titan] 2026-11-29 22:12:36,985 - root - INFO - Building device mesh with parallelism: pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=2, etp=1
[titan] 2026-11-29 22:12:37,102 - root - INFO - Applied FSDP to the model
[titan] 2026-11-29 22:12:37,338 - root - INFO - Training starts at step 1
[titan] 2026-11-29 22:12:38,129 - root - INFO - step:  1  loss:  6.80345  grad_norm:  0.8245  memory:  0.56GiB(2.38%)  tps: 239  tflops: 0.00  mfu: 0.00%
[titan] 2026-11-29 22:12:38,130 - root - INFO - Synchronizing and adjusting timeout for all ProcessGroups to 0:01:40
[titan] 2026-11-29 22:12:38,236 - root - INFO - step:  2  loss:  6.71143  grad_norm:  0.7650  memory:  0.56GiB(2.38%)  tps: 2,410  tflops: 0.00  mfu: 0.00%
[titan] 2026-11-29 22:12:38,318 - root - INFO - \x1b[31mstep:  3  \x1b[32mloss:  6.59527  \x1b[38;2;180;60;0mgrad_norm:  0.8820  \x1b[38;2;54;234;195mmemory:  0.56GiB(2.39%)  \x1b[34mtps: 3,134  \x1b[36mtflops: 0.00  \x1b[35mmfu: 0.00%\x1b[39m
[titan] 2026-11-29 22:12:38,319 - root - INFO - validate step:  3  loss:  6.9000  memory:  0.56GiB(2.39%)  tps: 9,999
[titan] 2026-11-29 22:12:38,502 - root - INFO - step:  5  loss:  6.32579  grad_norm:  0.8398  memory:  0.57GiB(2.40%)  tps: 1,474  tflops: 1,234.50  mfu: 12.50%
[titan] 2026-11-29 22:12:39,002 - root - INFO - Sleeping 2 seconds for other ranks to complete
"""


def test_parse_log_reads_every_field_and_skips_validation():
    run = ab.parse_log(SAMPLE)
    assert [s.step for s in run.steps] == [1, 2, 3, 5]
    s1, s2, s3, s5 = run.steps
    assert (s1.loss, s1.grad_norm, s1.memory_gib, s1.memory_pct) == (6.80345, 0.8245, 0.56, 2.38)
    assert s2.tps == 2410.0 and s3.tps == 3134.0
    assert s3.loss == 6.59527  # colored line
    assert s5.tflops == 1234.5 and s5.mfu == 12.5


def test_parse_log_step_times_from_timestamps():
    run = ab.parse_log(SAMPLE)
    times = [s.time_s for s in run.steps]
    # step 1 is measured from "Training starts", later steps from the previous step line,
    # and a gap of two steps (log_freq) is averaged over both.
    assert times[0] == pytest.approx(0.791)
    assert times[1] == pytest.approx(0.107)
    assert times[2] == pytest.approx(0.082)
    assert times[3] == pytest.approx((38.502 - 38.318) / 2)


def test_parse_log_keeps_first_line_of_each_step_when_ranks_interleave():
    line = (
        "[titan] 2026-11-29 22:12:38,{ms} - root - INFO - step:  1  loss:  {loss}  grad_norm:  "
        "0.8245  memory:  0.56GiB(2.38%)  tps: 239  tflops: 0.00  mfu: 0.00%"
    )
    text = line.format(ms="100", loss="6.80345") + "\n" + line.format(ms="101", loss="1.00000")
    run = ab.parse_log(text)
    assert len(run.steps) == 1 and run.steps[0].loss == 6.80345


def test_parse_log_without_steps():
    assert ab.parse_log("Traceback (most recent call last):\n  boom\n").steps == []


def _run(losses, start=1):
    return ab.RunLog(
        steps=[
            ab.Step(start + i, x, 1.0, 0.5, 1.0, 1000.0 * (i + 1), 0.0, 0.0, 0.01 * (i + 1))
            for i, x in enumerate(losses)
        ]
    )


def test_compare_within_and_beyond_tolerance():
    ok = ab.compare(_run([6.0, 5.5]), _run([6.00001, 5.5]), rtol=1e-5, atol=1e-5)
    assert ok.ok and ok.max_abs_diff == pytest.approx(1e-5)
    assert ok.max_rel_diff == pytest.approx(1e-5 / 6.0)
    bad = ab.compare(_run([6.0, 5.5]), _run([6.0, 5.6]), rtol=1e-5, atol=1e-5)
    assert not bad.ok
    assert bad.max_abs_diff == pytest.approx(0.1)
    assert len(bad.problems) == 1 and "step 2" in bad.problems[0]


def test_compare_flags_missing_steps_empty_runs_and_nan():
    assert not ab.compare(_run([6.0, 5.5]), _run([6.0]), 1e-5, 1e-5).ok
    empty = ab.compare(_run([]), _run([6.0]), 1e-5, 1e-5)
    assert not empty.ok and "stock run logged no training step" in empty.problems[0]
    nan = ab.compare(_run([float("nan")]), _run([float("nan")]), 1e-5, 1e-5)
    assert not nan.ok and "non-finite" in nan.problems[0]


def test_report_and_plot(tmp_path):
    stock, conv = _run([6.0, 5.5, 5.0]), _run([6.0, 5.5001, 5.0])
    cmp = ab.compare(stock, conv, rtol=1e-5, atol=1e-5)
    text = ab.render_report(stock, conv, cmp, {"config": "x.toml", "nproc": 2, "extra_args": []})
    assert "**FAIL**" in text and "step 2" in text
    assert "| 2 | 5.50000 | 5.50010 | 1.0e-04 |" in text
    assert "moe_force_load_balance" in text  # the routing near-tie hint on failure
    fixed = {"config": "x.toml", "nproc": 2, "extra_args": ["--debug.moe_force_load_balance"]}
    assert "Hint" not in ab.render_report(stock, conv, cmp, fixed)
    # mean step time excludes step 1: (20 + 30) / 2 ms; tokens/s likewise (2000 + 3000) / 2.
    assert "| step time ms (mean, step 2+) | 25.0 | 25.0 |" in text
    assert "| tokens/s per device (mean, step 2+) | 2,500 | 2,500 |" in text
    png = tmp_path / "ab.png"
    ab.plot(stock, conv, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_variant_configs_differ_only_in_converters_and_round_trip():
    path = os.path.join(os.path.dirname(__file__), "..", "train_configs", "qwen3_moe_tiny_cpu.toml")
    with open(path, "rb") as f:
        config = tomllib.load(f)
    stock, conv = ab.variant_configs(config)
    assert stock["model"]["converters"] == []
    assert conv["model"]["converters"] == ["megamoe"]
    for variant in (stock, conv):
        again = tomllib.loads(ab.dump_toml(variant))
        assert again == variant
        rest = {k: v for k, v in again.items() if k != "model"}
        assert rest == {k: v for k, v in config.items() if k != "model"}
    # A stock TOML gets the converter added for the B run; other converters are kept.
    config["model"]["converters"] = ["float8"]
    stock, conv = ab.variant_configs(config)
    assert stock["model"]["converters"] == ["float8"]
    assert conv["model"]["converters"] == ["float8", "megamoe"]


def test_variant_configs_requires_custom_config_module():
    with pytest.raises(ValueError, match="custom_config_module"):
        ab.variant_configs({"model": {"converters": ["megamoe"]}})


def test_dump_toml_nested_tables_and_values():
    data = {"a": {"x": 1, "s": 'q"uote', "b": {"y": [1.5, 2e-8], "t": True}}, "c": {"z": []}}
    assert tomllib.loads(ab.dump_toml(data)) == data


def test_cli_value():
    extra = ["--parallelism.expert_parallel_degree", "2", "--model.hf-assets-path=/x/tok"]
    assert ab.cli_value(extra, "parallelism.expert_parallel_degree") == "2"
    assert ab.cli_value(extra, "model.hf_assets_path") == "/x/tok"
    assert ab.cli_value(extra, "training.dataset_path") is None


def test_main_rejects_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="--config"):
        ab.main(["--config", str(tmp_path / "nope.toml"), "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="nproc"):
        ab.run_ab(str(tmp_path / "nope.toml"), nproc=0, out=str(tmp_path))


def test_summary_json_shape_from_smoke_helpers(tmp_path):
    # summary.json is what CI and benchmarks read; make sure its pieces serialize.
    cmp = ab.compare(_run([6.0]), _run([6.0]), 1e-5, 1e-5)
    blob = json.dumps({"stock": ab.run_stats(_run([6.0, 5.0])), "comparison": cmp.__dict__})
    assert json.loads(blob)["stock"]["steps"] == 2


def test_runs_get_torchtitans_allocator_setting_unless_the_user_set_one(tmp_path, monkeypatch):
    from torchtitan_megamoe.ab import run_env

    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    assert run_env(str(tmp_path))["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    env = run_env(str(tmp_path))
    assert "PYTORCH_ALLOC_CONF" not in env and env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
