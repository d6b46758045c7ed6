"""Spawned stops the whole process group of the server it started: a worker the server forked (as vLLM's EngineCore
and Worker processes are) does not outlive it."""
from __future__ import annotations

import os
import sys
import textwrap
import time

import httpx

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


def test_a_grace_lets_the_server_shut_down_and_still_kills_a_worker_that_ignores_sigterm(tmp_path):
    """grace_s > 0 (vLLM's servers): the group gets SIGTERM first, so the server runs its own shutdown; a worker that
    ignores SIGTERM is SIGKILLed once the grace is over. grace_s = 0: SIGKILL at once, no shutdown runs."""
    for grace in (1.0, 0.0):
        shut, worker_pid = tmp_path / f"shutdown-{grace}", tmp_path / f"worker-{grace}.pid"
        server = tmp_path / "graceful.py"
        server.write_text(
            textwrap.dedent(f"""
            import http.server, signal, subprocess, sys
            worker = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                       "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
            open({str(worker_pid)!r}, "w").write(str(worker.pid))
            def shutdown(*_):
                open({str(shut)!r}, "w").write("clean")
                sys.exit(0)
            signal.signal(signal.SIGTERM, shutdown)
            handler = http.server.SimpleHTTPRequestHandler
            http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), handler).serve_forever()
        """)
        )
        port = free_port()
        started = time.monotonic()
        with Spawned([sys.executable, str(server), str(port)], port, ready_path="/", timeout_s=60, grace_s=grace):
            pid = int(worker_pid.read_text())
        took = time.monotonic() - started
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid), f"grace {grace}: the SIGTERM-ignoring worker outlived close()"
        assert shut.exists() == (grace > 0), f"grace {grace}: the server's own shutdown ran: {shut.exists()}"
        if grace:
            assert took >= grace, f"the worker got no grace: closed after {took:.2f} s"


def test_ready_status_waits_for_that_status(tmp_path):
    """ready_status=200 (vLLM): a server answering 503 while it loads is not up yet; None (the fault server, which
    may inject errors): any answer is."""
    server = tmp_path / "loading.py"
    server.write_text(textwrap.dedent("""
        import http.server, sys
        asked = [0]
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                asked[0] += 1
                self.send_response(200 if asked[0] > 3 else 503)
                self.end_headers()
                self.wfile.write(str(asked[0]).encode())
            def log_message(self, *a):
                pass
        http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """))
    for status, first_ok in ((200, 4), (None, 1)):
        port = free_port()
        with Spawned([sys.executable, str(server), str(port)], port, ready_status=status, timeout_s=60) as srv:
            r = httpx.get(srv.url + "/v1/models", timeout=5)
            assert int(r.text) == first_ok + 1, (status, r.text)
