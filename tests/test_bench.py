"""The layer benchmark's CPU-runnable parts (its CUDA timing is exercised on the GPU machine).

- EP=2 over gloo: TorchTitan's own ExpertParallel wiring as the bench builds it gives the same
  output as the unsharded stock layer on each rank's tokens; the bench's EP path (stock EP vs ours
  on the reference backend, ours at EP=1) runs end to end through its CLI, prints its table and
  writes JSON with every ratio's inputs.
- EP=1: the CLI's reference-backend smoke run with every precision and --accuracy (one
  precision's backward faked as missing: its row reads "not available"); the backward-stage
  breakdown wiring (bwd_bench under the Triton interpreter at the tiny shape) and its table.
- The baselines' wiring: stock compiled as TorchTitan compiles a MoE block (aot_eager on CPU),
  swapped in only inside its ``with``; the whole block under one torch.compile (on CPU
  fullgraph fails on TorchTitan's CPU index padding, so it runs with graph breaks) matching
  stock eager forward and backward; the argument parsing; the tables from made-up results
  (ratios, floors, notes); rows that cannot run reported, not raised.
"""

import json
import os
import subprocess
import sys
import tempfile

import pytest
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
                "ours_ep1_fwd_ms", "ours_ep1_fwdbwd_ms", "stock_compiled_fwd_ms",
                "stock_compiled_fwdbwd_ms"):
        assert r[key] > 0, key
        assert r[key.replace("_ms", "_b2b_ms")] > 0, key
    # stock's EP layer compiled as TorchTitan compiles it with EP on (aot_eager on CPU)
    assert "stock_compiled_note" not in r and r.get("stock_compiled_recompiles", 0) == 0
    assert r["stock_compiled_fwd_warmup_s"] > 0 and r["stock_compiled_fwdbwd_warmup_s"] > 0
    table = capfd.readouterr().out
    assert "| tiny (smoke) | 2 | fwd |" in table and "| tiny (smoke) | 2 | fwdbwd |" in table
    assert "stock EP failed" not in table
    assert "stock compiled (EP on): first 2 calls (compilation)" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant is for CPU")
def test_ep_loopback_cli_runs_r_ranks_in_one_process(capsys):
    """--ep 2 --loopback: two loopback ranks of the hopper kernels (interpreter) in this process,
    their time against ours at EP=1 on both ranks' tokens."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "lb.json")
        rc = bench.main(["--ep", "2", "--loopback", "--shapes", "tiny", "--tokens", "4",
                         "--iters", "1", "--warmup", "0", "--no-backward", "--json", out])
        assert rc == 0
        r = json.load(open(out))["results"][0]
    assert r["ep"] == 2 and r["loopback"] and r["tokens"] == 4
    assert r["loopback_fwd_ms"] > 0 and r["ep1_fwd_ms"] > 0
    assert r["per_rank_fwd_ms"] == r["loopback_fwd_ms"] / 2
    assert r["loopback_fwd_host_ms"] > 0 and r["loopback_fwd_busy_ms"] == 0  # no device here
    assert r["ep1_rank_fwd_busy_ms"] == 0 and "overhead_rank_busy_fwd" not in r
    assert set(r["bytes"]) == {"dispatch", "dispatch meta", "combine"} and r["bytes"]["dispatch"] > 0
    printed = capsys.readouterr().out
    assert "| tiny (smoke) | bf16 | 2 | 4 | fwd |" in printed
    assert "| tiny (smoke) | bf16 | 2 | dispatch |" in printed


def test_loopback_table_sets_ep_r_against_r_ranks_of_ep1_at_their_own_tokens():
    """The loopback table's second reference: R x ours at EP=1 on one rank's T tokens (the
    per-rank GEMM sizes every EP=R pays), beside EP=1 on R*T, in the row and the graph line."""
    from torchtitan_megamoe.bench.ep_loopback import loopback_table

    r = {"shape": "S", "precision": "bf16", "ep": 8, "tokens": 16, "loopback_fwdbwd_ms": 9.0,
         "loopback_fwdbwd_host_ms": 1.0, "loopback_fwdbwd_busy_ms": 80.0, "ep1_fwdbwd_ms": 5.0,
         "ep1_fwdbwd_busy_ms": 50.0, "overhead_busy_fwdbwd": 1.6, "ep1_rank_fwdbwd_busy_ms": 64.0,
         "overhead_rank_busy_fwdbwd": 1.25, "loopback_fwdbwd_kernels": 9, "ep1_fwdbwd_kernels": 3,
         "loopback_fwdbwd_graph_ms": 78.0, "ep1_fwdbwd_graph_ms": 52.0,
         "ep1_rank_fwdbwd_graph_ms": 60.0}
    table = loopback_table([r])
    assert "| 1.60x | 64.000 (1.25x) | 9 / 3 |" in table
    assert "78.000 ms / EP=1 52.000 ms = 1.50x; / 8 x EP=1 on 16 tokens 60.000 ms = 1.30x" in table


def test_ep_cli_outside_torchrun_names_the_launcher(capsys):
    assert bench.main(["--ep", "2", "--backend", "reference"]) == 2
    assert "torchrun --nproc_per_node 2" in capsys.readouterr().err


# The CLI in its own process with mega_moe's fp8_bwd backward faked as missing (as a backend
# without it raises NotImplementedError there); bf16 and fp8 run the reference backend for real.
_CLI_FP8_BWD_MISSING = """
import sys

