"""`fidelity report`: numbers on the page equal the results', groups by panel, self-contained HTML checked in headless
Chromium."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats

from fidelity.cli import main as cli_main
from fidelity.report import ReportInputError, render

# ---- a small real computation in compare's output shape (JSON + per-position records)
# ---------------------------------------

DOMAINS = ("code", "math", "chat")


@dataclass
class Truth:
    """What the fixture computed directly with torch, independent of the report's code paths."""

    kl: dict[str, torch.Tensor]          # label -> [rows, T] KL(ref || pack)
    scored: torch.Tensor                 # [rows, T] bool
    ref_top1_prob: torch.Tensor          # [rows, T]
    ref_top_id: torch.Tensor             # [rows, T]
    row_ids: list[str]
    domains: list[str]
    tokens: torch.Tensor                 # [rows, T]


def _bootstrap_ci(per_row: np.ndarray, weights: np.ndarray, gen: np.random.Generator, n: int = 400):
    idx = gen.integers(0, len(per_row), size=(n, len(per_row)))
    means = (per_row[idx] * weights[idx]).sum(1) / weights[idx].sum(1)
    return [float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))]


def _buckets(kl: np.ndarray, pmax: np.ndarray, edges=(0.0, 0.25, 0.5, 0.75, 0.95, 1.0)) -> list[dict]:
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (pmax >= lo) & ((pmax < hi) if hi < 1.0 else (pmax <= hi))
        out.append(
            {
                "ref_confidence": [lo, hi],
                "positions": int(m.sum()),
                "kld_mean": float(kl[m].mean()) if m.any() else None,
            }
        )
    return out


