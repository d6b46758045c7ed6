"""Every suite end to end against a real engine: llama-cpp-python's OpenAI server with SmolLM2-135M on loopback, a few
items each with small budgets; then `suite compare` of two real runs against statsmodels/scipy on the same tables."""
import asyncio
import json

import numpy as np
import pytest
from scipy import stats
from statsmodels.stats.contingency_tables import mcnemar as sm_mcnemar

from fidelity.suites import make_suite
from fidelity.suites.paired import compare_runs
from fidelity.suites.records import read_manifest, read_records
from fidelity.suites.runner import Settings, run_suite

from _llamacpp import llama_server
from test_suite_scoring import SHARED_IFEVAL, evalplus_file, mbpp_file

pytestmark = pytest.mark.slow


def m_summary(run_dir):
    return read_manifest(run_dir)["summary"]


@pytest.fixture(scope="module")
def llama(smollm2_gguf, tmp_path_factory):
    pytest.importorskip("llama_cpp")
    flags = ["--n_ctx", "2048", "--n_threads", "2", "--verbose", "False"]
    with llama_server(smollm2_gguf, tmp_path_factory.mktemp("llama"), flags) as srv:
        yield srv


def suite_case(name, tmp_path):
    if name == "humaneval":
        return make_suite("humaneval"), Settings(mode="completion", limit=2, max_tokens=40)
    if name == "humaneval+":
        return make_suite("humaneval+", data=str(evalplus_file(tmp_path, make_suite("humaneval")))), Settings(
            max_tokens=40
        )
    if name == "mbpp+":
        return make_suite("mbpp+", data=str(mbpp_file(tmp_path))), Settings(max_tokens=40)
    if name == "ifeval":
        if not SHARED_IFEVAL.exists():
            pytest.skip(f"missing data: {SHARED_IFEVAL}")
        return make_suite("ifeval", data=str(SHARED_IFEVAL)), Settings(limit=2, max_tokens=24)
    if name == "needle":
        return make_suite("needle", lengths=[384], depths=[0.0, 1.0], seeds=1), Settings(max_tokens=12)
    return make_suite("toolcall", categories=["simple", "irrelevance"]), Settings(limit=2, max_tokens=24)


@pytest.mark.parametrize("name", ["humaneval", "humaneval+", "mbpp+", "ifeval", "needle", "toolcall"])
def test_suite_runs_end_to_end(llama, tmp_path, name):
    suite, settings = suite_case(name, tmp_path)
    summary = asyncio.run(run_suite(suite, tmp_path / "run", engine=llama.url, model="smollm2", settings=settings,
                                    concurrency=2))
    df = read_records(tmp_path / "run")
    print(df[["item_id", "passed", "score", "verdict", "response"]].to_string())
    assert summary.errors == 0 and len(df) == summary.items == 2
    assert (df["error"] == "").all() and df["passed"].notna().all()
    assert df["response"].str.len().gt(0).any()
    assert (
        df["finish_reason"].isin(["stop", "length", "tool_calls"]).all()
    )  # llama-cpp-python's reasons, recorded per item
    assert (
        m_summary(tmp_path / "run")["cut_by_limit"]
        == int((df["finish_reason"] == "length").sum())
        == summary.cut_by_limit
    )
    for req in df["request"]:
        body = json.loads(req)
        assert body["temperature"] == 0.0 and body["max_tokens"] == settings.max_tokens
    m = read_manifest(tmp_path / "run")
    assert m["suite"] == name and m["engine"] == llama.url and m["items"] == list(df["item_id"]) and m["finished"]
    if name == "needle":
        assert m["suite_config"]["measure"].startswith("tokenize")  # llama-cpp-python's /extras/tokenize
        prompts = [json.loads(d)["prompt_tokens"] for d in df["details"]]
        assert all(384 - 12 - 16 <= p <= 384 - 12 for p in prompts), prompts
    if name == "ifeval":
        assert df["score"].notna().all()
    if name == "humaneval":  # completion mode: the bare prompt, stop markers, prompt + completion executed
        body = json.loads(df["request"][0])
        assert (
            "messages" not in body
            and body["prompt"] == suite.problems["HumanEval/0"]["prompt"]
            and "\ndef " in body["stop"]
        )
        assert df["extracted"][0] == body["prompt"] + df["response"][0]


def test_compare_two_real_runs_matches_statsmodels(llama, tmp_path):
    if not SHARED_IFEVAL.exists():
        pytest.skip(f"missing data: {SHARED_IFEVAL}")
    suite = make_suite("ifeval", data=str(SHARED_IFEVAL))
    for run, max_tokens in (("a", 32), ("b", 6)):  # the same prompts; B's answers are cut short
        asyncio.run(run_suite(suite, tmp_path / run, engine=llama.url, model="smollm2",
                              settings=Settings(limit=4, max_tokens=max_tokens), concurrency=2))
    rep = compare_runs(tmp_path / "a", tmp_path / "b")
    a, b = read_records(tmp_path / "a"), read_records(tmp_path / "b")
    pa_, pb_ = a["passed"].astype(bool).to_numpy(), b["passed"].astype(bool).to_numpy()
    table = np.array([[np.sum(pa_ & pb_), np.sum(pa_ & ~pb_)], [np.sum(~pa_ & pb_), np.sum(~pa_ & ~pb_)]])
    print(table, rep)
    assert rep["n_items"] == 4 and (rep["flips_a_to_b"], rep["flips_b_to_a"]) == (table[0, 1], table[1, 0])
    expected = sm_mcnemar(table, exact=True).pvalue if table[0, 1] + table[1, 0] else 1.0
    assert rep["passed"]["p_value"] == pytest.approx(expected, rel=1e-12)
    diff = a["score"].to_numpy(float) - b["score"].to_numpy(float)
    t_ref = stats.ttest_rel(a["score"], b["score"]).pvalue if np.std(diff) > 0 else (1.0 if not diff.any() else 0.0)
    assert rep["score"]["p_value"] == pytest.approx(t_ref, rel=1e-9)
