"""`fidelity bench` against the fault server's paced toy stream (rates known by construction, faults injected) and
against a real llama-cpp-python server serving SmolLM2 (slow)."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest

from fidelity.engine.bench import CACHE_HIT_GAIN_PCT, BenchConfig, load_prompts, parse_length, run_bench
from testkit.faults import set_plan, spawn_fault_server
from fidelity.errors import ConfigError

from _gate_cli import gate_cli
from _llamacpp import llama_server


@pytest.fixture(scope="module")
def server():
    with spawn_fault_server() as srv:
        yield srv


def bench(url, model="toy", **kw):
    kw = {"streams": [], "prefill": [], "repeats": 1, "max_tokens": 16, "prompts_per_set": 1, "retries": 1,
          "backoff_s": 0.05, **kw}
    return asyncio.run(run_bench(BenchConfig(url, model, **kw)))


def hand_timed_stream(
    url: str, model: str, prompt: str, max_tokens: int, extra: dict | None = None
) -> tuple[float, int]:
    """One streamed chat request timed here, independently of fidelity.engine.bench: (decode tok/s after the first
    chunk, chunks)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        **(extra or {}),
    }
    times = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                ch = json.loads(line[5:])["choices"]
                if ch and (ch[0].get("delta") or {}).get("content"):
                    times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0]), len(times)


def test_prompt_sets_ship_with_provenance():
    data = load_prompts()
    assert "fidelity project" in data["provenance"]
    assert set(data["sets"]) == {"code", "prose", "structured"} and all(len(v) >= 3 for v in data["sets"].values())
    assert parse_length("3k") == 3000 and parse_length("512") == 512
    with pytest.raises(ConfigError, match="'x3'"):
        parse_length("x3")
    with pytest.raises(ConfigError, match="unknown prompt set.*'poems'"):
        BenchConfig("http://x", "m", sets=["poems"]).check()


def test_decode_rate_matches_the_pace_and_a_hand_timed_stream(server):
    interval = 0.02
    set_plan(server.url, {"token_interval_s": interval})
    doc = bench(server.url, max_tokens=40, repeats=2)
    hand, chunks = hand_timed_stream(server.url, "toy", "hello", 40)
    rate = doc["metrics"]["decode.all"]["median"]
    print("bench", rate, "hand", hand)
    assert chunks == 40
    assert rate <= 1.02 / interval  # the server sleeps `interval` between chunks: no faster than that
    assert abs(rate / hand - 1) < 0.2
    assert doc["usage_check"]["completion_mismatches"] == 0 and doc["usage_check"]["requests_with_usage"] == 6
    assert doc["eos"]["stopped_early"] == 0 and doc["errors"] == []
    assert len(doc["warmup"]) == 1 and doc["requests"]["sent"] == 7  # warm-up sent, not measured


def test_concurrent_streams_overlap_at_the_server(server):
    set_plan(server.url, {"token_interval_s": 0.02})
    doc = bench(server.url, sets=[], streams=[1, 4], max_tokens=30, repeats=2)
    seen = httpx.get(server.url + "/_stats").json()["max_in_flight"]
    lv = doc["streams"]["4"]
    assert seen == 4 and lv["max_in_flight"] == [4, 4] and lv["overlap"] == [True, True]
    one, four = doc["metrics"]["aggregate.1"]["median"], doc["metrics"]["aggregate.4"]["median"]
    assert four > 2.5 * one  # the toy server paces each stream on its own: four streams carry ~4x the tokens
    for t in ("mean", "p50", "p90"):
        assert lv["ttft"][t] is not None
    assert lv["ttft"]["p50"] <= lv["ttft"]["p90"]


def test_stalled_streams_are_errors_after_bounded_retries_without_hanging(server):
    set_plan(server.url, {"stream_stall_after": 3, "stream_stall_s": 60})
    t0 = time.monotonic()
    doc = bench(server.url, sets=["code"], max_tokens=10, stall_s=1.0, retries=1)
    took = time.monotonic() - t0
    assert took < 20, took
    assert len(doc["errors"]) == 1 and doc["errors"][0]["attempts"] == 2
    assert "stalled" in doc["errors"][0]["error"] and "decode:code" in doc["errors"][0]["error"]
    assert doc["metrics"]["decode.code"]["median"] is None  # nothing finished: no number


