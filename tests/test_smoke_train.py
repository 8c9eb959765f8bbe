"""Real TorchTitan training on CPU: stock vs the megamoe converter, through
``torchrun -m torchtitan.train`` (via ``torchtitan_megamoe.ab``), 1 rank and 2 ranks with
FSDP + EP=2 on gloo. Plus fast checks of the pieces these runs stand on (assets, CPU shims).

The slow tests take ~30 s each on 2 CPU cores (two short trainings apiece).
"""

import json
import os
import re
import subprocess
import sys

import pytest

from torchtitan_megamoe import ab, assets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "train_configs", "qwen3_moe_tiny_cpu.toml")
STEPS = 10


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("megamoe_tiny_assets"))
    assets.make_assets(out)
    return out


@pytest.fixture
def cpu_env(monkeypatch, tmp_path):
    # These runs are the CPU smoke test even on a GPU host: hide the GPUs, turn the shims on,
    # keep the HF dataset cache in the test's tmp dir and off the network.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("MEGAMOE_CPU", "1")
    for k, v in assets.offline_env(str(tmp_path / "hf_home")).items():
        monkeypatch.setenv(k, v)


def _ab(tiny_assets, out, nproc, extra, rtol=ab.DEFAULT_RTOL, atol=ab.DEFAULT_ATOL):
    extra = [
        "--model.hf_assets_path",
        assets.tokenizer_dir(tiny_assets),
        "--training.dataset_path",
        assets.dataset_dir(tiny_assets),
        "--training.steps",
        str(STEPS),
        *extra,
    ]
    res = ab.run_ab(CONFIG, nproc=nproc, out=str(out), extra=extra, rtol=rtol, atol=atol,
                    timeout=300)
    logs = {}
    for name in ("stock", ab.CONVERTER):
        with open(os.path.join(str(out), f"{name}.log"), errors="replace") as f:
            logs[name] = f.read()
    if res.exit_code != 0:
        with open(os.path.join(str(out), "report.md")) as f:
            report = f.read()
        tails = "\n".join(f"--- {n}.log (tail)\n" + t[-3000:] for n, t in logs.items())
        pytest.fail(f"A/B exit {res.exit_code}\n{report}\n{tails}")
    return res, logs


def _check_trained(res, logs):
    for run in (res.stock, res.conv):
        assert [s.step for s in run.steps] == list(range(1, STEPS + 1))
        # It learns: the tiny synthetic language is easy, the loss falls from ~ln(512)=6.2.
        assert run.steps[-1].loss < run.steps[0].loss - 0.5
    # The B run really ran the converter, the A run really did not.
    assert re.search(r"megamoe.*convert", logs[ab.CONVERTER], re.IGNORECASE)
    assert not re.search(r"megamoe.*convert", logs["stock"], re.IGNORECASE)
    for name in ("report.md", "ab.png", "summary.json", "stock.toml", "megamoe.toml"):
        assert os.path.getsize(os.path.join(res.out, name)) > 0


@pytest.mark.slow
def test_one_rank_stock_vs_converter(tiny_assets, tmp_path, cpu_env):
    # Routing fixed (round-robin) so that no near-tied top-k choice can flip between the runs:
    # then the fp32 losses must agree to the printed digit (see ab.DEFAULT_RTOL). Op-level
    # selective activation checkpointing on, so the op's recompute in backward is covered too.
    extra = [
        "--debug.moe_force_load_balance",
        "--activation_checkpoint.mode", "selective",
        "--activation_checkpoint.selective_ac_option", "op",
    ]
    res, logs = _ab(tiny_assets, tmp_path / "ab", 1, extra)
    _check_trained(res, logs)
    assert res.comparison.max_rel_diff <= ab.DEFAULT_RTOL


