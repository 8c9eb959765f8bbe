"""EP forward with the peers' partial rows returned as now ("direct": a full-grid combine whose
stores cross NVLink, between the two GEMM 2 launches) or "staged" (the combine into a local
buffer, HBM-bound, then a copy-engine transfer beside GEMM 2): MEGAMOE_EP_RETURN, in one process
per GPU, variants alternating over ROUNDS rounds (default 5) of a back-to-back median and a
waited median each; the table gives the median of the rounds and checks that every variant's
output is bitwise the first's:

    python3 -m torch.distributed.run --nproc_per_node 2 scripts/ep_return_variants.py 30b
    ROUNDS=3 python3 -m torch.distributed.run --nproc_per_node 2 \
        scripts/ep_return_variants.py 235b

Inputs as bench --ep: stock TorchTitan's router and experts (seed 0), this rank's expert slice,
16384 tokens per GPU. Also times our EP=1 forward back to back on the full weights, for the
EP=N / EP=1 ratio of issue 3.
"""

import os
import statistics
import sys

import torch
import torch.distributed as dist

from torchtitan_megamoe import mega_moe
from torchtitan_megamoe.bench.shapes import SHAPES, build_stock_moe
from torchtitan_megamoe.router import route
from torchtitan_megamoe.timing import back_to_back_ms, median_ms


def main(shape_name: str = "30b") -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    group = dist.group.WORLD
    shape = SHAPES[shape_name]
    T, D = 16384, shape["dim"]
    torch.manual_seed(0)
    moe = build_stock_moe(shape, dev)
    E_local = shape["experts"] // world
    mine = slice(rank * E_local, (rank + 1) * E_local)
    ex = moe.experts
    w_mine = [getattr(ex, n).detach()[mine].clone() for n in ("w1", "w2", "w3")]
    w_full = [getattr(ex, n).detach() for n in ("w1", "w2", "w3")]
    torch.manual_seed(1 + rank)
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)

    def layer(ws, grp):
        scores, ids, _ = route(moe.router, x, moe.expert_bias)
        return mega_moe(x, ids, scores, *ws, group=grp, backend="triton")

    variants = os.environ.get("VARIANTS", "direct staged").split()
    rounds = int(os.environ.get("ROUNDS", "5"))
    b2b, waited, same = {s: [] for s in variants}, {s: [] for s in variants}, {}
    first = None
    with torch.no_grad():
        ep1 = [back_to_back_ms(lambda: layer(w_full, None), 20, 3) for _ in range(2)]
        for _ in range(rounds):
            for s in variants:
                os.environ["MEGAMOE_EP_RETURN"] = s
                out = layer(w_mine, group)
                if first is None:
                    first = out.clone()
                same[s] = same.get(s, True) and torch.equal(out, first)
                b2b[s].append(back_to_back_ms(lambda: layer(w_mine, group), 20, 3))
                waited[s].append(median_ms(lambda: layer(w_mine, group), 20, 3))
    ep1_ms = min(ep1)
    if rank == 0:
        print(f"{shape['name']} EP={world}, {T} tokens per GPU, {rounds} rounds; "
              f"ours EP=1 back to back {ep1_ms:.3f} ms")
        print("| return | fwd b2b ms | EP=N / EP=1 | fwd waited ms | output = first |")
        print("| --- | --- | --- | --- | --- |")
        for s in variants:
            m = statistics.median(b2b[s])
            print(f"| {s} | {m:.3f} | {m / ep1_ms:.3f} | {statistics.median(waited[s]):.3f} "
                  f"| {same[s]} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
