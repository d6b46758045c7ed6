"""Needle in a haystack: one fact ("the special magic number for <key> is <7 digits>") hidden at a given depth of filler text
that fills a given context length, then asked for. Our own generator, deterministic given the engine's tokenizer.

- Haystack: `data=` a folder (its .txt/.md/.rst files, sorted by name, concatenated) or, by default, the docstrings of a fixed
  list of Python standard-library modules (text every Python install has; its hash goes into the manifest).
- Needle values are drawn from a seeded generator and redrawn until they occur nowhere in the haystack, so only the needle can
  supply the answer.
- Lengths are in the engine's own tokens: measured with its tokenize endpoint (plus the chat template's overhead, measured
  once from `usage.prompt_tokens`), or, without one, from `usage.prompt_tokens` of probe requests (max_tokens=1). The filler
  is bisected so that prompt + `max_tokens` (the room reserved for the answer) fits the context length.
- Grid: lengths × depths × seeds; item ids `L{length}-d{depth}-s{seed}`.
- Scoring: the first number in the answer (digit groups joined, so "1,234,567" reads 1234567) must equal the needle exactly.
"""
from __future__ import annotations

import hashlib
import inspect
import importlib
import random
import re
from pathlib import Path

from ..errors import ConfigError
from ..registry import SUITES
from .runner import Item, Outcome, Settings, Suite

STDLIB_MODULES = ["argparse", "asyncio.events", "collections", "csv", "decimal", "difflib", "email.message", "json", "logging",
                  "pickle", "re", "string", "textwrap", "unittest.case", "zipfile", "tarfile", "subprocess", "threading",
                  "typing", "pathlib", "functools", "itertools", "heapq", "bisect", "shutil", "tempfile", "socket", "ssl",
                  "sqlite3", "datetime", "calendar", "random", "statistics", "fractions", "inspect", "dataclasses", "enum",
                  "contextlib", "io", "os", "codecs", "locale", "gettext", "http.client", "urllib.parse", "xml.dom.minidom"]
KEYS_A = ["amber", "silent", "northern", "velvet", "hollow", "crimson", "gentle", "rapid", "frozen", "golden", "quiet", "bitter"]
KEYS_B = ["harbor", "lantern", "meadow", "falcon", "orchard", "glacier", "compass", "violin", "canyon", "beacon", "ember", "willow"]
INTRO = "Below is a long text. Somewhere in it is a special magic number. Read it and answer the question after it.\n\n"


def stdlib_haystack() -> str:
    parts = []
    for name in STDLIB_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        docs = [inspect.getdoc(mod) or ""]
        for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
            obj = getattr(mod, attr, None)
            if not attr.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ == mod.__name__:
                docs.append(inspect.getdoc(obj) or "")
        parts.extend(d for d in docs if len(d) > 80)
    return _clean("\n\n".join(parts))


