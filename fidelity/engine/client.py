"""Async client for OpenAI-compatible servers (vLLM, SGLang, llama.cpp, llama-cpp-python, `fidelity serve`, ...).

    async with EngineClient(ClientConfig("http://127.0.0.1:8000", model="m", journal="run.jsonl")) as c:
        comp = await c.completion("The cat", max_tokens=8, logprobs=5, echo=True)
        comp.logprobs[i].token / .logprob / .top            # per position, echoed prompt first
        chat = await c.chat([{"role": "user", "content": "hi"}], tools=[...])
        ids = await c.tokenize("The cat")                   # None when the server offers no tokenize endpoint

Every call goes through one bounded-concurrency, bounded-retry path: connection errors, timeouts, 5xx, 429 and 200
replies whose body is not JSON are retried with exponential backoff; other 4xx are not. After the last attempt an
`EngineError` is raised (the gate reports it as "could not run", never as a pass or a fail). A well-formed reply that
breaks the protocol (lists of different lengths, missing fields) raises `EngineProtocolError` without retry. With a
journal, finished requests are answered from it without sending.

`ClientConfig.timeout_s` is each request's deadline, all of it: from the moment the request gets its concurrency slot
to its parsed reply, every attempt, read and backoff included. A socket timeout (`stall_s`) bounds one read only, so an
engine that sends a byte every few seconds would otherwise hold a request (and a gate) for as long as it likes.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ..errors import FidelityError
from .journal import Journal, request_key


class EngineError(FidelityError):
    """The engine could not be used: unreachable, timed out, answered with an error, or answered something malformed."""

    def __init__(self, message: str, *, url: str | None = None, tag: str | None = None):
        self.url, self.tag = url, tag
        where = [f"request {tag!r}" if tag else None, url]
        where = [w for w in where if w]
        super().__init__(f"{message} [{', '.join(where)}]" if where else message)


ROUTE_ABSENT = (404, 405, 422)  # the answers of a server without the route asked for (a route probe's "no")


class EngineHTTPError(EngineError):
    """The engine answered with an HTTP error status (after retries, for retryable ones)."""

    def __init__(self, message: str, *, status: int, url: str | None = None, tag: str | None = None):
        self.status = status
        super().__init__(message, url=url, tag=tag)


class EngineProtocolError(EngineError):
    """The engine answered 200 but the body is not what the OpenAI protocol says (bad JSON, missing or inconsistent
    fields)."""


@dataclass
class ClientConfig:
    url: str  # base URL, with or without a trailing /v1
    model: str
    concurrency: int = 4
    # one request's deadline: every attempt, read and backoff (the wait for a slot not counted)
    timeout_s: float = 120.0
    retries: int = 3  # extra attempts after the first, while the deadline allows
    stall_s: float | None = None  # an attempt with no byte for this long is given up (and retried); None: the deadline
    backoff_s: float = 0.5  # first retry delay; doubles each attempt, with jitter
    backoff_max_s: float = 8.0
    api_key: str | None = None
    journal: str | Path | None = None

    @property
    def base(self) -> str:
        u = self.url.rstrip("/")
        return u[:-3] if u.endswith("/v1") else u


@dataclass
class TokenLogprob:
    """One position. `top` maps the engine's token text to logprob; `top_ids` maps token id to logprob where the engine
    gives ids (vLLM prompt_logprobs, `token_id:N` tokens, `fidelity serve`). `logprob` is None where the engine gives
    none (the first echoed token)."""

    token: str
    logprob: float | None
    top: dict[str, float] = field(default_factory=dict)
    token_id: int | None = None
    top_ids: dict[int, float] | None = None
    text_offset: int | None = None


@dataclass
class Completion:
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None  # echoed prompt tokens first when echo=True, then generated ones
    prompt_logprobs: list[TokenLogprob | None] | None  # vLLM's prompt_logprobs, one per prompt token (first is None)
    usage: dict
    raw: dict
    from_journal: bool = False
    cached_tokens: int | None = None  # prompt tokens the engine says it served from its prefix cache (None: not said)


@dataclass
class ToolCall:
    id: str | None
    name: str
    arguments: str  # JSON text as the engine produced it (may be invalid JSON: suites judge that)


@dataclass
class ChatCompletion:
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    usage: dict
    raw: dict
    from_journal: bool = False


@dataclass
class ClientStats:
    sent: int = 0  # HTTP requests actually sent (retries included)
    retries: int = 0
    journal_hits: int = 0
    errors: int = 0


@dataclass
class _Attempts:
    """What a request's attempts came to so far (read when its deadline ends them)."""
    count: int = 0
    last: str = "no attempt made"


