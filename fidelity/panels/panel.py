"""Panels: the rows a pack is scored on.

A panel is a folder with `panel.jsonl` (one row per line) and `manifest.json` (name, description, sources with their
license/provenance, and the sha256 of `panel.jsonl`). A row is one of
    {"id", "domain", "messages": [...], "tools": [...]}   a conversation in the OpenAI chat format
    {"id", "domain", "text": str}                         plain text, every token after the first scored
    {"id", "domain", "tokens": [...], "scored": [...]}    token ids as they are fed, `scored[t]` true where tokens[t] is
                                                          scored (or "score_from": k: tokens[k:] are scored)
A conversation is rendered with the pack's own chat template (`render_chat`); only the assistant turns' tokens are
scored: their content, tool calls and reasoning (`score_reasoning=False` leaves the reasoning out), never system, user
or tool tokens. Messages follow OpenAI's chat format: `content` a string or a list of text parts, assistant `tool_calls`
[{"id", "type": "function", "function": {"name", "arguments"}}] and `reasoning_content`, `role: "tool"` results with the
`tool_call_id` they answer; the row's `tools` are the JSON-schema tool list the template is given. Token-exact rows are
for packs whose chat format is code (DeepSeek's `encoding/`, see `fidelity.panels.encoding`) or rows rendered elsewhere;
their ids are checked against the pack's vocabulary. Loaders also read a bare .jsonl / .parquet file and Hugging Face
datasets (`hf:owner/name[:split]`, or any `datasets.load_dataset` source).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from ..errors import FidelityError
from ..lone_surrogates import first_lone_surrogate, json_bytes

PANEL_FILE = "panel.jsonl"
MANIFEST_FILE = "manifest.json"
DEFAULT_PANEL = Path(__file__).resolve().parents[2] / "panels" / "default"


class PanelError(FidelityError):
    """A panel or one of its rows is malformed. Names the file and the row."""


@dataclass
class PanelRow:
    id: str
    domain: str
    messages: list[dict] | None = None
    text: str | None = None
    tools: list[dict] | None = None  # a conversation's tool list (JSON schemas), given to the chat template
    tokens: list[int] | None = None  # a token-exact row
    scored: list[bool] | None = None  # with `tokens`: which of them are scored
    template_kwargs: dict | None = None  # extra chat-template variables (e.g. {"enable_thinking": false})
    score_reasoning: bool = True  # a conversation's reasoning text is scored (False: only content and tool calls)

    def to_json(self) -> dict:
        if self.tokens is not None:
            first = self.scored.index(True) if True in self.scored else len(self.scored)
            if first and all(self.scored[first:]):
                body = {"tokens": self.tokens, "score_from": first}
            else:
                body = {"tokens": self.tokens, "scored": [int(s) for s in self.scored]}
        elif self.messages is not None:
            body = {"messages": self.messages, **({"tools": self.tools} if self.tools else {}),
                    **({"chat_template_kwargs": self.template_kwargs} if self.template_kwargs else {}),
                    **({} if self.score_reasoning else {"score_reasoning": False})}
        else:
            body = {"text": self.text}
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
        return Panel(
            f"{self.name}[{per_domain}/domain]", rows, rows_sha256(rows), self.description, self.sources, self.path
        )


@dataclass
class TokenizedRow:
    """`tokens[t]` is scored when `scored[t]`: it is predicted by the logits at position t - 1 (so scored[0] is
    False)."""

    id: str
    domain: str
    tokens: list[int]
    scored: list[bool]
    truncated: bool = False
    tokens_cut: int = 0         # tokens truncation removed from the row's end
    scored_cut: int = 0         # of them, tokens that would have been scored

    @property
    def n_scored(self) -> int:
        return sum(self.scored)


# -- reading -------------------------------------------------------------------------------------------------------
def panel_jsonl_bytes(rows: Iterable[PanelRow]) -> bytes:
    """The rows as panel.jsonl holds them (and the bytes a panel's sha256 is taken over): one JSON line per row, its
    non-ASCII text as itself; a row whose text holds a lone surrogate (`fidelity.lone_surrogates`) in \\uXXXX escapes,
    which read back to the same row."""
    return b"".join(json_bytes(r.to_json())[0] + b"\n" for r in rows)


def lone_surrogate_rows(rows: Iterable[PanelRow]) -> list[str]:
    """Ids of the rows whose text holds a lone surrogate (written escaped; no tokenizer can encode them)."""
    return [r.id for r in rows if json_bytes(r.to_json())[1]]


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
    kinds = [k for k in ("messages", "text", "tokens") if obj.get(k) is not None]
    if len(kinds) != 1:
        raise PanelError(f"{where}: a row has exactly one of 'messages' (chat), 'text' (plain text) or 'tokens' "
                         f"(token-exact), got {kinds or 'none'}")
    if kinds == ["tokens"]:
        tokens, scored = parse_token_row(obj, where)
        return PanelRow(rid, domain, tokens=tokens, scored=scored)
    if kinds == ["text"]:
        text = obj["text"]
        if not isinstance(text, str) or not text:
            raise PanelError(f"{where}: field 'text' must be a non-empty string")
        return PanelRow(rid, domain, text=text)
    tools = parse_tools(obj.get("tools"), where)
    kwargs = obj.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise PanelError(f"{where}: field 'chat_template_kwargs' must be an object")
    if not isinstance(obj.get("score_reasoning", True), bool):
        raise PanelError(f"{where}: field 'score_reasoning' must be true or false")
    return PanelRow(rid, domain, messages=parse_messages(obj["messages"], where), tools=tools,
                    template_kwargs=kwargs or None, score_reasoning=obj.get("score_reasoning", True))


def parse_token_row(obj: dict, where: str) -> tuple[list[int], list[bool]]:
    tokens = obj["tokens"]
    if not isinstance(tokens, list) or not tokens:
        raise PanelError(f"{where}: field 'tokens' must be a non-empty list of token ids")
    for t, tok in enumerate(tokens):
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise PanelError(f"{where}: tokens[{t}] is {tok!r}, not a token id (a non-negative integer)")
    scored, score_from = obj.get("scored"), obj.get("score_from")
    if (scored is None) == (score_from is None):
        raise PanelError(f"{where}: a token-exact row has exactly one of 'scored' (one flag per token) or 'score_from'")
    if score_from is not None:
        if isinstance(score_from, bool) or not isinstance(score_from, int) or not 1 <= score_from < len(tokens):
            raise PanelError(f"{where}: 'score_from' must be an integer from 1 to {len(tokens) - 1} (the first token "
                             f"has no prediction), got {score_from!r}")
        return tokens, [False] * score_from + [True] * (len(tokens) - score_from)
    if not isinstance(scored, list) or len(scored) != len(tokens):
        got = f"{len(scored)} entries" if isinstance(scored, list) else type(scored).__name__
        raise PanelError(f"{where}: 'scored' must have one flag per token ({len(tokens)}), got {got}")
    flags = []
    for t, f in enumerate(scored):
        if f not in (0, 1) or isinstance(f, float):
            raise PanelError(f"{where}: scored[{t}] is {f!r}; flags are true/false or 1/0")
        flags.append(bool(f))
    if flags[0]:
        raise PanelError(f"{where}: scored[0] is true, but the first token has no prediction to score")
    return tokens, flags


def parse_tools(tools, where: str) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise PanelError(f"{where}: field 'tools' must be a list of tool definitions")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise PanelError(f"{where}: tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}")
    return tools or None


def message_text(content, where: str) -> str:
    """A message's text: the string, or its text parts joined (OpenAI's multi-part content)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise PanelError(f"{where}: content part {j} is {kind!r}; only text parts can be rendered and scored")
        parts.append(part["text"])
    return "".join(parts)


