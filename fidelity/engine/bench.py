"""Serving speed of an OpenAI-compatible engine: decode tok/s per prompt set, aggregate tok/s per concurrency level,
TTFT, cold prefill tok/s per prompt length, and (A/A mode) the run-to-run spread that any speed verdict must exceed.

    doc = asyncio.run(run_bench(BenchConfig(url, model="m", streams=[1, 2, 4], prefill=[3000], repeats=3)))
    doc["metrics"]["decode.all"]["median"]          # tok/s; every metric has median/min/max/spread_pct/values

Every request is streamed (`"stream": true`) and each content chunk's arrival time is kept:

- decode tok/s of one request = (tokens - 1) / (last token time - first token time): the time to the first token
  (queueing and prefill) is left out. Per set and repeat the rate is pooled (all the set's tokens over all its decode
  time); the metric is the median over repeats with the spread `spread_pct` = 100 (max - min) / (2 median), i.e. "± x
  %".
- aggregate tok/s at N streams = all tokens of N concurrent requests / (last token of any - first send). Each level
  records whether its requests were really in flight together (`overlap`: the last one was sent before the first one
  finished, `max_in_flight`). TTFT mean / p50 / p90 come over all requests of a level.
- cold prefill tok/s at length L = prompt tokens / TTFT of a `/v1/completions` request with max_tokens=1 whose prompt
  starts with a fresh random nonce, so no prefix cache can hold any of it but the BOS. The defeat is checked three ways:
  the engine's own cached-token count where it reports one (vLLM/OpenAI `usage.prompt_tokens_details.cached_tokens`,
  llama.cpp's `timings.cache_n`) must be ~0; each repeat's second cold request must not be faster than its first beyond
  the spread; and a warm repeat of the same prompt is timed for contrast (`warm_over_cold`: an engine with a prefix
  cache answers it much faster).
- token counts: what we saw arrive (content chunks) against the engine's `usage` (asked for with
  `stream_options.include_usage`) and, after timing, the engine's tokenizer over the returned text; mismatches are
  reported (`usage_check`), rates use the chunks we saw.
- generation length is fixed (`max_tokens`) and `ignore_eos` is sent (llama.cpp's server, vLLM and SGLang honour it;
  llama-cpp-python ignores it: `suppress_ids` sends `logit_bias` -100 for the given ids, e.g. the EOS); where the engine
  stops early anyway the number of such requests is reported under `eos`.
- one warm-up request (not measured) precedes the measurements; `aa=True` runs the whole bench twice and reports per
  metric the relative difference between the two runs (`aa.spread_pct`, at least the within-run spread).

Faults: a request whose connection fails, stalls (no byte for `stall_s`), answers 5xx/429, or whose stream ends before
`[DONE]` is retried at most `retries` times with backoff and then recorded in `errors`; `timeout_s` bounds the request
in all, its retries and backoff included. Metrics come from the requests that finished, and a metric with none is null.
Nothing waits without a bound.

Why our client and not guidellm (checked 2026-12-01): guidellm 0.8.1 resolves from PyPI here but pulls transformers
5.24, datasets 5.x, sanic and uvloop into the environment (transformers and datasets are pinned for the rest of
fidelity); and its profiles (synchronous, concurrent, sweep) measure TTFT, inter-token latency and output throughput of
synthetic prompts, but not a cold prefill whose cache defeat is checked against the engine's own cached-token counts,
nor our token-count cross-check, nor the A/A spread the speed gate and the ladder decide against. What we need from a
load generator is an SSE reader with timestamps, which httpx gives in a few lines.
"""
from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import math
import os
import random
import secrets
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np

from ..errors import ConfigError, FidelityError
from .client import ClientConfig, EngineClient, cached_prompt_tokens
from .gates.kinds import GateCall, gate_kind, run_gate
from .gates.settings import Check, GateResult
from .spawn import group_members
from .vllm import facts_from_metrics, mem_available_bytes, parse_prometheus, processes_pss_bytes

SETS = ("code", "prose", "structured")
CACHE_HIT_GAIN_PCT = 50.0  # the second of two cold prefills this much faster than the first reads as a prefix-cache hit


def load_prompts() -> dict:
    """The shipped prompt sets (package data, written for this project; provenance in the file)."""
    return json.loads(resources.files("fidelity.engine").joinpath("data/bench_prompts.json").read_text("utf-8"))


