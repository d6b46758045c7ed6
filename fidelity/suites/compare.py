"""Paired comparison of two suite runs over the same items: McNemar for pass/fail, paired t and Wilcoxon for scores.

Run A is the reference (native), run B the candidate. The verdict rule: B fails when its drop from A is larger than
`threshold_points` percentage points *and* the paired test says p < `alpha`. Items are paired by `item_id` and only where both
runs sent the same prompt (same prompt hash); anything else is reported, never silently dropped. Items with an engine error on
either side are excluded from the test and counted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import stats

from .records import RunError, read_manifest, read_records

EXACT_MAX_DISCORDANT = 25  # below this many discordant pairs McNemar uses the exact binomial test, else the mid-p version


@dataclass
class McNemar:
    b: int  # A pass, B fail
    c: int  # A fail, B pass
    p_value: float
    method: str


def mcnemar(b: int, c: int, exact_max: int = EXACT_MAX_DISCORDANT) -> McNemar:
    """Two-sided McNemar test on the discordant counts. Exact binomial (b ~ Bin(b + c, 1/2)) when b + c < exact_max, else the
    mid-p variant (exact p minus the probability of the observed table), which keeps the level closer to nominal. With no
    discordant pair there is no evidence of a difference: p = 1."""
    n = b + c
    if n == 0:
        return McNemar(b, c, 1.0, "no discordant pairs")
    k = min(b, c)
    exact = min(1.0, 2.0 * stats.binom.cdf(k, n, 0.5))
    if n < exact_max:
        return McNemar(b, c, exact, "mcnemar-exact")
    return McNemar(b, c, min(1.0, exact - stats.binom.pmf(k, n, 0.5)), "mcnemar-mid-p")


@dataclass
class PairedT:
    mean: float
    t: float
    df: int
    p_value: float


def paired_t(diff: np.ndarray) -> PairedT:
    """One-sample t-test of the paired differences against 0. Zero variance: p = 1 when all differences are 0, else 0."""
    diff = np.asarray(diff, dtype=np.float64)
    n = diff.size
    if n < 2:
        return PairedT(float(diff.mean()) if n else 0.0, math.nan, max(n - 1, 0), 1.0)
    mean, sd = diff.mean(), diff.std(ddof=1)
    if sd == 0:
        return PairedT(float(mean), math.copysign(math.inf, mean) if mean else 0.0, n - 1, 1.0 if mean == 0 else 0.0)
    t = mean / (sd / math.sqrt(n))
    return PairedT(float(mean), float(t), n - 1, float(2 * stats.t.sf(abs(t), n - 1)))


@dataclass
class Wilcoxon:
    n: int  # non-zero differences
    w_plus: float  # sum of the ranks of positive differences
    p_value: float
    method: str


def _exact_signed_rank_counts(n: int) -> np.ndarray:
    """counts[w] = number of sign patterns of ranks 1..n whose positive ranks sum to w."""
    counts = np.zeros(n * (n + 1) // 2 + 1, dtype=np.float64)
    counts[0] = 1
    for r in range(1, n + 1):
        counts[r:] = counts[r:] + counts[:-r].copy()
    return counts


def wilcoxon(diff: np.ndarray, exact_max_n: int = 50) -> Wilcoxon:
    """Wilcoxon signed-rank test, zeros dropped (Wilcoxon's convention). Exact null distribution when there are at most
    `exact_max_n` non-zero differences and no ties among their magnitudes; else the normal approximation with the tie
    correction and no continuity correction."""
    d = np.asarray(diff, dtype=np.float64)
    d = d[d != 0]
    n = d.size
    if n == 0:
        return Wilcoxon(0, 0.0, 1.0, "no non-zero differences")
    ranks = stats.rankdata(np.abs(d))
    w_plus = float(ranks[d > 0].sum())
    _, tie_sizes = np.unique(np.abs(d), return_counts=True)
    if n <= exact_max_n and (tie_sizes == 1).all():
        counts = _exact_signed_rank_counts(n)
        total = 2.0 ** n
        w = int(round(w_plus))
        lower, upper = counts[: w + 1].sum() / total, counts[w:].sum() / total
        return Wilcoxon(n, w_plus, float(min(1.0, 2 * min(lower, upper))), "wilcoxon-exact")
    mean = n * (n + 1) / 4
    var = n * (n + 1) * (2 * n + 1) / 24 - (tie_sizes ** 3 - tie_sizes).sum() / 48
    if var <= 0:
        return Wilcoxon(n, w_plus, 1.0, "wilcoxon-normal")
    z = (w_plus - mean) / math.sqrt(var)
    return Wilcoxon(n, w_plus, float(2 * stats.norm.sf(abs(z))), "wilcoxon-normal")


def _pairs(a, b):
    """Joins two record tables on item_id; returns (paired frame, report of what could not be paired)."""
    merged = a.merge(b, on="item_id", how="outer", suffixes=("_a", "_b"), indicator=True)
    only_a = sorted(merged.loc[merged["_merge"] == "left_only", "item_id"])
    only_b = sorted(merged.loc[merged["_merge"] == "right_only", "item_id"])
    both = merged[merged["_merge"] == "both"]
    changed = both["prompt_hash_a"] != both["prompt_hash_b"]
    err_a, err_b = both["error_a"].astype(bool), both["error_b"].astype(bool)
    usable = both[~changed & ~err_a & ~err_b]
    report = {"only_in_a": only_a, "only_in_b": only_b, "prompt_changed": sorted(both.loc[changed, "item_id"]),
              "errors": {"a": int(err_a.sum()), "b": int(err_b.sum()), "excluded_pairs": int((~changed & (err_a | err_b)).sum())}}
    return usable, report


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact binomial interval for k successes in n trials."""
    if n == 0:
        return (0.0, 1.0)
    a = (1 - level) / 2
    lo = 0.0 if k == 0 else float(stats.beta.ppf(a, k, n - k + 1))
    hi = 1.0 if k == n else float(stats.beta.ppf(1 - a, k + 1, n - k))
    return lo, hi


def mean_ci(diff: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """t interval of the mean paired difference."""
    n = diff.size
    if n < 2:
        return (math.nan, math.nan)
    half = stats.t.ppf(0.5 + level / 2, n - 1) * diff.std(ddof=1) / math.sqrt(n)
    return float(diff.mean() - half), float(diff.mean() + half)


def _verdict(drop_points: float, p: float, threshold: float, alpha: float, aa: bool, flips: int, n: int) -> str:
    if aa:
        return f"A/A noise floor: {flips} of {n} items flip ({100 * flips / n if n else 0:.2f}%)"
    if n == 0:
        return "no paired items"
    return "fail" if drop_points > threshold and p < alpha else "pass"


def compare_runs(run_a: str | Path, run_b: str | Path, *, threshold_points: float = 1.0, alpha: float = 0.05,
                 aa: bool = False, exact_max: int = EXACT_MAX_DISCORDANT) -> dict:
    ma, mb = read_manifest(run_a), read_manifest(run_b)
    if ma.get("suite") != mb.get("suite"):
        raise RunError(f"runs are of different suites: {ma.get('suite')!r} vs {mb.get('suite')!r}", file=Path(run_b) / "manifest.json")
    usable, report = _pairs(read_records(run_a), read_records(run_b))
    n = len(usable)
    out = {"suite": ma["suite"], "a": str(run_a), "b": str(run_b), "mode": "A/A" if aa else "A/B", "n_items": n,
           "threshold_points": threshold_points, "alpha": alpha, **report}
    warnings = []
    if ma.get("data") != mb.get("data"):
        warnings.append("the runs' data sources differ (hash or path); pairing used item ids and prompt hashes")
    if ma.get("suite_config") != mb.get("suite_config"):
        warnings.append(f"the runs' suite settings differ: {ma.get('suite_config')} vs {mb.get('suite_config')}")
    unsafe = [k for k, m in (("A", ma), ("B", mb)) if m.get("unsafe_no_sandbox")]
    if unsafe:
        warnings.append(f"run {' and '.join(unsafe)} ran generated code without the sandbox (--unsafe-no-sandbox)")
    if warnings:
        out["warning"] = "; ".join(warnings)
    metric = ma.get("metric", "passed")
    out["metric"] = metric
    if n and usable["passed_a"].notna().all() and usable["passed_b"].notna().all():
        pa_, pb_ = usable["passed_a"].astype(bool).to_numpy(), usable["passed_b"].astype(bool).to_numpy()
        b, c = int((pa_ & ~pb_).sum()), int((~pa_ & pb_).sum())
        mc = mcnemar(b, c, exact_max)
        drop = 100.0 * (b - c) / n
        out["passed"] = {"pass_rate_a": float(pa_.mean()), "pass_rate_b": float(pb_.mean()), "drop": drop,
                         "flips_a_to_b": b, "flips_b_to_a": c, "test": mc.method, "p_value": mc.p_value,
                         "flip_rate": (b + c) / n, "flip_rate_ci95": clopper_pearson(b + c, n),
                         "verdict": _verdict(drop, mc.p_value, threshold_points, alpha, aa, b + c, n)}
    sa, sb = usable["score_a"], usable["score_b"]
    if n and sa.notna().all() and sb.notna().all():
        diff = (sa.to_numpy(float) - sb.to_numpy(float))
        t, w = paired_t(diff), wilcoxon(diff)
        drop = 100.0 * t.mean
        out["score"] = {"score_a": float(sa.mean()), "score_b": float(sb.mean()), "drop": drop,
                        "flips_a_to_b": int((diff > 0).sum()), "flips_b_to_a": int((diff < 0).sum()),
                        "drop_ci95": [100.0 * x for x in mean_ci(diff)], "test": "paired-t", "t": t.t, "df": t.df,
                        "p_value": t.p_value,
                        "wilcoxon": {"n": w.n, "w_plus": w.w_plus, "p_value": w.p_value, "method": w.method},
                        "verdict": _verdict(drop, t.p_value, threshold_points, alpha, aa, int((diff != 0).sum()), n)}
    primary = out.get(metric) or out.get("passed") or out.get("score")
    if primary:
        for k in ("drop", "flips_a_to_b", "flips_b_to_a", "test", "p_value", "verdict"):
            out[k] = primary[k]
        if "pass_rate_a" in primary:
            out["pass_rate_a"], out["pass_rate_b"] = primary["pass_rate_a"], primary["pass_rate_b"]
    else:
        out["verdict"] = "no paired items"
    return out