def parse_messages(messages, where: str, *, need_assistant: bool = True) -> list[dict]:
    """The conversation, checked: roles and content, tool calls with ids and names, every tool result answering an
    earlier call. Plain {"role", "content"} messages come back as they were."""
    if not isinstance(messages, list) or not messages:
        raise PanelError(f"{where}: field 'messages' must be a non-empty list")
    clean, open_calls, answered = [], {}, set()
    for i, m in enumerate(messages):
        at = f"{where}: message {i}"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise PanelError(f"{at} must have string 'role' and 'content'")
        role, content = m["role"], m.get("content")
        if not (isinstance(content, str) or (isinstance(content, list) and content)
                or (content is None and role == "assistant")):
            raise PanelError(f"{at} must have string 'role' and 'content' (a string or a list of text parts)")
        message_text(content, at)
        if "truncated" in m and not isinstance(m["truncated"], bool):
            raise PanelError(f"{at}: 'truncated' must be true or false")
        out = {"role": role, "content": content}
        if role == "assistant":
            reasoning = m.get("reasoning_content")
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise PanelError(f"{at}: 'reasoning_content' must be a string")
                out["reasoning_content"] = reasoning
            calls = m.get("tool_calls")
            if calls is not None:
                out["tool_calls"] = [parse_tool_call(c, f"{at}: tool_calls[{j}]") for j, c in enumerate(calls)] \
                    if isinstance(calls, list) else parse_tool_call(calls, f"{at}: tool_calls")
                for c in out["tool_calls"]:
                    if c["id"] in open_calls or c["id"] in answered:
                        raise PanelError(f"{at}: tool call id {c['id']!r} is used twice")
                    open_calls[c["id"]] = c["function"]["name"]
            if not (message_text(content, at) or out.get("tool_calls") or out.get("reasoning_content")):
                raise PanelError(f"{at}: an assistant message needs content, tool_calls or reasoning_content")
        elif role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in open_calls:
                known = ", ".join(repr(k) for k in open_calls) or "none"
                raise PanelError(f"{at} (tool): tool_call_id {call_id!r} answers no earlier assistant tool call "
                                 f"(unanswered calls: {known})")
            out["tool_call_id"] = call_id
            if isinstance(m.get("name"), str):
                out["name"] = m["name"]
            open_calls.pop(call_id)
            answered.add(call_id)
        elif "tool_calls" in m or "tool_call_id" in m:
            raise PanelError(f"{at}: only assistant messages carry tool_calls and only tool messages a tool_call_id")
        if m.get("truncated"):
            out["truncated"] = True
        clean.append(out)
    if need_assistant and not any(m["role"] == "assistant" for m in clean):
        raise PanelError(f"{where}: a chat row needs an assistant message: only assistant tokens are scored")
    return clean


