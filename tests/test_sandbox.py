"""The sandbox from inside (identity, capabilities, seccomp, what the root holds, the limits), its refusal to run
without bubblewrap (exit 2 from the CLI, SandboxUnavailable from Python), the --unsafe-no-sandbox record, and the codec
that carries return values to the judge."""
import asyncio
import json
import math
import os
import platform
import random
import re
import socket
import subprocess
import sys
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from fidelity.suites import sandbox as sb
from fidelity.suites._sandbox_boot import decode, encode
from fidelity.suites.paired import compare_runs
from fidelity.suites.humaneval import make_code_suite
from fidelity.suites.records import read_manifest
from fidelity.suites.runner import Settings, run_suite

REPO = Path(__file__).resolve().parent.parent
# what bwrap says when the kernel (not our setup) refuses it: no user namespaces, no uid map; only then do tests skip
KERNEL_FORBIDS = re.compile(
    r"bwrap: .*(No permissions to create|namespace|uid map|setting up uid|Operation not permitted)"
)


@pytest.fixture
def working_sandbox() -> str:
    try:
        return sb.require_sandbox()
    except sb.SandboxUnavailable as e:
        if KERNEL_FORBIDS.search(str(e)):
            pytest.skip(f"this kernel forbids what bubblewrap needs (user namespaces): {e}")
        raise


def test_identity_capabilities_seccomp_and_root_from_inside(working_sandbox):
    if platform.machine() != "x86_64":
        pytest.skip("the raw syscall numbers below are x86-64's")
    probe = r"""
import ctypes, errno, json, os, socket
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    r = libc.syscall(nr, *[ctypes.c_long(a) for a in args])
    return 0 if r == 0 else -ctypes.get_errno()
status = dict(l.split(':', 1) for l in open('/proc/self/status') if ':' in l)
out = {"ids": [os.getuid(), os.geteuid(), os.getgid(), os.getgroups()],
       "caps": [int(status[k], 16) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")],
       "seccomp": status["Seccomp"].strip(), "nnp": status["NoNewPrivs"].strip(),
       "unshare_user": call(272, 0x10000000), "unshare_net": call(272, 0x40000000),
       "ptrace_traceme": call(101, 0, 0, 0, 0), "kexec_load": call(246, 0, 0, 0, 0), "setns": call(308, 0, 0),
       "bpf": call(321, 0, 0, 0), "init_module": call(175, 0, 0, 0),
       "mount_remount": libc.mount(None, b"/", None, ctypes.c_ulong(32 | 4096), None) and -ctypes.get_errno(),
       "clone_newns": call(56, 0x00020000 | 17, 0, 0, 0, 0), "root": sorted(os.listdir("/")),
       "interfaces": [l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]],
       "pids": sorted(int(p) for p in os.listdir('/proc') if p.isdigit())}
for fam in ("AF_INET", "AF_INET6", "AF_NETLINK", "AF_PACKET"):
    try:
        socket.socket(getattr(socket, fam), socket.SOCK_RAW if fam == "AF_PACKET" else socket.SOCK_DGRAM).close()
        out[fam] = 0
    except OSError as e:
        out[fam] = -e.errno
a, b = socket.socketpair()
a.sendall(b"x"); out["socketpair"] = b.recv(1).decode()
open('/tmp/w', 'w').write('ok'); out["tmp"] = open('/tmp/w').read()
for path in ('/', '/usr/lib', os.path.dirname(os.__file__)):
    try:
        open(os.path.join(path, 'w'), 'w'); out["writable:" + path] = True
    except OSError as e:
        out["writable:" + path] = e.errno
out["seen"] = {p: os.path.exists(p) for p in HOST_PATHS}
print(json.dumps(out))
"""
    host_paths = [
        str(REPO),
        str(REPO / "README.md"),
        "/etc/passwd",
        "/etc/shadow",
        "/home",
        "/root/.bashrc",
        "/var",
        "/run",
        "/usr/bin/sh",
        "/bin/sh",
        "/etc",
        sys.prefix + "/lib/python3.11/site-packages/torch",
    ]
    res = sb.Sandbox(sb.SandboxLimits(wall_s=20)).run(f"HOST_PATHS = {host_paths!r}\n" + probe)
    assert res.ok, res.stderr
    out = json.loads(res.stdout)
    assert out["ids"] == [65534, 65534, 65534, []] and out["caps"] == [0, 0, 0, 0, 0]
    assert out["seccomp"] == "2" and out["nnp"] == "1"
    for call in (
        "unshare_user",
        "unshare_net",
        "ptrace_traceme",
        "kexec_load",
        "setns",
        "bpf",
        "init_module",
        "mount_remount",
        "clone_newns",
    ):
        assert out[call] == -1, (call, out[call])  # EPERM from the filter
    for fam in ("AF_INET", "AF_INET6", "AF_NETLINK", "AF_PACKET"):
        assert out[fam] == -97, (fam, out[fam])  # EAFNOSUPPORT
    assert out["socketpair"] == "x" and out["tmp"] == "ok"
    assert all(v == 30 for k, v in out.items() if k.startswith("writable:")), out  # EROFS everywhere but /tmp
    interpreter_tops = {Path(p).parts[1] for p in sb._interpreter_binds()[0]}  # e.g. "root" for a pyenv under /root
    assert (
        set(out["root"])
        <= {"dev", "lib", "lib32", "lib64", "libx32", "proc", "sandbox", "tmp", "usr"} | interpreter_tops
    )
    assert out["interfaces"] == ["lo"]  # its own network namespace: a loopback of its own, nothing of the host's
    assert out["pids"] == [1, 2]  # bwrap's init and the program: no host process in sight
    assert not any(out["seen"].values()), out["seen"]


