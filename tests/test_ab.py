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
from moe_testing import TITAN_LOG_SAMPLE as SAMPLE  # a captured TorchTitan log


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


# --- multi-seed A/B (--seeds, ab/stats.py, ab/seeds.py) and two chosen sides (--sides)


def test_t_quantile_matches_tables():
    # Student-t two-sided 95% and 99% critical values (any statistics table).
    for df, t95, t99 in ((1, 12.7062, 63.6567), (2, 4.3027, 9.9248), (4, 2.7764, 4.6041),
                         (9, 2.2622, 3.2498), (30, 2.0423, 2.7500)):
        assert ab.t_quantile(0.975, df) == pytest.approx(t95, abs=1e-4)
        assert ab.t_quantile(0.995, df) == pytest.approx(t99, abs=1e-4)
    assert ab.t_quantile(0.025, 3) == pytest.approx(-ab.t_quantile(0.975, 3))


def test_final_window_and_trailing_means():
    a, b = _run([10.0, 9.0, 8.0, 7.0, 6.0]), _run([10.0, 9.0, 8.0, 7.0])
    # The last step both logged is 4: the window of 2 is steps 3-4.
    assert ab.final_window(a, b, 2) == [3, 4]
    assert ab.final_window(a, a, 10) == [1, 2, 3, 4, 5]  # shorter than the window: all of it
    assert ab.final_window(a, _run([]), 2) == []
    r = ab.seed_result(7, a, b, 2)
    assert (r.seed, r.first_step, r.last_step, r.window_steps) == (7, 3, 4, 2)
    assert r.mean_a == r.mean_b == 7.5 and r.diff == 0.0
    xs, ys = ab.trailing_means(a, 2)
    assert xs == [2, 3, 4, 5] and ys == [9.5, 8.5, 7.5, 6.5]
    xs, ys = ab.trailing_means(_run([4.0, 2.0]), 5)  # one partial window
    assert xs == [1, 2] and ys == [4.0, 3.0]


def _results(a_means, b_means, first=1):
    return [ab.SeedResult(first + i, 81, 100, 20, x, y, y - x, (y - x) / x)
            for i, (x, y) in enumerate(zip(a_means, b_means))]


# Side A's final-window means over 4 seeds: the seed moves the loss by ~0.05 (within-side
# spread), far more than the per-seed differences below.
A_MEANS = [3.20, 3.27, 3.15, 3.23]


def test_seed_stats_systematic_gap_is_different():
    b = [x + d for x, d in zip(A_MEANS, [-0.020, -0.018, -0.022, -0.019])]
    st = ab.seed_stats(_results(A_MEANS, b), ("stock", "megamoe"), window=20)
    assert st.n == 4 and st.verdict == "different"
    assert st.mean_diff == pytest.approx(-0.01975)
    assert st.sd_diff == pytest.approx(0.0017078, rel=1e-4)
    assert st.se_diff == pytest.approx(st.sd_diff / 2)
    assert st.t_crit == pytest.approx(3.1824, abs=1e-4)  # df 3
    assert abs(st.t_stat) > st.t_crit and st.threshold == pytest.approx(st.t_crit * st.se_diff)
    # Systematic, yet smaller than what changing the seed does to either side, and < 1%.
    assert st.sd_a == pytest.approx(0.050580, rel=1e-4)
    assert st.gap_within_spread is True and st.gap_within_limit is True
    assert "paired t-test" in st.rule and "3.18" in st.rule


def test_seed_stats_noise_only_is_indistinguishable():
    b = [x + d for x, d in zip(A_MEANS, [0.010, -0.012, 0.003, -0.002])]
    st = ab.seed_stats(_results(A_MEANS, b), ("a", "b"))
    assert st.verdict == "indistinguishable"
    assert abs(st.mean_diff) == pytest.approx(0.00025) and abs(st.t_stat) < 1


def test_seed_stats_edge_cases():
    one = ab.seed_stats(_results([3.0], [3.1]))
    assert one.verdict == "undetermined" and one.gap_within_spread is None
    assert one.mean_diff == pytest.approx(0.1) and one.gap_within_limit is False  # 3.3% > 1%
    # Equal differences have no spread: any nonzero gap is systematic, no gap is not.
    assert ab.seed_stats(_results([3.0, 3.1], [3.01, 3.11])).verdict == "different"
    assert ab.seed_stats(_results([3.0, 3.1], [3.0, 3.1])).verdict == "indistinguishable"
    assert ab.seed_stats([]).verdict == "undetermined"
    with pytest.raises(ValueError, match="alpha"):
        ab.seed_stats(_results([3.0], [3.0]), alpha=1.5)


