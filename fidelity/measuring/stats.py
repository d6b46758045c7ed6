"""Summaries of per-position metrics with honest uncertainty.

Positions within one panel row (a conversation) are correlated, so the unit of resampling is the row: every 95% interval
here is a percentile bootstrap over rows, stratified by domain (each replicate redraws each domain's rows with
replacement, keeping the panel's domain mix; Rao-Wu rescaled so small domains do not shrink the variance). Every
statistic is a ratio of per-row sums, so a replicate is a matrix product of resample counts with a [rows, quantities]
table and thousands of replicates cost milliseconds.

Small samples are honest: a 95% interval or p-value over fewer than MIN_ROWS rows (a domain's own, or the panel's), or
over a domain of one row (its variance is unknown), is reported as not available (null, with the reason) rather than as
a zero-width interval. The expanded percentile tail the bootstrap reads must hold at least MIN_TAIL_REPLICATES
replicates; with fewer degrees of freedom than that resolves (2,000 replicates: below about 9) the interval is an
analytic one on the rows' linearized ratio (the same stratified variance the bootstrap estimates), built on a scale
that keeps it inside the quantity's range (`Range`): a t interval for a signed mean, on the log scale (delta method) for
a non-negative one (KL, NLL), on the logit scale for one bounded on both sides (tail mass, delta p), and Wilson's
interval with the rows' design effect for a share of counted positions or rows (top-1, rows worse), also where the
share is 0 or 1 and the replicates cannot vary. Either way the p-value is the inversion of the interval: 0 lies
outside the 95% interval exactly when p < 0.05 (for a quantity whose range ends at 0, p is 0 unless the estimate is 0).

All KL figures are KL(P_ref || Q_pack) unless the key says `reverse`.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .metrics import TOPK, PositionMetrics

N_BOOT = 2000
TIE_MARGIN = 0.1          # nats: a reference top-1 margin below this is a near tie; flips there are reported apart
CONFIDENCE_EDGES = (0.0, 0.25, 0.5, 0.75, 0.95, 1.0)   # reference top-1 probability buckets (exllamav3 model_diff's)
KLD_PERCENTILES = {"kld_median": 50.0, "kld_p90": 90.0, "kld_p99": 99.0, "kld_p999": 99.9}
MIN_ROWS = 3               # a 95% interval or p-value over fewer rows (overall or in a domain) is not available
MIN_TAIL_REPLICATES = 20   # bootstrap replicates beyond each percentile it reports; fewer: the analytic t interval


@dataclass
class RowGroups:
    """Which row each scored position belongs to, and each row's domain."""

    row: np.ndarray              # [positions] int row index in 0..rows-1
    row_domain: np.ndarray       # [rows] domain index in 0..domains-1
    domains: list[str]

    @classmethod
    def build(cls, row: Sequence[int], row_domain_names: Sequence[str]) -> "RowGroups":
        domains = sorted(set(row_domain_names))
        index = {d: i for i, d in enumerate(domains)}
        return cls(
            np.asarray(row, dtype=np.int64), np.array([index[d] for d in row_domain_names], dtype=np.int64), domains
        )

    @property
    def n_rows(self) -> int:
        return len(self.row_domain)

    def dof(self, domain: int | None = None) -> int:
        """Degrees of freedom of a mean over rows: rows minus strata (one domain: its rows minus one)."""
        if domain is None:
            return self.n_rows - len(np.unique(self.row_domain))
        return int((self.row_domain == domain).sum()) - 1

    def row_sums(self, values: np.ndarray) -> np.ndarray:
        return np.bincount(self.row, weights=values, minlength=self.n_rows)


