"""Runs untrusted generated code in a separate process that cannot reach the network, the host's files or its secrets.

Isolation modes, strongest first (`detect_isolation()` picks the first that works here and says which in the run manifest):
- "namespaced" (root): new network, mount and PID namespaces (`unshare`); every mount read-only except a fresh size-capped
  tmpfs work dir; the program runs as `nobody` with no capabilities; rlimits on CPU, address space, file size, processes and
  open files; the whole PID namespace is killed at the wall-clock limit.
- "userns" (unprivileged user with user namespaces): the same, as the calling user mapped to root inside a user namespace.
- "rlimits" (weaker, reported as such): no namespaces, so the network and the host's writable directories stay reachable; only
  the rlimits, a throwaway work dir, a scrubbed environment and the wall-clock limit apply (and `nobody` when root can run
  the interpreter as that user, else no process limit: root ignores RLIMIT_NPROC).
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

BOOT = Path(__file__).with_name("_sandbox_boot.py")
NOBODY = 65534
SETUP_FAILED = 97
UNSHARE = ["unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc"]


@dataclass
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    file_mb: int = 16  # largest file the program may write (stdout/stderr included)
    processes: int = 16  # RLIMIT_NPROC of the sandbox user
    open_files: int = 64
    workdir_mb: int = 64
    output_chars: int = 20_000  # how much of stdout/stderr is kept


@dataclass
class SandboxResult:
    ok: bool
    reason: str  # "" when ok, else why the program failed, in words
    exit_code: int | None
    signal: int | None
    timed_out: bool
    wall_s: float
    stdout: str
    stderr: str


@dataclass
class Isolation:
    mode: str  # "namespaced", "userns" or "rlimits"
    network: bool  # True: the network is blocked
    filesystem: bool  # True: only the work dir is writable
    process_limit: bool
    note: str = ""

    def describe(self) -> str:
        weak = [w for w, ok in (("network reachable", self.network), ("host files writable", self.filesystem),
                                ("no process limit", self.process_limit)) if not ok]
        return f"{self.mode}" + (f" (WEAKER: {', '.join(weak)})" if weak else "") + (f"; {self.note}" if self.note else "")


SAFE_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _others_can_run_interpreter() -> bool:
    path = Path(os.path.realpath(sys.base_prefix))
    return all(os.stat(p).st_mode & 0o001 for p in [path, *path.parents])


def _command(mode: str, config: dict) -> list[str]:
    boot = [sys.executable, "-I", "-B", str(BOOT), json.dumps(config)]
    if mode == "namespaced":
        return UNSHARE + boot
    if mode == "userns":
        return UNSHARE[:1] + ["--user", "--map-root-user"] + UNSHARE[1:] + boot
    return boot


@functools.lru_cache(maxsize=None)
def detect_isolation() -> Isolation:
    """Tries the strongest mode first with a probe program that must see no network and a read-only host."""
    probe = ("import socket, os\n"
             "try:\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\nexcept OSError as e:\n"
             "    assert e.errno in (101, 99), e  # unreachable: no interface up (111 refused would mean a network)\n"
             "open('ok', 'w').write('1')\n")
    candidates = ["namespaced"] if os.geteuid() == 0 else ["userns"]
    notes = []
    if shutil.which("unshare"):
        for mode in candidates:
            res = Sandbox(SandboxLimits(wall_s=20), isolation=Isolation(mode, True, True, True)).run(probe)
            if res.ok:
                return Isolation(mode, True, True, True)
            notes.append(f"{mode} unavailable: {res.reason}")
    else:
        notes.append("no unshare binary")
    process_limit = os.geteuid() != 0 or _others_can_run_interpreter()
    return Isolation("rlimits", False, False, process_limit, note="; ".join(notes))


class Sandbox:
    def __init__(self, limits: SandboxLimits | None = None, isolation: Isolation | None = None):
        self.limits = limits or SandboxLimits()
        self.isolation = isolation or detect_isolation()

    def run(self, program: str, files: dict[str, str | bytes] | None = None, args: list[str] | None = None,
            env: dict[str, str] | None = None) -> SandboxResult:
        """Runs `program` (Python source) as `main.py` in a fresh work dir holding `files`, with the scrubbed environment
        plus `env`; returns how it ended."""
        mode = self.isolation.mode
        drop_to_nobody = os.geteuid() == 0 and (mode == "namespaced" or (mode == "rlimits" and self.isolation.process_limit))
        with tempfile.TemporaryDirectory(prefix="fidelity-sandbox-") as host_dir:
            work = Path(host_dir) / "work"
            work.mkdir()
            (work / "main.py").write_text(program)
            for name, text in (files or {}).items():
                if "/" in name or name.startswith("."):
                    raise ValueError(f"sandbox file names are plain names, got {name!r}")
                (work / name).write_bytes(text if isinstance(text, bytes) else text.encode())
            if drop_to_nobody:
                os.chmod(host_dir, 0o755)
            config = {"workdir": str(work), "mode": mode, "program": "main.py", "args": args or [],
                      "uid": NOBODY if drop_to_nobody else None, "workdir_mb": self.limits.workdir_mb,
                      "limits": asdict(self.limits), "env": {**SAFE_ENV, **(env or {}), "HOME": str(work), "TMPDIR": str(work)}}
            out_path, err_path = Path(host_dir) / "stdout", Path(host_dir) / "stderr"
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                t0 = time.monotonic()
                proc = subprocess.Popen(_command(mode, config), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                        env=dict(SAFE_ENV), start_new_session=True, cwd=host_dir)
                timed_out = False
                try:
                    proc.wait(timeout=self.limits.wall_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    _kill_group(proc)
                wall = time.monotonic() - t0
                _kill_group(proc)  # stragglers that left the process group die with the PID namespace; these do not
            stdout = _read_head(out_path, self.limits.output_chars)
            stderr = _read_head(err_path, self.limits.output_chars)
        code = proc.returncode
        sig = -code if code is not None and code < 0 else (code - 128 if code is not None and 128 < code < 160 else None)
        ok = code == 0 and not timed_out
        return SandboxResult(ok=ok, reason="" if ok else _reason(code, sig, timed_out, stderr, self.limits),
                             exit_code=code, signal=sig, timed_out=timed_out, wall_s=wall, stdout=stdout, stderr=stderr)


def _kill_group(proc: subprocess.Popen):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _read_head(path: Path, limit: int) -> str:
    """The output if short, else its first and last halves of `limit` (the end holds the harness's result lines)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size <= limit:
            return f.read().decode("utf-8", errors="replace")
        head = f.read(limit // 2)
        f.seek(size - limit // 2)
        tail = f.read()
    return (head.decode("utf-8", errors="replace") + f"\n[... {size - limit} bytes cut ...]\n"
            + tail.decode("utf-8", errors="replace"))


def _last_error_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def _reason(code: int | None, sig: int | None, timed_out: bool, stderr: str, lim: SandboxLimits) -> str:
    last = _last_error_line(stderr)
    if timed_out:
        return f"wall-clock limit ({lim.wall_s:g} s) reached"
    if code == SETUP_FAILED and last.startswith("sandbox setup failed"):
        return last
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and "MemoryError" not in stderr):
        return f"CPU time limit ({lim.cpu_s} s) reached" if sig == signal.SIGXCPU else "killed (SIGKILL)"
    if sig == signal.SIGXFSZ or "[Errno 27] File too large" in stderr:
        return f"file size limit ({lim.file_mb} MB) reached"
    if "MemoryError" in stderr:
        return f"memory limit ({lim.memory_mb} MB) reached: {last}"
    if "BlockingIOError" in stderr and "Resource temporarily unavailable" in stderr:
        return f"process limit ({lim.processes}) reached: {last}"
    if sig is not None:
        return f"killed by signal {signal.Signals(sig).name}: {last}" if sig in signal.valid_signals() else f"signal {sig}: {last}"
    return f"exit code {code}: {last}" if last else f"exit code {code}"