def parse_tool_call(call, where: str) -> dict:
    if isinstance(call, list) or not isinstance(call, dict):
        raise PanelError(f"{where} must be a tool call object {{\"id\", \"type\": \"function\", \"function\"}}")
    fn = call.get("function")
    if not isinstance(call.get("id"), str) or not call["id"]:
        raise PanelError(f"{where}: a tool call needs a string 'id' (tool results name it in 'tool_call_id')")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise PanelError(f"{where}: a tool call needs 'function': {{\"name\", \"arguments\"}}")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            json.loads(args)
        except json.JSONDecodeError as e:
            raise PanelError(f"{where}: function.arguments is not JSON ({e})") from None
    elif not isinstance(args, dict):
        raise PanelError(f"{where}: function.arguments must be a JSON string or an object")
    return {"id": call["id"], "type": call.get("type", "function"), "function": {"name": fn["name"], "arguments": args}}


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
    """(line number, object) for each non-empty line; invalid JSON or bytes that are not UTF-8 are a PanelError naming
    the file and line."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise PanelError(f"{path} line {line}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}); "
                         f"a panel is UTF-8 JSON Lines") from None
    for n, line in enumerate(text.split("\n"), 1):  # not splitlines(): U+2028 or U+0085 inside a string ends no line
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
    import pyarrow.parquet as pq  # noqa: PLC0415 (parquet panels only; compare and the CLI import this module)

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
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PanelError(f"{manifest_path}: invalid JSON: {e}") from None
        if not isinstance(manifest, dict):
            raise PanelError(f"{manifest_path}: the manifest is not a JSON object")
    digest = hashlib.sha256(jsonl.read_bytes()).hexdigest()
    if manifest.get("sha256") and manifest["sha256"] != digest:
        raise PanelError(f"{jsonl}: sha256 {digest[:12]}... differs from the manifest's {manifest['sha256'][:12]}...: "
                         f"the rows changed after the manifest was written (rewrite it with `fidelity panel manifest`)")
    rows = read_jsonl(jsonl)
    return Panel(manifest.get("name", path.name), rows, digest, manifest.get("description", ""),
                 manifest.get("sources", []), path)


def load_hf_panel(
    name: str,
    *,
    split: str = "train",
    data_files=None,
    id_field: str = "id",
    domain_field: str = "domain",
    messages_field: str = "messages",
    text_field: str = "text",
    **load_kwargs,
) -> Panel:
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
    digest = hashlib.sha256(data).hexdigest()
    domains: dict[str, int] = {}
    for r in rows:
        domains[r.domain] = domains.get(r.domain, 0) + 1
    escaped = lone_surrogate_rows(rows)
    manifest = {"name": name, "description": description, "sources": sources or [], "rows": len(rows),
                "domains": domains, "sha256": digest, **({"lone_surrogate_rows": escaped} if escaped else {}),
                **(extra or {})}
    # the manifest (with the rows' sha256) goes in first: a write cut short leaves a folder that fails to load (rows
    # missing, or old rows against the new sha256), never rows that load as a panel without their manifest
    _replace(out / MANIFEST_FILE, json_bytes(manifest, indent=2)[0] + b"\n")
    _replace(out / PANEL_FILE, data)
    return Panel(name, list(rows), digest, description, sources or [], out)


def _replace(path: Path, data: bytes):
    tmp = path.with_name(path.name + ".partial")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise PanelError(f"{path}: cannot write the panel: {e}") from None


# -- tokenizing ----------------------------------------------------------------------------------------------------
def tokenize_row(row: PanelRow, tokenizer, *, max_len: int | None = None, truncate: bool = False,
                 score_reasoning: bool | None = None) -> TokenizedRow:
    """`score_reasoning`: None follows the row's own `score_reasoning` field (true unless the panel says otherwise)."""
    if row.tokens is not None:
        tokens, scored = list(row.tokens), list(row.scored)
        check_vocabulary(row, tokenizer)
    elif row.text is not None:
        check_encodable(row)
        tokens = list(tokenizer(row.text, add_special_tokens=True)["input_ids"])
        scored = [False] + [True] * (len(tokens) - 1)
    else:
        check_encodable(row)
        tokens, scored = render_chat(row, tokenizer, score_reasoning=row.score_reasoning if score_reasoning is None
                                     else score_reasoning)
    truncated, tokens_cut, scored_cut = False, 0, 0
    if max_len is not None and len(tokens) > max_len:
        if not truncate:
            raise PanelError(
                f"row {row.id!r} ({row.domain}) is {len(tokens)} tokens, longer than the model's context "
                f"of {max_len}; shorten it or pass truncate=True (--truncate) to score its first {max_len}"
            )
        tokens_cut, scored_cut = len(tokens) - max_len, sum(scored[max_len:])
        tokens, scored, truncated = tokens[:max_len], scored[:max_len], True
    out = TokenizedRow(row.id, row.domain, tokens, scored, truncated, tokens_cut, scored_cut)
    if out.n_scored == 0:
        what = ("no assistant tokens" if row.messages is not None else
                "no scored flag set" if row.tokens is not None else "a single token")
        raise PanelError(f"row {row.id!r} ({row.domain}) has no scored tokens ({what}"
                         f"{', after truncation' if truncated else ''})")
    return out


