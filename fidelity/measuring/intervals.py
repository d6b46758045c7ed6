"""95% intervals and p-values of one statistic, from its row-bootstrap replicates or, where the bootstrap cannot
resolve the tails, analytically from its linearized standard error (the replicates and the SEs: `measuring.bootstrap`).

The expanded percentile tail the bootstrap reads must hold at least MIN_TAIL_REPLICATES replicates; with fewer degrees
of freedom than that resolves (2,000 replicates: below about 9) the interval is an analytic one on the rows' linearized
ratio (the same stratified variance the bootstrap estimates), built on a scale that keeps it inside the quantity's
range (`Range`): a t interval for a signed mean, on the log scale (delta method) for a non-negative one (KL, NLL), on
the logit scale for one bounded on both sides (tail mass, delta p), and Wilson's interval with the rows' design effect
for a share of counted positions or rows (top-1, rows worse), also where the share is 0 or 1 and the replicates cannot
vary. Either way the p-value is the inversion of the interval: 0 lies outside the 95% interval exactly when p < 0.05
(for a quantity whose range ends at 0, p is 0 unless the estimate is 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

MIN_TAIL_REPLICATES = 20   # bootstrap replicates beyond each percentile it reports; fewer: the analytic t interval


def _scipy_stats():
    """scipy.stats, imported when a number first needs it."""
    import scipy.stats  # noqa: PLC0415 (~1.2 s at import, and the report and gate commands import this module)

    return scipy.stats


def percentile_ci(samples: np.ndarray, level: float = 0.95, dof: int | None = None) -> list[float]:
    """Percentile interval of bootstrap replicates. With `dof` (independent rows minus domains) it is Hesterberg's
    expanded percentile interval: the tail probability is taken where a t with `dof` degrees of freedom puts `level`,
    since a percentile interval is as narrow as a z interval and undercovers with tens of rows."""
    stats = _scipy_stats()

    tail = (1 - level) / 2
    if dof is not None and dof >= 1:
        tail = float(stats.norm.sf(stats.t.isf(tail, dof)))
    samples = np.asarray(samples, dtype=np.float64)
    samples = samples[np.isfinite(samples)]
    if samples.size == 0:
        return [None, None]
    lo, hi = np.percentile(samples, [100 * tail, 100 * (1 - tail)])
    return [float(lo), float(hi)]

def iid_mean_ci(values: np.ndarray, level: float = 0.95) -> list[float]:
    """Normal interval treating every position as independent (what llama.cpp prints): too narrow when positions within
    a row are correlated. Kept for comparison and for the coverage test."""
    stats = _scipy_stats()

    v = np.asarray(values, dtype=np.float64)
    half = stats.norm.ppf(0.5 + level / 2) * v.std(ddof=1) / np.sqrt(len(v))
    return [float(v.mean() - half), float(v.mean() + half)]

def _expanded_tail(dof: int, level: float = 0.95) -> float:
    stats = _scipy_stats()

    return float(stats.norm.sf(stats.t.isf((1 - level) / 2, dof)))

@dataclass(frozen=True)
class Range:
    """Where a statistic's values lie: [lo, hi] (None: unbounded on that side). `counts`: a share of counted positions
    or rows (each 0 or 1), whose analytic interval is Wilson's with the design effect."""

    lo: float | None = None
    hi: float | None = None
    counts: bool = False

    def __post_init__(self):
        if self.lo is None and self.hi is not None:
            raise ValueError("a range bounded above only is not supported")
        if self.counts and (self.lo, self.hi) != (0.0, 1.0):
            raise ValueError("a share of counts lies in [0, 1]")

    def holds(self, x: float) -> bool:
        return (self.lo is None or x >= self.lo) and (self.hi is None or x <= self.hi)


SIGNED = Range()                            # delta NLL, paired differences
NONNEGATIVE = Range(0.0)                    # KL, NLL
UNIT = Range(0.0, 1.0)                      # a mean of values in [0, 1] (tail mass)
SHARE = Range(0.0, 1.0, counts=True)        # top-1 / top-K agreement, rows worse, a bucket's share of positions
DELTA_P = Range(-1.0, 1.0)                  # a mean difference of two probabilities

@dataclass
class Interval:
    """A 95% interval with the p-value of "the statistic is 0" read off the same construction, or the reason neither is
    available. `method`: "bootstrap" (expanded percentile, order statistics), "t" (linearized, t with `dof`), "t-log" /
    "t-logit" (the same on the log / logit scale of the distance to the range's ends) or "wilson" (Wilson's score
    interval at the effective sample size: design effect from the linearized SE, degrees of freedom as Korn &
    Graubard)."""

    ci: list[float] | None
    p_value: float | None
    method: str | None
    reason: str | None = None

