"""The row bootstrap every statistic's uncertainty comes from, and the scopes a statistic is reported in.

Positions within one panel row (a conversation) are correlated, so the unit of resampling is the row: every replicate
redraws each domain's rows with replacement (stratified by domain, keeping the panel's domain mix; Rao-Wu rescaled so
small domains do not shrink the variance). Every statistic is a ratio of per-row sums, so a replicate is a matrix
product of resample counts with a [rows, quantities] table and thousands of replicates cost milliseconds. An `Estimate`
turns its replicates (or its linearized SE) into a 95% interval and p-value (`measuring.intervals`).

Small samples are honest: a 95% interval or p-value over fewer than MIN_ROWS rows (a domain's own, or the panel's), or
over a domain of one row (its variance is unknown), is reported as not available (null, with the reason) rather than
as a zero-width interval.

Rows worse (`add_rows_worse`, `rows_worse_share`, `rows_worse`) over `row_scopes` is the one builder compare's summary
and the gates share.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .intervals import SHARE, SIGNED, Interval, Range, bootstrap_se, interval, sign_test

MIN_ROWS = 3               # a 95% interval or p-value over fewer rows (overall or in a domain) is not available


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

def finite_or_none(x: float) -> float | None:
    return float(x) if x is not None and np.isfinite(x) else None

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
        return Estimate(finite_or_none(f(value)), f(reps), dof, reason, se(lin_se), bounds, float(count))

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
