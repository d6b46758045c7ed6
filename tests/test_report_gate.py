"""The report of a real `fidelity gate --json` run against the loopback fault server (one gate perturbed so it
fails)."""

from __future__ import annotations

import json

import pytest

from fidelity.report import render

from _gate_cli import gate_cli
from test_report import close_to_printed, md_tables

faults = pytest.importorskip("testkit.faults")
pytest.importorskip("fidelity.commands.gate")

pytestmark = pytest.mark.slow


def test_gate_json_from_a_real_gate_run(tmp_path, rng_seed):
    delta = 0.02 + 0.1 * (rng_seed % 1000) / 1000
    with faults.spawn_fault_server({"perturb_prefill": delta}) as srv:
        out = tmp_path / "gate.json"
        r = gate_cli("--engine", srv.url, "--model", "toy", "--only", "batch-invariance,decode-vs-prefill", "--json",
                     str(out))
    assert r.returncode == 1, r.stdout + r.stderr              # decode-vs-prefill fails on the perturbed prefill
    gate = json.loads(out.read_text())
    rep = render([out], tmp_path / "report")
    rows = md_tables(rep.summary_md.read_text())["Engine gates"]
    checks = [(g, c) for g in gate["gates"] for c in g["checks"]]
    assert len(rows) == len(checks) > 0
    for row, (g, c) in zip(rows, checks):
        assert (row["gate"], row["gate status"], row["check"]) == (g["gate"], g["status"], c["metric"])
        assert row["check status"] == ("pass" if c["passed"] else "fail")
        assert row["threshold"].split()[0] == c["op"]
        if c["threshold"]:
            close_to_printed(row["threshold"].split()[1], c["threshold"])
        if c["value"]:
            close_to_printed(row["measured"], c["value"])
    assert {g["gate"]: g["status"] for g in gate["gates"]} == {"batch-invariance": "pass", "decode-vs-prefill": "fail"}
    prov = {r["what"]: r["value"] for r in md_tables(rep.summary_md.read_text())["Provenance"]}
    assert prov["gates"].startswith(f"engine {srv.url} · model toy") and "gate.json" in prov["gates"]
    html = rep.index_html.read_text()
    assert '<td class="fail">fail</td>' in html and f"{srv.url} (toy): fail" in html
