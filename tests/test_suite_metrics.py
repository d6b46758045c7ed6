"""Named per-item metrics (evalplus base / plus, IFEval's four), finish_reason, seeded subsets: what the runner records
and summarizes, and `suite compare`'s paired test per metric, against statsmodels / scipy / numpy on the same tables."""
import asyncio
import json
import random
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from scipy import stats
from statsmodels.stats.contingency_tables import mcnemar as sm_mcnemar
from statsmodels.stats.weightstats import DescrStatsW

from fidelity.suites.paired import compare_runs, paired_metric
from fidelity.suites.records import SCHEMA, Record, RunError, read_manifest, read_records, write_manifest, write_records
from fidelity.suites.runner import Item, Outcome, Settings, Suite, run_suite


def mcnemar_reference(x: np.ndarray, y: np.ndarray) -> float:
    b, c = int((x & ~y).sum()), int((~x & y).sum())
    if b + c == 0:
        return 1.0
    exact = sm_mcnemar(np.array([[int((x & y).sum()), b], [c, int((~x & ~y).sum())]]), exact=True).pvalue
    return exact if b + c < 25 else exact - stats.binom.pmf(min(b, c), b + c, 0.5)


def test_paired_metric_one_trial_is_mcnemar(rng_seed):
    rng = np.random.default_rng(rng_seed)
    m = int(rng.integers(40, 200))
    x = rng.random(m) < 0.6
    y = np.where(rng.random(m) < 0.2, ~x, x)
    ones = np.ones(m, int)
    out = paired_metric(x.astype(int), ones, y.astype(int), ones, threshold=1.0, alpha=0.05, aa=False)
    assert out["rate_a"] == x.mean() and out["rate_b"] == y.mean() and out["of"] == m
    assert out["drop"] == pytest.approx(100 * (x.mean() - y.mean()))
    assert (out["flips_a_to_b"], out["flips_b_to_a"]) == (int((x & ~y).sum()), int((~x & y).sum()))
    assert out["p_value"] == pytest.approx(mcnemar_reference(x, y), rel=1e-10, abs=1e-15)


def test_paired_metric_pooled_counts_is_a_paired_t_on_counts(rng_seed):
    """Instruction-level: pooled over instructions (sum k / sum n), tested with prompts as the independent units."""
    rng = np.random.default_rng(rng_seed)
    m = int(rng.integers(30, 150))
    n = rng.integers(1, 5, size=m)
    ka = rng.binomial(n, 0.7)
    kb = np.minimum(n, np.maximum(0, ka - rng.binomial(1, 0.2, size=m) + rng.binomial(1, 0.05, size=m)))
    out = paired_metric(ka, n, kb, n, threshold=1.0, alpha=0.05, aa=False)
    assert out["rate_a"] == pytest.approx(ka.sum() / n.sum(), rel=1e-15)
    assert out["rate_b"] == pytest.approx(kb.sum() / n.sum(), rel=1e-15)
    d = (ka - kb).astype(float)
    if d.std() > 0:
        assert out["p_value"] == pytest.approx(stats.ttest_rel(ka, kb).pvalue, rel=1e-9)
        lo, hi = DescrStatsW(d).tconfint_mean(0.05)
        assert out["drop_ci95"] == pytest.approx([100 * lo * m / n.sum(), 100 * hi * m / n.sum()], rel=1e-10)
        ref_w = stats.wilcoxon(ka, kb, zero_method="wilcox", correction=False, method="approx").pvalue
        assert out["wilcoxon"]["p_value"] == pytest.approx(ref_w, rel=1e-9)
    assert out["drop"] == pytest.approx(100 * (ka.sum() - kb.sum()) / n.sum())
    assert "error" in paired_metric(ka, n, kb, n + 1, threshold=1.0, alpha=0.05, aa=False)
    # pooled, not the mean of per-item fractions: 4 of 5 instructions is 0.8, where (1/1 + 3/4) / 2 would be 0.875
    hand = paired_metric(
        np.array([1, 3]), np.array([1, 4]), np.array([0, 3]), np.array([1, 4]), threshold=1.0, alpha=0.05, aa=False
    )
    assert (hand["rate_a"], hand["rate_b"]) == (0.8, 0.6)


