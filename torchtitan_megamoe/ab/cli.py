"""Command line of the A/B tool (``python -m torchtitan_megamoe.ab``)."""

from __future__ import annotations

import argparse
import os
import sys

from torchtitan_megamoe.ab.comparison import DEFAULT_ATOL, DEFAULT_RTOL
from torchtitan_megamoe.ab.configs import DEFAULT_CONFIG
from torchtitan_megamoe.ab.driver import run_ab


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_megamoe.ab",
        description="Train one TorchTitan config stock and with the megamoe converter; compare.",
        epilog="Arguments after -- go to torchtitan.train in both runs.",
    )
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"TOML (default {DEFAULT_CONFIG})")
    p.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per run (default 1)")
    p.add_argument("--out", default="outputs/ab", help="output dir (default outputs/ab)")
    p.add_argument("--rtol", type=float, default=DEFAULT_RTOL, help="relative loss tolerance")
    p.add_argument("--atol", type=float, default=DEFAULT_ATOL, help="absolute loss tolerance")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--profile-step", type=int, default=None, metavar="N",
                   help="trace step N (>= 4) of both runs with TorchTitan's profiler; the report "
                        "gains their kernel time by category (GPU runs)")
    args = p.parse_args(argv)
    # A SIGTERM (e.g. from `timeout`) becomes SystemExit, so the running torchrun is stopped too.
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    res = run_ab(args.config, args.nproc, args.out, extra, args.rtol, args.atol, args.timeout,
                 args.profile_step)
    with open(os.path.join(args.out, "report.md")) as f:
        print(f.read())
    return res.exit_code