def test_limits_files_arguments_and_output(working_sandbox):
    box = sb.Sandbox(sb.SandboxLimits(wall_s=10, file_mb=1))
    assert box.isolation.startswith("bubblewrap") and "seccomp" in box.isolation
    big = box.run("open('big', 'wb').write(b'x' * (4 << 20))")
    assert not big.ok and "file size limit (1 MB)" in big.reason
    ok = box.run("import sys; print(open('data.txt').read() + sys.argv[1])", files={"data.txt": "abc"}, args=["def"])
    assert ok.ok and ok.stdout.strip() == "abcdef" and ok.reason == ""
    chatty = box.run("print('x' * 100_000); print('last line')")
    assert chatty.ok and chatty.stdout.rstrip().endswith("last line") and "bytes cut" in chatty.stdout
    assert len(chatty.stdout) < 25_000
    with pytest.raises(ValueError, match="plain names.*'../x'"):
        box.run("pass", files={"../x": "y"})
    full = sb.Sandbox(sb.SandboxLimits(wall_s=10, tmp_mb=2, file_mb=8)).run(
        "open('/tmp/a', 'wb').write(b'x' * (4 << 20))"
    )
    assert not full.ok and "No space left on device" in full.stderr


def listening_socket():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(4)
    s.setblocking(False)
    return s


def cli(out_dir, port, env_extra, suite="humaneval", extra=()):
    env = {**os.environ, "PYTHONPATH": str(REPO), **env_extra}
    return subprocess.run([sys.executable, "-m", "fidelity", "suite", "run", suite, "--engine", f"http://127.0.0.1:{port}",
                           "--model", "m", "-o", str(out_dir), "--limit", "2", *extra], capture_output=True, text=True,
                          timeout=120, env=env)


def test_without_bubblewrap_the_run_refuses_before_anything_runs(tmp_path):
    engine = listening_socket()
    try:
        missing = cli(tmp_path / "run", engine.getsockname()[1], {"FIDELITY_BWRAP": str(tmp_path / "no-bwrap")})
        assert missing.returncode == 2, missing.stderr
        assert "no usable bubblewrap" in missing.stderr and "--unsafe-no-sandbox" in missing.stderr
        assert "pip install 'fidelity[suites]'" in missing.stderr
        # a bwrap that exists but cannot build namespaces (what a kernel without user namespaces answers)
        fake = tmp_path / "bwrap"
        fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo 'bubblewrap 0.11.0'; exit 0; }\n"
                        "echo 'bwrap: No permissions to create a new namespace' >&2\nexit 1\n")
        fake.chmod(0o755)
        denied = cli(tmp_path / "run2", engine.getsockname()[1], {"FIDELITY_BWRAP": str(fake)})
        assert denied.returncode == 2 and "No permissions to create a new namespace" in denied.stderr, denied.stderr
        assert "user.max_user_namespaces" in denied.stderr
        with pytest.raises(BlockingIOError):
            engine.accept()  # no request went to the engine
        assert (
            not (tmp_path / "run" / "records.parquet").exists() and not (tmp_path / "run2" / "records.parquet").exists()
        )
        wrong_suite = cli(tmp_path / "run3", engine.getsockname()[1], {}, suite="ifeval", extra=["--unsafe-no-sandbox"])
        assert wrong_suite.returncode == 2 and "runs no generated code" in wrong_suite.stderr
    finally:
        engine.close()


def test_python_api_raises_without_bubblewrap(monkeypatch, tmp_path):
    none = str(tmp_path / "none")
    for f in (sb.find_bwrap, sb.require_sandbox):
        f.cache_clear()
    try:
        with pytest.raises(sb.SandboxUnavailable, match="no usable bubblewrap.*--unsafe-no-sandbox"):
            make_code_suite("humaneval", bwrap=none)
        with pytest.raises(sb.SandboxUnavailable):
            sb.Sandbox(bwrap=none)
    finally:
        for f in (sb.find_bwrap, sb.require_sandbox):
            f.cache_clear()


