"""Host time per mega_moe call spent outside the backend: the registered op (torch.library's
custom-op wrapping) vs the plain-eager autograd Function, with a backend that does nothing but
allocate its outputs, so only the wrapping is timed (no kernel, no sync):

    python3 tools/op_overhead.py [cpu|cuda]

Prints microseconds per call (median of 5 rounds of 2000 calls) for forward with autograd
(saving), forward under no_grad, and forward + backward.
"""

import statistics
import sys
import time
import types

import torch

from torchtitan_megamoe import mega_moe
from torchtitan_megamoe.ops import api


def _null_backend() -> None:
    mod = types.ModuleType("megamoe_null_backend")

    def forward(x, topk_ids, topk_weights, w1, w2, w3, group, options, save=False):
        out = torch.empty_like(x)
        return (out, [torch.empty_like(x)]) if save else out

    def backward(grad_out, x, topk_ids, topk_weights, w1, w2, w3, group, options, saved=None,
                 release_saved=False):
        return tuple(torch.empty_like(t) for t in (x, topk_weights, w1, w2, w3))

    mod.forward, mod.backward = forward, backward
    sys.modules[mod.__name__] = mod
    # stands in for the reference backend: the options accept only the real backends' names
    api._BACKEND_MODULES["reference"] = mod.__name__


def _us_per_call(fn, n=2000, rounds=5) -> float:
    for _ in range(200):
        fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def main(device: str = "cpu") -> None:
    _null_backend()
    T, D, E, H, K = 64, 32, 8, 16, 4
    x = torch.randn(T, D, device=device, requires_grad=True)
    ids = torch.randint(0, E, (T, K), device=device)
    w = torch.rand(T, K, device=device, requires_grad=True)
    w1, w3 = (torch.randn(E, H, D, device=device, requires_grad=True) for _ in range(2))
    w2 = torch.randn(E, D, H, device=device, requires_grad=True)
    dy = torch.ones(T, D, device=device)

    def fwd():
        return mega_moe(x, ids, w, w1, w2, w3, backend="reference")

    def no_grad():
        with torch.no_grad():
            return fwd()

    def fwd_bwd():
        fwd().backward(dy)

    real = api._plain_eager
    print(f"host us per call ({device}, torch {torch.__version__}); null backend")
    print("| path | fwd (autograd) | fwd (no_grad) | fwd + bwd |")
    print("| --- | --- | --- | --- |")
    for name, plain in (("registered op", False), ("eager Function", True)):
        api._plain_eager = (lambda t: False) if not plain else real
        row = [_us_per_call(f) for f in (fwd, no_grad, fwd_bwd)]
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in row) + " |")
    api._plain_eager = real


if __name__ == "__main__":
    main(*sys.argv[1:])