class _Slot:
    """One request's hold on the client's concurrency semaphore: taken per attempt, given back at most once."""

    def __init__(self, sem: asyncio.Semaphore):
        self.sem, self.held = sem, False

    async def take(self):
        await self.sem.acquire()
        self.held = True  # no await between: a cancellation cannot leave the semaphore taken and this False

    def give(self):
        if self.held:
            self.held = False
            self.sem.release()


class EngineClient:
    def __init__(self, config: ClientConfig):
        self.config = config
        self.stats = ClientStats()
        self.journal = Journal(config.journal) if config.journal else None
        self._sem = asyncio.Semaphore(max(1, config.concurrency))
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        limits = httpx.Limits(max_connections=max(1, config.concurrency) + 2)
        stall = min(config.stall_s or config.timeout_s, config.timeout_s)
        self._http = httpx.AsyncClient(base_url=config.base, headers=headers, limits=limits,
                                       timeout=httpx.Timeout(stall, connect=min(10.0, stall)))
        self._tokenize_route: str | None = None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    async def aclose(self):
        await self._http.aclose()
        if self.journal:
            self.journal.close()

    # ---- the one path every request takes ----------------------------------------------------------------------------

    async def post(self, path: str, body: dict, *, tag: str = "", journal: bool = True, check=None,
                   route_probe: bool = False) -> dict:
        """POST `body` (JSON) to `path`; returns the parsed JSON reply, from the journal when it already holds it.
        `check(reply)` raises EngineProtocolError for a reply that breaks the protocol: such a reply is never journaled
        (and one found in an older journal is asked for again). `route_probe`: the request asks whether the route
        exists, so a 404 / 405 / 422 answer (raised as EngineHTTPError) is an answer, not counted in `stats.errors`."""
        return (await self._post(path, body, tag, journal, check, route_probe))[0]

    async def _post(self, path: str, body: dict, tag: str, journal: bool = True, check=None,
                    route_probe: bool = False) -> tuple[dict, bool]:
        """(reply, whether the journal answered this request)."""
        key = request_key(path, body, tag)
        if journal and self.journal is not None:
            hit = self.journal.get(key)
            if hit is not None:
                try:
                    if check is not None:
                        check(hit)
                    self.stats.journal_hits += 1
                    return hit, True
                except EngineProtocolError:
                    pass  # journaled before replies were validated: ask the engine again
        reply = await self._send("POST", path, body, tag, route_probe)
        if check is not None:
            check(reply)
        if journal and self.journal is not None:
            self.journal.put(key, reply, path=path, tag=tag)
        return reply, False

    async def _call(self, path: str, body: dict, parse, tag: str, validate=None):
        """The endpoints' one request helper: POST (journal, retries), then `parse(reply, url=, tag=)` and
        `validate(parsed)` (both raise EngineProtocolError) before the reply is journaled; the result's `from_journal`
        is this request's own journal hit (not a shared counter other requests in flight also move)."""
        parsed = {}

        def check(reply):
            out = parse(reply, url=self.config.base + path, tag=tag)
            if validate is not None:
                validate(out)
            parsed["out"] = out

        reply, hit = await self._post(path, body, tag, check=check)
        out = parsed["out"]
        out.from_journal = hit
        return out

    async def _send(self, method: str, path: str, body: dict | None, tag: str, route_probe: bool = False) -> dict:
        """The request with its retries, within `timeout_s` of first getting a concurrency slot (the slot is held
        only while an attempt is on the wire, so a request backing off lets another one go)."""
        url = self.config.base + path
        tried, slot = _Attempts(), _Slot(self._sem)
        await slot.take()
        try:
            return await asyncio.wait_for(
                self._attempts(method, path, body, tag, url, tried, slot), self.config.timeout_s
            )
        except asyncio.TimeoutError:
            self.stats.errors += 1
            raise EngineError(
                f"timed out: no complete answer within the request's deadline of {self.config.timeout_s:g} s "
                f"(retries included; --timeout / timeout_s) after {tried.count} attempt(s); "
                f"last: {tried.last}",
                url=url,
                tag=tag,
            ) from None
        except EngineHTTPError as e:
            if not (route_probe and e.status in ROUTE_ABSENT):
                self.stats.errors += 1
            raise
        finally:
            slot.give()

    async def _attempts(self, method: str, path: str, body: dict | None, tag: str, url: str, tried: "_Attempts",
                        slot: "_Slot") -> dict:
        for attempt in range(self.config.retries + 1):
            if attempt:
                self.stats.retries += 1
                delay = min(self.config.backoff_max_s, self.config.backoff_s * 2 ** (attempt - 1))
                await asyncio.sleep(delay * (0.5 + random.random() / 2))
                await slot.take()
            self.stats.sent += 1
            tried.count += 1
            tried.last = "still waiting for the reply"
            try:
                r = await self._http.request(method, path, json=body)
            except httpx.TimeoutException as e:
                tried.last = f"timed out: no byte for {self._http.timeout.read:g} s ({type(e).__name__})"
                continue
            except httpx.TransportError as e:
                tried.last = f"connection error: {type(e).__name__}: {e}"
                continue
            finally:
                slot.give()
            if r.status_code >= 500 or r.status_code == 429:
                tried.last = f"HTTP {r.status_code}: {r.text[:200]}"
                continue
            if r.status_code >= 400:  # counted in stats.errors by _send, unless a route probe's "no such route"
                raise EngineHTTPError(
                    f"engine answered HTTP {r.status_code}: {r.text[:300]}", status=r.status_code, url=url, tag=tag
                )
            try:
                return r.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                tried.last = f"reply is not JSON ({e}): {r.text[:120]!r}"
                continue
        self.stats.errors += 1
        raise EngineError(f"gave up after {self.config.retries + 1} attempts; last: {tried.last}", url=url, tag=tag)

    async def get(self, path: str, *, tag: str = "") -> dict:
        return await self._send("GET", path, None, tag)

    # ---- endpoints ---------------------------------------------------------------------------------------------------

    async def models(self) -> list[str]:
        reply = await self.get("/v1/models")
        return [m.get("id") for m in reply.get("data", [])]

    async def completion(self, prompt: str | list[int], *, max_tokens: int = 16, temperature: float = 0.0,
                         logprobs: int | None = None, echo: bool = False, prompt_logprobs: int | None = None,
                         stop: list[str] | None = None, seed: int | None = None, extra: dict | None = None,
                         tag: str = "", validate=None) -> Completion:
        """`/v1/completions`. `prompt` is text or token ids (not every server accepts ids). `prompt_logprobs` is vLLM's
        extension. `validate(completion)` raises EngineProtocolError for a reply the caller cannot use (ids outside its
        vocabulary): it is raised here and the reply is not journaled."""
        body = {
            "model": self.config.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            **_given(
                logprobs=logprobs,
                echo=True if echo else None,
                prompt_logprobs=prompt_logprobs,
                stop=stop or None,
                seed=seed,
            ),
            **(extra or {}),
        }
        return await self._call("/v1/completions", body, parse_completion, tag, validate)

    async def chat(
        self,
        messages: list[dict],
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        logprobs: bool = False,
        top_logprobs: int | None = None,
        stop: list[str] | None = None,
        seed: int | None = None,
        extra: dict | None = None,
        tag: str = "",
    ) -> ChatCompletion:
        """`/v1/chat/completions`, tools included."""
        body = {"model": self.config.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                **_given(tools=tools or None, tool_choice=tool_choice, logprobs=True if logprobs else None,
                         top_logprobs=top_logprobs if logprobs else None, stop=stop or None, seed=seed),
                **(extra or {})}
        return await self._call("/v1/chat/completions", body, parse_chat, tag)

    async def tokenize(self, text: str, *, add_special: bool = True) -> list[int] | None:
        """Token ids from the server's tokenizer, or None when it offers no tokenize endpoint. Tries vLLM/SGLang
        `/tokenize`, llama.cpp's `/tokenize` and llama-cpp-python's `/extras/tokenize`."""
        if self._tokenize_route == "":
            return None  # probed before: the server has none
        routes = [self._tokenize_route] if self._tokenize_route else ["/tokenize", "/extras/tokenize"]
        for route in routes:
            if route == "/extras/tokenize":
                body = {"input": text, "model": self.config.model}
            else:
                body = {"model": self.config.model, "prompt": text, "content": text, "add_special_tokens": add_special,
                        "add_special": add_special}
            def check(reply, route=route):
                tokens = reply.get("tokens") if isinstance(reply, dict) else None
                if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                           for t in tokens):
                    raise EngineProtocolError(f"tokenize reply has no list of non-negative integer 'tokens': "
                                              f"{str(reply)[:200]}", url=self.config.base + route, tag="tokenize")

            try:
                reply = await self.post(
                    route, body, tag="tokenize", check=check, route_probe=self._tokenize_route is None
                )
            except EngineHTTPError as e:
                if e.status in ROUTE_ABSENT:
                    continue
                raise
            tokens = reply["tokens"]
            self._tokenize_route = route
            return tokens
        self._tokenize_route = ""
        return None


