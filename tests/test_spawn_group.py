"""Spawned stops the whole process group of the server it started: a worker the server forked (as vLLM's EngineCore
and Worker processes are) does not outlive it."""
from __future__ import annotations

import os
import sys
import textwrap
import time

from fidelity.engine.spawn import Spawned, free_port


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:          # a zombie is gone for our purpose
        return f.read().split(")")[1].split()[0] != "Z"


def test_a_forked_worker_does_not_outlive_the_server(tmp_path):
    worker_pid = tmp_path / "worker.pid"
    server = tmp_path / "server.py"
    server.write_text(textwrap.dedent(f"""
        import http.server, subprocess, sys
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(worker_pid)!r}, "w").write(str(worker.pid))
        http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), http.server.SimpleHTTPRequestHandler).serve_forever()
    """))
    port = free_port()
    with Spawned([sys.executable, str(server), str(port)], port, ready_path="/", timeout_s=60):
        pid = int(worker_pid.read_text())
        assert alive(pid)
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid), "the server's worker outlived Spawned.close()"
