"""Needle in a haystack: facts ("the special magic number for <key> is <7 digits>") hidden at given depths of filler
text that fills a given context length, then asked for. Our own generator, deterministic given the engine's tokenizer.

- Haystack: by default generated prose (`generated_haystack`: seeded sentences from fixed word lists, no digits, as long
  as the largest length needs; deterministic from `haystack_seed`, nothing downloaded); `haystack="stdlib"`: the
  docstrings of a fixed list of Python standard-library modules (~54K tokens); `data=` a folder (its .txt/.md/.rst
  files, sorted by name, concatenated). The manifest records the source and the sha256 of the text used.
- Needle values are drawn from a seeded generator and redrawn until they occur nowhere in the haystack, so only the
  needle can supply the answer.
- Keys: `keys=K` needles per prompt, all asked for in one question. The cell's depth places the first; needle j sits at
  depth + j / K (wrapped into [0, 1]), so K keys spread over the context. The item passes when every key's number is
  right; the named metric `keys` counts the keys found.
- Lengths are in the engine's own tokens: measured with its tokenize endpoint (plus the chat template's overhead,
  measured once from `usage.prompt_tokens`), else with the pack's tokenizer (`tokenizer=` a pack folder, same overhead),
  else from `usage.prompt_tokens` of probe requests (max_tokens=1). The filler is bisected so that prompt + `max_tokens`
  (the room reserved for the answer) fits the length. A length "max" is the engine's context: `context=`, else what the
  engine states (vLLM's `max_model_len` in /v1/models, llama.cpp's `n_ctx` in /props).
- Grid: lengths x depths x seeds; item ids `L{length}-d{depth}-s{seed}`; `summarize` gives the pass rate per length x
  depth cell (and per key depth when K > 1), `suite compare` a McNemar test per cell.
- Scoring: one key: the first number in the answer (digit groups joined, so "1,234,567" reads 1234567) must equal the
  needle exactly. Several keys: each key's number is the first number after the key's name on its line; where the answer
  names no key at all, the numbers in order of the keys asked.
"""
from __future__ import annotations

import hashlib
import inspect
import importlib
import json
import random
import re
from pathlib import Path

from ..engine.client import EngineError
from ..errors import ConfigError
from ..registry import SUITES
from .runner import Item, Outcome, Settings, Suite

STDLIB_MODULES = [
    "argparse",
    "asyncio.events",
    "collections",
    "csv",
    "decimal",
    "difflib",
    "email.message",
    "json",
    "logging",
    "pickle",
    "re",
    "string",
    "textwrap",
    "unittest.case",
    "zipfile",
    "tarfile",
    "subprocess",
    "threading",
    "typing",
    "pathlib",
    "functools",
    "itertools",
    "heapq",
    "bisect",
    "shutil",
    "tempfile",
    "socket",
    "ssl",
    "sqlite3",
    "datetime",
    "calendar",
    "random",
    "statistics",
    "fractions",
    "inspect",
    "dataclasses",
    "enum",
    "contextlib",
    "io",
    "os",
    "codecs",
    "locale",
    "gettext",
    "http.client",
    "urllib.parse",
    "xml.dom.minidom",
]
KEYS_A = [
    "amber",
    "silent",
    "northern",
    "velvet",
    "hollow",
    "crimson",
    "gentle",
    "rapid",
    "frozen",
    "golden",
    "quiet",
    "bitter",
]
KEYS_B = [
    "harbor",
    "lantern",
    "meadow",
    "falcon",
    "orchard",
    "glacier",
    "compass",
    "violin",
    "canyon",
    "beacon",
    "ember",
    "willow",
]
INTRO = "Below is a long text. Somewhere in it is a special magic number. Read it and answer the question after it.\n\n"
INTRO_KEYS = (
    "Below is a long text. Somewhere in it are {n} special magic numbers, each for its own key. Read it and answer "
    "the question after it.\n\n"
)
GENERATOR_VERSION = 1  # bump when generated_haystack's output changes (the manifest records it)
SUBJECTS = [
    "the old miller",
    "a young clerk",
    "the river pilot",
    "our neighbour",
    "the night watchman",
    "a travelling painter",
    "the harbour master",
    "an elderly weaver",
    "the village teacher",
    "a quiet gardener",
    "the baker's daughter",
    "a visiting surveyor",
    "the lighthouse keeper",
    "the orchard keeper",
    "a wandering fiddler",
    "the ferry captain",
    "the town archivist",
    "a patient shepherd",
    "the glassblower",
    "the station porter",
]
VERBS = ["carried", "mended", "painted", "counted", "described", "remembered", "polished", "measured", "gathered",
         "followed", "studied", "folded", "repaired", "sketched", "weighed", "sorted", "admired", "questioned",
         "borrowed", "returned"]