def _given(**fields) -> dict:
    """The optional request fields that were given (None means leave the field out)."""
    return {k: v for k, v in fields.items() if v is not None}


# ---- parsing (pure functions, also used by tests on canned replies) --------------------------------------------------

def _choice(reply: dict, url: str, tag: str) -> dict:
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise EngineProtocolError(f"reply has no choices: {str(reply)[:200]}", url=url, tag=tag)
    return choices[0]


def _number(x, what: str, url: str, tag: str) -> float | None:
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x) or x > 1e-3:
        raise EngineProtocolError(f"{what} is not a logprob: {x!r}", url=url, tag=tag)
    return float(x)


def _token_id(token: str) -> int | None:
    # vLLM with return_tokens_as_token_ids=True spells tokens "token_id:123"
    if isinstance(token, str) and token.startswith("token_id:") and token[9:].isdigit():
        return int(token[9:])
    return None


def parse_legacy_logprobs(lp: dict, url: str = "", tag: str = "") -> list[TokenLogprob]:
    """The completions `logprobs` object: parallel lists tokens / token_logprobs / top_logprobs / text_offset."""
    if not isinstance(lp, dict):
        raise EngineProtocolError(f"logprobs is not an object: {str(lp)[:200]}", url=url, tag=tag)
    tokens = lp.get("tokens")
    values = lp.get("token_logprobs")
    tops = lp.get("top_logprobs")
    offsets = lp.get("text_offset")
    if not isinstance(tokens, list) or not isinstance(values, list):
        raise EngineProtocolError("logprobs lacks 'tokens' or 'token_logprobs' lists", url=url, tag=tag)
    lengths = {"tokens": len(tokens), "token_logprobs": len(values)}
    if tops is not None:
        lengths["top_logprobs"] = len(tops)
    if offsets is not None:
        lengths["text_offset"] = len(offsets)
    if len(set(lengths.values())) != 1:
        raise EngineProtocolError(f"logprob lists have different lengths (truncated?): {lengths}", url=url, tag=tag)
    out = []
    for i, tok in enumerate(tokens):
        top_raw = (tops[i] if tops is not None else None) or {}
        if not isinstance(top_raw, dict):
            raise EngineProtocolError(f"top_logprobs[{i}] is not an object", url=url, tag=tag)
        top = {str(k): _number(v, f"top_logprobs[{i}][{k!r}]", url, tag) for k, v in top_raw.items()}
        ids = {_token_id(k): v for k, v in top.items()}
        out.append(TokenLogprob(
            token=tok, logprob=_number(values[i], f"token_logprobs[{i}]", url, tag), top=top, token_id=_token_id(tok),
            top_ids=ids if top and None not in ids else None, text_offset=offsets[i] if offsets is not None else None))
    return out


