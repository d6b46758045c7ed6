"""Paired comparison of two suite runs over the same items: McNemar for pass/fail, paired t and Wilcoxon for scores
(statsmodels' and scipy's tests; what is ours is the pairing, the policy around degenerate cases and the verdict).

Run A is the reference (native), run B the candidate. The verdict rule: B fails when its drop from A is larger than
`threshold_points` percentage points *and* the paired test says p < `alpha`. Items are paired by `item_id` and only
where both runs sent the same prompt (same prompt hash); anything else is reported, never silently dropped. Items with
an engine error on either side are excluded from the test and counted. Each named metric of the records (evalplus base /
plus, IFEval's four) gets its own paired test (`paired_metric`); the verdict is the suite's primary metric's. Suites
that group their items (the manifest's `group_by`: toolcall's BFCL category, needle's length x depth cell) get a McNemar
test per group (`groups`), and chat runs whose records carry a reasoning length get its paired change (`reasoning`,
B - A).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import stats
from statsmodels.stats.contingency_tables import mcnemar as sm_mcnemar

from .records import RunError, read_manifest, read_records

EXACT_MAX_DISCORDANT = (
    25  # below this many discordant pairs McNemar uses the exact binomial test, else the mid-p version
)


@dataclass
class McNemar:
    b: int  # A pass, B fail
    c: int  # A fail, B pass
    p_value: float
    method: str


def mcnemar(b: int, c: int, exact_max: int = EXACT_MAX_DISCORDANT) -> McNemar:
    """Two-sided McNemar test on the discordant counts (statsmodels' exact binomial McNemar) when b + c < exact_max,
    else its mid-p variant (the exact p minus the probability of the observed table, scipy's binomial pmf), which keeps
    the level closer to nominal. With no discordant pair there is no evidence of a difference: p = 1."""
    n = b + c
    if n == 0:
        return McNemar(b, c, 1.0, "no discordant pairs")
    exact = float(min(1.0, sm_mcnemar(np.array([[0, b], [c, 0]]), exact=True).pvalue))
    if n < exact_max:
        return McNemar(b, c, exact, "mcnemar-exact")
    return McNemar(b, c, min(1.0, exact - float(stats.binom.pmf(min(b, c), n, 0.5))), "mcnemar-mid-p")


@dataclass
class PairedT:
    mean: float
    t: float
    df: int
    p_value: float


def paired_t(diff: np.ndarray) -> PairedT:
    """scipy's one-sample t-test of the paired differences against 0 (= ttest_rel of the two sides). Zero variance,
    where the test is undefined: p = 1 when all differences are 0, else 0."""
    diff = np.asarray(diff, dtype=np.float64)
    n = diff.size
    if n < 2:
        return PairedT(float(diff.mean()) if n else 0.0, math.nan, max(n - 1, 0), 1.0)
    mean = diff.mean()
    if diff.std(ddof=1) == 0:
        return PairedT(float(mean), math.copysign(math.inf, mean) if mean else 0.0, n - 1, 1.0 if mean == 0 else 0.0)
    res = stats.ttest_1samp(diff, 0.0)
    return PairedT(float(mean), float(res.statistic), n - 1, float(res.pvalue))


@dataclass
class Wilcoxon:
    n: int  # non-zero differences
    w_plus: float  # sum of the ranks of positive differences
    p_value: float
    method: str


def wilcoxon(diff: np.ndarray, exact_max_n: int = 50) -> Wilcoxon:
    """scipy's Wilcoxon signed-rank test, zeros dropped (Wilcoxon's convention): its exact null distribution when there
    are at most `exact_max_n` non-zero differences and no ties among their magnitudes, else its normal approximation
    with the tie correction and no continuity correction."""
    d = np.asarray(diff, dtype=np.float64)
    d = d[d != 0]
    n = d.size
    if n == 0:
        return Wilcoxon(0, 0.0, 1.0, "no non-zero differences")
    w_plus = float(stats.rankdata(np.abs(d))[d > 0].sum())
    exact = n <= exact_max_n and len(np.unique(np.abs(d))) == n
    res = stats.wilcoxon(d, zero_method="wilcox", correction=False, method="exact" if exact else "approx")
    return Wilcoxon(n, w_plus, float(min(1.0, res.pvalue)), "wilcoxon-exact" if exact else "wilcoxon-normal")


def _pairs(a, b):
    """Joins two record tables on item_id; returns (paired frame, report of what could not be paired)."""
    merged = a.merge(b, on="item_id", how="outer", suffixes=("_a", "_b"), indicator=True)
    only_a = sorted(merged.loc[merged["_merge"] == "left_only", "item_id"])
    only_b = sorted(merged.loc[merged["_merge"] == "right_only", "item_id"])
    both = merged[merged["_merge"] == "both"]
    changed = both["prompt_hash_a"] != both["prompt_hash_b"]
    err_a, err_b = both["error_a"].astype(bool), both["error_b"].astype(bool)
    usable = both[~changed & ~err_a & ~err_b]
    report = {
        "only_in_a": only_a,
        "only_in_b": only_b,
        "prompt_changed": sorted(both.loc[changed, "item_id"]),
        "errors": {
            "a": int(err_a.sum()),
            "b": int(err_b.sum()),
            "excluded_pairs": int((~changed & (err_a | err_b)).sum()),
        },
    }
    return usable, report


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact (Clopper-Pearson) binomial interval for k successes in n trials (scipy's binomtest)."""
    if n == 0:
        return (0.0, 1.0)
    ci = stats.binomtest(int(k), int(n)).proportion_ci(confidence_level=level, method="exact")
    return float(ci.low), float(ci.high)


def mean_ci(diff: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """t interval of the mean paired difference (scipy's one-sample t-test)."""
    diff = np.asarray(diff, dtype=np.float64)
    if diff.size < 2:
        return (math.nan, math.nan)
    if diff.std(ddof=1) == 0:
        return float(diff.mean()), float(diff.mean())
    ci = stats.ttest_1samp(diff, 0.0).confidence_interval(confidence_level=level)
    return float(ci.low), float(ci.high)


def paired_metric(ka: np.ndarray, na: np.ndarray, kb: np.ndarray, nb: np.ndarray, *, threshold: float, alpha: float,
                  aa: bool, exact_max: int = EXACT_MAX_DISCORDANT) -> dict:
    """One named metric of two runs over the same items, each item `k` followed of `n` (the same `n` on both sides: the
    same prompts). Rates are pooled, sum(k) / sum(n). One trial per item (evalplus base / plus, IFEval prompt-level):
    McNemar on the discordant items. Several (IFEval instruction-level): the pooled difference is
    sum(ka - kb) / sum(n) = mean(ka - kb) * items / sum(n), so the paired t test and Wilcoxon of the per-item count
    differences test it, items (not instructions) being the independent units, and the t interval of the mean scales to
    it."""
    ka, na, kb, nb = (np.asarray(x, dtype=np.int64) for x in (ka, na, kb, nb))
    if not np.array_equal(na, nb):
        bad = int(np.flatnonzero(na != nb)[0])
        return {"error": f"item {bad} of the pairs has {na[bad]} trials in A but {nb[bad]} in B"}
    m, total = ka.size, int(na.sum())
    rate_a, rate_b = float(ka.sum() / total), float(kb.sum() / total)
    drop = 100.0 * (rate_a - rate_b)
    out = {"rate_a": rate_a, "rate_b": rate_b, "followed_a": int(ka.sum()), "followed_b": int(kb.sum()), "of": total,
           "items": m, "drop": drop}
    if np.all(na == 1):
        b, c = int(((ka == 1) & (kb == 0)).sum()), int(((ka == 0) & (kb == 1)).sum())
        mc = mcnemar(b, c, exact_max)
        return {**out, "flips_a_to_b": b, "flips_b_to_a": c, "test": mc.method, "p_value": mc.p_value,
                "verdict": _verdict(drop, mc.p_value, threshold, alpha, aa, b + c, m)}
    d = (ka - kb).astype(np.float64)
    t, w = paired_t(d), wilcoxon(d)
    scale = 100.0 * m / total
    return {**out, "items_worse": int((d > 0).sum()), "items_better": int((d < 0).sum()),
            "drop_ci95": [scale * x for x in mean_ci(d)], "test": "paired-t on per-item counts", "t": t.t, "df": t.df,
            "p_value": t.p_value, "wilcoxon": {"n": w.n, "w_plus": w.w_plus, "p_value": w.p_value, "method": w.method},
            "verdict": _verdict(drop, t.p_value, threshold, alpha, aa, int((d != 0).sum()), m)}


def _metric_columns(usable) -> dict[str, tuple]:
    """{name: (ka, na, kb, nb)} for each named metric that every paired item has on both sides."""
    pa_ = [json.loads(x or "{}") for x in usable["metrics_a"]]
    pb_ = [json.loads(x or "{}") for x in usable["metrics_b"]]
    if not pa_:
        return {}
    names = [k for k in pa_[0] if all(k in r for r in pa_) and all(k in r for r in pb_)]
    return {k: tuple(np.array([r[k][j] for r in side]) for side, j in ((pa_, 0), (pa_, 1), (pb_, 0), (pb_, 1)))
            for k in names}


def paired_groups(usable, key: str, *, exact_max: int = EXACT_MAX_DISCORDANT) -> dict:
    """Pass rates and McNemar per group of items, the group read from each record's details[`key`] (the same on both
    sides: the same prompts). No verdict per group: the suite's verdict rule is for the whole suite."""
    if not len(usable) or not (usable["passed_a"].notna().all() and usable["passed_b"].notna().all()):
        return {}
    ga = [json.loads(d or "{}").get(key) for d in usable["details_a"]]
    gb = [json.loads(d or "{}").get(key) for d in usable["details_b"]]
    pa_, pb_ = usable["passed_a"].astype(bool).to_numpy(), usable["passed_b"].astype(bool).to_numpy()
    out = {}
    for g in dict.fromkeys(x for x in ga if x is not None):
        sel = np.array([x == g and y == g for x, y in zip(ga, gb)])
        n = int(sel.sum())
        b, c = int((pa_[sel] & ~pb_[sel]).sum()), int((~pa_[sel] & pb_[sel]).sum())
        mc = mcnemar(b, c, exact_max)
        out[str(g)] = {"items": n, "passed_a": int(pa_[sel].sum()), "passed_b": int(pb_[sel].sum()),
                       "pass_rate_a": float(pa_[sel].mean()), "pass_rate_b": float(pb_[sel].mean()),
                       "drop": 100.0 * (b - c) / n, "flips_a_to_b": b, "flips_b_to_a": c, "test": mc.method,
                       "p_value": mc.p_value}
    return out


def ratio_of_means_ci(a: np.ndarray, b: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """Interval of 100 (mean(b) / mean(a) - 1) for paired samples: t interval (n - 1 dof) on log(mean b) - log(mean a)
    with the delta-method variance var(b)/(n mb^2) + var(a)/(n ma^2) - 2 cov(a, b)/(n ma mb), exponentiated."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    n = a.size
    ma, mb = a.mean(), b.mean()
    if n < 2 or ma <= 0 or mb <= 0:
        return (math.nan, math.nan)
    cov = np.cov(a, b, ddof=1)
    var = cov[1, 1] / (n * mb * mb) + cov[0, 0] / (n * ma * ma) - 2 * cov[0, 1] / (n * ma * mb)
    half = float(stats.t.ppf(0.5 + level / 2, n - 1) * math.sqrt(max(var, 0.0)))
    centre = math.log(mb / ma)
    return 100.0 * (math.exp(centre - half) - 1), 100.0 * (math.exp(centre + half) - 1)


def paired_reasoning(usable) -> dict | None:
    """Reasoning length of the paired items, B against A (tokens where both sides have a count, else characters):
    means, the mean change with its t interval, the paired t and Wilcoxon p, the relative change of the means with its
    interval (`ratio_of_means_ci`), and how many items reasoned longer / shorter."""
    def side(col):
        return [(json.loads(d or "{}").get("reasoning") or None) for d in usable[col]]

    ra, rb = side("details_a"), side("details_b")
    both = [(x, y) for x, y in zip(ra, rb) if x is not None and y is not None]
    if not both:
        return None
    if all(x.get("tokens") is not None and y.get("tokens") is not None for x, y in both):
        unit, key = "tokens", "tokens"
    else:
        unit, key = "characters", "chars"
    a = np.array([x[key] for x, _ in both], dtype=np.float64)
    b = np.array([y[key] for _, y in both], dtype=np.float64)
    out = {
        "unit": unit,
        "items": len(both),
        "with_reasoning_a": int((a > 0).sum()),
        "with_reasoning_b": int((b > 0).sum()),
        "mean_a": float(a.mean()),
        "mean_b": float(b.mean()),
    }
    if not (a > 0).any() and not (b > 0).any():
        return {
            **out,
            "note": "no reply on either side carried separated reasoning (thinking off, or the engine has no "
            "reasoning parser and left it in the content)",
        }
    d = b - a
    t, w = paired_t(d), wilcoxon(d)
    pct = 100.0 * (out["mean_b"] / out["mean_a"] - 1) if out["mean_a"] > 0 else None
    return {**out, "change_mean": float(d.mean()), "change_ci95": list(mean_ci(d)), "change_pct": pct,
            "change_pct_ci95": list(ratio_of_means_ci(a, b)) if pct is not None else None,
            "items_longer": int((d > 0).sum()), "items_shorter": int((d < 0).sum()), "test": "paired-t",
            "p_value": t.p_value, "wilcoxon": {"n": w.n, "w_plus": w.w_plus, "p_value": w.p_value, "method": w.method}}


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
        raise RunError(
            f"runs are of different suites: {ma.get('suite')!r} vs {mb.get('suite')!r}",
            file=Path(run_b) / "manifest.json",
        )
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
    metrics = {name: paired_metric(*cols, threshold=threshold_points, alpha=alpha, aa=aa, exact_max=exact_max)
               for name, cols in _metric_columns(usable).items()} if n else {}
    if metrics:
        out["metrics"] = metrics
    out["cut_by_limit"] = {"a": int((usable["finish_reason_a"] == "length").sum()),
                           "b": int((usable["finish_reason_b"] == "length").sum())}
    group_by = ma.get("group_by")
    if group_by and group_by == mb.get("group_by"):
        out["group_by"] = group_by
        out["groups"] = paired_groups(usable, group_by, exact_max=exact_max)
    reasoning = paired_reasoning(usable) if n else None
    if reasoning:
        out["reasoning"] = reasoning
    primary = out.get(metric) or out.get("passed") or out.get("score")
    if primary:
        for k in ("drop", "flips_a_to_b", "flips_b_to_a", "test", "p_value", "verdict"):
            out[k] = primary[k]
        if "pass_rate_a" in primary:
            out["pass_rate_a"], out["pass_rate_b"] = primary["pass_rate_a"], primary["pass_rate_b"]
    else:
        out["verdict"] = "no paired items"
    return out
