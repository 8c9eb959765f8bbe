"""A/B run: the same TorchTitan config trained stock and with the ``megamoe`` converter.

    python -m torchtitan_megamoe.ab [--config X.toml] [--nproc N] [--out DIR] [--rtol R]
        [--atol A] [--timeout S] [--profile-step N [--memory-snapshot]] [--sides A,B[,C...]]
        [--a-args 'ARGS']
        [--b-args 'ARGS'] [--side-args 'LABEL=ARGS' ...] [--baseline LABEL] [--jobs J]
        [--deadline-s S [--min-run-s S]]
        [--seeds N [--seed-base S] [--window W] [--alpha P] [--gap-limit R] [--analyze]]
        [-- <extra torchtitan args, given to every run>]

e.g. ``python -m torchtitan_megamoe.ab --nproc 2 -- --parallelism.expert_parallel_degree 2``.

Sides (``--sides``, default ``stock,megamoe``): two or more, each ``KIND`` or ``LABEL=KIND``,
KIND ``stock`` (the config without the converter) or ``megamoe`` (with it); ``--a-args`` /
``--b-args`` add TorchTitan arguments to the first / second side, ``--side-args 'LABEL=ARGS'``
(repeatable) to any side by label, e.g. fp8 against bf16, both ours: ``--sides
fp8=megamoe,bf16=megamoe --a-args '--megamoe.precision fp8' --b-args '--megamoe.precision
bf16'``. The label names the side's files and its column. Every side but the baseline
(``--baseline LABEL``, default the first side) is compared against it, each comparison with
its own statistics and verdict, e.g. ``--sides stock,bf16=megamoe,fp8=megamoe,fp8_bwd=megamoe
--side-args 'fp8=--megamoe.precision fp8' --side-args
'fp8_bwd=--megamoe.precision fp8_bwd' --baseline bf16``: stock, fp8 and fp8_bwd each against
bf16, the bf16 run of a seed serving all three. With two sides and the default baseline the
A/B is A vs B (differences B - A).

Seeds (``--seeds N``, ab/seeds.py): every side is trained from the seeds S..S+N-1
(``--debug.seed``; S = ``--seed-base``, default the config's seed), each seed's runs a
single-seed A/B of their own in ``<out>/seed<S>/``. Each run is summarized by its mean loss over
the last W steps (``--window``, default 20); per seed d = X - baseline. The report gives the
d's mean, sd and standard error, each side's spread across seeds, and the verdict: **different**
when |mean d| > t x SE (a two-sided paired t-test at ``--alpha`` 0.05, t the Student-t quantile
for N - 1 degrees of freedom: 4.30 for 3 seeds), else **indistinguishable** (ab/stats.py has the
details). It also says whether |mean d| is within the pooled within-side spread and within
``--gap-limit`` (1%) of the baseline's loss. ``seeds.png`` plots every run's trailing W-step
mean loss per side and the per-seed relative differences. ``--analyze`` trains nothing and
writes the same report from the runs stored under ``--out``. Exit status 0 indistinguishable,
1 a comparison is different, 2 a run failed or is missing. Without ``--seeds`` everything is as
below (one seed, judged step by step).

Scheduling (ab/schedule.py): ``--jobs J`` runs up to J trainings at once on the same GPUs (to
overlap one run's start-up and compile with the others' steps; each has its own dir, log and
``torchrun --standalone`` rendezvous port); the tokens/s and step times of runs that overlapped
print as ``n/c`` (not comparable). ``--timeout`` bounds each run; ``--deadline-s S`` bounds the
whole invocation: after S seconds no run starts and running ones are stopped, and the report is
written from the runs that finished, listing the missing ones.

All runs use stock ``torchrun -m torchtitan.train``, the same TOML (copies written into the
output dir that differ only in ``[model] converters``: TorchTitan's CLI cannot give an empty
list), the same seed and the same extra arguments. Rank 0's log of each run is kept; its step
lines (loss, grad norm, memory, tokens/s) and their timestamps (step time) are parsed, and the
output dir gets ``report.md`` (per-step table, max |diff|, max relative diff, tokens/s, memory,
step time, the runs), ``ab.png`` (loss curves and step times) and ``summary.json``. The plots
need matplotlib, the tool's extra (``pip install 'torchtitan-megamoe[ab]'``); without it the
command stops before training and says so. On a CPU the step times compare the two CPU runs
only (the report says so): they say nothing about speed on a GPU.

Exit status: 0 losses agree within tolerance, 1 they do not, 2 a run failed or logged no steps.

On a machine without CUDA it sets ``MEGAMOE_CPU=1`` (the CPU shims, gloo) unless the caller set
it, and points the Hugging Face caches at a scratch dir with the offline switches on. If the
config reads the generated tiny assets (``<dir>/tokenizer`` and ``<dir>/dataset``) and they are
missing, it generates them (``torchtitan_megamoe.assets``).

One module per job: ``configs`` (the TOMLs, the sides), ``runner`` (torchrun with a timeout),
``schedule`` (the runs one at a time or J at once, within a deadline), ``logs`` (step-log
parsing, per-run stats), ``comparison`` (losses within tolerance), ``stats`` (windowed losses
across seeds, the verdict), ``report`` (markdown and PNG), ``trace`` (a profiled step's kernel
time by category), ``memory`` (what is alive at a step's memory peak), ``named_runs`` (their
NAME=PATH command line), ``driver`` (``run_ab``: one directory's runs, compared), ``seeds``
(``run_seeds``, every seed's runs) and ``cli`` (``main``). The names below are the tool's API
(tests, scripts/*.sh): import them from here.
"""

