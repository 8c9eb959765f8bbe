"""Tiny per-shape config picker for the GEMM kernels.

triton.autotune would re-run every candidate on the first call of each key too; this does the
same with device events, but also (a) returns the first candidate without timing under the CPU
interpreter, during CUDA graph capture or with MEGAMOE_TRITON_TUNE=0, and (b) lets callers pin a
config (tests). Candidates write the same outputs, so timing them in place is harmless.
"""

import os

import torch

_CHOSEN: dict = {}
TIMINGS: dict = {}
"""(kernel name, shape key) -> [(config, ms)], for the benchmark's report."""


def interpreting() -> bool:
    """True when kernels run under Triton's CPU interpreter (read at launch time)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def interpreter_needs_f32_dot() -> bool:
    """The CPU interpreter (seen with Triton 3.9) returns garbage from tl.dot on bf16 operands,
    so kernels upcast their dot operands to fp32 there; compiled kernels keep bf16 MMAs."""
    return interpreting()


def _tuning_enabled() -> bool:
    if interpreting():
        return False
    if os.environ.get("MEGAMOE_TRITON_TUNE", "1") == "0":
        return False
    return not torch.cuda.is_current_stream_capturing()


def warp_spec_allowed(name: str) -> bool:
    """Warp-specialized candidates only for kernels named in MEGAMOE_TRITON_WS (comma list).

    Triton's Hopper warp-specialization pass can fail with a C++ assertion that aborts the whole
    process instead of raising, so the GPU check script first compiles each kernel's
    warp-specialized config in a throwaway process (ws_probe.py) and lists the ones that survive.
    """
    return name in os.environ.get("MEGAMOE_TRITON_WS", "").split(",")


def pick_config(name: str, key: tuple, candidates: list, launch) -> dict:
    if len(candidates) > 1:
        candidates = [c for c in candidates if not c.get("WARP_SPEC") or warp_spec_allowed(name)]
    if len(candidates) == 1 or not _tuning_enabled():
        return candidates[0]
    k = (name, key)
    if k in _CHOSEN:
        return _CHOSEN[k]
    results = []
    for cfg in candidates:
        try:
            launch(cfg)  # compile + warm
        except Exception as err:  # a config the compiler rejects (e.g. out of shared memory)
            results.append((cfg, float("inf"), repr(err)[:200]))
            continue
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(10):
            start.record()
            launch(cfg)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        times.sort()
        results.append((cfg, times[len(times) // 2], ""))
    best = min(results, key=lambda r: r[1])
    if best[1] == float("inf"):
        raise RuntimeError(f"{name}: every candidate config failed: {results}")
    TIMINGS[k] = results
    _CHOSEN[k] = best[0]
    return best[0]


def bucket(rows: int) -> int:
    """Tuning key for a row count: the next power of two. Under EP the received row count
    changes every step; keying on it exactly would re-time every candidate each step."""
    return 1 << max(0, rows - 1).bit_length()