OBJECTS = [
    "a basket of pears",
    "the broken lantern",
    "an old map of the coast",
    "the copper kettle",
    "a bundle of letters",
    "the heavy oak door",
    "a jar of honey",
    "the faded banner",
    "a crate of apples",
    "the worn saddle",
    "a ledger of accounts",
    "the silver buttons",
    "a coil of rope",
    "the brass compass",
    "a sack of flour",
    "the painted shutters",
    "a roll of linen",
    "the iron gate",
    "a box of candles",
    "the wooden sled",
]
PLACES = [
    "near the mill",
    "by the stone bridge",
    "behind the chapel",
    "along the canal",
    "at the edge of the forest",
    "inside the granary",
    "under the market arches",
    "beside the well",
    "on the hill road",
    "in the walled garden",
    "across the meadow",
    "at the ferry landing",
    "past the customs house",
    "below the ridge",
    "in the boathouse",
]
TIMES = [
    "before dawn",
    "in the late afternoon",
    "after the first frost",
    "during the spring fair",
    "on a windy evening",
    "at midsummer",
    "when the bells rang",
    "after the long rain",
    "early one morning",
    "as the tide turned",
]
REMARKS = [
    "Nobody thought much of it at the time.",
    "The weather had been mild for weeks.",
    "It was a small thing, but it was remembered.",
    "Later that week the roads were closed.",
    "The story was told differently by everyone.",
    "Some said it happened every year.",
    "The market was busier than usual.",
    "Nothing else of note occurred.",
    "A few people stopped to watch.",
    "The lamps were lit early that day.",
]


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
            if (
                not attr.startswith("_")
                and (inspect.isclass(obj) or inspect.isfunction(obj))
                and obj.__module__ == mod.__name__
            ):
                docs.append(inspect.getdoc(obj) or "")
        parts.extend(d for d in docs if len(d) > 80)
    return _clean("\n\n".join(parts))


def generated_haystack(seed: int, chars: int) -> str:
    """At least `chars` characters of plain prose (paragraphs of 4-8 sentences), deterministic from `seed` and
    prefix-stable: a longer call starts with a shorter one's text. No digits, so no needle value can occur in it."""
    rng = random.Random(seed)
    paragraphs, size = [], 0
    while size < chars:
        sentences = []
        for _ in range(rng.randint(4, 8)):
            if rng.random() < 0.2:
                sentences.append(rng.choice(REMARKS))
                continue
            s = (f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} "
                 f"{rng.choice(PLACES)} {rng.choice(TIMES)}.")
            sentences.append(s[0].upper() + s[1:])
        paragraphs.append(" ".join(sentences))
        size += len(paragraphs[-1]) + 2
    return "\n\n".join(paragraphs)


