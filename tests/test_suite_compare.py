"""Paired statistics of `fidelity suite compare` against statsmodels and scipy on the same tables, and the pairing
rules."""

import json

import numpy as np
import pytest
from scipy import stats
from statsmodels.stats.contingency_tables import mcnemar as sm_mcnemar
from statsmodels.stats.weightstats import DescrStatsW

from fidelity.cli import main as cli
from fidelity.suites.paired import compare_runs, mcnemar, paired_t, wilcoxon
from fidelity.suites.records import Record, RunError, write_manifest, write_records


def sm_p(b, c, a=7, d=5):
    return sm_mcnemar(np.array([[a, b], [c, d]]), exact=True).pvalue


def test_mcnemar_exact_and_mid_p_match_statsmodels(rng_seed):
    rng = np.random.default_rng(rng_seed)
    for _ in range(40):
        b, c = (int(x) for x in rng.integers(0, 40, size=2))
        if b + c == 0:
            continue
        ours = mcnemar(b, c)
        exact = sm_p(b, c)
        if b + c < 25:
            assert ours.method == "mcnemar-exact"
            assert ours.p_value == pytest.approx(exact, rel=1e-12, abs=1e-15)
        else:
            assert ours.method == "mcnemar-mid-p"
            assert ours.p_value == pytest.approx(exact - stats.binom.pmf(min(b, c), b + c, 0.5), rel=1e-10, abs=1e-15)
            assert ours.p_value < exact


def test_mcnemar_without_discordant_pairs_is_p_one():
    m = mcnemar(0, 0)
    assert m.p_value == 1.0 and m.method == "no discordant pairs"


def test_paired_t_matches_statsmodels_and_scipy(rng_seed):
    rng = np.random.default_rng(rng_seed)
    a = rng.uniform(size=60)
    b = np.clip(a - 0.05 + rng.normal(scale=0.2, size=60), 0, 1)
    ours = paired_t(a - b)
    t_sm, p_sm, df_sm = DescrStatsW(a - b).ttest_mean(0)
    assert ours.t == pytest.approx(t_sm, rel=1e-10) and ours.df == df_sm
    assert ours.p_value == pytest.approx(p_sm, rel=1e-9)
    assert ours.p_value == pytest.approx(stats.ttest_rel(a, b).pvalue, rel=1e-9)


def test_paired_t_zero_variance_guards():
    assert paired_t(np.zeros(10)).p_value == 1.0
    assert paired_t(np.full(10, 0.1)).p_value == 0.0


def test_wilcoxon_exact_matches_scipy(rng_seed):
    rng = np.random.default_rng(rng_seed)
    for n in (5, 17, 40):
        d = rng.normal(loc=0.3, size=n)
        ours = wilcoxon(d)
        ref = stats.wilcoxon(d, zero_method="wilcox", method="exact")
        assert ours.method == "wilcoxon-exact"
        assert ours.w_plus == pytest.approx(np.sum(stats.rankdata(np.abs(d))[d > 0]))
        assert ours.p_value == pytest.approx(ref.pvalue, rel=1e-9)


def test_wilcoxon_with_ties_and_zeros_matches_scipy_normal_approximation(rng_seed):
    rng = np.random.default_rng(rng_seed)
    d = rng.integers(-3, 5, size=80) / 4.0  # many ties and zeros, as instruction-level IFEval scores give
    ours = wilcoxon(d)
    ref = stats.wilcoxon(d, zero_method="wilcox", correction=False, method="approx")
    assert ours.method == "wilcoxon-normal"
    assert ours.p_value == pytest.approx(ref.pvalue, rel=1e-9)
    assert wilcoxon(np.zeros(9)).p_value == 1.0


def _record(item, passed=None, score=None, error="", prompt="p"):
    return Record(item, passed, score, prompt + item, "{}", "", "", "", error, 0.1)


def make_run(path, suite, records, metric="passed"):
    path.mkdir(parents=True)
    write_manifest(path, {"suite": suite, "metric": metric, "data": {"sha256": "x"}})
    write_records(path / "records.parquet", records)
    return path


