"""Command line of the benchmark: ``python -m torchtitan_megamoe.bench --help``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from torchtitan_megamoe.bench.ep import bench_shape_ep
from torchtitan_megamoe.bench.ep1 import bench_shape
from torchtitan_megamoe.bench.ep_loopback import bench_shape_loopback, bytes_table, loopback_table
from torchtitan_megamoe.bench.shapes import SHAPES
from torchtitan_megamoe.bench.stock import note_for, torchao_version
from torchtitan_megamoe.bench.tables import (accuracy_table, bwd_table, ep_table, layer_rows,
                                             table, tuner_lines)
from torchtitan_megamoe.ops.recipe import PRECISIONS, recipe_named

BASELINE_CHOICES = ("eager", "compiled", "block", "torchao")
"""--baselines: stock eager (always runs: every output is checked against it), compiled (as
TorchTitan's --compile.enable), block (the whole block under one torch.compile, EP=1), torchao
(stock + torchao FP8, compiled; only with an FP8 precision in --precisions)."""


def _meta() -> dict:
    def version(pkg):
        try:
            import importlib.metadata as md

            return md.version(pkg)
        except Exception:  # noqa: BLE001 - not installed
            return None

    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "torchtitan": version("torchtitan"),
        "torchao": torchao_version(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "argv": sys.argv,
    }


def main_ep(args) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if "RANK" not in os.environ:
        print(f"bench: --ep {args.ep} runs under torchrun: torchrun --nproc_per_node "
              f"{args.ep} -m torchtitan_megamoe.bench --ep {args.ep}", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    if not cuda and args.backend != "reference":
        print("bench: needs CUDA GPUs (on CPU only --backend reference runs, as a smoke test)",
              file=sys.stderr)
        return 2
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # a caller that already joined a process group (tests) keeps it; torchrun runs start one here
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl" if cuda else "gloo")
    try:
        if dist.get_world_size() != args.ep:
            print(f"bench: world size {dist.get_world_size()} != --ep {args.ep}",
                  file=sys.stderr)
            return 2
        mesh = init_device_mesh("cuda" if cuda else "cpu", (args.ep,), mesh_dim_names=("ep",))
        results = []
        for key in args.shapes.split(","):
            t0 = time.time()
            r = bench_shape_ep(key, args.tokens, args.iters, args.warmup, args.backward,
                               args.peak_tflops, mesh, args.backend, args.ep1, args.profile,
                               compile_stock=args.compile_stock,
                               compile_backend=args.compile_backend)
            r["wall_s"] = round(time.time() - t0, 1)
            results.append(r)
            if dist.get_rank() == 0:
                print(json.dumps(r), flush=True)
        if dist.get_rank() == 0:
            print(ep_table(results))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"meta": _meta(), "results": results}, f, indent=1)
        return 0
    finally:
        if own_group:
            dist.destroy_process_group()


def main_loopback(args) -> int:
    from torchtitan_megamoe import settings

    if args.link_gbs:
        os.environ[settings.LOOPBACK_LINK_GBS] = str(args.link_gbs)
    results = []
    for key in args.shapes.split(","):
        for precision in args.precisions:
            t0 = time.time()
            r = bench_shape_loopback(key, args.ep, args.tokens, args.iters, args.warmup,
                                     args.backward, args.backend, precision, args.exposed,
                                     args.profile, args.graph)
            r["wall_s"] = round(time.time() - t0, 1)
            r["link_gbs"] = args.link_gbs
            results.append(r)
            print(json.dumps(r), flush=True)
            if args.json:  # after every result: a later one that dies cannot take it along
                with open(args.json, "w") as f:
                    json.dump({"meta": _meta(), "results": results}, f, indent=1)
    print(loopback_table(results))
    print()
    print(bytes_table(results))
    return 0


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help, except a switch's (its name says what it turns)."""

    def _get_help_string(self, action):
        if action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_megamoe.bench",
        description="MoE layer benchmark: stock TorchTitan MoE (eager, compiled as "
                    "--compile.enable does, block-compiled, + torchao FP8) vs mega_moe. Needs a "
                    "CUDA GPU (on CPU only --backend reference runs, as a smoke test); --ep N "
                    "runs under torchrun --nproc_per_node N.",
        formatter_class=HelpFormatter)
    p.add_argument("--shapes", default="30b,235b", help="comma list of: " + ",".join(SHAPES))
    p.add_argument("--tokens", type=int, default=16384, help="tokens per GPU")
    p.add_argument("--iters", type=int, default=None,
                   help="timed calls per measurement (None: 30, or 20 with --ep > 1)")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed calls before each measurement (the first also tunes)")
    p.add_argument("--no-backward", dest="backward", action="store_false",
                   help="time the forward only (forward + backward by default)")
    p.add_argument("--backend", default="hopper", choices=["hopper", "reference", "auto"],
                   help="mega_moe's backend for ours")
    p.add_argument("--precisions", "--precision", dest="precisions", default="bf16",
                   help="comma list of ours' precisions, from: " + ",".join(PRECISIONS)
                        + " (mega_moe(..., precision=p); ours in bf16 always runs; one the "
                          "backend lacks prints 'not available: <why>'); EP=1 only")
    p.add_argument("--baselines", default=None,
                   help="comma list of the stock baselines to time, from: "
                        + ",".join(BASELINE_CHOICES) + " (None: all; at --ep > 1 "
                        "eager,compiled). eager always runs (the reference of every output "
                        "check); compiled: as TorchTitan's --compile.enable compiles a MoE "
                        "block; block: the whole MoE block under one torch.compile (fullgraph "
                        "where it traces, else graph breaks allowed; EP=1 only), whose first "
                        "calls compile it; torchao: stock + torchao FP8 compiled, runs only "
                        "when --precisions lists fp8 or fp8_bwd")
    p.add_argument("--no-compile-stock", dest="compile_stock", action="store_false",
                   help="skip stock under torch.compile (as TorchTitan's --compile.enable "
                        "compiles each MoE block: bench/stock.py); its first calls compile for "
                        "tens of seconds per shape (the same as leaving compiled out of "
                        "--baselines)")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend of the compiled stock layers, block-compiled "
                        "included (None: inductor, TorchTitan's compile.backend; aot_eager "
                        "without CUDA, for the smoke runs)")
    p.add_argument("--no-torchao", dest="torchao", action="store_false",
                   help="skip stock + torchao's rowwise FP8 grouped GEMMs (compiled), which "
                        "runs when --precisions lists fp8 or fp8_bwd (needs torchao 0.18; the "
                        "same as leaving torchao out of --baselines)")
    p.add_argument("--accuracy", action="store_true",
                   help="also, per shape: relative error of the output and every gradient "
                        "against float64 on the same inputs, for ours at each precision, stock "
                        "bf16 and stock + torchao FP8 (EP=1)")
    p.add_argument("--no-stages", dest="stages", action="store_false",
                   help="EP=1: skip the hopper backend's per-stage times (the forward's stages "
                        "and the backward's breakdown, bench/backward_stages.py), to fit more "
                        "rows in one call")
    p.add_argument("--peak-tflops", type=float, default=765.0,
                   help="dense bf16 GEMM rate of the compute floor (H200 measured)")
    p.add_argument("--peak-fp8-tflops", type=float, default=1339.0,
                   help="dense FP8 GEMM rate of the fp8 rows' floor (H200 measured)")
    p.add_argument("--ep", type=int, default=1,
                   help="EP degree (GPUs); > 1 runs under torchrun")
    p.add_argument("--link-gbs", type=float, default=0.0,
                   help="with --loopback: pace every transfer to a link of this many GB/s per "
                        "direction (e.g. 326, NVLink between two H200s; scaled by R, as R ranks "
                        "share the GPU), so the overlap is measured, not assumed; 0: no pacing")
    p.add_argument("--exposed", type=float, default=0.0, metavar="GBS",
                   help="with --loopback: also time forward + backward with only one transfer "
                        "paced to a link of GBS GB/s, per transfer: what each one exposes")
    p.add_argument("--graph", action="store_true",
                   help="with --loopback: also time fwd+bwd of the R ranks and of EP=1 captured in "
                        "one CUDA graph (the device's time, no host issue in the way); "
                        "--exposed then times its variants so too")
    p.add_argument("--loopback", action="store_true",
                   help="with --ep R: R loopback ranks in this one process on one device, each on "
                        "its own stream (ours only, against ours at EP=1 on R*tokens; no torchrun; "
                        "on CPU the hopper kernels run under the Triton interpreter)")
    p.add_argument("--no-ep1", dest="ep1", action="store_false",
                   help="with --ep > 1: skip timing our EP=1 layer in the same run")
    p.add_argument("--json", default=None, help="write the results here (JSON)")
    p.add_argument("--profile", action="store_true",
                   help="print (rank 0's) top GPU kernels and host profile of ours (fwd+bwd; at EP=1 "
                        "also stock's fwd+bwd, at EP > 1 also ours' fwd)")
    args = p.parse_args(argv)
    for key in args.shapes.split(","):
        if key not in SHAPES:
            p.error(f"unknown shape {key!r}; pick from {','.join(SHAPES)}")
    precisions = [q.strip() for q in args.precisions.split(",") if q.strip()]
    for q in precisions:
        if q not in PRECISIONS:
            p.error(f"unknown precision {q!r}; pick from {','.join(PRECISIONS)}")
    args.precisions = list(dict.fromkeys(["bf16", *precisions]))
    if args.ep != 1 and not args.loopback and args.precisions != ["bf16"]:
        p.error("--precisions other than bf16 run at EP=1 or with --loopback (the torchrun EP "
                "bench times bf16)")
    if args.graph and not args.loopback:
        p.error("--graph times the loopback ranks: add --loopback")
    if args.loopback and args.ep < 2:
        p.error("--loopback needs --ep R with R >= 2")
    if (args.link_gbs or args.exposed) and not args.loopback:
        p.error("--link-gbs and --exposed pace loopback ranks: add --loopback")
    if args.link_gbs < 0:
        p.error("--link-gbs takes a bandwidth in GB/s (0: no pacing)")
    if args.loopback and args.backend != "hopper":
        p.error("--loopback runs backend hopper (the reference's EP path needs torch.distributed)")
    if args.ep != 1 and args.accuracy:
        p.error("--accuracy runs at EP=1 only")
    if args.baselines is None:
        baselines = ["eager", "compiled", "torchao"] + (["block"] if args.ep == 1 else [])
    else:
        baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]
        for b in baselines:
            if b not in BASELINE_CHOICES:
                p.error(f"unknown baseline {b!r}; pick from {','.join(BASELINE_CHOICES)}")
        if args.ep != 1 and "block" in baselines:
            p.error("--baselines block runs at EP=1 only")
    args.baselines = [b for b in BASELINE_CHOICES if b in baselines or b == "eager"]
    # the older switches still apply
    args.compile_stock = args.compile_stock and "compiled" in args.baselines
    args.block_compile_stock = "block" in args.baselines
    args.torchao = (args.torchao and "torchao" in args.baselines
                    and any(recipe_named(q).fp8 for q in args.precisions))
    args.baselines = [b for b in args.baselines
                      if {"compiled": args.compile_stock, "torchao": args.torchao}.get(b, True)]
    if args.compile_backend is None:
        args.compile_backend = "inductor" if torch.cuda.is_available() else "aot_eager"
    if args.iters is None:
        args.iters = 30 if args.ep == 1 else 20
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.loopback:
        return main_loopback(args)
    if args.ep != 1:
        return main_ep(args)
    if not torch.cuda.is_available() and args.backend != "reference":
        print("bench: needs a CUDA GPU (on CPU only --backend reference runs, as a smoke test)",
              file=sys.stderr)
        return 2
    results = []
    for key in args.shapes.split(","):
        t0 = time.time()
        r = bench_shape(key, args.tokens, args.iters, args.warmup, args.backward, args.backend,
                        args.peak_tflops, args.profile, precisions=args.precisions,
                        compile_stock=args.compile_stock, compile_backend=args.compile_backend,
                        torchao=args.torchao, peak_fp8_tflops=args.peak_fp8_tflops,
                        stages=args.stages, block_compile_stock=args.block_compile_stock)
        if args.accuracy:
            # after the timing, so that a failure here cannot cost its numbers
            from torchtitan_megamoe.bench.accuracy import accuracy_shape

            t1 = time.time()
            try:
                r["accuracy"] = accuracy_shape(key, args.tokens, args.precisions, args.backend,
                                               torchao=args.torchao)
            except Exception as err:  # noqa: BLE001 - reported in the table and the JSON
                r["accuracy_error"] = note_for(err)
            r["accuracy_wall_s"] = round(time.time() - t1, 1)
        r["rows"] = layer_rows(r, "waited")
        r["rows_b2b"] = layer_rows(r, "b2b")
        r["wall_s"] = round(time.time() - t0, 1)
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "tuned"}), flush=True)
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": _meta(), "results": results}, f, indent=1)
    return 0


def report(results: list[dict]) -> str:
    """Everything the EP=1 run prints after its JSON lines: the layer table (waited), the same
    back to back, the backward's stages, the tuner's picks and, with --accuracy, the errors."""
    parts = [table(results),
             "calls back to back (no wait per call, GPU-bound; ms per call; fwdbwd with fresh "
             ".grad):",
             table(results, "b2b")]
    parts += [t for t in (bwd_table(results), tuner_lines(results), accuracy_table(results)) if t]
    return "\n".join(parts)