def read_prompt_sets(path) -> dict[str, list[str]]:
    """A user's prompt sets (`bench --prompts FILE`): JSON lines {"set": name, "prompt": text}, one prompt each, in
    order. A line that is not such an object is refused, naming the file and the line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the prompt sets ({e})") from None
    sets: dict[str, list[str]] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{path} line {n}: not JSON ({e})") from None
        if not (isinstance(item, dict) and isinstance(item.get("set"), str) and item["set"].strip()
                and isinstance(item.get("prompt"), str) and item["prompt"].strip()):
            raise ConfigError(f'{path} line {n}: expected {{"set": name, "prompt": text}} with both non-empty')
        if item["set"] in SETS:
            raise ConfigError(f"{path} line {n}: set {item['set']!r} is a built-in set's name; name yours otherwise")
        sets.setdefault(item["set"], []).append(item["prompt"])
    if not sets:
        raise ConfigError(f"{path}: no prompts")
    return sets


def parse_length(text: str) -> int:
    """'3k' -> 3000, '12K' -> 12000, '512' -> 512 (prompt tokens)."""
    t = text.strip().lower()
    try:
        n = int(float(t[:-1]) * 1000) if t.endswith("k") else int(t)
    except ValueError:
        raise ConfigError(f"prefill length {text!r} is not a number of tokens (e.g. 512, 3k)")
    if n < 1:
        raise ConfigError(f"prefill length {text!r} must be at least one token")
    return n


@dataclass
class BenchConfig:
    url: str
    model: str
    sets: list[str] = field(default_factory=lambda: list(SETS))
    custom_sets: dict = field(default_factory=dict)   # name -> prompts (`--prompts FILE`), measured beside `sets`
    streams: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    prefill: list[int] = field(default_factory=lambda: [3000, 12000])
    repeats: int = 3
    max_tokens: int = 384
    prompts_per_set: int | None = None  # None: all of the set's prompts
    ignore_eos: bool = True
    # token ids pushed down by logit_bias -100 (EOS, where ignore_eos is not honoured)
    suppress_ids: list[int] = field(default_factory=list)
    warmup: int = 1
    aa: bool = False
    timeout_s: float = 600.0  # a whole request: every attempt and backoff
    stall_s: float = 60.0  # no byte for this long: the request is abandoned (and retried)
    retries: int = 2
    backoff_s: float = 0.5
    seed: int | None = None  # nonces and prompt order; None: fresh
    # a local engine's process: its process group's memory goes into `serving`; not a setting
    server_pid: int | None = None
    progress: object = None  # callable(str) told each phase as it starts (the CLI prints to stderr); not a setting

    def check(self):
        bad = [s for s in self.sets if s not in SETS]
        if bad:
            raise ConfigError(f"unknown prompt set(s) {bad} (known: {', '.join(SETS)})")
        if not self.sets and not self.custom_sets and not self.streams and not self.prefill:
            raise ConfigError("nothing to measure: no sets, streams or prefill lengths")
        if any(n < 1 for n in self.streams):
            raise ConfigError(f"--streams must be positive, got {self.streams}")
        if self.repeats < 1 or self.max_tokens < 2:
            raise ConfigError("repeats must be >= 1 and max_tokens >= 2 (a decode rate needs two tokens)")

    def settings(self) -> dict:
        """What a speed baseline must match to be compared (the gate re-runs with these)."""
        d = asdict(self)
        for k in (
            "url",
            "model",
            "aa",
            "seed",
            "timeout_s",
            "stall_s",
            "retries",
            "backoff_s",
            "progress",
            "server_pid",
        ):
            d.pop(k)
        # a user's sets by content: a baseline measured on other prompts under the same names does not match
        d["custom_sets"] = {name: hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]
                            for name, prompts in self.custom_sets.items()}
        return d


@dataclass
class Sample:
    """One streamed request. Times are seconds on the monotonic clock."""

    tag: str
    t_send: float = 0.0
    token_times: list[float] = field(default_factory=list)
    t_end: float = 0.0
    text: str = ""
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)  # llama.cpp server's own timings, where sent
    attempts: int = 0
    error: str | None = None
    prompt_tokens: int | None = None  # our count (the engine's tokenizer over the prompt), prefill requests

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.t_send if self.token_times else None

    @property
    def decode_span(self) -> float:
        return self.token_times[-1] - self.token_times[0] if len(self.token_times) > 1 else 0.0

    def cached_tokens(self) -> int | None:
        return cached_prompt_tokens(self.usage, self.timings)


class StreamError(Exception):
    def __init__(self, message: str, retryable: bool = True):
        super().__init__(message)
        self.retryable = retryable


class Streamer:
    """Streams requests with per-chunk arrival times; bounded retries, bounded waits."""

    def __init__(self, cfg: BenchConfig, max_streams: int):
        self.cfg = cfg
        base = cfg.url.rstrip("/")
        self.base = base[:-3] if base.endswith("/v1") else base
        self.http = httpx.AsyncClient(base_url=self.base, limits=httpx.Limits(max_connections=max_streams + 2),
                                      timeout=httpx.Timeout(cfg.stall_s, connect=min(10.0, cfg.stall_s)))
        self.sent = self.retried = 0

    async def aclose(self):
        await self.http.aclose()

    async def request(self, path: str, body: dict, tag: str) -> Sample:
        """The request with its retries, all within `timeout_s` of the first send: a stream that never stalls for
        `stall_s` but never ends (a byte every few seconds) is cut there, and no retry starts after it."""
        s = Sample(tag)
        deadline = time.monotonic() + self.cfg.timeout_s
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                delay = self.cfg.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random() / 2)
                if time.monotonic() + delay >= deadline:
                    break
                self.retried += 1
                await asyncio.sleep(delay)
            s = Sample(tag, attempts=attempt + 1)
            self.sent += 1
            try:
                await asyncio.wait_for(self._stream(path, body, s), deadline - time.monotonic())
                return s
            except asyncio.TimeoutError:
                s.error = (f"no complete answer within {self.cfg.timeout_s:g} s (the request's deadline, retries "
                           f"included)")
            except httpx.TimeoutException as e:
                s.error = f"stalled: no byte for {self.cfg.stall_s:g} s ({type(e).__name__})"
            except httpx.TransportError as e:
                s.error = f"connection error: {type(e).__name__}: {e}"
            except StreamError as e:
                s.error = str(e)
                if not e.retryable:
                    break
        s.error = f"{path} {tag}: gave up after {s.attempts} attempt(s); last: {s.error}"
        return s

    async def _stream(self, path: str, body: dict, s: Sample):
        s.t_send = time.monotonic()
        async with self.http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace")[:300]
                raise StreamError(
                    f"HTTP {r.status_code}: {text}", retryable=r.status_code >= 500 or r.status_code == 429
                )
            done = False
            async for line in r.aiter_lines():
                now = time.monotonic()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    raise StreamError(f"stream chunk is not JSON: {data[:120]!r}")
                if chunk.get("usage"):
                    s.usage = chunk["usage"]
                if isinstance(chunk.get("timings"), dict):
                    s.timings = chunk["timings"]
                for ch in chunk.get("choices") or []:
                    piece = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                    if piece:
                        s.token_times.append(now)
                        s.text += piece
                    if ch.get("finish_reason"):
                        s.finish_reason = ch["finish_reason"]
            if not done:
                raise StreamError(f"stream ended before [DONE] after {s.tokens} token chunks")
            if s.finish_reason is None:  # llama-cpp-python cuts a stream this way when another request arrives
                raise StreamError(
                    f"stream ended ([DONE]) without a finish_reason after {s.tokens} token chunks: the engine "
                    f"cut it (llama-cpp-python: start it with --interrupt_requests false)",
                    retryable=False,
                )
        s.t_end = time.monotonic()
        if not s.token_times:
            raise StreamError("stream finished without any token", retryable=False)


# ---- statistics ------------------------------------------------------------------------------------------------------

def summary(values: list[float], unit: str) -> dict:
    v = [x for x in values if x is not None and math.isfinite(x)]
    if not v:
        return {"median": None, "min": None, "max": None, "spread_pct": None, "values": [], "unit": unit}
    med = float(np.median(v))
    return {"median": med, "min": float(min(v)), "max": float(max(v)),
            "spread_pct": 100.0 * (max(v) - min(v)) / (2 * med) if med > 0 else None, "values": [float(x) for x in v],
            "unit": unit}


def pooled_decode_rate(samples: list[Sample]) -> float | None:
    """All tokens after each request's first over all decode time (TTFT excluded)."""
    ok = [s for s in samples if s.ok and s.tokens > 1]
    span = sum(s.decode_span for s in ok)
    return sum(s.tokens - 1 for s in ok) / span if span > 0 else None


