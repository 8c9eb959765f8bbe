"""Where a layer's time goes: its GPU kernels (torch.profiler) and the host's issue time."""

from __future__ import annotations

import time

import torch


def profile_kernels(title: str, fn, rank: int, calls: int = 3, rows: int = 40,
                    host_fn=None, host_profile: bool = True) -> None:
    """Rank 0 prints the GPU kernels of ``calls`` calls of fn (per-call time = total / calls):
    where a layer's time goes when no per-stage timer covers it (the EP exchange).
    ``host_fn``: what cProfile times instead of fn, e.g. the backend's Python forward called
    directly (under the custom op's C++ dispatch cProfile books the whole op on one frame);
    ``host_profile=False``: no cProfile tables (it sees the calling thread only)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    # Host time to issue one call, outside the profiler: when it exceeds the GPU time per call,
    # the layer is launch-bound, not kernel-bound.
    import cProfile
    import io
    import pstats

    host = cProfile.Profile()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host_ms = (time.perf_counter() - t0) * 1e3 / calls
    torch.cuda.synchronize()
    host.enable()
    for _ in range(calls):
        (host_fn or fn)()
    host.disable()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    if rank == 0:
        from torch.autograd import DeviceType

        kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
        gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / calls
        print(f"--- profile: {title}, {calls} calls: host issue {host_ms:.3f} ms per call, "
              f"GPU kernels {gpu_ms:.3f} ms per call", flush=True)
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows,
                                        max_name_column_width=60), flush=True)
        cats = by_category([(e.key, e.self_device_time_total) for e in kernels], calls)
        print("--- GPU kernels by category, ms per call: " + ", ".join(
            f"{cat} {ms:.3f}" for cat, ms in cats), flush=True)
        for order in ("tottime", "cumulative") if host_profile else ():
            text = io.StringIO()
            pstats.Stats(host, stream=text).sort_stats(order).print_stats(rows)
            print(f"--- host (cProfile, {calls} calls, sorted by {order}):", flush=True)
            print("\n".join(text.getvalue().splitlines()[-rows - 2:]), flush=True)


def by_category(kernels: list, calls: int) -> list:
    """[(category, ms per call)], largest first, of (kernel name, summed us) pairs over
    ``calls`` calls; the categories of a training step's trace (ab/trace.py)."""
    from torchtitan_megamoe.ab.trace import category

    out: dict = {}
    for name, us in kernels:
        cat = category(name)
        out[cat] = out.get(cat, 0.0) + us / 1e3 / calls
    return sorted(out.items(), key=lambda kv: -kv[1])


LAUNCH_APIS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
               "cudaMemsetAsync", "cudaMemcpyAsync")
"""Host runtime calls that put work on the GPU (what the timeline pairs with kernels)."""


def timeline(title: str, fn, rank: int, rows: int = 90) -> None:
    """Rank 0 prints one call of fn as a time line: every host launch call (H) and every GPU
    kernel (G) with its start (us from the call's first host event), duration and the idle
    time the GPU spent before it. The sum of the idle gaps is the latency the host's issue
    adds to a waited call (kernels themselves are in the other profile's table)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    if rank != 0:
        return
    events = [e for e in prof.events() if e.time_range.end > e.time_range.start]
    if not events:
        print(f"--- timeline: {title}: no events", flush=True)
        return
    t0 = min(e.time_range.start for e in events if e.device_type == DeviceType.CPU)
    gpu = sorted((e for e in events if e.device_type == DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    host = sorted((e for e in events if e.device_type == DeviceType.CPU
                   and any(e.name.startswith(api) for api in LAUNCH_APIS)),
                  key=lambda e: e.time_range.start)
    lines = [(e.time_range.start - t0, "H", f"{e.name}") for e in host]
    idle_total, busy_total, last_end = 0.0, 0.0, None
    for e in gpu:
        start = e.time_range.start - t0
        idle = 0.0 if last_end is None else max(0.0, e.time_range.start - last_end)
        idle_total += idle
        busy_total += e.time_range.end - e.time_range.start
        last_end = e.time_range.end if last_end is None else max(last_end, e.time_range.end)
        lines.append((start, "G", f"{e.time_range.end - e.time_range.start:9.1f} us  idle "
                                  f"{idle:7.1f}  {e.name[:70]}"))
    lines.sort(key=lambda x: x[0])
    first_gpu = gpu[0].time_range.start - t0 if gpu else 0.0
    end = (last_end - t0) if last_end is not None else 0.0
    print(f"--- timeline: {title}: {len(host)} host launches, {len(gpu)} GPU kernels; first "
          f"kernel at {first_gpu:.1f} us, last ends at {end:.1f} us; GPU busy {busy_total:.1f} "
          f"us, idle between kernels {idle_total:.1f} us", flush=True)
    for t, kind, text in lines[:rows]:
        print(f"{kind} {t:9.1f}  {text}", flush=True)
    if len(lines) > rows:
        print(f"... {len(lines) - rows} more", flush=True)
