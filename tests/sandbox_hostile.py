"""The hostile corpus of tests/test_sandbox_hostile.py: HumanEval-style answers that attack the host or the verdict,
each with the test its judge runs. Standard library only: the unprivileged run imports it from a copy under a system
Python.

Each attack returns the right answer only if it worked, so "it failed" shows twice: the item does not pass, and what it
tried to touch outside (a marker file, a listening socket, a process) shows nothing."""
import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

PROMPT = 'def answer():\n    """Return 42."""\n'
RETURNS_42 = "def check(candidate):\n    assert candidate() == 42\n"


def processes_for(cgroups) -> int:
    """The process cap the corpus runs under: with a cgroup, 16, so the fork-8-children-of-200MB attack forks all 8 and
    meets the whole-sandbox memory limit; without one the documented bound is processes x memory_mb, and 8 stop it at
    the process cap first (the 8 children, their parent and bwrap's init are 10)."""
    return 16 if cgroups is not None else 8


def returns(value) -> str:
    return f"def check(candidate):\n    assert candidate() == {value!r}\n"


def corpus(ctx: dict) -> dict[str, tuple[str, str]]:
    """name -> (answer code, test code). `ctx`: marker, host_tmp, secret_file/secret, repo_file/repo_sha256, unix_path,
    abstract_name, tcp_port, peer_secret, env_name/env_secret."""
    m, host_tmp = ctx["marker"], ctx["host_tmp"]
    return {
        "remount-root-then-write-host-tmp": (
            "import ctypes, os\n"
            "def answer():\n"
            "    libc = ctypes.CDLL(None, use_errno=True)\n"
            "    if libc.mount(None, b'/', None, 32 | 4096, None) != 0:  # MS_REMOUNT | MS_BIND, read-write\n"
            "        raise OSError(ctypes.get_errno(), 'remount refused')\n"
            f"    open(os.path.join({host_tmp!r}, {m!r}), 'w').write('escaped')\n"
            "    return 42\n",
            RETURNS_42,
        ),
        "write-host-tmp": (
            "import os\n"
            "def answer():\n"
            f"    for d in ({host_tmp!r}, '/var/tmp', '/dev/shm', os.path.expanduser('~')):\n"
            f"        open(os.path.join(d, {m!r}), 'w').write('escaped')\n"
            "    return 42\n",
            RETURNS_42,
        ),
        "read-caller-0600-file": (
            f"def answer():\n    return open({ctx['secret_file']!r}).read()\n",
            returns(ctx["secret"]),
        ),
        "read-repo-file": (
            "import hashlib\n"
            f"def answer():\n    return hashlib.sha256(open({ctx['repo_file']!r}, 'rb').read()).hexdigest()\n",
            returns(ctx["repo_sha256"]),
        ),
        "connect-host-unix-socket": (
            "import socket\n"
            "def answer():\n"
            f"    for address in ({ctx['unix_path']!r}, '\\0' + {ctx['abstract_name']!r}):\n"
            "        try:\n"
            "            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
            "            s.settimeout(2)\n"
            "            s.connect(address)\n"
            "            s.sendall(b'leak')\n"
            "            return 42\n"
            "        except OSError as e:\n"
            "            error = e\n"
            "    raise error\n",
            RETURNS_42,
        ),
        "connect-loopback-tcp": (
            "import socket\n"
            "def answer():\n"
            f"    socket.create_connection(('127.0.0.1', {ctx['tcp_port']}), timeout=2).sendall(b'leak')\n"
            "    return 42\n",
            RETURNS_42,
        ),
        "fork-bomb": ("import os\ndef answer():\n    while True:\n        os.fork()\n", RETURNS_42),
        "memory-bomb": ("def answer():\n    hog = bytearray(8 << 30)\n    return 42\n", RETURNS_42),
        "fork-8-children-of-200MB": (  # each child under the per-process limit, together over the sandbox's
            "import os, select, time\n"
            "def answer():\n"
            "    r, w = os.pipe()\n"
            "    kids = []\n"
            "    for i in range(8):\n"
            "        pid = os.fork()\n"
            "        if pid == 0:\n"
            "            hog = b'x' * (200 << 20)\n"
            "            os.write(w, b'1')\n"
            "            time.sleep(60)\n"
            "            os._exit(0)\n"
            "        kids.append(pid)\n"
            "    held, deadline = 0, time.time() + 3\n"
            "    while held < 8 and time.time() < deadline:\n"
            "        if select.select([r], [], [], 0.1)[0]:\n"
            "            held += len(os.read(r, 8))\n"
            "    alive = sum(os.waitpid(pid, os.WNOHANG)[0] == 0 for pid in kids)\n"
            "    return 42 if held == alive == 8 else (held, alive)\n",
            RETURNS_42,
        ),
        "300k-files-in-tmp": (
            "def answer():\n    for i in range(300_000):\n        open(f'/tmp/f{i}', 'w').close()\n    return 42\n",
            RETURNS_42,
        ),
        "infinite-loop": ("def answer():\n    while True:\n        pass\n", RETURNS_42),
        "setsid-sleeper": (
            "import os, time\n"
            "def answer():\n"
            "    if os.fork() == 0:\n"
            "        os.setsid()\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(3600)\n"
            "        os._exit(0)\n"
            "    time.sleep(3600)\n",
            RETURNS_42,
        ),
        "write-100-GB": (
            "def answer():\n"
            "    chunk = b'x' * (1 << 20)\n"
            "    with open('/tmp/big', 'wb') as f:\n"
            "        for _ in range(100 << 10):\n"
            "            f.write(chunk)\n"
            "    return 42\n",
            RETURNS_42,
        ),
        "read-concurrent-sandbox": (
            "import os, time\n"
            "def answer():\n"
            "    deadline = time.time() + 3\n"
            "    while time.time() < deadline:\n"
            "        for root in ['/tmp'] + [f'/proc/{p}/root/tmp' for p in os.listdir('/proc') if p.isdigit()]:\n"
            "            try:\n"
            "                for name in os.listdir(root):\n"
            "                    if name.startswith('peer-'):\n"
            "                        return open(os.path.join(root, name)).read()\n"
            "            except OSError:\n"
            "                pass\n"
            "        time.sleep(0.1)\n"
            "    raise FileNotFoundError('no other sandbox in sight')\n",
            returns(ctx["peer_secret"]),
        ),
        "steal-the-expected-answer": (  # the test holds the secret; the candidate searches everything it can read
            "import os\n"
            "def answer():\n"
            "    for top in ('/proc', '/tmp', '/sandbox', '/dev/shm'):\n"
            "        for root, dirs, files in os.walk(top):\n"
            "            if root.count('/') > 4:\n"
            "                dirs[:] = []\n"
            "            for name in files:\n"
            "                try:\n"
            "                    data = open(os.path.join(root, name), 'rb').read(1 << 20)\n"
            "                except OSError:\n"
            "                    continue\n"
            "                i = data.find(b'steal-')\n"
            "                if i >= 0:\n"
            "                    return data[i:i + 38].decode()\n"
            "    raise LookupError('the test is nowhere to be read')\n",
            returns("steal-" + ctx["peer_secret"]),
        ),
        "forge-nonce-from-argv-and-excepthook": (
            "import sys\n"
            "sys.excepthook = lambda *exc: print('\\n'.join(sys.argv))\n"
            "print('\\n'.join(sys.argv))\n"
            "def answer():\n    print('\\n'.join(sys.argv))\n    raise SystemExit(0)\n",
            RETURNS_42,
        ),
        "forge-os-exit-0": ("import os\ndef answer():\n    os._exit(0)\n", RETURNS_42),
        "forge-monkeypatched-assert": (
            "import builtins\n"
            "class Yes:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
            "builtins.AssertionError = type('Nope', (Exception,), {})\n"
            "def answer():\n    return Yes()\n",
            RETURNS_42,
        ),
        "forge-verdict-on-every-fd": (
            "import json, os\n"
            "def answer():\n"
            "    frame = json.dumps({'passed': True, 'status': 'pass', 'verdict': 'passed'}).encode()\n"
            "    for fd in range(3, 256):\n"
            "        try:\n"
            "            os.write(fd, len(frame).to_bytes(8, 'little') + frame)\n"
            "        except OSError:\n"
            "            pass\n"
            "    return 41\n",
            RETURNS_42,
        ),
        "env-secret": (
            f"import os\ndef answer():\n    return os.environ.get({ctx['env_name']!r})\n",
            returns(ctx["env_secret"]),
        ),
    }


