"""R expert-parallel ranks in ONE process ("loopback"): a test and measuring mode, never the default.

``run_ranks(R, fn, device)`` runs ``fn(rank_group)`` for r = 0..R-1, each in its own Python
thread, and returns their results in rank order. Only one thread runs at a time: a baton
(condition variable + turn) passes round-robin at every collective point, so the Triton CPU
interpreter (not thread-safe) and the host side stay deterministic. A rank runs until it reaches
a collective (``gather``: the exchange's barrier, the capacity's max), hands the baton to the
next rank, and resumes once all R ranks reached that point and the baton is back.

Each rank gets a ``LoopbackRank``: rank r of R over one shared ``LoopbackGroup``. Its
``group_name`` (``loopback:<id>:<rank>``) resolves back to that handle (``resolve``), so the
name can travel through the registered op as a real ProcessGroup's does. On CUDA each rank
thread runs on its own stream. ops/groups.py routes the EP code's group questions here;
ops/hopper/ep_transport.LoopbackExchange is the transport.
"""

from __future__ import annotations

import contextlib
import itertools
import threading

import torch

PREFIX = "loopback:"
TIMEOUT_S = 600.0
"""Longest a rank waits for the baton: a rank that skipped a collective shows as an error."""

_REGISTRY: dict = {}
_IDS = itertools.count()


class LoopbackError(RuntimeError):
    pass


class LoopbackGroup:
    """The state R loopback ranks share: the baton, the collectives' posts, close hooks."""

    def __init__(self, R: int):
        if R < 1:
            raise ValueError(f"loopback: R must be >= 1, got {R}")
        self.R = R
        self.id = next(_IDS)
        self._cv = threading.Condition()
        self._turn = 0
        self._done = [False] * R
        self._failed = None
        self._threads = [None] * R
        self._posts: dict = {}  # generation -> [value per rank]
        self._reads: dict = {}  # generation -> ranks that read it
        self._gen = [0] * R  # the next collective each rank reaches
        self._on_close = []
        self.ranks = [LoopbackRank(self, r) for r in range(R)]

    def on_close(self, fn) -> None:
        """Run ``fn`` when run_ranks ends (drops what was cached for this group's ranks)."""
        self._on_close.append(fn)

    def _next_turn(self, rank: int) -> int:
        for step in range(1, self.R + 1):
            r = (rank + step) % self.R
            if not self._done[r]:
                return r
        return rank

    def _wait(self, rank: int, ready) -> None:
        """Wait (holding the lock) until ``ready()`` and the baton is ``rank``'s."""
        ok = self._cv.wait_for(lambda: self._failed is not None
                               or (self._turn == rank and ready()), timeout=TIMEOUT_S)
        if self._failed is not None:
            raise LoopbackError(f"loopback rank {rank}: rank {self._failed} failed")
        if not ok:
            raise LoopbackError(f"loopback rank {rank}: no baton after {TIMEOUT_S:.0f} s; "
                                "a rank skipped a collective the others reached")

    def gather(self, rank: int, value) -> list:
        """Collective: every rank's ``value``, in rank order (the baton moves on meanwhile)."""
        self._check_thread(rank)
        with self._cv:
            gen = self._gen[rank]
            self._gen[rank] += 1
            posts = self._posts.setdefault(gen, [None] * self.R)
            posts[rank] = value
            if any(self._done):
                raise LoopbackError(f"loopback rank {rank}: reached collective #{gen} after "
                                    f"rank {self._done.index(True)} finished")
            self._turn = self._next_turn(rank)
            self._cv.notify_all()
            self._wait(rank, lambda: all(g > gen for g in self._gen))
            reads = self._reads[gen] = self._reads.get(gen, 0) + 1
            if reads == self.R:  # every rank has its copy
                del self._posts[gen], self._reads[gen]
            return list(posts)

    def _check_thread(self, rank: int) -> None:
        if self._threads[rank] is not threading.current_thread():
            raise LoopbackError(
                f"loopback rank {rank} of group {self.id} used from thread "
                f"{threading.current_thread().name!r}, not its rank thread (run_ranks); on "
                "CUDA, autograd runs a backward on its device thread: call the op's backward "
                "(torch.ops.megamoe.mega_moe_backward) inside the rank instead")

    def _run(self, rank: int, fn, stream, results: list) -> None:
        with self._cv:
            try:
                self._wait(rank, lambda: True)
            except LoopbackError:
                return
        try:
            with contextlib.ExitStack() as ctx:
                if stream is not None:  # a new thread starts on device 0's default stream
                    ctx.enter_context(torch.cuda.device(stream.device))
                    ctx.enter_context(torch.cuda.stream(stream))
                results[rank] = fn(self.ranks[rank])
        except BaseException as e:  # noqa: BLE001 (handed back to run_ranks)
            results[rank] = e
            with self._cv:
                if self._failed is None:
                    self._failed = rank
                self._cv.notify_all()
            return
        with self._cv:
            self._done[rank] = True
            waiting = [r for r in range(self.R) if self._gen[r] > self._gen[rank]]
            if waiting and self._failed is None:  # they would wait for this rank forever
                results[rank] = LoopbackError(
                    f"loopback rank {rank} finished after {self._gen[rank]} collectives while "
                    f"rank {waiting[0]} waits at collective #{self._gen[waiting[0]] - 1}")
                self._failed = rank
            self._turn = self._next_turn(rank)
            self._cv.notify_all()