def make_compare_run(folder: Path, seed: int, *, panel_name: str = "tiny", panel_sha: str | None = None,
                     packs=(("q8", 8.5, 0.15), ("q4", 4.5, 0.6)), rows_per_domain: int = 4, T: int = 24, V: int = 40,
                     write_records: bool = True, store: bool = True, domain_names=DOMAINS) -> tuple[dict, Truth]:
    """Random reference logits, each pack = reference + Gaussian noise of its scale; KL/top-1/PPL through plain
    torch."""
    g = torch.Generator().manual_seed(seed)
    gen = np.random.default_rng(seed)
    R = rows_per_domain * len(domain_names)
    domains = [d for d in domain_names for _ in range(rows_per_domain)]
    row_ids = [f"{d}-{i}" for i, d in enumerate(domains)]
    ref_logits = 3.0 * torch.randn(R, T, V, generator=g, dtype=torch.float64)
    ref_lp = ref_logits.log_softmax(-1)
    tokens = torch.distributions.Categorical(logits=ref_logits).sample()
    scored = torch.zeros(R, T, dtype=torch.bool)
    scored[:, 6:] = True
    K = 8
    ref_top_lp, ref_top_ids = ref_lp.topk(K, dim=-1)
    nll_ref = -ref_lp.gather(-1, tokens[..., None])[..., 0]

    def kl_of(scale):
        lp = (ref_logits + scale * torch.randn(R, T, V, generator=g, dtype=torch.float64)).log_softmax(-1)
        return lp, (ref_lp.exp() * (ref_lp - lp)).sum(-1)

    _, floor_kl = kl_of(0.01)
    noise_floor = float(floor_kl[scored].mean())
    sha = panel_sha or f"{seed:08x}" * 8
    results, per_row_kl, truth_kl = [], {}, {}
    dom = np.array(domains)
    folder.mkdir(parents=True, exist_ok=True)
    if write_records and store:
        # the reference store's records (fidelity.measuring.store layout): every token; top-K and NLL on scored ones
        (folder / "reference").mkdir()
        flat_scored = scored.reshape(-1).numpy()
        pd.DataFrame(
            {
                "row_id": np.repeat(row_ids, T),
                "domain": np.repeat(domains, T),
                "position": np.tile(np.arange(T), R),
                "token": tokens.reshape(-1).numpy(),
                "scored": flat_scored,
                "nll": np.where(flat_scored, nll_ref.reshape(-1).numpy(), np.nan),
                "topk_ids": [x if f else None for x, f in zip(ref_top_ids.reshape(-1, K).numpy(), flat_scored)],
                "topk_logprobs": [x if f else None for x, f in zip(ref_top_lp.reshape(-1, K).numpy(), flat_scored)],
            }
        ).to_parquet(folder / "reference" / "records.parquet")
        (folder / "reference" / "manifest.json").write_text(
            json.dumps({"panel": {"name": panel_name, "sha256": sha}, "top_k": K})
        )
    if write_records:
        (folder / "tokens.json").write_text(json.dumps({i: f"w{i} " for i in range(V)}))
    for label, bpw, scale in packs:
        lp, kl = kl_of(scale)
        truth_kl[label] = kl
        top1 = (lp.argmax(-1) == ref_lp.argmax(-1))
        nll = -lp.gather(-1, tokens[..., None])[..., 0]
        s = scored.numpy()
        row_mean = np.array([kl[r][scored[r]].mean().item() for r in range(R)])
        per_row_kl[label] = row_mean
        ones = np.full(R, float(scored[0].sum()))
        kls = kl[scored].numpy()
        domain_blocks = {}
        for d in domain_names:
            m = dom == d
            domain_blocks[d] = {
                "kld_mean": float(kl[m][s[m]].mean()),
                "kld_mean_ci95": _bootstrap_ci(row_mean[m], ones[m], gen),
                "top1": float(top1[m][s[m]].float().mean()),
                "ppl": float(nll[m][s[m]].mean().exp()),
                "positions": int(s[m].sum()),
            }
        overall = {
            "kld_mean": float(kls.mean()),
            "kld_mean_ci95": _bootstrap_ci(row_mean, ones, gen),
            "kld_domains_equal": float(np.mean([b["kld_mean"] for b in domain_blocks.values()])),
            "top1": float(top1[scored].float().mean()),
            "ppl": float(nll[scored].mean().exp()),
            "ppl_ref": float(nll_ref[scored].mean().exp()),
            "kld_median": float(np.median(kls)),
            "kld_p99": float(np.quantile(kls, 0.99)),
            "kld_p999": float(np.quantile(kls, 0.999)),
            "kld_max": float(kls.max()),
            "nonfinite": 0,
            "noise_floor_kld": noise_floor,
            "positions": int(kls.size),
            "kld_by_ref_confidence": _buckets(kls, ref_lp.exp().amax(-1)[scored].numpy()),
        }
        results.append(
            {"pack": f"/packs/{label}", "label": label, "bpw": bpw, "overall": overall, "domains": domain_blocks}
        )
        if (
            write_records
        ):  # compare's `<label>.parquet`: scored positions only, fidelity.measuring.metrics.PositionMetrics columns
            sel = scored.reshape(-1).numpy()
            ref_top2 = ref_lp.topk(2, -1).values
            pd.DataFrame(
                {
                    "row_id": np.repeat(row_ids, T)[sel],
                    "domain": np.repeat(domains, T)[sel],
                    "position": np.tile(np.arange(T), R)[sel],
                    "token": tokens.reshape(-1).numpy()[sel],
                    "kld": kl.reshape(-1).numpy()[sel],
                    "ref_top1": ref_lp.argmax(-1).reshape(-1).numpy()[sel],
                    "pack_top1": lp.argmax(-1).reshape(-1).numpy()[sel],
                    "ref_margin": (ref_top2[..., 0] - ref_top2[..., 1]).reshape(-1).numpy()[sel],
                    "ref_pmax": ref_lp.exp().amax(-1).reshape(-1).numpy()[sel],
                    "ref_nll": nll_ref.reshape(-1).numpy()[sel],
                    "pack_nll": nll.reshape(-1).numpy()[sel],
                    "finite": np.ones(int(sel.sum()), bool),
                }
            ).to_parquet(folder / f"{label}.parquet")
    paired = []
    labels = [p[0] for p in packs]
    for i in range(len(labels)):
        for j in range(i + 1, len(labels)):
            d = per_row_kl[labels[i]] - per_row_kl[labels[j]]
            paired.append(
                {
                    "a": labels[i],
                    "b": labels[j],
                    "kld_mean_diff": float(d.mean()),
                    "ci95": _bootstrap_ci(d, np.ones(R), gen),
                    "p_value": float(stats.ttest_1samp(d, 0.0).pvalue),
                }
            )
    data = {
        "panel": {"name": panel_name, "sha256": sha, "rows": R, "scored_positions": int(scored.sum())},
        "reference": {"path": "/packs/native", "fingerprint": "ref0fingerprint"},
        "results": results,
        "paired": paired,
        "fidelity_version": "0.1.0",
        "command_line": "fidelity compare /packs/native " + " ".join(f"/packs/{x}" for x in labels),
    }
    (folder / "compare.json").write_text(json.dumps(data))
    return data, Truth(kl=truth_kl, scored=scored, ref_top1_prob=ref_lp.exp().amax(-1), ref_top_id=ref_lp.argmax(-1),
                       row_ids=row_ids, domains=domains, tokens=tokens)


