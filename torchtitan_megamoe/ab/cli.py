"""Command line of the A/B tool (``python -m torchtitan_megamoe.ab``)."""

from __future__ import annotations

import argparse
import os
import sys

from torchtitan_megamoe.ab.comparison import DEFAULT_ATOL, DEFAULT_RTOL
from torchtitan_megamoe.ab.configs import DEFAULT_CONFIG, parse_sides
from torchtitan_megamoe.ab.driver import run_ab
from torchtitan_megamoe.ab.report import require_matplotlib
from torchtitan_megamoe.ab.stats import DEFAULT_ALPHA, DEFAULT_GAP_LIMIT, DEFAULT_WINDOW

_SIDE_ARGS = ("--a-args", "--b-args", "--side-args")


def _glue_side_args(argv: list[str]) -> list[str]:
    # "--a-args '--compile.enable'": argparse would take the value for an option of its own.
    out, i = [], 0
    while i < len(argv):
        if argv[i] in _SIDE_ARGS and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_megamoe.ab",
        description="Train one TorchTitan config stock and with the megamoe converter (or two "
                    "or more other sides, --sides); compare.",
        epilog="Arguments after -- go to torchtitan.train in every run. Multi-seed "
               "(--seeds N): see torchtitan_megamoe/ab/stats.py for the statistics and the "
               "verdict's rule.",
    )
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"TOML (default {DEFAULT_CONFIG})")
    p.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per run (default 1)")
    p.add_argument("--out", default="outputs/ab", help="output dir (default outputs/ab)")
    p.add_argument("--rtol", type=float, default=DEFAULT_RTOL, help="relative loss tolerance")
    p.add_argument("--atol", type=float, default=DEFAULT_ATOL, help="absolute loss tolerance")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--profile-step", type=int, default=None, metavar="N",
                   help="trace step N (>= 4) of both runs with TorchTitan's profiler; the report "
                        "gains their kernel time by category (GPU runs; with --seeds, the first "
                        "seed's runs)")
    p.add_argument("--memory-snapshot", action="store_true",
                   help="with --profile-step N: record the allocator's history and report "
                        "what is alive at step N's memory peak in each run (GPU runs; the "
                        "recording slows every step, so the runs' timings are not their speed)")
    g = p.add_argument_group("sides")
    g.add_argument("--sides", default="stock,megamoe", metavar="A,B[,C...]",
                   help="two or more sides, each KIND or LABEL=KIND with KIND stock (no "
                        "converter) or megamoe (the converter); LABEL names its files and column "
                        "(default stock,megamoe), e.g. fp8=megamoe,bf16=megamoe or "
                        "stock,bf16=megamoe,fp8=megamoe,fp8_bwd=megamoe")
    g.add_argument("--a-args", default="", metavar="'ARGS'",
                   help="TorchTitan args of the first side only, one quoted string, after the "
                        "common ones, e.g. --a-args '--megamoe.precision fp8'")
    g.add_argument("--b-args", default="", metavar="'ARGS'",
                   help="likewise for the second side")
    g.add_argument("--side-args", action="append", default=[], metavar="'LABEL=ARGS'",
                   help="TorchTitan args of the side LABEL, one quoted string (repeat for more "
                        "sides), e.g. --side-args 'fp8=--megamoe.precision fp8 "
                        "--megamoe.save_activations never'")
    g.add_argument("--baseline", default=None, metavar="LABEL",
                   help="the side every other side is compared against, each with its own "
                        "report and verdict (default the first side: B - A with two)")
    r = p.add_argument_group("scheduling")
    r.add_argument("--jobs", type=int, default=1, metavar="J",
                   help="run up to J trainings at the same time on the same GPUs (default 1); "
                        "each has its own dir, log and rendezvous port; their start-up and "
                        "compile overlap other runs' steps. Tokens/s and step times of "
                        "overlapping runs are reported as n/c (not comparable)")
    r.add_argument("--deadline-s", type=float, default=None, metavar="S",
                   help="S seconds after the start no run starts, and runs still going are "
                        "stopped (their timeouts end there); the report is written from the "
                        "runs finished and lists the missing ones. Leave ~40 s for that "
                        "under a hard limit")
    r.add_argument("--min-run-s", type=float, default=0.0, metavar="S",
                   help="with --deadline-s: start no run with less than S seconds left "
                        "(default 0)")
    s = p.add_argument_group(
        "seeds", "train every side from N seeds and judge the final-window mean losses")
    s.add_argument("--seeds", type=int, default=None, metavar="N",
                   help="seeds per side (TorchTitan's --debug.seed); without it, one A/B at "
                        "the config's seed, judged step by step within --rtol/--atol")
    s.add_argument("--seed-base", type=int, default=None, metavar="S",
                   help="the seeds are S, S+1, ..., S+N-1 (default the config's [debug] seed, "
                        "else 0)")
    s.add_argument("--window", type=int, default=DEFAULT_WINDOW, metavar="W",
                   help=f"final window: the last W steps (default {DEFAULT_WINDOW})")
    s.add_argument("--alpha", type=float, default=DEFAULT_ALPHA,
                   help=f"level of the paired t-test of the verdict (default {DEFAULT_ALPHA})")
    s.add_argument("--gap-limit", type=float, default=DEFAULT_GAP_LIMIT, metavar="R",
                   help="relative gap reported as within / beyond the goal (default "
                        f"{DEFAULT_GAP_LIMIT}: 1%%)")
    s.add_argument("--analyze", action="store_true",
                   help="train nothing: read the seed<S>/<label>.log files already in --out "
                        "(the same command without --analyze wrote them, e.g. one seed per "
                        "call) and write the same report")
    args = p.parse_args(_glue_side_args(argv))
    try:
        sides = parse_sides(args.sides, args.a_args, args.b_args, args.side_args)
        from torchtitan_megamoe.ab.configs import baseline_index

        baseline_index(sides, args.baseline)
    except ValueError as e:
        p.error(str(e))
    try:
        require_matplotlib()
    except ModuleNotFoundError as e:
        p.error(str(e))
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    seed_only = [o for o, v in (("--seed-base", args.seed_base is not None),
                                ("--analyze", args.analyze)) if v]
    if args.seeds is None and seed_only:
        p.error(f"{', '.join(seed_only)} need --seeds N")
    if args.memory_snapshot:
        if args.profile_step is None or args.seeds is not None:
            p.error("--memory-snapshot needs --profile-step N (the step it dumps) and no --seeds")
        from torchtitan_megamoe.ab.memory import snapshot_args

        extra = list(extra) + snapshot_args()
    # A SIGTERM (e.g. from `timeout`) becomes SystemExit, so the running torchrun is stopped too.
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.seeds is None:
        res = run_ab(args.config, args.nproc, args.out, extra, args.rtol, args.atol,
                     args.timeout, args.profile_step, sides, args.baseline, args.jobs,
                     args.deadline_s, args.min_run_s)
        code = res.exit_code
    else:
        from torchtitan_megamoe.ab.seeds import run_seeds

        code = run_seeds(
            args.config, args.nproc, args.out, extra, args.seeds, sides, args.window,
            args.alpha, args.gap_limit, args.rtol, args.atol, args.timeout, args.profile_step,
            train=not args.analyze, seed_base=args.seed_base, baseline=args.baseline,
            jobs=args.jobs, deadline_s=args.deadline_s, min_run_s=args.min_run_s,
        ).exit_code
    with open(os.path.join(args.out, "report.md")) as f:
        print(f.read())
    return code
