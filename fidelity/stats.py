"""Summaries of per-position metrics with honest uncertainty.

Positions within one panel row (a conversation) are correlated, so the unit of resampling is the row: every 95% interval
here is a percentile bootstrap over rows, stratified by domain (each replicate redraws each domain's rows with replacement,
keeping the panel's domain mix; Rao-Wu rescaled so small domains do not shrink the variance). Every statistic is a ratio of per-row sums, so a replicate is a matrix product of resample
counts with a [rows, quantities] table and thousands of replicates cost milliseconds.

All KL figures are KL(P_ref || Q_pack) unless the key says `reverse`.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .metrics import PositionMetrics

N_BOOT = 2000
TIE_MARGIN = 0.1          # nats: a reference top-1 margin below this is a near tie; flips there are reported apart
CONFIDENCE_EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0)   # reference top-1 probability buckets
KLD_PERCENTILES = {"kld_median": 50.0, "kld_p90": 90.0, "kld_p99": 99.0, "kld_p999": 99.9}


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
        return cls(np.asarray(row, dtype=np.int64), np.array([index[d] for d in row_domain_names], dtype=np.int64), domains)

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
    draws with replacement, weighted n / (n - 1) (Rao & Wu's rescaling bootstrap; plain n-of-n draws shrink a variance by
    (n - 1) / n per domain, which undercovers with a dozen rows per domain). A domain of one row contributes no variance."""
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


def domain_sums(table: np.ndarray, row_domain: np.ndarray, n_domains: int, counts: np.ndarray | None = None) -> np.ndarray:
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
    from scipy.stats import norm, t

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
    from scipy.stats import norm

    v = np.asarray(values, dtype=np.float64)
    half = norm.ppf(0.5 + level / 2) * v.std(ddof=1) / np.sqrt(len(v))
    return [float(v.mean() - half), float(v.mean() + half)]