def folder_haystack(folder: str) -> str:
    path = Path(folder)
    files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".md", ".rst")) if path.is_dir() else []
    if not files:
        raise ConfigError(f"needle: haystack folder {folder} has no .txt/.md/.rst files")
    return _clean("\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files))


def _clean(text: str) -> str:
    return re.sub(r"[ \t]+", " ", re.sub(r"\n{3,}", "\n\n", text)).strip()


def needle_for(seed: int, haystack: str) -> tuple[str, str]:
    return needles_for(seed, haystack, 1)[0]


def needles_for(seed: int, haystack: str, n: int) -> list[tuple[str, str]]:
    """`n` (key, value) pairs with distinct keys and values, none occurring in `haystack`."""
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    while len(out) < n:
        key = f"{rng.choice(KEYS_A)}-{rng.choice(KEYS_B)}"
        value = str(rng.randrange(1_000_000, 10_000_000))
        if value not in haystack and key not in haystack and all(key != k and value != v for k, v in out):
            out.append((key, value))
    return out


def key_depths(depth: float, n: int) -> list[float]:
    """Depth of each of `n` needles: the first at `depth`, needle j at depth + j / n, wrapped into [0, 1]."""
    return [round(d - 1.0 if d > 1.0 else d, 6) for d in (depth + j / n for j in range(n))]


def insert_at_depth(text: str, sentence: str, depth: float) -> str:
    """Puts `sentence` at the sentence boundary nearest to `depth` (0 = start, 1 = end) of `text`."""
    return insert_at_depths(text, [(sentence, depth)])


def insert_at_depths(text: str, placed: list[tuple[str, float]]) -> str:
    """Puts each sentence at the sentence boundary of `text` nearest to its depth (0 = start, 1 = end); the boundaries
    are those of `text` itself, so one insertion does not move another."""
    bounds = [0] + [m.end() for m in re.finditer(r"[.!?]\s+|\n\n", text)] + [len(text)]
    cuts = sorted((min(bounds, key=lambda b: abs(b - int(depth * len(text)))), i, sentence)
                  for i, (sentence, depth) in enumerate(placed))
    parts, prev = [], 0
    for cut, _, sentence in cuts:
        parts += [text[prev:cut].rstrip(), sentence]
        prev = cut
    parts.append(text[prev:].lstrip())
    return " ".join(p for p in parts if p).strip()


def needle_sentence(key: str, value: str) -> str:
    return f"The special magic number for {key} is {value}."


def build_prompt(filler: str, key: str, value: str, depth: float) -> str:
    body = insert_at_depth(filler, needle_sentence(key, value), depth)
    return (f"{INTRO}{body}\n\nWhat is the special magic number for {key} mentioned in the text above? "
            f"Answer with the number only.")


def build_multi_prompt(filler: str, needles: list[tuple[str, str]], depths: list[float]) -> str:
    """Several needles, each at its depth, asked for together."""
    if len(needles) == 1:
        return build_prompt(filler, needles[0][0], needles[0][1], depths[0])
    body = insert_at_depths(filler, [(needle_sentence(k, v), d) for (k, v), d in zip(needles, depths)])
    keys = [k for k, _ in needles]
    asked = ", ".join(keys[:-1]) + f" and {keys[-1]}"
    return (
        f"{INTRO_KEYS.format(n=len(needles))}{body}\n\nWhat are the special magic numbers for {asked} mentioned in the "
        f"text above? Answer with one line per key: the key, a colon, and its number."
    )


def _numbers(text: str) -> list[str]:
    return re.findall(r"\d+", re.sub(r"(?<=\d)(?:,|[^\S\n])(?=\d)", "", text))  # "1,234,567" and "1 234 567" read whole


def read_number(text: str) -> str:
    first = next((ln for ln in text.strip().splitlines() if ln.strip()), "")
    found = _numbers(first)
    return found[0] if found else ""


def read_key_numbers(text: str, keys: list[str]) -> list[str]:
    """The number answered for each key: the first number after the key's name on the line that names it; where the
    answer names no key at all, the answer's numbers in the order the keys were asked."""
    low = text.lower()
    if not any(k.lower() in low for k in keys):
        nums = _numbers(text)
        return [nums[i] if i < len(nums) else "" for i in range(len(keys))]
    out = []
    for k in keys:
        at = low.find(k.lower())
        if at < 0:
            out.append("")
            continue
        line = text[at + len(k):].split("\n", 1)[0]
        nums = _numbers(line)
        out.append(nums[0] if nums else "")
    return out


def parse_lengths(text: str) -> list:
    """'8k,32k,max' -> [8192, 32768, 'max'] (k = 1024 tokens, as context sizes are counted)."""
    out = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        if part == "max":
            out.append("max")
            continue
        try:
            n = int(float(part[:-1]) * 1024) if part.endswith("k") else int(part)
        except ValueError:
            raise ConfigError(f"needle: length {part!r} is not a number of tokens (512, 8k, max)")
        out.append(n)
    return out


async def engine_context(client) -> int | None:
    """The context length the engine states: vLLM's `max_model_len` (/v1/models), llama.cpp's `n_ctx` (/props)."""
    if not hasattr(client, "get"):
        return None
    for path in ("/v1/models", "/props"):
        try:
            reply = await client.get(path, tag="needle-context")
        except EngineError:
            continue
        if path == "/v1/models":
            found = [m.get("max_model_len") for m in reply.get("data") or [] if isinstance(m, dict)]
        else:
            found = [(reply.get("default_generation_settings") or {}).get("n_ctx"), reply.get("n_ctx")]
        found = [n for n in found if isinstance(n, int) and not isinstance(n, bool) and n > 0]
        if found:
            return found[0]
    return None


@SUITES.register("needle")
class Needle(Suite):
    name = "needle"
    metric = "passed"
    default_max_tokens = 24
    group_by = "cell"

    def __init__(
        self,
        data: str | None = None,
        lengths=(1024, 2048),
        depths=(0.0, 0.5, 1.0),
        seeds: int = 2,
        keys: int = 1,
        haystack: str = "stdlib",
        haystack_seed: int = 0,
        context: int | None = None,
        tokenizer: str | None = None,
    ):
        self.data, self.kind, self.haystack_seed = data, haystack, int(haystack_seed)
        self.lengths = [
            x if x == "max" else int(x) for x in (parse_lengths(lengths) if isinstance(lengths, str) else lengths)
        ]
        self.depths, self.seeds, self.keys = [float(d) for d in depths], int(seeds), int(keys)
        self.context, self.tokenizer = context, tokenizer
        if any(not 0 <= d <= 1 for d in self.depths):
            raise ConfigError(f"needle: depths must lie in [0, 1], got {self.depths}")
        if not 1 <= self.keys <= 12:
            raise ConfigError(f"needle: keys per prompt must be 1 to 12, got {self.keys}")
        if haystack not in ("generated", "stdlib"):
            raise ConfigError(f"needle: haystack is 'generated' or 'stdlib', not {haystack!r}")
        if data:
            self.haystack = folder_haystack(data)
        elif haystack == "stdlib":
            self.haystack = stdlib_haystack()
        else:
            self.haystack = generated_haystack(self.haystack_seed, 200_000)
        self.used_chars = 0  # the longest haystack prefix the prompts use
        self.measure = "unmeasured"

    def source(self) -> dict:
        if self.data:
            src = f"folder:{self.data}"
        elif self.kind == "stdlib":
            src = "python stdlib docstrings"
        else:
            src = f"generated prose, seed {self.haystack_seed} (generator v{GENERATOR_VERSION})"
        text = (
            self.haystack[: self.used_chars]
            if self.kind == "generated" and not self.data and self.used_chars
            else self.haystack
        )
        return {"source": src, "sha256": hashlib.sha256(text.encode()).hexdigest(), "chars": len(text)}

    def config(self) -> dict:
        return {"lengths": self.lengths, "depths": self.depths, "seeds": self.seeds, "keys": self.keys,
                "measure": self.measure}

    def load(self) -> list[Item]:
        items = []
        for length in self.lengths:
            for depth in self.depths:
                for seed in range(self.seeds):
                    items.append(Item(f"L{length}-d{depth:g}-s{seed}", "", data={"length": length, "depth": depth,
                                                                                 "seed": seed}))
        return items

    async def prepare(self, items, client, settings: Settings):
        counter = await TokenCounter.create(client, settings, self.tokenizer)
        self.measure = counter.method
        room = settings.max_tokens or self.default_max_tokens
        if any(it.data["length"] == "max" for it in items):
            context = self.context or await engine_context(client)
            if not context:
                raise ConfigError("needle: length 'max' needs the engine's context length; the engine states none "
                                  "(/v1/models max_model_len, /props n_ctx): give --context")
            self.lengths = [context if x == "max" else x for x in self.lengths]
            for it in items:
                if it.data["length"] == "max":
                    it.data["length"] = context
                    it.item_id = f"L{context}-d{it.data['depth']:g}-s{it.data['seed']}"
        fillers = {}
        for length in sorted({it.data["length"] for it in items}):
            fillers[length] = await self._fit(counter, length - room)
        self.used_chars = max((len(f) for f in fillers.values()), default=0)
        for it in items:
            d = it.data
            pairs = needles_for(d["seed"] * 7919 + d["length"] * 31 + int(d["depth"] * 1000), self.haystack, self.keys)
            d["needles"] = [
                {"key": k, "value": v, "depth": kd} for (k, v), kd in zip(pairs, key_depths(d["depth"], self.keys))
            ]
            d["key"], d["value"] = pairs[0]
            it.prompt = build_multi_prompt(fillers[d["length"]], pairs, [n["depth"] for n in d["needles"]])
            d["prompt_tokens"] = await counter.count(it.prompt) if counter.cheap else None
        return items

    def _probe(self, chars: int) -> str:
        pairs = [(f"{KEYS_A[j]}-{KEYS_B[j]}", "1234567") for j in range(self.keys)]
        return build_multi_prompt(self._prefix(chars), pairs, key_depths(0.5, self.keys))

    async def _fit(self, counter: "TokenCounter", budget: int) -> str:
        """Longest haystack prefix whose prompt, needles included, fits in `budget` tokens (bisection on characters);
        a generated haystack grows until it is long enough."""
        if budget < 64:
            raise ConfigError(
                f"needle: a context length leaves only {budget} tokens for the prompt after the answer's room"
            )
        whole = await counter.count(self._probe(len(self.haystack)))
        while whole <= budget and self.kind == "generated" and not self.data:
            self.haystack = generated_haystack(self.haystack_seed, 2 * len(self.haystack))
            whole = await counter.count(self._probe(len(self.haystack)))
        if whole <= budget:
            if whole < budget - max(8, budget // 100):
                raise ConfigError(f"needle: the haystack ({len(self.haystack)} chars, {whole} tokens) is too short for "
                                  f"{budget} prompt tokens; give a larger haystack folder or the generated haystack")
            return self._prefix(len(self.haystack))
        lo, hi = 0, len(self.haystack)
        while hi - lo > 16:
            mid = (lo + hi) // 2
            if await counter.count(self._probe(mid)) <= budget:
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
        d = item.data
        needles = d.get("needles") or [{"key": d["key"], "value": d["value"], "depth": d["depth"]}]
        got = [read_number(text)] if len(needles) == 1 else read_key_numbers(text, [n["key"] for n in needles])
        found = [g == n["value"] for g, n in zip(got, needles)]
        ok = all(found)
        if len(needles) == 1:
            verdict = "found" if ok else f"expected {needles[0]['value']}, answered {got[0] or 'no number'}"
        else:
            missed = [
                f"{n['key']}: expected {n['value']}, answered {g or 'no number'}"
                for g, n, f in zip(got, needles, found)
                if not f
            ]
            verdict = f"found all {len(needles)} keys" if ok else "; ".join(missed)
        return Outcome(extracted=",".join(got), passed=ok, verdict=verdict, metrics={"keys": (sum(found), len(found))},
                       details={"length": d["length"], "depth": d["depth"], "cell": f"L{d['length']} d{d['depth']:g}",
                                "prompt_tokens": d.get("prompt_tokens"),
                                "keys": [{**n, "found": f} for n, f in zip(needles, found)]})

    def summarize(self, records: list) -> dict:
        """Pass rate per length x depth cell (an item passes when all its keys are right) and, with several keys, the
        share of keys found per length x the depth each key sat at."""
        cells: dict[tuple, dict] = {}
        by_key: dict[tuple, list[int]] = {}
        for r in records:
            det = json.loads(r.details or "{}")
            if r.error or "length" not in det:
                continue
            c = cells.setdefault((det["length"], det["depth"]), {"items": 0, "passed": 0, "keys": 0, "keys_found": 0})
            c["items"] += 1
            c["passed"] += bool(r.passed)
            for k in det.get("keys") or []:
                c["keys"] += 1
                c["keys_found"] += bool(k["found"])
                acc = by_key.setdefault((det["length"], k["depth"]), [0, 0])
                acc[0] += bool(k["found"])
                acc[1] += 1
        errors = sum(bool(r.error) for r in records)
        rows = [{"length": length, "depth": depth, **c, "pass_rate": c["passed"] / c["items"]}
                for (length, depth), c in sorted(cells.items())]
        out = {"keys_per_prompt": self.keys, "lengths": sorted({r["length"] for r in rows}),
               "depths": sorted({r["depth"] for r in rows}), "cells": rows, "errors": errors}
        if self.keys > 1:
            out["by_key_depth"] = [{"length": length, "depth": depth, "found": k, "keys": n, "rate": k / n}
                                   for (length, depth), (k, n) in sorted(by_key.items())]
        return out


class TokenCounter:
    """Counts a user message's prompt tokens as the engine will see them."""

    def __init__(self, client, settings: Settings, method: str, overhead: int, tokenize=None):
        self.client, self.settings, self.method, self.overhead = client, settings, method, overhead
        self.cheap = tokenize is not None
        self._tokenize = tokenize

    @classmethod
    async def create(cls, client, settings: Settings, tokenizer: str | None = None) -> "TokenCounter":
        """The engine's tokenize endpoint, else the pack's tokenizer at `tokenizer` (a pack folder or file), else
        usage.prompt_tokens probes. With a tokenizer, the chat template's overhead comes from one usage probe."""
        probe = "Count these words, please."
        ids = await client.tokenize(probe) if hasattr(client, "tokenize") else None
        if ids is not None:
            method, tokenize = "tokenize", client.tokenize
        elif tokenizer:
            # the packs load torch: only when the engine cannot tokenize
            from ..packs.tokenizer import tokenizer_of  # noqa: PLC0415 (torch)

            tok = tokenizer_of(tokenizer)

            async def tokenize(text):
                return tok(text, add_special_tokens=True)["input_ids"]

            method, ids = f"pack tokenizer {tokenizer}", await tokenize(probe)
        else:
            return cls(client, settings, "usage.prompt_tokens", 0)
        usage = await cls(client, settings, "usage", 0)._usage(probe)
        overhead = usage - len(ids) if usage else 0
        return cls(client, settings, f"{method} + template overhead {overhead}", overhead, tokenize)

    async def _usage(self, text: str) -> int | None:
        if self.settings.mode == "completion":
            r = await self.client.completion(text, max_tokens=1, tag="needle-measure")
        else:
            r = await self.client.chat([{"role": "user", "content": text}], max_tokens=1, tag="needle-measure")
        n = (r.usage or {}).get("prompt_tokens")
        return int(n) if n else None

    async def count(self, text: str) -> int:
        if self.cheap:
            return len(await self._tokenize(text)) + self.overhead
        n = await self._usage(text)
        if n is None:
            raise ConfigError("needle: the engine has no tokenize endpoint and reports no usage.prompt_tokens; cannot "
                              "measure context lengths")
        return n
