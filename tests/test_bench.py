"""The layer benchmark's CPU-runnable parts (its CUDA timing is exercised on the GPU machine).

- EP=2 over gloo: TorchTitan's own ExpertParallel wiring as the bench builds it gives the same
  output as the unsharded stock layer on each rank's tokens; the bench's EP path (stock EP vs ours
  on the reference backend, ours at EP=1) runs end to end through its CLI, prints its table and
  writes JSON with every ratio's inputs.
- EP=1: the CLI's reference-backend smoke run; the backward-stage breakdown wiring (bwd_bench
  under the Triton interpreter at the tiny shape) and its table.
"""

import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchtitan_megamoe import bench
from torchtitan_megamoe.bench.tables import SM90_ONLY_STAGES

T = 24  # tokens per rank
TINY = bench.SHAPES["tiny"]


def _ep_worker(rank, out_dir):
    from torch.distributed.device_mesh import init_device_mesh

    # what torchrun would set (the bench checks RANK); a file rendezvous needs no free port
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'init')}",
                            rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    torch.manual_seed(0)
    moe = bench.build_stock_moe(TINY, torch.device("cpu"))
    torch.manual_seed(1 + rank)
    x = torch.randn(1, T, TINY["dim"], dtype=torch.bfloat16)
    with torch.no_grad():
        unsharded = moe(x)
        bench.shard_stock_experts(moe, mesh)
        sharded = moe(x)
    local_w1 = moe.experts.w1.to_local().clone()
    torch.save({"x": x, "unsharded": unsharded, "sharded": sharded, "local_w1": local_w1},
               os.path.join(out_dir, f"stock.{rank}"))
    rc = bench.main(["--ep", "2", "--shapes", "tiny", "--tokens", str(T), "--iters", "1",
                     "--warmup", "1", "--backend", "reference",
                     "--json", os.path.join(out_dir, "bench.json")])
    assert rc == 0
    dist.destroy_process_group()


def test_stock_ep_matches_unsharded_and_bench_ep_cli(capfd):
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_ep_worker, args=(d,), nprocs=2, join=True)
        ranks = [torch.load(os.path.join(d, f"stock.{r}")) for r in range(2)]
        with open(os.path.join(d, "bench.json")) as f:
            results = json.load(f)["results"]
    torch.manual_seed(0)
    full = bench.build_stock_moe(TINY, torch.device("cpu"))
    e_local = TINY["experts"] // 2
    for rank, got in enumerate(ranks):
        # each rank holds its own contiguous expert slice of the same initial weights
        mine = slice(rank * e_local, (rank + 1) * e_local)
        assert torch.equal(got["local_w1"], full.experts.w1.detach()[mine])
        ref = got["unsharded"].float()
        assert ref.norm() > 0
        assert ((got["sharded"].float() - ref).norm() / ref.norm()).item() < 1e-2, rank
    assert not torch.equal(ranks[0]["x"], ranks[1]["x"])  # the ranks really exchanged tokens

    (r,) = results
    assert r["ep"] == 2 and r["tokens"] == T and "stock_error" not in r
    assert r["same_expert_weights"] is True
    assert r["rel_err_vs_reference"] == 0.0  # ours runs the reference backend here
    assert r["rel_err_vs_stock"] < 2e-2  # bf16 stock (bf16 hidden) vs fp32-accumulated ours
    for key in ("stock_fwd_ms", "stock_fwdbwd_ms", "ours_fwd_ms", "ours_fwdbwd_ms",
                "ours_ep1_fwd_ms", "ours_ep1_fwdbwd_ms"):
        assert r[key] > 0, key
        assert r[key.replace("_ms", "_b2b_ms")] > 0, key
    table = capfd.readouterr().out
    assert "| tiny (smoke) | 2 | fwd |" in table and "| tiny (smoke) | 2 | fwdbwd |" in table
    assert "stock EP failed" not in table


def test_ep_cli_outside_torchrun_names_the_launcher(capsys):
    assert bench.main(["--ep", "2", "--backend", "reference"]) == 2
    assert "torchrun --nproc_per_node 2" in capsys.readouterr().err


