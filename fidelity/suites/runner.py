"""Runs one suite against an OpenAI-compatible engine: items → requests (greedy by default) → scored records,
resumable."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..engine.chat_options import reply_reasoning, thinking_template_kwargs, usage_reasoning_tokens
from ..engine.client import ClientConfig, EngineClient, EngineError
from .records import (JOURNAL, MANIFEST, RECORDS, REQUESTS, ItemJournal, Record, RunError, prompt_hash, read_manifest,
                      write_manifest, write_records)


@dataclass
class Item:
    item_id: str
    prompt: str  # the user message (chat) or the raw prompt (completion)
    data: dict = field(default_factory=dict)  # what the scorer needs
    messages: list[dict] | None = None  # chat messages, when more than one user turn
    tools: list[dict] | None = None


@dataclass
class Outcome:
    extracted: str
    passed: bool | None = None
    score: float | None = None
    verdict: str = ""
    details: dict = field(default_factory=dict)
    # named metrics: name -> bool (one trial) or (followed, of) (IFEval's instructions of one prompt); summaries pool
    # them over items as sum(followed) / sum(of), the way evalplus and lm-eval aggregate
    metrics: dict = field(default_factory=dict)


def metric_counts(metrics: dict) -> dict[str, list[int]]:
    """`Outcome.metrics` as {name: [followed, of]}."""
    out = {}
    for name, v in metrics.items():
        if isinstance(v, bool):
            out[name] = [int(v), 1]
        else:
            k, n = (int(x) for x in v)
            if not 0 <= k <= n:
                raise ValueError(f"metric {name!r}: {k} of {n}")
            out[name] = [k, n]
    return out


@dataclass
class Settings:
    mode: str = "chat"  # "chat" or "completion"
    max_tokens: int | None = None  # None: the suite's default
    temperature: float = 0.0
    # both template keys (`chat_options.thinking_template_kwargs`); None: the template's default
    thinking: bool | None = None
    limit: int | None = None  # the first N items
    seed: int = 0  # the engine's sampling seed (sent with every request)
    sample: int | None = None  # a random subset of N items, drawn with `sample_seed`, kept in dataset order
    sample_seed: int = 0


def seeded_subset(items: list, n: int, seed: int) -> list:
    """`n` items drawn without replacement by Python's `random.Random(seed)` (stable across Python versions for integer
    seeds), in dataset order."""
    if not 0 < n <= len(items):
        raise RunError(f"--sample {n}: the suite has {len(items)} items")
    keep = sorted(random.Random(seed).sample(range(len(items)), n))
    return [items[i] for i in keep]


class Suite:
    """One benchmark. Subclasses set `name`, `metric` ("passed" or "score") and implement `load`, `score`."""

    name = "?"
    metric = "passed"
    default_max_tokens = 512
    modes = ("chat", "completion")
    group_by: str | None = None  # a details key grouping the items (`suite compare` tests each group too)

    def load(self) -> list[Item]:
        raise NotImplementedError

    def source(self) -> dict:
        """Where the data came from and its hash (goes into the manifest)."""
        return {}

    def config(self) -> dict:
        """Suite options that change results (go into the manifest; a resume must match them)."""
        return {}

    async def prepare(self, items: list[Item], client, settings: Settings) -> list[Item]:
        """Hook for suites that need the engine to build items (needle measures lengths with the engine's tokenizer)."""
        return items

    def stop(self, settings: Settings) -> list[str] | None:
        return None

    def score(self, item: Item, text: str, tool_calls: list) -> Outcome:
        raise NotImplementedError

    def summarize(self, records: list) -> dict:
        """Suite-specific figures over the run's records (the manifest's `summary.suite`; printed by `suite run`)."""
        return {}


def request_body(suite: Suite, item: Item, settings: Settings, model: str) -> dict:
    """The exact body sent (also stored in the record)."""
    max_tokens = settings.max_tokens or suite.default_max_tokens
    body = {"model": model, "max_tokens": max_tokens, "temperature": settings.temperature, "seed": settings.seed}
    stop = suite.stop(settings)
    if stop:
        body["stop"] = stop
    if settings.mode == "completion":
        body["prompt"] = item.prompt
        return body
    body["messages"] = item.messages or [{"role": "user", "content": item.prompt}]
    if item.tools:
        body["tools"] = item.tools
    template_kwargs = thinking_template_kwargs(settings.thinking)
    if template_kwargs:
        body["chat_template_kwargs"] = template_kwargs
    return body


async def reasoning_length(client, reply) -> dict:
    """A chat reply's reasoning length: `chars` of its reasoning text (`reasoning_content` / `reasoning`; 0 when the
    reply has none), `tokens` from the engine's usage (`completion_tokens_details.reasoning_tokens`), else the engine's
    own tokenizer on the text, else None, and `tokens_from` saying which. An engine without a reasoning parser leaves
    the reasoning inside the content: `field` is then None and the length 0 says "none separated", not "no thinking"."""
    raw = getattr(reply, "raw", None) or {}
    text = reply_reasoning(raw)
    msg = ((raw.get("choices") or [{}])[0].get("message") or {}) if isinstance(raw, dict) else {}
    field = next((k for k in ("reasoning_content", "reasoning") if isinstance(msg.get(k), str) and msg.get(k)), None)
    out = {"field": field, "chars": len(text or ""), "tokens": None, "tokens_from": None}
    n = usage_reasoning_tokens(getattr(reply, "usage", None) or {})
    if n is not None:
        out.update(tokens=n, tokens_from="usage")
    elif not text:
        out.update(tokens=0, tokens_from="no reasoning")
    elif hasattr(client, "tokenize"):
        try:
            ids = await client.tokenize(text, add_special=False)
        except EngineError:
            ids = None
        if ids is not None:
            out.update(tokens=len(ids), tokens_from="tokenize")
    return out


async def _ask(client, body: dict, tag: str):
    """Sends `body` through the client; returns (text, tool_calls as dicts, finish_reason or "", the chat reply or None
    in completion mode)."""
    common = {k: body[k] for k in ("max_tokens", "temperature", "stop", "seed") if k in body}
    if "prompt" in body:
        comp = await client.completion(body["prompt"], tag=tag, **common)
        return comp.text, [], getattr(comp, "finish_reason", None) or "", None
    extra = {"chat_template_kwargs": body["chat_template_kwargs"]} if "chat_template_kwargs" in body else None
    chat = await client.chat(body["messages"], tools=body.get("tools"), extra=extra, tag=tag, **common)
    calls = [{"name": c.name, "arguments": c.arguments} for c in chat.tool_calls]
    return chat.content or "", calls, getattr(chat, "finish_reason", None) or "", chat


def manifest_for(
    suite: Suite, settings: Settings, engine: str, model: str, items: list[Item], isolation: str | None
) -> dict:
    return {"suite": suite.name, "metric": suite.metric, "data": suite.source(), "suite_config": suite.config(),
            "engine": engine, "model": model, "settings": asdict(settings), "items": [it.item_id for it in items],
            "sandbox": isolation, "unsafe_no_sandbox": bool(isolation and isolation.startswith("UNSAFE")),
            "group_by": suite.group_by}


_RESUME_KEYS = ("suite", "data", "suite_config", "engine", "model", "settings", "items", "unsafe_no_sandbox")


def check_resume(run_dir: Path, new: dict):
    old = read_manifest(run_dir)
    # settings added since (sample, sample_seed) read as their defaults in an older run's manifest
    old = {**old, "settings": {**asdict(Settings()), **old.get("settings", {})}} if "settings" in old else old
    old = {**old, "unsafe_no_sandbox": bool(old.get("unsafe_no_sandbox"))}  # runs from before the flag were not unsafe
    for k in _RESUME_KEYS:
        if old.get(k) != new.get(k):
            raise RunError(f"the run folder holds a run with a different {k!r} ({str(old.get(k))[:120]} vs "
                           f"{str(new.get(k))[:120]}); use a fresh folder", file=run_dir / MANIFEST)


@dataclass
class RunSummary:
    run_dir: str
    items: int
    resumed: int  # items taken from the journal
    errors: int
    passed: int | None
    mean_score: float | None
    # name -> {"followed", "of", "rate"} pooled over the items without error
    metrics: dict = field(default_factory=dict)
    finish_reasons: dict = field(default_factory=dict)  # finish_reason -> items ("" where the engine gave none)
    cut_by_limit: int = 0  # items whose reply ended at the token limit (finish_reason "length")
    reasoning: dict | None = None  # `reasoning_summary` (None in completion mode)
    # `Suite.summarize`: needle's length x depth grid, toolcall's integrity, ...
    suite: dict = field(default_factory=dict)


def pooled_metrics(records: list[Record]) -> dict:
    """Each named metric pooled over the records without an engine error: sum(followed) / sum(of)."""
    sums: dict[str, list[int]] = {}
    for r in records:
        if r.error:
            continue
        for name, (k, n) in json.loads(r.metrics or "{}").items():
            acc = sums.setdefault(name, [0, 0])
            acc[0] += k
            acc[1] += n
    return {name: {"followed": k, "of": n, "rate": k / n if n else None} for name, (k, n) in sums.items()}


def record_reasoning(rec: Record) -> dict | None:
    """The reasoning length `run_suite` put in a record's details (None: completion mode, an error, or an older run)."""
    if rec.error:
        return None
    r = json.loads(rec.details or "{}").get("reasoning")
    return r if isinstance(r, dict) else None


def reasoning_summary(records: list[Record]) -> dict | None:
    """Reasoning length over the records that carry one: items, items with reasoning, mean / median / total tokens
    (over the items whose token count is known) and mean characters."""
    rs = [r for r in map(record_reasoning, records) if r is not None]
    if not rs:
        return None
    tokens = [r["tokens"] for r in rs if r.get("tokens") is not None]
    return {
        "items": len(rs),
        "with_reasoning": sum(r["chars"] > 0 for r in rs),
        "chars_mean": sum(r["chars"] for r in rs) / len(rs),
        "tokens_items": len(tokens),
        "tokens_total": sum(tokens),
        "tokens_mean": sum(tokens) / len(tokens) if tokens else None,
        "tokens_median": float(statistics.median(tokens)) if tokens else None,
        "tokens_from": dict(Counter(r.get("tokens_from") for r in rs)),
    }


def run_summary(records: list[Record], suite: Suite | None = None) -> dict:
    """What the manifest's "summary" and the console report: pooled metrics, finish reasons, replies cut by the limit,
    reasoning length, and the suite's own figures (`Suite.summarize`)."""
    reasons = Counter(r.finish_reason for r in records if not r.error)
    out = {"metrics": pooled_metrics(records), "finish_reasons": dict(sorted(reasons.items())),
           "cut_by_limit": reasons.get("length", 0), "reasoning": reasoning_summary(records)}
    extra = suite.summarize(records) if suite is not None else {}
    if extra:
        out["suite"] = extra
    return out


def failed_record(item: Item, body: dict, response: str, verdict: str, error: str, latency: float, **more) -> Record:
    """An item the engine or the scorer failed on: no pass, no score, the error excluded from the paired tests."""
    return Record(item.item_id, None, None, prompt_hash(body), json.dumps(body), response, "", verdict, error, latency,
                  **more)


async def run_suite(suite: Suite, run_dir: str | Path, *, engine: str, model: str, settings: Settings | None = None,
                    concurrency: int = 4, client=None, retry_errors: bool = True, progress=None,
                    client_options: dict | None = None) -> RunSummary:
    """Runs (or resumes) `suite` into `run_dir`. `client` defaults to an `EngineClient` with its request journal in the
    run folder (`client_options`: more `ClientConfig` fields, e.g. retries); tests pass a stand-in with the same
    `chat`/`completion` methods. Items whose engine request failed are recorded as errors, and sent again on resume when
    `retry_errors`."""
    settings = settings or Settings()
    if settings.mode not in suite.modes:
        raise RunError(f"suite {suite.name} supports modes {list(suite.modes)}, not {settings.mode!r}")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    own_client = client is None
    if own_client:
        client = EngineClient(ClientConfig(engine, model=model, concurrency=concurrency, journal=run_dir / REQUESTS,
                                           **(client_options or {})))
    try:
        items = suite.load()
        if settings.limit is not None and settings.sample is not None:
            raise RunError("give --limit (the first N items) or --sample (a seeded random N), not both")
        if settings.limit is not None:
            items = items[: settings.limit]
        if settings.sample is not None:
            items = seeded_subset(items, settings.sample, settings.sample_seed)
        items = await suite.prepare(items, client, settings)
        ids = [it.item_id for it in items]
        if len(set(ids)) != len(ids):
            raise RunError(f"suite {suite.name} produced duplicate item ids")
        manifest = manifest_for(suite, settings, engine, model, items, getattr(suite, "isolation", None))
        if (run_dir / MANIFEST).exists():
            check_resume(run_dir, manifest)
        else:
            write_manifest(run_dir, {**manifest, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        journal = ItemJournal(run_dir / JOURNAL)
        done = {k for k, r in journal.records.items() if not (retry_errors and r.error)}
        resumed = len(done & set(ids))
        todo = [it for it in items if it.item_id not in done]

        async def one(item: Item):
            body = request_body(suite, item, settings, model)
            t0 = time.monotonic()
            try:
                text, calls, finish, chat = await _ask(client, body, tag=f"{suite.name}:{item.item_id}")
            except EngineError as e:
                rec = failed_record(item, body, "", "engine error", str(e), time.monotonic() - t0)
            else:
                latency = time.monotonic() - t0
                reasoning = await reasoning_length(client, chat) if chat is not None else None
                response = text if not calls else json.dumps({"content": text, "tool_calls": calls})
                try:
                    out = await asyncio.to_thread(suite.score, item, text, calls)
                except Exception as e:  # a scorer bug must not sink the run nor count against the model
                    rec = failed_record(item, body, response, "scorer error", f"scorer error: {type(e).__name__}: {e}",
                                        latency, finish_reason=finish)
                else:
                    details = {**out.details, "reasoning": reasoning} if reasoning is not None else out.details
                    rec = Record(item.item_id, out.passed, out.score, prompt_hash(body), json.dumps(body), response,
                                 out.extracted, out.verdict, "", latency, json.dumps(details, default=str),
                                 finish_reason=finish, metrics=json.dumps(metric_counts(out.metrics)))
            journal.append(rec)
            if progress:
                progress(rec)

        await asyncio.gather(*(one(it) for it in todo))
        journal.close()
        records = [journal.records[i] for i in ids]
        write_records(run_dir / RECORDS, records)
        summary = run_summary(records, suite)
        manifest = {**read_manifest(run_dir), "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "errors": sum(bool(r.error) for r in records), "summary": summary}
        write_manifest(run_dir, manifest)
    finally:
        if own_client:
            await client.aclose()
    ok = [r for r in records if not r.error]
    passed = sum(bool(r.passed) for r in ok) if suite.metric == "passed" else None
    scores = [r.score for r in ok if r.score is not None]
    return RunSummary(str(run_dir), len(records), resumed, len(records) - len(ok), passed,
                      sum(scores) / len(scores) if scores else None, **summary)
