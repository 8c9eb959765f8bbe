"""Host time of each step of a waited EP forward (mega_moe with an expert-parallel group), per
rank, the counterpart of tools/host_issue.py for ops/hopper/ep_forward.py:

    torchrun --nproc_per_node 2 tools/host_issue_ep.py [30b|235b|tiny] [iters]
    # CPU smoke of the script itself (gloo, Triton interpreter):
    TRITON_INTERPRET=1 torchrun --nproc_per_node 2 tools/host_issue_ep.py tiny 3

Each round synchronizes (device and ranks), then calls the forward once. The callables the EP
forward issues its work through (the token route, the exchange's regions, copies, barriers and
side stream, the plan, the GEMMs, the combines) are wrapped with wall-clock reads, so each
step's in-sequence host time shows, and "python between steps" is the rest of the call. The
waited call is also timed unwrapped (the wrappers cost ~1 us each). Rank 0 prints the median
per step over the rounds, in microseconds, next to the whole call and the GPU time of a
back-to-back call.
"""

import collections
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


_DEPTH = [0]


def _wrap(owner, name: str, label: str, log: list) -> None:
    """Replace owner.name by a wrapper that logs (label, seconds, nesting depth) per call."""
    fn = getattr(owner, name)

    def timed(*args, **kwargs):
        depth = _DEPTH[0]
        _DEPTH[0] += 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            log.append((label, time.perf_counter() - t0, depth))
            _DEPTH[0] = depth

    setattr(owner, name, timed)


def steps() -> list[tuple]:
    """(owner, callable's name, label) of every step the EP forward issues its work through."""
    from torchtitan_megamoe.ops.hopper import ep_dispatch, ep_forward
    from torchtitan_megamoe.ops.hopper.ep_transport import AllToAllExchange, SymmetricExchange

    route = ep_dispatch.TokenRoute
    found = [
        (ep_forward, "TokenRoute", "route kernel (TokenRoute)"),
        (route, "send_meta", "send_meta"),
        (route, "send_own", "send_own (own rows)"),
        (route, "send_peers", "send_peers (row copies)"),
        (route, "received", "received ids/weights"),
        (ep_forward, "build_plans", "region plans (one pair)"),
        (ep_forward, "gemm1_swiglu", "GEMM 1 (xR)"),
        (ep_forward, "gemm2", "GEMM 2 (xR)"),
        (ep_forward, "forward_fp8_rows", "FP8 region (xR)"),
        (ep_forward, "combine", "combines (xR)"),
        (route, "return_rows", "return_rows"),
        (route, "sum_returned", "sum_returned"),
    ]
    for cls in (SymmetricExchange, AllToAllExchange):
        found += [(cls, "send_region", "send_region (views)"),
                  (cls, "exchange", "exchange (barriers)")]
    return found + [(SymmetricExchange, "run_async", "run_async (side stream)")]


def main(key: str = "30b", iters: int = 30) -> None:
    from torchtitan_megamoe import mega_moe
    from torchtitan_megamoe.bench.shapes import SHAPES

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    R, me = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    dev = torch.device("cuda" if cuda else "cpu")
    shape = SHAPES[key]
    T = 16384 if cuda else 64
    D, H, E, K = shape["dim"], shape["hidden"], shape["experts"], shape["top_k"]
    El = E // R
    gen = torch.Generator(device="cpu").manual_seed(me)
    x = torch.randn(T, D, generator=gen).to(dev, torch.bfloat16)
    ids = torch.rand(T, E, generator=gen).topk(K, dim=1).indices.to(dev)
    w = torch.rand(T, K, generator=gen).softmax(-1).to(dev)
    w1, w3 = ((torch.randn(El, H, D, generator=gen) / D**0.5).to(dev, torch.bfloat16)
              for _ in range(2))
    w2 = (torch.randn(El, D, H, generator=gen) / H**0.5).to(dev, torch.bfloat16)

    def call():
        return mega_moe(x, ids, w, w1, w2, w3, group=group, backend="hopper")

    def sync():
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    def waited(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if cuda:
            torch.cuda.synchronize()
        return dt * 1e6

    with torch.no_grad():
        for _ in range(3):  # tuner, compiles, the exchange's buffers
            call()
        unwrapped = statistics.median(waited(call) for _ in range(iters))
        b2b = float("nan")
        if cuda:
            sync()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                call()
            end.record()
            torch.cuda.synchronize()
            b2b = start.elapsed_time(end) / iters * 1e3

        log: list = []
        for owner, name, label in steps():
            _wrap(owner, name, label, log)
        totals, per_step = [], collections.defaultdict(list)
        for _ in range(iters):
            log.clear()
            totals.append(waited(call))
            sums, top = collections.defaultdict(float), 0.0
            for label, dt, depth in log:
                sums[label] += dt * 1e6
                top += dt * 1e6 if depth == 0 else 0.0
            for label, us in sums.items():
                per_step[label].append(us)
            per_step["python between steps"].append(totals[-1] - top)
    if me == 0:
        print(f"EP={R} forward host issue per step, {shape['name']}, {T} tokens per rank, "
              f"median of {iters} waited calls, rank 0 (us; nested steps count in both):")
        for label, vals in per_step.items():
            print(f"  {label:<28}{statistics.median(vals):9.1f}")
        print(f"  {'whole call, wrapped':<28}{statistics.median(totals):9.1f}")
        print(f"  {'whole call, unwrapped':<28}{unwrapped:9.1f}")
        print(f"  {'GPU per call, back to back':<28}{b2b:9.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "30b",
         int(sys.argv[2]) if len(sys.argv) > 2 else 30)
