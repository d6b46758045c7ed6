"""Chat rows rendered by a pack's own encoder code into token-exact rows.

Some packs' chat format is code, not a template: DeepSeek V3.2 / V4 / V4.1 ship `encoding/encoding_*.py` with
`encode_messages(messages, thinking_mode, ...) -> str` (the DSML wire text their servers use). `encode_panel` imports
that module from the pack folder and renders each conversation with it, locating the assistant turns prefix by prefix
as `render_chat` does, and writes the result as token-exact rows, which any later `compare` scores without running
the pack's code again. Importing the module runs the pack's Python, so it happens only with `trust_pack_code=True`
(`--trust-pack-code`).

Messages go to the encoder in OpenAI's chat format: content as one string, tool-call arguments as JSON text, the row's
`tools` on the (first) system message, where DeepSeek's encoders read them.
"""
from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import sys
from pathlib import Path

from .panel import (Panel, PanelError, PanelRow, load_panel, message_text, scored_rendering, tokenizer_fingerprint,
                     write_panel)


def find_encoder(pack_dir: str | Path, *, trust_pack_code: bool = False):
    """(encode_messages, the file it came from) of the pack's `encoding/*.py`."""
    folder = Path(pack_dir).expanduser() / "encoding"
    files = sorted(folder.glob("*.py")) if folder.is_dir() else []
    if not files:
        raise PanelError(
            f"{Path(pack_dir)}: no encoding/*.py in the pack folder (its chat format is its chat template)"
        )
    if not trust_pack_code:
        raise PanelError(f"{folder}: rendering through {', '.join(f.name for f in files)} runs the pack's own Python "
                         f"code; pass --trust-pack-code (trust_pack_code=True) if you trust this pack")
    sys.path.insert(0, str(folder))  # an encoder may import its sibling files
    try:
        for f in files:
            name = f"fidelity_pack_encoding_{hashlib.sha256(str(f.resolve()).encode()).hexdigest()[:12]}_{f.stem}"
            spec = importlib.util.spec_from_file_location(name, f)
            module = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(module)
            except Exception as e:
                raise PanelError(f"{f}: the pack's encoder failed to import: {type(e).__name__}: {e}") from None
            if callable(getattr(module, "encode_messages", None)):
                return module.encode_messages, f
    finally:
        sys.path.remove(str(folder))
    raise PanelError(f"{folder}: none of {', '.join(f.name for f in files)} defines encode_messages(messages, ...)")


def encoder_messages(row: PanelRow) -> list[dict]:
    out = []
    for i, m in enumerate(row.messages):
        msg = {"role": m["role"], "content": message_text(m["content"], f"row {row.id!r} message {i}")}
        if m.get("reasoning_content"):
            msg["reasoning_content"] = m["reasoning_content"]
        if m.get("tool_calls"):
            msg["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                "name": c["function"]["name"], "arguments": c["function"]["arguments"]
                if isinstance(c["function"]["arguments"], str) else json.dumps(c["function"]["arguments"])}}
                for c in m["tool_calls"]]
        if m["role"] == "tool":
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    if row.tools:  # encode_row gives a row with tools a system message first
        out[0]["tools"] = row.tools
    return out


def encode_row(row: PanelRow, encode, tokenizer, *, encoder_kwargs: dict | None = None,
               score_reasoning: bool = True) -> PanelRow:
    """The chat row as a token-exact row: rendered by `encode(messages, **kwargs)`, assistant turns scored."""
    kwargs = dict(encoder_kwargs or {})
    params = inspect.signature(encode).parameters
    if "thinking_mode" in params and "thinking_mode" not in kwargs:
        kwargs["thinking_mode"] = "thinking" if any(m.get("reasoning_content") for m in row.messages) else "chat"
    if row.tools and row.messages[0]["role"] != "system":  # the tools travel on a system message: an empty one
        row = PanelRow(row.id, row.domain, messages=[{"role": "system", "content": ""}] + row.messages, tools=row.tools)
    msgs = encoder_messages(row)

    def render(m, gen):
        if not m:
            return ""
        try:
            return encode(m, **kwargs)
        except Exception as e:
            raise PanelError(f"row {row.id!r}: the pack's encoder cannot render this conversation: "
                             f"{type(e).__name__}: {e}") from None

    tokens, scored = scored_rendering(row, msgs, render, tokenizer, score_reasoning=score_reasoning,
                                      renderer="the pack's encoder")
    return PanelRow(row.id, row.domain, tokens=tokens, scored=scored)


def encode_panel(panel, pack, out: str | Path, *, trust_pack_code: bool = False, encoder_kwargs: dict | None = None,
                 score_reasoning: bool = True, tokenizer=None, name: str | None = None) -> Panel:
    """Every chat row of `panel` as a token-exact row rendered by `pack`'s encoder; text and token rows unchanged."""
    pack_dir = Path(getattr(pack, "path", pack))
    encode, source = find_encoder(pack_dir, trust_pack_code=trust_pack_code)
    if tokenizer is None:
        # the packs load torch: only without a tokenizer
        from ..packs.tokenizer import tokenizer_of  # noqa: PLC0415 (torch)

        tokenizer = tokenizer_of(pack)
    panel = panel if isinstance(panel, Panel) else load_panel(panel)
    rows = [encode_row(r, encode, tokenizer, encoder_kwargs=encoder_kwargs,
                       score_reasoning=score_reasoning and r.score_reasoning) if r.messages is not None else r
            for r in panel.rows]
    encoded = {"encoder": f"encoding/{source.name}", "encoder_sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
               "encoder_kwargs": encoder_kwargs or {}, "tokenizer": tokenizer_fingerprint(tokenizer),
               "from_panel": {"name": panel.name, "sha256": panel.sha256}, "score_reasoning": score_reasoning}
    return write_panel(out, rows, name=name or Path(out).name, description=panel.description,
                       sources=panel.sources, extra={"encoded": encoded})