@dataclass
class RatioBootstrap:
    """Point estimates and bootstrap replicates of per-domain sums of several additive quantities."""

    names: list[str]
    point: np.ndarray        # [domains, quantities]
    reps: np.ndarray         # [n_boot, domains, quantities]

    @classmethod
    def run(cls, columns: dict[str, np.ndarray], groups: RowGroups, n_boot: int, seed: int) -> "RatioBootstrap":
        names = list(columns)
        table = np.stack([columns[k] for k in names], axis=1)
        counts = bootstrap_counts(groups.row_domain, n_boot, np.random.default_rng(seed))
        nd = len(groups.domains)
        return cls(names, domain_sums(table, groups.row_domain, nd), domain_sums(table, groups.row_domain, nd, counts))

    def _q(self, s: np.ndarray, name: str) -> np.ndarray:
        return s[..., self.names.index(name)]

    def pooled(self, num: str, den: str) -> tuple[float, np.ndarray]:
        f = lambda s: self._q(s, num).sum(-1) / self._q(s, den).sum(-1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return float(f(self.point)), f(self.reps)

    def per_domain(self, num: str, den: str) -> tuple[np.ndarray, np.ndarray]:
        f = lambda s: self._q(s, num) / self._q(s, den)
        with np.errstate(invalid="ignore", divide="ignore"):
            return f(self.point), f(self.reps)

    def domains_equal(self, num: str, den: str) -> tuple[float, np.ndarray]:
        point, reps = self.per_domain(num, den)
        with warnings.catch_warnings():   # a pack with no finite position anywhere has no mean: NaN, reported as null
            warnings.simplefilter("ignore", RuntimeWarning)
            return float(np.nanmean(point)), np.nanmean(reps, axis=-1)


def _finite(x: float) -> float | None:
    return float(x) if x is not None and np.isfinite(x) else None


def _exp_ci(ci: list) -> list:
    return [float(np.exp(x)) if x is not None else None for x in ci]


def summarize(pm: PositionMetrics, groups: RowGroups, *, n_boot: int = N_BOOT, seed: int = 0,
              tie_margin: float = TIE_MARGIN) -> dict:
    """Overall (pooled and domains-equal) and per-domain statistics of one pack against the reference, with 95% CIs.
    Non-finite positions are counted (`nonfinite`) and left out of every average."""
    m = pm.to_numpy()
    ok = m["finite"]
    row = groups.row
    w = ok.astype(np.float64)
    z = lambda x: np.where(ok, x, 0.0)
    ref_p, pack_p = np.exp(-z(m["ref_nll"])), np.exp(-z(m["pack_nll"]))
    agree = (m["ref_top1"] == m["pack_top1"]) & ok
    tie = ok & (z(m["ref_margin"]) < tie_margin)
    columns = {
        "n": w, "kld": z(m["kld"]), "kld_reverse": z(m["kld_reverse"]), "agree": agree.astype(float),
        "ref_nll": z(m["ref_nll"]), "pack_nll": z(m["pack_nll"]), "dnll": z(m["pack_nll"] - m["ref_nll"]),
        "dp": z(pack_p - ref_p), "dp2": z((pack_p - ref_p) ** 2),
        "n_tie": tie.astype(float), "flip_tie": (tie & ~agree).astype(float),
        "n_clear": (ok & ~tie).astype(float), "flip_clear": (ok & ~tie & ~agree).astype(float),
        "nonfinite": (~ok).astype(float),
    }
    boot = RatioBootstrap.run({k: groups.row_sums(v) for k, v in columns.items()}, groups, n_boot, seed)
    dof = groups.dof()

    def stat(num, den="n"):
        est, reps = boot.pooled(num, den)
        return _finite(est), percentile_ci(reps, dof=dof)

    kld, kld_ci = stat("kld")
    kld_eq, kld_eq_reps = boot.domains_equal("kld", "n")
    top1, top1_ci = stat("agree")
    top1_eq, top1_eq_reps = boot.domains_equal("agree", "n")
    dnll, dnll_ci = stat("dnll")
    ref_nll, _ = stat("ref_nll")
    pack_nll, pack_nll_ci = stat("pack_nll")
    dp2, _ = stat("dp2")
    finite_kld = m["kld"][ok]
    has_reverse = bool(np.isfinite(m["kld_reverse"][ok]).any()) if ok.any() else False
    overall = {
        "positions": int(ok.sum()), "nonfinite": int((~ok).sum()),
        "kld_mean": kld, "kld_mean_ci95": kld_ci,
        "kld_domains_equal": _finite(kld_eq), "kld_domains_equal_ci95": percentile_ci(kld_eq_reps, dof=dof),
        "kld_reverse_mean": stat("kld_reverse")[0] if has_reverse else None,
        "top1": top1, "top1_ci95": top1_ci,
        "top1_domains_equal": _finite(top1_eq), "top1_domains_equal_ci95": percentile_ci(top1_eq_reps, dof=dof),
        "tie_margin": tie_margin,
        "top1_flips_clear": int(columns["flip_clear"].sum()), "clear_positions": int(columns["n_clear"].sum()),
        "top1_flips_near_tie": int(columns["flip_tie"].sum()), "near_tie_positions": int(columns["n_tie"].sum()),
        "ppl": _finite(np.exp(pack_nll)) if pack_nll is not None else None,
        "ppl_ci95": _exp_ci(pack_nll_ci),
        "ppl_ref": _finite(np.exp(ref_nll)) if ref_nll is not None else None,
        "ln_ppl_ratio": dnll, "ln_ppl_ratio_ci95": dnll_ci,
        "delta_nll_mean": dnll,
        "delta_p_mean": stat("dp")[0], "rms_delta_p": _finite(np.sqrt(dp2)) if dp2 is not None else None,
    }
    for key, q in KLD_PERCENTILES.items():
        overall[key] = float(np.percentile(finite_kld, q)) if finite_kld.size else None
    overall["kld_max"] = float(finite_kld.max()) if finite_kld.size else None
    overall["kld_by_ref_confidence"] = confidence_buckets(m["kld"][ok], m["ref_pmax"][ok])

    domains = {}
    d_kld, d_kld_reps = boot.per_domain("kld", "n")
    d_top1, d_top1_reps = boot.per_domain("agree", "n")
    d_nll, d_nll_reps = boot.per_domain("pack_nll", "n")
    d_ref_nll, _ = boot.per_domain("ref_nll", "n")
    pos_domain = groups.row_domain[row]
    for i, name in enumerate(groups.domains):
        sel = ok & (pos_domain == i)
        k = m["kld"][sel]
        domains[name] = {
            "rows": int((groups.row_domain == i).sum()), "positions": int(sel.sum()),
            "nonfinite": int((~ok & (pos_domain == i)).sum()),
            "kld_mean": _finite(d_kld[i]), "kld_mean_ci95": percentile_ci(d_kld_reps[:, i], dof=groups.dof(i)),
            "top1": _finite(d_top1[i]), "top1_ci95": percentile_ci(d_top1_reps[:, i], dof=groups.dof(i)),
            "ppl": _finite(np.exp(d_nll[i])), "ppl_ci95": _exp_ci(percentile_ci(d_nll_reps[:, i], dof=groups.dof(i))),
            "ppl_ref": _finite(np.exp(d_ref_nll[i])),
            "kld_median": float(np.median(k)) if k.size else None, "kld_p99": float(np.percentile(k, 99)) if k.size else None,
        }
    return {"overall": overall, "domains": domains}


def confidence_buckets(kld: np.ndarray, ref_pmax: np.ndarray, edges=CONFIDENCE_EDGES) -> list[dict]:
    """Mean KL(P_ref || Q_pack) by the reference's confidence in its top-1 token."""
    out = []
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        upper = ref_pmax <= hi if i == len(edges) - 2 else ref_pmax < hi
        sel = (ref_pmax >= lo) & upper
        out.append({"ref_confidence": [lo, hi], "positions": int(sel.sum()),
                    "kld_mean": float(kld[sel].mean()) if sel.any() else None})
    return out


def paired_difference(pm_a: PositionMetrics, pm_b: PositionMetrics, groups: RowGroups, *, n_boot: int = N_BOOT,
                      seed: int = 0) -> dict:
    """Pack A vs pack B on the same positions: mean of KL_a - KL_b (both KL(P_ref || pack)) over positions finite in both,
    a 95% CI by the row bootstrap (rows keep A and B together, so the pairing is kept), and a two-sided bootstrap p-value
    for "no difference" (its floor is 1 / (n_boot + 1))."""
    ok = pm_a.finite.numpy() & pm_b.finite.numpy()
    diff = np.where(ok, pm_a.kld.numpy() - pm_b.kld.numpy(), 0.0)
    boot = RatioBootstrap.run({"diff": groups.row_sums(diff), "n": groups.row_sums(ok.astype(float))}, groups, n_boot, seed)
    est, reps = boot.pooled("diff", "n")
    reps = reps[np.isfinite(reps)]
    dof = groups.dof()
    return {"kld_mean_diff": _finite(est), "ci95": percentile_ci(reps, dof=dof),
            "p_value": bootstrap_p_value(reps, dof=dof), "positions": int(ok.sum())}


def bootstrap_p_value(reps: np.ndarray, dof: int | None = None) -> float:
    """Two-sided p-value for "the statistic is 0", read off the replicates the way `percentile_ci` reads its interval
    (0 lies outside the 95% interval exactly when p < 0.05). Its floor is about 1 / (len(reps) + 1)."""
    from scipy.stats import norm, t

    if len(reps) == 0 or np.all(reps == 0):
        return 1.0
    tail = min((np.sum(reps <= 0) + 1) / (len(reps) + 1), (np.sum(reps >= 0) + 1) / (len(reps) + 1))
    if dof is not None and dof >= 1:
        tail = float(t.sf(norm.isf(tail), dof))
    return float(min(1.0, 2 * tail))