def prefill_rate(s: Sample) -> float | None:
    """Prompt tokens (ours, else the engine's usage) over TTFT; None for a failed request or one without either."""
    tokens = s.prompt_tokens or s.usage.get("prompt_tokens")
    return tokens / s.ttft if s.ok and s.ttft and tokens else None


def ttft_stats(samples: list[Sample]) -> dict:
    t = [s.ttft for s in samples if s.ok and s.ttft is not None]
    if not t:
        return {"mean": None, "p50": None, "p90": None, "n": 0}
    return {
        "mean": float(np.mean(t)),
        "p50": float(np.percentile(t, 50)),
        "p90": float(np.percentile(t, 90)),
        "n": len(t),
    }


def intervals(samples: list[Sample]) -> list[list[float]]:
    """[send, end] of each finished request, seconds from the first send."""
    ok = [s for s in samples if s.ok]
    t0 = min((s.t_send for s in ok), default=0.0)
    return [[round(s.t_send - t0, 6), round(s.t_end - t0, 6)] for s in ok]


def max_in_flight(samples: list[Sample]) -> int:
    events = sorted([(s.t_send, 1) for s in samples if s.ok] + [(s.t_end, -1) for s in samples if s.ok],
                    key=lambda e: (e[0], e[1]))
    now = best = 0
    for _, d in events:
        now += d
        best = max(best, now)
    return best