import torch

import torchtitan_megamoe

real = torchtitan_megamoe.mega_moe


class NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        raise NotImplementedError("no fp8_bwd backward here (test)")


def mega_moe(*args, precision="bf16", **kw):
    if precision != "fp8_bwd":
        return real(*args, precision=precision, **kw)
    return NoBackward.apply(real(*args, precision="bf16", **kw))


torchtitan_megamoe.mega_moe = mega_moe
from torchtitan_megamoe.bench import main

sys.exit(main(sys.argv[1:]))
"""


def test_ep1_cli_reference_smoke():
    # its own process: on CPU the bench applies the project's CPU shims process-wide
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "b.json")
        proc = subprocess.run(
            [sys.executable, "-c", _CLI_FP8_BWD_MISSING, "--shapes", "tiny", "--tokens",
             str(T), "--iters", "1", "--warmup", "0", "--backend", "reference",
             "--precisions", "bf16,fp8,fp8_bwd", "--accuracy", "--json", path],
            capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        with open(path) as f:
            (r,) = json.load(f)["results"]
    assert r["rel_err_vs_stock"] < 2e-2 and r["stock_fwdbwd_ms"] > 0 and r["ours_fwdbwd_ms"] > 0
    assert "bwd_stages" not in r  # the stage breakdown belongs to the hopper backend
    assert "| tiny (smoke) | fwdbwd | bf16 |" in proc.stdout
    assert r["ours_fwd_host_ms"] > 0 and r["stock_fwd_host_ms"] > 0
    assert "fwd host issue time" in proc.stdout
    assert all(r[f"{who}_{tag}_b2b_ms"] > 0 for who in ("ours", "stock") for tag in ("fwd", "fwdbwd"))
    assert "calls back to back (no wait per call, GPU-bound" in proc.stdout
    # ours at each precision, with its first call; fp8_bwd's backward not there
    assert r["precisions"] == ["bf16", "fp8", "fp8_bwd"]
    assert r["ours_first_call_s"] > 0 and r["ours_fp8_first_call_s"] > 0
    assert r["ours_fp8_fwd_ms"] > 0 and r["ours_fp8_fwdbwd_ms"] > 0
    assert r["ours_fp8_fwdbwd_peak_mib"] >= 0 and r["ours_fp8_rel_err_vs_stock"] < 0.2
    assert r["ours_fp8_bwd_fwd_ms"] > 0 and "ours_fp8_bwd_fwdbwd_ms" not in r
    missing = "not available: no fp8_bwd backward here (test)"
    assert r["ours_fp8_bwd_fwdbwd_note"] == missing == r["ours_fp8_bwd_first_call_note"]
    assert f"| tiny (smoke) | fwdbwd | fp8_bwd | {missing} |" in proc.stdout
    # stock compiled (aot_eager on CPU), no recompile while timed; torchao cannot run here
    assert r["stock_compiled_fwd_ms"] > 0 and r["stock_compiled_fwdbwd_ms"] > 0
    assert r["stock_compiled_rel_err_vs_stock"] < 1e-2 and r["stock_compiled_recompiles"] == 0
    # (not installed; installed, torchao's quantization kernels need a GPU)
    assert r["stock_fp8_note"].startswith(("not available: ", "failed: "))
    assert "stock + torchao FP8 compiled: " in proc.stdout
    # the whole block under one torch.compile: on CPU TorchTitan's index padding reads the
    # counts with .item() and branches on them, so fullgraph fails and graph breaks are allowed
    assert r["stock_block_fwd_ms"] > 0 and r["stock_block_fwdbwd_ms"] > 0
    assert r["stock_block_rel_err_vs_stock"] < 1e-2 and r["stock_block_recompiles"] == 0
    assert r["stock_block_mode"] == "default (graph breaks allowed)"
    assert "fill_indices_cpu" in r["stock_block_fullgraph_error"]
    assert r["stock_block_graph_breaks"] >= 1 and r["stock_block_graphs"] >= 2
    assert r["stock_block_first_call_s"] == pytest.approx(
        r["stock_block_fwd_first_call_s"] + r["stock_block_fwdbwd_first_call_s"])
    assert "stock block-compiled (torch.compile default, graph breaks allowed, " in proc.stdout
    assert "stock block-compiled: fullgraph=True did not trace" in proc.stdout
    # the JSON's rows are the table's: ratios against each baseline
    rows = {(row["pass"], row["precision"]): row for row in r["rows"]}
    fp8 = rows[("fwd", "fp8")]
    assert fp8["x_stock_compiled"] == r["stock_compiled_fwd_ms"] / r["ours_fp8_fwd_ms"]
    assert fp8["x_stock"] == r["stock_fwd_ms"] / r["ours_fp8_fwd_ms"]
    assert fp8["x_stock_block"] == r["stock_block_fwd_ms"] / r["ours_fp8_fwd_ms"]
    assert rows[("fwdbwd", "bf16")]["stock_block_first_call_s"] == \
        r["stock_block_fwdbwd_first_call_s"]
    assert fp8["x_stock_fp8"] is None and rows[("fwdbwd", "fp8_bwd")]["note"] == missing
    assert {(row["pass"], row["precision"]) for row in r["rows_b2b"]} == set(rows)
    # accuracy against float64: every gradient of ours, stock's output and weight gradients
    acc = r["accuracy"]
    assert set(acc["ours_bf16"]) == {"out", "dx", "dw1", "dw2", "dw3", "dtopk_weights"}
    assert all(0 < v < 1e-2 for v in acc["ours_bf16"].values())
    assert acc["ours_bf16"]["out"] < acc["ours_fp8"]["out"] < 0.2  # FP8 rounds its operands
    assert acc["ours_fp8_bwd"]["grad_note"] == missing and acc["ours_fp8_bwd"]["out"] < 1e-2
    assert set(acc["stock"]) == {"out", "dw1", "dw2", "dw3"} and acc["stock"]["out"] < 2e-2
    assert acc["stock_torchao_fp8"]["note"].startswith(("not available: ", "failed: "))
    assert "op-level relative error against float64" in proc.stdout
    assert "| tiny (smoke) | ours fp8_bwd |" in proc.stdout


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
    dgrad2 = next(line for line in lines if line.startswith("| dgrad2_swiglu on"))
    assert dgrad2.startswith("| dgrad2_swiglu on saved a1/a3 | "
                             f"{stages['dgrad2_swiglu_ms']:.3f} (")
    assert f"| {stages['dgrad2_swiglu_grouped_mm_ms']:.3f} (" in dgrad2
    assert dgrad2.endswith("| error | RuntimeError: boom |")
    dw2 = next(line for line in lines if line.startswith("| wgrad_dw2 |"))
    assert f"| {stages['wgrad_dw2_grouped_mm_ms']:.3f} (" in dw2
    layer = next(line for line in lines if line.startswith("| layer:"))
    assert "| 2.500 | - |" in layer
    assert bench.bwd_table([{"shape": "x", "ours_fwd_ms": 1.0}]) == ""


def test_tuner_lines_name_the_pick_and_every_rejected_candidate():
    from torchtitan_megamoe.bench.tables import tuner_lines

    inf = float("inf")
    r = {"tuned": {
        "gemm2[1]": [
            {"config": {"block_m": 128}, "ms": 0.80, "err": ""},
            {"config": {"impl": "sm90"}, "ms": 0.70, "err": ""},
        ],
        "gemm1_swiglu[1]": [
            {"config": {"block_m": 128}, "ms": 1.50, "err": ""},
            {"config": {"impl": "sm90"}, "ms": inf,
             "err": "wrong result: rel. difference 1.4e+00 from the first candidate's"},
        ],
    }}
    lines = tuner_lines([r, r]).splitlines()
    assert len(lines) == 2  # one per kernel key, however many shapes repeat it
    assert lines[0] == "tuner gemm2[1]: sm90 0.700 ms (best triton: 0.800)"
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


def test_host_issue_ep_wraps_steps_that_exist():
    """tools/host_issue_ep.py times the EP forward's steps by wrapping them by name: a renamed
    step must fail here, not in a GPU session."""
    from tools.host_issue_ep import steps

    for owner, name, label in steps():
        assert callable(getattr(owner, name, None)), (owner, name, label)


def test_cli_options():
    from torchtitan_megamoe.bench.cli import parse_args

    a = parse_args([])
    assert a.precisions == ["bf16"] and a.compile_stock and not a.torchao and not a.accuracy
    assert a.compile_backend == ("inductor" if torch.cuda.is_available() else "aot_eager")
    assert a.peak_tflops == 765.0 and a.peak_fp8_tflops == 1339.0 and a.iters == 30
    assert a.stages and not parse_args(["--no-stages"]).stages
    a = parse_args(["--precisions", "fp8,bf16,fp8", "--accuracy", "--compile-backend", "eager"])
    assert a.precisions == ["bf16", "fp8"] and a.torchao and a.accuracy  # bf16 always runs
    assert a.compile_backend == "eager"
    a = parse_args(["--precision", "fp8_bwd", "--no-torchao", "--no-compile-stock"])
    assert a.precisions == ["bf16", "fp8_bwd"] and not a.torchao and not a.compile_stock
    assert a.block_compile_stock and a.baselines == ["eager", "block"]
    # --baselines: every baseline by default (torchao only with an FP8 precision)
    assert parse_args([]).baselines == ["eager", "compiled", "block"]
    a = parse_args(["--precisions", "fp8"])
    assert a.baselines == ["eager", "compiled", "block", "torchao"] and a.block_compile_stock
    a = parse_args(["--baselines", "eager,block", "--precisions", "fp8"])
    assert a.block_compile_stock and not a.compile_stock and not a.torchao
    a = parse_args(["--baselines", "compiled,torchao", "--precisions", "fp8"])
    assert not a.block_compile_stock and a.compile_stock and a.torchao
    assert a.baselines == ["eager", "compiled", "torchao"]  # eager always runs
    a = parse_args(["--ep", "2"])
    assert not a.block_compile_stock and a.compile_stock  # block: EP=1 only
    for bad in (["--precisions", "fp4"], ["--ep", "2", "--precisions", "fp8"],
                ["--ep", "2", "--accuracy"], ["--shapes", "7b"], ["--baselines", "fused"],
                ["--ep", "2", "--baselines", "eager,block"], ["--loopback"],
                ["--ep", "2", "--loopback", "--backend", "reference"], ["--graph"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_rows_that_cannot_run_are_reported_not_raised(capsys):
    from torchtitan_megamoe.bench.ep1 import first_call, time_layer

    def no_fp8():
        raise NotImplementedError("mega_moe backend='hopper' has no FP8 forward yet")

    res = {}
    first_call(res, "ours_fp8", no_fp8)
    time_layer(res, "ours_fp8", no_fp8, no_fp8, no_fp8, 1, 0, True)
    note = "not available: mega_moe backend='hopper' has no FP8 forward yet"
    assert res == {"ours_fp8_first_call_note": note, "ours_fp8_fwd_note": note,
                   "ours_fp8_fwdbwd_note": note}

    def boom():
        raise ValueError("boom")

    out = torch.ones(4)
    res = {}
    time_layer(res, "x", lambda: out, boom, boom, 2, 0, True, ref=out)
    assert res["x_fwd_ms"] > 0 and res["x_fwd_b2b_ms"] > 0 and res["x_rel_err_vs_stock"] == 0
    assert res["x_fwdbwd_note"] == "failed: ValueError: boom" and "x_fwdbwd_ms" not in res
    assert "ValueError: boom" in capsys.readouterr().err  # a failure's traceback is printed
    time_layer(res := {}, "y", lambda: out, lambda: None, lambda: None, 1, 0, False)
    assert set(res) == {"y_fwd_ms", "y_fwd_b2b_ms"}  # no backward asked for


def _made_up_result():
    return {
        "shape": "S", "flops_fwd": 1530e9, "peak_tflops": 765.0, "peak_fp8_tflops": 1530.0,
        "precisions": ["bf16", "fp8", "fp8_bwd"],
        "stock_fwd_ms": 12.0, "stock_fwdbwd_ms": 36.0,
        "stock_compiled_fwd_ms": 6.0, "stock_compiled_fwdbwd_ms": 18.0,
        "stock_block_fwd_ms": 4.0, "stock_block_fwdbwd_ms": 12.0,
        "stock_block_mode": "fullgraph", "stock_block_graphs": 1, "stock_block_graph_breaks": 0,
        "stock_block_fwd_first_call_s": 40.0, "stock_block_fwdbwd_first_call_s": 50.0,
        "stock_block_fwd_warmup_s": 41.0, "stock_block_fwdbwd_warmup_s": 51.0,
        "stock_fp8_fwd_ms": 8.0, "stock_fp8_fwdbwd_ms": 24.0,
        "ours_fwd_ms": 3.0, "ours_fwdbwd_ms": 9.0,
        "ours_fwdbwd_peak_mib": 100.0, "ours_first_call_s": 4.0,
        "ours_fp8_fwd_ms": 1.5, "ours_fp8_fwdbwd_ms": 4.5,
        "ours_fp8_fwdbwd_peak_mib": 90.0, "ours_fp8_first_call_s": 6.0,
        "ours_fp8_bwd_fwd_ms": 3.0, "ours_fp8_bwd_fwdbwd_note": "not available: no FP8 bwd",
        "stock_fwd_b2b_ms": 10.0, "stock_compiled_fwd_b2b_ms": 5.0, "ours_fwd_b2b_ms": 2.5,
        "stock_fwdbwd_peak_mib": 300.0, "stock_compiled_fwdbwd_peak_mib": 250.0,
        "stock_compiled_fwd_warmup_s": 20.0, "stock_compiled_fwdbwd_warmup_s": 30.0,
        "stock_compiled_rel_err_vs_stock": 1e-3, "stock_compiled_recompiles": 0,
    }


def test_layer_rows_and_tables_from_made_up_results():
    from torchtitan_megamoe.bench.tables import floor_ms, layer_rows, table

    r = _made_up_result()
    # floors: 1530 GFLOP fwd is 2 ms at 765 (bf16) and 1 ms at 1530 (fp8); backward 2x
    assert floor_ms(r, "fwd", "bf16") == 2.0 and floor_ms(r, "fwd", "fp8") == 1.0
    assert floor_ms(r, "fwd", "fp8_bwd") == 2.0 and floor_ms(r, "fwdbwd", "bf16") == 6.0
    assert floor_ms(r, "fwdbwd", "fp8") == 3.0 and floor_ms(r, "fwdbwd", "fp8_bwd") == 4.0
    rows = {(row["pass"], row["precision"]): row for row in layer_rows(r)}
    assert len(rows) == 6
    bf16 = rows[("fwd", "bf16")]
    assert (bf16["x_stock"], bf16["x_stock_compiled"], bf16["x_stock_fp8"]) == (4.0, 2.0, 8 / 3)
    assert bf16["x_stock_block"] == 4 / 3 and bf16["stock_block_first_call_s"] == 40.0
    assert bf16["tflops"] == 510.0 and bf16["floor_frac"] == 2 / 3
    fp8 = rows[("fwdbwd", "fp8")]
    assert fp8["x_stock_compiled"] == 4.0 and fp8["floor_frac"] == 3.0 / 4.5
    assert fp8["peak_mib"] == 90.0 and fp8["first_call_s"] == 6.0
    missing = rows[("fwdbwd", "fp8_bwd")]
    assert missing["ours_ms"] is None and missing["note"] == "not available: no FP8 bwd"
    assert missing["x_stock"] is None and missing["floor_ms"] == 4.0

    lines = table([r]).splitlines()
    assert lines[0].startswith("| shape | pass | ours | ours ms | stock eager ms | stock compiled "
                               "ms | stock block-compiled ms | stock + torchao FP8 compiled ms | "
                               "vs eager | vs compiled | vs block-compiled | vs torchao FP8 |")
    assert ("| S | fwd | bf16 | 3.000 | 12.000 | 6.000 | 4.000 | 8.000 | 4.00x | 2.00x | 1.33x | "
            "2.67x | 510 | 2.00 | 0.67 | n/a | n/a |") in lines
    assert ("| S | fwdbwd | fp8 | 4.500 | 36.000 | 18.000 | 12.000 | 24.000 | 8.00x | 4.00x | "
            "2.67x | 5.33x | 1020 | 3.00 | 0.67 | 90 | 6.0 |") in lines
    assert ("| S | fwdbwd | fp8_bwd | not available: no FP8 bwd | 36.000 | 18.000 | 12.000 | "
            "24.000 | n/a | n/a | n/a | n/a | n/a | 4.00 | n/a | n/a | n/a |") in lines
    text = "\n".join(lines)
    assert ("S stock compiled: first 2 calls (compilation) fwd 20.0 s, fwdbwd 30.0 s (output "
            "1.0e-03 from stock eager)") in text
    assert ("stock block-compiled (fullgraph, 1 graph(s) and 0 graph break(s) in the forward): "
            "first 2 calls (compilation) fwd 41.0 s, fwdbwd 51.0 s (first call alone fwd 40.0 s, "
            "fwdbwd 50.0 s)") in text
    assert ("S peak memory of one fwd+bwd above the inputs (fresh grads, MiB; the FP8 rows "
            "include the weights' FP8 copies held across calls): stock eager 300, "
            "stock compiled 250, ours bf16 100, ours fp8 90") in text

    b2b = table([r], "b2b").splitlines()  # only the forward has back-to-back times here
    assert ("| S | fwd | bf16 | 2.500 | 10.000 | 5.000 | n/a | n/a | 4.00x | 2.00x | n/a | n/a | "
            "612 | 2.00 | 0.80 |") in b2b
    assert len(b2b) == 2 + 3 and b2b[0].endswith("| floor/ours |")
    # a baseline that did not run: n/a in its column, its reason under the table
    r2 = {"shape": "S2", "flops_fwd": 1530e9, "stock_fwd_ms": 4.0, "ours_fwd_ms": 2.0,
          "stock_fp8_note": "not available: torchao not installed",
          "stock_compiled_fwd_note": "failed: RuntimeError: | inductor broke"}
    text = table([r2])
    assert "| S2 | fwd | bf16 | 2.000 | 4.000 | n/a | n/a | n/a | 2.00x | n/a | n/a | n/a |" \
        in text
    assert "S2 stock + torchao FP8 compiled: not available: torchao not installed" in text
    assert "S2 stock compiled fwd: failed: RuntimeError: / inductor broke" in text


def test_accuracy_and_ep_tables_from_made_up_results():
    from torchtitan_megamoe.bench.tables import accuracy_table, ep_table

    assert accuracy_table([{"shape": "S"}]) == ""
    r = {"shape": "S", "accuracy": {
        "ours_bf16": {"out": 1e-3, "dx": 2e-3, "dw1": 3e-3, "dw2": 4e-3, "dw3": 5e-3,
                      "dtopk_weights": 6e-3},
        "ours_fp8": {"note": "not available: no FP8 forward"},
        "ours_fp8_bwd": {"out": 1e-3, "grad_note": "not available: no FP8 backward"},
        "stock": {"out": 4e-3, "dw1": 4e-3, "dw2": 4e-3, "dw3": 4e-3},
        "stock_torchao_fp8": {"out": 6.6e-2, "dw1": 5e-2, "dw2": 5e-2, "dw3": 5e-2}}}
    lines = accuracy_table([r, {"shape": "T", "accuracy_error": "failed: OOM"}]).splitlines()
    assert ("| S | ours bf16 | 1.00e-03 | 2.00e-03 | 3.00e-03 | 4.00e-03 | 5.00e-03 | 6.00e-03 |"
            "  |") in lines
    assert "| S | ours fp8 | - | - | - | - | - | - | not available: no FP8 forward |" in lines
    assert ("| S | ours fp8_bwd | 1.00e-03 | - | - | - | - | - | not available: no FP8 "
            "backward |") in lines
    assert "| S | stock bf16 (eager) | 4.00e-03 | - | 4.00e-03 | 4.00e-03 | 4.00e-03 | - |  |" \
        in lines
    assert any(line.startswith("| S | stock + torchao FP8 (eager) | 6.60e-02 |") for line in lines)
    assert "| T | all | n/a | n/a | n/a | n/a | n/a | n/a | failed: OOM |" in lines

    ep = {"shape": "S", "ep": 2, "flops_fwd": 1530e9, "floor_fwd_ms": 2.0,
          "stock_fwd_ms": 8.0, "stock_compiled_fwd_ms": 6.0, "ours_fwd_ms": 3.0,
          "ours_ep1_fwd_ms": 2.0, "stock_compiled_fwd_warmup_s": 12.0}
    text = ep_table([ep, {**ep, "shape": "S3", "stock_compiled_fwd_ms": None,
                          "stock_compiled_fwd_warmup_s": None,
                          "stock_compiled_note": "failed: Unsupported: x"}])
    assert "| S | 2 | fwd | 8.000 | 6.000 | 3.000 | 2.67x | 2.00x | 191 | 510 | 0.67 | 2.000 |" in text
    assert "| S3 | 2 | fwd | 8.000 | n/a | 3.000 | 2.67x | n/a |" in text
    assert "S stock compiled (EP on): first 2 calls (compilation) fwd 12.0 s" in text
    assert "S3 stock compiled: failed: Unsupported: x" in text


def test_compiled_stock_is_swapped_in_only_inside_its_with():
    """TorchTitan's per-block compile of a MoE (router and reorderer compiled, the module-level
    grouped-GEMM function replaced by its compiled form), here with aot_eager on the CPU's
    torch._grouped_mm: inside, the compiled pieces run forward and backward and give stock's
    output; outside, the module and the function are eager again."""
    import torchtitan.models.moe.moe as moe_module
    from torchtitan.models.moe.moe import MoE, MoEArgs

    from torchtitan_megamoe import cpu
    from torchtitan_megamoe.bench.stock import CompiledStock

    cpu.apply()  # stock's index padding on CPU tensors (what build_stock_moe applies on CPU)
    torch.manual_seed(0)
    args = MoEArgs(num_experts=8, num_shared_experts=0, top_k=2, score_func="softmax",
                   route_norm=True, score_before_experts=False, use_grouped_mm=True)
    moe = MoE(args, dim=128, hidden_dim=64)
    with torch.no_grad():
        moe.init_weights(init_std=0.02, buffer_device=torch.device("cpu"))
    for p in moe.parameters():
        p.data = p.data.to(torch.bfloat16)
    x = torch.randn(1, 40, 128, dtype=torch.bfloat16)
    eager_fn, router, reorderer = moe_module._run_experts_grouped_mm, moe.router, moe.reorderer
    want = moe(x).detach()
    compiled = CompiledStock(moe, backend="aot_eager")
    with compiled.active():
        assert moe.router._orig_mod is router and moe.reorderer._orig_mod is reorderer
        assert moe_module._run_experts_grouped_mm is compiled.grouped_mm is not eager_fn
        with torch.no_grad():
            got = moe(x)
        xg = x.clone().requires_grad_(True)
        moe(xg).float().square().sum().backward()
    assert moe.router is router and moe.reorderer is reorderer
    assert moe_module._run_experts_grouped_mm is eager_fn
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
    assert xg.grad is not None and moe.experts.w1.grad is not None
    assert compiled(x).shape == x.shape and moe.router is router  # __call__: the same, once


def test_block_compiled_stock_matches_eager_forward_and_backward():
    """The whole stock block under one torch.compile (aot_eager on CPU) at the tiny shape:
    its output and gradients (x and the expert and gate weights) match stock eager within bf16
    tolerance. On CPU, TorchTitan's index padding (fill_indices_cpu) branches on .item() of the
    token counts, so fullgraph fails there and the block runs with graph breaks."""
    from torchtitan_megamoe.bench.stock import BlockCompiledStock

    torch.manual_seed(0)
    moe = bench.build_stock_moe(TINY, torch.device("cpu"))
    x = torch.randn(1, T, TINY["dim"], dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    params = {n: p for n, p in moe.named_parameters()}

    def run(layer):
        moe.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_(True)
        out = layer(xg)
        out.backward(grad)
        return out.detach().float(), xg.grad.float(), {n: p.grad.float() for n, p in
                                                       params.items()}

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    want, want_dx, want_g = run(moe)
    block = BlockCompiledStock(moe, backend="aot_eager")
    with torch.no_grad():
        assert rel(block(x).float(), want) < 1e-2
    got, dx, g = run(block)
    assert rel(got, want) < 1e-2 and rel(dx, want_dx) < 2e-2
    assert set(g) == set(want_g) and all(rel(g[n], want_g[n]) < 2e-2 for n in g), \
        {n: rel(g[n], want_g[n]) for n in g}
    d = block.describe()
    assert d["mode"] == BlockCompiledStock.DEFAULT and "fill_indices_cpu" in d["fullgraph_error"]
    assert d["graphs"] >= 2 and d["graph_breaks"] == d["graphs"] - 1


def test_block_compiled_stock_keeps_fullgraph_where_it_traces():
    from torchtitan_megamoe.bench.stock import BlockCompiledStock

    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    block = BlockCompiledStock(lin, backend="aot_eager")
    assert torch.allclose(block(x), lin(x))
    assert block.describe() == {"mode": "fullgraph", "graphs": 1, "graph_breaks": 0}


def test_help_names_the_command_and_every_default(capsys, monkeypatch):
    """``--help`` reads ``usage: python -m torchtitan_megamoe.bench``; every option has help
    text, and each option that takes a value shows its default."""
    from torchtitan_megamoe.bench.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m torchtitan_megamoe.bench ")
    assert "(default: 16384)" in out and "(default: hopper)" in out
    import argparse

    seen = []
    real = argparse.ArgumentParser.add_argument

    def spy(self, *args, **kwargs):
        seen.append((args, kwargs))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "add_argument", spy)
    parse_args([])
    assert len(seen) > 15 and all(kw.get("help") for _, kw in seen), seen


def test_back_to_back_time_is_not_moved_by_one_stall():
    """back_to_back_ms is the median per-call interval: one slow call among many (an allocator
    or driver hiccup) leaves it at the usual call's time, where a mean would carry the stall."""
    import time as _time

    from torchtitan_megamoe.timing import back_to_back_ms

    calls = []

    def fn():
        calls.append(None)
        _time.sleep(0.2 if len(calls) == 5 else 0.002)

    t = back_to_back_ms(fn, 15)
    assert len(calls) == 15
    assert 1.5 < t < 8, t  # ~2 ms; the mean over the calls would be ~15 ms


