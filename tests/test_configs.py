"""The TOML train configs: they parse, say what they claim, and build on a CPU-only machine.

Parsing runs in this process through TorchTitan's own ConfigManager (which imports our
``custom_config_module``). The dry runs build each big config the way ``torchtitan.train`` does,
with ``--comm.mode fake_backend``: a fake process group of NGPU ranks, this process as rank 0,
the real meshes, EP, activation checkpointing, compile wrappers, FSDP and rank 0's materialized
and initialized parameter shards. All dry runs share one subprocess (this file run as a script;
one import of TorchTitan), which reports per config what the model looks like.

Dry-run cost on a 2-core CI machine (peak RSS is the process's, CPU seconds per config; the
truncated-normal init fill is replaced by a uniform one, see ``_cheap_trunc_normal``): 30B-A3B on
32 ranks ~10 s, ~4.5 GB; 235B-A22B on 128 ranks ~14 s, ~8 GB (the largest; CI has 24 GB); the
A/B configs run at reduced depth (their per-layer wiring is what is checked), ~2-4 s each. The
whole file takes about a minute.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os
import subprocess
import sys
import time

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_DIR = os.path.join(REPO, "train_configs")

PRODUCTION = {
    # file: (flavor, world size, EP degree, activation checkpointing as flavors_gpu names it)
    "qwen3_30b_a3b.toml": ("30B-A3B", 32, 8, "op"),
    "qwen3_235b_a22b.toml": ("235B-A22B", 128, 8, "full"),
}
AB = {
    # file: (production file it mirrors, GPUs, EP degree)
    "qwen3_30b_a3b_ab_2gpu.toml": ("qwen3_30b_a3b.toml", 2, 2),
    "qwen3_30b_a3b_ab_8gpu.toml": ("qwen3_30b_a3b.toml", 8, 8),
    "qwen3_235b_a22b_ab_2gpu.toml": ("qwen3_235b_a22b.toml", 2, 2),
    "qwen3_235b_a22b_ab_8gpu.toml": ("qwen3_235b_a22b.toml", 8, 8),
}
TOKENS_PER_GPU = 16384


def _path(name: str) -> str:
    return os.path.join(CONFIG_DIR, name)


def _load_toml(name: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    with open(_path(name), "rb") as f:
        return tomllib.load(f)


@functools.lru_cache(maxsize=None)
def _parse(name: str, *cli: str):
    # Cached (tyro parsing takes ~1 s); callers must not mutate the result.
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--job.config_file", _path(name), *cli])


def _base_flavor(flavor: str) -> str:
    return flavor.rsplit("-L", 1)[0] if "-L" in flavor else flavor


# --------------------------------------------------------------------------------------------
# Parsing (in process, fast).


def test_expected_configs_exist():
    present = {os.path.basename(p) for p in glob.glob(os.path.join(CONFIG_DIR, "*.toml"))}
    missing = (set(PRODUCTION) | set(AB)) - present
    assert not missing, f"train_configs/ lacks {sorted(missing)}"


def test_every_toml_parses_with_megamoe_section():
    from torchtitan_megamoe.config import MegaMoEConfig

    paths = sorted(glob.glob(os.path.join(CONFIG_DIR, "*.toml")))
    assert paths
    for path in paths:
        name = os.path.basename(path)
        raw = _load_toml(name)
        # The CLI overrides the TOML; every other [megamoe] key lands as written.
        cfg = _parse(name, "--megamoe.precision", "fp8")
        assert cfg.job.custom_config_module == "torchtitan_megamoe.config", name
        section = raw.get("megamoe", {})
        assert set(section) <= {f.name for f in dataclasses.fields(MegaMoEConfig)}, name
        assert cfg.megamoe.precision == "fp8", name
        for key, value in section.items():
            if key != "precision":
                assert getattr(cfg.megamoe, key) == value, (name, key)
        if cfg.experimental.custom_import:
            __import__(cfg.experimental.custom_import)
        from torchtitan.models.qwen3 import qwen3_args

        if cfg.model.name == "qwen3":
            assert cfg.model.flavor in qwen3_args, (name, cfg.model.flavor)


def test_production_configs_set_and_document_every_megamoe_field():
    from torchtitan_megamoe.config import MegaMoEConfig

    for name in list(PRODUCTION):
        raw = _load_toml(name)
        assert set(raw["megamoe"]) == {f.name for f in dataclasses.fields(MegaMoEConfig)}, name
        with open(_path(name)) as f:
            text = f.read()
        section = text[text.index("[megamoe]") :]
        comments = " ".join(line for line in section.splitlines() if line.lstrip().startswith("#"))
        for field in raw["megamoe"]:
            assert f"{field}:" in comments, f"{name}: [megamoe] {field} has no comment"


def test_production_configs_match_their_description():
    for name, (flavor, world, ep, ac) in PRODUCTION.items():
        cfg = _parse(name)
        assert (cfg.model.name, cfg.model.flavor) == ("qwen3", flavor), name
        assert cfg.model.converters == ["megamoe"], name
        assert dataclasses.asdict(cfg.megamoe) == _load_toml(name)["megamoe"], name
        assert cfg.parallelism.expert_parallel_degree == ep, name
        assert cfg.parallelism.data_parallel_shard_degree == -1, name
        assert cfg.parallelism.tensor_parallel_degree == 1, name
        assert cfg.training.seq_len * cfg.training.local_batch_size == TOKENS_PER_GPU, name
        assert (cfg.training.dtype, cfg.training.mixed_precision_param) == (
            "float32",
            "bfloat16",
        ), name
        assert cfg.training.mixed_precision_reduce == "float32", name
        assert cfg.compile.enable, name
        expected_ac = ("selective", "op") if ac == "op" else ("full", None)
        got_ac = (cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option)
        assert got_ac[0] == expected_ac[0] and expected_ac[1] in (None, got_ac[1]), name
        with open(_path(name)) as f:
            header = f.read().split("[job]")[0]
        assert "--nproc_per_node 8" in header and f"--nnodes {world // 8}" in header, name
        assert f"NGPU={world}" in header, name


def test_production_configs_fit_an_h200_by_the_estimate():
    from torchtitan.models.qwen3 import qwen3_args

    from torchtitan_megamoe.flavors_gpu import estimate_peak_gib, H200_GIB, HEADROOM

    for name, (flavor, world, ep, ac) in PRODUCTION.items():
        est = estimate_peak_gib(qwen3_args[flavor], world, ep, TOKENS_PER_GPU, ac)
        assert est.total_gib <= H200_GIB * HEADROOM, (name, est)
    # Why 235B uses full AC: per-op SAC would not fit even the whole GPU.
    big = estimate_peak_gib(qwen3_args["235B-A22B"], 128, 8, TOKENS_PER_GPU, "op")
    assert big.total_gib > H200_GIB


def test_ab_configs_mirror_production_at_the_deepest_fitting_depth():
    import torchtitan_megamoe.flavors_gpu as fg
    from torchtitan.models.qwen3 import qwen3_args

    for name, (prod, gpus, ep) in AB.items():
        cfg, ref = _parse(name), _parse(prod)
        assert cfg.experimental.custom_import == "torchtitan_megamoe.flavors_gpu", name
        args, base = qwen3_args[cfg.model.flavor], qwen3_args[ref.model.flavor]
        assert _base_flavor(cfg.model.flavor) == ref.model.flavor, name
        for field in dataclasses.fields(base):
            if field.name not in ("n_layers", "max_seq_len"):
                assert getattr(args, field.name) == getattr(base, field.name), (name, field.name)
        assert cfg.parallelism.expert_parallel_degree == ep, name
        assert cfg.model.converters == ["megamoe"], name
        for section in ("training", "activation_checkpoint", "compile"):
            a, b = getattr(cfg, section), getattr(ref, section)
            for field in ("seq_len", "local_batch_size", "dtype", "mixed_precision_param",
                          "mixed_precision_reduce", "mode", "selective_ac_option", "enable",
                          "components"):
                if hasattr(b, field):
                    assert getattr(a, field) == getattr(b, field), (name, section, field)
        assert cfg.megamoe == ref.megamoe, name
        ac = PRODUCTION[prod][3]
        deepest = fg.max_layers(ref.model.flavor, gpus, ep, TOKENS_PER_GPU, ac)
        assert deepest >= 1, name
        assert args.n_layers == deepest, (
            f"{name}: flavor has {args.n_layers} layers; the memory estimate allows {deepest}"
        )
        with open(_path(name)) as f:
            header = f.read().split("[job]")[0]
        assert f"--nproc {gpus}" in header and f"Per GPU, {deepest} layers" in header, name


def test_gpu_configs_load_the_next_batch_in_one_worker(tmp_path):
    """Every GPU config tokenizes the next batch in one dataloader worker while the step runs
    (without one the host does it between steps, ~25 ms at seq 8192, the GPU idle), and gets
    the batches a loader without workers gives, in order. Never more than one worker: TorchTitan's
    HF dataset does not shard by worker, so each would yield the same batches."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import build_text_dataloader

    from torchtitan_megamoe import assets

    gpu = sorted(os.path.basename(p) for p in glob.glob(os.path.join(CONFIG_DIR, "*.toml"))
                 if not p.endswith("_cpu.toml"))
    assert set(PRODUCTION) | set(AB) <= set(gpu)
    for name in gpu:
        loader = _parse(name).training.dataloader
        assert (loader.num_workers, loader.persistent_workers) == (1, True), name
    out = str(tmp_path)
    assets.make_assets(out)
    tokenizer = HuggingFaceTokenizer(assets.tokenizer_dir(out))
    batches = {}
    for workers in (0, 1):
        cfg = _parse("qwen3_30b_a3b_gpu_smoke.toml", "--training.dataset_path",
                     assets.dataset_dir(out), "--training.seq_len", "64",
                     "--training.dataloader.num_workers", str(workers))
        it = iter(build_text_dataloader(1, 0, tokenizer, cfg))
        batches[workers] = [next(it) for _ in range(6)]
    for (a, la), (b, lb) in zip(batches[0], batches[1]):
        assert torch.equal(a["input"], b["input"]) and torch.equal(la, lb)
    assert not torch.equal(batches[0][0][0]["input"], batches[0][1][0]["input"])