def check_encodable(row: PanelRow):
    """A text or chat row must be Unicode text: a lone surrogate (kept in the panel, escaped) is no character, and no
    tokenizer can encode it."""
    parts = [("its text", row.text)] if row.text is not None else \
        [(f"message {i}", json.dumps(m, ensure_ascii=False)) for i, m in enumerate(row.messages)] + \
        [("its tools", json.dumps(row.tools, ensure_ascii=False))]
    for what, text in parts:
        at = first_lone_surrogate(text)
        if at is not None:
            raise PanelError(f"row {row.id!r} ({row.domain}): {what} holds a lone surrogate ({text[at]!r}: half of a "
                             f"UTF-16 pair, not a character), which no tokenizer can encode; fix or drop the row")


def check_vocabulary(row: PanelRow, tokenizer):
    """A token-exact row's ids must all be ids of the pack's tokenizer (added tokens included)."""
    n = len(tokenizer)
    for t, tok in enumerate(row.tokens):
        if tok >= n:
            raise PanelError(f"row {row.id!r} ({row.domain}): tokens[{t}] = {tok} is outside the pack's vocabulary "
                             f"of {n} ids (was the row made with another tokenizer?)")


def template_reasoning_key(template: str) -> str | None:
    """The message field a chat template reads a turn's reasoning from: `reasoning_content` (Qwen3, DeepSeek-R1 and
    the OpenAI-compatible servers' spelling) or `thinking` (gpt-oss); None when it reads neither."""
    for key in ("reasoning_content", "thinking"):
        if re.search(rf"\b{key}\b", template):
            return key
    return None


def template_messages(row: PanelRow, template: str) -> list[dict]:
    """The row's messages as chat templates expect them: content as one string, tool-call arguments as objects (what
    HF templates `tojson`), reasoning under the key this template reads, tool results with their function's name."""
    key = template_reasoning_key(template)
    names, out = {}, []
    for i, m in enumerate(row.messages):
        msg = {"role": m["role"], "content": message_text(m["content"], f"row {row.id!r} message {i}")}
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                args = c["function"]["arguments"]
                calls.append({"id": c["id"], "type": "function", "function": {
                    "name": c["function"]["name"], "arguments": json.loads(args) if isinstance(args, str) else args}})
                names[c["id"]] = c["function"]["name"]
            msg["tool_calls"] = calls
        if m.get("reasoning_content"):
            if key is None:
                raise PanelError(
                    f"row {row.id!r}: message {i} has reasoning_content, but the pack's chat template reads "
                    f"no reasoning (neither 'reasoning_content' nor 'thinking'), so it cannot be rendered"
                )
            msg[key] = m["reasoning_content"]
        if m["role"] == "tool":
            msg["tool_call_id"] = m["tool_call_id"]
            msg["name"] = m.get("name") or names.get(m["tool_call_id"], "")
        out.append(msg)
    return out