def _rec(item, base, plus, finish="stop"):
    return Record(item, bool(plus), None, "h" + item, "{}", "", "", "", "", 0.1, finish_reason=finish,
                  metrics=json.dumps({"base": [int(base), 1], "plus": [int(plus), 1]}))


def test_compare_tests_base_and_plus_separately(tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    m = 150
    base_a = rng.random(m) < 0.8
    plus_a = base_a & (rng.random(m) < 0.85)
    base_b = np.where(rng.random(m) < 0.1, ~base_a, base_a)
    plus_b = base_b & np.where(rng.random(m) < 0.15, ~plus_a, plus_a)
    cut_a, cut_b = rng.random(m) < 0.1, rng.random(m) < 0.3
    for name, base, plus, cut in (("a", base_a, plus_a, cut_a), ("b", base_b, plus_b, cut_b)):
        (tmp_path / name).mkdir()
        write_manifest(tmp_path / name, {"suite": "humaneval+", "metric": "passed", "data": {}})
        write_records(tmp_path / name / "records.parquet",
                      [_rec(f"t{i}", base[i], plus[i], "length" if cut[i] else "stop") for i in range(m)])
    rep = compare_runs(tmp_path / "a", tmp_path / "b")
    for name, x, y in (("base", base_a, base_b), ("plus", plus_a, plus_b)):
        got = rep["metrics"][name]
        assert got["rate_a"] == x.mean() and got["rate_b"] == y.mean()
        assert got["p_value"] == pytest.approx(mcnemar_reference(x, y), rel=1e-10, abs=1e-15)
    assert rep["metrics"]["plus"]["p_value"] == rep["passed"]["p_value"]  # passed is evalplus's plus
    assert rep["cut_by_limit"] == {"a": int(cut_a.sum()), "b": int(cut_b.sum())}


def test_records_from_before_the_new_columns_still_read(tmp_path):
    old = pa.schema([f for f in SCHEMA if f.name not in ("finish_reason", "metrics")])
    rec = Record("t0", True, None, "h", "{}", "", "", "", "", 0.1)
    pq.write_table(pa.table({f.name: [getattr(rec, f.name)] for f in old}, schema=old), tmp_path / "records.parquet")
    df = read_records(tmp_path)
    assert df["finish_reason"].tolist() == [""] and df["metrics"].tolist() == ["{}"]


class Toy(Suite):
    name = "toy"
    modes = ("chat",)

    def __init__(self, n=40):
        self.n = n

    def load(self):
        return [Item(f"q{i}", f"question {i}") for i in range(self.n)]

    def score(self, item, text, tool_calls):
        i = int(item.item_id[1:])
        return Outcome(extracted=text, passed=i % 3 == 0, metrics={"one": i % 2 == 0, "pooled": (i % 4, 3 + i % 2)})


class StandIn:
    """A client whose finish_reason is "length" for every fifth question, None for every seventh."""

    def __init__(self):
        self.asked = []

    async def chat(self, messages, tools=None, extra=None, tag="", **kw):
        i = int(messages[0]["content"].split()[1])
        self.asked.append(i)
        finish = "length" if i % 5 == 0 else (None if i % 7 == 0 else "stop")
        return SimpleNamespace(content=f"answer {i}", tool_calls=[], finish_reason=finish)


def test_finish_reason_and_pooled_metrics_are_recorded_and_summarized(tmp_path):
    client = StandIn()
    s = asyncio.run(run_suite(Toy(), tmp_path / "r", engine="stand-in", model="m", client=client))
    df = read_records(tmp_path / "r")
    i = np.arange(40)
    expected = np.where(i % 5 == 0, "length", np.where(i % 7 == 0, "", "stop"))
    assert df["finish_reason"].tolist() == expected.tolist()
    assert s.cut_by_limit == int((i % 5 == 0).sum()) == 8
    assert s.finish_reasons == {"": int(((i % 7 == 0) & (i % 5 != 0)).sum()), "length": 8,
                                "stop": int(((i % 7 != 0) & (i % 5 != 0)).sum())}
    k, n = i % 4, 3 + i % 2
    assert s.metrics["pooled"] == {"followed": int(k.sum()), "of": int(n.sum()), "rate": k.sum() / n.sum()}
    assert s.metrics["one"]["rate"] == np.mean(i % 2 == 0)
    assert read_manifest(tmp_path / "r")["summary"]["cut_by_limit"] == 8


def test_seeded_sample_is_reproducible_recorded_and_in_order(tmp_path, rng_seed):
    seed = rng_seed % 1000
    runs = []
    for name, sample_seed in (("a", seed), ("b", seed), ("c", seed + 1)):
        client = StandIn()
        asyncio.run(run_suite(Toy(60), tmp_path / name, engine="stand-in", model="m", client=client,
                              settings=Settings(sample=12, sample_seed=sample_seed)))
        m = read_manifest(tmp_path / name)
        assert m["settings"]["sample"] == 12 and m["settings"]["sample_seed"] == sample_seed
        assert sorted(client.asked) == [int(x[1:]) for x in m["items"]]
        runs.append(m["items"])
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert [int(x[1:]) for x in runs[0]] == sorted(random.Random(seed).sample(range(60), 12))
    assert len(set(runs[0])) == 12 and set(runs[0]) <= {f"q{i}" for i in range(60)}
    with pytest.raises(RunError, match="--limit.*--sample.*not both"):
        asyncio.run(run_suite(Toy(), tmp_path / "d", engine="e", model="m", client=StandIn(),
                              settings=Settings(limit=3, sample=3)))
    with pytest.raises(RunError, match="--sample 41: the suite has 40 items"):
        asyncio.run(
            run_suite(Toy(), tmp_path / "e", engine="e", model="m", client=StandIn(), settings=Settings(sample=41))
        )


def lm_eval_ifeval_utils():
    """lm-eval's own `lm_eval.tasks.ifeval.utils`; with lm-eval installed --no-deps its package import fails
    (sacrebleu...), so then the same file as the suite loads it (lm-eval's code, unchanged)."""
    import importlib
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        pytest.skip("missing tool: lm-eval is not installed")
    try:
        return importlib.import_module("lm_eval.tasks.ifeval.utils")
    except ImportError:
        from fidelity.suites.ifeval import load_checkers

        return load_checkers()[0]["utils"]


def test_ifeval_four_numbers_equal_lm_eval_aggregation(rng_seed):
    from test_suite_scoring import SHARED_IFEVAL

    from fidelity.suites import make_suite
    from fidelity.suites.runner import metric_counts, pooled_metrics

    if not SHARED_IFEVAL.exists():
        pytest.skip(f"missing data: {SHARED_IFEVAL}")
    utils = lm_eval_ifeval_utils()
    suite = make_suite("ifeval", data=str(SHARED_IFEVAL))
    items = {it.item_id: it for it in suite.load()}
    rng = random.Random(rng_seed)
    records, results = [], []
    for key in rng.sample(sorted(items), 40):
        row = suite._rows[key]
        words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(rng.randrange(3, 420)))
        response = rng.choice(
            [
                "",
                words,
                words.upper(),
                "*" + words + "*",
                f'"{words}"',
                "Title: <<t>>\n" + words,
                f"```json\n{{\"a\": \"{words[:40]}\"}}\n```",
                words + "\n\nP.S. done",
                key + ", " + words,
            ]
        )
        out = suite.score(items[key], response, [])
        records.append(Record(key, out.passed, out.score, "h", "{}", response, "", "", "", 0.0,
                              metrics=json.dumps(metric_counts(out.metrics))))
        # Some rows' arguments are invalid for their checker (1129: letter "!"), and lm-eval's checker then draws one
        # from
        # Python's global random state; our scorer seeds it with 0 before checking, so lm-eval gets the same seed here.
        random.seed(0)
        results.append(utils.process_results(row, [response]))
    ours = pooled_metrics(records)
    for level in ("strict", "loose"):
        prompt_ref = np.mean([r[f"prompt_level_{level}_acc"] for r in results])
        inst_ref = utils.agg_inst_level_acc([r[f"inst_level_{level}_acc"] for r in results])
        assert ours[f"prompt_level_{level}_acc"]["rate"] == pytest.approx(prompt_ref, rel=1e-15)
        assert ours[f"inst_level_{level}_acc"]["rate"] == pytest.approx(inst_ref, rel=1e-15)
        assert ours[f"inst_level_{level}_acc"]["of"] == sum(len(r[f"inst_level_{level}_acc"]) for r in results)
    assert 0 < ours["inst_level_loose_acc"]["rate"] < 1  # the responses exercise both outcomes


