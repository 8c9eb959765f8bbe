"""Median time of a GPU callable, for the benchmarks (CUDA events; wall clock on CPU)."""

import statistics
import time
import traceback

import torch


def median_ms(fn, iters: int, warmup: int = 0) -> float:
    """Median over ``iters`` calls of ``fn`` after ``warmup`` untimed calls, in milliseconds.

    On the GPU each call is bracketed by CUDA events and waited for, so the time is the
    device's; without CUDA (the CPU smoke runs of the benchmarks) it is wall time."""
    if not torch.cuda.is_available():
        return host_issue_ms(fn, iters, warmup)  # wall time per call
    for _ in range(warmup):
        fn()
    times = []
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


def back_to_back_ms(fn, iters: int, warmup: int = 0) -> float:
    """Time per call of ``iters`` calls issued back to back: the host may run ahead of the
    device, as it does across layers in training when nothing syncs. An event is recorded
    before each call and after the last (recording does not sync the host); the result is the
    median of the intervals between consecutive events, so one stall inside the run (an
    allocator or driver hiccup) does not move it, as it would a mean over the calls. Against
    median_ms (each call waited for), the difference is host time the device would otherwise
    idle for. Wall time per call (median) without CUDA."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    events[0].record()
    for i in range(iters):
        fn()
        events[i + 1].record()
    events[-1].synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(events, events[1:]))


def host_issue_ms(fn, iters: int, warmup: int = 0) -> float:
    """Median over ``iters`` calls of the host's time to return from ``fn`` with the device idle
    before each call (synchronized first, not after): how long a waited call keeps the device
    waiting for launches before its work queues up. A call that syncs inside measures its device
    time too. Wall time per call without CUDA (the whole call)."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize()
    return statistics.median(times)


def peak_extra_mib(fn) -> float:
    """Peak of the caching allocator's memory above its level before one call of ``fn``, in
    MiB: the call's transient workspace plus what it returns (0 without CUDA)."""
    if not torch.cuda.is_available():
        fn()
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def gpu_busy_ms(fn, calls: int = 2) -> tuple[float, float]:
    """(ms the device is busy per call, kernels per call) over ``calls`` profiled calls of
    ``fn``: the union of every kernel's, copy's and memset's interval, so work that overlaps on
    several streams counts once and host gaps count not at all. Where the host issues slower
    than the device runs (R loopback ranks issued by one process), this is the device's time,
    which an event-timed call cannot give. (0, 0) without CUDA."""
    if not torch.cuda.is_available():
        fn()
        return 0.0, 0.0
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, end = 0.0, float("-inf")
    for s, e in spans:
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy / 1e3 / calls, len(spans) / calls


def _where(err: BaseException) -> str:
    """' at file:line (function)' of the innermost frame of this package that raised ``err``
    (a capture error names no line of ours otherwise)."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if "torchtitan_megamoe" in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    path = f.filename.split("torchtitan_megamoe")[-1].lstrip("/")
    return f" at {path}:{f.lineno} ({f.name}: {f.line})"


def capture(fn) -> tuple:
    """(graph, what ``fn`` returned while captured): ``fn`` run once off the capture stream (as
    torch.cuda.graph wants), then captured in one CUDA graph, concurrent streams kept (capture
    mode "relaxed": R loopback ranks launch into the captured streams from their own
    threads). A replay rewrites what the captured call returned."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="relaxed"):
        out = fn()
    return graph, out


def graphed_ms(fn, iters: int, warmup: int = 1) -> tuple[float | None, str | None]:
    """(median ms of replaying one call of ``fn`` captured in a CUDA graph (``capture``),
    None), or (None, why) where the capture fails: the device's time with no host in the way.
    (None, "no CUDA") without a device."""
    if not torch.cuda.is_available():
        return None, "no CUDA"
    for _ in range(warmup):
        fn()
    try:
        graph, _ = capture(fn)
    except Exception as err:  # noqa: BLE001 - reported, the caller's other numbers stand
        torch.cuda.synchronize()
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:200]}{_where(err)}"
    try:
        return median_ms(graph.replay, iters, warmup=1), None
    finally:
        del graph