def test_reduced_flavors_are_independent_copies():
    import torchtitan_megamoe.flavors_gpu as fg
    from torchtitan.models.qwen3 import qwen3_args

    fg.register()  # idempotent
    small = qwen3_args["235B-A22B-L2"]
    assert small.n_layers == 2 and qwen3_args["235B-A22B"].n_layers == 94
    assert small.moe_args is not qwen3_args["235B-A22B"].moe_args
    assert fg.param_count(qwen3_args["30B-A3B"]) == 30_532_122_624


def test_cli_cannot_empty_converters():
    # The documented reason why the stock run needs `converters = []` in a TOML (or the A/B
    # tool's rewritten copy) rather than a CLI flag.
    from torchtitan.protocols.model_converter import build_model_converters

    cfg = _parse("qwen3_30b_a3b.toml", "--model.converters", "")
    assert cfg.model.converters == [""]
    with pytest.raises(KeyError):
        build_model_converters(cfg, None)


# --------------------------------------------------------------------------------------------
# Dry runs (one subprocess for all of them).

# (name, config, world size, extra CLI, also build the same config stock and compare)
DRY_RUNS = [
    ("30B-A3B x32", "qwen3_30b_a3b.toml", 32, [], False),
    # Reduced depth: the 8-GPU A/B configs at full/14 layers would need 15-18 GB of fp32 shards
    # on one CPU; their per-layer wiring (EP=8 over the whole world, efsdp=1) is the same at
    # 1-2 layers.
    ("A/B 30B x8", "qwen3_30b_a3b_ab_8gpu.toml", 8, ["--model.flavor", "30B-A3B-L2"], True),
    ("A/B 235B x8", "qwen3_235b_a22b_ab_8gpu.toml", 8, ["--model.flavor", "235B-A22B-L1"], False),
    ("A/B 30B x2", "qwen3_30b_a3b_ab_2gpu.toml", 2, ["--model.flavor", "30B-A3B-L1"], False),
    ("235B-A22B x128", "qwen3_235b_a22b.toml", 128, [], False),
]


