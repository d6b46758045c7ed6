"""Issue 41, defects 3 and 5 against the fault server: an engine that drips its reply a byte at a time ends in an
EngineError within the request's deadline (retries included), in the client, in `fidelity gate` (exit 2) and in the
bench's stream reader; and no gate passes on a sliver of evidence (one scored position, one prompt): it could not run,
saying what it had and what it needed."""
from __future__ import annotations

import asyncio
import json
import subprocess
import time

import numpy as np
import pytest

from fidelity.engine.gates.invariance import batch_invariance, decode_vs_prefill, prefix_cache
from fidelity.engine.gates.kinds import run_gate
from fidelity.engine.gates.oracle_kl import oracle_kl
from fidelity.engine.gates.settings import GateSettings
from fidelity.engine.bench import BenchConfig, Streamer
from fidelity.engine.client import ClientConfig, EngineClient, EngineError
from testkit.faults import set_plan, spawn_fault_server, toy_reference

from _gate_cli import gate_cli

DRIP = {"drip_s": 0.5}   # a completion's JSON is hundreds of bytes: minutes at this pace, and no read waits over 0.5 s


@pytest.fixture(scope="module")
def server():
    with spawn_fault_server() as srv:
        yield srv


def _texts(seed: int, n: int, length: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz ."), size=length)) for _ in range(n)]


async def _complete(url: str, **cfg):
    async with EngineClient(ClientConfig(url, model="toy", backoff_s=0.01, **cfg)) as c:
        return await c.completion("the cat", max_tokens=8, logprobs=3, echo=True, tag="drip")


def _timed(coro, bound_s: float):
    """(result or exception, seconds); an outer bound so that a client that never gives up fails the test instead
    of hanging it."""
    async def go():
        t0 = time.monotonic()
        try:
            out = await asyncio.wait_for(coro, bound_s)
        except asyncio.TimeoutError:
            pytest.fail(f"still waiting after {bound_s:g} s: no deadline ended the request")
        except Exception as e:  # the error under test
            out = e
        return out, time.monotonic() - t0
    return asyncio.run(go())


@pytest.mark.parametrize("plan", [DRIP, {**DRIP, "fail_attempts": 1}])
def test_a_dripping_engine_ends_in_an_engine_error_within_the_deadline(server, plan):
    """With a 503 first, the deadline covers the retry too: it is the request's, not an attempt's."""
    set_plan(server.url, plan)
    deadline = 2.0
    err, took = _timed(_complete(server.url, timeout_s=deadline, retries=3), 30)
    assert isinstance(err, EngineError), err
    assert deadline <= took < deadline + 1.5, took
    msg = str(err)
    assert f"within the request's deadline of {deadline:g} s" in msg and "'drip'" in msg and "/v1/completions" in msg
    assert f"after {1 + plan.get('fail_attempts', 0)} attempt(s)" in msg
    set_plan(server.url)


def test_a_stall_is_retried_within_the_deadline(server):
    """stall_s bounds one read: a reply that stalls past it is asked again, as long as the deadline allows."""
    set_plan(server.url, {"slow_s": 1.5, "slow_attempts": 1})
    out, took = _timed(_complete(server.url, timeout_s=10, stall_s=0.5, retries=2), 30)
    assert not isinstance(out, Exception), out
    assert out.text.startswith("the cat") and took < 5
    set_plan(server.url)


def test_fidelity_gate_against_a_dripping_engine_exits_2(server, tmp_path):
    set_plan(server.url, DRIP)
    js = tmp_path / "g.json"
    t0 = time.monotonic()
    try:
        r = gate_cli("--engine", server.url, "--model", "toy", "--only", "batch-invariance", "--timeout", "2", "--json",
                     str(js), timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("fidelity gate still running after 120 s against an engine that drips its replies")
    took = time.monotonic() - t0
    set_plan(server.url)
    assert r.returncode == 2, r.stdout + r.stderr
    (g,) = json.loads(js.read_text())["gates"]
    assert g["status"] == "error" and "within the request's deadline of 2 s" in g["error"]
    assert g["seconds"] < 5 and took < 60


def test_the_bench_stream_reader_keeps_one_deadline_over_its_retries(server):
    """A stream that never stalls (a token every 0.3 s, 400 tokens) and never ends: cut at timeout_s, and no retry
    starts after it (each attempt had its own timeout_s before: three of them here)."""
    set_plan(server.url, {"token_interval_s": 0.3})
    cfg = BenchConfig(server.url, "toy", timeout_s=2.0, stall_s=30.0, retries=2, backoff_s=0.01)
    body = {"model": "toy", "messages": [{"role": "user", "content": "go"}], "max_tokens": 400, "stream": True}

    async def go():
        st = Streamer(cfg, 1)
        try:
            return await st.request("/v1/chat/completions", body, "drip"), st.sent
        finally:
            await st.aclose()
    (sample, sent), took = _timed(go(), 60)
    set_plan(server.url)
    assert not sample.ok and "within 2 s (the request's deadline, retries included)" in sample.error
    assert sent == 1 and 2.0 <= took < 3.5, (sent, took)


# ---- minimum evidence
# ---------------------------------------------------------------------------------------------------

def _gate(url, fn, *args, **kw):
    async def go():
        async with EngineClient(ClientConfig(url, model="toy", concurrency=4, backoff_s=0.01)) as c:
            return await run_gate(fn.__name__, fn, c, *args, **kw)
    return asyncio.run(go())


def test_oracle_kl_on_one_scored_position_could_not_run(server):
    set_plan(server.url)
    ref = toy_reference(["ab"])                        # one row, one scored position, every logprob present
    res = _gate(server.url, oracle_kl, ref, GateSettings(top_k=5), prompt_as="ids")
    assert res.status == "error" and not res.checks, res.to_dict()
    assert ("could not run: 1 scored positions in 1 panel rows were compared; a verdict needs at least 20 positions "
            "and 3 panel rows" in res.error)
    assert res.measured == {"rows": 1, "positions": 1, "min_rows": 3, "min_positions": 20}


def test_oracle_kl_decides_at_the_minimums_and_not_below(server, rng_seed):
    set_plan(server.url)
    ref = toy_reference(_texts(rng_seed, 3, 8))        # 3 rows x 7 scored positions = 21
    s = GateSettings(top_k=5)
    assert _gate(server.url, oracle_kl, ref, s, prompt_as="ids").status == "pass"
    res = _gate(server.url, oracle_kl, ref, s, {"min_positions": 22}, prompt_as="ids")
    assert res.status == "error" and "21 scored positions in 3 panel rows" in res.error and "at least 22" in res.error


@pytest.mark.parametrize("gate,what", [(batch_invariance, "1 (prompt, batch size) pairs"),
                                       (decode_vs_prefill, "1 prompts")])
def test_self_consistency_gates_on_one_prompt_could_not_run(server, rng_seed, gate, what):
    set_plan(server.url)
    s = GateSettings(prompts=_texts(rng_seed, 1, 10), max_tokens=4, batch_sizes=[2])
    res = _gate(server.url, gate, s)
    assert res.status == "error" and not res.checks, res.to_dict()
    assert f"positions in {what} were compared; a verdict needs at least 4 positions and 2 " in res.error


def test_prefix_cache_minimums_from_its_section(server, rng_seed):
    set_plan(server.url)
    s = GateSettings(prompts=_texts(rng_seed, 2, 10), max_tokens=2, long_prompt_repeats=2)
    assert _gate(server.url, prefix_cache, s).status == "pass"
    res = _gate(server.url, prefix_cache, s, {"min_rows": 4})
    assert (
        res.status == "error"
        and "in 3 cases were compared; a verdict needs at least 4 positions and 4 cases" in res.error
    )


def test_gate_toml_sets_the_minimums_and_refuses_bad_ones(server, tmp_path, monkeypatch, capsys, rng_seed):
    """Through the CLI: exit 2 with the counts (JSON and JUnit written) below a minimum set in gate.toml; a minimum
    that is not a whole number >= 1 is refused naming the file."""
    import fidelity.engine.gates.config as GC
    from fidelity.cli import main

    set_plan(server.url)
    monkeypatch.setattr(GC, "load_reference", lambda *a, **k: toy_reference(_texts(rng_seed, 3, 12)))
    cfg, js = tmp_path / "gate.toml", tmp_path / "g.json"
    args = ["gate", "--engine", server.url, "--model", "toy", "--reference-store", "toy", "--only", "oracle-kl",
            "--config", str(cfg), "--json", str(js)]
    cfg.write_text("[oracle-kl]\nmin_rows = 4\n")
    assert main(args) == 2
    (g,) = json.loads(js.read_text())["gates"]
    assert (
        g["status"] == "error" and "33 scored positions in 3 panel rows" in g["error"] and "4 panel rows" in g["error"]
    )
    cfg.write_text("[oracle-kl]\nmin_rows = 3\n")
    assert main(args) == 0
    for bad in ("0", "2.5", "true"):
        cfg.write_text(f"[oracle-kl]\nmin_positions = {bad}\n")
        js.unlink(missing_ok=True)
        assert main(args) == 2 and not js.exists()
        err = capsys.readouterr().err
        assert str(cfg) in err and "[oracle-kl] min_positions must be a " in err, err
