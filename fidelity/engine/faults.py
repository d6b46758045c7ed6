"""A fault-injecting OpenAI-compatible test server (loopback only), for testing the client and the gates.

    python -m fidelity.engine.faults --port 8123 [--plan '{"fail_attempts": 2}'] [--upstream URL] [--request-log FILE]

Without `--upstream` it serves a tiny deterministic toy model (character tokens, logits a fixed pseudo-random function of the last
two tokens), so it is exactly batch-invariant, decode==prefill and cache-independent unless a fault says otherwise. With
`--upstream` it forwards to a real engine and applies the same faults to its replies.

Faults (the `FaultPlan` fields): 5xx bursts (`fail_attempts` per distinct request body), replies slower than the client timeout
(`slow_s`), 200 replies whose body is not JSON (`malformed_attempts`), logprob lists cut short (`truncate_logprobs`), a connection
dropped half-way through the body (`drop_attempts`), and logprobs perturbed by a known amount: `perturb_prefill` shifts the logits
of echoed prompt positions by +delta (even token ids) / -delta (odd ids), `perturb_batched` does the same only while another request
is in flight (a batch-dependent kernel); `shift_echo` returns echo logprobs one position early, as llama-cpp-python does for a
prompt without BOS (the entry of each token holds the distribution of the token after it; the first is null and the last
generated token has none). Protocol faults: `null_logprobs` nulls the logprobs of that fraction of positions
(the same positions in every reply), `bad_prompt_id` adds a malformed or out-of-range token id to every prompt_logprobs
position. In front of an upstream, each returned top-k logprob moves by +-delta (by a hash of its
text) and the returned set is renormalized to its original mass, so no logprob moves by more than 2 delta.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
from dataclasses import asdict, dataclass, fields

import numpy as np

VOCAB = list(" abcdefghijklmnopqrstuvwxyz.,!?") + ["\n"]


@dataclass
class FaultPlan:
    fail_attempts: int = 0  # each distinct request body gets this many `fail_status` replies first
    fail_status: int = 503
    malformed_attempts: int = 0
    drop_attempts: int = 0
    slow_s: float = 0.0  # delay before answering...
    slow_attempts: int = 0  # ...the first N attempts of each body (0: every attempt)
    latency_s: float = 0.0  # processing time of every request (lets concurrent requests overlap)
    truncate_logprobs: bool = False
    perturb_prefill: float = 0.0
    perturb_batched: float = 0.0
    shift_echo: bool = False
    null_logprobs: float = 0.0  # this fraction of positions (fixed by position index) gets null logprobs and top lists
    bad_prompt_id: str = ""  # a key added to every prompt_logprobs position, e.g. "999999999", "abc", "-1"

    @classmethod
    def from_json(cls, text: str | None) -> "FaultPlan":
        d = json.loads(text) if text else {}
        known = {f.name for f in fields(cls)}
        bad = set(d) - known
        if bad:
            raise SystemExit(f"unknown fault plan fields: {sorted(bad)} (known: {sorted(known)})")
        return cls(**d)


class ToyModel:
    """Deterministic character-level model: logprobs at a position depend only on the previous two tokens."""

    vocab = VOCAB

    def __init__(self, seed: int = 1234):
        self.seed = seed
        self._cache: dict[tuple[int, int], np.ndarray] = {}

    def tokenize(self, text: str) -> list[int]:
        return [VOCAB.index(c) if c in VOCAB else VOCAB.index("?") for c in text]

    def detokenize(self, ids: list[int]) -> str:
        return "".join(VOCAB[i] for i in ids)

    def logprobs_after(self, ctx: list[int], shift: float = 0.0) -> np.ndarray:
        key = (ctx[-2] if len(ctx) > 1 else -1, ctx[-1] if ctx else -1)
        if key not in self._cache:
            rng = np.random.default_rng([self.seed, key[0] + 1, key[1] + 1])
            self._cache[key] = rng.normal(0.0, 2.0, size=len(VOCAB))
        logits = self._cache[key].copy()
        if shift:
            logits += shift * np.where(np.arange(len(VOCAB)) % 2 == 0, 1.0, -1.0)
        m = logits.max()
        return logits - (m + math.log(np.exp(logits - m).sum()))


class FaultServer:
    def __init__(self, plan: FaultPlan, upstream: str | None = None, request_log: str | None = None, model: ToyModel | None = None):
        self.plan, self.upstream, self.request_log = plan, upstream, request_log
        self.model = model or ToyModel()
        self.attempts: dict[str, int] = {}
        self.in_flight = 0

    # ---- HTTP plumbing (HTTP/1.1, one request per connection) ----------------------------------------------------------

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:] if ":" in l)}
            body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
            await self.respond(method, path.split("?")[0], body, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            try:
                writer.close()
            except Exception:
                pass

    def _write(self, writer, status: int, payload: bytes, content_type: str = "application/json"):
        reason = {200: "OK", 404: "Not Found", 400: "Bad Request"}.get(status, "Error")
        writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {len(payload)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + payload)

    async def respond(self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter):
        if path == "/_control":  # tests switch the plan of one running server instead of starting a new process
            req = json.loads(body or b"{}")
            self.plan = FaultPlan(**req.get("plan", {}))
            self.request_log = req.get("request_log", self.request_log)
            self.attempts.clear()
            return self._write(writer, 200, json.dumps({"plan": asdict(self.plan)}).encode())
        key = hashlib.sha256(method.encode() + path.encode() + body).hexdigest()[:16]
        n = self.attempts[key] = self.attempts.get(key, 0) + 1
        if self.request_log:
            with open(self.request_log, "a") as f:
                f.write(json.dumps({"key": key, "path": path, "attempt": n}) + "\n")
        p = self.plan
        if p.slow_s and (not p.slow_attempts or n <= p.slow_attempts):
            await asyncio.sleep(p.slow_s)
        if n <= p.fail_attempts:
            return self._write(writer, p.fail_status, b'{"error": "injected server error"}')
        if n <= p.fail_attempts + p.malformed_attempts:
            return self._write(writer, 200, b'{"choices": [{"text": "unfinished')
        self.in_flight += 1
        try:
            await asyncio.sleep(p.latency_s)
            status, reply = await self.route(method, path, json.loads(body) if body else {})
        finally:
            self.in_flight -= 1
        payload = json.dumps(reply).encode()
        if n <= p.fail_attempts + p.malformed_attempts + p.drop_attempts:
            # announce the full length, send half, hang up
            writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                         + payload[: len(payload) // 2])
            await writer.drain()
            writer.transport.abort()
            return
        self._write(writer, status, payload)

    async def route(self, method: str, path: str, req: dict) -> tuple[int, dict]:
        if self.upstream:
            return await self.forward(method, path, req)
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": "toy", "object": "model"}]}
        if path == "/v1/completions":
            return 200, self.toy_completion(req)
        if path == "/v1/chat/completions":
            text = "".join(m.get("content") or "" for m in req.get("messages", [])) + "\n"
            comp = self.toy_completion({**req, "prompt": text, "echo": False, "logprobs": None})
            return 200, {"object": "chat.completion", "choices": [{"index": 0, "finish_reason": comp["choices"][0]["finish_reason"],
                         "message": {"role": "assistant", "content": comp["choices"][0]["text"]}}], "usage": comp["usage"]}
        if path == "/tokenize":
            return 200, {"tokens": self.model.tokenize(req.get("prompt", req.get("content", "")))}
        return 404, {"error": f"no route {path}"}

    async def forward(self, method: str, path: str, req: dict) -> tuple[int, dict]:
        import httpx

        async with httpx.AsyncClient(base_url=self.upstream, timeout=600) as c:
            r = await c.request(method, path, json=req if method == "POST" else None)
        try:
            reply = r.json()
        except json.JSONDecodeError:
            return r.status_code, {"error": r.text[:500]}
        if r.status_code == 200 and path == "/v1/completions" and (self.plan.perturb_prefill or self.plan.perturb_batched):
            self.perturb_reply(reply, req)
        if r.status_code == 200 and self.plan.truncate_logprobs:
            self.truncate(reply)
        return r.status_code, reply

    # ---- the toy model's completions ----------------------------------------------------------------------------------

    def toy_completion(self, req: dict) -> dict:
        prompt = req.get("prompt", "")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]
        ids = list(prompt) if isinstance(prompt, list) else self.model.tokenize(prompt)
        k = req.get("logprobs")
        echo = bool(req.get("echo"))
        batched = self.plan.perturb_batched if self.in_flight > 1 else 0.0
        gen, rows = [], []
        if echo:
            for t in range(len(ids)):
                lp = self.model.logprobs_after(ids[:t], shift=self.plan.perturb_prefill + batched) if t else None
                rows.append((ids[t], lp))
        for _ in range(int(req.get("max_tokens", 16))):
            lp = self.model.logprobs_after(ids + gen, shift=batched)
            nxt = int(np.argmax(lp))
            gen.append(nxt)
            rows.append((nxt, lp))
        if echo and self.plan.shift_echo:  # entry i gets the distribution after token i; nothing after the last one
            seq = ids + gen
            rows = [(seq[0], None)] + [(seq[i], self.model.logprobs_after(seq[:i + 1], shift=self.plan.perturb_prefill))
                                       for i in range(1, len(seq) - 1)]
        choice = {"index": 0, "text": (self.model.detokenize(ids) if echo else "") + self.model.detokenize(gen),
                  "finish_reason": "length", "logprobs": None}
        if k is not None:
            choice["logprobs"] = self.legacy_logprobs(rows, int(k))
            if self.plan.truncate_logprobs:
                self.truncate({"choices": [choice]})
            lp = choice["logprobs"]
            for i in range(len(lp["tokens"])):
                if self._nulled(i):
                    lp["token_logprobs"][i] = None
                    lp["top_logprobs"][i] = None
        if req.get("prompt_logprobs") is not None:  # vLLM's shape: ids as keys, every prompt position
            pk = int(req["prompt_logprobs"])
            choice["prompt_logprobs"] = [None]
            for t in range(1, len(ids)):
                lp = self.model.logprobs_after(ids[:t], shift=self.plan.perturb_prefill + batched)
                keep = set(np.argsort(-lp, kind="stable")[:pk].tolist()) | {ids[t]}
                entry = {str(i): {"logprob": float(lp[i]), "decoded_token": VOCAB[i]} for i in keep}
                if self.plan.bad_prompt_id:
                    entry[self.plan.bad_prompt_id] = {"logprob": -30.0, "decoded_token": "?"}
                choice["prompt_logprobs"].append(None if self._nulled(t) else entry)
        return {"object": "text_completion", "model": "toy", "choices": [choice],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(gen), "total_tokens": len(ids) + len(gen)}}

    def _nulled(self, i: int) -> bool:
        f = self.plan.null_logprobs
        return bool(f) and hashlib.sha256(str(i).encode()).digest()[0] < 256 * f

    def legacy_logprobs(self, rows: list[tuple[int, np.ndarray | None]], k: int) -> dict:
        tokens, values, tops, offsets, off = [], [], [], [], 0
        for tok, lp in rows:
            tokens.append(VOCAB[tok])
            offsets.append(off)
            off += 1
            if lp is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(float(lp[tok]))
            best = np.argsort(-lp, kind="stable")[:k]
            tops.append({VOCAB[i]: float(lp[i]) for i in best})
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    # ---- faults applied to any reply ----------------------------------------------------------------------------------

    @staticmethod
    def truncate(reply: dict):
        for ch in reply.get("choices", []):
            lp = ch.get("logprobs")
            if isinstance(lp, dict) and lp.get("token_logprobs"):
                lp["token_logprobs"] = lp["token_logprobs"][:-1]

    def perturb_reply(self, reply: dict, req: dict):
        """Upstream replies: shift each returned top-k logprob by +-delta (by a hash of its token text), keeping the returned set's
        total mass, so the result is still a distribution with the same tail."""
        batched = self.plan.perturb_batched if self.in_flight > 1 else 0.0
        delta = batched + (self.plan.perturb_prefill if req.get("echo") else 0.0)  # prefill: echoed prompt positions only
        if not delta:
            return
        for ch in reply.get("choices", []):
            lp = ch.get("logprobs")
            if not isinstance(lp, dict):
                continue
            n_prompt = (reply.get("usage") or {}).get("prompt_tokens", len(lp.get("tokens", [])))
            for i, top in enumerate(lp.get("top_logprobs") or []):
                if not top or (not batched and i >= n_prompt):
                    continue
                keys = list(top)
                vals = np.array([top[t] for t in keys], dtype=np.float64)
                signs = np.array([1.0 if hashlib.md5(t.encode()).digest()[0] % 2 == 0 else -1.0 for t in keys])
                mass = np.log(np.exp(vals).sum())
                new = vals + delta * signs
                new += mass - np.log(np.exp(new).sum())
                lp["top_logprobs"][i] = {t: float(v) for t, v in zip(keys, new)}
                if lp["tokens"][i] in top:
                    lp["token_logprobs"][i] = float(new[keys.index(lp["tokens"][i])])


async def serve(host: str, port: int, server: FaultServer):
    srv = await asyncio.start_server(server.handle, host, port)
    async with srv:
        await srv.serve_forever()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--plan", default=None, help="FaultPlan as JSON")
    ap.add_argument("--upstream", default=None, help="forward to this engine instead of serving the toy model")
    ap.add_argument("--request-log", default=None, help="append one JSON line per request received")
    args = ap.parse_args(argv)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("the fault server listens on loopback only")
    plan = FaultPlan.from_json(args.plan)
    print(f"fault server on {args.host}:{args.port} plan={asdict(plan)} upstream={args.upstream}", flush=True)
    asyncio.run(serve(args.host, args.port, FaultServer(plan, args.upstream, args.request_log)))


if __name__ == "__main__":
    main()


def toy_reference(texts: list[str], model: ToyModel | None = None):
    """The toy model's exact distributions as a gate `Reference` (every position after the first scored)."""
    from .gates import Reference, ReferenceRow

    model = model or ToyModel()
    rows = []
    for i, text in enumerate(texts):
        ids = model.tokenize(text)
        scored = list(range(1, len(ids)))
        lp = np.stack([model.logprobs_after(ids[:t]) for t in scored])
        rows.append(ReferenceRow(id=f"toy{i}", domain="toy", tokens=ids, scored=scored, logprobs=lp))
    return Reference(rows=rows, pieces=list(VOCAB), detokenize=model.detokenize)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Spawned:
    """A server subprocess on a loopback port, waited for until it answers and killed on exit (tests and benchmarks)."""

    def __init__(self, cmd: list[str], port: int, *, ready_path: str = "/v1/models", timeout_s: float = 120.0, log: str | None = None):
        import subprocess
        import time

        import httpx

        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.log = open(log, "w") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before answering: {' '.join(cmd)}"
                                   + (f" (log {log})" if log else ""))
            try:
                httpx.get(self.url + ready_path, timeout=2)
                return  # any HTTP answer: the server is up (it may be one that injects errors)
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"server did not answer within {timeout_s:g} s: {' '.join(cmd)}")
            time.sleep(0.2)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        if hasattr(self.log, "close"):
            self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def spawn_fault_server(plan: FaultPlan | dict | None = None, *, upstream: str | None = None, request_log: str | None = None) -> Spawned:
    import sys

    plan = plan if isinstance(plan, FaultPlan) else FaultPlan(**(plan or {}))
    port = free_port()
    cmd = [sys.executable, "-m", "fidelity.engine.faults", "--port", str(port), "--plan", json.dumps(asdict(plan))]
    if upstream:
        cmd += ["--upstream", upstream]
    if request_log:
        cmd += ["--request-log", request_log]
    return Spawned(cmd, port, timeout_s=60)


def set_plan(url: str, plan: dict | None = None, request_log: str | None = None):
    """Switch a running fault server to `plan` (and a request log), forgetting its attempt counts."""
    import httpx

    httpx.post(url + "/_control", json={"plan": plan or {}, "request_log": request_log}, timeout=10).raise_for_status()
