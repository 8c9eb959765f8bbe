"""Token exchange between the ranks of an EP group: static shapes, no host sync.

Every rank owns receive buffers ``recv[name]`` of shape ``[R, C, W]``: region ``[s]`` is written
only by source rank ``s`` and holds up to C rows (C = capacity, tokens per rank). A sender
stores rows into ``send_region(d, name)`` (its region in rank d's buffer), then every rank calls
``exchange(names)``; afterwards ``recv[name]`` holds what each source stored. Three transports
implement that contract:

- ``SymmetricExchange`` (CUDA tensors, a group whose ranks share NVLink): the buffers are
  PyTorch symmetric memory (CUDA backend), ``send_region`` IS the peer GPU's buffer, so a
  kernel's stores travel over NVLink straight into it, and ``exchange`` is the device-side
  symmetric-memory barrier (release/acquire across the group, launched on the current stream,
  no host round trip). Overlapped sends run on a side stream (``run_async``) and tell each
  peer their rows are there with a point-to-point signal (``signal`` / ``wait_from``: the
  symmetric memory's signal pads, channel 2).
- ``AllToAllExchange`` (any backend, e.g. gloo on CPU): ``send_region`` is a local staging
  buffer and ``exchange`` is one ``all_to_all_single`` per name with equal, static splits (so
  no split sizes cross the host either). Whole regions travel; it is the portable fallback
  and the path the CPU tests run.
- ``LoopbackExchange`` (R loopback ranks in one process, ops/loopback.py: a test and measuring
  mode): every rank's buffers are ordinary tensors all ranks see, ``send_region`` IS the
  peer's region, and ``exchange`` is the group barrier: on CUDA each rank records an event on
  its stream and waits on every rank's (device-side ordering, no host sync), on CPU a plain
  barrier. It overlaps on CUDA as the symmetric transport does; a signal is an event the
  receiver's stream waits on.

One exchange object per (group, device, capacity, row widths, dtype) is cached and shared by
every layer and by forward and backward: layers run one after another on one stream, and each
call's own barriers order its reads of ``recv`` before any peer's next stores (see
ep_dispatch.py for the protocol).

Capacity. C is fixed when the exchange is created: ``max_tokens_per_rank`` if set
(MegaMoEOptions.max_tokens_per_rank, the ``[megamoe] max_tokens_per_rank`` knob), else the largest
token count any rank of the group brings to that first call (agreed with one all_reduce, once).
Symmetric buffers must have the same size on every rank, so C cannot grow later: a call with
more tokens raises, naming the knob. A receive region holds a source's whole batch, so no
routing can overflow it: nothing is ever dropped or written out of bounds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchtitan_megamoe import settings
from torchtitan_megamoe.ops import loopback
from torchtitan_megamoe.ops.groups import all_reduce_max, group_rank, group_size
from torchtitan_megamoe.ops.hopper.kernels.ep_pace import pace
from torchtitan_megamoe.ops.options import capacity_error

_CACHE: dict = {}
SIGNAL_CHANNEL = 2
"""Symmetric-memory signal channel of ``signal`` / ``wait_from`` (the barriers use 0)."""


def symmetric_memory_usable(device: torch.device, group) -> bool:
    """Whether the symmetric-memory transport applies: CUDA tensors and an NCCL group."""
    if device.type != "cuda":
        return False
    try:
        # TorchTitan may init "cuda:nccl,cpu:gloo"; CUDA tensors then go through NCCL.
        return "nccl" in str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return False


class Exchange:
    """Receive buffers [R, C, W] per name plus the transport-specific send side."""

    def __init__(self, group, capacity: int, widths: dict, device: torch.device):
        self.group = group
        self.R = group_size(group)
        self.rank = group_rank(group)
        self.capacity = capacity
        self.widths = widths  # name -> (W, dtype)
        self.device = device

    def check_tokens(self, T: int) -> None:
        if T > self.capacity:  # fixed when it was created: symmetric buffers cannot grow
            raise capacity_error(T, self.capacity)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.recv.values())

    def pace(self, rows: torch.Tensor, row_bytes: int, transfer: str) -> None:
        """After a copy of ``rows`` (device count) rows of ``row_bytes`` into a peer (part of
        ``transfer``): wait, on this stream, as long as the emulated link would take (loopback
        only; else nothing)."""


class _SideStream(Exchange):
    """Transfers can run on a side stream (``run_async``) under the compute."""

    overlaps = True

    def _side_stream(self) -> torch.cuda.Stream:
        if not hasattr(self, "_side"):
            self._side = torch.cuda.Stream(device=self.device)
        return self._side

    def run_async(self, fn) -> torch.cuda.Event:
        """Run ``fn`` (kernels / copies into peers' regions, ``signal``s) on a side stream after
        what the current stream has issued so far. Returns the event the current stream must
        wait on before reusing fn's inputs.

        The side stream waits on this rank's own current stream, and its signals (channel 2) on a
        peer only until that peer consumed this rank's previous signal, which it did before the
        previous call's last barrier: it cannot deadlock with the barriers the current stream
        runs (channel 0) at the same time."""
        side = self._side_stream()
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()
            done = torch.cuda.Event()
            done.record(side)
        return done

    def signal(self, d: int) -> None:
        """Tell rank d that what this stream stored into its regions so far is there (one
        signal per peer and call, on channel 2; rank d consumes it with ``wait_from``)."""
        raise NotImplementedError

    def wait_from(self, s: int) -> None:
        """The current stream waits for rank s's ``signal`` to this rank (then reads what s
        stored before it)."""
        raise NotImplementedError


class SymmetricExchange(_SideStream):
    """PyTorch symmetric memory over NVLink (see the module's doc)."""

    def __init__(self, group, capacity, widths, device):
        super().__init__(group, capacity, widths, device)
        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "get_backend") and symm_mem.get_backend(device) is None:
            # The CUDA backend (CUDA IPC + NVLink) is the one validated on Hopper;
            # NVSHMEM failed there. The backend can only be chosen before the first allocation.
            try:
                symm_mem.set_backend("CUDA")
            except RuntimeError:
                pass
        self.recv, self._handles = {}, {}
        for name, (W, dtype) in widths.items():
            buf = symm_mem.empty((self.R, capacity, W), dtype=dtype, device=device)
            self._handles[name] = symm_mem.rendezvous(buf, group)
            self.recv[name] = buf
        self._peer = {
            (d, name): self._handles[name].get_buffer(d, (self.R, capacity, W), dtype)[self.rank]
            for name, (W, dtype) in widths.items()
            for d in range(self.R)
        }
        self._barrier_handle = next(iter(self._handles.values()))
        # every device-side wait is bounded: past it symmetric memory's wait kernel fails (a
        # CUDA error), so a peer that never arrives cannot hang the job
        self._timeout_ms = settings.exchange_timeout_ms()

    def send_region(self, d: int, name: str) -> torch.Tensor:
        return self._peer[(d, name)]

    def exchange(self, names) -> None:
        self._barrier_handle.barrier(channel=0, timeout_ms=self._timeout_ms)

    def signal(self, d: int) -> None:
        self._barrier_handle.put_signal(d, channel=SIGNAL_CHANNEL, timeout_ms=self._timeout_ms)

    def wait_from(self, s: int) -> None:
        self._barrier_handle.wait_signal(s, channel=SIGNAL_CHANNEL, timeout_ms=self._timeout_ms)


