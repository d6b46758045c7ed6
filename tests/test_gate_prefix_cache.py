"""The prefix-cache gate against a stub engine with a real multi-entry prefix cache of its own (characters are its
tokens; a prompt is served from the cache up to the longest block-aligned prefix any earlier prompt shares with it). The
stub states its cached prompt tokens the way vLLM/OpenAI (`usage.prompt_tokens_details.cached_tokens`) or llama.cpp
(`timings.cache_n`) do, or not at all, or states 0 (cache off), or changes its logprobs when it reads the cache. What
is checked against the stub's own books: no request asks for echo, every cold request is cold (also when the same gate
ran before), the cached tokens the gate reports are the ones the stub served, and the verdict each mode deserves."""
from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from http.server import ThreadingHTTPServer

import numpy as np
import pytest

from fidelity.engine.client import ClientConfig, EngineClient
from fidelity.engine.gates.invariance import prefix_cache
from fidelity.engine.gates.kinds import run_gate
from fidelity.engine.gates.settings import GateSettings
from fidelity.engine.serve import JsonHandler
from fidelity.engine.spawn import free_port

BLOCK = 16
DRIFT = 1e-3  # what the "drift" engine adds to every logprob of a request it served partly from its cache


class CachingStub:
    """Greedy generation as a hash of the text so far; a prefix cache of every prompt seen."""

    def __init__(self):
        self.mode, self.seen, self.requests = "count", [], []

    def reset(self, mode: str):
        self.mode, self.seen, self.requests = mode, [], []

    def cached(self, prompt: str) -> int:
        best = max((len(_common_prefix(prompt, p)) for p in self.seen), default=0)
        return min(best, len(prompt) - 1) // BLOCK * BLOCK   # at least the last token is computed

    def complete(self, body: dict) -> dict:
        prompt = body["prompt"]
        cached = self.cached(prompt) if self.mode != "zero" else 0
        self.seen.append(prompt)
        self.requests.append({"prompt": prompt, "echo": bool(body.get("echo")), "cached": cached})
        text, tokens, lps, tops = "", [], [], []
        for _ in range(body.get("max_tokens", 16)):
            h = hashlib.sha256((prompt + text).encode()).digest()
            tok = chr(97 + h[0] % 26)
            lp = -0.05 - h[1] / 300 + (DRIFT if self.mode == "drift" and cached else 0.0)
            alt = chr(97 + (h[0] + 1) % 26)
            tokens.append(tok), lps.append(lp), tops.append({tok: lp, alt: lp - 1.5})
            text += tok
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(tokens)}
        reply = {"choices": [{"text": text, "finish_reason": "length", "index": 0,
                              "logprobs": {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops}}]}
        if self.mode in ("count", "zero", "drift"):
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        elif self.mode == "timings":
            reply["timings"] = {"cache_n": cached, "prompt_n": len(prompt) - cached}
        return {**reply, "usage": usage}


def _common_prefix(a: str, b: str) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return a[:n]


@pytest.fixture(scope="module")
def stub():
    engine = CachingStub()

    class Handler(JsonHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            self.send_json(200, engine.complete(body))

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engine.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield engine
    server.shutdown()


def gate(stub, settings: GateSettings):
    async def go():
        async with EngineClient(ClientConfig(stub.url, model="stub", concurrency=1, backoff_s=0.01)) as c:
            return await run_gate("prefix-cache", prefix_cache, c, settings)
    return asyncio.run(go())


def settings(rng_seed: int) -> GateSettings:
    rng = np.random.default_rng(rng_seed)
    words = ["river", "stone", "bread", "cloud", "lamp", "garden", "winter", "copper", "violin", "harbor"]
    prompts = [" ".join(rng.choice(words, size=int(rng.integers(4, 9)))) for _ in range(int(rng.integers(2, 7)))]
    return GateSettings(prompts=prompts, max_tokens=int(rng.integers(4, 12)), long_prompt_repeats=6)


@pytest.mark.parametrize("mode", ["count", "timings"])
def test_a_cache_that_keeps_the_numbers_passes_and_its_hits_are_the_engines(stub, rng_seed, mode):
    s = settings(rng_seed)
    stub.reset(mode)
    first = gate(stub, s)
    second = gate(stub, s)    # the same gate again on a cache that holds all of the first run's prompts
    assert first.status == second.status == "pass", (first.to_dict(), second.to_dict())
    assert not any(r["echo"] for r in stub.requests), "the gate asked for echo (an engine may then skip its cache)"
    cases = 1 + max(2, len(s.prompts) // 2)
    assert len(stub.requests) == 2 * (2 + 3 * (cases - 1))
    half = len(stub.requests) // 2
    for res, served in ((first, stub.requests[:half]), (second, stub.requests[half:])):
        m = res.measured
        assert m["cache"] == "hit" and m["cache_hit_cases"] == cases and m["identical"] == 1.0
        assert m["max_abs_dlogprob"] == 0.0 and m["cases"] == cases
        assert m["cached_tokens_total"] == sum(r["cached"] for r in served)
        rows = {r["case"]: r for r in res.worst}
        assert all(r["cold_cached_tokens"] == 0 for r in rows.values()), "a cold request was served from the cache"
        long_prompt = served[0]["prompt"]
        assert served[1]["prompt"] == long_prompt and rows["long prompt"]["warm_cached_tokens"] == \
            (len(long_prompt) - 1) // BLOCK * BLOCK
        assert not any("not observable" in n for n in res.notes)


def test_a_cache_that_changes_the_logprobs_fails(stub, rng_seed):
    stub.reset("drift")
    res = gate(stub, settings(rng_seed))
    assert res.status == "fail" and res.measured["cache"] == "hit", res.to_dict()
    assert res.measured["max_abs_dlogprob"] == pytest.approx(DRIFT, abs=1e-12)
    assert [c.metric for c in res.checks if not c.passed] == ["max_abs_dlogprob"]


def test_an_engine_that_states_no_cached_tokens_gets_its_verdict_with_the_note(stub, rng_seed):
    stub.reset("none")
    res = gate(stub, settings(rng_seed))
    assert res.status == "pass" and res.measured["cache"] == "not observable", res.to_dict()
    assert res.notes[0].startswith("cache use not observable")


def test_an_engine_whose_cache_served_nothing_could_not_run(stub, rng_seed):
    stub.reset("zero")
    res = gate(stub, settings(rng_seed))
    assert res.status == "error" and not res.checks, res.to_dict()
    assert "served none of the warm requests' prompt tokens from its prefix cache" in res.error
    assert res.measured == {"cache": "not used", "cache_hit_cases": 0, "warm_cached_tokens_min": 0,
                            "cached_tokens_total": 0}