def test_dropped_streams_are_retried_then_reported(server):
    set_plan(server.url, {"stream_drop_after": 4, "stream_fault_attempts": 1})  # each body's first attempt is cut
    doc = bench(server.url, sets=["prose"], max_tokens=10)
    # the warm-up is retried once; the measured request has the same body, so the server already counts it a second
    # attempt
    assert doc["errors"] == [] and doc["requests"]["retries"] == 1
    set_plan(server.url, {"stream_drop_after": 4})  # every attempt cut
    doc = bench(server.url, sets=["prose"], max_tokens=10, retries=2)
    assert len(doc["errors"]) == 1 and doc["errors"][0]["attempts"] == 3
    assert "before [DONE]" in doc["errors"][0]["error"] or "connection" in doc["errors"][0]["error"]
    set_plan(server.url, {"fail_attempts": 1})  # a 503 first: retried
    doc = bench(server.url, sets=["prose"], max_tokens=10)
    assert doc["errors"] == [] and doc["requests"]["retries"] == 1


def test_cli_writes_json_and_exit_2_on_errors(server, tmp_path):
    set_plan(server.url, {"token_interval_s": 0.005})
    out = tmp_path / "b.json"
    cmd = [sys.executable, "-m", "fidelity", "bench", "--engine", server.url, "--model", "toy", "--sets", "code",
           "--streams", "2", "--prefill", "300", "--repeats", "1", "--max-tokens", "12", "--prompts-per-set", "1",
           "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert set(doc["metrics"]) == {"decode.code", "decode.all", "aggregate.2", "ttft_mean.2", "prefill.300"}
    assert abs(doc["prefill"]["300"]["prompt_tokens"] - 300) <= 3  # the toy tokenizer: one token a character
    assert doc["usage_check"]["prompt_mismatches"] == 0
    set_plan(server.url, {"stream_drop_after": 2})
    r = subprocess.run(cmd + ["--retries", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "error" in r.stdout


# ---- a real llama.cpp server
# ----------------------------------------------------------------------------------------------

LLAMA_FLAGS = ["--n_threads", "1", "--n_ctx", "2048", "--verbose", "false", "--interrupt_requests", "false"]
SMOL_EOS = [2, 0]  # <|im_end|>, <|endoftext|>: llama-cpp-python does not honour ignore_eos


@pytest.fixture(scope="module")
def llama(smollm2_gguf, tmp_path_factory):
    pytest.importorskip("llama_cpp")
    with llama_server(smollm2_gguf, tmp_path_factory.mktemp("llama"), LLAMA_FLAGS) as srv:
        yield srv


@pytest.mark.slow
def test_llama_decode_rate_matches_a_hand_timed_stream(llama):
    prompt = load_prompts()["sets"]["prose"][0]
    doc = bench(llama.url, "smol", sets=["prose", "code"], max_tokens=48, repeats=2, suppress_ids=SMOL_EOS)
    hand, chunks = hand_timed_stream(llama.url, "smol", prompt, 48, {"logit_bias": {"2": -100, "0": -100}})
    rate = doc["metrics"]["decode.all"]["median"]
    print("bench", doc["metrics"]["decode.all"], "hand", hand, chunks)
    assert chunks == 48 and doc["eos"]["stopped_early"] == 0
    assert abs(rate / hand - 1) < 0.2
    assert doc["usage_check"]["retokenized_minus_chunks"] and all(
        abs(d) <= 1 for d in doc["usage_check"]["retokenized_minus_chunks"]
    )


@pytest.mark.slow
def test_llama_streams_overlap_and_cold_prefill_is_cold(llama):
    doc = bench(llama.url, "smol", sets=[], streams=[2], prefill=[400], max_tokens=24, repeats=2, suppress_ids=SMOL_EOS)
    print(json.dumps({k: doc[k] for k in ("metrics", "prefill", "streams", "errors")}, indent=1))
    assert doc["errors"] == []
    lv = doc["streams"]["2"]
    assert lv["overlap"] == [True, True] and lv["max_in_flight"] == [2, 2]
    pf = doc["prefill"]["400"]
    assert abs(pf["prompt_tokens"] - 400) <= 4
    cold = doc["metrics"]["prefill.400"]["values"]  # first, second cold of repeat 0, then of repeat 1
    for first, second in zip(cold[::2], cold[1::2]):
        # a prefix-cache hit would make the second as fast as the warm repeat (> 3x, asserted below; ~150x measured);
        # timing noise on a busy 2-core CI machine reached +81 % between two honest cold prefills (one slow first)
        assert second / first < 3 and second < pf["warm_tok_s"] / 3
    # the library's own verdict: the median second-cold gain within max(spread, CACHE_HIT_GAIN_PCT)
    assert pf["second_cold_gain_pct"] <= max(doc["metrics"]["prefill.400"]["spread_pct"], CACHE_HIT_GAIN_PCT)
    # llama-cpp-python keeps the last prompt's KV and reuses its longest common prefix: the same prompt again is much
    # faster, so the cold numbers above are cold because of the nonce
    assert pf["warm_over_cold"] > 3 and pf["cache_defeated"]


# ---- the [speed] gate
# ---------------------------------------------------------------------------------------------------

def test_speed_gate_passes_the_same_pace_fails_a_slower_one_errors_on_drops(server, tmp_path):
    import xml.etree.ElementTree as ET

    set_plan(server.url, {"token_interval_s": 0.01})
    base = bench(server.url, sets=["code"], streams=[2], max_tokens=20, repeats=2, aa=True)
    assert set(base["aa"]["spread_pct"]) == {"decode.code", "decode.all", "aggregate.2", "ttft_mean.2"}
    for k, spread in base["aa"]["spread_pct"].items():  # the two runs' difference, at least either run's own spread
        a, b = base["metrics"][k], base["aa"]["second"]["metrics"][k]
        assert spread == pytest.approx(max(100 * abs(b["median"] / a["median"] - 1), a["spread_pct"], b["spread_pct"]))
        assert a["spread_pct"] == pytest.approx(100 * (max(a["values"]) - min(a["values"])) / (2 * a["median"]))
    (tmp_path / "base.json").write_text(json.dumps(base))
    (tmp_path / "gate.toml").write_text('[speed]\nbaseline = "base.json"\ndrop_max_pct = 25\n')
    args = ["--engine", server.url, "--model", "toy", "--config", str(tmp_path / "gate.toml"), "--only", "speed"]

    r = gate_cli(*args, "--json", str(tmp_path / "same.json"))
    same = json.loads((tmp_path / "same.json").read_text())["gates"][0]
    assert r.returncode == 0, r.stdout + r.stderr
    assert {c["metric"] for c in same["checks"]} == {
        "decode.code change %",
        "decode.all change %",
        "aggregate.2 change %",
    }
    for c in same["checks"]:
        m = same["measured"]["metrics"][c["metric"].split()[0]]
        assert c["value"] == pytest.approx(100 * (m["new"] / m["baseline"] - 1))  # the change as the medians give it
        assert c["threshold"] == -max(25.0, m["spread_pct"])

    set_plan(server.url, {"token_interval_s": 0.03})  # a third of the pace
    r = gate_cli(*args, "--json", str(tmp_path / "slow.json"), "--junit", str(tmp_path / "slow.xml"))
    slow = json.loads((tmp_path / "slow.json").read_text())
    assert r.returncode == 1 and slow["status"] == "fail", r.stdout
    decode = slow["gates"][0]["measured"]["metrics"]["decode.all"]
    assert decode["change_pct"] < -40
    case = ET.parse(tmp_path / "slow.xml").getroot().find("testcase")
    assert case.get("name") == "speed" and case.find("failure") is not None
    assert "decode.all change %" in case.find("failure").get("message")

    set_plan(server.url, {"stream_drop_after": 3})
    r = gate_cli(*args, "--json", str(tmp_path / "err.json"))
    err = json.loads((tmp_path / "err.json").read_text())["gates"][0]
    assert r.returncode == 2 and err["status"] == "error" and "request(s) failed" in err["error"]


def test_speed_and_suite_sections_are_checked(tmp_path, server):
    (tmp_path / "a.toml").write_text('[speed]\ndrop_max = 5\n')
    r = gate_cli("--engine", server.url, "--model", "toy", "--config", str(tmp_path / "a.toml"), "--only", "speed")
    assert r.returncode == 2 and "[speed] needs 'baseline'" in r.stderr and "drop_max" in r.stderr
    (tmp_path / "b.toml").write_text('[suite.humaneval]\nbaseline = "x"\nthreshhold = 1\n')
    r = gate_cli("--engine", server.url, "--model", "toy", "--config", str(tmp_path / "b.toml"))
    assert r.returncode == 2 and "[suite.humaneval]" in r.stderr and "threshhold" in r.stderr
    r = gate_cli("--engine", server.url, "--model", "toy", "--only", "speed")
    assert r.returncode == 2 and "need their section" in r.stderr
    (tmp_path / "c.toml").write_text('[speed]\nbaseline = "missing.json"\n')
    r = gate_cli("--engine", server.url, "--model", "toy", "--config", str(tmp_path / "c.toml"), "--only", "speed",
                 "--json", str(tmp_path / "c.json"))
    g = json.loads((tmp_path / "c.json").read_text())["gates"][0]
    assert r.returncode == 2 and "missing.json" in g["error"] and "does not exist" in g["error"]