class LoopbackExchange(_SideStream):
    """The symmetric transport's contract among loopback ranks (ops/loopback.py): each rank
    allocates its own buffers, the ranks swap them at one rendezvous, and a peer's region is a
    view of the peer's buffer."""

    def __init__(self, group, capacity, widths, device):
        super().__init__(group, capacity, widths, device)
        self.overlaps = device.type == "cuda"  # CPU: one thread runs at a time, steps in order
        self.recv = {n: torch.empty((self.R, capacity, W), dtype=dt, device=device)
                     for n, (W, dt) in widths.items()}
        every = group.gather(self.recv)
        self._peer = {(d, n): every[d][n][self.rank] for n in widths for d in range(self.R)}
        # R ranks share the one GPU, so a rank's compute runs ~R times slower than on its own
        # GPU: its link is paced R times slower too, keeping transfer / compute as on a node
        gbs = settings.loopback_link_gbs() if self.overlaps else 0.0
        self._ns_per_byte = self.R / gbs if gbs else 0.0
        self._paced = settings.loopback_paced_transfers()  # None: every transfer
        # signal(d) posts an event here, at [d]; every rank sees every rank's outbox
        self._outbox: list = [None] * self.R
        self._outboxes = group.gather(self._outbox)

    def send_region(self, d: int, name: str) -> torch.Tensor:
        return self._peer[(d, name)]

    def _barrier(self, stream) -> None:
        if stream is None:
            self.group.barrier()
            return
        # what this stream issued so far, then every rank's: ordering on the device only
        mine = torch.cuda.Event()
        mine.record(stream)
        for ev in self.group.gather(mine):
            stream.wait_event(ev)

    def exchange(self, names) -> None:
        self._barrier(torch.cuda.current_stream(self.device) if self.overlaps else None)

    def pace(self, rows: torch.Tensor, row_bytes: int, transfer: str) -> None:
        if self._ns_per_byte and (self._paced is None or transfer in self._paced):
            pace(rows, row_bytes * self._ns_per_byte)

    def signal(self, d: int) -> None:
        # a fresh event per signal: the receiver waits on this record, not a later call's
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._outbox[d] = ev

    def wait_from(self, s: int) -> None:
        ev = self._outboxes[s][self.rank]
        if ev is None:  # a rank signals before the collective the receiver waits after
            raise RuntimeError(f"loopback rank {self.rank}: no signal from rank {s} yet")
        torch.cuda.current_stream(self.device).wait_event(ev)
        self._outboxes[s][self.rank] = None  # consumed, as symmetric memory's signal is