def bootstrap_counts(row_domain: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """[n_boot, rows] weight of each row in each replicate. Each domain's n rows are redrawn among themselves: n - 1
    draws with replacement, weighted n / (n - 1) (Rao & Wu's rescaling bootstrap; plain n-of-n draws shrink a variance
    by (n - 1) / n per domain, which undercovers with a dozen rows per domain). A domain of one row contributes no
    variance."""
    counts = np.zeros((n_boot, len(row_domain)))
    for d in np.unique(row_domain):
        members = np.flatnonzero(row_domain == d)
        n = len(members)
        if n == 1:
            counts[:, members] = 1.0
            continue
        draws = rng.multinomial(n - 1, np.full(n, 1.0 / n), size=n_boot)
        counts[:, members] = draws * (n / (n - 1))
    return counts


def domain_sums(
    table: np.ndarray, row_domain: np.ndarray, n_domains: int, counts: np.ndarray | None = None
) -> np.ndarray:
    """Per-domain sums of a [rows, quantities] table: [domains, quantities], or [n_boot, domains, quantities] when
    `counts` ([n_boot, rows]) weights the rows of each replicate."""
    shape = (n_domains, table.shape[1]) if counts is None else (counts.shape[0], n_domains, table.shape[1])
    out = np.zeros(shape)
    for d in range(n_domains):
        members = np.flatnonzero(row_domain == d)
        if counts is None:
            out[d] = table[members].sum(0)
        else:
            out[:, d] = counts[:, members] @ table[members]
    return out


def percentile_ci(samples: np.ndarray, level: float = 0.95, dof: int | None = None) -> list[float]:
    """Percentile interval of bootstrap replicates. With `dof` (independent rows minus domains) it is Hesterberg's
    expanded percentile interval: the tail probability is taken where a t with `dof` degrees of freedom puts `level`,
    since a percentile interval is as narrow as a z interval and undercovers with tens of rows."""
    from scipy.stats import norm, t  # noqa: PLC0415 (scipy.stats: ~1 s; reports and gates import stats)

    tail = (1 - level) / 2
    if dof is not None and dof >= 1:
        tail = float(norm.sf(t.isf(tail, dof)))
    samples = np.asarray(samples, dtype=np.float64)
    samples = samples[np.isfinite(samples)]
    if samples.size == 0:
        return [None, None]
    lo, hi = np.percentile(samples, [100 * tail, 100 * (1 - tail)])
    return [float(lo), float(hi)]


def iid_mean_ci(values: np.ndarray, level: float = 0.95) -> list[float]:
    """Normal interval treating every position as independent (what llama.cpp prints): too narrow when positions within
    a row are correlated. Kept for comparison and for the coverage test."""
    from scipy.stats import norm  # noqa: PLC0415 (scipy.stats: ~1 s; reports and gates import stats)

    v = np.asarray(values, dtype=np.float64)
    half = norm.ppf(0.5 + level / 2) * v.std(ddof=1) / np.sqrt(len(v))
    return [float(v.mean() - half), float(v.mean() + half)]


@dataclass
class RatioBootstrap:
    """Point estimates and bootstrap replicates of per-domain sums of several additive quantities."""

    names: list[str]
    point: np.ndarray        # [domains, quantities]
    reps: np.ndarray         # [n_boot, domains, quantities]
    table: np.ndarray | None = None       # [rows, quantities]: the per-row sums the replicates resample
    row_domain: np.ndarray | None = None  # [rows]

    @classmethod
    def run(cls, columns: dict[str, np.ndarray], groups: RowGroups, n_boot: int, seed: int) -> "RatioBootstrap":
        names = list(columns)
        table = np.stack([columns[k] for k in names], axis=1)
        counts = bootstrap_counts(groups.row_domain, n_boot, np.random.default_rng(seed))
        nd = len(groups.domains)
        return cls(names, domain_sums(table, groups.row_domain, nd), domain_sums(table, groups.row_domain, nd, counts),
                   table, groups.row_domain)

    def _col(self, name: str) -> np.ndarray:
        return self.table[:, self.names.index(name)]

    def pooled_se(self, num: str, den: str) -> float:
        """Linearized (Taylor) standard error of the pooled ratio sum(num) / sum(den), strata = domains, rows drawn with
        replacement within each: the variance the Rao-Wu bootstrap estimates, without resampling."""
        y, n = self._col(num), self._col(den)
        total = n.sum()
        if total <= 0:
            return float("nan")
        e = y - (y.sum() / total) * n
        return float(np.sqrt(_stratified_var(e, self.row_domain)) / total)

    def domain_se(self, num: str, den: str, domain: int) -> float:
        sel = self.row_domain == domain
        y, n = self._col(num)[sel], self._col(den)[sel]
        if n.sum() <= 0:
            return float("nan")
        e = y - (y.sum() / n.sum()) * n
        return float(np.sqrt(_stratified_var(e, np.zeros(len(e), np.int64))) / n.sum())

    def domains_equal_se(self, num: str, den: str) -> float:
        """Standard error of the mean of the per-domain ratios (domains are independent strata)."""
        ses = [self.domain_se(num, den, d) for d in range(self.point.shape[0])]
        ses = [x for x in ses if np.isfinite(x)]
        return float(np.sqrt(np.sum(np.square(ses))) / len(ses)) if ses else float("nan")

    def _q(self, s: np.ndarray, name: str) -> np.ndarray:
        return s[..., self.names.index(name)]

    def pooled(self, num: str, den: str) -> tuple[float, np.ndarray]:
        def f(s):
            return self._q(s, num).sum(-1) / self._q(s, den).sum(-1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return float(f(self.point)), f(self.reps)

    def per_domain(self, num: str, den: str) -> tuple[np.ndarray, np.ndarray]:
        def f(s):
            return self._q(s, num) / self._q(s, den)
        with np.errstate(invalid="ignore", divide="ignore"):
            return f(self.point), f(self.reps)

    def domains_equal(self, num: str, den: str) -> tuple[float, np.ndarray]:
        point, reps = self.per_domain(num, den)
        with warnings.catch_warnings():   # a pack with no finite position anywhere has no mean: NaN, reported as null
            warnings.simplefilter("ignore", RuntimeWarning)
            return float(np.nanmean(point)), np.nanmean(reps, axis=-1)


def _stratified_var(e: np.ndarray, strata: np.ndarray) -> float:
    """sum over strata of n_h / (n_h - 1) * sum_i (e_i - mean_h)^2: the with-replacement variance of a stratified
    total."""
    v = 0.0
    for h in np.unique(strata):
        x = e[strata == h]
        if len(x) > 1:
            v += len(x) / (len(x) - 1) * float(np.square(x - x.mean()).sum())
    return v


def _expanded_tail(dof: int, level: float = 0.95) -> float:
    from scipy.stats import norm, t  # noqa: PLC0415 (scipy.stats: ~1 s; reports and gates import stats)

    return float(norm.sf(t.isf((1 - level) / 2, dof)))


def not_available(groups: RowGroups, domain: int | None = None) -> str | None:
    """Why a 95% interval or p-value over the panel's rows (or one domain's) is not available; None when it is."""
    counts = np.bincount(groups.row_domain, minlength=len(groups.domains))
    if domain is not None:
        n = int(counts[domain])
        if n < MIN_ROWS:
            return (f"domain {groups.domains[domain]!r} has {n} row{'s' if n != 1 else ''}; a 95% interval or p-value "
                    f"needs at least {MIN_ROWS}")
        return None
    if groups.n_rows < MIN_ROWS:
        return (f"{groups.n_rows} row{'s' if groups.n_rows != 1 else ''}; a 95% interval or p-value needs at least "
                f"{MIN_ROWS}")
    single = [groups.domains[i] for i in np.flatnonzero(counts == 1)]
    if single:
        return (f"domain{'s' if len(single) > 1 else ''} {', '.join(map(repr, single))} "
                f"{'have' if len(single) > 1 else 'has'} one row: its variance is unknown")
    return None


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
    from scipy.stats import norm, t  # noqa: PLC0415 (scipy.stats: ~1 s; reports and gates import stats)

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
        p = min(1.0, 2 * float(t.sf(norm.isf(max(c, 1) / b), dof)))
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
    from scipy.stats import t  # noqa: PLC0415 (scipy.stats: ~1 s; reports and gates import stats)

    if bounds.counts:
        return wilson_interval(est, se, dof, count, level)
    q = float(t.isf((1 - level) / 2, dof))
    lo, hi = bounds.lo, bounds.hi
    if lo is None:
        if se == 0:
            return Interval([est, est], 1.0 if est == 0 else 0.0, "t")
        return Interval([est - q * se, est + q * se], min(1.0, 2 * float(t.sf(abs(est) / se, dof))), "t")
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
    p = (0.0 if null_on_end else min(1.0, 2 * float(t.sf(abs(g - float(scale(0.0))) / s_g, dof))))
    return Interval(ci, p, method)


def wilson_interval(est: float, se: float, dof: int, count: float | None, level: float = 0.95) -> Interval:
    """A share of `count` positions or rows (each 0 or 1): Wilson's score interval (z) at the effective size
    n = est (1 - est) / se^2 (count / the rows' design effect; `count` itself where the share is 0 or 1 or the rows show
    no variance) times (z / t_dof)^2, Korn & Graubard's (1998) degrees-of-freedom adjustment, so that inside the range
    its width is the t interval's. Their truncation of the design effect at 1 is left out: with 3-10 rows it covered
    0.96-0.999 where this covers 0.946-0.98 (tests/test_stats.py). Never outside [0, 1], and not zero-width at 0 or 1.
    p of "the share is 0": 1 at 0, else 0 (one counted position rules it out)."""
    from scipy.stats import norm, t  # noqa: PLC0415 (scipy.stats: ~1 s; reports and gates import stats)

    if count is None or not count > 0:
        return Interval(None, None, None, "a share needs the number of positions or rows it counts")
    z, q = float(norm.isf((1 - level) / 2)), float(t.isf((1 - level) / 2, dof))
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


def _finite(x: float) -> float | None:
    return float(x) if x is not None and np.isfinite(x) else None


def _exp_ci(ci: list | None) -> list | None:
    return [float(np.exp(x)) for x in ci] if ci is not None else None


def bootstrap_se(reps: np.ndarray) -> float | None:
    """Standard error of a statistic: the standard deviation of its finite bootstrap replicates."""
    reps = np.asarray(reps, dtype=np.float64)
    reps = reps[np.isfinite(reps)]
    return float(reps.std(ddof=1)) if reps.size > 1 else None


@dataclass
class Estimate:
    """A point estimate with its row-bootstrap replicates. `reason`: why no interval or p-value is available (too
    few rows); `lin_se`: its linearized standard error, for the analytic interval where the bootstrap cannot resolve
    its tails (None: no analytic interval, so none then); `bounds`: the statistic's range, `count` (a share) the
    positions or rows it counts. See `interval`."""

    value: float | None
    reps: np.ndarray
    dof: int | None
    reason: str | None = None
    lin_se: Callable[[], float] | None = None
    bounds: Range = SIGNED
    count: float | None = None

    def interval(self) -> Interval:
        if getattr(self, "_interval", None) is None:
            self._interval = interval(self.value, self.reps, self.lin_se, self.dof if self.dof is not None else 0,
                                      self.reason, bounds=self.bounds, count=self.count)
        return self._interval

    def ci(self) -> list | None:
        return self.interval().ci

    def se(self) -> float | None:
        iv = self.interval()
        if iv.ci is None:
            return None
        return bootstrap_se(self.reps) if iv.method == "bootstrap" else float(self.lin_se())

    def p_value(self) -> float | None:
        return self.interval().p_value


@dataclass
class Scopes:
    """One statistic overall (pooled over positions), per domain, and with the domains weighted equally."""

    overall: Estimate
    domains: list[Estimate]
    equal: Estimate


def ratio_scopes(boot: RatioBootstrap, num: str, den: str, groups: RowGroups, transform=None, *,
                 bounds: Range) -> Scopes:
    """sum(num) / sum(den) pooled, per domain and domains-equal (the mean of the domains' ratios), each with its
    replicates; `transform` (e.g. np.sqrt, np.exp) is applied to the point and to every replicate (a transformed
    statistic has no linearized SE: its interval needs enough degrees of freedom for the bootstrap). `bounds`: the
    statistic's range (SIGNED, NONNEGATIVE, UNIT, SHARE: `den` then counts what `num` counts, DELTA_P), which its
    analytic interval keeps to."""
    f = transform or (lambda x: x)
    why = not_available(groups)
    se = (lambda g: None) if transform is not None else (lambda g: g)
    dens = boot.point[..., boot.names.index(den)]       # [domains]: what each domain's share counts

    def E(value, reps, dof, reason, lin_se, count):
        return Estimate(_finite(f(value)), f(reps), dof, reason, se(lin_se), bounds, float(count))

    with np.errstate(invalid="ignore", divide="ignore"):
        est, reps = boot.pooled(num, den)
        d_est, d_reps = boot.per_domain(num, den)
        e_est, e_reps = boot.domains_equal(num, den)
        return Scopes(E(est, reps, groups.dof(), why, lambda: boot.pooled_se(num, den), dens.sum()),
                      [E(d_est[i], d_reps[:, i], groups.dof(i), not_available(groups, i),
                         lambda i=i: boot.domain_se(num, den, i), dens[i]) for i in range(len(groups.domains))],
                      E(e_est, e_reps, groups.dof(), why, lambda: boot.domains_equal_se(num, den), dens.sum()))


def weighted_quantile(sorted_values: np.ndarray, weights: np.ndarray, qs: Sequence[float]) -> np.ndarray:
    """Quantiles (inverted empirical CDF: the smallest value whose cumulative weight reaches q of the total) of values
    sorted ascending with `weights` [..., n]: [..., len(qs)]."""
    cw = np.cumsum(weights, axis=-1)
    total = cw[..., -1:]
    out = np.empty(weights.shape[:-1] + (len(qs),))
    for j, q in enumerate(qs):
        idx = np.minimum((cw < q * total * (1 - 1e-12)).sum(-1), len(sorted_values) - 1)
        out[..., j] = sorted_values[idx]
    with np.errstate(invalid="ignore"):
        out[total[..., 0] <= 0] = np.nan
    return out


def quantile_reps(values: np.ndarray, row: np.ndarray, weights: np.ndarray, qs: Sequence[float],
                  window: int = 1024) -> np.ndarray:
    """Bootstrap replicates [n_boot, len(qs)] of `weighted_quantile` of `values` (one per position, `row` its row),
    where in replicate b every position of row i weighs weights[b, i] (resample counts, times a domain's weight).
    Exact, without a replicate-by-position table: a replicate's cumulative weight at the sorted positions of a window
    around the pooled quantile is its weight below the window (one matrix product) plus a running sum inside it; a
    replicate whose quantile falls outside the window is redone with a window four times wider."""
    order = np.argsort(values, kind="stable")
    v, r = values[order], row[order]
    n, (n_boot, n_rows) = v.size, weights.shape
    out = np.full((n_boot, len(qs)), np.nan)
    if n == 0:
        return out
    total = weights @ np.bincount(r, minlength=n_rows).astype(float)
    live = np.flatnonzero(total > 0)
    by_row = np.ascontiguousarray(weights.T)       # [rows, n_boot]: the running sum adds whole replicate vectors
    for j, q in enumerate(qs):
        target = q * total * (1 - 1e-12)
        todo, half = live, window
        while todo.size:
            lo, hi = max(0, int(q * n) - half), min(n, int(q * n) + half)
            w = by_row if todo.size == n_boot else by_row[:, todo]
            base = np.bincount(r[:lo], minlength=n_rows).astype(float) @ w
            cum = w[r[lo:hi]]
            cum[0] += base
            for k in range(1, cum.shape[0]):       # a running sum of whole rows: numpy's cumsum is several times slower
                cum[k] += cum[k - 1]
            t = target[todo]
            inside = ((lo == 0) | (base < t)) & ((hi == n) | (cum[-1] >= t))
            idx = np.minimum(lo + (cum < t).sum(0), n - 1)
            out[todo[inside], j] = v[idx[inside]]
            todo, half = todo[~inside], half * 4
    return out


def _ci_dict(e: Estimate, key: str, se: bool = False) -> dict:
    out = {key: e.value, f"{key}_ci95": e.ci()}
    if se:
        out[f"{key}_se"] = e.se()
    return out


def sign_test(worse: int, better: int) -> float | None:
    """Two-sided sign test (scipy.stats.binomtest) of rows that got worse against rows that got better; ties left
    out."""
    from scipy.stats import binomtest  # noqa: PLC0415 (scipy.stats: ~1 s; reports and gates import stats)

    if worse + better == 0:
        return None
    return float(binomtest(int(worse), int(worse + better), 0.5).pvalue)


# ---- scopes and rows worse: the one builder compare's summary and the gates share ------------------------------------

@dataclass(frozen=True)
class RowScope:
    """Which rows a reported block covers: all of them (`overall`), one domain's (`domain` its index), or the domains
    weighted equally (`rows` None: a mean of the domains' statistics, not a set of rows)."""

    name: str
    domain: int | None
    rows: np.ndarray | None     # [rows] bool

    def pick(self, scopes: Scopes) -> Estimate:
        """This scope's estimate of a statistic computed in every scope."""
        if self.domain is not None:
            return scopes.domains[self.domain]
        return scopes.overall if self.rows is not None else scopes.equal

    def total(self, table: dict[str, np.ndarray], column: str) -> int:
        """The sum of a per-row count column over this scope's rows."""
        return int(table[column][self.rows].sum())


def row_scopes(groups: RowGroups) -> tuple[RowScope, list[RowScope], RowScope]:
    """The overall scope, one per domain (in `groups.domains` order) and the domains-equal one."""
    return (RowScope("overall", None, np.ones(groups.n_rows, bool)),
            [RowScope(name, i, groups.row_domain == i) for i, name in enumerate(groups.domains)],
            RowScope("domains_equal", None, None))


def add_rows_worse(table: dict[str, np.ndarray], n: str, dnll: str) -> None:
    """Per-row columns of rows worse, added to a table of per-row sums: `row_scored` (the row has a position counted in
    `n`), `row_worse` / `row_better` (its summed NLL change `dnll` rose / fell; a scored row with no change is
    neither)."""
    scored = table[n] > 0
    table["row_scored"] = scored.astype(float)
    table["row_worse"] = (scored & (table[dnll] > 0)).astype(float)
    table["row_better"] = (scored & (table[dnll] < 0)).astype(float)


def rows_worse_share(boot: RatioBootstrap, groups: RowGroups) -> Scopes:
    """The share of scored rows that got worse (`add_rows_worse`'s columns in `boot`), in every scope."""
    return ratio_scopes(boot, "row_worse", "row_scored", groups, bounds=SHARE)


def rows_worse(table: dict[str, np.ndarray], scope: RowScope, share: Scopes) -> dict:
    """Rows worse over a scope of rows: the counts, the share with its 95% interval, and the sign test of worse
    against better."""
    worse, better = scope.total(table, "row_worse"), scope.total(table, "row_better")
    e = scope.pick(share)
    return {"rows": scope.total(table, "row_scored"), "worse": worse, "better": better, "share": e.value,
            "share_ci95": e.ci(), "sign_test_p": sign_test(worse, better)}


# ---- summarize -------------------------------------------------------------------------------------------------------

def summarize(pm: PositionMetrics, groups: RowGroups, *, n_boot: int = N_BOOT, seed: int = 0,
              tie_margin: float = TIE_MARGIN, confidence_edges=CONFIDENCE_EDGES) -> dict:
    """Overall (pooled and domains-equal) and per-domain statistics of one pack against the reference, with 95% CIs
    (the definitions are in README.md, "What compare reports"). Non-finite positions are counted (`nonfinite`) and left
    out of every average."""
    m = pm.to_numpy()
    edges = list(confidence_edges)
    columns = _position_columns(m, tie_margin, edges)
    table = {k: groups.row_sums(v) for k, v in columns.items()}
    add_rows_worse(table, "n", "dnll")   # a row whose mean NLL rose (rows without a finite position count neither way)
    boot = RatioBootstrap.run(table, groups, n_boot, seed)
    counts = bootstrap_counts(groups.row_domain, n_boot, np.random.default_rng(seed))   # the same replicates
    ok = m["finite"]
    has_reverse = bool(np.isfinite(m["kld_reverse"][ok]).any()) if ok.any() else False
    s = _Summary(boot, groups, table, edges, has_reverse, m.get("topk_match") is not None,
                 _kld_quantiles(m["kld"], ok, groups.row, groups.row_domain[groups.row], groups, counts))
    overall_scope, domain_scopes, equal_scope = row_scopes(groups)
    overall = s.overall(overall_scope, m, columns, tie_margin, n_boot)
    overall["domains_equal"] = s.domains_equal(equal_scope)
    return {"overall": overall, "domains": {scope.name: s.domain(scope, m) for scope in domain_scopes}}


def _position_columns(m: dict[str, np.ndarray], tie_margin: float, edges: list[float]) -> dict[str, np.ndarray]:
    """Per-position quantities summarize sums per row (non-finite positions 0 in every one): the finite count `n`, the
    KLs, top-1 / top-K agreement, NLLs and their change, Δp, near-tie flips, and per reference-confidence bucket."""
    ok = m["finite"]

    def z(x):
        return np.where(ok, x, 0.0)

    ref_p, pack_p = np.exp(-z(m["ref_nll"])), np.exp(-z(m["pack_nll"]))
    agree = (m["ref_top1"] == m["pack_top1"]) & ok
    tie = ok & (z(m["ref_margin"]) < tie_margin)
    columns = {
        "n": ok.astype(np.float64), "kld": z(m["kld"]), "kld_reverse": z(np.nan_to_num(m["kld_reverse"])),
        "agree": agree.astype(float),
        "ref_nll": z(m["ref_nll"]), "pack_nll": z(m["pack_nll"]), "dnll": z(m["pack_nll"] - m["ref_nll"]),
        "dp": z(pack_p - ref_p), "dp2": z((pack_p - ref_p) ** 2),
        "n_tie": tie.astype(float), "flip_tie": (tie & ~agree).astype(float),
        "n_clear": (ok & ~tie).astype(float), "flip_clear": (ok & ~tie & ~agree).astype(float),
        "nonfinite": (~ok).astype(float),
    }
    topk = m.get("topk_match")
    if topk is not None:
        for k in range(1, TOPK + 1):
            columns[f"agree_top{k}"] = (ok & (topk >= k)).astype(float)
    bucket = np.clip(np.searchsorted(edges, z(m["ref_pmax"]), side="right") - 1, 0, len(edges) - 2)
    for b in range(len(edges) - 1):
        inb = ok & (bucket == b)
        columns[f"conf{b}_n"] = inb.astype(float)
        columns[f"conf{b}_kld"] = np.where(inb, columns["kld"], 0.0)
        columns[f"conf{b}_kld_reverse"] = np.where(inb, columns["kld_reverse"], 0.0)
    return columns


class _Summary:
    """Every statistic of summarize in its three scopes, and the blocks that report them: the scope block the overall
    and the domain blocks share, the overall block, a domain's block and the domains-equal block."""

    def __init__(self, boot: RatioBootstrap, groups: RowGroups, table: dict[str, np.ndarray], edges: list[float],
                 has_reverse: bool, has_topk: bool, quantiles: dict):
        def S(num, den="n", transform=None, bounds=NONNEGATIVE):
            return ratio_scopes(boot, num, den, groups, transform, bounds=bounds)

        self.groups, self.table, self.edges, self.has_reverse, self.quantiles = (groups, table, edges, has_reverse,
                                                                                 quantiles)
        self.kld, self.kld_reverse, self.top1 = S("kld"), S("kld_reverse"), S("agree", bounds=SHARE)
        self.dnll, self.ref_nll, self.pack_nll = S("dnll", bounds=SIGNED), S("ref_nll"), S("pack_nll")
        self.dp, self.rms_dp = S("dp", bounds=DELTA_P), S("dp2", transform=np.sqrt, bounds=UNIT)
        self.worse_share = rows_worse_share(boot, groups)
        self.topk = [S(f"agree_top{k}", bounds=SHARE) for k in range(1, TOPK + 1)] if has_topk else []
        self.confidence = [(S(f"conf{b}_kld", f"conf{b}_n"), S(f"conf{b}_n", bounds=SHARE),
                            S(f"conf{b}_kld_reverse", f"conf{b}_n")) for b in range(len(edges) - 1)]

    def scope(self, scope: RowScope) -> dict:
        """The statistics the overall block and every domain's block report alike."""
        pick, edges = scope.pick, self.edges
        out = {
            **_ci_dict(pick(self.kld_reverse), "kld_reverse_mean"),
            **_ci_dict(pick(self.dnll), "delta_nll_mean", se=True),
            **_ci_dict(pick(self.pack_nll), "nll_mean"),
            **_ci_dict(pick(self.ref_nll), "nll_ref_mean"),
            "rows_worse": rows_worse(self.table, scope, self.worse_share),
            "topk_agreement": [
                {"k": k + 1, "value": pick(s).value, "ci95": pick(s).ci()} for k, s in enumerate(self.topk)
            ],
            **_ci_dict(pick(self.dp), "delta_p_mean"),
            **_ci_dict(pick(self.rms_dp), "rms_delta_p"),
            "kld_by_ref_confidence": [
                {
                    "ref_confidence": [edges[b], edges[b + 1]],
                    "positions": scope.total(self.table, f"conf{b}_n"),
                    "share": pick(share).value,
                    "kld_mean": pick(k_).value,
                    "kld_mean_ci95": pick(k_).ci(),
                    "kld_reverse_mean": pick(r_).value if self.has_reverse else None,
                }
                for b, (k_, share, r_) in enumerate(self.confidence)
            ],
            **self.quantiles["overall" if scope.domain is None else scope.domain],
        }
        if not self.has_reverse:
            out["kld_reverse_mean"], out["kld_reverse_mean_ci95"] = None, None
        return out

    def overall(self, scope: RowScope, m: dict, columns: dict, tie_margin: float, n_boot: int) -> dict:
        ok = m["finite"]
        kld, top1, dnll = self.kld, self.top1, self.dnll
        finite_kld = m["kld"][ok]
        return {
            "positions": int(ok.sum()), "nonfinite": int((~ok).sum()),
            "kld_mean": kld.overall.value, "kld_mean_ci95": kld.overall.ci(),
            "kld_domains_equal": kld.equal.value, "kld_domains_equal_ci95": kld.equal.ci(),
            "top1": top1.overall.value, "top1_ci95": top1.overall.ci(),
            "top1_domains_equal": top1.equal.value, "top1_domains_equal_ci95": top1.equal.ci(),
            "tie_margin": tie_margin,
            "top1_flips_clear": int(columns["flip_clear"].sum()), "clear_positions": int(columns["n_clear"].sum()),
            "top1_flips_near_tie": int(columns["flip_tie"].sum()), "near_tie_positions": int(columns["n_tie"].sum()),
            **_perplexities(self.pack_nll.overall, self.ref_nll.overall),
            "ln_ppl_ratio": dnll.overall.value, "ln_ppl_ratio_ci95": dnll.overall.ci(),
            **self.scope(scope),
            "kld_max": float(finite_kld.max()) if finite_kld.size else None,
            "ci_unavailable": not_available(self.groups),
            "bootstrap_replicates": n_boot,
        }

    def domain(self, scope: RowScope, m: dict) -> dict:
        i, ok, pos_domain = scope.domain, m["finite"], self.groups.row_domain[self.groups.row]
        sel = ok & (pos_domain == i)
        return {
            "rows": int(scope.rows.sum()), "positions": int(sel.sum()),
            "nonfinite": int((~ok & (pos_domain == i)).sum()),
            "kld_mean": self.kld.domains[i].value, "kld_mean_ci95": self.kld.domains[i].ci(),
            "top1": self.top1.domains[i].value, "top1_ci95": self.top1.domains[i].ci(),
            **_perplexities(self.pack_nll.domains[i], self.ref_nll.domains[i]),
            **self.scope(scope),
            "kld_max": float(m["kld"][sel].max()) if sel.any() else None,
            "ci_unavailable": not_available(self.groups, i),
        }

    def domains_equal(self, scope: RowScope) -> dict:
        eq = {"kld_reverse_mean": self.kld_reverse, "delta_nll_mean": self.dnll, "delta_p_mean": self.dp,
              "rms_delta_p": self.rms_dp, "nll_mean": self.pack_nll, "nll_ref_mean": self.ref_nll,
              "rows_worse_share": self.worse_share}
        out = {k: scope.pick(v).value for k, v in eq.items()}
        out.update({f"{k}_ci95": scope.pick(v).ci() for k, v in eq.items()})
        out["delta_nll_mean_se"] = scope.pick(self.dnll).se()
        if not self.has_reverse:
            out["kld_reverse_mean"], out["kld_reverse_mean_ci95"] = None, None
        edges = self.edges
        out.update({"kld_mean": self.kld.equal.value, "kld_mean_ci95": self.kld.equal.ci(),
                    "top1": self.top1.equal.value, "top1_ci95": self.top1.equal.ci(),
                    "topk_agreement": [{"k": k + 1, "value": s.equal.value, "ci95": s.equal.ci()}
                                       for k, s in enumerate(self.topk)],
                    "kld_by_ref_confidence": [
                        {"ref_confidence": [edges[b], edges[b + 1]], "kld_mean": k_.equal.value,
                         "kld_mean_ci95": k_.equal.ci()} for b, (k_, _, _) in enumerate(self.confidence)],
                    **self.quantiles["equal"]})
        return out


def _perplexities(pack_nll: Estimate, ref_nll: Estimate) -> dict:
    """ppl (with its 95% interval) and ppl_ref: exp of the mean NLLs."""
    return {"ppl": _finite(np.exp(pack_nll.value)) if pack_nll.value is not None else None,
            "ppl_ci95": _exp_ci(pack_nll.ci()),
            "ppl_ref": _finite(np.exp(ref_nll.value)) if ref_nll.value is not None else None}


def _kld_quantiles(kld: np.ndarray, ok: np.ndarray, row: np.ndarray, pos_domain: np.ndarray, groups: RowGroups,
                   counts: np.ndarray) -> dict:
    """KLD quantiles (KLD_PERCENTILES) with row-bootstrap CIs: pooled (np.percentile for the point), per domain, and
    domains-equal (each domain's positions weigh 1 / its position count, so every domain carries the same mass). The
    replicates use the inverted-CDF quantile of the resampled rows' positions; the maximum has no CI."""
    qs = [q / 100 for q in KLD_PERCENTILES.values()]
    keys = list(KLD_PERCENTILES)

    def block(values, point, reps, dof, reason=None):
        def value(j):
            return float(point[j]) if np.isfinite(point[j]) else None

        ivs = [Estimate(value(j), reps[:, j], dof, reason, bounds=NONNEGATIVE).interval() for j in range(len(keys))]
        return {**{k: value(j) for j, k in enumerate(keys)}, **{f"{k}_ci95": iv.ci for k, iv in zip(keys, ivs)},
                **{f"{k}_ci95_unavailable": iv.reason for k, iv in zip(keys, ivs)}}

    out = {}
    v, r, d = kld[ok], row[ok], pos_domain[ok]
    point = np.percentile(v, [100 * q for q in qs]) if v.size else np.full(len(qs), np.nan)
    out["overall"] = block(v, point, quantile_reps(v, r, counts, qs), groups.dof(), not_available(groups))
    for i in range(len(groups.domains)):
        sel = d == i
        vi = v[sel]
        point = np.percentile(vi, [100 * q for q in qs]) if vi.size else np.full(len(qs), np.nan)
        out[i] = block(vi, point, quantile_reps(vi, r[sel], counts, qs), groups.dof(i), not_available(groups, i))
    n_d = np.bincount(d, minlength=len(groups.domains)).astype(float)
    # domains-equal: a position weighs 1 / (its domain's position count), in a replicate its resampled count
    row_pos = np.bincount(r, minlength=groups.n_rows).astype(float)
    rep_dom = domain_sums(row_pos[:, None], groups.row_domain, len(groups.domains), counts)[..., 0]  # [n_boot, domains]
    with np.errstate(divide="ignore"):
        inv = np.where(rep_dom > 0, 1.0 / np.where(rep_dom > 0, rep_dom, 1.0), 0.0)
        point_w = np.where(n_d[d] > 0, 1.0 / np.maximum(n_d[d], 1.0), 0.0)
    order = np.argsort(v, kind="stable")
    point = weighted_quantile(v[order], point_w[order], qs) if v.size else np.full(len(qs), np.nan)
    reps = quantile_reps(v, r, counts * inv[:, groups.row_domain], qs)
    out["equal"] = block(v, point, reps, groups.dof(), not_available(groups))
    return out


PAIRED_METRICS = ("kld", "kld_reverse")


def paired_difference(pm_a: PositionMetrics, pm_b: PositionMetrics, groups: RowGroups, *, n_boot: int = N_BOOT,
                      seed: int = 0) -> dict:
    """Pack A vs pack B on the same positions (finite in both), for KL(P_ref || pack) and KL(pack || P_ref): the paired
    difference A - B and the relative change 100 (A - B) / B (%), pooled, per domain and domains-equal, each with a 95%
    CI by the row bootstrap (rows keep A and B together, so the pairing is kept) and a two-sided bootstrap p-value for
    "no difference" read off the same interval (`interval`: p < 0.05 exactly when 0 is outside it; a bootstrap
    p-value's floor is about 1 / n_boot); per-domain p-values also Holm-corrected across the domains that have one
    (statsmodels' multipletests). On too few rows, or with no position finite in both, intervals and p-values are
    null and `unavailable` says why. The top-level keys are the pooled KL(P_ref || pack) figures."""
    ok = pm_a.finite.numpy() & pm_b.finite.numpy()
    out = {"positions": int(ok.sum()), "bootstrap_replicates": n_boot}
    for metric in PAIRED_METRICS:
        a, b = getattr(pm_a, metric).numpy(), getattr(pm_b, metric).numpy()
        if not (np.isfinite(a[ok]).any() and np.isfinite(b[ok]).any()):
            out[metric] = None
            continue
        a, b = np.where(ok, np.nan_to_num(a), 0.0), np.where(ok, np.nan_to_num(b), 0.0)
        boot = RatioBootstrap.run({"diff": groups.row_sums(a - b), "a": groups.row_sums(a), "b": groups.row_sums(b),
                                   "n": groups.row_sums(ok.astype(float))}, groups, n_boot, seed)
        out[metric] = _paired_block(boot, groups)
    first = out["kld"] or {}
    why = first.get("unavailable") if out["kld"] else "no position is finite in both packs"
    out.update({"kld_mean_diff": first.get("diff"), "ci95": first.get("diff_ci95"), "p_value": first.get("p_value"),
                "method": first.get("method"), "unavailable": why})
    return out


def _paired_block(boot: RatioBootstrap, groups: RowGroups) -> dict:
    from statsmodels.stats.multitest import multipletests  # noqa: PLC0415 (~2 s, for Holm only)

    diff, a, b = (ratio_scopes(boot, k, "n", groups, bounds=bounds)
                  for k, bounds in (("diff", SIGNED), ("a", NONNEGATIVE), ("b", NONNEGATIVE)))

    def rel(d: Estimate, base: Estimate, ratio_se: Callable[[], float]) -> Estimate:
        # 100 (A - B) / B = 100 (A / B - 1); `ratio_se`: the linearized SE of A / B, for the analytic interval where
        # the bootstrap cannot resolve the tails (a domain of a few rows)
        with np.errstate(invalid="ignore", divide="ignore"):
            value = 100 * d.value / base.value if d.value is not None and base.value else None
            return Estimate(_finite(value) if value is not None else None, 100 * d.reps / base.reps, d.dof, d.reason,
                            lin_se=lambda: 100 * ratio_se(),
                            bounds=Range(-100.0))     # A's KL >= 0: at most 100 % below B

    def block(d: Estimate, ea: Estimate, eb: Estimate, ratio_se: Callable[[], float]) -> dict:
        r, iv = rel(d, eb, ratio_se), d.interval()
        floor = bootstrap_p_floor(int(np.isfinite(d.reps).sum()), d.dof) if iv.method == "bootstrap" else None
        return {"a": ea.value, "b": eb.value, "diff": d.value, "diff_ci95": iv.ci, "diff_se": d.se(),
                "relative_change_pct": r.value, "relative_change_pct_ci95": r.ci(),
                "relative_change_pct_unavailable": r.interval().reason,
                "p_value": iv.p_value, "p_value_floor": floor, "method": iv.method, "unavailable": iv.reason}

    out = block(diff.overall, a.overall, b.overall, lambda: boot.pooled_se("a", "b"))
    per = {name: block(diff.domains[i], a.domains[i], b.domains[i], lambda i=i: boot.domain_se("a", "b", i))
           for i, name in enumerate(groups.domains)}
    tested = {name: v for name, v in per.items() if v["p_value"] is not None}
    for v in per.values():
        v["p_holm"] = None
    if tested:
        holm = multipletests([v["p_value"] for v in tested.values()], method="holm")[1]
        for v, p in zip(tested.values(), holm):
            v["p_holm"] = float(p)
    out["domains"] = per
    out["domains_equal"] = block(diff.equal, a.equal, b.equal, lambda: domains_equal_ratio_se(boot, "a", "b"))
    return out


def domains_equal_ratio_se(boot: RatioBootstrap, num: str, den: str, n: str = "n") -> float:
    """Linearized SE of mean_d(num_d / n_d) / mean_d(den_d / n_d), the ratio of two domains-equal means (domains
    with no position left out, as `RatioBootstrap.domains_equal` leaves them out): row i of domain d (of D, N_d
    positions) contributes ((num_i - A_d n_i) - R (den_i - B_d n_i)) / (D N_d B), R = A / B, strata = domains."""
    y, x, w, dom = boot._col(num), boot._col(den), boot._col(n), boot.row_domain
    live = [d for d in np.unique(dom) if w[dom == d].sum() > 0]
    if not live:
        return float("nan")
    A = {d: y[dom == d].sum() / w[dom == d].sum() for d in live}
    B = {d: x[dom == d].sum() / w[dom == d].sum() for d in live}
    a_eq, b_eq = float(np.mean(list(A.values()))), float(np.mean(list(B.values())))
    if not b_eq > 0:
        return float("nan")
    r = a_eq / b_eq
    e = np.zeros(len(y))
    for d in live:
        s = dom == d
        e[s] = ((y[s] - A[d] * w[s]) - r * (x[s] - B[d] * w[s])) / (len(live) * w[s].sum() * b_eq)
    return float(np.sqrt(_stratified_var(e, dom)))


def bootstrap_p_floor(n_reps: int, dof: int) -> float:
    """The smallest p-value `interval` gives from `n_reps` bootstrap replicates at `dof` degrees of freedom (no
    replicate, or one, on the far side of 0): 2 t_dof.sf(norm.isf(1 / n_reps)). A p-value there is "< floor"."""
    from scipy.stats import norm, t  # noqa: PLC0415 (scipy.stats: ~1 s; reports and gates import stats)

    return min(1.0, 2 * float(t.sf(norm.isf(1 / n_reps), dof)))


def bootstrap_p_value(reps: np.ndarray, dof: int | None = None) -> float:
    """Two-sided p-value for "the statistic is 0", read off the replicates the way `percentile_ci` reads its interval
    (0 lies outside the 95% interval exactly when p < 0.05). Its floor is about 1 / (len(reps) + 1)."""
    from scipy.stats import norm, t  # noqa: PLC0415 (scipy.stats: ~1 s; reports and gates import stats)

    if len(reps) == 0 or np.all(reps == 0):
        return 1.0
    tail = min((np.sum(reps <= 0) + 1) / (len(reps) + 1), (np.sum(reps >= 0) + 1) / (len(reps) + 1))
    if dof is not None and dof >= 1:
        tail = float(t.sf(norm.isf(tail), dof))
    return float(min(1.0, 2 * tail))
