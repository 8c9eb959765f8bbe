"""A/B run: the same TorchTitan config trained stock and with the ``megamoe`` converter.

    python -m torchtitan_megamoe.ab [--config X.toml] [--nproc N] [--out DIR] [--rtol R]
        [--atol A] [--profile-step N] [--sides A,B] [--a-args 'ARGS'] [--b-args 'ARGS']
        [--seeds N [--seed-base S] [--window W] [--alpha P] [--gap-limit R] [--analyze]]
        [-- <extra torchtitan args, given to both runs>]

e.g. ``python -m torchtitan_megamoe.ab --nproc 2 -- --parallelism.expert_parallel_degree 2``.

Sides (``--sides``, default ``stock,megamoe``): each is ``KIND`` or ``LABEL=KIND``, KIND ``stock``
(the config without the converter) or ``megamoe`` (with it); ``--a-args`` / ``--b-args`` add
TorchTitan arguments to one side, e.g. fp8 against bf16, both ours:
``--sides fp8=megamoe,bf16=megamoe --a-args '--megamoe.precision fp8' --b-args
'--megamoe.precision bf16'``. The label names the side's files and its column.

Seeds (``--seeds N``, ab/seeds.py): both sides are trained from the seeds S..S+N-1
(``--debug.seed``; S = ``--seed-base``, default the config's seed), each pair a single-seed A/B
of its own in ``<out>/seed<S>/``. Each run is summarized by its mean loss over the last W steps
(``--window``, default 20); per seed d = B - A. The report gives the d's mean, sd and standard
error, each side's spread across seeds, and the verdict: **different** when |mean d| > t x SE
(a two-sided paired t-test at ``--alpha`` 0.05, t the Student-t quantile for N - 1 degrees of
freedom: 4.30 for 3 seeds), else **indistinguishable** (ab/stats.py has the details). It also
says whether |mean d| is within the pooled within-side spread and within ``--gap-limit``
(1%) of A's loss. ``seeds.png`` plots every run's trailing W-step mean loss and the per-seed
relative differences. Exit status 0 indistinguishable, 1 different, 2 a run failed. Without
``--seeds`` everything is as below (one seed, judged step by step).

Both runs use stock ``torchrun -m torchtitan.train``, the same TOML (two copies written into the
output dir that differ only in ``[model] converters``: TorchTitan's CLI cannot give an empty
list), the same seed and the same extra arguments. Rank 0's log of each run is kept; its step
lines (loss, grad norm, memory, tokens/s) and their timestamps (step time) are parsed, and the
output dir gets ``report.md`` (per-step table, max |diff|, max relative diff, tokens/s, memory,
step time), ``ab.png`` (loss curves and step times) and ``summary.json``.

Exit status: 0 losses agree within tolerance, 1 they do not, 2 a run failed or logged no steps.

On a machine without CUDA it sets ``MEGAMOE_CPU=1`` (the CPU shims, gloo) unless the caller set
it, and points the Hugging Face caches at a scratch dir with the offline switches on. If the
config reads the generated tiny assets (``<dir>/tokenizer`` and ``<dir>/dataset``) and they are
missing, it generates them (``torchtitan_megamoe.assets``).

One module per job: ``configs`` (the two TOMLs, the sides), ``runner`` (torchrun with a
timeout), ``logs`` (step-log parsing, per-run stats), ``comparison`` (losses within tolerance),
``stats`` (windowed losses across seeds, the verdict), ``report`` (markdown and PNG), ``trace``
(a profiled step's kernel time by category), ``driver`` (``run_ab``, all of it in order),
``seeds`` (``run_seeds``, one ``driver.run_pair`` per seed) and ``cli`` (``main``). The
names below are the tool's API (tests, scripts/*.sh): import them from here.
"""

from torchtitan_megamoe.ab.cli import main
from torchtitan_megamoe.ab.comparison import DEFAULT_ATOL, DEFAULT_RTOL, Comparison, compare
from torchtitan_megamoe.ab.configs import (
    CONVERTER,
    DEFAULT_CONFIG,
    DEFAULT_SIDES,
    Side,
    cli_value,
    dump_toml,
    parse_sides,
    side_configs,
    variant_configs,
)
from torchtitan_megamoe.ab.driver import ABResult, run_ab, run_pair
from torchtitan_megamoe.ab.logs import RunLog, Step, parse_log, parse_log_file, run_stats
from torchtitan_megamoe.ab.report import plot, plot_seeds, render_report, render_seed_report
from torchtitan_megamoe.ab.runner import run_env, run_one, torchrun_command
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
    "SeedResult",
    "SeedStats",
    "SeedsResult",
    "Side",
    "Step",
    "cli_value",
    "compare",
    "dump_toml",
    "final_window",
    "main",
    "parse_log",
    "parse_log_file",
    "parse_sides",
    "plot",
    "plot_seeds",
    "render_report",
    "render_seed_report",
    "run_ab",
    "run_env",
    "run_one",
    "run_pair",
    "run_seeds",
    "run_stats",
    "seed_result",
    "seed_stats",
    "side_configs",
    "t_quantile",
    "torchrun_command",
    "trailing_means",
    "variant_configs",
]
