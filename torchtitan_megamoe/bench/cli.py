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
from torchtitan_megamoe.bench.shapes import SHAPES
from torchtitan_megamoe.bench.tables import bwd_table, ep_table, table, tuner_lines


def _meta() -> dict:
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
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
                               args.peak_tflops, mesh, args.backend, args.ep1, args.profile)
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="MoE layer benchmark: stock TorchTitan MoE vs mega_moe")
    p.add_argument("--shapes", default="30b,235b", help="comma list of: " + ",".join(SHAPES))
    p.add_argument("--tokens", type=int, default=16384, help="tokens per GPU")
    p.add_argument("--iters", type=int, default=None, help="timed calls (30; 20 with --ep > 1)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-backward", dest="backward", action="store_false")
    p.add_argument("--backend", default="hopper", choices=["hopper", "reference", "auto"])
    p.add_argument("--peak-tflops", type=float, default=765.0)
    p.add_argument("--ep", type=int, default=1,
                   help="EP degree (GPUs); > 1 runs under torchrun")
    p.add_argument("--no-ep1", dest="ep1", action="store_false",
                   help="with --ep > 1: skip timing our EP=1 layer in the same run")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--profile", action="store_true",
                   help="print (rank 0's) top GPU kernels and host profile of ours (fwd+bwd; at EP=1 "
                        "also stock's fwd+bwd, at EP > 1 also ours' fwd)")
    args = p.parse_args(argv)
    for key in args.shapes.split(","):
        if key not in SHAPES:
            p.error(f"unknown shape {key!r}; pick from {','.join(SHAPES)}")
    if args.iters is None:
        args.iters = 30 if args.ep == 1 else 20
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
                        args.peak_tflops, args.profile)
        r["wall_s"] = round(time.time() - t0, 1)
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "tuned"}), flush=True)
    print(table(results))
    bwd = bwd_table(results)
    if bwd:
        print(bwd)
    tuned = tuner_lines(results)
    if tuned:
        print(tuned)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": _meta(), "results": results}, f, indent=1)
    return 0
