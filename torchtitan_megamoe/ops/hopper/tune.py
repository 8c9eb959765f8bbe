"""Tiny per-shape config picker for the GEMM kernels.

triton.autotune would re-run every candidate on the first call of each key too; this does the
same with device events, but also (a) returns the stage table's untuned pick (sides/table.py:
the side measured fastest where it fits) without timing under the CPU interpreter, during CUDA
graph capture or with MEGAMOE_TUNE=0, and (b) lets callers pin a config (tests). Candidates
write the same outputs, so timing them in place is harmless.

(c) With ``outputs``, every candidate's result is also checked against the first candidate's
(the table's reference side, the trusted Triton kernels) before it is timed: a candidate whose output differs by
more than CHECK_TOL (relative Frobenius, on a sample of at most ~1M elements per tensor) is
never picked and its entry in TIMINGS says why. Implementations differ only by bf16 rounding
(~1e-3); a broken kernel (a new shape, a new GPU) differs by O(1). This is the guard that keeps
a fast but wrong hand-written kernel out of a training run.
"""

import torch

from torchtitan_megamoe import settings

from torchtitan_megamoe.timing import median_ms

_CHOSEN: dict = {}
TIMINGS: dict = {}
"""(stage name, shape key) -> [(config, ms, why it was rejected or "")], for the benchmark's
report."""


def _tuning_enabled() -> bool:
    if settings.triton_interpreting():
        return False
    if not settings.tuning():
        return False
    return not torch.cuda.is_current_stream_capturing()


CHECK_TOL = 5e-2


def _sample(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    step = max(1, flat.numel() >> 20) | 1  # odd: does not alias row lengths of powers of two
    return flat[::step].clone()


def output_mismatch(got: tuple, ref: tuple) -> float:
    """Largest relative Frobenius difference of got's tensors from ref's; positions equal in
    both (NaN included: memory no candidate wrote) count as agreeing; inf when the shapes
    differ or a difference is not finite."""
    worst = 0.0
    for g, r in zip(got, ref, strict=True):
        if g.shape != r.shape:
            return float("inf")
        g, r = g.double(), r.double()
        same = (g == r) | (g.isnan() & r.isnan())
        d = torch.where(same, 0.0, g - r)
        if not bool(torch.isfinite(d).all()):
            return float("inf")
        scale = torch.where(same, 0.0, r).norm().clamp_min(1e-30)
        worst = max(worst, float(d.norm() / scale) if bool((d != 0).any()) else 0.0)
    return worst


def relative_difference(got: tuple, ref: tuple) -> float:
    """Largest ||g - r|| / ||r|| over whole tensors: the check for outputs that are written at
    every position (e.g. the used rows alone) and quantized, where output_mismatch's measure
    over the differing positions only would read a rounding flipped at a few of them (one e4m3
    step: 6-12% of those values) as a wrong result. inf when the shapes differ or a difference
    is not finite."""
    worst = 0.0
    for g, r in zip(got, ref, strict=True):
        if g.shape != r.shape:
            return float("inf")
        g, r = g.double(), r.double()
        d = (g - r).norm()
        if not bool(torch.isfinite(d)):
            return float("inf")
        worst = max(worst, float(d / r.norm().clamp_min(1e-30)) if bool(d > 0) else 0.0)
    return worst


def _time_ms(launch, cfg) -> float:
    """Median of 10 launches (CUDA events); the tests replace it with fixed times."""
    return median_ms(lambda: launch(cfg), 10)


def tuned(name: str, key: tuple) -> dict | None:
    """What pick_config returns for (name, key) once it has timed them (and tuning is on);
    None before. Lets a wrapper skip building its candidate list on every later call."""
    chosen = _CHOSEN.get((name, key))
    return chosen if chosen is not None and _tuning_enabled() else None


def picked(name: str, key: tuple) -> dict | None:
    """What pick_config chose for (name, key) after timing its candidates; None before (or when
    it never timed them)."""
    return _CHOSEN.get((name, key))


def pick_config(stage, key: tuple, problem, launch, outputs=None,
                mismatch=output_mismatch):
    """The fastest candidate of ``stage`` (a sides.table.Stage) for ``key``, timed once and
    cached. ``problem()``: (shape, availability) for the table's offer, called only while no
    pick is cached (building the offer costs host time on every call otherwise).
    ``outputs(result)``: the tensors a launch wrote, from its return value, to check each
    candidate against the first (see the module docstring); None: no check.
    ``mismatch(got, ref)``: the check's measure (output_mismatch, or relative_difference for
    quantized outputs)."""
    name = stage.name
    chosen = tuned(name, key)
    if chosen is not None:
        return chosen
    offer = stage.offer(*problem())
    candidates = offer.candidates
    if not candidates:
        raise ValueError(f"{name}: no config fits {key}")
    if len(candidates) == 1:
        return candidates[0]
    k = (name, key)
    if not _tuning_enabled():
        return offer.untuned
    results, ref = [], None
    for cfg in candidates:
        try:
            res = launch(cfg)  # compile + warm
        except Exception as err:  # a config the compiler rejects (e.g. out of shared memory)
            results.append((cfg, float("inf"), repr(err)[:200]))
            continue
        if outputs is not None:
            got = tuple(_sample(t) for t in outputs(res))
            if ref is None:
                ref = got
            else:
                err = mismatch(got, ref)
                if err > CHECK_TOL:
                    results.append((cfg, float("inf"),
                                    f"wrong result: rel. difference {err:.2e} from the first "
                                    f"candidate's (tolerance {CHECK_TOL})"))
                    continue
        results.append((cfg, _time_ms(launch, cfg), ""))
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
