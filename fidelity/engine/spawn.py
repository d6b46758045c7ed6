"""A server subprocess on a free loopback port: `free_port()`, `Spawned(cmd, port)` (waits until it answers over HTTP,
kills it on exit). The ladder starts its rungs' engines with it; tests and benchmarks start theirs."""
from __future__ import annotations


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Spawned:
    """A server subprocess on a loopback port, waited for until it answers and killed on exit (tests and benchmarks).
    It runs in a session of its own and exits with its whole process group: engines that fork workers (vLLM's
    EngineCore and Worker processes outlive a kill of its API server) leave nothing behind."""

    def __init__(self, cmd: list[str], port: int, *, ready_path: str = "/v1/models", timeout_s: float = 120.0, log: str | None = None):
        import subprocess
        import time

        import httpx

        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.log = open(log, "w") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before answering: {' '.join(cmd)}"
                                   + (f" (log {log})" if log else ""))
            try:
                httpx.get(self.url + ready_path, timeout=2)
                return  # any HTTP answer: the server is up (it may be one that injects errors)
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"server did not answer within {timeout_s:g} s: {' '.join(cmd)}")
            time.sleep(0.2)

    def close(self):
        import os
        import signal

        try:   # the group outlives its leader while any worker lives
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(timeout=30)
        if hasattr(self.log, "close"):
            self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
