"""Running an A/B's trainings: one at a time, or up to ``jobs`` at once on the same GPUs, each
within its timeout and all within a deadline.

``run_all`` starts the runs in the order given (seed by seed, side by side), at most ``jobs`` at
a time. Concurrent runs compare losses, not speed: their point is that one run's start-up
(process start, model init, torch.compile, the FP8 kernels' JIT) overlaps other runs' steps.
They do not collide: each has its own TOML, log and dump folder (``<dir>/<label>.toml``,
``.log``, ``<label>/``), and ``torchrun --standalone`` gives each its own rendezvous store on a
port the OS picks (runner.torchrun_command). Tokens/s and step times of a run that overlapped
another are not comparable; each record says whether it overlapped (``overlapped``) and the
reports print those numbers as ``n/c``.

Deadline (``deadline_s``, seconds from ``t0``): no run starts after it, or when less than
``min_run_s`` is left before it; a run's timeout is cut to end at the deadline, so every run is
over by then (plus the ~20 s runner._kill_group gives a stopped torchrun) and the report can be
written from the runs that finished. The records say which runs are missing and why.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import asdict, dataclass

OK = "ok"
FAILED = "failed"
TIMED_OUT = "timed out"
STOPPED = "stopped at the deadline"
NOT_STARTED = "not started (deadline)"
MISSING = "missing (no log)"


@dataclass
class RunSpec:
    key: str  # "seed11/fp8", or the label without seeds
    label: str
    seed: int | None
    cmd: list[str]
    log_path: str


@dataclass
class RunRecord:
    key: str
    label: str
    seed: int | None
    log_path: str
    status: str = NOT_STARTED  # OK, FAILED, TIMED_OUT, STOPPED, NOT_STARTED, MISSING
    code: int | None = None  # torchrun's exit status; None: never ran
    start_s: float | None = None  # seconds after t0
    end_s: float | None = None
    timeout_s: float | None = None  # the timeout it ran under (cut at the deadline)
    jobs: int = 1
    overlapped: bool = False  # another run of the same invocation ran at the same time

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def wall_s(self) -> float | None:
        if self.start_s is None or self.end_s is None:
            return None
        return self.end_s - self.start_s

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RunRecord:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})


def status_of(code: int | None, timeout_s: float | None, timeout: float) -> str:
    if code is None:
        return NOT_STARTED
    if code == 0:
        return OK
    if code == 124:
        return STOPPED if timeout_s is not None and timeout_s < timeout else TIMED_OUT
    return FAILED


def mark_overlaps(records: list[RunRecord]) -> None:
    """``overlapped`` for each record whose run shared time with another's."""
    ran = [r for r in records if r.start_s is not None and r.end_s is not None]
    for r in ran:
        r.overlapped = any(o is not r and o.start_s < r.end_s and r.start_s < o.end_s
                           for o in ran)


def run_all(
    specs: list[RunSpec],
    run_one,
    env: dict[str, str] | None,
    timeout: float,
    jobs: int = 1,
    deadline_s: float | None = None,
    min_run_s: float = 0.0,
    t0: float | None = None,
    clock=None,
    log=None,
) -> list[RunRecord]:
    """Run ``specs`` (``run_one(cmd, log_path, env, timeout) -> exit status``, runner.run_one),
    at most ``jobs`` at once; one record per spec, in the specs' order. With ``jobs == 1`` the
    runs go one after the other in this thread (an interrupt reaches the running torchrun
    directly); with more, each runs in a thread of its own and an interrupt stops them all
    (runner.stop_all)."""
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    clock = clock or time.monotonic
    log = log or (lambda msg: print(msg, flush=True))
    t0 = clock() if t0 is None else t0
    deadline = math.inf if deadline_s is None else t0 + deadline_s
    records = [RunRecord(s.key, s.label, s.seed, s.log_path, jobs=jobs) for s in specs]
    lock = threading.Condition()
    running: dict[int, threading.Thread] = {}
    errors: list[BaseException] = []

    def _start_ok(i: int) -> float | None:
        """The timeout run i gets, or None when the deadline leaves it too little."""
        left = deadline - clock()
        if left <= 0 or left < min_run_s:
            return None
        return min(timeout, left)

    def _run(i: int, t: float) -> None:
        spec, rec = specs[i], records[i]
        code = None
        try:
            code = run_one(spec.cmd, spec.log_path, env, t)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)
        finally:
            rec.end_s = clock() - t0
            rec.code = code if code is not None else 1
            rec.status = status_of(rec.code, t, timeout)
            log(f"[megamoe.ab] {spec.key}: exit {rec.code} in {rec.wall_s:.1f} s"
                + ("" if rec.status in (OK, FAILED) else f" ({rec.status})")
                + f", log {spec.log_path}")
            with lock:
                running.pop(i, None)
                lock.notify_all()

    def _begin(i: int, t: float) -> None:
        rec = records[i]
        rec.start_s, rec.timeout_s = clock() - t0, t
        log(f"[megamoe.ab] start {specs[i].key} ({rec.start_s:.0f} s after the start, "
            f"timeout {t:.0f} s{f', {len(running) + 1} running' if jobs > 1 else ''})")

    if jobs == 1:
        for i in range(len(specs)):
            t = _start_ok(i)
            if t is None:
                break
            _begin(i, t)
            _run(i, t)
            if errors:
                raise errors[0]
    else:
        from torchtitan_megamoe.ab import runner

        todo = list(range(len(specs)))
        try:
            with lock:
                while todo or running:
                    while todo and len(running) < jobs and not errors:
                        t = _start_ok(todo[0])
                        if t is None:
                            todo = []
                            break
                        i = todo.pop(0)
                        _begin(i, t)
                        th = threading.Thread(target=_run, args=(i, t), daemon=True,
                                              name=f"ab-{specs[i].key}")
                        running[i] = th
                        th.start()
                    if errors:
                        todo = []
                    if not running:
                        break
                    lock.wait(timeout=1.0)
        except BaseException:
            runner.stop_all()
            raise
        if errors:
            raise errors[0]
    for rec in records:
        if rec.code is None:
            rec.status = NOT_STARTED
    mark_overlaps(records)
    missing = [r.key for r in records if r.status == NOT_STARTED]
    if missing:
        log(f"[megamoe.ab] not started (deadline {deadline_s:g} s): {', '.join(missing)}")
    return records
