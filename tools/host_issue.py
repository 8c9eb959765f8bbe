"""Host time of each step of a waited EP=1 forward (the layer as the bench runs it: stock's
router with our top-k, then mega_moe), on the device's host:

    python3 tools/host_issue.py [30b|235b] [iters]

Each round synchronizes, then runs the forward's steps in order and reads the wall clock
between them, so every number is what that step keeps the (idle) device waiting before its
work is queued. Prints the median per step in microseconds, the whole waited call the same
way, and the Triton launcher's share (a cached kernel launched through JITFunction.run vs
its compiled handle's own launch). No CUDA: nothing to measure, exits 0.
"""

import statistics
import sys
import time

import torch


def main(key: str = "30b", iters: int = 50) -> None:
    if not torch.cuda.is_available():
        print("host_issue: no CUDA device, nothing measured")
        return
    from torchtitan_megamoe import mega_moe
    from torchtitan_megamoe.bench.shapes import SHAPES, build_stock_moe
    from torchtitan_megamoe.ops.api import ids_range_message
    from torchtitan_megamoe.ops.hopper.kernels.combine import combine
    from torchtitan_megamoe.ops.hopper.tiles import BLOCK_M
    from torchtitan_megamoe.ops.hopper.sides.gemm1_swiglu import gemm1_swiglu
    from torchtitan_megamoe.ops.hopper.sides.gemm2 import gemm2
    from torchtitan_megamoe.ops.hopper.plan import build_plan
    from torchtitan_megamoe.router import route
    from torchtitan_megamoe.timing import host_issue_ms

    shape = SHAPES[key]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    moe = build_stock_moe(shape, dev)
    T, D = 16384, shape["dim"]
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    ex = moe.experts
    E = ex.w1.shape[0]

    def steps():
        marks = [time.perf_counter()]
        scores, ids, _ = route(moe.router, x, moe.expert_bias)
        marks.append(time.perf_counter())
        plan = build_plan(ids, E, BLOCK_M, id_limit=E)
        marks.append(time.perf_counter())
        torch._assert_async(plan.ids_ok, ids_range_message(E, 1))
        marks.append(time.perf_counter())
        h = gemm1_swiglu(x, ex.w1, ex.w3, plan)
        marks.append(time.perf_counter())
        y = gemm2(h, ex.w2, plan)
        marks.append(time.perf_counter())
        combine(y, scores, plan.slot_row, x.dtype)
        marks.append(time.perf_counter())
        return [(b - a) * 1e6 for a, b in zip(marks, marks[1:])]

    def layer():
        scores, ids, _ = route(moe.router, x, moe.expert_bias)
        return mega_moe(x, ids, scores, ex.w1, ex.w2, ex.w3, backend="hopper")

    names = ["route", "build_plan", "assert_async", "gemm1", "gemm2", "combine"]
    with torch.no_grad():
        for _ in range(5):  # tuner, compiles
            steps()
            layer()
        torch.cuda.synchronize()
        rows = []
        for _ in range(iters):
            torch.cuda.synchronize()
            rows.append(steps())
        torch.cuda.synchronize()
        med = [statistics.median(r[i] for r in rows) for i in range(len(names))]
        # the same rounds with the device kept busy by a sleep kernel queued after the sync
        # (launches then queue behind it), and with the host spinning on an event instead of
        # blocking in synchronize: which of the two makes a waited call's steps slow
        variants = {}
        for label in ("device busy", "host spins"):
            vrows = []
            for _ in range(iters):
                if label == "device busy":
                    torch.cuda.synchronize()
                    torch.cuda._sleep(int(2e7))  # ~10 ms
                else:
                    ev = torch.cuda.Event()
                    ev.record()
                    while not ev.query():
                        pass
                vrows.append(steps())
            torch.cuda.synchronize()
            variants[label] = [statistics.median(r[i] for r in vrows) for i in range(len(names))]
        # the whole waited call: host_issue_ms (the bench's measure) in microseconds
        layer_us = host_issue_ms(layer, iters) * 1e3
        router_us = host_issue_ms(lambda: route(moe.router, x, moe.expert_bias), iters) * 1e3
        stock_us = host_issue_ms(lambda: moe(x.view(1, T, D)), iters) * 1e3
        torch.cuda.synchronize()
    print(f"host issue per step, {shape['name']}, {T} tokens, median of {iters} (us):")
    for n, v in zip(names, med):
        print(f"  {n:<14}{v:8.1f}")
    print(f"  {'sum':<14}{sum(med):8.1f}")
    for label, v in variants.items():
        print(f"  {label}: " + ", ".join(f"{n} {u:.1f}" for n, u in zip(names, v))
              + f"; sum {sum(v):.1f}")
    print(f"  {'layer (route + mega_moe)':<26}{layer_us:8.1f}  of which route {router_us:.1f}")
    print(f"  {'stock MoE (syncs inside)':<26}{stock_us:8.1f}")
    _launcher_share()
    _tight_loops(x, ex, E, moe, route, build_plan, gemm1_swiglu, gemm2, combine, BLOCK_M)
    if "--cprofile" in sys.argv:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        with torch.no_grad():
            torch.cuda.synchronize()
            prof.enable()
            for _ in range(30):
                steps()
            prof.disable()
            torch.cuda.synchronize()
        for order in ("tottime", "cumulative"):
            print(f"--- cProfile of 30 rounds of the steps, by {order}:")
            pstats.Stats(prof).sort_stats(order).print_stats(45)


