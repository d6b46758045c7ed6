"""Panels answered by a served model: every prompt goes to an OpenAI-compatible engine (`/v1/chat/completions`, the
native model behind vLLM, SGLang, llama.cpp...), greedy unless told otherwise, tools passed through, and the answer
(content, tool calls, reasoning) becomes the row's last assistant turn. Requests are journaled in the panel folder
(`requests.jsonl`, the engine client's journal), so an interrupted build resumes without asking again; the panel itself
is written only when every prompt is answered.

    build_panel_from_engine("prompts.jsonl", "http://127.0.0.1:8000", "dsv41", "panels/native",
                            EngineSettings(max_new_tokens=4096, thinking="on"))
"""
from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from ..engine.chat_options import thinking_template_kwargs
from ..engine.client import ClientConfig, EngineClient, EngineError
from .panel import Panel, PanelError, iter_jsonl, parse_messages, parse_row, parse_tools, write_panel

JOURNAL_FILE = "requests.jsonl"


@dataclass
class Prompt:
    id: str
    domain: str
    messages: list[dict]  # ends with a user or tool turn: the next assistant turn is the answer
    tools: list[dict] | None = None


def read_prompts(path: str | Path) -> list[Prompt]:
    """Prompt rows: {"id", "domain", "prompt"} or {"id", "domain", "messages", "tools"?} per line, the messages in
    the OpenAI chat format ending with a user turn or a tool result."""
    path = Path(path)
    out, seen = [], set()
    for n, obj in iter_jsonl(path):
        rid, domain = (obj.get("id"), obj.get("domain")) if isinstance(obj, dict) else (None, None)
        if not isinstance(rid, str) or not rid or not isinstance(domain, str) or not domain:
            raise PanelError(f"{path} line {n}: 'id' and 'domain' must be non-empty strings")
        where = f"{path} line {n} (row {rid!r})"
        if rid in seen:
            raise PanelError(f"{where}: row id {rid!r} appears twice")
        seen.add(rid)
        if isinstance(obj.get("prompt"), str):
            messages = [{"role": "user", "content": obj["prompt"]}]
        elif isinstance(obj.get("messages"), list) and obj["messages"] and isinstance(obj["messages"][-1], dict) \
                and obj["messages"][-1].get("role") in ("user", "tool"):
            messages = parse_messages(obj["messages"], where, need_assistant=False)
        else:
            raise PanelError(f"{where}: needs a string 'prompt' or 'messages' ending with a user turn or a tool result")
        out.append(Prompt(rid, domain, messages, parse_tools(obj.get("tools"), where)))
    if not out:
        raise PanelError(f"{path}: no prompts")
    return out


@dataclass
class EngineSettings:
    max_new_tokens: int = 2048
    temperature: float = 0.0  # greedy
    seed: int | None = None
    thinking: str | None = None  # "on" / "off": the chat template's thinking switch; None: the engine's default
    concurrency: int = 4
    timeout_s: float = 600.0
    retries: int = 3

    def template_kwargs(self) -> dict | None:
        """`chat_template_kwargs` for the request (`chat_options.thinking_template_kwargs`: both thinking keys)."""
        if self.thinking is None:
            return None
        if self.thinking not in ("on", "off"):
            raise PanelError(f"--thinking is 'on' or 'off', not {self.thinking!r}")
        return thinking_template_kwargs(self.thinking == "on")


