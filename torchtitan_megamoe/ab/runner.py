"""Running TorchTitan: ``torchrun -m torchtitan.train`` with its environment, a log file and a
timeout that ends torchrun and every worker."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from torchtitan_megamoe.ab.failures import RANK_LOGS

_LIVE: set = set()  # torchrun processes run_one started and still waits on
_LIVE_LOCK = threading.Lock()


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def run_env(out: str) -> dict[str, str]:
    from torchtitan_megamoe.assets import offline_env

    env = dict(os.environ)
    if "PYTORCH_ALLOC_CONF" not in env and "PYTORCH_CUDA_ALLOC_CONF" not in env:
        # what TorchTitan's own launcher (run_train.sh) sets for every run: without it the
        # caching allocator's fragmentation, not the live tensors, decides the peak compared
        env["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    if not _cuda_available():
        env.setdefault("MEGAMOE_CPU", "1")
        # Keep the dataset's Arrow cache out of the user's HF cache, and never touch the network.
        for k, v in offline_env(os.path.join(out, "hf_home")).items():
            env.setdefault(k, v)
    return env


def torchrun_command(config_path: str, nproc: int, dump: str, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        # a rendezvous store on a port the OS picks (localhost:0), which the workers share as
        # their MASTER_PORT: concurrent runs (ab --jobs J) cannot collide on a port
        "--standalone",
        f"--nproc_per_node={nproc}",
        "--local-ranks-filter=0",
        # every rank's output also in <dump>/ranks/: the log keeps rank 0's, a failure needs all
        "--log-dir",
        os.path.join(dump, RANK_LOGS),
        "--tee",
        "3",
        "-m",
        "torchtitan.train",
        "--job.config_file",
        config_path,
        "--job.dump_folder",
        dump,
        *extra,
    ]


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) from Linux /proc; empty elsewhere."""
    table = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            table[int(entry)] = (int(fields[1]), fields[19])
        except (OSError, ValueError, IndexError):
            continue
    return table


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of every process below ``pid``."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for p, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(p)
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append((c, table[c][1]))
            todo.append(c)
    return out


def _kill_group(proc: subprocess.Popen) -> None:
    # SIGTERM lets torchrun stop its workers. Each worker runs in a session of its own, so a
    # signal to torchrun's group does not reach them: whatever is still alive after the grace
    # period is killed by pid (checked against its start time), so that no worker keeps holding
    # the GPUs and NCCL ports into the next run.
    import signal

    workers = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    if proc.poll() is None:
        proc.kill()
    table = _proc_table()
    for pid, started in workers:
        if pid in table and table[pid][1] == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()


def run_one(cmd: list[str], log_path: str, env: dict[str, str], timeout: float) -> int:
    with open(log_path, "w") as log:
        # Own session: a timeout (or an interrupted ab) ends torchrun and all its workers.
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        with _LIVE_LOCK:
            _LIVE.add(proc)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            log.write(f"\n[megamoe.ab] timed out after {timeout:.0f} s\n")
            return 124
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            with _LIVE_LOCK:
                _LIVE.discard(proc)


def stop_all() -> None:
    """Stop every torchrun that ``run_one`` started and still waits on (other threads' runs,
    ``ab --jobs J``), with all their workers; for an interrupted ab."""
    with _LIVE_LOCK:
        procs = list(_LIVE)
    threads = [threading.Thread(target=_kill_group, args=(p,), daemon=True) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
