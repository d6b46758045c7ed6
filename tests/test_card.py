"""`fidelity card`: the model-card section from fidelity's results alone (golden Markdown, every annotated number equal to
the JSON field it names), and the statistics it reads that compare did not carry before (absolute NLL per scope, the
relative change's interval where the bootstrap cannot resolve the tails, the p-value floor)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from fidelity.measuring.metrics import PositionMetrics
from fidelity.measuring.stats import RowGroups, paired_difference, summarize

FIXTURES = Path(__file__).parent / "fixtures" / "card"


def _metrics(kld, ref_nll, pack_nll, finite=None) -> PositionMetrics:
    n = len(kld)
    finite = np.ones(n, bool) if finite is None else finite
    t = lambda x: torch.as_tensor(np.where(finite, np.asarray(x, dtype=np.float64), np.nan))
    top = torch.zeros(n, dtype=torch.int64)
    return PositionMetrics(kld=t(kld), kld_reverse=torch.full((n,), float("nan"), dtype=torch.float64), ref_top1=top,
                           pack_top1=top, ref_margin=t(np.ones(n)), ref_pmax=t(np.full(n, 0.5)), ref_nll=t(ref_nll),
                           pack_nll=t(pack_nll), finite=torch.as_tensor(finite), topk_match=torch.full((n,), 5))


def _panel(rng, domains, rows_per_domain, min_len=6, max_len=30):
    names = [d for d in domains for _ in range(rows_per_domain)]
    lens = rng.integers(min_len, max_len, len(names))
    return RowGroups.build(np.repeat(np.arange(len(names)), lens), names), lens


def _stratified_var(e: np.ndarray, strata: np.ndarray) -> float:
    v = 0.0
    for h in np.unique(strata):
        x = e[strata == h]
        v += len(x) / (len(x) - 1) * float(((x - x.mean()) ** 2).sum())
    return v


# ---- statistics the card reads --------------------------------------------------------------------------------------------

def test_absolute_nll_on_both_sides_in_every_scope(rng_seed):
    rng = np.random.default_rng(rng_seed)
    groups, lens = _panel(rng, ["code", "chat", "math"], 12)
    n = int(lens.sum())
    ref_nll = rng.gamma(2.0, 0.6, n)
    pack_nll = ref_nll + rng.normal(0.02, 0.2, n)
    finite = rng.random(n) > 0.02
    out = summarize(_metrics(rng.gamma(0.5, 0.02, n), ref_nll, pack_nll, finite), groups, n_boot=500)
    o, dom = out["overall"], np.array(groups.domains)[groups.row_domain[groups.row]]
    assert o["nll_mean"] == pytest.approx(pack_nll[finite].mean(), rel=1e-12)
    assert o["nll_ref_mean"] == pytest.approx(ref_nll[finite].mean(), rel=1e-12)
    assert np.exp(o["nll_mean"]) == pytest.approx(o["ppl"], rel=1e-12)
    np.testing.assert_allclose(o["nll_mean_ci95"], np.log(o["ppl_ci95"]), rtol=1e-12)
    for d in groups.domains:
        sel = finite & (dom == d)
        assert out["domains"][d]["nll_mean"] == pytest.approx(pack_nll[sel].mean(), rel=1e-12)
        assert out["domains"][d]["nll_ref_mean"] == pytest.approx(ref_nll[sel].mean(), rel=1e-12)
    eq = o["domains_equal"]
    assert eq["nll_ref_mean"] == pytest.approx(np.mean([ref_nll[finite & (dom == d)].mean() for d in groups.domains]))
    # the reference's interval: row-bootstrap, so within a third of the stratified linearized t interval written out here
    y = np.bincount(groups.row, weights=np.where(finite, ref_nll, 0.0), minlength=groups.n_rows)
    w = np.bincount(groups.row, weights=finite.astype(float), minlength=groups.n_rows)
    r = y.sum() / w.sum()
    se = np.sqrt(_stratified_var((y - r * w) / w.sum(), groups.row_domain))
    half = stats.t.isf(0.025, groups.n_rows - 3) * se
    lo, hi = o["nll_ref_mean_ci95"]
    assert lo < o["nll_ref_mean"] < hi
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.33)
    assert o["bootstrap_replicates"] == 500


def _row_sums(groups, a, b):
    s = lambda x: np.bincount(groups.row, weights=x, minlength=groups.n_rows)
    return s(a), s(b), s(np.ones_like(a))


def test_relative_change_has_an_interval_where_the_bootstrap_cannot_resolve_the_tails(rng_seed):
    """3 domains of 3 rows: no scope has the degrees of freedom for a 2,000-replicate expanded percentile interval, so
    each takes the analytic one, t on log(A / B) with the linearized SE: written out here (domains equal by a numerical
    derivative of the plain statistic, not the code's algebra). Before: relative_change_pct_ci95 null everywhere."""
    rng = np.random.default_rng(rng_seed)
    groups, lens = _panel(rng, ["code", "chat", "math"], 3)
    n = int(lens.sum())
    ka, kb = rng.gamma(0.6, 0.03, n), rng.gamma(0.6, 0.05, n)
    pm = lambda k: _metrics(k, np.ones(n), np.ones(n))
    got = paired_difference(pm(ka), pm(kb), groups, n_boot=2000)["kld"]
    a, b, w = _row_sums(groups, ka, kb)
    dom = groups.row_domain

    def expected(ratio, se, dof):
        q = stats.t.isf(0.025, dof)
        return [100 * (ratio * np.exp(-q * se / ratio) - 1), 100 * (ratio * np.exp(q * se / ratio) - 1)]

    r = a.sum() / b.sum()
    se = np.sqrt(_stratified_var((a - r * b) / b.sum(), dom))
    assert got["method"] == "t"
    assert got["relative_change_pct"] == pytest.approx(100 * (r - 1), rel=1e-12)
    np.testing.assert_allclose(got["relative_change_pct_ci95"], expected(r, se, groups.n_rows - 3), rtol=1e-9)
    for i, d in enumerate(groups.domains):
        s = dom == i
        rd = a[s].sum() / b[s].sum()
        se_d = np.sqrt(_stratified_var((a[s] - rd * b[s]) / b[s].sum(), np.zeros(s.sum())))
        np.testing.assert_allclose(got["domains"][d]["relative_change_pct_ci95"], expected(rd, se_d, 2), rtol=1e-9)
        assert got["domains"][d]["relative_change_pct_unavailable"] is None

    def equal_ratio(weights):
        per = lambda x, i: (weights * x)[dom == i].sum() / (weights * w)[dom == i].sum()
        return np.mean([per(a, i) for i in range(3)]) / np.mean([per(b, i) for i in range(3)])

    r_eq, h = equal_ratio(np.ones(len(a))), 1e-6
    infl = np.array([(equal_ratio(1 + h * np.eye(len(a))[i]) - equal_ratio(1 - h * np.eye(len(a))[i])) / (2 * h)
                     for i in range(len(a))])
    se_eq = np.sqrt(_stratified_var(infl, dom))
    eq = got["domains_equal"]
    assert eq["relative_change_pct"] == pytest.approx(100 * (r_eq - 1), rel=1e-9)
    np.testing.assert_allclose(eq["relative_change_pct_ci95"], expected(r_eq, se_eq, groups.n_rows - 3), rtol=1e-6)


def test_p_value_at_the_bootstrap_floor_is_marked(rng_seed):
    """B far worse than A on every row: no replicate crosses 0, so p is the floor 2 t_dof.sf(z(1 / replicates))."""
    rng = np.random.default_rng(rng_seed)
    groups, lens = _panel(rng, ["code", "chat", "math", "writing"], 8)
    n = int(lens.sum())
    ka = rng.gamma(0.6, 0.02, n)
    pm = lambda k: _metrics(k, np.ones(n), np.ones(n))
    got = paired_difference(pm(ka), pm(ka + 0.05 + rng.gamma(0.6, 0.02, n)), groups, n_boot=2000)
    floor = 2 * stats.t.sf(stats.norm.isf(1 / 2000), groups.n_rows - 4)
    assert got["bootstrap_replicates"] == 2000
    assert got["kld"]["method"] == "bootstrap"
    assert got["kld"]["p_value_floor"] == pytest.approx(floor, rel=1e-12)
    assert got["kld"]["p_value"] == pytest.approx(floor, rel=1e-12)
    for d in groups.domains:     # 8 rows: 7 degrees of freedom cannot resolve the tails: the t interval, no floor
        assert got["kld"]["domains"][d]["method"] == "t" and got["kld"]["domains"][d]["p_value_floor"] is None


def test_a_quantile_without_an_interval_says_why(rng_seed):
    rng = np.random.default_rng(rng_seed)
    groups, lens = _panel(rng, ["code", "chat"], 3)
    n = int(lens.sum())
    out = summarize(_metrics(rng.gamma(0.5, 0.02, n), np.ones(n), np.ones(n)), groups, n_boot=2000)
    o = out["overall"]
    assert o["kld_p99_ci95"] is None
    assert "bootstrap replicates cannot resolve the 95% tails at 4 degrees of freedom" in o["kld_p99_ci95_unavailable"]
