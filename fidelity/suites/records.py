"""A suite run's folder: `manifest.json` (what was run against what), `records.jsonl` (the item journal: one line per
finished item, fsync'ed, so a killed run resumes without losing or repeating an item), `requests.jsonl` (the engine
client's request journal) and `records.parquet` (the final per-item table, written from the journal in dataset order).
Both journals checksum every line (`fidelity.engine.journal`). Text holding a lone surrogate (an engine's "\\ud800")
round-trips: the journal line is written in \\uXXXX escapes, and in records.parquet, whose strings must be UTF-8, the
row is marked `lone_surrogates` and its string columns hold JSON string escapes, which `read_records` decodes."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..engine.journal import AppendOnlyJsonl
from ..errors import FidelityError
from ..lone_surrogates import first_lone_surrogate, hash_bytes

MANIFEST, JOURNAL, REQUESTS, RECORDS = "manifest.json", "records.jsonl", "requests.jsonl", "records.parquet"


class RunError(FidelityError):
    """A run folder is missing, corrupt, or was made with different settings. Names the file."""

    def __init__(self, message: str, *, file: str | os.PathLike | None = None, item: str | None = None):
        self.file, self.item = (str(file) if file is not None else None), item
        where = [w for w in (f"item {item!r}" if item else None, f"file {file}" if file is not None else None) if w]
        super().__init__(f"{message} [{', '.join(where)}]" if where else message)


@dataclass
class Record:
    item_id: str
    passed: bool | None  # pass/fail suites; None for an engine error
    score: float | None  # scored suites (and pass/fail suites' partial credit where they have one)
    prompt_hash: str
    request: str  # JSON of the request body sent
    response: str  # the engine's text (tool calls as JSON for toolcall)
    extracted: str  # what the scorer judged (code, answer, calls)
    verdict: str  # why it passed or failed, in words
    error: str  # non-empty: the engine failed on this item; excluded from paired tests
    latency_s: float
    details: str = "{}"  # suite-specific JSON (IFEval's per-instruction results, ...)
    finish_reason: str = ""  # the engine's finish_reason ("stop", "length": cut by the token limit, ...); "" where none
    metrics: str = "{}"  # JSON {name: [followed, of]} of the suite's named metrics (see `Outcome.metrics`)


# columns later than the first runs; older records read with these. `lone_surrogates`: the row's text held a lone
# surrogate, so its string columns are stored as JSON string escapes (see the module docstring)
NEW_COLUMNS = {"finish_reason": "", "metrics": "{}", "lone_surrogates": False}


# the columns are Record's fields, in order, as Arrow types
_ARROW_TYPES = {"str": pa.string(), "bool | None": pa.bool_(), "float | None": pa.float64(), "float": pa.float64()}
SCHEMA = pa.schema([(f.name, _ARROW_TYPES[f.type]) for f in fields(Record)])
TEXT_COLUMNS = [f.name for f in SCHEMA if f.type == pa.string()]
PARQUET_SCHEMA = SCHEMA.append(pa.field("lone_surrogates", pa.bool_()))  # the records' columns and the escape mark


def prompt_hash(request: dict) -> str:
    """sha256 of what decides the answer: messages or prompt, and tools."""
    key = {k: request.get(k) for k in ("messages", "prompt", "tools")}
    return hashlib.sha256(hash_bytes(json.dumps(key, sort_keys=True, ensure_ascii=False))).hexdigest()[:16]


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class ItemJournal(AppendOnlyJsonl):
    """Append-only JSONL of finished `Record`s. The last line, if a kill cut it short, is dropped on open. A later line
    for the same item (an engine error retried on resume) replaces the earlier one."""

    def __init__(self, path: str | os.PathLike):
        self.records: dict[str, Record] = {}
        super().__init__(path)

    def _record(self, lineno: int, obj) -> Record:
        try:
            return Record(**obj)
        except TypeError as e:
            self._bad_line(lineno, f"is not an item record ({e})")

    def _keep(self, rec: Record) -> None:
        self.records[rec.item_id] = rec

    def _bad_line(self, lineno: int, why: str) -> None:
        raise RunError(f"line {lineno} {why}; delete the file to start over", file=self.path)

    def append(self, rec: Record):
        self.records[rec.item_id] = rec
        self._append(asdict(rec))


def _escaped(text: str) -> str:
    return json.dumps(text)[1:-1]  # a JSON string's body: ASCII, read back by json.loads('"' + text + '"')


def _parquet_row(rec: Record) -> dict:
    row = asdict(rec)
    row["lone_surrogates"] = any(first_lone_surrogate(row[c]) is not None for c in TEXT_COLUMNS)
    if row["lone_surrogates"]:
        row.update({c: _escaped(row[c]) for c in TEXT_COLUMNS})
    return row


def write_records(path: str | os.PathLike, records: list[Record]):
    rows = [_parquet_row(r) for r in records]
    cols = {name: [row[name] for row in rows] for name in PARQUET_SCHEMA.names}
    tmp = Path(str(path) + ".tmp")
    try:
        pq.write_table(pa.table(cols, schema=PARQUET_SCHEMA), tmp)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise RunError(f"cannot write the records: {e}; the item journal keeps every finished item, and a rerun "
                       f"writes them again", file=path) from None


def read_records(run_dir: str | os.PathLike):
    """The run's records as a pandas DataFrame (from records.parquet)."""
    path = Path(run_dir) / RECORDS
    if not path.exists():
        raise RunError("no records.parquet: not a suite run folder, or the run has not finished", file=path)
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise RunError(f"cannot read records: {e}", file=path)
    missing = set(SCHEMA.names) - set(table.column_names) - set(NEW_COLUMNS)
    if missing:
        raise RunError(f"records lack columns {sorted(missing)}", file=path)
    df = table.to_pandas()
    for name, default in NEW_COLUMNS.items():
        if name not in df:
            df[name] = default
    escaped = df["lone_surrogates"].astype(bool)
    if escaped.any():  # as Python objects: pandas' arrow-backed strings cannot hold a lone surrogate either
        for c in TEXT_COLUMNS:
            df[c] = df[c].astype(object)
            df.loc[escaped, c] = [json.loads(f'"{v}"') for v in df.loc[escaped, c]]
    dup = df["item_id"][df["item_id"].duplicated()]
    if len(dup):
        raise RunError(f"duplicate item ids in records: {sorted(set(dup))[:5]}", file=path)
    return df


def read_manifest(run_dir: str | os.PathLike) -> dict:
    path = Path(run_dir) / MANIFEST
    if not path.exists():
        raise RunError("no manifest.json: not a suite run folder", file=path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunError(f"manifest is not JSON: {e}", file=path)


def write_manifest(run_dir: str | os.PathLike, manifest: dict):
    path = Path(run_dir) / MANIFEST
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise RunError(f"cannot write the manifest: {e}", file=path) from None
