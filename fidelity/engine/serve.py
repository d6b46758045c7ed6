"""An OpenAI-compatible endpoint computed by the fp32 oracle itself: the exact model as an engine, for gates and suites.

Routes: GET /v1/models; POST /v1/completions (text or token-id prompts, echo, logprobs up to the vocabulary size, vLLM's
prompt_logprobs and return_tokens_as_token_ids, stop, greedy or seeded sampling); POST /v1/chat/completions (the pack's
chat template, tools passed to it, Hermes-style <tool_call> blocks parsed into tool_calls, logprobs); POST /tokenize;
POST /detokenize.

Requests are computed one at a time, each as a batch of one, without a KV cache (every step re-runs the whole sequence):
slow, but batch-invariant and cache-independent by construction, and exact to the oracle's fp32.
"""
from __future__ import annotations

import json
import re
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from ..errors import FidelityError
from ..oracle import Oracle
from ..packs.tokenizer import load_tokenizer


class CachedPack:
    """Wraps a pack so each tensor is decoded once (the oracle re-fetches weights every forward)."""

    def __init__(self, pack):
        self._pack, self._cache, self._lock = pack, {}, threading.Lock()

    def tensor(self, name: str, device=None) -> torch.Tensor:
        key = (name, None if device is None else str(device))
        with self._lock:
            if key not in self._cache:
                self._cache[key] = self._pack.tensor(name, device=device)
            return self._cache[key]

    def tensors(self, names, device=None) -> dict[str, torch.Tensor]:
        """Through the cache, one by one (the inner pack's batched decode would bypass it)."""
        return {n: self.tensor(n, device=device) for n in names}

    def __getattr__(self, name):
        return getattr(self._pack, name)


class BadRequest(Exception):
    pass


@dataclass
class Step:
    token: int
    logprobs: torch.Tensor  # [V] float64 log-distribution this token was drawn from / scored under


