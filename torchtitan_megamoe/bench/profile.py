"""Where a layer's time goes: its GPU kernels (torch.profiler) and the host's issue time."""

from __future__ import annotations

import time

import torch


def profile_kernels(title: str, fn, rank: int, calls: int = 3, rows: int = 40,
                    host_fn=None) -> None:
    """Rank 0 prints the GPU kernels of ``calls`` calls of fn (per-call time = total / calls):
    where a layer's time goes when no per-stage timer covers it (the EP exchange).
    ``host_fn``: what cProfile times instead of fn, e.g. the backend's Python forward called
    directly (under the custom op's C++ dispatch cProfile books the whole op on one frame)."""
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
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(host, stream=text).sort_stats(order).print_stats(rows)
            print(f"--- host (cProfile, {calls} calls, sorted by {order}):", flush=True)
            print("\n".join(text.getvalue().splitlines()[-rows - 2:]), flush=True)
