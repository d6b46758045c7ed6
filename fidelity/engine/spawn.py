"""A server subprocess on a free loopback port: `free_port()`, `Spawned(cmd, port)` (waits until it answers over HTTP,
stops its whole process group on exit), `group_members(pgid)`. The ladder starts its rungs' engines with it, vLLM's
`VllmServe.spawn` its servers; tests and benchmarks start theirs."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Spawned:
    """A server subprocess on a loopback port, waited for until it answers and stopped on exit.
    It runs in a session of its own and exits with its whole process group: engines that fork workers (vLLM's
    EngineCore and Worker processes outlive a kill of its API server) leave nothing behind. `grace_s` > 0: `close()`
    sends the group SIGTERM (the server's own shutdown) and gives it that long, twice (the leader, then its workers),
    before SIGKILL; 0 kills at once. `ready_status`: the status /ready_path must answer with; None takes any HTTP answer
    (a server that injects errors is up when it answers at all)."""

    def __init__(self, cmd: list[str], port: int, *, ready_path: str = "/v1/models", ready_status: int | None = None,
                 timeout_s: float = 120.0, log: str | None = None, grace_s: float = 0.0):
        self.cmd, self.port, self.url, self.log_path, self.grace_s = cmd, port, f"http://127.0.0.1:{port}", log, grace_s
        self.started = time.monotonic()
        self._log = open(log, "w") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        try:
            self._wait_ready(ready_path, ready_status, timeout_s)
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.monotonic() - self.started

    def _wait_ready(self, path: str, status: int | None, timeout_s: float):
        deadline = self.started + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before answering: {' '.join(self.cmd)}"
                                   + (f" (log {self.log_path}: {self.log_tail()})" if self.log_path else ""))
            try:
                if status in (None, httpx.get(self.url + path, timeout=2).status_code):
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not answer within {timeout_s:g} s: {' '.join(self.cmd)}"
                                   + (f" (log {self.log_path})" if self.log_path else ""))
            time.sleep(0.2)

    def log_tail(self, chars: int = 2000) -> str:
        return Path(self.log_path).read_text(errors="replace")[-chars:] if self.log_path else ""

    def close(self):
        pgid = self.proc.pid
        if self.grace_s > 0 and self.proc.poll() is None:
            _signal_group(pgid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                pass
            deadline = time.monotonic() + self.grace_s
            while group_members(pgid) and time.monotonic() < deadline:
                time.sleep(0.2)
        _signal_group(pgid, signal.SIGKILL)  # the group outlives its leader while any worker lives
        self.proc.wait(timeout=30)
        if hasattr(self._log, "close"):
            self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _signal_group(pgid: int, sig: int):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`, from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d.name))
    return out
