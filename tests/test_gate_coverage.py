"""Gates never pass on missing data (issue 16): against the fault server, an engine that nulls 90 % of its logprobs
makes every gate an error naming the rows/prompts short of coverage (not a pass with max |delta| 0); token ids that are
not ids or lie outside the vocabulary are engine protocol errors (exit 2, JSON and JUnit still written), and the journal
keeps only replies that passed validation, so a rerun after the engine is fixed asks again."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from fidelity.engine.gates.invariance import batch_invariance, decode_vs_prefill, prefix_cache
from fidelity.engine.gates.kinds import run_gate
from fidelity.engine.gates.oracle_kl import oracle_kl
from fidelity.engine.gates.settings import GateSettings
from fidelity.engine.client import ClientConfig, EngineClient
from testkit.faults import set_plan, spawn_fault_server, toy_reference


@pytest.fixture(scope="module")
def server():
    with spawn_fault_server() as srv:
        yield srv


def _texts(seed: int, n: int = 3, length: int = 24) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz ."), size=length)) for _ in range(n)]


def _run(url, fn, *args, **kw):
    async def go():
        async with EngineClient(ClientConfig(url, model="toy", concurrency=4, backoff_s=0.01)) as c:
            return await run_gate(fn.__name__, fn, c, *args, **kw)
    return asyncio.run(go())


@pytest.mark.parametrize("prompt_logprobs", [False, True])
def test_oracle_kl_on_a_tenth_of_the_positions_is_an_error_naming_rows(server, rng_seed, prompt_logprobs):
    ref = toy_reference(_texts(rng_seed))
    s = GateSettings(prompt_logprobs=prompt_logprobs, top_k=5)
    set_plan(server.url)
    clean = _run(server.url, oracle_kl, ref, s)
    assert clean.status == "pass" and clean.measured["coverage"] == 1.0
    set_plan(server.url, {"null_logprobs": 0.9})
    res = _run(server.url, oracle_kl, ref, s)
    assert res.status == "error", res.to_dict()
    assert "below the minimum coverage 99 %" in res.error and "row toy0 (" in res.error
    assert res.measured["coverage"] < 0.3 and not res.checks   # no KL, top-1 or pass/fail was computed from the sliver


@pytest.mark.parametrize("gate", [batch_invariance, prefix_cache, decode_vs_prefill])
def test_other_gates_on_replies_without_logprobs_are_errors(server, rng_seed, gate):
    s = GateSettings(prompts=_texts(rng_seed, 3, 12), max_tokens=8, batch_sizes=[2], long_prompt_repeats=2)
    set_plan(server.url)
    assert _run(server.url, gate, s).status == "pass"
    set_plan(server.url, {"null_logprobs": 0.9})
    res = _run(server.url, gate, s)
    assert res.status == "error", res.to_dict()
    assert "could be compared, below the minimum coverage 99 %" in res.error and "short: " in res.error
    assert res.measured["coverage"] < 0.5


def _gate_cli(tmp_path, monkeypatch, url, texts, journal=None):
    import fidelity.engine.gates.config as GC
    from fidelity.cli import main
    monkeypatch.setattr(GC, "load_reference", lambda *a, **k: toy_reference(texts))
    cfg = tmp_path / "gate.toml"
    cfg.write_text("[settings]\nprompt_logprobs = true\nbackoff_s = 0.01\n")
    js, xml = tmp_path / "g.json", tmp_path / "g.xml"
    js.unlink(missing_ok=True), xml.unlink(missing_ok=True)
    args = ["gate", "--engine", url, "--model", "toy", "--reference-store", "toy", "--only", "oracle-kl", "--config",
            str(cfg), "--json", str(js), "--junit", str(xml)] + (["--journal", str(journal)] if journal else [])
    return main(args), js, xml


@pytest.mark.parametrize("bad", ["999999999", "abc", "-1"])
def test_malformed_token_ids_are_protocol_errors_with_json_and_junit(server, tmp_path, monkeypatch, rng_seed, bad):
    import xml.etree.ElementTree as ET
    texts = _texts(rng_seed, 3)   # the fewest rows oracle-kl decides on (DEFAULT_MINIMUMS)
    journal = tmp_path / "journal.jsonl"
    set_plan(server.url, {"bad_prompt_id": bad})
    rc, js, xml = _gate_cli(tmp_path, monkeypatch, server.url, texts, journal)
    assert rc == 2
    (g,) = json.loads(js.read_text())["gates"]
    assert g["status"] == "error" and not g["checks"]
    want = "outside the reference's vocabulary of 32" if bad == "999999999" else f"has key {bad!r}, not a token id"
    assert want in g["error"], g["error"]
    suite = ET.parse(xml).getroot()
    assert suite.get("errors") == "1" and suite.get("failures") == "0"
    # nothing the engine said wrong was journaled: fixed, the rerun asks again and passes
    tags = [json.loads(line)["tag"] for line in journal.read_text().splitlines() if line.strip()]
    assert not [t for t in tags if t.startswith("oracle-kl/")]
    set_plan(server.url)
    rc, js, _ = _gate_cli(tmp_path, monkeypatch, server.url, texts, journal)
    rep = json.loads(js.read_text())
    assert rc == 0 and rep["gates"][0]["status"] == "pass" and rep["gates"][0]["measured"]["coverage"] == 1.0


def test_a_bad_reply_left_in_an_old_journal_is_asked_again(server, tmp_path, monkeypatch, rng_seed):
    """Journals written before replies were validated may hold one: it is not replayed."""
    texts = _texts(rng_seed, 3)
    journal = tmp_path / "journal.jsonl"
    set_plan(server.url)
    rc, _, _ = _gate_cli(tmp_path, monkeypatch, server.url, texts, journal)
    assert rc == 0
    recs = [json.loads(line) for line in journal.read_text().splitlines()]
    kl = next(r for r in recs if r["tag"].startswith("oracle-kl/"))
    kl["response"]["choices"][0]["prompt_logprobs"][1]["abc"] = {"logprob": -1.0}
    journal.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    rc, js, _ = _gate_cli(tmp_path, monkeypatch, server.url, texts, journal)
    rep = json.loads(js.read_text())
    assert rc == 0 and rep["client"]["sent"] >= 1 and rep["gates"][0]["status"] == "pass"