class StubClient:
    async def chat(self, messages, tag="", **kw):
        return SimpleNamespace(content="```python\ndef answer():\n    return 42\n```", tool_calls=[])


def test_unsafe_no_sandbox_is_explicit_and_recorded(tmp_path, working_sandbox):
    data = tmp_path / "tasks.jsonl"
    data.write_text(json.dumps({"task_id": "t/0", "prompt": 'def answer():\n    """42."""\n', "entry_point": "answer",
                                "test": "def check(candidate):\n    assert candidate() == 42\n"}) + "\n")
    runs = {}
    for name, unsafe in (("safe", False), ("unsafe", True)):
        suite = make_code_suite("humaneval", data=str(data), unsafe_no_sandbox=unsafe)
        summary = asyncio.run(run_suite(suite, tmp_path / name, engine="stub", model="stub", settings=Settings(),
                                        client=StubClient()))
        assert summary.passed == 1
        runs[name] = read_manifest(tmp_path / name)
    assert runs["safe"]["unsafe_no_sandbox"] is False and runs["safe"]["sandbox"].startswith("bubblewrap")
    assert runs["unsafe"]["unsafe_no_sandbox"] is True and runs["unsafe"]["sandbox"].startswith("UNSAFE")
    rep = compare_runs(tmp_path / "safe", tmp_path / "unsafe")
    assert "run B ran generated code without the sandbox" in rep["warning"]
    from fidelity.report.tables import suite_table

    assert (
        "run B ran generated code without the sandbox" in suite_table([("suite.json", rep)]).note
    )  # the report shows it


