"""Panels: the rows a pack is scored on.

A panel is a folder with `panel.jsonl` (one row per line) and `manifest.json` (name, description, sources with their
license/provenance, and the sha256 of `panel.jsonl`). A row is either a conversation
    {"id": str, "domain": str, "messages": [{"role": ..., "content": ...}, ...]}
rendered with the pack's own chat template, of which only the assistant turns' tokens are scored, or plain text
    {"id": str, "domain": str, "text": str}
of which every token after the first is scored. Loaders also read a bare .jsonl / .parquet file and Hugging Face
datasets (`hf:owner/name[:split]`, or any `datasets.load_dataset` source).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from .errors import FidelityError

PANEL_FILE = "panel.jsonl"
MANIFEST_FILE = "manifest.json"
DEFAULT_PANEL = Path(__file__).resolve().parent.parent / "panels" / "default"


class PanelError(FidelityError):
    """A panel or one of its rows is malformed. Names the file and the row."""


@dataclass
class PanelRow:
    id: str
    domain: str
    messages: list[dict] | None = None
    text: str | None = None

    def to_json(self) -> dict:
        body = {"messages": self.messages} if self.messages is not None else {"text": self.text}
        return {"id": self.id, "domain": self.domain, **body}


@dataclass
class Panel:
    name: str
    rows: list[PanelRow]
    sha256: str
    description: str = ""
    sources: list[dict] = field(default_factory=list)
    path: Path | None = None

    @property
    def domains(self) -> list[str]:
        return sorted({r.domain for r in self.rows})

    def subset(self, per_domain: int) -> "Panel":
        """The first `per_domain` rows of each domain (a reduced panel for quick runs); its sha256 names the subset."""
        seen: dict[str, int] = {}
        rows = []
        for r in self.rows:
            if seen.get(r.domain, 0) < per_domain:
                rows.append(r)
                seen[r.domain] = seen.get(r.domain, 0) + 1
        return Panel(f"{self.name}[{per_domain}/domain]", rows, rows_sha256(rows), self.description, self.sources, self.path)


@dataclass
class TokenizedRow:
    """`tokens[t]` is scored when `scored[t]`: it is predicted by the logits at position t - 1 (so scored[0] is False)."""

    id: str
    domain: str
    tokens: list[int]
    scored: list[bool]
    truncated: bool = False

    @property
    def n_scored(self) -> int:
        return sum(self.scored)


# -- reading -------------------------------------------------------------------------------------------------------
def panel_jsonl_bytes(rows: Iterable[PanelRow]) -> bytes:
    return "".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in rows).encode()


def rows_sha256(rows: Iterable[PanelRow]) -> str:
    return hashlib.sha256(panel_jsonl_bytes(rows)).hexdigest()


def parse_row(obj, where: str) -> PanelRow:
    """One row from a decoded record; `where` names it in errors (file and line)."""
    if not isinstance(obj, dict):
        raise PanelError(f"{where}: a row must be an object, got {type(obj).__name__}")
    rid = obj.get("id")
    if isinstance(rid, int) and not isinstance(rid, bool):
        rid = str(rid)
    if not isinstance(rid, str) or not rid:
        raise PanelError(f"{where}: field 'id' must be a non-empty string, got {rid!r}")
    where = f"{where} (row {rid!r})"
    domain = obj.get("domain")
    if not isinstance(domain, str) or not domain:
        raise PanelError(f"{where}: field 'domain' must be a non-empty string, got {type(domain).__name__} {domain!r}")
    messages, text = obj.get("messages"), obj.get("text")
    if (messages is None) == (text is None):
        raise PanelError(f"{where}: a row has exactly one of 'messages' (chat) or 'text' (plain text)")
    if text is not None:
        if not isinstance(text, str) or not text:
            raise PanelError(f"{where}: field 'text' must be a non-empty string")
        return PanelRow(rid, domain, text=text)
    if not isinstance(messages, list) or not messages:
        raise PanelError(f"{where}: field 'messages' must be a non-empty list")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise PanelError(f"{where}: message {i} must have string 'role' and 'content'")
        if "truncated" in m and not isinstance(m["truncated"], bool):
            raise PanelError(f"{where}: message {i}: 'truncated' must be true or false")
        clean.append({"role": m["role"], "content": m["content"], **({"truncated": True} if m.get("truncated") else {})})
    if not any(m["role"] == "assistant" for m in clean):
        raise PanelError(f"{where}: a chat row needs an assistant message: only assistant tokens are scored")
    return PanelRow(rid, domain, messages=clean)


def _check_unique(rows: list[PanelRow], source) -> list[PanelRow]:
    seen = set()
    for r in rows:
        if r.id in seen:
            raise PanelError(f"{source}: row id {r.id!r} appears twice")
        seen.add(r.id)
    if not rows:
        raise PanelError(f"{source}: the panel has no rows")
    return rows


def iter_jsonl(path: Path):
    """(line number, object) for each non-empty line; invalid JSON is a PanelError naming the file and line."""
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise PanelError(f"{path} line {n}: invalid JSON: {e}") from None


def read_jsonl(path: Path) -> list[PanelRow]:
    rows = [parse_row(obj, f"{path} line {n}") for n, obj in iter_jsonl(path)]
    return _check_unique(rows, path)


def read_parquet(path: Path) -> list[PanelRow]:
    import pyarrow.parquet as pq

    records = pq.read_table(path).to_pylist()
    return _check_unique([parse_row(_drop_nulls(r), f"{path} row {i}") for i, r in enumerate(records)], path)


def _drop_nulls(record: dict) -> dict:
    return {k: v for k, v in record.items() if v is not None}


def load_panel(source: str | Path | None = None) -> Panel:
    """A panel folder, a .jsonl or .parquet file, or `hf:NAME[:SPLIT]` (Hugging Face datasets). None: panels/default."""
    if source is None:
        source = DEFAULT_PANEL
    if isinstance(source, str) and source.startswith("hf:"):
        name, _, split = source[3:].partition(":")
        return load_hf_panel(name, split=split or "train")
    path = Path(source).expanduser()
    if path.is_dir():
        return _load_folder(path)
    if not path.exists():
        raise PanelError(f"{path}: no such panel folder or file")
    if path.suffix == ".jsonl":
        rows = read_jsonl(path)
    elif path.suffix == ".parquet":
        rows = read_parquet(path)
    else:
        raise PanelError(f"{path}: a panel is a folder, a .jsonl or a .parquet file")
    return Panel(path.stem, rows, rows_sha256(rows), path=path)


def _load_folder(path: Path) -> Panel:
    jsonl, manifest_path = path / PANEL_FILE, path / MANIFEST_FILE
    if not jsonl.exists():
        raise PanelError(f"{path}: a panel folder holds {PANEL_FILE} and {MANIFEST_FILE}; {PANEL_FILE} is missing")
    manifest = {}
    if manifest_path.exists():
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as e:
            raise PanelError(f"{manifest_path}: invalid JSON: {e}") from None
    digest = hashlib.sha256(jsonl.read_bytes()).hexdigest()
    if manifest.get("sha256") and manifest["sha256"] != digest:
        raise PanelError(f"{jsonl}: sha256 {digest[:12]}... differs from the manifest's {manifest['sha256'][:12]}...: "
                         f"the rows changed after the manifest was written (rewrite it with `fidelity panel manifest`)")
    rows = read_jsonl(jsonl)
    return Panel(manifest.get("name", path.name), rows, digest, manifest.get("description", ""),
                 manifest.get("sources", []), path)


def load_hf_panel(name: str, *, split: str = "train", data_files=None, id_field: str = "id", domain_field: str = "domain",
                  messages_field: str = "messages", text_field: str = "text", **load_kwargs) -> Panel:
    """Rows from `datasets.load_dataset(name, split=split, data_files=...)`: a hub dataset id, or a builder such as
    "json" / "parquet" with local `data_files`. Field names map the dataset's columns onto a panel row."""
    try:
        import datasets
    except ImportError:
        raise PanelError("reading Hugging Face datasets needs the `datasets` package (pip install datasets)") from None
    try:
        ds = datasets.load_dataset(name, split=split, data_files=data_files, **load_kwargs)
    except Exception as e:
        raise PanelError(f"datasets cannot load {name!r} (split {split!r}): {type(e).__name__}: {e}") from None
    rows = []
    for i, rec in enumerate(ds):
        mapped = {"id": rec.get(id_field, str(i)), "domain": rec.get(domain_field)}
        if rec.get(messages_field) is not None:
            mapped["messages"] = rec[messages_field]
        if rec.get(text_field) is not None:
            mapped["text"] = rec[text_field]
        rows.append(parse_row(mapped, f"dataset {name!r} split {split!r} row {i}"))
    rows = _check_unique(rows, f"dataset {name!r}")
    return Panel(name.replace("/", "_"), rows, rows_sha256(rows), sources=[{"dataset": name, "split": split}])


