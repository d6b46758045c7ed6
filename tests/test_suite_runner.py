"""The suite runner against our fault-injecting loopback server: records, manifest, resume after a kill, engine
faults."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from testkit.faults import set_plan, spawn_fault_server
from fidelity.suites import make_suite
from fidelity.suites.paired import compare_runs
from fidelity.suites.records import ItemJournal, Record, RunError, read_manifest, read_records
from fidelity.suites.runner import Settings, run_suite

COLUMNS_BUT_LATENCY = [
    "item_id",
    "passed",
    "score",
    "prompt_hash",
    "request",
    "response",
    "extracted",
    "verdict",
    "error",
    "details",
]


@pytest.fixture(scope="module")
def toy():
    with spawn_fault_server() as srv:
        yield srv


def cli_run(url, out, limit, extra=()):
    return [
        sys.executable,
        "-m",
        "fidelity",
        "suite",
        "run",
        "humaneval",
        "--engine",
        url,
        "--model",
        "toy",
        "-o",
        str(out),
        "--limit",
        str(limit),
        "--concurrency",
        "1",
        "--max-tokens",
        "24",
        *extra,
    ]


def journal_lines(run_dir: Path) -> list[dict]:
    p = run_dir / "records.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else []


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_records(toy, tmp_path):
    set_plan(toy.url, {"latency_s": 0.25})
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    n = 8
    asyncio.run(run_suite(make_suite("humaneval"), whole, engine=toy.url, model="toy", concurrency=1,
                          settings=Settings(limit=n, max_tokens=24)))
    proc = subprocess.Popen(cli_run(toy.url, killed, n), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(journal_lines(killed)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = len(journal_lines(killed))
    assert 3 <= done_before < n, "the kill should land mid-run"
    assert not (killed / "records.parquet").exists()
    out = subprocess.run(cli_run(toy.url, killed, n), check=True, capture_output=True, text=True, timeout=120)
    assert f"{n} items ({done_before} resumed)" in out.stdout
    lines = journal_lines(killed)
    assert sorted(r["item_id"] for r in lines) == sorted(set(r["item_id"] for r in lines)) and len(lines) == n
    a, b = read_records(whole), read_records(killed)
    pd.testing.assert_frame_equal(a[COLUMNS_BUT_LATENCY], b[COLUMNS_BUT_LATENCY])
    assert list(a["item_id"]) == [f"HumanEval/{i}" for i in range(n)]
    m = read_manifest(killed)
    assert m["suite"] == "humaneval" and m["engine"] == toy.url and m["settings"]["limit"] == n and m["errors"] == 0
    assert m["data"]["sha256"] == read_manifest(whole)["data"]["sha256"] and m["sandbox"].startswith("bubblewrap")
    assert m["unsafe_no_sandbox"] is False
    set_plan(toy.url, None)


def test_engine_faults_are_errors_excluded_from_the_test_and_retried_on_resume(toy, tmp_path):
    set_plan(toy.url, None)
    suite = make_suite("humaneval")
    settings = Settings(limit=3, max_tokens=8)
    good = asyncio.run(run_suite(suite, tmp_path / "a", engine=toy.url, model="toy", settings=settings))
    assert good.errors == 0
    set_plan(toy.url, {"fail_attempts": 5, "fail_status": 503})
    bad = asyncio.run(run_suite(suite, tmp_path / "b", engine=toy.url, model="toy", settings=settings,
                                client_options={"retries": 1, "backoff_s": 0.01}))
    assert bad.errors == 3 and bad.passed is None or bad.passed == 0
    df = read_records(tmp_path / "b")
    assert df["error"].str.contains("HTTP 503").all() and df["passed"].isna().all()
    rep = compare_runs(tmp_path / "a", tmp_path / "b")
    assert (
        rep["errors"] == {"a": 0, "b": 3, "excluded_pairs": 3}
        and rep["n_items"] == 0
        and rep["verdict"] == "no paired items"
    )
    set_plan(toy.url, None)
    again = asyncio.run(run_suite(suite, tmp_path / "b", engine=toy.url, model="toy", settings=settings))
    assert again.errors == 0 and again.resumed == 0
    pd.testing.assert_frame_equal(
        read_records(tmp_path / "a")[COLUMNS_BUT_LATENCY], read_records(tmp_path / "b")[COLUMNS_BUT_LATENCY]
    )
    rep = compare_runs(tmp_path / "a", tmp_path / "b", aa=True)
    assert rep["n_items"] == 3 and rep["p_value"] == 1.0 and rep["verdict"].startswith("A/A noise floor: 0 of 3")


def test_resume_refuses_other_settings_and_a_corrupt_journal(toy, tmp_path):
    set_plan(toy.url, None)
    suite = make_suite("humaneval")
    asyncio.run(run_suite(suite, tmp_path / "r", engine=toy.url, model="toy", settings=Settings(limit=2, max_tokens=8)))
    with pytest.raises(RunError, match=r"different 'settings'.*manifest\.json"):
        asyncio.run(
            run_suite(suite, tmp_path / "r", engine=toy.url, model="toy", settings=Settings(limit=2, max_tokens=9))
        )
    with open(tmp_path / "r" / "records.jsonl", "a") as f:
        f.write('{"item_id": "x"}\n')
    with pytest.raises(RunError, match=r"line 3 is not an item record.*records\.jsonl"):
        ItemJournal(tmp_path / "r" / "records.jsonl")


def test_item_journal_names_the_file_and_line_that_is_not_json(tmp_path):
    j = ItemJournal(tmp_path / "records.jsonl")
    j.append(Record("a", True, None, "h", "{}", "r", "x", "ok", "", 0.1))
    j.close()
    good = (tmp_path / "records.jsonl").read_text()
    (tmp_path / "records.jsonl").write_text(good + "not json\n" + good)
    with pytest.raises(RunError, match=r"line 2 is not valid JSON.*delete the file.*records\.jsonl"):
        ItemJournal(tmp_path / "records.jsonl")
    (tmp_path / "records.jsonl").write_text(good + "[1, 2]\n")
    with pytest.raises(RunError, match=r"line 2 is not an item record.*records\.jsonl"):
        ItemJournal(tmp_path / "records.jsonl")


def test_journal_drops_a_line_cut_by_a_kill(tmp_path):
    j = ItemJournal(tmp_path / "records.jsonl")
    j.append(Record("a", True, None, "h", "{}", "r", "x", "ok", "", 0.1))
    j.close()
    with open(tmp_path / "records.jsonl", "a") as f:
        f.write('{"item_id": "b", "pass')
    j2 = ItemJournal(tmp_path / "records.jsonl")
    assert list(j2.records) == ["a"]
    j2.append(Record("b", False, None, "h", "{}", "r", "x", "no", "", 0.1))
    j2.close()
    assert [json.loads(l)["item_id"] for l in (tmp_path / "records.jsonl").read_text().splitlines()] == ["a", "b"]


def test_bad_inputs_name_the_file(tmp_path):
    from fidelity.errors import ConfigError

    bad = tmp_path / "he.jsonl"
    bad.write_text(json.dumps({"task_id": "T/0", "prompt": "def f():\n"}) + "\n")
    with pytest.raises(ConfigError, match=r"he\.jsonl line 1 lacks"):
        make_suite("humaneval", data=str(bad))
    with pytest.raises(ConfigError, match="does not exist"):
        make_suite("humaneval", data=str(tmp_path / "nope.jsonl"))
    with pytest.raises(ConfigError, match="unknown suite 'gsm9k'"):
        make_suite("gsm9k")
    with pytest.raises(RunError, match="supports modes \\['chat'\\], not 'completion'"):
        asyncio.run(run_suite(make_suite("toolcall", categories=["simple"]), tmp_path / "t", engine="http://127.0.0.1:9",
                              model="m", settings=Settings(mode="completion")))