@pytest.mark.slow
def test_two_ranks_fsdp_ep2_stock_vs_converter(tiny_assets, tmp_path, cpu_env):
    res, logs = _ab(
        tiny_assets,
        tmp_path / "ab",
        2,
        ["--parallelism.expert_parallel_degree", "2", "--debug.moe_force_load_balance"],
    )
    _check_trained(res, logs)
    for log in logs.values():
        assert "dp_shard=2" in log and "ep=2" in log
        assert "Applied FSDP to the model" in log
    assert res.comparison.max_rel_diff <= ab.DEFAULT_RTOL


@pytest.mark.slow
def test_two_ranks_ep2_natural_routing(tiny_assets, tmp_path, cpu_env):
    # Learned routing, as in real training. A near-tie can flip one token's expert and move one
    # step's loss by ~1/(tokens per step) ~ 5e-4 abs; anything wrong in the op (scaling, a
    # missing expert, a lost gradient) moves it by far more than 1e-3 relative.
    res, logs = _ab(
        tiny_assets, tmp_path / "ab", 2, ["--parallelism.expert_parallel_degree", "2"], rtol=1e-3
    )
    _check_trained(res, logs)


FP8_CONFIG = os.path.join(ROOT, "train_configs", "qwen3_moe_tiny_fp8_cpu.toml")


@pytest.mark.slow
def test_fp8_training_on_cpu(tiny_assets, tmp_path, cpu_env):
    # The FP8 CPU config as a user runs it (torchrun -m torchtitan.train, one rank): the
    # reference backend emulates the FP8 recipe in every expert GEMM, forward and backward.
    log_path = str(tmp_path / "fp8.log")
    cmd = ab.torchrun_command(FP8_CONFIG, 1, str(tmp_path / "dump"), [
        "--model.hf_assets_path", assets.tokenizer_dir(tiny_assets),
        "--training.dataset_path", assets.dataset_dir(tiny_assets),
    ])
    code = ab.run_one(cmd, log_path, dict(os.environ), 300)
    with open(log_path, errors="replace") as f:
        log = f.read()
    assert code == 0, log[-4000:]
    assert re.search(r"megamoe: converted 2 MoE blocks \(backend=reference, precision=fp8", log)
    run = ab.parse_log(log)
    assert [s.step for s in run.steps] == list(range(1, STEPS + 1))
    # It learns in FP8 too: from ~ln(512) = 6.2 down by more than 0.5 in 10 steps.
    assert run.steps[-1].loss < run.steps[0].loss - 0.5


@pytest.mark.slow
def test_fp8_ep2_trains_as_fp8_ep1(tiny_assets, tmp_path, cpu_env):
    # FP8 at expert_parallel_degree=2 against FP8 over the same 2 ranks at EP=1 (FSDP alone),
    # both with the converter (make ab-ep2-fp8): the exchange's e4m3 dy is the only difference.
    sides = (ab.Side("ep2", "megamoe", ("--parallelism.expert_parallel_degree", "2")),
             ab.Side("ep1", "megamoe"))
    res = ab.run_ab(FP8_CONFIG, nproc=2, out=str(tmp_path / "ab"), sides=sides, rtol=1e-3,
                    timeout=300, extra=[
                        "--model.hf_assets_path", assets.tokenizer_dir(tiny_assets),
                        "--training.dataset_path", assets.dataset_dir(tiny_assets),
                        "--debug.moe_force_load_balance"])
    with open(os.path.join(res.out, "ep2.log"), errors="replace") as f:
        log = f.read()
    assert res.exit_code == 0, res.comparison.problems
    assert "ep=2" in log and re.search(r"precision=fp8\b", log)
    assert [s.step for s in res.conv.steps] == list(range(1, STEPS + 1))
    assert res.comparison.max_rel_diff <= 1e-3


