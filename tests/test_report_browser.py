"""Open the report in headless Chromium over the DevTools protocol (on a pipe, no extra packages): every figure decoded,
no console errors, no request but the page itself; a deliberately broken page proves the checks can fail."""
from __future__ import annotations

import base64
import io
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from fidelity.report import render
from test_report import make_compare_run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--mute-audio",
    "--disable-dev-shm-usage",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="missing tool: chromium is not installed (apt-get install chromium)"),
]


@dataclass
class PageCheck:
    images: list[dict]
    console_errors: list[str]
    requests: list[str]
    screenshot: bytes
    failed: list[str] = field(default_factory=list)


class DevTools:
    """Chromium with `--remote-debugging-pipe`: CDP messages are NUL-terminated JSON, written to its fd 3 and read from
    its fd 4."""

    def __init__(self, user_data_dir: Path, timeout: float = 60.0):
        self._log = tempfile.TemporaryFile()        # a file, not a pipe: a chatty browser must never block on stderr
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={user_data_dir}", "--remote-debugging-pipe", "about:blank"]
        shell = f'exec "$@" 3<&{to_chrome_r} 4>&{from_chrome_w} {to_chrome_r}<&- {from_chrome_w}>&-'
        self.proc = subprocess.Popen(["bash", "-c", shell, "chromium", *cmd], pass_fds=(to_chrome_r, from_chrome_w),
                                     stdout=subprocess.DEVNULL, stderr=self._log)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self.timeout = timeout
        self._next_id = 0
        self._replies: dict[int, queue.Queue] = {}
        self.events: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        buf = b""
        with os.fdopen(self._from_chrome, "rb", buffering=0) as f:
            while chunk := f.read(1 << 16):
                buf += chunk
                *messages, buf = buf.split(b"\0")
                for m in messages:
                    msg = json.loads(m)
                    if "id" in msg and msg["id"] in self._replies:
                        self._replies[msg["id"]].put(msg)
                    else:
                        self.events.put(msg)

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        q = self._replies[self._next_id] = queue.Queue()
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                reply = q.get(timeout=0.5)
                break
            except queue.Empty:
                if self.proc.poll() is not None:
                    self._log.seek(0)
                    raise RuntimeError(f"chromium exited with {self.proc.returncode} during {method}: "
                                       f"{self._log.read()[-2000:].decode(errors='replace')}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"chromium did not answer {method} within {self.timeout:.0f} s") from None
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    def wait_event(self, method: str, seen: list) -> dict:
        while True:
            try:
                ev = self.events.get(timeout=self.timeout)
            except queue.Empty:
                raise TimeoutError(f"no {method} from chromium within {self.timeout:.0f} s") from None
            seen.append(ev)
            if ev.get("method") == method:
                return ev

    def close(self):
        try:
            self.send("Browser.close")
        except Exception:
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_chrome)
        self._log.close()


def open_page(path: Path, tmp: Path) -> PageCheck:
    browser = DevTools(tmp / "chromium-profile")
    try:
        target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            browser.send(f"{domain}.enable", session=session)
        browser.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": 1280, "height": 900, "deviceScaleFactor": 1, "mobile": False},
            session=session,
        )
        events: list[dict] = []
        url = path.resolve().as_uri()
        browser.send("Page.navigate", {"url": url}, session=session)
        browser.wait_event("Page.loadEventFired", events)
        images = browser.send(
            "Runtime.evaluate",
            {
                "returnByValue": True,
                "expression": """
            Array.from(document.images).map(i => ({src: i.getAttribute('src').slice(0, 40), complete: i.complete,
                                                   width: i.naturalWidth, height: i.naturalHeight}))""",
            },
            session=session,
        )
        size = browser.send("Page.getLayoutMetrics", session=session)["cssContentSize"]
        shot = browser.send(
            "Page.captureScreenshot",
            {
                "format": "png",
                "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
            },
            session=session,
        )
        browser.send(
            "Runtime.evaluate", {"expression": "1"}, session=session
        )  # flush events queued before the screenshot
        while not browser.events.empty():
            events.append(browser.events.get())
    finally:
        browser.close()
    check = PageCheck(
        images=images["result"]["value"], console_errors=[], requests=[], screenshot=base64.b64decode(shot["data"])
    )
    for ev in events:
        method, p = ev.get("method"), ev.get("params", {})
        if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            check.console_errors.append(" ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            check.console_errors.append(p["exceptionDetails"].get("text", "exception"))
        elif method == "Log.entryAdded" and p["entry"].get("level") == "error":
            check.console_errors.append(p["entry"].get("text", ""))
        elif method == "Network.requestWillBeSent" and not p["request"]["url"].startswith("data:"):
            check.requests.append(p["request"]["url"])
        elif method == "Network.loadingFailed":
            check.failed.append(p.get("errorText", ""))
    return check


def _decoded(png: bytes) -> np.ndarray:
    from matplotlib.image import imread

    return imread(io.BytesIO(png), format="png")


def test_report_opens_in_chromium_with_every_figure(tmp_path, rng_seed):
    make_compare_run(tmp_path / "a", rng_seed)
    make_compare_run(tmp_path / "b", rng_seed + 1, panel_name="other", packs=(("q3", 3.5, 0.9),))
    rep = render([tmp_path / "a", tmp_path / "b" / "compare.json"], tmp_path / "report")
    html = rep.index_html.read_text()
    assert "http://" not in html and "https://" not in html and "<script" not in html
    check = open_page(rep.index_html, tmp_path)
    (tmp_path / "report" / "screenshot.png").write_bytes(check.screenshot)
    assert len(check.images) == len(rep.figures) == 8
    for img, fig in zip(check.images, rep.figures):
        assert img["complete"] and img["width"] > 0 and img["height"] > 0, img
        assert (img["width"], img["height"]) == _decoded(fig.read_bytes()).shape[1::-1]
    assert check.console_errors == []
    assert check.requests == [rep.index_html.resolve().as_uri()]
    assert check.failed == []
    shot = _decoded(check.screenshot)
    assert shot.shape[1] >= 1200 and shot.shape[0] > 2000  # the whole page (less a scrollbar), not a blank viewport
    assert shot[..., :3].std() > 0.05


def test_the_browser_check_catches_a_broken_page(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><head><title>x</title></head><body><img src="missing.png">'
                   '<img src="http://127.0.0.1:9/x.png"><script>console.error("boom")</script></body></html>')
    check = open_page(bad, tmp_path)
    assert [i["width"] for i in check.images] == [0, 0]
    assert "boom" in check.console_errors
    assert "http://127.0.0.1:9/x.png" in check.requests and bad.resolve().as_uri() in check.requests