class LoopbackRank:
    """Rank ``rank`` of a LoopbackGroup: what the EP code holds as its ``group``."""

    def __init__(self, shared: LoopbackGroup, rank: int):
        self.shared, self.rank, self.size = shared, rank, shared.R
        self.group_name = f"{PREFIX}{shared.id}:{rank}"

    def gather(self, value) -> list:
        return self.shared.gather(self.rank, value)

    def barrier(self) -> None:
        self.gather(None)

    def on_close(self, fn) -> None:
        self.shared.on_close(fn)

    def __repr__(self) -> str:
        return f"LoopbackRank({self.group_name}, R={self.size})"


def is_loopback(group) -> bool:
    return isinstance(group, LoopbackRank)


def resolve(group_name: str) -> LoopbackRank:
    """The rank handle a ``loopback:<id>:<rank>`` name stands for (only while its run_ranks runs)."""
    rank = _REGISTRY.get(group_name)
    if rank is None:
        raise LoopbackError(f"loopback group {group_name!r} is not running: its names resolve "
                            "only inside run_ranks")
    return rank


def run_ranks(R: int, fn, device=None) -> list:
    """``[fn(rank_group) for each rank]``, R ranks as threads taking turns (see the module's
    doc); on a CUDA ``device`` each rank runs on its own stream, which follows the caller's
    current stream, and the caller's stream waits for every rank's at the end. Re-raises the
    first rank's error."""
    group = LoopbackGroup(R)
    device = torch.device(device) if device is not None else torch.device("cpu")
    streams = [torch.cuda.Stream(device=device) if device.type == "cuda" else None
               for _ in range(R)]
    for s in streams:
        if s is not None:  # the inputs were made on the caller's stream
            s.wait_stream(torch.cuda.current_stream(device))
    results = [None] * R
    threads = [threading.Thread(target=group._run, args=(r, fn, streams[r], results),
                                name=f"loopback-{group.id}-rank{r}", daemon=True)
               for r in range(R)]
    group._threads = threads
    for h in group.ranks:
        _REGISTRY[h.group_name] = h
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for s in streams:
            if s is not None:  # the results are ready on the caller's stream, no host sync
                torch.cuda.current_stream(device).wait_stream(s)
        for h in group.ranks:
            _REGISTRY.pop(h.group_name, None)
        for close in group._on_close:
            close()
    if group._failed is not None:
        raise results[group._failed]
    return results