def test_cli_sample_seed_and_console_summary(tmp_path):
    """`suite run ifeval --sample 5 --seed 3` on the toy engine (every reply ends at max_tokens: finish_reason
    length)."""
    import subprocess
    import sys

    from test_suite_scoring import SHARED_IFEVAL

    from testkit.faults import spawn_fault_server

    if not SHARED_IFEVAL.exists():
        pytest.skip(f"missing data: {SHARED_IFEVAL}")
    from fidelity.suites import make_suite

    with spawn_fault_server() as srv:
        cmd = [
            sys.executable,
            "-m",
            "fidelity",
            "suite",
            "run",
            "ifeval",
            "--data",
            str(SHARED_IFEVAL),
            "--engine",
            srv.url,
            "--model",
            "toy",
            "-o",
            str(tmp_path / "a"),
            "--sample",
            "5",
            "--seed",
            "3",
            "--max-tokens",
            "4",
        ]
        outs = [subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout]
        asyncio.run(
            run_suite(
                make_suite("ifeval", data=str(SHARED_IFEVAL)),
                tmp_path / "b",
                engine=srv.url,
                model="toy",
                settings=Settings(sample=5, sample_seed=3, max_tokens=4),
            )
        )
    keys = [json.loads(l)["key"] for l in SHARED_IFEVAL.read_text().splitlines() if l.strip()]
    m = read_manifest(tmp_path / "a")
    assert m["items"] == [str(keys[i]) for i in sorted(random.Random(3).sample(range(len(keys)), 5))]
    assert m["items"] == read_manifest(tmp_path / "b")["items"] and m["settings"]["sample_seed"] == 3
    assert "cut by the token limit (finish_reason length): 5/5" in outs[0]
    df = read_records(tmp_path / "a")
    k = sum(json.loads(x)["inst_level_strict_acc"][0] for x in df["metrics"])
    n = sum(json.loads(x)["inst_level_strict_acc"][1] for x in df["metrics"])
    assert f"inst_level_strict_acc: {k / n:.4f} ({k}/{n})" in outs[0]


