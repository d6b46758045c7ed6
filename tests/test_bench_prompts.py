"""`fidelity bench --prompts FILE`: a user's own prompt sets measured beside (or instead of) the built-in ones, each
with its decode rate; the sets' content, not only their names, is part of what a speed baseline must match; a bad line
is refused naming the file and the line."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fidelity.engine.bench import BenchConfig, read_prompt_sets
from fidelity.errors import ConfigError
from testkit.faults import set_plan, spawn_fault_server


@pytest.fixture(scope="module")
def server():
    with spawn_fault_server() as srv:
        yield srv


def write(path, items):
    path.write_text("".join(json.dumps(i) + "\n" for i in items))
    return path


def test_custom_sets_are_measured_instead_of_the_built_in_ones(server, tmp_path):
    set_plan(server.url, {"token_interval_s": 0.003})
    prompts = write(tmp_path / "p.jsonl", [{"set": "math", "prompt": "What is 17 times 23?"},
                                           {"set": "json", "prompt": "Write a JSON object with two keys."},
                                           {"set": "math", "prompt": "Integrate x squared."}])
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, "-m", "fidelity", "bench", "--engine", server.url, "--model", "toy",
                        "--prompts", str(prompts), "--streams", "", "--prefill", "", "--repeats", "1",
                        "--max-tokens", "8", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert set(doc["metrics"]) == {"decode.math", "decode.json", "decode.all"}
    assert doc["requests"]["sent"] == 3 + 1          # three prompts, one warm-up
    assert all(doc["metrics"][k]["median"] > 0 for k in doc["metrics"])


def test_the_sets_content_is_part_of_the_baseline_and_bad_lines_are_named(tmp_path):
    a = read_prompt_sets(write(tmp_path / "a.jsonl", [{"set": "math", "prompt": "1 + 1?"}]))
    b = read_prompt_sets(write(tmp_path / "b.jsonl", [{"set": "math", "prompt": "2 + 2?"}]))
    sa = BenchConfig("http://x", "m", custom_sets=a).settings()
    sb = BenchConfig("http://x", "m", custom_sets=b).settings()
    assert sa["custom_sets"].keys() == {"math"} and sa != sb
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"set": "math", "prompt": "ok"}\n{"set": "math"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl line 2: expected"):
        read_prompt_sets(bad)
    bad.write_text('{"set": "code", "prompt": "a built-in name"}\n')
    with pytest.raises(ConfigError, match=r"line 1: set 'code' is a built-in set's name"):
        read_prompt_sets(bad)
    bad.write_text("not json\n")
    with pytest.raises(ConfigError, match=r"line 1: not JSON"):
        read_prompt_sets(bad)