def test_fp8_config_fits_the_recipe_and_the_assets():
    from torchtitan.models.qwen3 import qwen3_args

    from torchtitan_megamoe import flavors
    from torchtitan_megamoe.ops.reference import FP8_BLOCK

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    with open(FP8_CONFIG, "rb") as f:
        config = tomllib.load(f)
    assert "experimental" not in config  # the flavor registers with the config module
    assert config["megamoe"] == {"backend": "reference", "precision": "fp8"}
    args = qwen3_args[config["model"]["flavor"]]
    assert args.dim % FP8_BLOCK == 0 and args.moe_inter_dim % FP8_BLOCK == 0
    assert args.vocab_size == flavors.TINY_VOCAB_SIZE and args.eos_id == flavors.TINY_EOS_ID
    # Its own copy: the CPU flavor it derives from keeps its shape.
    assert qwen3_args["megamoe_tiny"].dim == 64
    assert args.moe_args is not qwen3_args["megamoe_tiny"].moe_args


# --------------------------------------------------------------------------------------------
# Fast checks of what the runs stand on.


def test_assets_are_deterministic_idempotent_and_fit_the_flavor(tmp_path, tiny_assets):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from torchtitan_megamoe import flavors

    out = str(tmp_path / "a")
    assert assets.make_assets(out) is True
    assert assets.make_assets(out) is False  # second call: nothing to do
    for rel in ("tokenizer/tokenizer.json", "dataset/train.jsonl"):
        with open(os.path.join(out, rel), "rb") as mine, open(os.path.join(tiny_assets, rel), "rb") as ref:
            assert mine.read() == ref.read(), f"{rel} differs between two generations"
    tok = HuggingFaceTokenizer(assets.tokenizer_dir(out))
    assert tok.get_vocab_size() <= flavors.TINY_VOCAB_SIZE == assets.DEFAULT_VOCAB_SIZE
    ids = tok.encode("The tiny model learns.", add_bos=True, add_eos=True)
    assert ids[0] == 0 and ids[-1] == flavors.TINY_EOS_ID == 1
    assert tok.decode(ids[1:-1]) == "The tiny model learns."
    with pytest.raises(ValueError, match="vocab_size"):
        assets.make_assets(str(tmp_path / "b"), assets.AssetSpec(vocab_size=100))


_SHIM_PROBE = r"""
import json, torch
import torchtitan.tools.utils as tu
import torchtitan.components.metrics as metrics
import torchtitan.models.moe.utils as moe_utils
from torchtitan_megamoe import cpu
ids = torch.tensor([[0, 3], [3, 7], [1, 3]])
try:
    counts = torch.histc(ids.view(-1), bins=8, min=0, max=8).tolist()
    dtype = str(torch.histc(ids.view(-1), bins=8, min=0, max=8).dtype)
except NotImplementedError:
    counts, dtype = None, None
perm = None
if cpu.applied():
    tpe = torch.tensor([2, 0, 3, 1])
    perm = moe_utils.generate_permute_indices(tpe, 2, 2, 32, 8)[1].tolist()
    monitor = metrics.build_device_memory_monitor()
    stats = monitor.get_peak_stats()
    assert stats.max_reserved_gib > 0.05, stats
print(json.dumps({"applied": cpu.applied(), "device_type": tu.device_type,
                  "counts": counts, "dtype": dtype, "m_sizes": perm}))
"""


def _probe(env_value):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("MEGAMOE_CPU", None)
    if env_value is not None:
        env["MEGAMOE_CPU"] = env_value
    out = subprocess.run(
        [sys.executable, "-c", _SHIM_PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cpu_shims_are_opt_in():
    off = _probe(None)
    assert off == {
        "applied": False, "device_type": "cuda", "counts": None, "dtype": None, "m_sizes": None
    }
    on = _probe("1")
    assert on["applied"] is True and on["device_type"] == "cpu"
    assert on["counts"] == [1, 1, 0, 3, 0, 0, 0, 1] and on["dtype"] == "torch.int64"
    # local experts 0, 1 receive 2+3 and 0+1 rows; each padded to the alignment of 8.
    assert on["m_sizes"] == [8, 8]
