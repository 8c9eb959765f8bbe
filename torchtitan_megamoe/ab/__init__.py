"""A/B run: the same TorchTitan config trained stock and with the ``megamoe`` converter.

    python -m torchtitan_megamoe.ab [--config X.toml] [--nproc N] [--out DIR] [--rtol R]
        [--atol A] [--profile-step N] [-- <extra torchtitan args, given to both runs>]

e.g. ``python -m torchtitan_megamoe.ab --nproc 2 -- --parallelism.expert_parallel_degree 2``.

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

One module per job: ``configs`` (the two TOMLs), ``runner`` (torchrun with a timeout), ``logs``
(step-log parsing, per-run stats), ``comparison`` (losses within tolerance), ``report``
(markdown and PNG), ``trace`` (a profiled step's kernel time by category), ``driver``
(``run_ab``, all of it in order) and ``cli`` (``main``). The
names below are the tool's API (tests, scripts/*.sh): import them from here.
"""

from torchtitan_megamoe.ab.cli import main
from torchtitan_megamoe.ab.comparison import DEFAULT_ATOL, DEFAULT_RTOL, Comparison, compare
from torchtitan_megamoe.ab.configs import (
    CONVERTER,
    DEFAULT_CONFIG,
    cli_value,
    dump_toml,
    variant_configs,
)
from torchtitan_megamoe.ab.driver import ABResult, run_ab
from torchtitan_megamoe.ab.logs import RunLog, Step, parse_log, parse_log_file, run_stats
from torchtitan_megamoe.ab.report import plot, render_report
from torchtitan_megamoe.ab.runner import run_env, run_one, torchrun_command

__all__ = [
    "ABResult",
    "CONVERTER",
    "Comparison",
    "DEFAULT_ATOL",
    "DEFAULT_CONFIG",
    "DEFAULT_RTOL",
    "RunLog",
    "Step",
    "cli_value",
    "compare",
    "dump_toml",
    "main",
    "parse_log",
    "parse_log_file",
    "plot",
    "render_report",
    "run_ab",
    "run_env",
    "run_one",
    "run_stats",
    "torchrun_command",
    "variant_configs",
]