def test_parse_sides():
    assert ab.parse_sides("stock,megamoe") == ab.DEFAULT_SIDES
    fp8, bf16 = ab.parse_sides("fp8=megamoe,bf16=megamoe", "--megamoe.precision fp8",
                               "--megamoe.precision 'bf16'")
    assert (fp8.label, fp8.kind, fp8.args) == ("fp8", "megamoe", ("--megamoe.precision", "fp8"))
    assert bf16.args == ("--megamoe.precision", "bf16")
    a, b = ab.parse_sides("stock,stock")  # stock against stock: the noise floor
    assert (a.label, b.label) == ("stock_a", "stock_b") and a.kind == b.kind == "stock"
    for bad in ("stock", "stock,megamoe,stock", "stock,float8", "a b=stock,megamoe"):
        with pytest.raises(ValueError, match="--sides|kind|label"):
            ab.parse_sides(bad)


def _log_text(losses):
    lines = ["[titan] 2026-12-02 10:00:00,000 - root - INFO - Training starts at step 1"]
    for i, x in enumerate(losses):
        lines.append(
            f"[titan] 2026-12-02 10:00:{1 + i:02d},000 - root - INFO - step: {i + 1:2d}  "
            f"loss: {x:8.5f}  grad_norm:  0.5000  memory: 30.00GiB(21.00%)  tps: 40,000  "
            "tflops: 100.00  mfu: 10.00%"
        )
    return "\n".join(lines) + "\n"


def _arg(cmd, name):
    return cmd[cmd.index(name) + 1] if name in cmd else None


def _fake_trainer(gap, noise, fail=None):
    """A run_one that writes a TorchTitan log: the loss falls from ~6; the seed moves it
    (0.05 per seed) and wiggles it step to step; side B (--megamoe.precision fp8) is ``gap``
    higher plus ``noise[seed]``. ``fail``: (seed, label) that exits 1 with no steps."""
    import math

    calls = []

    def run_one(cmd, log_path, env, timeout):
        seed = int(_arg(cmd, "--debug.seed"))
        label = os.path.basename(_arg(cmd, "--job.dump_folder"))
        calls.append((seed, label, cmd))
        if (seed, label) == fail:
            open(log_path, "w").write("Traceback (most recent call last):\n  boom\n")
            return 1
        steps = int(_arg(cmd, "--training.steps"))
        fp8 = _arg(cmd, "--megamoe.precision") == "fp8"
        losses = [
            2.0 + 4.0 * math.exp(-t / 8) + 0.05 * (seed - 12) + 0.03 * math.sin(seed * 7 + t)
            + (gap + noise.get(seed, 0.0) + 0.002 * math.cos(t * seed)) * fp8
            for t in range(1, steps + 1)
        ]
        with open(log_path, "w") as f:
            f.write(_log_text(losses))
        return 0

    return run_one, calls


CONFIG = os.path.join(os.path.dirname(__file__), "..", "train_configs", "qwen3_moe_tiny_cpu.toml")


def _seeds_cli(tmp_path, *more):
    return [
        "--config", CONFIG, "--out", str(tmp_path / "ab"), "--seeds", "3", "--seed-base", "11",
        "--window", "10", "--sides", "fp8=megamoe,bf16=megamoe",
        "--a-args", "--megamoe.precision fp8", "--b-args", "--megamoe.precision bf16", *more,
        "--", "--training.steps", "30", f"--model.hf_assets_path={tmp_path}/no_assets",
    ]