def _tight_loops(x, ex, E, moe, route, build_plan, gemm1_swiglu, gemm2, combine, block_m,
                 n=100):
    """Each step alone, called n times in a row while the device is kept busy (the host never
    waits): its steady-state host cost, against the in-sequence numbers above."""
    with torch.no_grad():
        scores, ids, _ = route(moe.router, x, moe.expert_bias)
        plan = build_plan(ids, E, block_m, id_limit=E)
        h = gemm1_swiglu(x, ex.w1, ex.w3, plan)
        y = gemm2(h, ex.w2, plan)
        calls = {
            "route": lambda: route(moe.router, x, moe.expert_bias),
            "build_plan": lambda: build_plan(ids, E, block_m, id_limit=E),
            "gemm1": lambda: gemm1_swiglu(x, ex.w1, ex.w3, plan),
            "gemm2": lambda: gemm2(h, ex.w2, plan),
            "combine": lambda: combine(y, scores, plan.slot_row, x.dtype),
        }
        out = []
        for name, fn in calls.items():
            k = n // 10 if name.startswith("gemm") else n  # the GEMMs' ~1 ms each: fewer calls
            torch.cuda.synchronize()
            torch.cuda._sleep(int(2e9))  # ~1 s of device time: the queue never drains
            for _ in range(20):
                fn()
            t0 = time.perf_counter()
            for _ in range(k):
                fn()
            out.append(f"{name} {(time.perf_counter() - t0) / k * 1e6:.1f}")
            torch.cuda.synchronize()
    print("steady-state host cost per call, device busy (us): " + ", ".join(out))


def _launcher_share(n: int = 2000) -> None:
    """JITFunction.run vs the compiled handle's launch for one tiny cached kernel."""
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(p, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(p + i, i, mask=i < n)

    buf = torch.empty(128, dtype=torch.int32, device="cuda")
    handle = _probe[(1,)](buf, 100, BLOCK=128)
    torch.cuda.synchronize()

    def per_call(fn):
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        us = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        return us

    jit_us = per_call(lambda: _probe[(1,)](buf, 100, BLOCK=128))
    stream = torch.cuda.current_stream().cuda_stream
    try:
        def direct():  # Triton 3.x: the bound arguments, constexprs included
            handle.run(1, 1, 1, stream, handle.function, handle.packed_metadata, None, None,
                       None, buf, 100, 128)
        direct()
        torch.cuda.synchronize()
        direct_us = per_call(direct)
    except Exception as err:  # the handle's run signature differs between Triton versions
        direct_us = float("nan")
        print(f"  compiled handle launch failed: {err!r}"[:300])
    empty_us = per_call(lambda: torch.empty(128, dtype=torch.int32, device="cuda"))
    zeros_us = per_call(lambda: torch.zeros(1, dtype=torch.int32, device="cuda"))
    print(f"Triton launch of a cached kernel (us): JITFunction.run {jit_us:.1f}, compiled "
          f"handle {direct_us:.1f}; torch.empty {empty_us:.1f}, torch.zeros(1) {zeros_us:.1f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "30b",
         int(sys.argv[2]) if len(sys.argv) > 2 else 50)