# ---- Markdown: parse the numbers back
# ---------------------------------------------------------------------------------------

def md_tables(md: str) -> dict[str, list[dict[str, str]]]:
    """Every Markdown table under its heading: heading -> rows as {header: cell}."""
    out, heading, lines = {}, None, md.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif line.startswith("| ") and i + 1 < len(lines) and lines[i + 1].startswith("|--"):
            headers = [h.strip() for h in line.strip("|").split(" | ")]
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = [c.strip() for c in re.split(r"(?<!\\)\|", lines[i].strip()[1:-1])]
                rows.append(dict(zip(headers, cells)))
                i += 1
            key = heading
            while key in out:
                key += "'"
            out[key] = rows
            continue
        i += 1
    return out


def overall_rows(t: dict) -> dict[str, dict[str, str]]:
    """The overall table and its perplexity / KL-tail half, joined by pack."""
    rows = {r["pack"]: dict(r) for r in t["Overall"]}
    for r in t["Perplexity and KL tail"]:
        rows[r["pack"]].update(r)
    return rows


def close_to_printed(cell: str, value: float, sig: int = 4):
    """`cell` is `value` printed with `sig` significant digits: parse it back and allow half a unit in the last
    digit."""
    parsed = float(cell)
    tol = 0.5 * 10 ** (math.floor(math.log10(abs(value))) - sig + 1) if value else 0.0
    assert abs(parsed - value) <= tol * 1.0001, (cell, value)


def parse_with_ci(cell: str) -> tuple[float, float | None, float | None]:
    m = re.fullmatch(r"(\S+)(?: \[(\S+), (\S+)\])?", cell)
    assert m, cell
    return float(m[1]), (float(m[2]) if m[2] else None), (float(m[3]) if m[3] else None)


@pytest.fixture
def run_a(tmp_path, rng_seed):
    return make_compare_run(tmp_path / "run_a", rng_seed)


