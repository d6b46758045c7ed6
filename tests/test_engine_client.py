"""The engine client and journal against our fault-injecting loopback server (real processes, real sockets)."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from fidelity.engine.client import (ClientConfig, EngineClient, EngineError, EngineHTTPError, EngineProtocolError,
                                    parse_chat, parse_completion, parse_vllm_prompt_logprobs)
from testkit.faults import ToyModel, VOCAB, set_plan, spawn_fault_server
from fidelity.engine.journal import Journal, request_key
from fidelity.errors import FidelityError


@pytest.fixture(scope="module")
def server():
    with spawn_fault_server() as srv:
        yield srv


@pytest.fixture
def faults(server, tmp_path):
    """Returns (url, request log path) after switching the shared server to a plan."""
    def use(plan=None):
        log = tmp_path / "req.jsonl"
        set_plan(server.url, plan, str(log))
        return server.url, log
    return use


def attempts(log_path) -> list[dict]:
    return [json.loads(l) for l in open(log_path)] if log_path.exists() else []


def completion_attempts(log_path) -> list[dict]:
    return [r for r in attempts(log_path) if r["path"] == "/v1/completions"]


def run(coro):
    return asyncio.run(coro)


async def one_completion(url, prompt="the cat", **cfg):
    async with EngineClient(ClientConfig(url, model="toy", backoff_s=0.01, **cfg)) as c:
        comp = await c.completion(prompt, max_tokens=4, logprobs=3, echo=True, tag="t1")
        return comp, c.stats


def test_toy_logprobs_match_independent_softmax(faults, rng_seed):
    rng = np.random.default_rng(rng_seed)
    prompt = "".join(rng.choice(list("abcdefghij "), size=12))
    url, _ = faults()
    comp, stats = run(one_completion(url, prompt))
    toy = ToyModel()
    ids = toy.tokenize(prompt)
    assert [t.token for t in comp.logprobs[: len(ids)]] == list(prompt)
    assert comp.logprobs[0].logprob is None
    for t in range(1, len(ids)):
        raw = np.random.default_rng([toy.seed, (ids[t - 2] if t > 1 else -1) + 1, ids[t - 1] + 1]).normal(
            0, 2.0, len(VOCAB)
        )
        want = raw[ids[t]] - np.log(np.exp(raw).sum())
        assert comp.logprobs[t].logprob == pytest.approx(want, abs=1e-9)
    assert stats.sent == 1 and stats.retries == 0


def test_5xx_burst_is_retried_then_answered(faults):
    url, log = faults({"fail_attempts": 2})
    comp, stats = run(one_completion(url, retries=3))
    assert comp.text.startswith("the cat")
    assert stats.retries == 2 and stats.sent == 3
    assert [r["attempt"] for r in completion_attempts(log)] == [1, 2, 3]


def test_retries_are_bounded_and_the_error_names_the_request(faults):
    url, log = faults({"fail_attempts": 50})
    with pytest.raises(EngineError) as e:
        run(one_completion(url, retries=2))
    assert len(completion_attempts(log)) == 3
    msg = str(e.value)
    assert "gave up after 3 attempts" in msg and "HTTP 503" in msg and "'t1'" in msg and "/v1/completions" in msg


def test_4xx_is_not_retried(faults):
    url, log = faults()

    async def go():
        async with EngineClient(ClientConfig(url, model="toy", retries=3, backoff_s=0.01)) as c:
            await c.post("/v1/nothing-here", {"x": 1}, tag="missing")
    with pytest.raises(EngineHTTPError) as e:
        run(go())
    assert e.value.status == 404 and "'missing'" in str(e.value)
    assert sum(r["path"] == "/v1/nothing-here" for r in attempts(log)) == 1


@pytest.mark.parametrize("plan,expect", [
    ({"slow_s": 1.5, "slow_attempts": 1}, None),
    ({"slow_s": 1.5}, "timed out"),
    ({"malformed_attempts": 1}, None),
    ({"malformed_attempts": 9}, "not JSON"),
    ({"drop_attempts": 1}, None),
    ({"drop_attempts": 9}, "connection error"),
])
def test_slow_malformed_and_dropped_replies(faults, plan, expect):
    url, log = faults(plan)
    if expect is None:
        comp, stats = run(one_completion(url, retries=2, stall_s=0.5))
        assert comp.text.startswith("the cat") and stats.retries == 1
    else:
        with pytest.raises(EngineError, match=expect):
            run(one_completion(url, retries=2, stall_s=0.5))
        assert len(completion_attempts(log)) == 3


def test_truncated_logprobs_are_a_protocol_error_not_retried(faults):
    url, log = faults({"truncate_logprobs": True})
    with pytest.raises(EngineProtocolError, match=r"different lengths.*token_logprobs"):
        run(one_completion(url, retries=3))
    assert len(completion_attempts(log)) == 1


def test_concurrency_is_bounded(faults):
    url, log = faults({"latency_s": 0.3})

    async def go():
        async with EngineClient(ClientConfig(url, model="toy", concurrency=2)) as c:
            t0 = asyncio.get_running_loop().time()
            await asyncio.gather(*(c.completion(f"p{i}", max_tokens=1, tag=str(i)) for i in range(6)))
            return asyncio.get_running_loop().time() - t0
    took = run(go())
    assert took >= 0.9  # 6 requests, 2 at a time, 0.3 s each
    assert len(completion_attempts(log)) == 6


def test_journal_answers_finished_requests_without_sending(faults, tmp_path):
    url, log = faults()
    jpath = tmp_path / "journal.jsonl"
    first, s1 = run(one_completion(url, journal=jpath))
    again, s2 = run(one_completion(url, journal=jpath))
    assert s1.sent == 1 and s2.sent == 0 and s2.journal_hits == 1 and again.from_journal
    assert [t.logprob for t in again.logprobs] == [t.logprob for t in first.logprobs]
    assert len(completion_attempts(log)) == 1


def test_from_journal_is_each_requests_own(faults, tmp_path):
    """A journal hit while another request is in flight marks only the hit (a shared hit counter marked both)."""
    url, log = faults()
    jpath = tmp_path / "journal.jsonl"
    run(one_completion(url, journal=jpath))  # tag "t1" is journaled
    faults({"slow_s": 0.6})
    before = len(attempts(log))

    async def go():
        async with EngineClient(ClientConfig(url, model="toy", journal=jpath, timeout_s=30)) as c:
            fresh = asyncio.create_task(c.chat([{"role": "user", "content": "hi"}], max_tokens=2, tag="fresh"))
            await asyncio.sleep(0.2)  # the fresh request is on the wire
            hit = await c.completion("the cat", max_tokens=4, logprobs=3, echo=True, tag="t1")
            return await fresh, hit, c.stats
    fresh, hit, stats = run(go())
    assert hit.from_journal and not fresh.from_journal
    assert stats.sent == 1 and stats.journal_hits == 1
    assert [r["path"] for r in attempts(log)[before:]] == ["/v1/chat/completions"]


def test_journal_survives_a_cut_last_line_and_rejects_corruption(tmp_path):
    p = tmp_path / "j.jsonl"
    j = Journal(p)
    k1, k2 = request_key("/a", {"x": 1}), request_key("/a", {"x": 1}, tag="other")
    assert k1 != k2
    j.put(k1, {"v": 1})
    j.close()
    with open(p, "a") as f:
        f.write('{"key": "' + k2 + '", "resp')  # killed mid-write
    j = Journal(p)
    assert j.get(k1) == {"v": 1} and k2 not in j
    j.put(k2, {"v": 2})
    j.close()
    assert Journal(p).get(k2) == {"v": 2}
    lines = p.read_text().splitlines()
    p.write_text(lines[0] + "\nnot json\n" + lines[1] + "\n")
    with pytest.raises(FidelityError, match=rf"{p.name}.*line 2"):
        Journal(p)


def test_parse_vllm_prompt_logprobs_and_token_ids():
    reply = {"choices": [{"text": "ab", "finish_reason": "length",
                          "logprobs": {"tokens": ["token_id:5", "token_id:7"], "token_logprobs": [None, -0.5],
                                       "top_logprobs": [None, {"token_id:7": -0.5, "token_id:2": -1.5}]},
                          "prompt_logprobs": [None, {"7": {"logprob": -0.5, "rank": 1, "decoded_token": "b"}}]}]}
    c = parse_completion(reply)
    assert c.logprobs[1].token_id == 7 and c.logprobs[1].top_ids == {7: -0.5, 2: -1.5}
    assert c.prompt_logprobs[0] is None and c.prompt_logprobs[1].top_ids == {7: -0.5}
    with pytest.raises(EngineProtocolError, match=r"prompt_logprobs\[1\]"):
        parse_vllm_prompt_logprobs([None, "junk"])
    with pytest.raises(EngineProtocolError, match="not a logprob"):
        parse_completion({"choices": [{"text": "", "logprobs": {"tokens": ["a"], "token_logprobs": [0.7]}}]})


def test_cached_tokens_as_the_engine_states_them(rng_seed):
    """The prefix-cache count an engine states: OpenAI/vLLM usage.prompt_tokens_details.cached_tokens, llama.cpp's
    timings.cache_n, None where neither is said; a count that is no count, or more than the prompt, names its field."""
    rng = np.random.default_rng(rng_seed)
    prompt = int(rng.integers(1, 1000))
    cached = int(rng.integers(0, prompt + 1))
    reply = lambda **kw: {"choices": [{"text": "x", "finish_reason": "length"}], **kw}   # noqa: E731
    usage = {"prompt_tokens": prompt, "completion_tokens": 1}
    assert parse_completion(reply(usage=usage)).cached_tokens is None
    assert parse_completion(reply(usage={**usage, "prompt_tokens_details": None})).cached_tokens is None
    assert (
        parse_completion(reply(usage={**usage, "prompt_tokens_details": {"cached_tokens": cached}})).cached_tokens
        == cached
    )
    assert (
        parse_completion(reply(usage=usage, timings={"cache_n": cached, "prompt_n": prompt - cached})).cached_tokens
        == cached
    )
    for bad in (-1, "12", 3.0, True):
        with pytest.raises(
            EngineProtocolError, match=r"usage\.prompt_tokens_details\.cached_tokens is not a token count"
        ):
            parse_completion(
                reply(usage={**usage, "prompt_tokens_details": {"cached_tokens": bad}}), tag="prefix-cache/x"
            )
    with pytest.raises(
        EngineProtocolError, match=rf"timings\.cache_n = {prompt + 1} exceeds the prompt's {prompt} tokens"
    ):
        parse_completion(reply(usage=usage, timings={"cache_n": prompt + 1}))


def test_parse_chat_tool_calls_and_logprobs():
    reply = {
        "choices": [
            {
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
                        },
                        {"id": "c2", "type": "function", "function": {"name": "noop", "arguments": {"x": 1}}},
                    ],
                },
                "logprobs": {
                    "content": [{"token": "a", "logprob": -0.1, "top_logprobs": [{"token": "a", "logprob": -0.1}]}]
                },
            }
        ]
    }
    c = parse_chat(reply)
    assert [t.name for t in c.tool_calls] == ["get_weather", "noop"] and json.loads(c.tool_calls[0].arguments) == {
        "city": "Paris"
    }
    assert json.loads(c.tool_calls[1].arguments) == {"x": 1} and c.logprobs[0].top == {"a": -0.1}
    bad = {"choices": [{"message": {"tool_calls": [{"id": "c3", "function": {"arguments": "{}"}}]}}]}
    with pytest.raises(EngineProtocolError, match=r"tool_calls\[0\] has no function name"):
        parse_chat(bad, url="http://x/v1/chat/completions", tag="item-7")
    with pytest.raises(EngineProtocolError, match="item-7"):
        parse_chat({"choices": []}, tag="item-7")
