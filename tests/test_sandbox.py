"""The sandbox against a corpus of hostile generated programs, run as a real (stubbed-engine) humaneval run: none escapes, each
is a failure with its reason, and the run goes on to score the benign items after them."""
import asyncio
import json
import os
import socket
import subprocess
import time
from types import SimpleNamespace

import pytest

from fidelity.suites.humaneval import make_code_suite
from fidelity.suites.records import read_records
from fidelity.suites.runner import Settings, run_suite
from fidelity.suites.sandbox import Sandbox, SandboxLimits, detect_isolation

PROMPT = 'def answer():\n    """Return 42."""\n'
TEST = "def check(candidate):\n    assert candidate() == 42\n"


def hostile_corpus(marker: str, port: int, secret_name: str) -> dict[str, str]:
    body = {
        "fork-bomb": "import os\ndef answer():\n    while True:\n        os.fork()\n    return 42\n",
        "memory-bomb": "def answer():\n    hog = bytearray(8 << 30)\n    return 42\n",
        "write-outside": (f"import os\ndef answer():\n    errors = []\n"
                          f"    for p in ('/tmp/{marker}', '../{marker}', os.path.expanduser('~/../{marker}')):\n"
                          f"        try:\n            open(p, 'w').write('escaped')\n        except OSError as e:\n"
                          f"            errors.append(e)\n    if errors:\n        raise errors[0]\n    return 42\n"),
        "socket": (f"import socket\ndef answer():\n    socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')\n"
                   f"    return 42\n"),
        "infinite-loop": "def answer():\n    while True:\n        pass\n",
        "env-secret": (f"import os\ndef answer():\n    print(dict(os.environ))\n    for p in ('/proc/1/environ', '/proc/self/environ'):\n"
                       f"        try:\n            print(open(p).read())\n        except OSError as e:\n            print(p, e)\n"
                       f"    return os.environ[{secret_name!r}]\n"),
        "forged-exit": "import os\ndef answer():\n    os._exit(0)\n",
        "benign": "def answer():\n    return 42\n",
    }
    return {k: f"Here you go:\n```python\n{v}```\n" for k, v in body.items()}


class StubClient:
    """Answers each chat request with the canned response for its task (the prompt holds the task's docstring)."""

    def __init__(self, responses: dict[str, str]):
        self.responses = responses

    async def chat(self, messages, tag="", **kw):
        task = tag.split(":", 1)[1]
        return SimpleNamespace(content=self.responses[task.split("/")[1]], tool_calls=[])


def nobody_processes() -> list[str]:
    out = subprocess.run(["ps", "-u", "65534", "-o", "pid=,stat=,args="], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if ln.strip()]


@pytest.mark.slow
def test_hostile_corpus_is_contained_and_the_run_continues(tmp_path, rng_seed, monkeypatch):
    iso = detect_isolation()
    marker = f"fidelity-escape-{rng_seed}"
    secret_name, secret = "FIDELITY_TEST_SECRET", f"s3cr3t-{rng_seed}"
    monkeypatch.setenv(secret_name, secret)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    corpus = hostile_corpus(marker, port, secret_name)
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps({"task_id": f"hostile/{k}", "prompt": PROMPT, "entry_point": "answer", "test": TEST}) + "\n"
                            for k in corpus))
    suite = make_code_suite("humaneval", data=str(data), limits=SandboxLimits(wall_s=4, cpu_s=3, memory_mb=512, processes=16))
    t0 = time.monotonic()
    summary = asyncio.run(run_suite(suite, tmp_path / "run", engine="stub", model="stub", settings=Settings(),
                                    client=StubClient(corpus), concurrency=2))
    elapsed = time.monotonic() - t0
    df = read_records(tmp_path / "run").set_index("item_id")
    print(df[["passed", "verdict"]].to_string(), f"\nisolation: {iso.describe()}, {elapsed:.1f} s")

    assert summary.items == len(corpus) and summary.errors == 0
    assert bool(df.loc["hostile/benign", "passed"]) is True  # the run went on and the sandbox still passes real solutions
    hostile = df.drop(index="hostile/benign")
    assert not hostile["passed"].any()
    verdict = hostile["verdict"].to_dict()
    assert "process limit" in verdict["hostile/fork-bomb"] or "wall-clock" in verdict["hostile/fork-bomb"]
    assert "memory limit" in verdict["hostile/memory-bomb"]
    assert "wall-clock" in verdict["hostile/infinite-loop"] or "CPU time" in verdict["hostile/infinite-loop"]
    assert "KeyError" in verdict["hostile/env-secret"]
    assert verdict["hostile/forged-exit"] == "exited before the tests finished"
    if iso.mode != "rlimits":
        assert "Read-only file system" in verdict["hostile/write-outside"]
        assert "Network is unreachable" in verdict["hostile/socket"]
    # nothing escaped: no file outside, no connection, no secret, no process left behind
    assert not (tmp_path / marker).exists() and not os.path.exists(f"/tmp/{marker}")
    if iso.network:
        with pytest.raises(BlockingIOError):
            listener.accept()
    listener.close()
    assert secret not in df.to_json()
    deadline = time.monotonic() + 10
    while nobody_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert nobody_processes() == []


def test_sandbox_reports_isolation_and_limits():
    iso = detect_isolation()
    assert iso.mode in ("namespaced", "userns", "rlimits")
    if os.geteuid() == 0 and iso.mode == "namespaced":
        assert iso.describe() == "namespaced"
    box = Sandbox(SandboxLimits(wall_s=5, file_mb=1))
    big = box.run("open('big', 'wb').write(b'x' * (4 << 20))")
    assert not big.ok and "file size limit (1 MB)" in big.reason
    ok = box.run("import sys; print(open('data.txt').read() + sys.argv[1])", files={"data.txt": "abc"}, args=["def"])
    assert ok.ok and ok.stdout.strip() == "abcdef" and ok.reason == ""
    chatty = box.run("print('x' * 100_000); print('last line')")
    assert chatty.ok and chatty.stdout.rstrip().endswith("last line") and "bytes cut" in chatty.stdout
    assert len(chatty.stdout) < 25_000
    with pytest.raises(ValueError, match="plain names.*'../x'"):
        box.run("pass", files={"../x": "y"})


def test_rlimits_mode_is_reported_weaker():
    from fidelity.suites.sandbox import Isolation

    weak = Isolation("rlimits", network=False, filesystem=False, process_limit=False)
    assert weak.describe() == "rlimits (WEAKER: network reachable, host files writable, no process limit)"
    res = Sandbox(SandboxLimits(wall_s=5), weak).run("print(6 * 7)")
    assert res.ok and res.stdout.strip() == "42"


def test_user_namespace_mode_blocks_network_and_host_writes(tmp_path):
    """The mode an unprivileged user gets (here forced): same namespaces, no uid change."""
    from fidelity.suites.sandbox import Isolation

    box = Sandbox(SandboxLimits(wall_s=10), Isolation("userns", True, True, True))
    probe = box.run("import os; print(os.getuid())")
    if not probe.ok:
        pytest.skip(f"user namespaces unavailable here: {probe.reason}")
    target = tmp_path / "escape"
    write = box.run(f"open({str(target)!r}, 'w').write('x')")
    assert not write.ok and "Read-only file system" in write.reason and not target.exists()
    net = box.run("import socket; socket.create_connection(('127.0.0.1', 22), timeout=2)")
    assert not net.ok and "Network is unreachable" in net.reason
    local = box.run("open('f', 'w').write('ok'); print(open('f').read())")
    assert local.ok and local.stdout.strip() == "ok"
