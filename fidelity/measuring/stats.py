"""Summaries of per-position metrics with honest uncertainty: `summarize` (one pack against the reference: overall,
per domain and domains-equal) and `paired_difference` (pack A against pack B on the same positions).

Every 95% interval is a percentile bootstrap over rows, stratified by domain (`measuring.bootstrap`), or where too few
rows leave the bootstrap unable to resolve the tails an analytic interval that keeps to the statistic's range, with the
p-value read off the same interval (`measuring.intervals`); under MIN_ROWS rows neither is available, with the reason.

All KL figures are KL(P_ref || Q_pack) unless the key says `reverse`.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .bootstrap import (Estimate, RatioBootstrap, RowGroups, RowScope, add_rows_worse, bootstrap_counts,
                        domain_sums, domains_equal_ratio_se, finite_or_none, not_available, quantile_reps,
                        ratio_scopes, row_scopes, rows_worse, rows_worse_share, weighted_quantile)
from .intervals import DELTA_P, NONNEGATIVE, SHARE, SIGNED, UNIT, Range, bootstrap_p_floor
from .metrics import TOPK, PositionMetrics

N_BOOT = 2000
TIE_MARGIN = 0.1          # nats: a reference top-1 margin below this is a near tie; flips there are reported apart
CONFIDENCE_EDGES = (0.0, 0.25, 0.5, 0.75, 0.95, 1.0)   # reference top-1 probability buckets (exllamav3 model_diff's)
KLD_PERCENTILES = {"kld_median": 50.0, "kld_p90": 90.0, "kld_p99": 99.0, "kld_p999": 99.9}


def _exp_ci(ci: list | None) -> list | None:
    return [float(np.exp(x)) for x in ci] if ci is not None else None

def _ci_dict(e: Estimate, key: str, se: bool = False) -> dict:
    out = {key: e.value, f"{key}_ci95": e.ci()}
    if se:
        out[f"{key}_se"] = e.se()
    return out

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
    return {"ppl": finite_or_none(np.exp(pack_nll.value)) if pack_nll.value is not None else None,
            "ppl_ci95": _exp_ci(pack_nll.ci()),
            "ppl_ref": finite_or_none(np.exp(ref_nll.value)) if ref_nll.value is not None else None}


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
            return Estimate(finite_or_none(value) if value is not None else None, 100 * d.reps / base.reps, d.dof,
                            d.reason, lin_se=lambda: 100 * ratio_se(),
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