def folder_haystack(folder: str) -> str:
    path = Path(folder)
    files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".md", ".rst")) if path.is_dir() else []
    if not files:
        raise ConfigError(f"needle: haystack folder {folder} has no .txt/.md/.rst files")
    return _clean("\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files))


def _clean(text: str) -> str:
    return re.sub(r"[ \t]+", " ", re.sub(r"\n{3,}", "\n\n", text)).strip()


def needle_for(seed: int, haystack: str) -> tuple[str, str]:
    rng = random.Random(seed)
    while True:
        key = f"{rng.choice(KEYS_A)}-{rng.choice(KEYS_B)}"
        value = str(rng.randrange(1_000_000, 10_000_000))
        if value not in haystack and key not in haystack:
            return key, value


def insert_at_depth(text: str, sentence: str, depth: float) -> str:
    """Puts `sentence` at the sentence boundary nearest to `depth` (0 = start, 1 = end) of `text`."""
    target = int(depth * len(text))
    bounds = [0] + [m.end() for m in re.finditer(r"[.!?]\s+|\n\n", text)] + [len(text)]
    cut = min(bounds, key=lambda b: abs(b - target))
    return f"{text[:cut].rstrip()} {sentence} {text[cut:].lstrip()}".strip()


def build_prompt(filler: str, key: str, value: str, depth: float) -> str:
    body = insert_at_depth(filler, f"The special magic number for {key} is {value}.", depth)
    return f"{INTRO}{body}\n\nWhat is the special magic number for {key} mentioned in the text above? Answer with the number only."


def read_number(text: str) -> str:
    first = next((ln for ln in text.strip().splitlines() if ln.strip()), "")
    joined = re.sub(r"(?<=\d)[,\s](?=\d)", "", first)
    m = re.search(r"\d+", joined)
    return m.group(0) if m else ""


@SUITES.register("needle")
class Needle(Suite):
    name = "needle"
    metric = "passed"
    default_max_tokens = 24

    def __init__(self, data: str | None = None, lengths=(1024, 2048), depths=(0.0, 0.5, 1.0), seeds: int = 2):
        self.data = data
        self.lengths, self.depths, self.seeds = list(lengths), [float(d) for d in depths], int(seeds)
        if any(not 0 <= d <= 1 for d in self.depths):
            raise ConfigError(f"needle: depths must lie in [0, 1], got {self.depths}")
        self.haystack = folder_haystack(data) if data else stdlib_haystack()
        self.measure = "unmeasured"

    def source(self) -> dict:
        src = f"folder:{self.data}" if self.data else "python stdlib docstrings"
        return {"source": src, "sha256": hashlib.sha256(self.haystack.encode()).hexdigest(), "chars": len(self.haystack)}

    def config(self) -> dict:
        return {"lengths": self.lengths, "depths": self.depths, "seeds": self.seeds, "measure": self.measure}

    def load(self) -> list[Item]:
        items = []
        for length in self.lengths:
            for depth in self.depths:
                for seed in range(self.seeds):
                    key, value = needle_for(seed * 7919 + length * 31 + int(depth * 1000), self.haystack)
                    items.append(Item(f"L{length}-d{depth:g}-s{seed}", "", data={"length": length, "depth": depth, "key": key,
                                                                                "value": value}))
        return items

    async def prepare(self, items, client, settings: Settings):
        counter = await TokenCounter.create(client, settings)
        self.measure = counter.method
        room = settings.max_tokens or self.default_max_tokens
        fillers = {}
        for length in sorted({it.data["length"] for it in items}):
            fillers[length] = await self._fit(counter, length - room)
        for it in items:
            d = it.data
            it.prompt = build_prompt(fillers[d["length"]], d["key"], d["value"], d["depth"])
            d["prompt_tokens"] = await counter.count(it.prompt) if counter.cheap else None
        return items

    async def _fit(self, counter: "TokenCounter", budget: int) -> str:
        """Longest haystack prefix whose prompt, needle included, fits in `budget` tokens (bisection on characters)."""
        if budget < 64:
            raise ConfigError(f"needle: a context length leaves only {budget} tokens for the prompt after the answer's room")
        probe = lambda n: build_prompt(self._prefix(n), "amber-harbor", "1234567", 0.5)
        whole = await counter.count(probe(len(self.haystack)))
        if whole <= budget:
            if whole < budget - max(8, budget // 100):
                raise ConfigError(f"needle: the haystack ({len(self.haystack)} chars, {whole} tokens) is too short for "
                                  f"{budget} prompt tokens; give a larger haystack folder")
            return self._prefix(len(self.haystack))
        lo, hi = 0, len(self.haystack)
        while hi - lo > 16:
            mid = (lo + hi) // 2
            if await counter.count(probe(mid)) <= budget:
                lo = mid
            else:
                hi = mid
        return self._prefix(lo)

    def _prefix(self, chars: int) -> str:
        """The first `chars` characters, cut back to a sentence end nearby, else to a word boundary."""
        text = self.haystack[:chars]
        if chars >= len(self.haystack):
            return text
        end = max(text.rfind(". "), text.rfind("\n"))
        if end >= chars - 200:
            return text[: end + 1]
        return text[: max(text.rfind(" "), 0)]

    def score(self, item: Item, text: str, tool_calls: list) -> Outcome:
        got, want = read_number(text), item.data["value"]
        ok = got == want
        return Outcome(extracted=got, passed=ok, verdict="found" if ok else f"expected {want}, answered {got or 'no number'}",
                       details={"length": item.data["length"], "depth": item.data["depth"],
                                "prompt_tokens": item.data.get("prompt_tokens")})


class TokenCounter:
    """Counts a user message's prompt tokens as the engine will see them."""

    def __init__(self, client, settings: Settings, method: str, overhead: int):
        self.client, self.settings, self.method, self.overhead = client, settings, method, overhead
        self.cheap = method.startswith("tokenize")

    @classmethod
    async def create(cls, client, settings: Settings) -> "TokenCounter":
        probe = "Count these words, please."
        ids = await client.tokenize(probe) if hasattr(client, "tokenize") else None
        if ids is None:
            return cls(client, settings, "usage.prompt_tokens", 0)
        usage = await cls(client, settings, "usage", 0)._usage(probe)
        overhead = usage - len(ids) if usage else 0
        return cls(client, settings, f"tokenize + template overhead {overhead}", overhead)

    async def _usage(self, text: str) -> int | None:
        if self.settings.mode == "completion":
            r = await self.client.completion(text, max_tokens=1, tag="needle-measure")
        else:
            r = await self.client.chat([{"role": "user", "content": text}], max_tokens=1, tag="needle-measure")
        n = (r.usage or {}).get("prompt_tokens")
        return int(n) if n else None

    async def count(self, text: str) -> int:
        if self.cheap:
            return len(await self.client.tokenize(text)) + self.overhead
        n = await self._usage(text)
        if n is None:
            raise ConfigError("needle: the engine has no tokenize endpoint and reports no usage.prompt_tokens; cannot "
                              "measure context lengths")
        return n