def test_seeds_loop_systematic_gap_is_different(tmp_path, monkeypatch):
    from torchtitan_megamoe.ab import driver

    fake, calls = _fake_trainer(gap=0.03, noise={11: 0.001, 12: -0.001, 13: 0.0005})
    monkeypatch.setattr(driver, "run_one", fake)
    assert ab.main(_seeds_cli(tmp_path)) == 1  # different
    # Seed by seed, A then B, every run told its seed; the side args come after the common ones.
    assert [(s, l) for s, l, _ in calls] == [(s, l) for s in (11, 12, 13) for l in ("fp8", "bf16")]
    for seed, label, cmd in calls:
        assert cmd[-2:] == ["--megamoe.precision", label]
        assert _arg(cmd, "--debug.seed") == str(seed) and "--training.steps" in cmd
        assert _arg(cmd, "--job.config_file").endswith(f"seed{seed}/{label}.toml")
    out = tmp_path / "ab"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "different" and summary["exit_code"] == 1
    st = summary["stats"]
    # fp8 is side A: B - A = bf16 - fp8 = -(gap + noise) + the 0.002 cos wiggle's window mean.
    assert st["mean_diff"] == pytest.approx(-0.03, abs=2e-3)
    assert st["n"] == 3 and [r["seed"] for r in st["seeds"]] == [11, 12, 13]
    assert all((r["first_step"], r["last_step"]) == (21, 30) for r in st["seeds"])
    assert st["sd_a"] == pytest.approx(0.05, abs=0.01)  # the seed's offset, 0.05 per seed
    report = (out / "report.md").read_text()
    assert "# megamoe A/B over 3 seeds: fp8 vs bf16" in report
    assert "**verdict: DIFFERENT**" in report and "paired t-test" in report
    assert "steps 21-30" in report and "| 12 | 21-30 (10) |" in report
    assert "`--megamoe.precision fp8`" in report
    assert (out / "seeds.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Each seed is a single-seed A/B of its own.
    for seed in (11, 12, 13):
        d = out / f"seed{seed}"
        for name in ("fp8.toml", "bf16.toml", "fp8.log", "bf16.log", "report.md", "ab.png"):
            assert (d / name).stat().st_size > 0
        assert "# megamoe A/B: fp8 vs bf16" in (d / "report.md").read_text()
        conv = tomllib.loads((d / "fp8.toml").read_text())
        assert conv["model"]["converters"] == ["megamoe"]

    # --analyze trains nothing and reaches the same statistics from the logs.
    def no_training(*a, **k):
        raise AssertionError("--analyze must not train")

    monkeypatch.setattr(driver, "run_one", no_training)
    assert ab.main(_seeds_cli(tmp_path, "--analyze")) == 1
    again = json.loads((out / "summary.json").read_text())
    assert again["stats"]["mean_diff"] == st["mean_diff"] and again["analyzed_only"]


def test_seeds_loop_noise_only_is_indistinguishable(tmp_path, monkeypatch):
    from torchtitan_megamoe.ab import driver

    fake, _ = _fake_trainer(gap=0.0, noise={11: 0.004, 12: -0.005, 13: 0.0015})
    monkeypatch.setattr(driver, "run_one", fake)
    assert ab.main(_seeds_cli(tmp_path)) == 0
    summary = json.loads((tmp_path / "ab" / "summary.json").read_text())
    assert summary["verdict"] == "indistinguishable"
    assert summary["stats"]["gap_within_spread"] is True
    assert "**verdict: INDISTINGUISHABLE**" in (tmp_path / "ab" / "report.md").read_text()


def test_seeds_default_sides_failed_run_and_profile(tmp_path, monkeypatch):
    """Stock vs megamoe by default, the seeds from the config's [debug] seed (42); a failed run
    leaves its seed out (exit 2); --profile-step traces the first seed's pair only."""
    from torchtitan_megamoe.ab import driver

    fake, calls = _fake_trainer(gap=0.0, noise={}, fail=(43, "megamoe"))
    monkeypatch.setattr(driver, "run_one", fake)
    res = ab.run_seeds(CONFIG, 1, str(tmp_path / "ab"),
                       ["--training.steps", "8", f"--model.hf_assets_path={tmp_path}/x"],
                       seeds=3, window=4, profile_step=5)
    assert [(s, l) for s, l, _ in calls] == [
        (s, l) for s in (42, 43, 44) for l in ("stock", "megamoe")]
    profiled = [s for s, _, cmd in calls if "--profiling.enable_profiling" in cmd]
    assert profiled == [42, 42]
    assert res.exit_code == 2 and [r.seed for r in res.stats.seeds] == [42, 44]
    assert any("seed 43 left out" in p for p in res.problems)
    report = (tmp_path / "ab" / "report.md").read_text()
    assert "stock vs megamoe" in report and "| 43 | left out |" in report
    assert "Profiled: seed 42" in report and "Where step 5's GPU time goes" in report
    assert (tmp_path / "ab" / "seed42" / "profile.md").exists()
    with pytest.raises(ValueError, match="--debug.seed"):
        ab.run_seeds(CONFIG, 1, str(tmp_path / "ab2"), ["--debug.seed", "3"], seeds=2)


def test_single_seed_with_chosen_sides(tmp_path, monkeypatch):
    """Without --seeds, --sides / --a-args give one A/B of the two sides, judged step by step."""
    from torchtitan_megamoe.ab import driver

    seen = []

    def fake(cmd, log_path, env, timeout):
        seen.append(cmd)
        with open(log_path, "w") as f:
            f.write(SAMPLE)
        return 0

    monkeypatch.setattr(driver, "run_one", fake)
    code = ab.main(["--config", CONFIG, "--out", str(tmp_path / "ab"), "--sides",
                    "stock,fast=megamoe", "--b-args", "--compile.enable", "--",
                    f"--model.hf_assets_path={tmp_path}/x"])
    assert code == 0
    assert "--compile.enable" not in seen[0] and seen[1][-1] == "--compile.enable"
    report = (tmp_path / "ab" / "report.md").read_text()
    assert "# megamoe A/B: stock vs fast" in report and "| | stock | fast |" in report
    assert "B = `fast` (megamoe, `--compile.enable`)" in report
    summary = json.loads((tmp_path / "ab" / "summary.json").read_text())
    assert set(summary["returncodes"]) == {"stock", "fast"} and "fast" in summary
    with pytest.raises(SystemExit):
        ab.main(["--config", CONFIG, "--seed-base", "3"])  # needs --seeds


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory):
    from torchtitan_megamoe import assets

    out = str(tmp_path_factory.mktemp("megamoe_tiny_assets"))
    assets.make_assets(out)
    return out