def _vm_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


def _summarize(trainer) -> dict:
    from torch.distributed.tensor import DTensor

    model = trainer.model_parts[0]
    params = {}
    for fqn, p in model.named_parameters():
        entry = {"shape": list(p.shape), "dtype": str(p.dtype), "device": p.device.type}
        if isinstance(p, DTensor):
            entry["mesh"] = list(p.device_mesh.mesh_dim_names)
            entry["mesh_shape"] = list(p.device_mesh.shape)
            entry["placements"] = [repr(pl) for pl in p.placements]
            entry["local_shape"] = list(p.to_local().shape)
            # A sample: a full scan of rank 0's shards costs seconds per config.
            entry["local_finite"] = bool(p.to_local().flatten()[:4096].isfinite().all())
        params[fqn] = entry
    # Class names along the MRO: FSDP and AC wrap modules in subclasses (FSDPMegaExperts, ...).
    modules = {
        fqn: [c.__name__ for c in type(m).__mro__]
        for fqn, m in model.named_modules()
        if fqn.endswith(".moe") or fqn.endswith(".moe.experts")
    }
    pd = trainer.parallel_dims
    return {
        "params": params,
        "modules": modules,
        "flavor": trainer.job_config.model.flavor,
        "n_layers": trainer.model_args.n_layers,
        "num_experts": trainer.model_args.moe_args.num_experts,
        "dims": {"world": pd.world_size, "ep": pd.ep, "dp_shard": pd.dp_shard},
        # Global ranks of rank 0's EP group: must be one node's GPUs (NVLink), i.e. 0..ep-1.
        "ep_ranks": pd.get_mesh("ep").mesh.tolist() if pd.ep > 1 else [0],
    }