def interval(est: float | None, reps: np.ndarray, se: Callable[[], float], dof: int, reason: str | None = None,
             level: float = 0.95, bounds: Range = SIGNED, count: float | None = None) -> Interval:
    """`est` (None when there is nothing to estimate), its bootstrap replicates and (called only when needed) its
    linearized standard error; `bounds` the statistic's range, `count` (for a share) the positions or rows it counts.
    The bootstrap is used when the expanded tail holds at least MIN_TAIL_REPLICATES replicates: then the interval is the
    order statistics k = ceil(tail * B) from each end (inside the range, as every replicate is) and p = 2 t_dof.sf(z)
    with z = norm.isf(max(c, 1) / B), c the replicates on the far side of 0, so p < 0.05 exactly when 0 is outside.
    Otherwise the analytic interval of `bounds` (`analytic_interval`). A share at 0 or 1 always takes Wilson's: its
    replicates cannot vary there, and a zero-width interval would claim certainty from a handful of rows."""
    stats = _scipy_stats()

    if reason is not None:
        return Interval(None, None, None, reason)
    if est is None or not np.isfinite(est):
        return Interval(None, None, None, "no finite position to estimate it from")
    if dof < 1:
        return Interval(None, None, None, f"{dof} degrees of freedom")
    if not bounds.holds(est):
        return Interval(None, None, None, f"the estimate {est:.6g} lies outside its range [{bounds.lo}, {bounds.hi}]")
    tail = _expanded_tail(dof, level)
    reps = np.asarray(reps, dtype=np.float64)
    reps = np.sort(reps[np.isfinite(reps)])
    b = len(reps)
    at_end = bounds.counts and est in (0.0, 1.0)
    if b * tail >= MIN_TAIL_REPLICATES and not at_end:
        k = int(np.ceil(tail * b))
        lo, hi = float(reps[k - 1]), float(reps[b - k])
        c = min(int(np.sum(reps <= 0)), int(np.sum(reps >= 0)))
        p = min(1.0, 2 * float(stats.t.sf(stats.norm.isf(max(c, 1) / b), dof)))
        outside = lo > 0 or hi < 0
        if outside != (p < 1 - level):   # a rounding step at the boundary: the counts decide
            p = float(np.nextafter(1 - level, 0)) if outside else 1 - level
        return Interval([lo, hi], p, "bootstrap")
    if se is None:
        return Interval(None, None, None, f"{b} bootstrap replicates cannot resolve the 95% tails at {dof} degrees of "
                                          f"freedom and this statistic has no analytic interval")
    s = se()
    if s is None or not np.isfinite(s):
        return Interval(None, None, None, "no finite position to estimate it from")
    return analytic_interval(float(est), float(s), dof, bounds, count, level)

def analytic_interval(est: float, se: float, dof: int, bounds: Range = SIGNED, count: float | None = None,
                      level: float = 0.95) -> Interval:
    """The interval from the linearized SE on a scale where `bounds` cannot be crossed, and the p-value of 0 by
    inverting it. Signed: est +- t_dof se. Bounded below only: t on log(est - lo) with SE se / (est - lo) (delta
    method). Bounded on both sides: t on logit((est - lo) / (hi - lo)) with SE se (hi - lo) / ((est - lo)(hi - est)).
    A share: `wilson_interval`. With se 0 (every row alike) or the estimate on an end of its range the interval is
    the point. A null of 0 on an end of the range (KL = 0) has p 0 unless the estimate is 0 (any position above 0
    rules it out), then 1; a null inside the range is tested on the same scale as the interval."""
    stats = _scipy_stats()

    if bounds.counts:
        return wilson_interval(est, se, dof, count, level)
    q = float(stats.t.isf((1 - level) / 2, dof))
    lo, hi = bounds.lo, bounds.hi
    if lo is None:
        if se == 0:
            return Interval([est, est], 1.0 if est == 0 else 0.0, "t")
        return Interval([est - q * se, est + q * se], min(1.0, 2 * float(stats.t.sf(abs(est) / se, dof))), "t")
    if hi is None:
        method, scale, unscale = "t-log", (lambda x: np.log(x - lo)), (lambda y: lo + np.exp(y))
        slope = 1.0 / (est - lo) if est > lo else np.inf
    else:
        method, scale = "t-logit", (lambda x: np.log(x - lo) - np.log(hi - x))

        def unscale(y):
            return lo + (hi - lo) / (1.0 + np.exp(-y))
        slope = (hi - lo) / ((est - lo) * (hi - est)) if lo < est < hi else np.inf
    null_on_end = lo >= 0 or (hi is not None and hi <= 0)
    if se == 0 or not np.isfinite(slope):
        return Interval([est, est], 1.0 if est == 0 else 0.0, method)
    g, s_g = float(scale(est)), se * slope
    ci = [float(unscale(g - q * s_g)), float(unscale(g + q * s_g))]
    p = (0.0 if null_on_end else min(1.0, 2 * float(stats.t.sf(abs(g - float(scale(0.0))) / s_g, dof))))
    return Interval(ci, p, method)

