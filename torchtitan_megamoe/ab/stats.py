"""Seed-to-seed statistics of a multi-seed A/B: final-window mean losses, their paired
differences, and the "indistinguishable / different" verdict.

Long bf16 trainings drift apart chaotically, so a per-step tolerance cannot judge them. Instead
both sides are trained from the same N seeds (``--debug.seed``), and each run is summarized by
its **final-window mean loss**: the mean of the losses it logged over the last W steps, i.e.
steps ``last - W + 1 .. last`` where ``last`` is the last step both runs of that seed logged.

Per seed i: ``d_i = mean_B,i - mean_A,i`` (B minus A; relative: ``d_i / mean_A,i``). The two
runs of a seed start from the same weights and read the same batches, so the d_i are paired
differences. Over the N seeds:

- ``mean_diff`` = mean of d_i, ``sd_diff`` = their sample standard deviation (N - 1),
  ``se_diff = sd_diff / sqrt(N)`` its standard error;
- ``sd_a``, ``sd_b``: the seed-to-seed spread of each side's final-window mean (sample sd), and
  ``spread = sqrt((sd_a**2 + sd_b**2) / 2)``, the pooled within-side spread.

**Verdict rule** (a two-sided paired t-test at level ``alpha``, default 0.05): **different** when
``|mean_diff| > t * se_diff``, where ``t`` is the Student-t quantile ``1 - alpha/2`` with N - 1
degrees of freedom (4.30 for 3 seeds, 2.78 for 5, 2.26 for 10); otherwise
**indistinguishable**. With ``se_diff == 0`` any nonzero mean difference is different. With one
seed there is no spread: the verdict is **undetermined**.

"Different" means the gap is systematic: it is larger than what the seed-to-seed noise of the
*differences* explains. It does not say the gap matters; for that the report also sets
``|mean_diff|`` against the within-side spread (a gap smaller than what changing the seed does to
either side) and against a relative limit (``gap_limit``, default 1% of side A's loss): the goal
of an FP8 vs BF16 A/B is a gap within the spread and at most 1%.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torchtitan_megamoe.ab.logs import RunLog

DEFAULT_WINDOW = 20
DEFAULT_ALPHA = 0.05
DEFAULT_GAP_LIMIT = 0.01


# --- Student's t distribution (no scipy here): the regularized incomplete beta function by its
# continued fraction (modified Lentz), the CDF from it, the quantile by bisection.


def _betacf(a: float, b: float, x: float) -> float:
    tiny, eps = 1e-300, 3e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                    -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
          + a * math.log(x) + b * math.log1p(-x))
    front = math.exp(ln)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with ``t_cdf(t, df) == p`` (0 < p < 1), to ~1e-10."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


# --- windowed losses


def final_window(a: RunLog, b: RunLog, window: int) -> list[int]:
    """The steps of the final window: those both runs logged, from ``last - window + 1`` to
    ``last`` (the last step both logged). Empty when they share no step."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    common = sorted(set(a.by_step()) & set(b.by_step()))
    if not common:
        return []
    last = common[-1]
    return [s for s in common if s > last - window]


def window_mean(run: RunLog, steps: list[int]) -> float:
    """Mean loss of ``run`` over ``steps`` (nan when empty)."""
    by = run.by_step()
    vals = [by[s].loss for s in steps]
    return sum(vals) / len(vals) if vals else float("nan")


def trailing_means(run: RunLog, window: int) -> tuple[list[int], list[float]]:
    """(steps, mean loss over the logged steps in ``(step - window, step]``) for every logged
    step with a full window behind it (step >= first + window - 1); when the run is shorter than
    one window, every step with the steps logged so far."""
    steps = [s.step for s in run.steps]
    losses = [s.loss for s in run.steps]
    if not steps:
        return [], []
    full = steps[-1] - steps[0] + 1 >= window
    xs, ys = [], []
    for i, s in enumerate(steps):
        if full and s < steps[0] + window - 1:
            continue
        vals = [x for t, x in zip(steps[: i + 1], losses[: i + 1]) if t > s - window]
        xs.append(s)
        ys.append(sum(vals) / len(vals))
    return xs, ys


# --- across seeds


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _sd(xs: list[float]) -> float:
    """Sample standard deviation (N - 1); nan below two values."""
    if len(xs) < 2:
        return float("nan")
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


