"""Host time of one training forward of the experts module as the one-GPU step runs it
(``moe.MegaExperts``: fp32 parameters under a bf16 autocast, gradients on), per precision, with
the device kept busy so that no launch waits: what the host spends before the layer's work is
all queued, the step's forward being host-bound.

    python3 tools/host_module.py [tokens] [iters] [--cprofile]

Cases: bf16; fp8 with the layer's FP8 copies current (the activation-checkpoint recompute, and
every call with ``fp8_free_after_backward`` off); fp8 making them first (the step's first
forward of each layer with ``fp8_free_after_backward``, the default). Prints the median in
microseconds; ``--cprofile`` adds a profile of the copies-made case. 30B's expert dims, default
8192 tokens (30B-A3B-L6 at seq 8192, batch 1). No CUDA: nothing to measure, exits 0.
"""

import statistics
import sys
import time

import torch


def main(tokens: int = 8192, iters: int = 40) -> None:
    if not torch.cuda.is_available():
        print("host_module: no CUDA device, nothing measured")
        return
    from torchtitan_megamoe.bench.shapes import SHAPES
    from torchtitan_megamoe.moe import MegaExperts
    from torchtitan_megamoe.ops.options import MegaMoEOptions

    shape = SHAPES["30b"]
    D, H, E, K = shape["dim"], shape["hidden"], shape["experts"], shape["top_k"]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(tokens, D, device=dev, requires_grad=True)
    ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(tokens)]).to(torch.int32)
    w = torch.softmax(torch.randn(tokens, K, device=dev), -1)

    def module(precision):
        m = MegaExperts(D, H, E, options=MegaMoEOptions(backend="hopper", precision=precision))
        m.to(dev)
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.02)
        return m

    def call(m, remake):
        if remake:
            m.release_after_backward()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return m(x, ids, w)

    cases = {"bf16": (module("bf16"), False)}
    m8 = module("fp8")
    cases["fp8, copies current"] = (m8, False)
    cases["fp8, copies made"] = (m8, True)
    for m, remake in cases.values():
        for _ in range(3):  # tuner, compiles
            call(m, remake).sum().backward()
    torch.cuda.synchronize()
    print(f"host time of a training forward of MegaExperts, 30B dims, {tokens} tokens, "
          f"device busy, median of {iters} (us):")
    for name, (m, remake) in cases.items():
        times = []
        for _ in range(iters):
            torch.cuda.synchronize()
            torch.cuda._sleep(int(5e7))  # ~25 ms queued: no launch of the call waits
            t0 = time.perf_counter()
            out = call(m, remake)
            times.append((time.perf_counter() - t0) * 1e6)
            del out
        torch.cuda.synchronize()
        print(f"  {name:<22}{statistics.median(times):9.1f}")
    if "--cprofile" in sys.argv:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        for _ in range(10):
            torch.cuda.synchronize()
            torch.cuda._sleep(int(5e7))
            prof.enable()
            out = call(m8, True)
            prof.disable()
            del out
        torch.cuda.synchronize()
        print("--- cProfile of 10 fp8 forwards that make their copies, by cumulative time:")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(*(int(a) for a in args))