class OracleEngine:
    def __init__(self, pack, model_name: str | None = None, device: str = "cpu", numerics: str = "exact",
                 activation_budget: int | None = None):
        self.pack = pack
        self.oracle = Oracle(CachedPack(pack), device=device, dtype=torch.float32, keep_weights=True, numerics=numerics,
                             activation_budget=activation_budget)
        self.tokenizer = load_tokenizer(pack)
        self.model_name = model_name or getattr(pack, "path", "oracle").name
        self.vocab = self.oracle.family.vocab_size
        self.pieces = [self.tokenizer.decode([i]) for i in range(min(self.vocab, len(self.tokenizer)))]
        self.pieces += [""] * (self.vocab - len(self.pieces))
        eos = self.tokenizer.eos_token_id
        self.eos = {eos} if eos is not None else set()
        self.lock = threading.Lock()

    # ---- model -----------------------------------------------------------------------------------------------------

    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), V] float64 log-distributions of the next token after each prefix ids[:t+1]."""
        logits = self.oracle.logits(torch.tensor([ids], dtype=torch.long))[0]
        return torch.log_softmax(logits.double(), dim=-1)

    def generate(self, ids: list[int], max_tokens: int, temperature: float, seed: int | None, stop: list[str],
                 first: torch.Tensor | None = None) -> tuple[list[Step], str]:
        """`first`: the next-token distribution after `ids` when the caller already computed it (the prompt's last
        row)."""
        gen: list[Step] = []
        g = torch.Generator().manual_seed(seed if seed is not None else 0)
        finish = "length"
        for step in range(max_tokens):
            lp = first if step == 0 and first is not None else self.logprobs(ids + [s.token for s in gen])[-1]
            if temperature and temperature > 0:
                tok = int(torch.multinomial(torch.softmax(lp / temperature, -1), 1, generator=g))
            else:
                tok = int(torch.argmax(lp))
            gen.append(Step(tok, lp))
            if tok in self.eos:
                finish = "stop"
                break
            if stop and any(s in self.tokenizer.decode([x.token for x in gen]) for s in stop):
                finish = "stop"
                break
        return gen, finish

    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.vocab]
            if bad:
                raise BadRequest(f"token id {bad[0]} is outside the vocabulary (size {self.vocab})")
            return list(prompt)
        raise BadRequest("prompt must be a non-empty string or list of token ids (one prompt per request)")

    # ---- OpenAI shapes ---------------------------------------------------------------------------------------------

    def _name(self, tok: int, as_ids: bool) -> str:
        return f"token_id:{tok}" if as_ids else self.pieces[tok]

    def legacy_logprobs(
        self, rows: list[tuple[int, torch.Tensor | None]], k: int, as_ids: bool, text_start: int = 0
    ) -> dict:
        tokens, values, tops, offsets, off = [], [], [], [], text_start
        for tok, lp in rows:
            tokens.append(self._name(tok, as_ids))
            offsets.append(off)
            off += len(self.pieces[tok])
            if lp is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(float(lp[tok]))
            top = {}
            if k > 0:
                v, i = torch.topk(lp, min(k, lp.numel()))
                for val, idx in zip(v.tolist(), i.tolist()):
                    top.setdefault(self._name(idx, as_ids), val)  # pieces that collide keep the likelier id
            top.setdefault(self._name(tok, as_ids), float(lp[tok]))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def completion(self, req: dict) -> dict:
        ids = self.encode(req.get("prompt", ""))
        if int(req.get("n", 1) or 1) != 1:
            raise BadRequest("n > 1 is not supported")
        max_tokens = int(req.get("max_tokens", 16) if req.get("max_tokens") is not None else 16)
        k = req.get("logprobs")
        echo, as_ids = bool(req.get("echo")), bool(req.get("return_tokens_as_token_ids"))
        stop = req.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        with self.lock:
            need_prompt = (echo and k is not None) or req.get("prompt_logprobs") is not None
            prompt_lp = self.logprobs(ids) if need_prompt else None
            gen, finish = self.generate(
                ids,
                max_tokens,
                float(req.get("temperature", 1.0) or 0.0),
                req.get("seed"),
                stop,
                first=prompt_lp[-1] if prompt_lp is not None else None,
            )
        text = self.tokenizer.decode([s.token for s in gen])
        prompt_text = self.tokenizer.decode(ids)
        choice = {"index": 0, "text": (prompt_text if echo else "") + text, "finish_reason": finish, "logprobs": None}
        if k is not None:
            rows = [(ids[t], prompt_lp[t - 1] if t else None) for t in range(len(ids))] if echo else []
            rows += [(s.token, s.logprobs) for s in gen]
            choice["logprobs"] = self.legacy_logprobs(rows, int(k), as_ids, 0 if echo else len(prompt_text))
        if req.get("prompt_logprobs") is not None:
            pk = int(req["prompt_logprobs"])
            pl = [None]
            for t in range(1, len(ids)):
                lp = prompt_lp[t - 1]
                entry = {}
                if pk > 0:
                    v, i = torch.topk(lp, min(pk, lp.numel()))
                    entry = {
                        str(idx): {"logprob": val, "decoded_token": self.pieces[idx]}
                        for val, idx in zip(v.tolist(), i.tolist())
                    }
                entry.setdefault(str(ids[t]), {"logprob": float(lp[ids[t]]), "decoded_token": self.pieces[ids[t]]})
                pl.append(entry)
            choice["prompt_logprobs"] = pl
        return self._reply("cmpl", "text_completion", choice, ids, gen)

    def chat(self, req: dict) -> dict:
        messages = req.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=req.get("tools"), add_generation_prompt=True, tokenize=False
            )
        except Exception as e:
            raise BadRequest(f"the chat template failed on these messages: {type(e).__name__}: {e}")
        ids = self.encode(text)
        max_tokens = int(req.get("max_tokens") or req.get("max_completion_tokens") or 256)
        stop = req.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        with self.lock:
            gen, finish = self.generate(
                ids, max_tokens, float(req.get("temperature", 1.0) or 0.0), req.get("seed"), stop
            )
        toks = [s.token for s in gen if s.token not in self.eos]
        content = self.tokenizer.decode(toks, skip_special_tokens=True)
        calls = []
        for i, m in enumerate(re.finditer(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", content, re.S)):
            try:
                obj = json.loads(m.group(1))
                calls.append(
                    {
                        "id": f"call_{i}",
                        "type": "function",
                        "function": {"name": str(obj.get("name")), "arguments": json.dumps(obj.get("arguments", {}))},
                    }
                )
            except json.JSONDecodeError:
                pass
        msg = {"role": "assistant", "content": content if not calls else None}
        if calls:
            msg["tool_calls"] = calls
            finish = "tool_calls"
        choice = {"index": 0, "message": msg, "finish_reason": finish}
        if req.get("logprobs"):
            k = int(req.get("top_logprobs") or 0)
            content_lp = []
            for s in gen:
                top = []
                if k:
                    v, i = torch.topk(s.logprobs, k)
                    top = [{"token": self.pieces[idx], "logprob": val} for val, idx in zip(v.tolist(), i.tolist())]
                content_lp.append(
                    {"token": self.pieces[s.token], "logprob": float(s.logprobs[s.token]), "top_logprobs": top}
                )
            choice["logprobs"] = {"content": content_lp}
        return self._reply("chatcmpl", "chat.completion", choice, ids, gen)

    def _reply(self, id_prefix: str, kind: str, choice: dict, ids: list, gen: list) -> dict:
        """The OpenAI response around one choice, with the prompt's and the generation's token counts."""
        return {
            "id": f"{id_prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(gen), "total_tokens": len(ids) + len(gen)},
        }

    def tokenize(self, req: dict) -> dict:
        text = req.get("prompt", req.get("content", req.get("input")))
        if not isinstance(text, str):
            raise BadRequest("tokenize needs 'prompt' (or 'content') text")
        ids = self.tokenizer.encode(text, add_special_tokens=bool(req.get("add_special_tokens", False)))
        return {
            "tokens": ids,
            "count": len(ids),
            "max_model_len": int(self.pack.config.get("max_position_embeddings", 0) or 0),
        }

    def detokenize(self, req: dict) -> dict:
        return {"prompt": self.tokenizer.decode(self.encode(req.get("tokens") or []))}


class JsonHandler(BaseHTTPRequestHandler):
    """A request handler whose replies are JSON bodies with their length (so an HTTP/1.1 connection stays usable)."""

    def send_json(self, status: int, obj: dict):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def make_handler(engine: OracleEngine):
    routes = {"/v1/completions": engine.completion, "/v1/chat/completions": engine.chat, "/tokenize": engine.tokenize,
              "/detokenize": engine.detokenize}

    class Handler(JsonHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet
            pass

        def do_GET(self):
            if self.path.split("?")[0] in ("/v1/models", "/models"):
                return self.send_json(
                    200,
                    {"object": "list", "data": [{"id": engine.model_name, "object": "model", "owned_by": "fidelity"}]},
                )
            if self.path.split("?")[0] == "/health":
                return self.send_json(200, {"status": "ok"})
            self.send_json(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n)
            fn = routes.get(self.path.split("?")[0])
            if fn is None:
                return self.send_json(404, {"error": {"message": f"no route {self.path}"}})
            try:
                req = json.loads(raw or b"{}")
                if not isinstance(req, dict):
                    raise BadRequest("the body must be a JSON object")
                if req.get("stream"):
                    raise BadRequest("stream=true is not supported")
                self.send_json(200, fn(req))
            except (BadRequest, json.JSONDecodeError, ValueError, TypeError) as e:
                self.send_json(400, {"error": {"message": str(e), "type": "invalid_request_error"}})
            except FidelityError as e:
                self.send_json(400, {"error": {"message": str(e), "type": "invalid_request_error"}})
            except Exception as e:  # a bug in us: say so, as a 500 the client may retry
                self.send_json(500, {"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error"}})

    return Handler


def serve(
    pack,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str | None = None,
    device: str = "cpu",
    ready=None,
    numerics: str = "exact",
    activation_budget: int | None = None,
):
    engine = OracleEngine(pack, model_name=model_name, device=device, numerics=numerics,
                          activation_budget=activation_budget)
    httpd = ThreadingHTTPServer((host, port), make_handler(engine))
    if ready:
        ready(httpd, engine)
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