def request_messages(messages: list[dict]) -> list[dict]:
    """Messages as the OpenAI API takes them: tool-call arguments as JSON text, no panel-only fields."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k != "truncated"}
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": c["function"]["arguments"]
                        if isinstance(c["function"]["arguments"], str)
                        else json.dumps(c["function"]["arguments"]),
                    },
                }
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def answer_message(prompt: Prompt, reply, where: str) -> dict:
    """The engine's answer as the row's assistant turn: content, reasoning, tool calls; `truncated` when the engine
    stopped at the token limit."""
    raw = ((reply.raw.get("choices") or [{}])[0].get("message") or {})
    reasoning = raw.get("reasoning_content") or raw.get("reasoning")
    msg = {"role": "assistant", "content": reply.content if reply.content is not None else ""}
    if isinstance(reasoning, str) and reasoning:
        msg["reasoning_content"] = reasoning
    if reply.tool_calls:
        msg["tool_calls"] = [
            {
                "id": c.id or f"{prompt.id}-call{j}",
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for j, c in enumerate(reply.tool_calls)
        ]
    if not (msg["content"] or msg.get("tool_calls") or msg.get("reasoning_content")):
        raise PanelError(f"{where}: the engine answered with nothing (finish_reason {reply.finish_reason!r})")
    if reply.finish_reason == "length":
        if msg.get("tool_calls"):
            raise PanelError(
                f"{where}: the engine stopped at the token limit inside a tool call; raise --max-new-tokens"
            )
        msg["truncated"] = True
    return msg


async def _answer_all(prompts: list[Prompt], url: str, model: str, settings: EngineSettings, journal: Path,
                      progress: bool):
    from tqdm.auto import tqdm  # noqa: PLC0415 (CLI startup: panel's parser imports this module)

    cfg = ClientConfig(url, model=model, concurrency=settings.concurrency, timeout_s=settings.timeout_s,
                       retries=settings.retries, journal=journal)
    extra = {"chat_template_kwargs": settings.template_kwargs()} if settings.thinking else None
    bar = tqdm(total=len(prompts), desc="answering", unit="prompt", disable=not progress)
    async with EngineClient(cfg) as client:
        async def one(p: Prompt):
            try:
                reply = await client.chat(
                    request_messages(p.messages),
                    tools=p.tools,
                    max_tokens=settings.max_new_tokens,
                    temperature=settings.temperature,
                    seed=settings.seed,
                    extra=extra,
                    tag=f"panel:{p.id}",
                )
            except EngineError as e:
                raise PanelError(f"row {p.id!r} ({p.domain}): the engine failed: {e}; the answers so far are kept in "
                                 f"{journal} and a rerun of the same command resumes from them") from None
            bar.update(1)
            return reply

        tasks = [asyncio.ensure_future(one(p)) for p in prompts]
        try:
            replies = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            bar.close()
        return replies, client.stats


def build_panel_from_engine(prompts: str | Path, url: str, model: str, out: str | Path,
                            settings: EngineSettings | None = None, *, name: str | None = None, description: str = "",
                            license: str = "CC0-1.0", score_reasoning: bool = True, progress: bool = True) -> Panel:
    settings = settings or EngineSettings()
    settings.template_kwargs()  # refuses a bad --thinking before anything is sent
    items = read_prompts(prompts)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    journal = out / JOURNAL_FILE
    replies, stats = asyncio.run(_answer_all(items, url, model, settings, journal, progress))
    rows, reasons, served = [], Counter(), set()
    for p, reply in zip(items, replies):
        where = f"row {p.id!r} ({p.domain})"
        answer = answer_message(p, reply, where)
        reasons[str(reply.finish_reason)] += 1
        served.add(reply.raw.get("model"))
        obj = {
            "id": p.id,
            "domain": p.domain,
            "messages": p.messages + [answer],
            **({"tools": p.tools} if p.tools else {}),
            **({"chat_template_kwargs": settings.template_kwargs()} if settings.thinking else {}),
            **({} if score_reasoning else {"score_reasoning": False}),
        }
        rows.append(parse_row(obj, f"answer of {where}"))
    truncated = sum(1 for r in rows if r.messages[-1].get("truncated"))
    answers = {"engine": url, "model": model, "served_model": sorted(m for m in served if m),
               "settings": asdict(settings), "finish_reasons": dict(reasons), "truncated_rows": truncated,
               "requests": {"sent": stats.sent, "from_journal": stats.journal_hits, "journal": JOURNAL_FILE}}
    sources = [
        {"part": "prompts", "source": Path(prompts).name, "license": license},
        {
            "part": "answers",
            "source": f"answers of {model} served at {url} "
            f"({'greedy' if settings.temperature == 0 else f'temperature {settings.temperature:g}'}, "
            f"max {settings.max_new_tokens} new tokens, thinking {settings.thinking or 'engine default'})",
            "license": "model output",
        },
    ]
    return write_panel(out, rows, name=name or out.name, description=description, sources=sources,
                       extra={"answers": answers})