from torchtitan_megamoe.ab.cli import main
from torchtitan_megamoe.ab.comparison import DEFAULT_ATOL, DEFAULT_RTOL, Comparison, compare
from torchtitan_megamoe.ab.configs import (
    CONVERTER,
    DEFAULT_CONFIG,
    DEFAULT_SIDES,
    Side,
    baseline_index,
    cli_value,
    dump_toml,
    parse_side_args,
    parse_sides,
    side_configs,
    variant_configs,
)
from torchtitan_megamoe.ab.driver import ABResult, run_ab, run_pair
from torchtitan_megamoe.ab.logs import RunLog, Step, parse_log, parse_log_file, run_stats
from torchtitan_megamoe.ab.report import (
    plot,
    plot_runs,
    plot_seeds,
    render_report,
    render_seed_report,
    render_sides_report,
)
from torchtitan_megamoe.ab.runner import run_env, run_one, stop_all, torchrun_command
from torchtitan_megamoe.ab.schedule import RunRecord, RunSpec, run_all
from torchtitan_megamoe.ab.seeds import SeedsResult, run_seeds
from torchtitan_megamoe.ab.stats import (
    DEFAULT_ALPHA,
    DEFAULT_GAP_LIMIT,
    DEFAULT_WINDOW,
    SeedResult,
    SeedStats,
    final_window,
    seed_result,
    seed_stats,
    t_quantile,
    trailing_means,
)

__all__ = [
    "ABResult",
    "CONVERTER",
    "Comparison",
    "DEFAULT_ALPHA",
    "DEFAULT_ATOL",
    "DEFAULT_CONFIG",
    "DEFAULT_GAP_LIMIT",
    "DEFAULT_RTOL",
    "DEFAULT_SIDES",
    "DEFAULT_WINDOW",
    "RunLog",
    "RunRecord",
    "RunSpec",
    "SeedResult",
    "SeedStats",
    "SeedsResult",
    "Side",
    "Step",
    "baseline_index",
    "cli_value",
    "compare",
    "dump_toml",
    "final_window",
    "main",
    "parse_log",
    "parse_log_file",
    "parse_side_args",
    "parse_sides",
    "plot",
    "plot_runs",
    "plot_seeds",
    "render_report",
    "render_seed_report",
    "render_sides_report",
    "run_ab",
    "run_all",
    "run_env",
    "run_one",
    "run_pair",
    "run_seeds",
    "run_stats",
    "seed_result",
    "seed_stats",
    "side_configs",
    "stop_all",
    "t_quantile",
    "torchrun_command",
    "trailing_means",
    "variant_configs",
]
