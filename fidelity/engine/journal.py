"""Per-request journal: an append-only JSONL file of finished requests keyed by a hash of (path, body, tag).

An interrupted run that reopens the same journal gets every finished response back without re-sending it. Only
successful responses are journaled; a request that failed is sent again on resume. A line cut short by a kill is ignored
on load.

Every line carries a checksum of its record (`"checksum": "sha256:..."`, over the record's compact JSON), so a line that
changed after it was written (a flipped bit in a journaled logprob) is never used. A journal is a cache of work that can
be done again, so such a line is not refused: its work is done again (the request sent, the item run) and a warning
names the file and the lines; a later line for the same request replaces it. A line with no checksum (written before
there were checksums) is treated the same way. A line that is not UTF-8, not JSON or not a record is refused, naming the
file and line: the file is not a journal, or is damaged beyond one record. Text holding a lone surrogate is written with
\\uXXXX escapes and the line marked `"lone_surrogates": true` (`fidelity.lone_surrogates`); it reads back to the same
str.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
from pathlib import Path

from ..errors import FidelityError
from ..lone_surrogates import hash_bytes, json_bytes

CHECKSUM, LONE_SURROGATES = "checksum", "lone_surrogates"  # a line's own fields, around the record it holds


def read_journal_lines(path: Path) -> list[tuple[int, bytes]]:
    """(line number, bytes) of every non-empty line of an append-only JSONL journal. A last line cut short by a kill is
    truncated away first, so appends start on a fresh line and nothing half-written is ever read."""
    data = path.read_bytes()
    cut = data.rfind(b"\n") + 1
    if cut < len(data):
        with open(path, "r+b") as f:
            f.truncate(cut)
    return [(n, line) for n, line in enumerate(data[:cut].split(b"\n"), 1) if line.strip()]


def request_key(path: str, body: dict, tag: str = "") -> str:
    """Stable key of one logical request. `tag` separates identical bodies that must be sent separately (e.g. the same
    prompt alone and inside a concurrent batch)."""
    canon = json.dumps(
        {"path": path, "body": body, "tag": tag}, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    return hashlib.sha256(hash_bytes(canon)).hexdigest()


def record_checksum(record: dict) -> str:
    """sha256 of the record's canonical JSON (compact, ASCII escapes, keys in their order, which reading keeps; sorting
    would order int keys otherwise than the strings they read back as): any change to what the line holds changes it."""
    canon = json.dumps(record, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(canon.encode("ascii")).hexdigest()


def journal_line(record: dict) -> bytes:
    """One line (newline included) holding `record`, its checksum, and the lone-surrogate mark where its text needed
    it."""
    checksum = record_checksum(record)
    data, escaped = json_bytes({**record, CHECKSUM: checksum})
    if escaped:
        data, _ = json_bytes({**record, LONE_SURROGATES: True, CHECKSUM: checksum})
    return data + b"\n"


class AppendOnlyJsonl:
    """An append-only JSONL file of finished work, one fsync'ed line per unit (`journal_line`): on open every earlier
    line is checked by `_record(lineno, obj)` (which refuses one that is not a record through `_bad_line`), and kept by
    `_keep(record)` when its checksum holds (see the module docstring); `_append(record)` adds a line, safe across
    threads. A write that fails (a full disk) leaves no part of its line behind and is a FidelityError naming the
    file."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock = threading.Lock()
        self.changed_lines: list[int] = []  # lines whose checksum fails: not used
        self.unchecked_lines: list[int] = []  # lines without a checksum: not used
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            for lineno, raw in read_journal_lines(self.path):
                self._load_line(lineno, raw)
            self._warn_untrusted()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _load_line(self, lineno: int, raw: bytes) -> None:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            self._bad_line(lineno, f"is not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line)")
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            self._bad_line(lineno, f"is not valid JSON ({e})")
        checksum = obj.pop(CHECKSUM, None) if isinstance(obj, dict) else None
        if isinstance(obj, dict):
            obj.pop(LONE_SURROGATES, None)
        record = self._record(lineno, obj)
        if checksum is None:
            self.unchecked_lines.append(lineno)
        elif checksum != record_checksum(obj):
            self.changed_lines.append(lineno)
        else:
            self._keep(record)

    def _warn_untrusted(self) -> None:
        def lines(ns):
            return ", ".join(map(str, ns[:10])) + (f" and {len(ns) - 10} more" if len(ns) > 10 else "")

        why = [f"line(s) {lines(self.changed_lines)} changed after they were written (their checksum fails)"
               if self.changed_lines else "",
               f"line(s) {lines(self.unchecked_lines)} carry no checksum (written by an older fidelity)"
               if self.unchecked_lines else ""]
        if any(why):
            warnings.warn(f"journal {self.path}: {'; '.join(w for w in why if w)}: not used, their work is done again",
                          stacklevel=2)

    def _record(self, lineno: int, obj):
        """The record a line holds; `_bad_line` when it holds none."""
        raise NotImplementedError

    def _keep(self, record) -> None:
        raise NotImplementedError

    def _bad_line(self, lineno: int, why: str) -> None:
        raise FidelityError(f"journal {self.path}: line {lineno} {why} (the file is corrupt; delete it to start over)")

    def _append(self, record: dict) -> None:
        data = journal_line(record)
        with self._lock:
            size = os.fstat(self._fd).st_size
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self._fd, view):]
                os.fsync(self._fd)
            except OSError as e:
                try:  # no half line left behind for the next append to run into
                    os.ftruncate(self._fd, size)
                except OSError:
                    pass
                raise FidelityError(f"journal {self.path}: cannot append a line: {e.strerror or e} (errno {e.errno}); "
                                    f"the lines before it are kept, and a rerun resumes from them") from None

    def close(self):
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class Journal(AppendOnlyJsonl):
    """Append-only JSONL of `{"key", "path", "tag", "response"}` records."""

    def __init__(self, path: str | os.PathLike):
        self._entries: dict[str, dict] = {}
        super().__init__(path)

    def _record(self, lineno: int, rec):
        if not isinstance(rec, dict) or "key" not in rec or "response" not in rec:
            self._bad_line(lineno, "is not a journal record")
        return rec

    def _keep(self, rec) -> None:
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