def test_summary_numbers_equal_the_json(tmp_path, run_a):
    data, _ = run_a
    rep = render([tmp_path / "run_a" / "compare.json"], tmp_path / "out")
    t = md_tables(rep.summary_md.read_text())
    overall = overall_rows(t)
    assert set(overall) == {r["label"] for r in data["results"]}
    for res in data["results"]:
        o, row = res["overall"], overall[res["label"]]
        m, lo, hi = parse_with_ci(row["KLD mean [95% CI]"])
        for printed, v in ((m, o["kld_mean"]), (lo, o["kld_mean_ci95"][0]), (hi, o["kld_mean_ci95"][1])):
            close_to_printed(repr(printed), v)
        # the fixture's domains-equal KLD has no interval and no recorded reason: a mark that the note explains
        assert row["KLD domains equal"].endswith("¹")
        assert "¹ no interval: the result does not say why" in rep.summary_md.read_text()
        for header, key in (
            ("KLD domains equal", "kld_domains_equal"),
            ("PPL", "ppl"),
            ("PPL ref", "ppl_ref"),
            ("KL median", "kld_median"),
            ("KL p99", "kld_p99"),
            ("KL p99.9", "kld_p999"),
            ("KL max", "kld_max"),
            ("bpw", None),
        ):
            close_to_printed(row[header].rstrip("¹"), o[key] if key else res["bpw"])
        assert abs(float(row["top-1"].rstrip("%")) / 100 - o["top1"]) <= 0.5e-4 + 1e-12
        ratio = o["kld_mean"] / o["noise_floor_kld"]
        assert abs(float(row["× noise floor"].rstrip("×")) - ratio) <= 0.5e-2 * ratio
        domain_rows = {r["domain"]: r for r in t["KLD mean per domain [95% CI]"]}
        top1_rows = {r["domain"]: r for r in t["Top-1 agreement per domain"]}
        for d, b in res["domains"].items():
            m, lo, hi = parse_with_ci(domain_rows[d][res["label"]])
            for printed, v in ((m, b["kld_mean"]), (lo, b["kld_mean_ci95"][0]), (hi, b["kld_mean_ci95"][1])):
                close_to_printed(repr(printed), v)
            assert int(domain_rows[d]["positions"]) == b["positions"]
            assert abs(float(top1_rows[d][res["label"]].rstrip("%")) / 100 - b["top1"]) <= 0.5e-4 + 1e-12
    paired = t["Paired, pack A vs pack B (per-row KL difference)"]
    for pr, row in zip(data["paired"], paired):
        assert (row["A"], row["B"]) == (pr["a"], pr["b"])
        m, lo, hi = parse_with_ci(row["KLD mean A − B [95% CI]"])
        for printed, v in ((m, pr["kld_mean_diff"]), (lo, pr["ci95"][0]), (hi, pr["ci95"][1])):
            close_to_printed(repr(printed), v)
        close_to_printed(row["p-value"], pr["p_value"], sig=3)
    assert rep._repr_html_().count("<img src=\"data:image/png;base64,") == len(rep.figures) == 4
    conf = t["Mean KL by reference confidence (reference probability of its top token)"]
    for res in data["results"]:
        for row, b in zip(conf, res["overall"]["kld_by_ref_confidence"]):
            assert row["bucket"].startswith(f"[{b['ref_confidence'][0]:g}, {b['ref_confidence'][1]:g}")
            if b["kld_mean"] is not None:
                close_to_printed(row[res["label"]], b["kld_mean"])
    prov = {r["what"]: r["value"] for r in t["Provenance"]}
    assert data["panel"]["sha256"] in prov["group 1: panel"]
    assert "ref0fingerprint" in prov["group 1: reference"]
    assert data["command_line"] in prov["group 1: compare.json"]


def test_record_derived_numbers_equal_a_direct_computation(tmp_path, run_a):
    """KL quantiles, KL by confidence bucket and the worst position, from the run folder, against the fixture's own
    torch tensors."""
    data, truth = run_a
    rep = render([tmp_path / "run_a"], tmp_path / "out", worst=3)
    t = md_tables(rep.summary_md.read_text())
    q = {r["pack"]: r for r in t["KL distribution per pack"]}
    conf = t["Mean KL by reference confidence (reference probability of its top token)"]
    edges = [0.0, 0.25, 0.5, 0.75, 0.95, 1.0]     # compare's buckets (exllamav3 model_diff's), written out
    for label, kl in truth.kl.items():
        kls = kl[truth.scored].numpy()
        assert int(q[label]["positions"]) == kls.size
        for header, v in (("mean", kls.mean()), ("p99", np.quantile(kls, 0.99)), ("p99.9", np.quantile(kls, 0.999)),
                          ("max", kls.max()), ("median", np.median(kls))):
            close_to_printed(q[label][header], float(v))
        p = truth.ref_top1_prob[truth.scored].numpy()
        for row, lo, hi in zip(conf, edges[:-1], edges[1:]):
            m = (p >= lo) & ((p < hi) if hi < 1.0 else (p <= hi))
            assert int(row["positions"]) == int(m.sum())
            if m.any():
                close_to_printed(row[label], float(kls[m].mean()))
        worst = [w for v in rep.groups for w in v.worst if w.label == label]
        flat = kl.masked_fill(~truth.scored, -1.0)
        r, pos = divmod(int(flat.argmax()), flat.shape[1])
        assert (worst[0].row_id, worst[0].position) == (truth.row_ids[r], pos)
        assert worst[0].kl == pytest.approx(float(flat.max()), rel=1e-6)
        assert worst[0].token == f"w{int(truth.tokens[r, pos])} "
        assert worst[0].before.endswith(f"w{int(truth.tokens[r, pos - 1])} ")
        ref_best = int(truth.ref_top_id[r, pos])
        assert worst[0].reference_top[0][0] == f"w{ref_best}␣"      # edge whitespace made visible in token lists
    assert len(rep.figures) == 4 and all(f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in rep.figures)