def parse_vllm_prompt_logprobs(pl: list, url: str = "", tag: str = "") -> list[TokenLogprob | None]:
    """vLLM's `prompt_logprobs`: per prompt token None or {"id": {"logprob", "rank", "decoded_token"}} (or {"id":
    logprob})."""
    if not isinstance(pl, list):
        raise EngineProtocolError("prompt_logprobs is not a list", url=url, tag=tag)
    out: list[TokenLogprob | None] = []
    for i, pos in enumerate(pl):
        if pos is None:
            out.append(None)
            continue
        if not isinstance(pos, dict):
            raise EngineProtocolError(f"prompt_logprobs[{i}] is not an object", url=url, tag=tag)
        ids, text = {}, {}
        for k, v in pos.items():
            if not (isinstance(k, str) and k.isascii() and k.isdigit()):
                raise EngineProtocolError(
                    f"prompt_logprobs[{i}] has key {k!r}, not a token id (a non-negative integer)", url=url, tag=tag
                )
            lp = v.get("logprob") if isinstance(v, dict) else v
            ids[int(k)] = _number(lp, f"prompt_logprobs[{i}][{k}]", url, tag)
            if isinstance(v, dict) and v.get("decoded_token") is not None:
                text[v["decoded_token"]] = ids[int(k)]
        out.append(TokenLogprob(token="", logprob=None, top=text, top_ids=ids))
    return out