@dataclass
class SeedResult:
    """One seed's pair of runs, summarized by their final-window mean losses."""

    seed: int
    first_step: int  # of the final window
    last_step: int
    window_steps: int  # steps both runs logged in the window
    mean_a: float
    mean_b: float
    diff: float  # mean_b - mean_a
    rel_diff: float  # diff / mean_a


def seed_result(seed: int, a: RunLog, b: RunLog, window: int) -> SeedResult | None:
    """``None`` when the two runs share no logged step."""
    steps = final_window(a, b, window)
    if not steps:
        return None
    ma, mb = window_mean(a, steps), window_mean(b, steps)
    return SeedResult(seed, steps[0], steps[-1], len(steps), ma, mb, mb - ma,
                      (mb - ma) / ma if ma else float("nan"))


@dataclass
class SeedStats:
    names: tuple[str, str]  # (A, B); differences are B - A
    window: int
    alpha: float
    gap_limit: float
    seeds: list[SeedResult] = field(default_factory=list)
    n: int = 0
    mean_a: float = float("nan")
    sd_a: float = float("nan")  # seed-to-seed spread of A's final-window mean
    mean_b: float = float("nan")
    sd_b: float = float("nan")
    spread: float = float("nan")  # pooled within-side spread sqrt((sd_a^2 + sd_b^2) / 2)
    mean_diff: float = float("nan")  # mean of the per-seed B - A
    sd_diff: float = float("nan")  # their sample sd
    se_diff: float = float("nan")  # sd_diff / sqrt(n)
    mean_rel_diff: float = float("nan")  # mean of the per-seed (B - A) / A
    sd_rel_diff: float = float("nan")
    t_stat: float = float("nan")  # mean_diff / se_diff
    t_crit: float = float("nan")  # Student-t quantile 1 - alpha/2, n - 1 degrees of freedom
    threshold: float = float("nan")  # t_crit * se_diff
    verdict: str = "undetermined"  # "indistinguishable" | "different" | "undetermined"
    gap_within_spread: bool | None = None  # |mean_diff| <= spread
    gap_within_limit: bool | None = None  # |mean_rel_diff| <= gap_limit

    @property
    def rule(self) -> str:
        return rule_text(self.alpha, self.n)


def rule_text(alpha: float, n: int) -> str:
    t = f"{t_quantile(1 - alpha / 2, n - 1):.2f}" if n >= 2 else "t"
    return (
        f"different when |mean difference| > t x SE, the standard error of the per-seed "
        f"differences (sd / sqrt(N)), with t = {t} the Student-t quantile 1 - alpha/2 for "
        f"N - 1 = {max(n - 1, 0)} degree{'' if n == 2 else 's'} of freedom (a two-sided "
        f"paired t-test, alpha "
        f"{alpha:g}); otherwise indistinguishable; undetermined with one seed"
    )


def seed_stats(
    seeds: list[SeedResult],
    names: tuple[str, str] = ("A", "B"),
    window: int = DEFAULT_WINDOW,
    alpha: float = DEFAULT_ALPHA,
    gap_limit: float = DEFAULT_GAP_LIMIT,
) -> SeedStats:
    """The statistics and verdict (module docstring) over the seeds' results."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    st = SeedStats(tuple(names), window, alpha, gap_limit, list(seeds), len(seeds))
    if not seeds:
        return st
    a = [s.mean_a for s in seeds]
    b = [s.mean_b for s in seeds]
    d = [s.diff for s in seeds]
    r = [s.rel_diff for s in seeds]
    st.mean_a, st.sd_a, st.mean_b, st.sd_b = _mean(a), _sd(a), _mean(b), _sd(b)
    st.mean_diff, st.sd_diff = _mean(d), _sd(d)
    st.mean_rel_diff, st.sd_rel_diff = _mean(r), _sd(r)
    st.gap_within_limit = abs(st.mean_rel_diff) <= gap_limit
    if st.n < 2:
        return st
    st.spread = math.sqrt((st.sd_a ** 2 + st.sd_b ** 2) / 2)
    st.gap_within_spread = abs(st.mean_diff) <= st.spread
    st.se_diff = st.sd_diff / math.sqrt(st.n)
    st.t_crit = t_quantile(1 - alpha / 2, st.n - 1)
    st.threshold = st.t_crit * st.se_diff
    if st.se_diff > 0:
        st.t_stat = st.mean_diff / st.se_diff
    else:
        st.t_stat = 0.0 if st.mean_diff == 0 else math.copysign(math.inf, st.mean_diff)
    st.verdict = "different" if abs(st.t_stat) > st.t_crit else "indistinguishable"
    return st