def test_worst_positions_without_a_reference_store(tmp_path, rng_seed):
    """compare's records alone: the worst position is still found; context is the scored tokens, reference shows its
    top-1."""
    _, truth = make_compare_run(tmp_path / "a", rng_seed, store=False, packs=(("q4", 4.5, 0.6),))
    rep = render([tmp_path / "a"], tmp_path / "out", worst=1)
    w = rep.groups[0].worst[0]
    kl = truth.kl["q4"].masked_fill(~truth.scored, -1.0)
    r, pos = divmod(int(kl.argmax()), kl.shape[1])
    assert (w.row_id, w.position, w.token) == (truth.row_ids[r], pos, f"w{int(truth.tokens[r, pos])} ")
    first_scored = int(truth.scored[r].nonzero()[0])
    assert w.before == "".join(f"w{int(t)} " for t in truth.tokens[r, max(first_scored, pos - 24):pos])
    assert w.reference_top == [(f"w{int(truth.ref_top_id[r, pos])}␣", None)]
    assert any("scored tokens only as context" in n for n in rep.groups[0].notes)


def test_json_records_folder_and_store_given_separately(tmp_path, rng_seed):
    """`fidelity compare --json X --out DIR` and `fidelity reference -o STORE` leave three places; the report joins
    them."""
    data, truth = make_compare_run(tmp_path / "a", rng_seed, packs=(("q4", 4.5, 0.6),))
    (tmp_path / "a" / "compare.json").rename(tmp_path / "compare.json")
    (tmp_path / "a" / "reference").rename(tmp_path / "store")
    with pytest.raises(ReportInputError, match="match the labels of no compare result given"):
        render([tmp_path / "a"], tmp_path / "out")
    rep = render([tmp_path / "compare.json", tmp_path / "a", tmp_path / "store"], tmp_path / "out", worst=1)
    w = rep.groups[0].worst[0]
    r = truth.row_ids.index(w.row_id)
    assert w.kl == pytest.approx(float(truth.kl["q4"].masked_fill(~truth.scored, -1).max()), rel=1e-6)
    assert len(w.reference_top) == 5 and w.reference_top[0][0] == f"w{int(truth.ref_top_id[r, w.position])}␣"
    assert w.reference_top[0][1] == pytest.approx(float(truth.ref_top1_prob[r, w.position]), rel=1e-5)
    assert w.before.startswith(f"w{int(truth.tokens[r, max(0, w.position - 24)])} ")      # unscored prompt tokens too
    # the store path compare recorded, relative to the JSON's folder, is found without giving the store
    (tmp_path / "compare.json").write_text(json.dumps({**data, "reference": {**data["reference"], "store": "store"}}))
    again = render([tmp_path / "compare.json", tmp_path / "a"], tmp_path / "out3", worst=1).groups[0].worst[0]
    assert again.reference_top == w.reference_top
    other = tmp_path / "other_store"
    other.mkdir()
    (other / "records.parquet").write_bytes((tmp_path / "store" / "records.parquet").read_bytes())
    (other / "manifest.json").write_text(json.dumps({"panel": {"sha256": "e" * 64}}))
    with pytest.raises(
        ReportInputError, match="other_store: reference store for panel sha256 eeeeeeeeeeee matches no compare"
    ):
        render([tmp_path / "compare.json", other], tmp_path / "out2")


@pytest.mark.slow
def test_other_panel_is_a_separate_group_with_a_warning(tmp_path, rng_seed):
    make_compare_run(tmp_path / "a", rng_seed)
    make_compare_run(tmp_path / "b", rng_seed + 1, panel_name="other", packs=(("q3", 3.5, 0.9),))
    render([tmp_path / "a"], tmp_path / "alone")
    both = render([tmp_path / "a", tmp_path / "b"], tmp_path / "both")
    assert len(both.groups) == 2 and len(both.warnings) == 1
    assert "panel 'other'" in both.warnings[0] and str(tmp_path / "b") in both.warnings[0]
    assert [r[0] for r in both.groups[0].overall.rows] == ["q8", "q4"]
    assert [r[0] for r in both.groups[1].overall.rows] == ["q3"]
    # group 1's figures are byte-identical with and without the foreign result: nothing of it was drawn there
    for name in ("per_domain_kld.png", "kld_vs_bpw.png", "kl_distribution.png", "kl_by_confidence.png"):
        assert (tmp_path / "alone" / name).read_bytes() == (tmp_path / "both" / name).read_bytes(), name
        assert (tmp_path / "both" / name.replace(".png", "-group2.png")).is_file()
    md, html = both.summary_md.read_text(), both.index_html.read_text()
    assert md.count("> **Warning:**") == 2 and "Separate group 2: Panel other" in md
    assert html.count('class="warning"') == 2


