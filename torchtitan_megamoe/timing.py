"""Median time of a GPU callable, for the benchmarks (CUDA events; wall clock on CPU)."""

import statistics
import time

import torch


def median_ms(fn, iters: int, warmup: int = 0) -> float:
    """Median over ``iters`` calls of ``fn`` after ``warmup`` untimed calls, in milliseconds.

    On the GPU each call is bracketed by CUDA events and waited for, so the time is the
    device's; without CUDA (the CPU smoke runs of the benchmarks) it is wall time."""
    for _ in range(warmup):
        fn()
    times = []
    if not torch.cuda.is_available():
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