def test_loopback_host_profile_profiles_one_rank_thread(monkeypatch, capsys):
    """--profile's host table: one rank thread under cProfile while the others run unprofiled
    (Python 3.12 runs one profiler at a time; a second one raises)."""
    import threading

    from torchtitan_megamoe.bench.ep_loopback import host_profile
    from torchtitan_megamoe.ops import loopback_moe as lm

    seen = []
    monkeypatch.setattr(lm, "_rank_step", lambda r: seen.append(r) or sum(range(10_000)))

    def call():
        threads = [threading.Thread(target=lm._rank_step, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    host_profile("tiny", call)
    assert sorted(seen) == [0, 1, 2]
    assert "--- host, one rank thread (tiny, by own time):" in capsys.readouterr().out


def test_profile_sums_kernels_by_category_per_call():
    """--profile's category line: the step trace's categories (ab/trace.py), ms per call,
    largest first; the EP exchange's row copies count as copies, our Triton kernels apart."""
    from torchtitan_megamoe.bench.profile import by_category

    kernels = [("void megamoe::bf16::grouped_gemm_kernel<5>(CUtensorMap_st...", 6000.0),
               ("void megamoe::bf16::grouped_gemm_kernel<0>(CUtensorMap_st...", 2000.0),
               ("_copy_rows_kernel", 1000.0), ("Memcpy DtoD (Device -> Device)", 200.0),
               ("_combine_kernel", 700.0), ("_bwd_combine_kernel", 500.0)]
    got = dict(by_category(kernels, calls=2))
    assert got == pytest.approx({"megamoe sm90 GEMMs": 4.0, "copies and fills": 0.6,
                                 "megamoe Triton kernels": 0.6})
    assert [c for c, _ in by_category(kernels, 2)][0] == "megamoe sm90 GEMMs"