# -- writing -------------------------------------------------------------------------------------------------------
def write_panel(out_dir: str | Path, rows: list[PanelRow], *, name: str, description: str = "",
                sources: list[dict] | None = None, extra: dict | None = None) -> Panel:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = panel_jsonl_bytes(_check_unique(list(rows), out))
    (out / PANEL_FILE).write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    domains: dict[str, int] = {}
    for r in rows:
        domains[r.domain] = domains.get(r.domain, 0) + 1
    manifest = {"name": name, "description": description, "sources": sources or [], "rows": len(rows),
                "domains": domains, "sha256": digest, **(extra or {})}
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    return Panel(name, list(rows), digest, description, sources or [], out)


# -- tokenizing ----------------------------------------------------------------------------------------------------
def tokenize_row(row: PanelRow, tokenizer, *, max_len: int | None = None, truncate: bool = False) -> TokenizedRow:
    if row.text is not None:
        tokens = list(tokenizer(row.text, add_special_tokens=True)["input_ids"])
        scored = [False] + [True] * (len(tokens) - 1)
    else:
        tokens, scored = render_chat(row, tokenizer)
    truncated = False
    if max_len is not None and len(tokens) > max_len:
        if not truncate:
            raise PanelError(f"row {row.id!r} ({row.domain}) is {len(tokens)} tokens, longer than the model's context "
                             f"of {max_len}; shorten it or pass truncate=True (--truncate) to score its first {max_len}")
        tokens, scored, truncated = tokens[:max_len], scored[:max_len], True
    out = TokenizedRow(row.id, row.domain, tokens, scored, truncated)
    if out.n_scored == 0:
        what = "no assistant tokens" if row.messages is not None else "a single token"
        raise PanelError(f"row {row.id!r} ({row.domain}) has no scored tokens ({what}"
                         f"{', after truncation' if truncated else ''})")
    return out


