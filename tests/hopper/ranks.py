"""Run a test worker on several processes and collect what each rank saved."""

import os
import tempfile

import torch
import torch.multiprocessing as mp


def run_ranks(worker, nprocs: int, *args) -> list:
    """Spawn ``worker(rank, *args, init_file, result_file)`` on ``nprocs`` processes (init_file
    for ``init_method="file://..."``; each rank torch.saves its result to
    ``f"{result_file}.{rank}"``) and return the results in rank order."""
    with tempfile.TemporaryDirectory() as d:
        result = os.path.join(d, "result")
        mp.spawn(worker, args=(*args, os.path.join(d, "init"), result), nprocs=nprocs, join=True)
        return [torch.load(f"{result}.{r}") for r in range(nprocs)]
