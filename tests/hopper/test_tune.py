"""The tuner's output check (ops/hopper/tune.py): a candidate whose result differs from the first
candidate's beyond bf16 rounding is never picked, however fast; rounding-level differences and
memory no candidate wrote (even NaN garbage) do not disqualify. CPU: timing is replaced by fixed
numbers, the launches by tensor writes."""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from torchtitan_megamoe.ops.hopper import tune
from torchtitan_megamoe.ops.hopper.sides.table import Available, Side, Stage


@dataclass(frozen=True)
class C:
    side: ClassVar[str] = "triton"
    id: int


@dataclass(frozen=True)
class Fast:
    side: ClassVar[str] = "fast"
    id: int


def _stage(name, n, built=None, fast=False):
    """A table whose reference side offers C(0) .. C(n - 1); with ``fast``, a preferred side
    offering Fast(n) after them."""
    def offer(shape, avail):
        if built is not None:
            built.append(1)
        return [C(i) for i in range(n)]
    sides = (Side("triton", offer, None),) + ((Side("fast", lambda s, a: [Fast(n)], None),)
                                               if fast else ())
    return Stage(name, sides, "triton", ("fast", "triton") if fast else ("triton",))


def _problem():
    return None, Available()


@pytest.fixture
def tuner(monkeypatch):
    times = {}
    monkeypatch.setattr(tune, "_tuning_enabled", lambda: True)
    monkeypatch.setattr(tune, "_time_ms", lambda launch, cfg: times[cfg.id])
    monkeypatch.setattr(tune, "_CHOSEN", {})
    monkeypatch.setattr(tune, "TIMINGS", {})
    return times


def _run(out, writers, times, tuner_times, key):
    tuner_times.update(times)
    def launch(cfg):
        writers[cfg.id](out)
        return out

    return tune.pick_config(_stage("check", len(writers)), key, _problem, launch,
                            outputs=lambda r: (r,))


def test_a_fast_wrong_candidate_is_never_picked(tuner):
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(300, 64, generator=g).bfloat16()
    out = torch.empty(300, 64, dtype=torch.bfloat16)
    right = lambda o: o.copy_(ref)  # noqa: E731
    wrong = lambda o: o.copy_(ref.roll(1, 0))  # noqa: E731  (rows swapped: an indexing bug)
    picked = _run(out, [right, wrong], {0: 2.0, 1: 1.0}, tuner, key=1)
    assert picked.id == 0
    (_, ms, why), = [r for r in tune.TIMINGS[("check", 1)] if r[0].id == 1]
    assert ms == float("inf") and "wrong result" in why


def test_rounding_level_differences_and_untouched_garbage_pass(tuner):
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(300, 64, generator=g)
    out = torch.full((400, 64), float("nan"), dtype=torch.bfloat16)  # rows 300+: nobody writes

    def first(o):
        o[:300] = ref.bfloat16()

    def second(o):  # another kernel: the same values rounded through a different path
        o[:300] = (ref * (1 + 3e-3 * torch.randn(300, 64, generator=g))).bfloat16()

    picked = _run(out, [first, second], {0: 2.0, 1: 1.0}, tuner, key=2)
    assert picked.id == 1


def test_mismatch_measure():
    a = torch.tensor([1.0, 2.0, float("nan"), 4.0])
    assert tune.output_mismatch((a,), (a.clone(),)) == 0.0
    assert tune.output_mismatch((a[:3],), (a,)) == float("inf")
    b = a.clone()
    b[2] = 5.0  # a NaN where the reference has a value, or the reverse: not finite
    assert tune.output_mismatch((a,), (b,)) == float("inf")
    c = a.clone()
    c[0] = 1.005
    assert 0 < tune.output_mismatch((c,), (a,)) < 1e-2


def test_relative_difference_for_quantized_outputs():
    """One e4m3 rounding step flipped at 1 of 1000 positions: output_mismatch (over the differing
    positions) calls it a 7% difference, relative_difference (over the tensor) ~0.2%; a wrong
    result stays large for both, and a NaN is infinite."""
    ref = torch.linspace(1.0, 2.0, 1000)
    got = ref.clone()
    got[500] *= 1.07
    assert tune.output_mismatch((got,), (ref,)) > 5e-2
    assert 0 < tune.relative_difference((got,), (ref,)) < 5e-3
    assert tune.relative_difference((ref * 1.2,), (ref,)) > 0.1
    got[3] = float("nan")
    assert tune.relative_difference((got,), (ref,)) == float("inf")
    assert tune.relative_difference((ref[:5],), (ref,)) == float("inf")


def test_tuned_is_the_pick_once_timed_and_none_otherwise(tuner, monkeypatch):
    """tune.tuned lets a wrapper skip building its candidates on later calls: None before the
    first pick_config of a key, that pick after, and None while tuning is off (where
    pick_config returns the table's untuned pick, not its first candidate)."""
    out = torch.zeros(8)
    write = lambda o: o.fill_(1.0)  # noqa: E731
    assert tune.tuned("check", 3) is None
    picked = _run(out, [write, write], {0: 2.0, 1: 1.0}, tuner, key=3)
    assert picked.id == 1 and tune.tuned("check", 3) is picked
    assert tune.tuned("check", 4) is None
    monkeypatch.setattr(tune, "_tuning_enabled", lambda: False)
    assert tune.tuned("check", 3) is None
    assert tune.pick_config(_stage("check", 2), 3, _problem, None).id == 0
    fast = _stage("check", 2, fast=True)
    assert fast.offer(*_problem()).candidates[0] == C(0)  # the reference comes first
    assert tune.pick_config(fast, 3, _problem, None) == Fast(2)


def test_a_candidate_builder_runs_only_until_a_pick_is_cached(tuner):
    """pick_config builds the table's offer (problem() included) for the first pick of a key,
    not once the pick is cached."""
    out = torch.zeros(8)
    tuner.update({0: 2.0, 1: 1.0})
    built = []
    stage = _stage("lazy", 2, built=built)

    def launch(cfg):
        return out.fill_(1.0)

    for _ in range(3):
        assert tune.pick_config(stage, 5, _problem, launch, outputs=lambda r: (r,)).id == 1
    assert len(built) == 1