def test_grouping_by_panel_and_reference(tmp_path, rng_seed):
    """The main group is the one with the most packs, even when the odd one is given first; a different reference on the
    same panel is a separate group too."""
    from fidelity.report import load_inputs

    odd, _ = make_compare_run(
        tmp_path / "odd", rng_seed, panel_name="other", packs=(("q3", 3.5, 0.9),), write_records=False
    )
    main, _ = make_compare_run(tmp_path / "main", rng_seed + 1, write_records=False)
    other_ref = {**main, "reference": {"path": "/packs/bf16", "fingerprint": "bf16fingerprint"}}
    inputs = load_inputs([odd, main, other_ref])
    assert [([p.label for p in g.packs], g.reference["fingerprint"]) for g in inputs.groups] == [
        (["q8", "q4"], "ref0fingerprint"), (["q8", "q4"], "bf16fingerprint"), (["q3"], "ref0fingerprint")]
    assert inputs.groups[0].warning is None
    assert (
        "reference 'bf16fingerprint' differs" in inputs.groups[1].warning and "<result 3>" in inputs.groups[1].warning
    )
    assert "panel 'other'" in inputs.groups[2].warning and "<result 1>" in inputs.groups[2].warning


@pytest.mark.slow
def test_same_label_from_two_files_is_kept_apart(tmp_path, rng_seed):
    make_compare_run(tmp_path / "a", rng_seed, panel_sha="ab" * 32)
    make_compare_run(tmp_path / "b", rng_seed + 1, panel_sha="ab" * 32, packs=(("q8", 8.5, 0.3),))
    rep = render([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    assert len(rep.groups) == 1
    assert [r[0] for r in rep.groups[0].overall.rows] == ["q8 (a)", "q4", "q8 (b)"]
    assert [r[:2] for r in rep.groups[0].paired.rows] == [["q8 (a)", "q4"]]
    twice = render([tmp_path / "a", tmp_path / "a"], tmp_path / "twice")
    assert [r[0] for r in twice.groups[0].overall.rows] == ["q8 (a)", "q4 (a)", "q8 (a) #2", "q4 (a) #2"]


def test_a_pack_with_only_non_finite_positions(tmp_path, rng_seed):
    """NaN logits everywhere: compare reports None means and counts non-finite positions; the page says so, plots skip
    it."""
    data, _ = make_compare_run(tmp_path / "a", rng_seed, write_records=False)
    broken = data["results"][1]
    n = broken["overall"]["positions"]
    broken["overall"] = {**{k: None for k in broken["overall"]}, "nonfinite": n, "positions": 0}
    broken["domains"] = {d: {**{k: None for k in b}, "positions": 0} for d, b in broken["domains"].items()}
    rep = render([data], tmp_path / "out")
    row = overall_rows(md_tables(rep.summary_md.read_text()))["q4"]
    assert (row["KLD mean [95% CI]"], row["top-1"], row["non-finite"]) == ("—", "—", str(n))
    assert len(rep.figures) == 4


def _suite_compare_json(tmp_path: Path, seed: int) -> dict:
    """A real `suite compare` result: two runs of random pass/fail items through fidelity.suites.paired."""
    paired = pytest.importorskip("fidelity.suites.paired")
    records = pytest.importorskip("fidelity.suites.records")
    rng = np.random.default_rng(seed)
    a_pass = rng.random(80) < 0.6
    b_pass = np.where(rng.random(80) < 0.2, ~a_pass, a_pass)
    runs = []
    for name, passed in (("native", a_pass), ("q4", b_pass)):
        d = tmp_path / "suite" / name
        d.mkdir(parents=True)
        records.write_manifest(d, {"suite": "humaneval", "metric": "passed", "data": {"sha256": "x"}})
        recs = [
            records.Record(f"t{i}", bool(p), None, f"h{i}", "{}", "", "", "", "", 0.1) for i, p in enumerate(passed)
        ]
        recs[5] = records.Record("t5", None, None, "h5", "{}", "", "", "", "HTTP 503", 0.1) if name == "q4" else recs[5]
        records.write_records(d / "records.parquet", recs)
        runs.append(d)
    return paired.compare_runs(*runs)


def _gate_json(seed: int) -> dict:
    """Gate results as `fidelity.engine.gates.settings.GateResult.to_dict()` writes them, with random measurements."""
    gates = pytest.importorskip("fidelity.engine.gates.settings")
    rng = np.random.default_rng(seed)
    kl = float(rng.uniform(0.001, 0.1))
    results = [
        gates.GateResult(
            "oracle-kl",
            "fail" if kl > 0.02 else "pass",
            checks=[gates.Check("kl_mean", kl, "<=", 0.02)],
            measured={"kl_mean": kl},
        ),
        gates.GateResult(
            "batch-invariance",
            "pass",
            checks=[gates.Check("identical_fraction", 1.0, ">=", 1.0)],
            worst=[{"prompt": i, "identical": True, "max_abs_dlogprob": float(rng.uniform(0, 1e-6))} for i in range(2)],
        ),
        gates.GateResult("prefix-cache", "error", error="connection refused"),
    ]
    return {"engine": "http://127.0.0.1:8000", "gates": [r.to_dict() for r in results]}


def test_suite_and_gate_tables(tmp_path, run_a, rng_seed):
    suite = _suite_compare_json(tmp_path, rng_seed)
    gate = _gate_json(rng_seed)
    (tmp_path / "suite.json").write_text(json.dumps(suite))
    (tmp_path / "gate.json").write_text(json.dumps(gate))
    rep = render(
        [tmp_path / "run_a" / "compare.json", tmp_path / "suite.json", tmp_path / "gate.json"], tmp_path / "out"
    )
    t = md_tables(rep.summary_md.read_text())
    s = t["Suites, candidate (B) paired against the reference build (A)"][0]
    assert (s["suite"], s["candidate"], int(s["items"]), s["verdict"]) == (
        "humaneval",
        "q4",
        suite["n_items"],
        suite["verdict"],
    )
    assert int(s["A✓ B✗"]) == suite["flips_a_to_b"] and int(s["A✗ B✓"]) == suite["flips_b_to_a"]
    close_to_printed(s["p-value"], suite["p_value"], sig=3)
    assert abs(float(s["pass rate B"].rstrip("%")) / 100 - suite["pass_rate_b"]) <= 0.5e-4 + 1e-12
    assert s["excluded / unpaired"] == "1 errors / 0"
    if "flip_rate" in suite["passed"]:
        assert abs(float(s["flip rate"].rstrip("%")) / 100 - suite["passed"]["flip_rate"]) <= 0.5e-4 + 1e-12
    g = t["Engine gates"]
    kl_check = gate["gates"][0]["checks"][0]
    kl = next(r for r in g if r["check"] == "kl_mean")
    assert (kl["gate"], kl["gate status"], kl["threshold"], kl["check status"]) == (
        "oracle-kl", gate["gates"][0]["status"], "<= 0.02", "pass" if kl_check["passed"] else "fail")
    close_to_printed(kl["measured"], kl_check["value"])
    assert any(r["gate"] == "batch-invariance" and r["check status"] == "pass" for r in g)
    assert any(
        r["gate"] == "prefix-cache" and r["gate status"] == "error" and "connection refused" in r["measured"] for r in g
    )
    prov = {r["what"]: r["value"] for r in t["Provenance"]}
    assert prov["suite humaneval"] == f"A {suite['a']} · B {suite['b']} · from suite.json"
    worst = t["Worst examples: batch-invariance"]
    for row, w in zip(worst, gate["gates"][1]["worst"]):
        assert int(row["prompt"]) == w["prompt"] and row["identical"] == "yes"
        close_to_printed(row["max_abs_dlogprob"], w["max_abs_dlogprob"])
    html = rep.index_html.read_text()
    assert '<td class="error">error</td>' in html and '<td class="pass">pass</td>' in html


def test_gate_and_suite_json_without_a_compare_result(tmp_path):
    """Only gate results (a list of gate dicts, measured/thresholds without checks): still a page, no empty plots."""
    gates = [{"gate": "oracle-kl", "status": "fail", "measured": {"kl_mean": 0.5}, "thresholds": {"kl_mean_max": 0.02}}]
    rep = render([gates], tmp_path / "out")
    assert rep.figures == [] and rep.groups == []
    row = md_tables(rep.summary_md.read_text())["Engine gates"][0]
    assert (row["check"], row["measured"], row["threshold"]) == ("kl_mean", "0.5", "0.02")


@pytest.mark.slow
def test_cli_writes_the_report(tmp_path, run_a, capsys):
    make_compare_run(tmp_path / "b", 7, panel_name="other", packs=(("q3", 3.5, 0.9),))
    rc = cli_main(
        [
            "report",
            str(tmp_path / "run_a"),
            str(tmp_path / "b" / "compare.json"),
            "-o",
            str(tmp_path / "out"),
            "--worst",
            "2",
        ]
    )
    assert rc == 0
    err = capsys.readouterr().err
    assert "warning:" in err and "panel 'other'" in err
    html = (tmp_path / "out" / "index.html").read_text()
    assert "fidelity report " + str(tmp_path / "run_a") in html
    assert len(list((tmp_path / "out").glob("*.png"))) == 4 + 4


@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "not_json",
        "unknown_kind",
        "no_sha",
        "folder_without_json",
        "records_without_columns",
        "store_of_another_panel",
    ],
)
def test_bad_input_names_the_file(tmp_path, run_a, case, capsys):
    data, _ = run_a
    if case == "missing":
        bad, expect = tmp_path / "nope.json", "no such file"
    elif case == "not_json":
        bad, expect = tmp_path / "x.json", "not valid JSON"
        bad.write_text("{oops")
    elif case == "unknown_kind":
        bad, expect = tmp_path / "x.json", "not a compare, suite-compare or gate result"
        bad.write_text(json.dumps({"hello": 1}))
    elif case == "no_sha":
        bad, expect = tmp_path / "x.json", "no panel sha256"
        bad.write_text(json.dumps({**data, "panel": {"name": "p"}}))
    elif case == "folder_without_json":
        bad, expect = tmp_path / "empty", "run folder has no compare JSON"
        bad.mkdir()
    elif case == "store_of_another_panel":
        bad, expect = tmp_path / "run_a", "reference store is for panel sha256 ffffffffffff"
        (bad / "reference" / "manifest.json").write_text(json.dumps({"panel": {"sha256": "f" * 64}}))
    else:
        bad, expect = tmp_path / "run_a", "q4.parquet: per-position records of pack 'q4' lack columns ['kl']"
        pd.read_parquet(bad / "q4.parquet").drop(columns=["kld"]).to_parquet(bad / "q4.parquet")
    with pytest.raises(ReportInputError, match=re.escape(expect)) as e:
        render([bad], tmp_path / "out")
    assert bad.name in str(e.value)
    assert cli_main(["report", str(bad), "-o", str(tmp_path / "out2")]) == 2
    assert bad.name in capsys.readouterr().err


