"""Overlap of a panel with calibration or benchmark texts: rows that share a word n-gram (default 8, as seed cards
state "no prompt shares an 8-gram with IFEval") with any text of the `against` sources.

Words are the lower-cased `\\w+` runs of the text (punctuation and spacing ignored), so an n-gram matches across
formatting differences; a text of fewer than n words has no n-gram and cannot match (scripts written without spaces
count a whole run as one word). Token-exact rows are decoded with the pack's tokenizer first.
"""
from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pyarrow.parquet as pq

from ..suites import make_suite
from .panel import PanelError, load_panel, message_text

WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def ngrams(text: str, n: int) -> Iterator[tuple[int, str]]:
    """(word index, n-gram joined by spaces) of every n-gram of `text`."""
    w = words(text)
    for i in range(len(w) - n + 1):
        yield i, " ".join(w[i:i + n])


@dataclass
class Hit:
    row: str
    domain: str
    part: str  # where in the row: "message 2 (user)", "text", "tokens"
    ngram: str
    source: str  # the against source and the item in it
    shared: int  # how many distinct n-grams this row part shares with that source item

    def to_json(self) -> dict:
        return self.__dict__.copy()


@dataclass
class Findings:
    panel: str
    n: int
    against: list[dict]  # per source: texts and n-grams read
    rows_checked: int
    hits: list[Hit] = field(default_factory=list)

    @property
    def rows_hit(self) -> list[str]:
        return sorted({h.row for h in self.hits})

    def to_json(self) -> dict:
        return {"panel": self.panel, "ngram": self.n, "against": self.against, "rows_checked": self.rows_checked,
                "rows_hit": self.rows_hit, "hits": [h.to_json() for h in self.hits]}


def _strings(obj) -> Iterator[str]:
    """Every string in a decoded record, nested ones included."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def _record_text(rec, fields: list[str] | None) -> str:
    if fields and isinstance(rec, dict):
        rec = [rec[k] for k in fields if k in rec]
    return "\n".join(_strings(rec))


def against_texts(source: str, fields: list[str] | None = None) -> Iterator[tuple[str, str]]:
    """(item name, text) of every text of a calibration or benchmark source."""
    if source.startswith("suite:"):
        name, _, data = source[6:].partition("=")
        for item in make_suite(name, **({"data": data} if data else {})).load():
            text = "\n".join(message_text(m.get("content"), f"{source} item {item.item_id}") for m in item.messages) \
                if item.messages else item.prompt
            yield f"{source} item {item.item_id}", text
        return
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and
                       (p.suffix in (".txt", ".jsonl", ".json", ".parquet") or p.name.endswith(".jsonl.gz")))
        if not files:
            raise PanelError(f"{path}: no .txt/.jsonl/.jsonl.gz/.json/.parquet files to check against")
        for f in files:
            yield from against_texts(str(f), fields)
        return
    if not path.exists():
        raise PanelError(f"{path}: no such file to check against")
    name = path.name
    if name.endswith(".jsonl") or name.endswith(".jsonl.gz"):
        opener = gzip.open if name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise PanelError(f"{path} line {n}: invalid JSON: {e}") from None
                yield f"{path} line {n}", _record_text(rec, fields)
    elif path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        for i, rec in enumerate(data if isinstance(data, list) else [data]):
            yield f"{path} item {i}", _record_text(rec, fields)
    elif path.suffix == ".parquet":
        for i, rec in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path} row {i}", _record_text(rec, fields)
    elif path.suffix == ".txt":
        yield str(path), path.read_text(encoding="utf-8")
    else:
        raise PanelError(
            f"{path}: check against .txt, .jsonl(.gz), .json, .parquet files, folders of them, or suite:NAME"
        )


def row_parts(row, tokenizer) -> Iterator[tuple[str, str]]:
    if row.text is not None:
        yield "text", row.text
    elif row.tokens is not None:
        if tokenizer is None:
            raise PanelError(f"row {row.id!r} is token-exact: pass --pack so its tokens can be decoded to text")
        yield "tokens", tokenizer.decode(row.tokens)
    else:
        for i, m in enumerate(row.messages):
            parts = [message_text(m.get("content"), f"row {row.id!r} message {i}"), m.get("reasoning_content") or ""]
            parts += [json.dumps(c["function"]["arguments"]) if not isinstance(c["function"]["arguments"], str)
                      else c["function"]["arguments"] for c in m.get("tool_calls") or []]
            yield f"message {i} ({m['role']})", "\n".join(p for p in parts if p)


def check_panel(panel, against: list[str], *, n: int = 8, fields: list[str] | None = None, pack=None,
                tokenizer=None) -> Findings:
    if n < 1:
        raise PanelError(f"--ngram must be at least 1, got {n}")
    panel = panel if hasattr(panel, "rows") else load_panel(panel)
    if tokenizer is None and pack is not None:
        # the packs load torch: only without a tokenizer
        from ..packs.tokenizer import tokenizer_of  # noqa: PLC0415 (torch)

        tokenizer = tokenizer_of(pack)
    index: dict[str, str] = {}  # n-gram -> first source item holding it
    read = []
    for source in against:
        texts = grams = 0
        for item, text in against_texts(source, fields):
            texts += 1
            for _, g in ngrams(text, n):
                grams += 1
                index.setdefault(g, item)
        read.append({"source": source, "texts": texts, "ngrams": grams})
    found = Findings(panel.name, n, read, len(panel.rows))
    for row in panel.rows:
        for part, text in row_parts(row, tokenizer):
            shared: dict[str, list[str]] = {}
            for _, g in ngrams(text, n):
                if g in index:
                    shared.setdefault(index[g], []).append(g)
            for item, gs in shared.items():
                found.hits.append(Hit(row.id, row.domain, part, gs[0], item, len(set(gs))))
    return found


def print_findings(con, f: Findings):
    sources = ", ".join(f"{a['source']} ({a['texts']} texts)" for a in f.against)
    if not f.hits:
        con.print(f"{f.panel}: none of {f.rows_checked} rows shares a {f.n}-gram with {sources}")
        return
    con.print(f"{f.panel}: {len(f.rows_hit)} of {f.rows_checked} rows share a {f.n}-gram with {sources}:")
    for h in f.hits:
        con.print(f"  row {h.row!r} ({h.domain}) {h.part}: {h.shared} shared with {h.source}, e.g. \"{h.ngram}\"",
                  markup=False, highlight=False)