def test_report_table_has_a_row_per_metric(tmp_path):
    from fidelity.report.tables import suite_table

    m = 30
    for name, fail_from in (("a", 30), ("b", 20)):
        (tmp_path / name).mkdir()
        write_manifest(tmp_path / name, {"suite": "humaneval+", "metric": "passed", "data": {}})
        write_records(tmp_path / name / "records.parquet", [_rec(f"t{i}", True, i < fail_from) for i in range(m)])
    rep = compare_runs(tmp_path / "a", tmp_path / "b")
    t = suite_table([("c.json", rep)])
    rows = {r[0]: dict(zip(t.headers, r)) for r in t.rows}
    assert set(rows) == {"humaneval+", "humaneval+ · base", "humaneval+ · plus"}
    assert rows["humaneval+ · plus"]["A✓ B✗"] == "10" and rows["humaneval+ · base"]["A✓ B✗"] == "0"
    assert rows["humaneval+ · plus"]["p-value"] == rows["humaneval+"]["p-value"]


def test_a_run_from_before_sample_resumes_and_compare_prints_each_metric(tmp_path, capsys):
    from fidelity.cli import main as cli

    asyncio.run(run_suite(Toy(), tmp_path / "r", engine="stand-in", model="m", client=StandIn()))
    m = read_manifest(tmp_path / "r")
    for k in ("sample", "sample_seed"):
        del m["settings"][k]
    write_manifest(tmp_path / "r", m)
    again = asyncio.run(run_suite(Toy(), tmp_path / "r", engine="stand-in", model="m", client=StandIn()))
    assert again.resumed == 40
    assert cli(["suite", "compare", str(tmp_path / "r"), str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    i = np.arange(40)
    k, n = i % 4, 3 + i % 2
    assert f"pooled: {k.sum() / n.sum():.4f} -> {k.sum() / n.sum():.4f} (of {n.sum()})" in out
    assert "one: 0.5000 -> 0.5000 (of 40)" in out and "cut by the token limit: A 8, B 8 of 40" in out