def test_labels_and_text_are_escaped(tmp_path, rng_seed):
    """Labels and token text are data, never markup: a label that looks like HTML stays text, a '|' keeps Markdown
    tables whole."""
    data, _ = make_compare_run(tmp_path / "a", rng_seed, packs=(("<img src=x>|q4", 4.5, 0.6),), write_records=False)
    rep = render([data], tmp_path / "out")
    html = rep.index_html.read_text()
    assert html.count("<img ") == len(rep.figures) and "&lt;img src=x&gt;|q4" in html
    row = md_tables(rep.summary_md.read_text())["Overall"][0]
    assert row["pack"] == "<img src=x>\\|q4" and row["bpw"] == "4.5"


def test_token_ids_when_no_tokenizer_is_available(tmp_path, rng_seed):
    _, truth = make_compare_run(tmp_path / "a", rng_seed, packs=(("q4", 4.5, 0.6),))
    (tmp_path / "a" / "tokens.json").unlink()
    rep = render([tmp_path / "a"], tmp_path / "out", tokenizer=None, worst=1)
    w = rep.groups[0].worst[0]
    r = truth.row_ids.index(w.row_id)
    assert w.token == f"⟨{int(truth.tokens[r, w.position])}⟩"
    assert any("shown as ⟨id⟩" in n for n in rep.groups[0].notes)
