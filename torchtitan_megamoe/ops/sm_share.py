"""SMs a persistent GEMM leaves free for a kernel that runs beside it on another stream.

The EP forward returns the peers' partial rows (a combine whose stores cross NVLink, bound by
the link, not by the SMs) while GEMM 2 of the own tokens runs. Two kernels on two streams do
not share SMs by themselves: whichever the block scheduler starts first takes every SM, since a
persistent GEMM CTA fills an SM (registers and shared memory) and keeps it until the GEMM ends.
Measured on 2 H200s (docs/PERF.md, 2026-11-30): the return combine ran alone for 194 us between
the two GEMM 2 launches. Inside ``leave_sms(n)`` the persistent launches (csrc/ kernels and the
Triton persistent candidates) start n CTAs fewer, so n SMs stay free for the other stream's
kernel whatever the launch order; the GEMMs take their tiles from a global ticket (or stride
over their programs), so fewer CTAs only means fewer tiles in flight.
"""

from __future__ import annotations

import contextlib

_LEFT = 0


@contextlib.contextmanager
def leave_sms(n: int):
    """Persistent launches inside leave ``n`` SMs of the device free."""
    global _LEFT
    old, _LEFT = _LEFT, max(0, int(n))
    try:
        yield
    finally:
        _LEFT = old


def persistent_ctas(num_sms: int) -> int:
    """CTAs of a one-per-SM persistent launch on a device of ``num_sms`` SMs."""
    return max(1, num_sms - _LEFT)