def _dry_run_one(config: str, world: int, extra: list[str], stock: bool, dump: str) -> dict:
    import gc

    import torch.distributed as dist
    import torchtitan.train as tt
    from torchtitan.config import ConfigManager

    os.environ["NGPU"] = os.environ["WORLD_SIZE"] = str(world)
    args = ["--job.config_file", _path(config), "--comm.mode", "fake_backend",
            "--training.steps", "0", "--job.dump_folder", dump, *extra]
    cfg = ConfigManager().parse_args(args)
    if stock:
        cfg.model.converters = [c for c in cfg.model.converters if c != "megamoe"]
    trainer = tt.Trainer(cfg)
    try:
        summary = _summarize(trainer)
        summary["converters"] = list(cfg.model.converters)
    finally:
        trainer.close()
        del trainer
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
    return summary


def _cheap_trunc_normal(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
    # Stand-in for torch.nn.init.trunc_normal_ in dry runs: same bounds, uniform fill. The
    # initial values are not what a dry run checks, and the exact fill (~30 ns per element on
    # CPU) was two thirds of the dry runs' time; init_weights itself still runs on every shard.
    import torch

    with torch.no_grad():
        return tensor.uniform_(max(a, mean - 2 * std), min(b, mean + 2 * std), generator=generator)


def _dry_run_main(spec_path: str, out_path: str) -> None:
    """Subprocess entry: run every dry run in ``spec_path``, write results as they finish."""
    import traceback

    import torch

    torch.nn.init.trunc_normal_ = _cheap_trunc_normal

    with open(spec_path) as f:
        spec = json.load(f)
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("RANK", "0")
    results = {}
    for run in spec["runs"]:
        variants = [("megamoe", False)] + ([("stock", True)] if run["stock"] else [])
        for label, stock in variants:
            key = run["name"] + ("" if not stock else " (stock)")
            try:
                # Reset VmHWM so each run reports its own peak (Linux: "5" -> clear_refs).
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                res = _dry_run_one(
                    run["config"], run["world"], run["extra"], stock,
                    os.path.join(spec["dump"], key.replace(" ", "_").replace("/", "_")),
                )
            except Exception:
                res = {"error": traceback.format_exc()}
            res["wall_s"] = time.perf_counter() - t0
            res["cpu_s"] = time.process_time() - c0
            res["peak_rss_gb"] = _vm_kib("VmHWM") * 1024 / 1e9
            results[key] = res
            with open(out_path + ".tmp", "w") as f:
                json.dump(results, f)
            os.replace(out_path + ".tmp", out_path)


def _dry_run_results(tmp_dir: str) -> dict:
    from torchtitan_megamoe import assets

    assets_dir = os.path.join(tmp_dir, "assets")
    assets.make_assets(assets_dir)
    data = ["--model.hf_assets_path", assets.tokenizer_dir(assets_dir),
            "--training.dataset", "c4_test",
            "--training.dataset_path", assets.dataset_dir(assets_dir)]
    spec = {
        "dump": os.path.join(tmp_dir, "dump"),
        "runs": [
            {"name": n, "config": c, "world": w, "extra": data + e, "stock": s}
            for n, c, w, e, s in DRY_RUNS
        ],
    }
    spec_path, out_path = os.path.join(tmp_dir, "spec.json"), os.path.join(tmp_dir, "out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ)
    for k in ("NGPU", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(assets.offline_env(os.path.join(tmp_dir, "hf_home")))
    env["MEGAMOE_CPU"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), spec_path, out_path],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    results = {}
    if os.path.exists(out_path):
        with open(out_path) as f:
            results = json.load(f)
    results["_proc"] = {"returncode": proc.returncode, "tail": (proc.stdout + proc.stderr)[-4000:]}
    return results


def _check_dry_run(results: dict, key: str) -> dict:
    assert key in results, f"dry run {key!r} did not finish: {results['_proc']}"
    res = results[key]
    assert "error" not in res, f"dry run {key!r} failed:\n{res['error']}"
    # Fails loudly if a config outgrows CI (24 GB), see the module docstring.
    assert res["peak_rss_gb"] < 12, f"{key}: peak RSS {res['peak_rss_gb']:.1f} GB"
    return res


def _check_sharding(key: str, res: dict, ep: int, world: int, converted: bool) -> None:
    from torchtitan.models.qwen3 import qwen3_args

    assert res["dims"] == {"world": world, "ep": ep, "dp_shard": world}, key
    assert res["ep_ranks"] == list(range(ep)), (key, res["ep_ranks"])
    n_layers, num_experts = res["n_layers"], res["num_experts"]
    experts = [f for f in res["modules"] if f.endswith(".moe.experts")]
    moes = [f for f in res["modules"] if f.endswith(".moe")]
    assert len(experts) == len(moes) == n_layers, key
    for f in moes:
        moe, exp = res["modules"][f], res["modules"][f + ".experts"]
        assert "MoE" in moe and "GroupedExperts" in exp, (key, f, moe, exp)
        assert ("MegaMoE" in moe) == converted and ("MegaExperts" in exp) == converted, (
            key, f, moe, exp)
    total = 0
    for fqn, p in res["params"].items():
        total += _numel(p["shape"])
        assert p["device"] == "cpu" and p["dtype"] == "torch.float32", (key, fqn, p)
        assert "placements" in p and p["local_finite"], (key, fqn, p)
        if ".moe.experts.w" in fqn:
            # Experts: Shard(0) on the ep mesh (rank r owns a contiguous block of experts),
            # FSDP on efsdp on top; rank 0 keeps num_experts / world of them.
            assert p["mesh"] == ["efsdp", "ep"], (key, fqn, p)
            assert p["mesh_shape"] == [world // ep, ep], (key, fqn, p)
            assert p["placements"][1] == "Shard(dim=0)", (key, fqn, p)
            assert p["local_shape"] == [num_experts // world] + p["shape"][1:], (key, fqn, p)
        else:
            assert p["mesh"] == ["fsdp"] and p["placements"] == ["Shard(dim=0)"], (key, fqn, p)
    from torchtitan_megamoe.flavors_gpu import param_count

    # The parameter arithmetic behind the memory estimates, against the real model.
    assert total == param_count(qwen3_args[res["flavor"]]), (key, total)


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
    return _dry_run_results(str(tmp_path_factory.mktemp("dry_runs")))


@pytest.mark.slow
def test_dry_run_30b_production(dry_runs):
    res = _check_dry_run(dry_runs, "30B-A3B x32")
    _check_sharding("30B-A3B x32", res, ep=8, world=32, converted=True)


@pytest.mark.slow
def test_dry_run_235b_production(dry_runs):
    res = _check_dry_run(dry_runs, "235B-A22B x128")
    _check_sharding("235B-A22B x128", res, ep=8, world=128, converted=True)


@pytest.mark.slow
def test_dry_run_ab_configs(dry_runs):
    for key, ep, world in (("A/B 30B x8", 8, 8), ("A/B 235B x8", 8, 8), ("A/B 30B x2", 2, 2)):
        _check_sharding(key, _check_dry_run(dry_runs, key), ep=ep, world=world, converted=True)


@pytest.mark.slow
def test_dry_run_stock_matches_converted(dry_runs):
    # Same parameter names, global/local shapes and placements with and without the converter:
    # checkpoints and optimizer state interchange, and the A/B compares like with like.
    conv = _check_dry_run(dry_runs, "A/B 30B x8")
    stock = _check_dry_run(dry_runs, "A/B 30B x8 (stock)")
    _check_sharding("A/B 30B x8 (stock)", stock, ep=8, world=8, converted=False)
    assert stock["converters"] == [] and conv["converters"] == ["megamoe"]
    assert stock["params"] == conv["params"]


if __name__ == "__main__":
    _dry_run_main(sys.argv[1], sys.argv[2])
