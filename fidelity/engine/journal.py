"""Per-request journal: an append-only JSONL file of finished requests keyed by a hash of (path, body, tag).

An interrupted run that reopens the same journal gets every finished response back without re-sending it. Only successful
responses are journaled; a request that failed is sent again on resume. A line cut short by a kill is ignored on load.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

from ..errors import FidelityError


def read_journal_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every non-empty line of an append-only JSONL journal. A last line cut short by a kill is
    truncated away first, so appends start on a fresh line and nothing half-written is ever read."""
    data = path.read_bytes()
    cut = data.rfind(b"\n") + 1
    if cut < len(data):
        with open(path, "r+b") as f:
            f.truncate(cut)
    return [(n, line) for n, line in enumerate(data[:cut].decode("utf-8").splitlines(), 1) if line.strip()]


def request_key(path: str, body: dict, tag: str = "") -> str:
    """Stable key of one logical request. `tag` separates identical bodies that must be sent separately (e.g. the same
    prompt alone and inside a concurrent batch)."""
    canon = json.dumps({"path": path, "body": body, "tag": tag}, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


class AppendOnlyJsonl:
    """An append-only JSONL file of finished work, one fsync'ed line per unit: on open every earlier line is handed to
    `_take(lineno, obj)` (a line cut short by a kill is dropped first; one that is not JSON goes to `_bad_line`), and
    `_append(obj)` adds a line, safe across threads."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            for lineno, line in read_journal_lines(self.path):
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    self._bad_line(lineno, f"is not valid JSON ({e})")
                self._take(lineno, obj)
        self._file = open(self.path, "a", encoding="utf-8")

    def _take(self, lineno: int, obj) -> None:
        raise NotImplementedError

    def _bad_line(self, lineno: int, why: str) -> None:
        raise FidelityError(f"journal {self.path}: line {lineno} {why} (the file is corrupt; delete it to start over)")

    def _append(self, obj) -> None:
        line = json.dumps(obj, ensure_ascii=False)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self):
        with self._lock:
            if not self._file.closed:
                self._file.close()


class Journal(AppendOnlyJsonl):
    """Append-only JSONL of `{"key", "path", "tag", "response"}` records."""

    def __init__(self, path: str | os.PathLike):
        self._entries: dict[str, dict] = {}
        super().__init__(path)

    def _take(self, lineno: int, rec) -> None:
        if not isinstance(rec, dict) or "key" not in rec or "response" not in rec:
            self._bad_line(lineno, "is not a journal record")
        self._entries[rec["key"]] = rec["response"]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> dict | None:
        return self._entries.get(key)

    def put(self, key: str, response: dict, *, path: str = "", tag: str = ""):
        self._entries[key] = response
        self._append({"key": key, "path": path, "tag": tag, "response": response})
