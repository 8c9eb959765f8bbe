"""timing.py's device busy time: the union of kernel intervals, host gaps left out."""

import time

import pytest
import torch

from torchtitan_megamoe.timing import gpu_busy_ms, graphed_ms


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case")
def test_gpu_busy_without_a_device_is_zero():
    calls = []
    assert gpu_busy_ms(lambda: calls.append(1)) == (0.0, 0.0) and calls == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_busy_leaves_out_host_gaps_and_counts_overlap_once():
    a = torch.randn(4096, 4096, device="cuda")

    def work():
        a @ a
        time.sleep(0.05)  # the device idles: not busy
        a @ a

    busy, kernels = gpu_busy_ms(work)
    assert kernels == 2 and 0 < busy < 20
    side = torch.cuda.Stream()

    def two_streams():  # the same two GEMMs, concurrent on two streams
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            a @ a
        a @ a
        torch.cuda.current_stream().wait_stream(side)

    both, _ = gpu_busy_ms(two_streams)
    assert both <= busy * 1.05


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case")
def test_graphed_without_a_device_says_why():
    assert graphed_ms(lambda: None, 1) == (None, "no CUDA")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graphed_replays_the_captured_work_and_reports_a_failed_capture():
    a = torch.randn(2048, 2048, device="cuda")
    ms, err = graphed_ms(lambda: a @ a, 3)
    assert err is None and ms > 0
    ms, err = graphed_ms(lambda: a.sum().item(), 3)  # a host sync cannot be captured
    assert ms is None and err


def test_a_failed_capture_names_the_line_of_ours_that_raised():
    from torchtitan_megamoe.ops.loopback import LoopbackGroup
    from torchtitan_megamoe.timing import _where

    with pytest.raises(ValueError) as err:
        LoopbackGroup(0)
    where = _where(err.value)
    assert where.startswith(" at ops/loopback.py:") and "__init__" in where, where
    assert _where(ValueError("raised outside the package")) == ""
