"""`fidelity card`: the model-card section from fidelity's results alone (golden Markdown, every annotated number equal
to the JSON field it names), and the statistics it reads that compare did not carry before (absolute NLL per scope, the
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
from fidelity.measuring.bootstrap import RowGroups
from fidelity.measuring.stats import paired_difference, summarize

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


# ---- statistics the card reads
# --------------------------------------------------------------------------------------------

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
    # the reference's interval: row-bootstrap, so within a third of the stratified linearized t interval written out
    # here
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


# ---- the card: golden Markdown, and every number against the field it names
# ----------------------------------------------

INPUTS = ["compare.json", "suite-humaneval+.json", "suite-ifeval.json", "suite-gsm8k.json", "bench-native.json",
          "bench-q4-mix.json", "bench-q3.json"]
COMMENT = re.compile(r"<!-- (.*?) -->")


def _card() -> str:
    from fidelity.report.card import card_markdown

    text, this, _ = card_markdown([FIXTURES / n for n in INPUTS], build="q4-mix")
    assert this == "q4-mix"
    return text


def test_card_equals_the_golden_markdown():
    """The committed card (tests/fixtures/card/expected_card.md, reviewed by hand) from the committed results; any
    change to a table, a number's format or a source comment shows here. To change it on purpose: the command in
    tests/fixtures/card/make_fixtures.py, then review the diff."""
    got, want = _card(), (FIXTURES / "expected_card.md").read_text(encoding="utf-8")
    if got != want:
        import difflib

        diff = "".join(
            difflib.unified_diff(want.splitlines(True), got.splitlines(True), "expected_card.md", "rendered")
        )
        pytest.fail(f"the card differs from tests/fixtures/card/expected_card.md:\n{diff[:6000]}")


def _resolve(file: str, ptr: str):
    from urllib.parse import unquote

    doc = json.loads((FIXTURES / unquote(file)).read_text())
    for part in unquote(ptr).split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


NUMBER = re.compile(r"(< )?([−+]?\d[\d,]*(?:\.\d+)?)(%?)$")


def test_every_number_equals_the_json_field_its_comment_names():
    """Each `value<!-- file#/json/pointer -->` of the card: the pointer resolved here (RFC 6901, percent-decoded) in the
    fixture file, and the printed value equal to it within half a unit of its last printed digit (a percentage or a pass
    rate may print 100x; "< x" is a bound the value must be under)."""
    text = _card()
    checked = 0
    pos = 0
    for m in COMMENT.finditer(text):
        before, pos = text[pos:m.start()], m.end()
        body = m[1]
        if " " in body:         # a formula over fields (a count, a % change), checked below
            continue
        file, ptr = body.split("#", 1)
        value = _resolve(file, ptr)
        if isinstance(value, str):
            assert before.rstrip("`").endswith(value.replace("|", "\\|")), (body, before[-60:], value)
            checked += 1
            continue
        num = NUMBER.search(before)
        assert num, (body, before[-40:])
        printed = float(num[2].replace("−", "-").replace(",", ""))
        if num[1]:
            assert value < printed * (1 + 1e-12), (body, printed, value)
        else:
            digits = len(num[2].split(".")[1]) if "." in num[2] else 0
            tol = 0.5 * 10 ** -digits + 1e-12
            assert abs(printed - value) <= tol or abs(printed - 100 * value) <= tol, (body, printed, value)
        checked += 1
    assert checked > 150


def test_derived_numbers_against_the_results():
    """"closer on N of M domains", the change in KL where the card's build is compare's B (its inverse), and the speed
    deltas: computed here from the fixture files."""
    text = re.sub(COMMENT, "", _card())
    data = json.loads((FIXTURES / "compare.json").read_text())
    for pr in data["paired"]:
        if "q4-mix" not in (pr["a"], pr["b"]):
            continue
        other = pr["b"] if pr["a"] == "q4-mix" else pr["a"]
        doms = pr["kld"]["domains"]
        mine = sum((v["diff"] < 0) == (pr["a"] == "q4-mix") for v in doms.values())
        assert f"Against **{other}**: q4-mix is closer to native on {mine} of the {len(doms)} domains" in text
        for name, v in doms.items():
            this_kl, other_kl = (v["a"], v["b"]) if pr["a"] == "q4-mix" else (v["b"], v["a"])
            change = 100 * (this_kl / other_kl - 1)
            row = next(line for line in text.splitlines() if line.startswith(f"| {name} (") and f"{other}" not in line
                       and line in text.split(f"Against **{other}**")[1].split("Against **")[0])
            printed = float(row.split(" | ")[3].split("%")[0].replace("−", "-"))
            assert printed == pytest.approx(change, abs=0.05 + 1e-9), (other, name)
    base = json.loads((FIXTURES / "bench-native.json").read_text())["metrics"]
    new = json.loads((FIXTURES / "bench-q4-mix.json").read_text())["metrics"]
    rows = {
        line.split(" | ")[0].lstrip("| "): line
        for line in text.split("### Speed")[1].splitlines()
        if line.startswith("| ")
    }
    for key, label in (("decode.code", "decode tok/s, code"), ("ttft_mean.4", "mean TTFT s, 4 streams")):
        change = 100 * (new[key]["median"] / base[key]["median"] - 1)
        if key.startswith("ttft"):      # lower is better: the change is that of its inverse
            change = 100 * (base[key]["median"] / new[key]["median"] - 1)
        printed = float(rows[label].split(" | ")[2].split("(")[1].split("%")[0].replace("−", "-"))
        assert printed == pytest.approx(change, abs=0.05 + 1e-9)


def test_card_renders_as_tables_with_the_comments_hidden():
    """A CommonMark renderer with GFM tables and HTML on (markdown-it-py, what the Hub's renderer is built like): every
    table keeps its columns in every row, and no comment leaks into the text."""
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark", {"html": True}).enable("table")
    text = _card()
    html = md.render(text)
    tables = re.findall(r"<table>.*?</table>", html, flags=re.S)
    assert len(tables) == text.count("\n|---")
    for t in tables:
        widths = {len(re.findall(r"<t[hd][ >]", row)) for row in re.findall(r"<tr>.*?</tr>", t, flags=re.S)}
        assert len(widths) == 1, widths
    visible = re.sub(r"<!--.*?-->", "", html, flags=re.S)
    assert "<!--" not in visible and "-->" not in visible and "&lt;!--" not in visible


def test_cli_writes_the_card_and_refuses_an_unknown_build(tmp_path, capsys):
    from fidelity.cli import main as cli_main

    args = ["card", *(str(FIXTURES / n) for n in INPUTS), "-o", str(tmp_path / "card")]
    assert cli_main(args + ["--build", "q4-mix"]) == 0
    written = (tmp_path / "card" / "card.md").read_text(encoding="utf-8")
    assert written.split("written by `fidelity card`")[0] == _card().split("written by `fidelity card`")[0]
    assert "failed in that run" in capsys.readouterr().err        # the failed pack is named, not silently dropped
    assert cli_main(args + ["--build", "q9"]) != 0
    err = capsys.readouterr().err
    assert "q9" in err and "q3, q4-mix, q5" in err


# ---- fidelity report: the numbers compare carries, compare's buckets, the floor, the reasons
# ------------------------------

def test_report_carries_nll_delta_nll_rows_worse_change_and_the_floor(tmp_path):
    from fidelity.report import render
    from test_report import md_tables

    rep = render([FIXTURES / "compare.json"], tmp_path / "report", tokenizer=None)
    md = rep.summary_md.read_text()
    t = md_tables(md)
    data = json.loads((FIXTURES / "compare.json").read_text())
    measured = {r["label"]: r for r in data["results"] if r["status"] == "measured"}
    lik = {r["pack"]: r for r in t["Likelihood: NLL, ΔNLL, rows worse"]}
    for label, r in measured.items():
        o = r["overall"]
        assert lik[label]["NLL reference"].startswith(f"{o['nll_ref_mean']:.4g} [")
        assert lik[label]["NLL pack"].startswith(f"{o['nll_mean']:.4g} [")
        assert lik[label]["ΔNLL [95% CI]"].startswith(f"{o['delta_nll_mean']:.4g} [")
        assert lik[label]["rows worse"] == f"{o['rows_worse']['worse']} / {o['rows_worse']['rows']}"
    paired = t["Paired, pack A vs pack B (per-row KL difference)"]
    for pr, row in zip(data["paired"], paired):
        k = pr["kld"]
        floor = 2 * stats.t.sf(stats.norm.isf(1 / pr["bootstrap_replicates"]), data["panel"]["rows"] - 4)
        assert k["p_value"] == pytest.approx(floor, rel=1e-9)          # every pair of the fixture sits at the floor
        assert row["p-value"] == f"< {np.ceil(floor * 1e4) / 1e4:.2g}"
        lo, hi = k["relative_change_pct_ci95"]
        assert row["change % [95% CI]"] == f"{k['relative_change_pct']:.3g} [{lo:.3g}, {hi:.3g}]"
    per = t["Paired per domain (Holm across domains)"]
    agentic = [r for r in per if r["domain"] == "agentic"]
    assert agentic and all(r["p-value"].startswith("—") and r["p-value"][-1] in "¹²³" for r in agentic)
    assert "no interval: domain 'agentic' has 2 rows" in md
    conf = t["Mean KL by reference confidence (reference probability of its top token)"]
    assert [r["bucket"] for r in conf] == ["[0, 0.25)", "[0.25, 0.5)", "[0.5, 0.75)", "[0.75, 0.95)", "[0.95, 1]"]