def render_chat(row: PanelRow, tokenizer) -> tuple[list[int], list[bool]]:
    """Render with the tokenizer's chat template; mark the tokens of each assistant turn (its content and end-of-turn
    marker, only the content when the turn is marked `truncated`, never the trailing newline the template adds after
    it). Assistant spans are found by rendering growing
    prefixes of the conversation, which must be prefixes of the full rendering."""
    if not getattr(tokenizer, "chat_template", None):
        raise PanelError(f"row {row.id!r}: the pack's tokenizer has no chat template, so chat rows cannot be rendered")
    msgs = row.messages
    render = lambda m, gen: tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=gen)
    full = render(msgs, False)
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        start_text = render(msgs[:i], True) if i else ""
        end_text = render(msgs[:i + 1], False)
        if not (full.startswith(start_text) and full.startswith(end_text) and end_text.startswith(start_text)):
            raise PanelError(f"row {row.id!r}: the chat template does not render this conversation prefix by prefix, so "
                             f"assistant turn {i} cannot be located")
        end = len(end_text.rstrip())
        if m.get("truncated"):  # cut short by a token limit: its content is scored, the template's end-of-turn is not
            content = m["content"].strip()
            at = end_text.rfind(content) if content else -1
            if at < len(start_text):
                raise PanelError(f"row {row.id!r}: assistant turn {i} is marked truncated but its text is not found "
                                 f"verbatim in the rendered conversation")
            end = at + len(content)
        spans.append((len(start_text), end))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    tokens = list(enc["input_ids"])
    scored = []
    for s, e in enc["offset_mapping"]:
        scored.append(any(a <= s < b for a, b in spans) and e > s)
    if scored:
        scored[0] = False
    return tokens, scored


def tokenize_panel(panel: Panel, tokenizer, *, max_len: int | None = None, truncate: bool = False) -> list[TokenizedRow]:
    return [tokenize_row(r, tokenizer, max_len=max_len, truncate=truncate) for r in panel.rows]


def tokenizer_fingerprint(tokenizer) -> str:
    """Identity of a tokenizer for the reference store: its vocabulary, merges, special tokens and chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update((getattr(tokenizer, "chat_template", None) or "").encode())
    return h.hexdigest()[:16]
