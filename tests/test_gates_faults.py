"""Gates and `fidelity gate` against the fault-injecting loopback server: errors are errors (exit 2), perturbed engines
are caught by the amount they are perturbed, the top-k KL estimator against an exact full-vocabulary KL, and resume
after a kill."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from scipy.special import log_softmax, rel_entr

from fidelity.engine.gates.invariance import batch_invariance, decode_vs_prefill
from fidelity.engine.gates.kinds import run_gate
from fidelity.engine.gates.logprobs import engine_position, position_kl
from fidelity.engine.gates.oracle_kl import _top1_agree, oracle_kl
from fidelity.engine.gates.settings import DEFAULT_THRESHOLDS, GateSettings
from fidelity.engine.reference import Reference
from fidelity.engine.client import ClientConfig, EngineClient, TokenLogprob
from testkit.faults import VOCAB, ToyModel, set_plan, spawn_fault_server, toy_reference

from _gate_cli import gate_cli

THREE = "batch-invariance,decode-vs-prefill,prefix-cache"


@pytest.fixture(scope="module")
def server():
    with spawn_fault_server() as srv:
        yield srv


def run_one(url, fn, *args, concurrency=4, **kw):
    async def go():
        async with EngineClient(ClientConfig(url, model="toy", concurrency=concurrency, backoff_s=0.01)) as c:
            return await run_gate(fn.__name__, fn, c, *args, **kw)
    return asyncio.run(go())


def random_texts(seed: int, n: int = 3, length: int = 20) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz ."), size=length)) for _ in range(n)]


@pytest.mark.slow
def test_clean_engine_passes_three_gates_with_json_and_junit(server, tmp_path):
    set_plan(server.url)
    js, xml = tmp_path / "g.json", tmp_path / "g.xml"
    r = gate_cli("--engine", server.url, "--model", "toy", "--only", THREE, "--json", str(js), "--junit", str(xml))
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(js.read_text())
    assert [g["status"] for g in rep["gates"]] == ["pass"] * 3
    assert all(g["measured"]["max_abs_dlogprob"] == 0.0 for g in rep["gates"])
    import xml.etree.ElementTree as ET
    suite = ET.parse(xml).getroot()
    assert suite.get("tests") == "3" and suite.get("failures") == "0" and suite.get("errors") == "0"


@pytest.mark.slow
def test_unreachable_or_failing_engine_is_exit_2_not_pass_or_fail(server, tmp_path):
    log = tmp_path / "req.jsonl"
    set_plan(server.url, {"fail_attempts": 1000}, str(log))
    js, xml = tmp_path / "g.json", tmp_path / "g.xml"
    r = gate_cli(
        "--engine",
        server.url,
        "--model",
        "toy",
        "--only",
        THREE,
        "--retries",
        "2",
        "--json",
        str(js),
        "--junit",
        str(xml),
    )
    assert r.returncode == 2, r.stdout + r.stderr
    rep = json.loads(js.read_text())
    assert [g["status"] for g in rep["gates"]] == ["error"] * 3
    assert all("gave up after 3 attempts" in g["error"] and "HTTP 503" in g["error"] for g in rep["gates"])
    assert xml.read_text().count("<error ") == 3
    # bounded: every logical request was tried exactly 1 + retries times (a body sent under two tags counts twice)
    counts = {}
    for line in open(log):
        rec = json.loads(line)
        counts[rec["key"]] = max(counts.get(rec["key"], 0), rec["attempt"])
    assert counts and all(v % 3 == 0 for v in counts.values())


@pytest.mark.slow
def test_timeouts_are_errors(server, tmp_path):
    set_plan(server.url, {"slow_s": 3})
    r = gate_cli(
        "--engine", server.url, "--model", "toy", "--only", "prefix-cache", "--timeout", "0.5", "--retries", "1"
    )
    assert r.returncode == 2 and "timed out" in r.stdout.replace("\n", " ")


@pytest.mark.parametrize("delta", [0.02, 0.3])
def test_prefill_perturbation_is_caught_by_its_size(server, delta, rng_seed):
    set_plan(server.url, {"perturb_prefill": delta})
    s = GateSettings(prompts=random_texts(rng_seed), max_tokens=6, top_k=len(VOCAB))
    res = run_one(server.url, decode_vs_prefill, s)
    assert res.status == "fail"
    # independent: logits shifted by +-delta by token parity; the max |change| of a logprob over these positions
    toy = ToyModel()
    worst = 0.0
    for text in s.prompts:
        ids = toy.tokenize(text)
        for _ in range(s.max_tokens):
            base = toy.logprobs_after(ids)
            shifted = log_softmax(base + delta * np.where(np.arange(len(VOCAB)) % 2 == 0, 1.0, -1.0))
            nxt = int(np.argmax(base))
            worst = max(worst, abs(shifted[nxt] - base[nxt]))
            ids.append(nxt)
    assert res.measured["max_abs_dlogprob"] == pytest.approx(worst, rel=1e-9)
    set_plan(server.url)
    assert run_one(server.url, decode_vs_prefill, s).status == "pass"


def test_batch_dependent_perturbation_is_caught(server, rng_seed):
    set_plan(server.url, {"perturb_batched": 0.05, "latency_s": 0.05})
    s = GateSettings(prompts=random_texts(rng_seed, n=3), max_tokens=4, batch_sizes=[2, 3])
    res = run_one(server.url, batch_invariance, s)
    assert res.status == "fail" and 0 < res.measured["max_abs_dlogprob"] <= 2 * 0.05 + 1e-12
    w = res.worst[0]  # changed continuations first, then the largest delta
    assert (not w["identical"]) or w["max_abs_dlogprob"] == res.measured["max_abs_dlogprob"]
    # the same engine is fine for requests sent one at a time
    assert run_one(server.url, decode_vs_prefill, s, concurrency=1).status == "pass"


def exact_kl(ref_lp: np.ndarray, eng_lp: np.ndarray) -> float:
    return float(rel_entr(np.exp(ref_lp), np.exp(eng_lp)).sum())


@pytest.mark.parametrize("k,vllm", [(len(VOCAB), False), (4, False), (4, True)])
def test_oracle_kl_estimator_against_exact_full_vocab_kl(server, rng_seed, k, vllm):
    delta = 0.4
    set_plan(server.url, {"perturb_prefill": delta})
    texts = random_texts(rng_seed, n=3, length=15)      # 3 rows: the fewest oracle-kl decides on
    ref = toy_reference(texts)
    res = run_one(server.url, oracle_kl, ref, GateSettings(top_k=k, prompt_logprobs=vllm), prompt_as="ids")
    assert res.status == "fail"
    sign = np.where(np.arange(len(VOCAB)) % 2 == 0, 1.0, -1.0)
    exact = [
        exact_kl(r.logprobs[j], log_softmax(r.logprobs[j] + delta * sign))
        for r in ref.rows
        for j in range(len(r.scored))
    ]
    assert res.measured["positions"] == len(exact)
    assert res.worst[0]["kl"] == res.measured["kl_max"] and {"row", "position", "token", "engine_top1"} <= set(
        res.worst[0]
    )
    if k == len(VOCAB):  # full distributions: the estimator is the full KL
        assert res.measured["kl_mean"] == pytest.approx(np.mean(exact), rel=1e-9)
        assert res.measured["ref_tail_mass_max"] < 1e-9
    else:  # top-k: a lower bound, and the gap equals tail_mass * KL(tails) computed here
        assert res.measured["kl_mean"] <= np.mean(exact) + 1e-12
        gaps = []
        for r in ref.rows:
            for j in range(len(r.scored)):
                p = r.logprobs[j]
                q = log_softmax(p + delta * sign)
                seen = set(np.argsort(-q, kind="stable")[:k]) | {r.tokens[r.scored[j]]}
                tail = np.array([i for i in range(len(VOCAB)) if i not in seen])
                pt, qt = np.exp(p[tail]).sum(), np.exp(q[tail]).sum()
                gaps.append(pt * exact_kl(p[tail] - np.log(pt), q[tail] - np.log(qt)))
        assert np.mean(exact) - res.measured["kl_mean"] == pytest.approx(np.mean(gaps), rel=1e-6, abs=1e-12)
    set_plan(server.url)
    clean = run_one(server.url, oracle_kl, ref, GateSettings(top_k=k, prompt_logprobs=vllm), prompt_as="text")
    assert clean.status == "pass" and clean.measured["kl_mean"] < 1e-12 and clean.measured["top1"] == 1.0


def test_shifted_echo_is_named_with_the_fix_to_try(server, rng_seed):
    """An engine whose echo logprobs come one position early (llama-cpp-python without BOS): both gates that read echoes
    fail, and name the shift, checked against the reference and against the engine's own next-token answer."""
    texts = random_texts(rng_seed, n=3, length=15)
    ref = toy_reference(texts)
    s = GateSettings(prompts=texts, max_tokens=5, top_k=len(VOCAB))
    set_plan(server.url, {"shift_echo": True})
    kl = run_one(server.url, oracle_kl, ref, s, prompt_as="ids")
    dvp = run_one(server.url, decode_vs_prefill, s)
    assert kl.status == "fail" and kl.measured["echo_shift"] == 1 and kl.measured["kl_mean"] > 0.1
    note = kl.notes[0]
    # shifted by one, the entries are the toy model's exact distributions: KL 0 there
    assert re.search(
        r"shifted by \+1 position: the entry for each token holds the distribution of the token 1 after it "
        r"\(against the reference: mean KL [0-9.e-]+ as returned, 0 shifted by \+1\)",
        note,
    ), note
    assert "start every prompt with the BOS token" in note and "prompt_logprobs" in note
    assert f"Confirmed by the engine itself: its next-token logprobs after row {ref.rows[0].id}" in note
    assert dvp.status == "fail" and dvp.measured["echo_shift"] == 1 and "shifted by +1" in dvp.notes[0]
    assert "the decode's own logprobs vs the prefill's echo: mean KL" in dvp.notes[0]
    # controls: an aligned echo passes with nothing named; a perturbed (not shifted) one fails with nothing named
    for plan, status in (({}, "pass"), ({"perturb_prefill": 0.3}, "fail")):
        set_plan(server.url, plan)
        for res in (run_one(server.url, oracle_kl, ref, s, prompt_as="ids"), run_one(server.url, decode_vs_prefill, s)):
            assert res.status == status and "echo_shift" not in res.measured, (plan, res.measured)
            assert not any("misalignment" in n for n in res.notes)
    set_plan(server.url)