def render_chat(row: PanelRow, tokenizer, *, score_reasoning: bool = True) -> tuple[list[int], list[bool]]:
    """Render with the tokenizer's chat template (the row's `tools` and template variables passed along); mark the
    tokens of each assistant turn (its reasoning, content, tool calls and end-of-turn marker; only up to the end of its
    text when the turn is marked `truncated`; never the trailing newline the template adds after it). Assistant spans
    are found by rendering growing prefixes of the conversation, which must be prefixes of the full rendering. With
    `score_reasoning=False` the reasoning text (found verbatim in the turn) is not scored; the template's markers around
    it are."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise PanelError(f"row {row.id!r}: the pack's tokenizer has no chat template, so chat rows cannot be rendered")
    if not isinstance(template, str):  # a dict of named templates: the default one renders
        template = template.get("default") or next(iter(template.values()))
    msgs = template_messages(row, template)
    extra = dict(row.template_kwargs or {})
    if row.tools:
        extra["tools"] = row.tools

    def render(m, gen):
        try:
            return tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=gen, **extra)
        except Exception as e:
            raise PanelError(f"row {row.id!r}: the chat template cannot render this conversation: "
                             f"{type(e).__name__}: {e}") from None

    return scored_rendering(row, msgs, render, tokenizer, score_reasoning=score_reasoning)


def scored_rendering(row: PanelRow, msgs: list[dict], render, tokenizer, *, score_reasoning: bool = True,
                     renderer: str = "the chat template") -> tuple[list[int], list[bool]]:
    """Tokens and scored flags of a conversation given `render(messages, add_generation_prompt) -> text` (a chat
    template, or a pack's encoder code); `msgs` are the messages as the renderer takes them, one per row message."""
    full = render(msgs, False)
    spans, unscored = [], []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        start_text = render(msgs[:i], True) if i else ""
        end_text = render(msgs[:i + 1], False)
        if not (full.startswith(start_text) and full.startswith(end_text) and end_text.startswith(start_text)):
            raise PanelError(f"row {row.id!r}: {renderer} does not render this conversation prefix by prefix, so "
                             f"assistant turn {i} cannot be located")
        start, end = len(start_text), len(end_text.rstrip())
        reasoning = (row.messages[i].get("reasoning_content") or "").strip()
        at_reasoning = end_text.find(reasoning, start) if reasoning else -1
        if reasoning and not start <= at_reasoning < end:
            raise PanelError(f"row {row.id!r}: {renderer} dropped the reasoning of assistant turn {i} "
                             f"(it is not in the rendered turn)")
        if row.messages[i].get("truncated"):  # cut short by a token limit: its text is scored, the end-of-turn is not
            if m.get("tool_calls"):
                raise PanelError(f"row {row.id!r}: assistant turn {i} is marked truncated but has tool calls; a turn "
                                 f"cut short has only text")
            content = (m["content"] or "").strip()
            at = end_text.rfind(content, start) if content else -1
            if content and at < start:
                raise PanelError(f"row {row.id!r}: assistant turn {i} is marked truncated but its text is not found "
                                 f"verbatim in the rendered conversation")
            end = at + len(content) if content else at_reasoning + len(reasoning)
        spans.append((start, end))
        if reasoning and not score_reasoning:
            unscored.append((at_reasoning, at_reasoning + len(reasoning)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    tokens = list(enc["input_ids"])
    scored = [e > s and _within(s, spans) and not _within(s, unscored) for s, e in enc["offset_mapping"]]
    if scored:
        scored[0] = False
    return tokens, scored


def _within(pos: int, spans: list[tuple[int, int]]) -> bool:
    return any(a <= pos < b for a, b in spans)


def tokenize_panel(panel: Panel, tokenizer, *, max_len: int | None = None, truncate: bool = False,
                   score_reasoning: bool | None = None) -> list[TokenizedRow]:
    return [tokenize_row(r, tokenizer, max_len=max_len, truncate=truncate, score_reasoning=score_reasoning)
            for r in panel.rows]


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