@pytest.mark.slow
def test_seeds_real_cpu_runs(tiny_assets, tmp_path, monkeypatch):
    """Two seeds x 6 steps of the tiny config on CPU, stock vs megamoe: four real trainings,
    two at a time (--jobs 2: concurrent torchruns, each with its own rendezvous store; ~1 min
    on 2 cores). fp32 on both sides: the gap is ~1e-7, far inside any spread."""
    from torchtitan_megamoe import assets

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("MEGAMOE_CPU", "1")
    for k, v in assets.offline_env(str(tmp_path / "hf_home")).items():
        monkeypatch.setenv(k, v)
    extra = ["--model.hf_assets_path", assets.tokenizer_dir(tiny_assets),
             "--training.dataset_path", assets.dataset_dir(tiny_assets), "--training.steps", "6"]
    res = ab.run_seeds(CONFIG, 1, str(tmp_path / "ab"), extra, seeds=2, seed_base=1, window=3,
                       timeout=300, jobs=2)
    if res.exit_code == 2:
        pytest.fail((tmp_path / "ab" / "report.md").read_text())
    assert [r.status for r in res.records] == ["ok"] * 4
    assert any(r.overlapped for r in res.records)
    st = res.stats
    assert st.n == 2 and st.verdict in ("indistinguishable", "different")
    assert all((r.first_step, r.last_step) == (4, 6) for r in st.seeds)
    assert abs(st.mean_rel_diff) < 1e-4
    # The seed really changes the run (initial weights): the two seeds' losses differ.
    p1, p2 = res.pairs[1], res.pairs[2]
    assert p1.stock.steps[0].loss != p2.stock.steps[0].loss
    assert (tmp_path / "ab" / "seeds.png").stat().st_size > 0


# --- the tool's extra (matplotlib) and what a CPU run's speed means


def test_missing_matplotlib_names_the_extra_before_any_training(tmp_path, monkeypatch):
    import sys

    from torchtitan_megamoe.ab import driver

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'torchtitan-megamoe\[ab\]'"):
        ab.plot(_run([6.0]), _run([6.0]), str(tmp_path / "ab.png"))

    def no_training(*a, **k):
        raise AssertionError("the CLI must stop before training")

    monkeypatch.setattr(driver, "run_one", no_training)
    with pytest.raises(SystemExit) as stop:
        ab.main(["--config", CONFIG, "--out", str(tmp_path / "ab")])
    assert stop.value.code == 2
    # The library part of the tool works without it.
    assert ab.compare(_run([6.0]), _run([6.0]), 1e-5, 1e-5).ok


def _timed(times_s):
    return ab.RunLog(steps=[ab.Step(i + 1, 5.0, 1.0, 0.5, 1.0, 1000.0, 0.0, 0.0, t)
                            for i, t in enumerate(times_s)])