@pytest.mark.slow
def test_bad_config_and_only_are_named(tmp_path, server):
    cfg = tmp_path / "gate.toml"
    cfg.write_text("[decode-vs-prefill]\nkl_mean_maxx = 1\n")
    r = gate_cli("--engine", server.url, "--model", "toy", "--config", str(cfg))
    assert r.returncode == 2 and "kl_mean_maxx" in r.stderr and "gate.toml" in r.stderr
    cfg.write_text("[settings]\nmax_tokens = 4\n[prefix_cache]\nidentical_min = 1\n")
    r = gate_cli("--engine", server.url, "--model", "toy", "--config", str(cfg))
    assert r.returncode == 2 and "[prefix_cache]" in r.stderr
    r = gate_cli("--engine", server.url, "--model", "toy", "--only", "oracle-kl,batch-invarience")
    assert r.returncode == 2 and "batch-invarience" in r.stderr


@pytest.mark.slow
def test_thresholds_from_toml_turn_a_fail_into_a_pass(server, tmp_path):
    set_plan(server.url, {"perturb_prefill": 0.01})
    cfg = tmp_path / "gate.toml"
    cfg.write_text("[settings]\nmax_tokens = 4\n[decode-vs-prefill]\nmax_abs_dlogprob_max = 0.05\nkl_mean_max = 0.01\n")
    args = ["--engine", server.url, "--model", "toy", "--only", "decode-vs-prefill"]
    assert gate_cli(*args).returncode == 1
    assert gate_cli(*args, "--config", str(cfg)).returncode == 0