def test_ep1_cli_reference_smoke():
    # its own process: on CPU the bench applies the project's CPU shims process-wide
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "b.json")
        proc = subprocess.run(
            [sys.executable, "-m", "torchtitan_megamoe.bench", "--shapes", "tiny", "--tokens",
             str(T), "--iters", "1", "--warmup", "0", "--backend", "reference", "--json", path],
            capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        with open(path) as f:
            (r,) = json.load(f)["results"]
    assert r["rel_err_vs_stock"] < 2e-2 and r["stock_fwdbwd_ms"] > 0 and r["ours_fwdbwd_ms"] > 0
    assert "bwd_stages" not in r  # the stage breakdown belongs to the triton backend
    assert "| tiny (smoke) | fwdbwd |" in proc.stdout
    assert r["ours_fwd_host_ms"] > 0 and r["stock_fwd_host_ms"] > 0
    assert "fwd host issue time" in proc.stdout
    assert all(r[f"{who}_{tag}_b2b_ms"] > 0 for who in ("ours", "stock") for tag in ("fwd", "fwdbwd"))
    assert "calls back to back (no wait per call, GPU-bound" in proc.stdout


def test_bwd_stage_breakdown_and_table(monkeypatch):
    # Triton interpreter without CUDA: the smallest shape its tiles cover keeps this quick
    monkeypatch.setitem(bench.SHAPES, "micro", dict(name="micro", dim=32, hidden=16, experts=3,
                                                    top_k=2))
    stages = bench.bwd_stage_breakdown("micro", 9, 1)
    for _, tri, cub in bench.BWD_STAGES:
        for key in (tri, cub):
            if key and key not in SM90_ONLY_STAGES:
                assert stages[f"{key}_ms"] > 0, key
    assert not SM90_ONLY_STAGES & {k[:-3] for k in stages}  # no sm90 kernel on the interpreter
    r = {"shape": "micro", "bwd_stages": stages, "ours_fwd_ms": 1.0, "ours_fwdbwd_ms": 3.5}
    bad = {"shape": "other", "bwd_stages_error": "RuntimeError: boom"}
    lines = bench.bwd_table([r, bad]).splitlines()
    assert len(lines) >= 2 + len(bench.BWD_STAGES) + 1  # header, rule, stages, layer (+ picks)
    kernel_a = next(line for line in lines if line.startswith("| A: dgrad L2"))
    assert kernel_a.startswith("| A: dgrad L2 + SwiGLU on saved a1/a3 | "
                               f"{stages['A_dgrad_l2_swiglu_ms']:.3f} (")
    assert f"| {stages['A_dgrad_l2_swiglu_cublas_ms']:.3f} (" in kernel_a
    assert kernel_a.endswith("| error | RuntimeError: boom |")
    dw2 = next(line for line in lines if line.startswith("| wgrad dw2 |"))
    assert f"| {stages['B_dw2_cublas_ms']:.3f} (" in dw2
    layer = next(line for line in lines if line.startswith("| layer:"))
    assert "| 2.500 | - |" in layer
    assert bench.bwd_table([{"shape": "x", "ours_fwd_ms": 1.0}]) == ""


def test_tuner_lines_name_the_pick_and_every_rejected_candidate():
    from torchtitan_megamoe.bench.tables import tuner_lines

    inf = float("inf")
    r = {"tuned": {
        "gemm2_rows[1]": [
            {"config": {"BLOCK_M": 128}, "ms": 0.80, "err": ""},
            {"config": {"IMPL": "sm90"}, "ms": 0.70, "err": ""},
        ],
        "gemm1_swiglu[1]": [
            {"config": {"BLOCK_M": 128}, "ms": 1.50, "err": ""},
            {"config": {"IMPL": "sm90"}, "ms": inf,
             "err": "wrong result: rel. difference 1.4e+00 from the first candidate's"},
        ],
    }}
    lines = tuner_lines([r, r]).splitlines()
    assert len(lines) == 2  # one per kernel key, however many shapes repeat it
    assert lines[0] == "tuner gemm2_rows[1]: sm90 0.700 ms (best triton: 0.800)"
    assert lines[1].startswith("tuner gemm1_swiglu[1]: triton 1.500 ms; REJECTED by the "
                               "output check: sm90 (wrong result")


def test_timeline_prints_one_call(capsys):
    """The host/GPU time line runs on any device (on CPU it has no GPU kernels to list)."""
    from torchtitan_megamoe.bench.profile import timeline

    a = torch.randn(64, 64)
    timeline("cpu matmul", lambda: a @ a, 0)
    out = capsys.readouterr().out
    assert "--- timeline: cpu matmul:" in out
    assert "GPU busy" in out


def test_host_issue_ms_is_the_median_host_time_of_a_call():
    import time

    from torchtitan_megamoe.timing import host_issue_ms

    delays = iter([0.0, 0.002, 0.002, 0.030, 0.002])  # one outlier: the median ignores it
    ms = host_issue_ms(lambda: time.sleep(next(delays)), iters=4, warmup=1)
    assert 2.0 <= ms < 20.0
