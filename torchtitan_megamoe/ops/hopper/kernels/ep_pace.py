"""A link's transfer time on a stream: one program spins until ``count`` rows of ``ns_per_row``
each have "travelled" (the GPU's global timer), the loopback transport's emulation of a slower
link (ep_transport.LoopbackExchange with MEGAMOE_LOOPBACK_LINK_GBS). Launched on the side stream
right after the rows' copy, so what waits for the transfer (a signal, the barrier) waits for the
paced time; one SM is busy meanwhile, as SM stores over NVLink keep SMs busy.
Waits on: nothing inside the launch. Signals: nothing. CUDA only (the global timer)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _pace_kernel(count_ptr, ns_per_row):
    n = tl.load(count_ptr).to(tl.int64)
    start = tl.extra.cuda.globaltimer()
    until = start + (n.to(tl.float64) * ns_per_row).to(tl.int64)
    now = start
    while now < until:
        now = tl.extra.cuda.globaltimer()


def pace(count: torch.Tensor, ns_per_row: float) -> None:
    """Spin on the current stream for count[0] * ns_per_row nanoseconds (count: a 1-element
    int32 device tensor, the rows moved)."""
    _pace_kernel[(1,)](count, float(ns_per_row), num_warps=1)