class AllToAllExchange(Exchange):
    overlaps = False

    def __init__(self, group, capacity, widths, device):
        super().__init__(group, capacity, widths, device)
        self.recv = {n: torch.empty((self.R, capacity, W), dtype=dt, device=device)
                     for n, (W, dt) in widths.items()}
        self._send = {n: torch.empty_like(t) for n, t in self.recv.items()}

    def send_region(self, d: int, name: str) -> torch.Tensor:
        return self._send[name][d]

    def exchange(self, names) -> None:
        for n in names:
            dist.all_to_all_single(self.recv[n].view(self.R, -1), self._send[n].view(self.R, -1),
                                   group=self.group)


def _transport(device, group) -> type:
    if loopback.is_loopback(group):
        return LoopbackExchange
    return SymmetricExchange if symmetric_memory_usable(device, group) else AllToAllExchange


def capacity_hint(group, T: int, max_tokens_per_rank: int = 0) -> int:
    """The capacity a call with T tokens will see, without communicating (fake impls): the
    group's existing exchange's, else ``max_tokens_per_rank``, else T (ranks of one TorchTitan
    job bring equal batches, so the group's largest is this rank's)."""
    for ex in _CACHE.values():
        if ex.group is group or ex.group.group_name == group.group_name:
            return ex.capacity
    return max(max_tokens_per_rank or T, 1)


def get_exchange(group, T: int, widths: dict, device: torch.device,
                 max_tokens_per_rank: int = 0) -> Exchange:
    """The group's cached exchange for these row widths (created collectively on first use,
    with capacity ``max_tokens_per_rank``, or 0: the group's largest T of this call)."""
    key = (group.group_name, str(device), tuple(sorted((n, w, str(dt))
                                                        for n, (w, dt) in widths.items())))
    ex = _CACHE.get(key)
    if ex is None:
        capacity = max_tokens_per_rank
        if capacity == 0:
            # One host sync, once per group and shape: the buffers must be the same size on
            # every rank.
            capacity = all_reduce_max(group, T, device)
        capacity = max(capacity, 1)
        ex = _CACHE[key] = _transport(device, group)(group, capacity, widths, device)
        if loopback.is_loopback(group):
            group.on_close(lambda: _CACHE.pop(key, None))  # its buffers go with its ranks
    ex.check_tokens(T)
    return ex


def exchange_nbytes(group, dim: int) -> int:
    """Bytes of the group's exchange buffers for token rows of width ``dim`` (symmetric or
    staging memory: outside the caching allocator, so max_memory_allocated does not see it)."""
    return sum(ex.nbytes() for ex in _CACHE.values()
               if ex.group is group and ex.widths["x"][0] == dim)