def test_compare_runs_pairs_items_excludes_errors_and_matches_statsmodels(tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    n = 120
    pa_ = rng.random(n) < 0.7
    pb_ = np.where(rng.random(n) < 0.15, ~pa_, pa_)
    a = [_record(f"t{i}", bool(pa_[i])) for i in range(n)] + [_record("only-a", True)]
    b = [_record(f"t{i}", bool(pb_[i])) for i in range(n)] + [_record("only-b", False)]
    b[3] = _record("t3", None, error="engine error: HTTP 503")
    b[4] = _record("t4", bool(pb_[4]), prompt="changed")
    ra, rb = make_run(tmp_path / "a", "humaneval", a), make_run(tmp_path / "b", "humaneval", b)
    rep = compare_runs(ra, rb)
    keep = np.ones(n, bool)
    keep[[3, 4]] = False
    bb, cc = int((pa_ & ~pb_ & keep).sum()), int((~pa_ & pb_ & keep).sum())
    aa_, dd = int((pa_ & pb_ & keep).sum()), int((~pa_ & ~pb_ & keep).sum())
    assert rep["n_items"] == n - 2
    assert rep["only_in_a"] == ["only-a"] and rep["only_in_b"] == ["only-b"] and rep["prompt_changed"] == ["t4"]
    assert rep["errors"] == {"a": 0, "b": 1, "excluded_pairs": 1}
    assert (rep["flips_a_to_b"], rep["flips_b_to_a"]) == (bb, cc)
    sm = sm_mcnemar(np.array([[aa_, bb], [cc, dd]]), exact=True).pvalue
    if bb + cc < 25:
        assert rep["p_value"] == pytest.approx(sm, rel=1e-12)
    else:
        assert rep["p_value"] == pytest.approx(sm - stats.binom.pmf(min(bb, cc), bb + cc, 0.5), rel=1e-10)
    assert rep["drop"] == pytest.approx(100 * (bb - cc) / (n - 2))
    expected = "fail" if rep["drop"] > 1.0 and rep["p_value"] < 0.05 else "pass"
    assert rep["verdict"] == expected


def test_verdict_rule_and_threshold(tmp_path):
    # 40 items: A passes all, B fails 8 of them -> drop 20 points, exact p = 2 * 0.5**8
    a = [_record(f"t{i}", True) for i in range(40)]
    b = [_record(f"t{i}", i >= 8) for i in range(40)]
    ra, rb = make_run(tmp_path / "a", "s", a), make_run(tmp_path / "b", "s", b)
    rep = compare_runs(ra, rb)
    assert rep["p_value"] == pytest.approx(2 * 0.5 ** 8) and rep["verdict"] == "fail"
    assert compare_runs(ra, rb, threshold_points=25.0)["verdict"] == "pass"
    assert compare_runs(rb, ra)["verdict"] == "pass"  # B better than A is never a drop
    aa = compare_runs(ra, rb, aa=True)
    assert aa["mode"] == "A/A" and aa["verdict"].startswith("A/A noise floor: 8 of 40 items flip (20.00%)")


def test_noise_floor_and_drop_intervals_match_statsmodels(tmp_path, rng_seed):
    from statsmodels.stats.proportion import proportion_confint

    rng = np.random.default_rng(rng_seed)
    n = int(rng.integers(30, 200))
    pa_ = rng.random(n) < 0.5
    pb_ = np.where(rng.random(n) < 0.05, ~pa_, pa_)
    ra = make_run(tmp_path / "a", "s", [_record(f"t{i}", bool(x)) for i, x in enumerate(pa_)])
    rb = make_run(tmp_path / "b", "s", [_record(f"t{i}", bool(x)) for i, x in enumerate(pb_)])
    rep = compare_runs(ra, rb, aa=True)["passed"]
    flips = int((pa_ != pb_).sum())
    assert rep["flip_rate"] == flips / n
    assert rep["flip_rate_ci95"] == pytest.approx(proportion_confint(flips, n, alpha=0.05, method="beta"), abs=1e-12)
    sa, sb = rng.uniform(size=n), rng.uniform(size=n)
    ra = make_run(tmp_path / "sa", "s", [_record(f"t{i}", score=float(x)) for i, x in enumerate(sa)], metric="score")
    rb = make_run(tmp_path / "sb", "s", [_record(f"t{i}", score=float(x)) for i, x in enumerate(sb)], metric="score")
    ci = compare_runs(ra, rb)["score"]["drop_ci95"]
    assert np.array(ci) / 100 == pytest.approx(DescrStatsW(sa - sb).tconfint_mean(0.05), rel=1e-10)


def test_score_suite_uses_paired_t_and_reports_wilcoxon(tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    sa = rng.integers(0, 5, size=50) / 4
    sb = np.clip(sa - rng.integers(0, 2, size=50) / 4, 0, 1)
    ra = make_run(
        tmp_path / "a", "ifeval", [_record(f"k{i}", score=float(s)) for i, s in enumerate(sa)], metric="score"
    )
    rb = make_run(
        tmp_path / "b", "ifeval", [_record(f"k{i}", score=float(s)) for i, s in enumerate(sb)], metric="score"
    )
    rep = compare_runs(ra, rb)
    assert rep["test"] == "paired-t"
    assert rep["p_value"] == pytest.approx(stats.ttest_rel(sa, sb).pvalue if np.any(sa != sb) else 1.0, rel=1e-9)
    ref_w = stats.wilcoxon(sa - sb, zero_method="wilcox", correction=False, method="approx").pvalue
    assert rep["score"]["wilcoxon"]["p_value"] == pytest.approx(ref_w, rel=1e-9)


def test_compare_errors_name_the_file(tmp_path):
    ra = make_run(tmp_path / "a", "humaneval", [_record("t0", True)])
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunError, match="manifest.json"):
        compare_runs(ra, tmp_path / "empty")
    write_manifest(tmp_path / "empty", {"suite": "humaneval"})
    with pytest.raises(RunError, match=r"records\.parquet"):
        compare_runs(ra, tmp_path / "empty")
    rb = make_run(tmp_path / "b", "ifeval", [_record("t0", True)])
    with pytest.raises(RunError, match="different suites.*'humaneval' vs 'ifeval'"):
        compare_runs(ra, rb)


def test_cli_compare_writes_json(tmp_path, capsys):
    a = [_record(f"t{i}", True) for i in range(10)]
    b = [_record(f"t{i}", i > 0) for i in range(10)]
    ra, rb = make_run(tmp_path / "a", "s", a), make_run(tmp_path / "b", "s", b)
    assert cli(["suite", "compare", str(ra), str(rb), "--json", str(tmp_path / "c.json")]) == 0
    rep = json.loads((tmp_path / "c.json").read_text())
    assert rep["p_value"] == pytest.approx(1.0) and rep["flips_a_to_b"] == 1
    assert "pass" in capsys.readouterr().out
    assert cli(["suite", "compare", str(ra), str(tmp_path / "nope")]) == 2