# ---- the bench -------------------------------------------------------------------------------------------------------

class Bench:
    def __init__(self, cfg: BenchConfig):
        cfg.check()
        self.cfg = cfg
        self.rng = random.Random(cfg.seed if cfg.seed is not None else secrets.randbits(64))
        data = load_prompts()
        self.prompts = {k: data["sets"][k][: cfg.prompts_per_set or None] for k in cfg.sets}
        self.prompts.update({k: list(v)[: cfg.prompts_per_set or None] for k, v in cfg.custom_sets.items()})
        self.filler = data["filler"]
        self.samples: list[Sample] = []
        self.counter = 0

    def chat_body(self, prompt: str) -> dict:
        body = {
            "model": self.cfg.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.cfg.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.cfg.ignore_eos:
            body["ignore_eos"] = True
        if self.cfg.suppress_ids:
            body["logit_bias"] = {str(i): -100 for i in self.cfg.suppress_ids}
        return body

    async def chat(self, st: Streamer, prompt: str, kind: str) -> Sample:
        self.counter += 1
        s = await st.request("/v1/chat/completions", self.chat_body(prompt), f"{kind}#{self.counter}")
        self.samples.append(s)
        return s

    async def decode(self, st: Streamer, repeat: int) -> dict:
        out = {}
        for name, prompts in self.prompts.items():
            got = [await self.chat(st, p, f"decode:{name}:r{repeat}") for p in prompts]
            out[name] = got
        return out

    async def level(self, st: Streamer, n: int, repeat: int) -> list[Sample]:
        pool = [p for ps in self.prompts.values() for p in ps] or [self.filler[:400]]
        start = self.rng.randrange(len(pool))
        batch = [pool[(start + i) % len(pool)] for i in range(n)]
        return list(await asyncio.gather(*(self.chat(st, p, f"streams:{n}:r{repeat}") for p in batch)))

    async def prefill_prompt(self, client: EngineClient, length: int) -> tuple[str, int | None]:
        """A prompt of about `length` tokens (the engine's tokenizer; the filler text repeated) starting with a fresh
        nonce."""
        nonce = f"[{self.rng.getrandbits(64):016x}] "
        text = nonce + (self.filler + " ") * 2
        ids = await client.tokenize(text)
        if ids is None:  # no tokenizer endpoint: about four characters a token
            reps = max(1, math.ceil(4 * length / len(self.filler)))
            return (nonce + (self.filler + " ") * reps)[: 4 * length], None
        per_char = len(ids) / len(text)
        text = nonce + (self.filler + " ") * max(1, math.ceil(length / per_char / len(self.filler)) + 1)
        for _ in range(3):
            text = text[: max(len(nonce) + 1, int(len(text) * length / max(1, len(ids))))]
            ids = await client.tokenize(text)
            if abs(len(ids) - length) <= max(2, length // 100):
                break
            if len(ids) < length:
                text = text + " " + self.filler
        return text, len(ids)

    async def prefill(self, st: Streamer, client: EngineClient, length: int, repeat: int) -> dict:
        cold = []
        for k in range(2):  # two cold requests: the second must not be faster beyond the spread
            prompt, n = await self.prefill_prompt(client, length)
            body = {"model": self.cfg.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}}
            s = await st.request("/v1/completions", body, f"prefill:{length}:r{repeat}:cold{k}")
            s.prompt_tokens = n
            self.samples.append(s)
            cold.append(s)
        warm = await st.request("/v1/completions", body, f"prefill:{length}:r{repeat}:warm")
        warm.prompt_tokens = n
        self.samples.append(warm)
        return {"cold": cold, "warm": warm}

    async def run_once(self) -> dict:
        cfg = self.cfg
        t0 = time.time()
        st = Streamer(cfg, max(cfg.streams or [1]))
        client = EngineClient(ClientConfig(cfg.url, model=cfg.model, concurrency=2, timeout_s=cfg.timeout_s,
                                           stall_s=cfg.stall_s, retries=cfg.retries))
        try:
            warm_prompt = next((p for ps in self.prompts.values() for p in ps), self.filler[:400])
            warmups = [await self.chat(st, warm_prompt, "warmup") for _ in range(cfg.warmup)]
            decode, levels, prefill = [], {n: [] for n in cfg.streams}, {n: [] for n in cfg.prefill}
            say = cfg.progress or (lambda text: None)
            for r in range(cfg.repeats):
                if self.prompts:
                    say(f"repeat {r + 1}/{cfg.repeats}: single-stream decode, sets {', '.join(self.prompts)}")
                    decode.append(await self.decode(st, r))
                for n in cfg.streams:
                    say(f"repeat {r + 1}/{cfg.repeats}: {n} concurrent streams")
                    levels[n].append(await self.level(st, n, r))
                for n in cfg.prefill:
                    say(f"repeat {r + 1}/{cfg.repeats}: cold prefill of {n} tokens")
                    prefill[n].append(await self.prefill(st, client, n, r))
            usage = await self.usage_check(client, [s for s in self.samples if s not in warmups])
        finally:
            await st.aclose()
            await client.aclose()
        return self.document(decode, levels, prefill, usage, warmups, st, started=t0)

    async def usage_check(self, client: EngineClient, samples: list[Sample]) -> dict:
        """Our token counts against the engine's usage and against its tokenizer over the returned text."""
        gen = [s for s in samples if s.ok and not s.tag.startswith("prefill")]
        engine_diff = [
            s.usage["completion_tokens"] - s.tokens for s in gen if s.usage.get("completion_tokens") is not None
        ]
        retok = []
        for s in gen[:8]:  # a few suffice to see whether one chunk is one token
            try:
                ids = await client.tokenize(s.text, add_special=False)
            except Exception:
                ids = None
            if ids is None:
                break
            retok.append(len(ids) - s.tokens)
        pre = [s for s in samples if s.ok and s.tag.startswith("prefill") and s.prompt_tokens is not None]
        prompt_diff = [
            s.usage["prompt_tokens"] - s.prompt_tokens for s in pre if s.usage.get("prompt_tokens") is not None
        ]
        notes = []
        if not engine_diff:
            notes.append("the engine reported no usage in its streams (stream_options.include_usage ignored)")
        elif any(abs(d) > 1 for d in engine_diff):
            notes.append(
                f"the engine counts other token numbers than the chunks we saw in "
                f"{sum(abs(d) > 1 for d in engine_diff)} "
                f"of {len(engine_diff)} requests (max difference {max(engine_diff, key=abs)}): chunks may carry "
                f"several tokens, rates use the chunks"
            )
        return {"requests_with_usage": len(engine_diff), "completion_minus_chunks": engine_diff[:50],
                "completion_mismatches": sum(abs(d) > 1 for d in engine_diff),
                "retokenized_minus_chunks": retok, "prompt_usage_minus_ours": prompt_diff[:50],
                "prompt_mismatches": sum(abs(d) > 1 for d in prompt_diff), "notes": notes}

    def document(self, decode, levels, prefill, usage, warmups, st: Streamer, started: float) -> dict:
        cfg = self.cfg
        metrics: dict[str, dict] = {}
        per_set = {}
        for name in self.prompts:
            rates = [pooled_decode_rate(rep[name]) for rep in decode]
            metrics[f"decode.{name}"] = summary(rates, "tok/s")
            per_set[name] = {"requests": sum(len(rep[name]) for rep in decode),
                             "tokens": [sum(s.tokens for s in rep[name] if s.ok) for rep in decode]}
        if decode:
            metrics["decode.all"] = summary(
                [pooled_decode_rate([s for v in rep.values() for s in v]) for rep in decode], "tok/s"
            )
        level_doc = {}
        for n, reps in levels.items():
            agg, overlap, inflight = [], [], []
            for batch in reps:
                ok = [s for s in batch if s.ok]
                if ok and len(ok) == len(batch):
                    agg.append(sum(s.tokens for s in ok) / (max(s.t_end for s in ok) - min(s.t_send for s in ok)))
                    overlap.append(max(s.t_send for s in ok) < min(s.t_end for s in ok))
                    inflight.append(max_in_flight(ok))
            metrics[f"aggregate.{n}"] = summary(agg, "tok/s")
            all_s = [s for b in reps for s in b]
            t = ttft_stats(all_s)
            metrics[f"ttft_mean.{n}"] = summary([ttft_stats(b)["mean"] for b in reps], "s")
            level_doc[str(n)] = {
                "ttft": t,
                "overlap": overlap,
                "max_in_flight": inflight,
                "per_stream_decode": pooled_decode_rate(all_s),
                "intervals": [intervals(b) for b in reps],
            }
        prefill_doc = {}
        for n, reps in prefill.items():
            first, second, warm, cached, lengths = [], [], [], [], []
            for rep in reps:
                c0, c1 = rep["cold"]
                first.append(prefill_rate(c0))
                second.append(prefill_rate(c1))
                warm.append(prefill_rate(rep["warm"]))
                cached += [s.cached_tokens() for s in rep["cold"] if s.ok and s.cached_tokens() is not None]
                lengths += [s.prompt_tokens or s.usage.get("prompt_tokens") for s in rep["cold"] if s.ok]
            cold = summary([x for pair in zip(first, second) for x in pair], "tok/s")
            metrics[f"prefill.{n}"] = cold
            pairs = [(a, b) for a, b in zip(first, second) if a and b]
            second_gain = float(np.median([100.0 * (b / a - 1) for a, b in pairs])) if pairs else None
            spread = cold["spread_pct"] or 0.0
            prompt_len = float(np.median([x for x in lengths if x])) if any(lengths) else None
            # a prefix-cache hit makes the second cold several times faster (see warm_over_cold); timing noise on a
            # busy machine reaches tens of percent, so only a gain beyond both the spread and CACHE_HIT_GAIN_PCT
            # counts as a hit
            cache_ok = (second_gain is None or second_gain <= max(spread, CACHE_HIT_GAIN_PCT)) and \
                       all(c <= max(4, 0.01 * (prompt_len or 0)) for c in cached)
            warm_med = summary(warm, "tok/s")["median"]
            prefill_doc[str(n)] = {"prompt_tokens": prompt_len, "second_cold_gain_pct": second_gain,
                                   "engine_cached_tokens": cached, "warm_tok_s": warm_med,
                                   "warm_over_cold": warm_med / cold["median"] if warm_med and cold["median"] else None,
                                   "cache_defeated": cache_ok}
        measured = [s for s in self.samples if s not in warmups]
        gen = [s for s in measured if s.ok and not s.tag.startswith("prefill")]
        early = [s.tag for s in gen if s.tokens < cfg.max_tokens and s.finish_reason != "length"]
        errors = [{"tag": s.tag, "error": s.error, "attempts": s.attempts} for s in measured if not s.ok]
        return {
            "kind": "fidelity-bench",
            "version": 1,
            "engine": cfg.url,
            "model": cfg.model,
            "settings": cfg.settings(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "seconds": round(time.time() - started, 3),
            "metrics": metrics,
            "decode": per_set,
            "streams": level_doc,
            "prefill": prefill_doc,
            "usage_check": usage,
            "eos": {
                "ignore_eos_sent": cfg.ignore_eos,
                "stopped_early": len(early),
                "of": len(gen),
                "tags": early[:20],
                "tokens_min": min((s.tokens for s in gen), default=None),
            },
            "warmup": [{"tag": s.tag, "ok": s.ok, "tokens": s.tokens} for s in warmups],
            "errors": errors,
            "requests": {"sent": st.sent, "retries": st.retried, "failed": len(errors)},
        }


def aa_spread(a: dict, b: dict) -> dict:
    """Per metric: 100 |b - a| / a between two runs of the same build, at least each run's own repeat spread."""
    out = {}
    for k, ma in a["metrics"].items():
        mb = b["metrics"].get(k) or {}
        if ma.get("median") and mb.get("median"):
            out[k] = max(
                100.0 * abs(mb["median"] / ma["median"] - 1), ma.get("spread_pct") or 0.0, mb.get("spread_pct") or 0.0
            )
    return out


async def run_bench(cfg: BenchConfig) -> dict:
    before = await asyncio.to_thread(engine_facts, cfg.url, cfg.stall_s)
    doc = await Bench(cfg).run_once()
    if cfg.aa:
        second = await Bench(cfg).run_once()
        doc["aa"] = {
            "spread_pct": aa_spread(doc, second),
            "second": {"metrics": second["metrics"], "errors": second["errors"], "requests": second["requests"]},
        }
        # the document's errors are both runs' failed requests, so its request counts are both runs' too
        doc["errors"] += second["errors"]
        doc["requests"] = {k: doc["requests"][k] + second["requests"][k] for k in ("sent", "retries", "failed")}
    after = await asyncio.to_thread(engine_facts, cfg.url, cfg.stall_s)
    doc["serving"] = serving_block(cfg, before, after)
    return doc


# ---- what the engine states about itself (after the timed runs) ------------------------------------------------------

def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def engine_facts(url: str, timeout_s: float) -> dict:
    """What the engine exposes about itself: vLLM's /metrics (a text with `vllm:` samples) as `ServingFacts`, else
    llama.cpp's /props and /slots; `{"engine": None, "reasons": [...]}` says what was tried and why nothing came."""
    base = url.rstrip("/").removesuffix("/v1")
    reasons = []
    try:
        r = httpx.get(base + "/metrics", timeout=timeout_s)
        if r.status_code == 200:
            samples = parse_prometheus(r.text)
            if any(x.name.startswith("vllm:") for x in samples):
                return {"engine": "vllm", "facts": facts_from_metrics(samples)}
            reasons.append("GET /metrics has no vllm: samples")
        else:
            reasons.append(f"GET /metrics answered {r.status_code}")
    except (httpx.HTTPError, FidelityError) as e:
        reasons.append(f"GET /metrics: {e}")
    try:
        props = httpx.get(base + "/props", timeout=timeout_s)
        slots = httpx.get(base + "/slots", timeout=timeout_s)
        if props.status_code == 200 or slots.status_code == 200:
            pj = props.json() if props.status_code == 200 else None
            sj = slots.json() if slots.status_code == 200 else None
            return {"engine": "llama.cpp", "props": pj if isinstance(pj, dict) else None,
                    "slots": sj if isinstance(sj, list) else None}
        reasons.append(f"GET /props answered {props.status_code}, /slots {slots.status_code}")
    except (httpx.HTTPError, ValueError) as e:
        reasons.append(f"GET /props or /slots: {e}")
    return {"engine": None, "reasons": reasons}


def serving_block(cfg: BenchConfig, before: dict, after: dict) -> dict:
    """The bench JSON's `serving`: KV capacity, speculative-decoding acceptance over the bench's own requests (warm-ups
    and A/A runs included: the counters after minus before), a local engine's memory and the host's MemAvailable, read
    after the timed runs. A fact the engine does not state is null, its reason in `null_reasons`."""
    out = {"engine": after["engine"], "kv_cache_tokens": None, "kv_cache_bytes": None, "kv_block_size": None,
           "spec_decode": None, "memory_pss_bytes": None, "memory_processes": None, "mem_available_bytes": None}
    why = {}
    none_said = "; ".join(after.get("reasons", []))
    if after["engine"] == "vllm":
        f = after["facts"]
        out.update(kv_cache_tokens=f.kv_cache_tokens, kv_cache_bytes=f.kv_cache_bytes, kv_block_size=f.block_size)
        if f.kv_cache_tokens is None:
            why["kv_cache_tokens"] = "vLLM's /metrics has no cache_config_info kv_cache_size_tokens"
        if f.spec_decode is None:
            why["spec_decode"] = "vLLM exports no spec_decode counters (no speculative decoding)"
        elif before.get("engine") != "vllm" or before["facts"].spec_decode is None:
            why["spec_decode"] = "the spec_decode counters could not be read before the runs"
        else:
            out["spec_decode"] = f.spec_decode.minus(before["facts"].spec_decode).summary()
    elif after["engine"] == "llama.cpp":
        slots, props = after.get("slots"), after.get("props") or {}
        n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
        if isinstance(slots, list) and slots and all(isinstance(x, dict) and "n_ctx" in x for x in slots):
            n_ctx = {x["n_ctx"] for x in slots}.pop() if len({x["n_ctx"] for x in slots}) == 1 else None
        out["llama_cpp"] = {
            "n_ctx_per_slot": n_ctx,
            "slots": len(slots) if isinstance(slots, list) else props.get("total_slots"),
        }
        why["kv_cache_tokens"] = ("llama.cpp states each slot's context (llama_cpp.n_ctx_per_slot), not the KV cache's "
                                  "size (slots may share one unified cache)")
        why["spec_decode"] = "llama.cpp states no speculative-decoding counters on /props or /slots"
    else:
        why["kv_cache_tokens"] = why["spec_decode"] = f"the engine states no serving facts ({none_said})"
    if not is_loopback(cfg.url):
        why["memory_pss_bytes"] = why["mem_available_bytes"] = (
            f"the engine is not on this host ({cfg.url} is not loopback)"
        )
        return {**out, "null_reasons": why}
    out["mem_available_bytes"] = mem_available_bytes()
    if cfg.server_pid is None:
        why["memory_pss_bytes"] = "no server process given (bench --pid)"
        return {**out, "null_reasons": why}
    try:
        group = os.getpgid(cfg.server_pid)
    except ProcessLookupError:
        why["memory_pss_bytes"] = f"process {cfg.server_pid} does not exist"
        return {**out, "null_reasons": why}
    if group == os.getpgrp():
        why["memory_pss_bytes"] = (
            f"process {cfg.server_pid} is in fidelity's own process group {group}: its memory would "
            f"count fidelity's (start the server in a session of its own, e.g. setsid)"
        )
        return {**out, "null_reasons": why}
    members = group_members(group)
    out.update(memory_pss_bytes=processes_pss_bytes(members), memory_processes=len(members), memory_process_group=group)
    return {**out, "null_reasons": why}


def spread_of(doc: dict, metric: str) -> float:
    """The run-to-run spread (%) a change of `metric` must exceed: the A/A spread when the document has one, else the
    repeats'."""
    aa = (doc.get("aa") or {}).get("spread_pct") or {}
    if metric in aa:
        return float(aa[metric])
    return float((doc["metrics"].get(metric) or {}).get("spread_pct") or 0.0)


# ---- comparing two bench documents (the [speed] gate and the ladder) -------------------------------------------------

def throughput_metrics(doc: dict) -> list[str]:
    """The higher-is-better metrics of a document: decode, aggregate and prefill tok/s."""
    return [k for k in doc["metrics"] if k.split(".")[0] in ("decode", "aggregate", "prefill")]


def compare_bench(base: dict, new: dict, metrics: list[str] | None = None) -> dict[str, dict]:
    """Per metric: baseline and new medians, change % (positive = faster; TTFT counted as its inverse, lower is better)
    and the spread a change must exceed (the larger of the two documents' A/A or repeat spreads)."""
    out = {}
    for m in metrics or throughput_metrics(base):
        b = (base["metrics"].get(m) or {}).get("median")
        n = (new["metrics"].get(m) or {}).get("median")
        change = None
        if b and n:
            change = 100.0 * (b / n - 1) if m.startswith("ttft") else 100.0 * (n / b - 1)
        out[m] = {
            "baseline": b,
            "new": n,
            "change_pct": change,
            "spread_pct": max(spread_of(base, m), spread_of(new, m)),
        }
    return out


def bench_config_from(doc: dict, url: str, model: str, **overrides) -> BenchConfig:
    """The settings a stored bench document was measured with, against another engine."""
    known = set(BenchConfig.__dataclass_fields__)
    return BenchConfig(url, model, **{**{k: v for k, v in doc["settings"].items() if k in known}, **overrides})


def read_bench(path) -> dict:
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"bench baseline {p} does not exist")
    except json.JSONDecodeError as e:
        raise ConfigError(f"bench baseline {p} is not JSON: {e}")
    if not isinstance(doc, dict) or doc.get("kind") != "fidelity-bench" or "metrics" not in doc:
        raise ConfigError(f"bench baseline {p} is not a `fidelity bench --json` document")
    return doc


SPEED_KEYS = {"baseline", "drop_max_pct", "metrics", "repeats"}


def check_speed_section(path: str, section: str, table) -> None:
    bad = set(table) - SPEED_KEYS
    if bad or "baseline" not in table:
        raise ConfigError(f"gate config {path}: [speed] needs 'baseline' and knows {sorted(SPEED_KEYS)}"
                          + (f"; unknown: {sorted(bad)}" if bad else ""))


@gate_kind("speed", check=check_speed_section, names=lambda table: ["speed"])
async def _run_speed(call: GateCall, name: str, section: dict):
    return await run_gate(name, speed_gate, call.engine, call.model, section, config_dir=call.config_dir)


async def speed_gate(url: str, model: str, section: dict, *, config_dir=None):
    """The [speed] gate: re-run the baseline's bench against the engine; a metric fails when it drops by more than
    max(drop_max_pct, the spread). Failed requests make the gate an error (no speed verdict on partial data)."""
    path = Path(section["baseline"])
    if config_dir is not None and not path.is_absolute():
        path = Path(config_dir) / path
    base = read_bench(path)
    drop_max = float(section.get("drop_max_pct", 5.0))
    over = {"repeats": int(section["repeats"])} if "repeats" in section else {}
    new = await run_bench(bench_config_from(base, url, model, **over))
    rows = compare_bench(base, new, section.get("metrics"))
    measured = {
        "baseline": str(path),
        "drop_max_pct": drop_max,
        "metrics": rows,
        "bench": {k: new[k] for k in ("metrics", "streams", "prefill", "eos", "usage_check", "requests", "errors")},
    }
    notes = [] if base.get("aa") else ["the baseline has no A/A spread (bench --aa): the repeats' spread is used"]
    if new["errors"]:
        return GateResult("speed", "error", measured=measured, notes=notes,
                          error=f"{len(new['errors'])} bench request(s) failed; first: {new['errors'][0]['error']}")
    missing = [m for m, r in rows.items() if r["change_pct"] is None]
    if missing:
        return GateResult("speed", "error", measured=measured, notes=notes,
                          error=f"metric(s) {missing} missing in the baseline {path} or in this run")
    checks = [Check(f"{m} change %", r["change_pct"], ">=", -max(drop_max, r["spread_pct"])) for m, r in rows.items()]
    return GateResult("speed", "pass" if all(c.passed for c in checks) else "fail", checks=checks, measured=measured,
                      notes=notes)