def wilson_interval(est: float, se: float, dof: int, count: float | None, level: float = 0.95) -> Interval:
    """A share of `count` positions or rows (each 0 or 1): Wilson's score interval (z) at the effective size
    n = est (1 - est) / se^2 (count / the rows' design effect; `count` itself where the share is 0 or 1 or the rows show
    no variance) times (z / t_dof)^2, Korn & Graubard's (1998) degrees-of-freedom adjustment, so that inside the range
    its width is the t interval's. Their truncation of the design effect at 1 is left out: with 3-10 rows it covered
    0.96-0.999 where this covers 0.946-0.98 (tests/test_stats.py). Never outside [0, 1], and not zero-width at 0 or 1.
    p of "the share is 0": 1 at 0, else 0 (one counted position rules it out)."""
    stats = _scipy_stats()

    if count is None or not count > 0:
        return Interval(None, None, None, "a share needs the number of positions or rows it counts")
    z, q = float(stats.norm.isf((1 - level) / 2)), float(stats.t.isf((1 - level) / 2, dof))
    var_binomial = est * (1 - est) / count
    # rows of one share (12 of 13 and 24 of 26) leave a variance of rounding only: as if none (design effect 1)
    n_eff = est * (1 - est) / (se * se) if var_binomial > 0 and se * se > 1e-9 * var_binomial else count
    n = n_eff * (z / q) ** 2
    if est in (0.0, 1.0):   # the general form, exact here (the general one rounds 1 to 1 - 2^-53)
        ci = [0.0, z * z / (n + z * z)] if est == 0 else [n / (n + z * z), 1.0]
    else:
        centre = (est + z * z / (2 * n)) / (1 + z * z / n)
        half = z / (1 + z * z / n) * np.sqrt(est * (1 - est) / n + z * z / (4 * n * n))
        ci = [float(centre - half), float(centre + half)]
    return Interval(ci, 1.0 if est == 0 else 0.0, "wilson")

def bootstrap_se(reps: np.ndarray) -> float | None:
    """Standard error of a statistic: the standard deviation of its finite bootstrap replicates."""
    reps = np.asarray(reps, dtype=np.float64)
    reps = reps[np.isfinite(reps)]
    return float(reps.std(ddof=1)) if reps.size > 1 else None

def sign_test(worse: int, better: int) -> float | None:
    """Two-sided sign test (scipy.stats.binomtest) of rows that got worse against rows that got better; ties left
    out."""
    stats = _scipy_stats()

    if worse + better == 0:
        return None
    return float(stats.binomtest(int(worse), int(worse + better), 0.5).pvalue)

def bootstrap_p_floor(n_reps: int, dof: int) -> float:
    """The smallest p-value `interval` gives from `n_reps` bootstrap replicates at `dof` degrees of freedom (no
    replicate, or one, on the far side of 0): 2 t_dof.sf(norm.isf(1 / n_reps)). A p-value there is "< floor"."""
    stats = _scipy_stats()

    return min(1.0, 2 * float(stats.t.sf(stats.norm.isf(1 / n_reps), dof)))

def bootstrap_p_value(reps: np.ndarray, dof: int | None = None) -> float:
    """Two-sided p-value for "the statistic is 0", read off the replicates the way `percentile_ci` reads its interval
    (0 lies outside the 95% interval exactly when p < 0.05). Its floor is about 1 / (len(reps) + 1)."""
    stats = _scipy_stats()

    if len(reps) == 0 or np.all(reps == 0):
        return 1.0
    tail = min((np.sum(reps <= 0) + 1) / (len(reps) + 1), (np.sum(reps >= 0) + 1) / (len(reps) + 1))
    if dof is not None and dof >= 1:
        tail = float(stats.t.sf(stats.norm.isf(tail), dof))
    return float(min(1.0, 2 * tail))