def test_speed_up_also_from_median_step_times_which_ignore_a_few_slow_steps():
    # step 2 recompiles in both runs; the steady steps are 300 vs 200 ms
    stock, conv = _timed([1.0, 0.9, 0.3, 0.3, 0.3]), _timed([1.0, 0.5, 0.2, 0.2, 0.2])
    text = ab.render_report(stock, conv, ab.compare(stock, conv, 1e-5, 1e-5),
                            {"config": "x.toml", "nproc": 1, "extra_args": [], "device": "CUDA"})
    assert "| step time ms (median, step 2+) | 300.0 | 200.0 |" in text
    assert "| step time ms (mean, step 2+) | 450.0 | 275.0 |" in text
    speed = next(line for line in text.splitlines() if line.startswith("Speed-up"))
    assert speed.endswith("1.636 (median: 1.500)")


def test_cpu_reports_say_their_timings_say_nothing_about_gpus():
    stock, conv = _run([6.0, 5.5, 5.0]), _run([6.0, 5.5, 5.0])
    cmp = ab.compare(stock, conv, rtol=1e-5, atol=1e-5)
    meta = {"config": "x.toml", "nproc": 1, "extra_args": []}
    cpu = ab.render_report(stock, conv, cmp, dict(meta, device="CPU (gloo, MEGAMOE_CPU shims)"))
    speed = next(line for line in cpu.splitlines() if line.startswith("Speed-up"))
    assert "1.000" in speed and "say nothing about speed on a GPU" in speed
    gpu = ab.render_report(stock, conv, cmp, dict(meta, device="CUDA"))
    assert "say nothing about speed on a GPU" not in gpu


# --- FP8 on CPU: the reference backend's emulation of the recipe against bf16 precision

FP8_CONFIG = os.path.join(os.path.dirname(__file__), "..", "train_configs",
                          "qwen3_moe_tiny_fp8_cpu.toml")

# Step 1 runs the forward on the same weights and batch in both runs; only the e4m3 rounding
# of the expert GEMMs' operands differs. That rounding moves the MoE output by a few percent,
# and at initialization the tiny model's MoE branch carries little of the loss: removing it
# entirely moves this config's step-1 loss by ~5e-6 relative (measured), and fp8 vs bf16
# differs by ~3e-6. 1e-4 leaves a 30x margin, while an FP8 scale lost or applied twice (outputs
# off by up to 448x, the e4m3 range) moves the step-1 loss by ~7e-3.
FP8_STEP1_RTOL = 1e-4
# Later steps: the FP8 gradients steer the updates, so the runs drift apart (~1e-3 relative by
# step 10, measured); 1e-2 is the tool's tolerance for a bf16-class difference on GPUs too.
FP8_RTOL = 1e-2


@pytest.mark.slow
def test_fp8_vs_bf16_on_cpu_through_the_cli(tiny_assets, tmp_path):
    """``python -m torchtitan_megamoe.ab`` on the FP8 CPU config: fp8 (as the TOML says)
    against ``--megamoe.precision bf16``, both with the converter (two 10-step trainings)."""
    import subprocess
    import sys

    from torchtitan_megamoe import assets

    out = tmp_path / "ab"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", MEGAMOE_CPU="1",
               **assets.offline_env(str(tmp_path / "hf_home")))
    cmd = [sys.executable, "-m", "torchtitan_megamoe.ab", "--config", FP8_CONFIG, "--out",
           str(out), "--sides", "fp8=megamoe,bf16=megamoe", "--b-args",
           "--megamoe.precision bf16", "--rtol", str(FP8_RTOL), "--timeout", "300", "--",
           "--model.hf_assets_path", assets.tokenizer_dir(tiny_assets),
           "--training.dataset_path", assets.dataset_dir(tiny_assets)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=700)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    cmp = summary["comparison"]
    assert cmp["steps"] == list(range(1, 11)) and cmp["max_rel_diff"] <= FP8_RTOL
    assert cmp["rel_diff"][0] <= FP8_STEP1_RTOL
    # The precision really reached the op: the runs are not bit-identical.
    assert cmp["max_abs_diff"] > 0
    assert "precision=fp8" in (out / "fp8.log").read_text()
    assert "precision=bf16" in (out / "bf16.log").read_text()
    assert "say nothing about speed on a GPU" in done.stdout