def random_value(rng: random.Random, depth=0):
    kinds = ["int", "big-int", "fraction", "decimal", "float", "str", "bool", "none", "bytes", "complex"] + (
        ["list", "tuple", "set", "dict", "frozenset"] if depth < 4 else [])
    k = rng.choice(kinds)
    if k == "int":
        return rng.randint(-10**30, 10**30)
    if k == "big-int":  # past Python's 4300-digit int/str limit, and around the codec's hex threshold
        return rng.choice([-1, 1]) * rng.choice(
            [rng.getrandbits(rng.randint(13_000, 70_000)), (1 << 2000) - rng.randint(0, 1)]
        )
    if k == "fraction":
        return Fraction(rng.randint(-10**rng.randint(1, 5000), 10**5), rng.randint(1, 10**rng.randint(1, 5000)))
    if k == "decimal":
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 6000)))
        return rng.choice(
            [Decimal(f"{rng.choice('+-')}{digits}E{rng.randint(-(10**6), 10**6)}"), Decimal("-0"), Decimal("-Infinity")]
        )
    if k == "float":
        return rng.choice([rng.uniform(-1e9, 1e9), math.inf, -math.inf, -0.0])
    if k == "str":
        return "".join(chr(rng.randint(1, 0x2FFF)) for _ in range(rng.randint(0, 8)))
    if k == "bool":
        return rng.random() < 0.5
    if k == "none":
        return None
    if k == "bytes":
        return rng.randbytes(rng.randint(0, 6))
    if k == "complex":
        return complex(rng.uniform(-5, 5), rng.uniform(-5, 5))
    items = [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    hashable = []
    for x in items:
        try:
            hash(x)
            hashable.append(x)
        except TypeError:
            pass
    if k == "list":
        return items
    if k == "tuple":
        return tuple(items)
    if k == "set":
        return set(hashable)
    if k == "frozenset":
        return frozenset(hashable)
    return {h: v for h, v in zip(hashable, items)}


def test_codec_round_trips_plain_values_and_refuses_objects(rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(300):
        v = random_value(rng)
        back = decode(json.loads(json.dumps(encode(v))))
        assert back == v and type(back) is type(v)
    decimals = [random_value(rng) for _ in range(200)]
    decimals = [d for d in decimals if type(d) is Decimal] + [Decimal("-0"), Decimal("1.000"), Decimal("sNaN123")]
    back = decode(json.loads(json.dumps(encode(decimals))))
    assert [d.as_tuple() for d in back] == [
        d.as_tuple() for d in decimals
    ]  # every digit, the exponent, -0, NaN payloads
    nan = decode(json.loads(json.dumps(encode([math.nan]))))
    assert math.isnan(nan[0])
    arr = np.arange(6, dtype=np.int32).reshape(2, 3)
    back = decode(json.loads(json.dumps(encode(arr))))
    assert back.dtype == np.int32 and (back == arr).all() and type(decode(encode(np.float64(2.5)))) is np.float64

    class Liar:
        def __eq__(self, other):
            return True

    for bad in (Liar(), object(), iter([1]), np.array(["a"], dtype=object)):
        with pytest.raises(TypeError):
            encode(bad)
    big = [[rng.randint(-9, 9), [rng.random(), str(i)]] for i in range(20_000)]
    assert decode(json.loads(json.dumps(encode(big)))) == big and encode(big) == {"J": big}  # the plain-JSON path
    for forged in (
        {"x": 1},
        {"l": [1], "t": [2]},
        {"a": ["object", [1], [1]]},
        [1, 2],
        {"J": [{"l": [1]}]},
        {"T": [[1]]},
        {"q": [1, 0]},
        {"q": [1.5, 2]},
        {"q": [True, 2]},
        {"D": "1.2.3"},
        {"D": 5},
        {"i": "xyz"},
        {"i": 12},
    ):
        with pytest.raises(ValueError):
            decode(forged)


def test_evalplus_verdicts_cannot_be_forged_and_canonical_solutions_run_sandboxed(tmp_path, working_sandbox):
    from test_suite_scoring import evalplus_file

    data = evalplus_file(tmp_path, make_code_suite("humaneval"))
    suite = make_code_suite("humaneval+", data=str(data))
    p = suite.problems["HumanEval/2"]
    assert suite.check("HumanEval/2", p["prompt"] + p["canonical_solution"]).passed
    forged = {
        "os._exit(0)": "import os\ndef truncate_number(number):\n    os._exit(0)\n",
        "a float whose == agrees": (
            "class Yes(float):\n    def __eq__(self, other):\n        return True\n"
            "    __hash__ = float.__hash__\ndef truncate_number(number):\n    return Yes(-1.0)\n"
        ),
        "patched numpy and evalplus": (
            "import numpy as np, evalplus.eval as ev\nnp.allclose = lambda *a, **k: True\n"
            "ev._mapping = {k: 'pass' for k in (0, 1, 2, 3, None)}\n"
            "def truncate_number(number):\n    return -1.0\n"
        ),
        "printed a passing status": (
            "import json\nprint(json.dumps({'status': 'pass', 'passed_inputs': 2, 'inputs': 2}))\n"
            "def truncate_number(number):\n    return -1.0\n"
        ),
    }
    for what, code in forged.items():
        out = suite.check("HumanEval/2", code)
        assert not out.passed and out.details["base"]["status"] == "fail", (what, out.verdict)
    # a canonical solution from a user's --data file is code like any other: it runs in the sandbox, where the host is
    # not
    marker = tmp_path / "canonical-escaped"
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[1]["canonical_solution"] = f"    open({str(marker)!r}, 'w').write('x')\n    return number % 1.0\n"
    evil = tmp_path / "HumanEvalPlus-evil.jsonl"
    evil.write_text("".join(json.dumps(r) + "\n" for r in rows))
    evil_suite = make_code_suite("humaneval+", data=str(evil))
    with pytest.raises(RuntimeError, match="canonical solution failed in the sandbox.*No such file or directory"):
        evil_suite.check("HumanEval/2", p["prompt"] + p["canonical_solution"])
    assert not marker.exists()


def test_a_sandbox_that_fails_to_start_is_not_the_models_failure(tmp_path, monkeypatch, working_sandbox):
    data = tmp_path / "tasks.jsonl"
    data.write_text(json.dumps({"task_id": "t/0", "prompt": 'def answer():\n    """42."""\n', "entry_point": "answer",
                                "test": "def check(candidate):\n    assert candidate() == 42\n"}) + "\n")
    suite = make_code_suite("humaneval", data=str(data))
    # an answer that pretends the sandbox failed (bwrap's words on stderr, exit 1) is still the model's failure
    pretend = suite.check(
        "t/0",
        "import os, sys\nsys.stderr.write('bwrap: Creating new namespace failed\\n')\n"
        "sys.stderr.flush()\nos._exit(1)\n",
    )
    assert pretend.passed is False and ("ended before answering" in pretend.verdict or "is gone" in pretend.verdict)
    fake = tmp_path / "bwrap"
    fake.write_text(
        "#!/bin/sh\necho 'bwrap: Creating new namespace failed: Resource temporarily unavailable' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(sb, "find_bwrap", lambda path=None: (str(fake), "0.11.0"))
    with pytest.raises(sb.SandboxError, match="judge sandbox did not start.*Resource temporarily unavailable"):
        suite.check("t/0", "def answer():\n    return 42\n")
    summary = asyncio.run(run_suite(suite, tmp_path / "run", engine="stub", model="stub", settings=Settings(),
                                    client=StubClient()))
    assert summary.errors == 1 and summary.passed == 0  # a scorer error: excluded from comparisons, retried on resume