@pytest.mark.slow
def test_interrupted_run_resumes_without_resending_and_ends_equal(server, tmp_path):
    log = tmp_path / "req.jsonl"
    journal = tmp_path / "journal.jsonl"
    set_plan(server.url, {"latency_s": 0.1}, str(log))
    base = ["--engine", server.url, "--model", "toy", "--only", THREE]
    full = tmp_path / "full.json"
    assert gate_cli(*base, "--json", str(full)).returncode == 0
    total = sum(1 for l in open(log) if json.loads(l)["path"] == "/v1/completions")
    log.unlink()

    proc = subprocess.Popen([sys.executable, "-m", "fidelity", "gate", *base, "--journal", str(journal)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while (not journal.exists() or sum(1 for _ in open(journal)) < total // 3) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = sum(1 for _ in open(journal))
    assert 0 < done < total
    log.unlink()

    resumed = tmp_path / "resumed.json"
    r = gate_cli(*base, "--journal", str(journal), "--json", str(resumed))
    assert r.returncode == 0, r.stdout + r.stderr
    sent_after = sum(1 for l in open(log) if json.loads(l)["path"] == "/v1/completions")
    assert sent_after == total - done
    a, b = json.loads(full.read_text()), json.loads(resumed.read_text())
    assert b["client"]["journal_hits"] == done
    strip = lambda rep: [(g["gate"], g["status"], g["measured"], g["worst"]) for g in rep["gates"]]
    assert strip(a) == strip(b)


def test_documented_defaults_match_the_code():
    from fidelity.commands import gate as cmd

    for name, th in DEFAULT_THRESHOLDS.items():
        import re
        line = next(l for l in cmd.__doc__.splitlines() if l.strip().startswith(name + " "))
        documented = {k: float(v) for k, v in re.findall(r"(\w+) = ([0-9.e+-]+)", line)}
        assert documented == th, (name, line)


def test_oracle_kl_without_a_usable_reference_could_not_run(server, tmp_path):
    from fidelity.engine.gates.config import run_gates

    set_plan(server.url)
    rep = asyncio.run(run_gates(server.url, "toy", ["oracle-kl"], {}))
    assert rep["exit_code"] == 2 and "needs --reference-store" in rep["gates"][0]["error"]
    rep = asyncio.run(run_gates(server.url, "toy", ["oracle-kl"], {}, store=str(tmp_path / "nowhere")))
    assert (
        rep["exit_code"] == 2
        and "not a reference store" in rep["gates"][0]["error"]
        and "nowhere" in rep["gates"][0]["error"]
    )


@pytest.mark.slow
def test_proxy_mode_perturbs_a_real_upstream_by_a_bounded_amount(server, rng_seed):
    """--upstream: the same faults in front of any engine (here the toy server); +-delta per returned logprob,
    renormalized within the returned set, so no logprob moves by more than 2 delta."""
    set_plan(server.url)
    delta = 0.05
    s = GateSettings(prompts=random_texts(rng_seed), max_tokens=4, top_k=8)
    with spawn_fault_server({"perturb_prefill": delta}, upstream=server.url) as proxy:
        res = run_one(proxy.url, decode_vs_prefill, s)
        assert res.status == "fail" and 0 < res.measured["max_abs_dlogprob"] <= 2 * delta + 1e-12
        set_plan(proxy.url, {"truncate_logprobs": True})
        assert run_one(proxy.url, decode_vs_prefill, s).status == "error"
    assert run_one(server.url, decode_vs_prefill, s).status == "pass"


def test_text_keys_that_several_ids_share_are_never_attributed():
    """llama-cpp-python renders partial-UTF-8 tokens by dropping the bytes (" \\xe2" -> " ") and special tokens as "",
    and its text-keyed top lists overwrite colliding keys: such texts must go to the tail bucket and leave top-1
    undecided."""
    pieces = ["a", " ", " \ufffd", "<|end|>", "b", "b"]
    ref = Reference(rows=[], pieces=pieces, detokenize="".join, special_ids={3})
    assert ref.piece_ids() == {"a": 0, "<|end|>": 3}  # engines that render specials by name still map them
    lp = np.log(np.array([0.1, 0.05, 0.6, 0.05, 0.1, 0.1]))
    tl = TokenLogprob(token="a", logprob=float(lp[0]), top={" ": float(lp[2]), "a": float(lp[0])})  # " " is really id 2
    amb = ref.ambiguous_texts()
    assert _top1_agree(tl, lp, ref, amb) is None
    pk = position_kl(lp, engine_position(tl, 0, ref.piece_ids()))
    assert pk.kl == pytest.approx(0.0, abs=1e-12) and pk.tail_mass == pytest.approx(0.9)
    tl_id = TokenLogprob(token="a", logprob=float(lp[0]), top_ids={2: float(lp[2]), 0: float(lp[0])})
    assert _top1_agree(tl_id, lp, ref, amb) is True