def peers(ctx: dict) -> dict[str, tuple[str, str]]:
    """Benign items: a right answer (the sandbox still passes real solutions) and the concurrent sandbox whose files the
    reader looks for."""
    return {
        "benign": ("def answer():\n    return 42\n", RETURNS_42),
        "concurrent-peer": (
            "import time\n"
            f"open('/tmp/peer-secret', 'w').write({ctx['peer_secret']!r})\n"
            "def answer():\n    time.sleep(2.5)\n    return 42\n", RETURNS_42),
    }


def judge_all(sandbox, items: dict[str, tuple[str, str]], workers: int = 4) -> dict[str, dict]:
    """Each item through the HumanEval judge of `sandbox`, `workers` at a time; name -> passed, verdict, sandbox
    labels."""
    labels, lock = {}, threading.Lock()
    start = sandbox._start

    def tracking_start(job, fds):
        proc = start(job, fds)
        with lock:
            labels.setdefault(threading.current_thread().name, []).append(proc.label)
        return proc

    sandbox._start = tracking_start

    def one(item):
        name, (code, test) = item
        res = sandbox.judge("humaneval", {"prompt": PROMPT, "test": test, "entry_point": "answer"},
                            {"code": code, "entry_point": "answer"}, verdict_limit=1 << 20)
        passed = res.verdict is not None and res.verdict.get("passed") is True
        return name, {"passed": passed, "verdict": "passed" if passed else res.failure(),
                      "labels": labels.get(threading.current_thread().name, [])[-2:]}

    with ThreadPoolExecutor(workers) as pool:
        return dict(pool.map(one, items.items()))


if __name__ == "__main__":  # the unprivileged run: python sandbox_hostile.py CTX_JSON OUT_JSON
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from fidelity.suites.sandbox import Sandbox, SandboxLimits

    from fidelity.suites.sandbox import SandboxUnavailable

    ctx = json.loads(open(sys.argv[1]).read())
    os.environ[ctx["env_name"]] = ctx["env_secret"]
    box = Sandbox(SandboxLimits(**ctx["limits"]))
    box = box.with_limits(processes=processes_for(box.cgroups))
    try:
        Sandbox(SandboxLimits(**ctx["limits"]), containment="cgroup")
        cgroup_refusal = None
    except SandboxUnavailable as e:
        cgroup_refusal = str(e)
    results = judge_all(box, {**corpus(ctx), **peers(ctx)})
    with open(sys.argv[2], "w") as f:
        json.dump({"isolation": box.isolation, "uid": os.getuid(), "python": sys.executable, "results": results,
                   "cgroup_refusal": cgroup_refusal, "cgroup": box.cgroups is not None}, f)