def cached_prompt_tokens(usage: dict | None, timings: dict | None, url: str = "", tag: str = "") -> int | None:
    """The prompt tokens an engine says it took from its prefix cache: OpenAI's and vLLM's
    `usage.prompt_tokens_details.cached_tokens` (vLLM only with --enable-prompt-tokens-details), else llama.cpp's
    `timings.cache_n`; None where the engine says neither. A count that is not a non-negative integer is an error."""
    usage = usage if isinstance(usage, dict) else {}
    prompt = usage.get("prompt_tokens")
    for what, where in (("usage.prompt_tokens_details.cached_tokens", usage.get("prompt_tokens_details")),
                        ("timings.cache_n", timings)):
        n = where.get(what.rsplit(".", 1)[1]) if isinstance(where, dict) else None
        if n is None:
            continue
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise EngineProtocolError(f"{what} is not a token count: {n!r}", url=url, tag=tag)
        if isinstance(prompt, int) and n > prompt:
            raise EngineProtocolError(f"{what} = {n} exceeds the prompt's {prompt} tokens (usage.prompt_tokens)",
                                      url=url, tag=tag)
        return n
    return None


def parse_completion(reply: dict, url: str = "", tag: str = "") -> Completion:
    ch = _choice(reply, url, tag)
    if not isinstance(ch.get("text", ""), str):
        raise EngineProtocolError("choices[0].text is not a string", url=url, tag=tag)
    lp = ch.get("logprobs")
    pl = ch.get("prompt_logprobs", reply.get("prompt_logprobs"))
    return Completion(
        text=ch.get("text") or "", finish_reason=ch.get("finish_reason"),
        logprobs=parse_legacy_logprobs(lp, url, tag) if lp is not None else None,
        prompt_logprobs=parse_vllm_prompt_logprobs(pl, url, tag) if pl is not None else None,
        usage=reply.get("usage") or {}, raw=reply,
        cached_tokens=cached_prompt_tokens(reply.get("usage"), reply.get("timings"), url, tag))


def parse_chat(reply: dict, url: str = "", tag: str = "") -> ChatCompletion:
    ch = _choice(reply, url, tag)
    msg = ch.get("message")
    if not isinstance(msg, dict):
        raise EngineProtocolError("choices[0].message is missing", url=url, tag=tag)
    calls = []
    for i, tc in enumerate(msg.get("tool_calls") or []):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise EngineProtocolError(f"tool_calls[{i}] has no function name", url=url, tag=tag)
        args = fn.get("arguments", "")
        calls.append(
            ToolCall(id=tc.get("id"), name=fn["name"], arguments=args if isinstance(args, str) else json.dumps(args))
        )
    logprobs = None
    content_lp = (ch.get("logprobs") or {}).get("content") if isinstance(ch.get("logprobs"), dict) else None
    if content_lp is not None:
        logprobs = []
        for i, t in enumerate(content_lp):
            top = {
                a["token"]: _number(a.get("logprob"), f"content[{i}].top_logprobs", url, tag)
                for a in t.get("top_logprobs") or []
            }
            logprobs.append(
                TokenLogprob(
                    token=t.get("token", ""),
                    logprob=_number(t.get("logprob"), f"content[{i}].logprob", url, tag),
                    top=top,
                    token_id=_token_id(t.get("token", "")),
                )
            )
    return ChatCompletion(
        content=msg.get("content"),
        tool_calls=calls,
        finish_reason=ch.get("finish_reason"),
        logprobs=logprobs,
        usage=reply.get("usage") or {},
        raw=reply,
    )


async def gather_bounded(coros, *, return_exceptions: bool = False):
    """asyncio.gather; the client's semaphore already bounds how many are in flight."""
    return await asyncio.gather(*coros, return_exceptions=return_exceptions)
