"""Engine gates: each an async function of an `EngineClient` returning a `GateResult` (measured values, thresholds, pass/fail,
worst examples). A gate that cannot get valid answers from the engine returns status "error", never "pass" or "fail".

- oracle-kl: the engine's prompt logprobs on the reference store's panel vs the oracle's exact distributions.
- batch-invariance: each prompt alone vs inside concurrent batches; greedy continuations and per-token logprobs must be equal.
- decode-vs-prefill: greedy generation with logprobs vs the same tokens prefilled with `echo`.
- prefix-cache: a long prompt cold vs warm, and a shared prefix with different suffixes cold vs warm.

When oracle-kl or decode-vs-prefill fails, each checks whether the engine's echo logprobs are shifted (entry t holding the
distribution of position t + d): oracle-kl against the reference and against the engine's own next-token answer after a
row, decode-vs-prefill against the decode's own logprobs; a fitting shift is named first in the notes (`measured["echo_shift"]`)
with the fix to try (llama-cpp-python shifts by +1 for prompts without BOS).

Default thresholds (`DEFAULT_THRESHOLDS`, overridden per gate from TOML) assume the engine serves the reference weights in fp32/fp16
and claims determinism; a bf16 or quantized engine should raise `kl_mean_max` in its gate.toml.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from ...errors import ConfigError
from ...registry import GATES
from ..client import Completion, EngineClient, EngineError, EngineProtocolError, TokenLogprob

DEFAULT_THRESHOLDS: dict[str, dict[str, float]] = {
    # mean KL(reference || engine) in nats over scored positions (top-k estimator, see oracle_kl), and top-1 agreement
    "oracle-kl": {"kl_mean_max": 1e-3, "top1_min": 0.95},
    # fraction of (prompt, batch size) pairs whose greedy continuation equals the alone one; max |delta logprob| on equal tokens
    "batch-invariance": {"identical_min": 1.0, "max_abs_dlogprob_max": 1e-5},
    # generated tokens' logprobs from decode vs from prefill (echo): max |delta| and mean KL over the returned top-k
    "decode-vs-prefill": {"max_abs_dlogprob_max": 1e-3, "kl_mean_max": 1e-5},
    # cold vs warm: identical outputs, max |delta logprob| over echoed prompt and generated tokens
    "prefix-cache": {"identical_min": 1.0, "max_abs_dlogprob_max": 1e-5},
}

# A verdict needs evidence: with fewer scored positions or rows than these a gate could not run (status "error",
# exit 2), never passes; set per gate in gate.toml ([oracle-kl] min_rows = 10). oracle-kl: 3 panel rows (fewer have
# no interval, stats.MIN_ROWS) and 20 positions (1 / (1 - top1_min): fewer cannot hold one top-1 disagreement and
# still pass, so the check cannot tell 95 % from 100 %); the self-consistency gates: 2 of their units (one prompt is
# an anecdote) and 4 compared positions.
DEFAULT_MINIMUMS: dict[str, dict[str, int]] = {
    "oracle-kl": {"min_rows": 3, "min_positions": 20},
    "batch-invariance": {"min_rows": 2, "min_positions": 4},
    "decode-vs-prefill": {"min_rows": 2, "min_positions": 4},
    "prefix-cache": {"min_rows": 2, "min_positions": 4},
}
ROWS_ARE = {"oracle-kl": "panel rows", "batch-invariance": "(prompt, batch size) pairs", "decode-vs-prefill": "prompts",
            "prefix-cache": "cases"}

DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
]


@dataclass
class Check:
    metric: str
    value: float
    op: str  # "<=" or ">="
    threshold: float

    @property
    def passed(self) -> bool:
        if self.value is None or math.isnan(self.value):
            return False
        return self.value <= self.threshold if self.op == "<=" else self.value >= self.threshold


@dataclass
class GateResult:
    gate: str
    status: str  # "pass" | "fail" | "error"
    checks: list[Check] = field(default_factory=list)
    measured: dict = field(default_factory=dict)
    worst: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["checks"] = [{**asdict(c), "passed": c.passed} for c in self.checks]
        return d


@dataclass
class GateSettings:
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    prompt_prefix: str = ""  # e.g. the BOS text; some servers misalign echo logprobs without a BOS (see notes)
    max_tokens: int = 16
    top_k: int = 5
    batch_sizes: list[int] = field(default_factory=lambda: [2, 4])
    long_prompt_repeats: int = 4  # prefix-cache: the long prompt is this many prompts joined
    worst: int = 5
    prompt_logprobs: bool = False  # oracle-kl: ask for vLLM's prompt_logprobs (token ids) instead of echo + logprobs
    bootstrap: int = 2000  # oracle-kl: row-bootstrap replicates of its per-domain intervals
    min_coverage: float = 0.99  # fraction of positions that must carry logprobs (oracle-kl: of scored positions compared)


def _verdict(name: str, checks: list[Check], **kw) -> GateResult:
    return GateResult(name, "pass" if all(c.passed for c in checks) else "fail", checks=checks, **kw)


def _thresholds(name: str, overrides: dict | None) -> dict[str, float]:
    th = dict(DEFAULT_THRESHOLDS[name])
    th.update({k: v for k, v in (overrides or {}).items() if k not in DEFAULT_MINIMUMS[name]})
    return th


def too_little_evidence(gate: str, rows: int, positions: int, overrides: dict | None, what: str) -> GateResult | None:
    """An error result (could not run) when the gate compared fewer `what` (positions) or rows than its minimums
    (`DEFAULT_MINIMUMS`, overridden from its gate.toml section); None when there is enough to decide on."""
    need = {k: int((overrides or {}).get(k, v)) for k, v in DEFAULT_MINIMUMS[gate].items()}
    if rows >= need["min_rows"] and positions >= need["min_positions"]:
        return None
    unit = ROWS_ARE[gate]
    return GateResult(gate, "error", measured={"rows": rows, "positions": positions, **need},
                      error=f"could not run: {positions} {what} in {rows} {unit} were compared; a verdict needs at "
                            f"least {need['min_positions']} positions and {need['min_rows']} {unit} (gate.toml "
                            f"[{gate}] min_positions / min_rows)")


def _checks(th: dict[str, float], measured: dict) -> list[Check]:
    out = []
    for key, limit in th.items():
        metric, kind = key.rsplit("_", 1)
        out.append(Check(metric, measured.get(metric, float("nan")), "<=" if kind == "max" else ">=", float(limit)))
    return out


async def run_gate(name: str, fn: Callable, *args, **kw) -> GateResult:
    """A gate that raises could not run: status "error" (exit 2, JSON and JUnit still written), never a pass or fail."""
    t0 = time.monotonic()
    try:
        res = await fn(*args, **kw)
    except EngineError as e:
        res = GateResult(name, "error", error=str(e))
    except Exception as e:  # a reply the gate cannot use in a way no check above named: still an error, not a crash
        res = GateResult(name, "error", error=f"{type(e).__name__}: {e}")
    res.seconds = round(time.monotonic() - t0, 3)
    return res


# ---- gate kinds: each registered in `fidelity.registry.GATES` under its gate.toml section --------------------------------

@dataclass
class GateCall:
    """What `engine.gates.config.run_gates` hands every gate kind's runner."""
    engine: str
    model: str
    client: EngineClient
    settings: GateSettings
    prompt_as: str
    config_dir: str | None
    journal: str | None
    store: str | None  # the reference store (--reference-store); None: not given
    load_reference: Callable[[], "Reference"]  # reads `store` (oracle-kl only)


@dataclass(frozen=True)
class GateKind:
    """One kind of gate. `run(call, name, section)` returns its `GateResult` (section: its gate.toml table, or None);
    `check(path, section, table)` raises `ConfigError` for a bad table; `names(table)`, when set, makes the kind run only
    where its section is in the config, as the gates that section defines (`speed`; `suite.NAME`)."""
    run: Callable
    check: Callable[[str, str, object], None]
    names: Callable[[object], list[str]] | None = None

    @property
    def defined_by(self) -> Callable:
        return self.run


def gate_kind(section: str, *, check: Callable[[str, str, object], None], names: Callable | None = None):
    """Decorator: register the runner below as the gate kind of `section`."""
    def add(run: Callable) -> Callable:
        GATES.register(section)(GateKind(run, check, names))
        return run
    return add


def check_thresholds(path: str, section: str, table) -> None:
    known = set(DEFAULT_THRESHOLDS[section]) | set(DEFAULT_MINIMUMS[section])
    bad = set(table) - known
    if bad:
        raise ConfigError(f"gate config {path}: unknown threshold(s) {sorted(bad)} in [{section}] "
                          f"(known: {sorted(known)})")
    for k, v in table.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"gate config {path}: [{section}] {k} must be a number, got {v!r}")
        if k in DEFAULT_MINIMUMS[section] and (not float(v).is_integer() or v < 1):
            raise ConfigError(f"gate config {path}: [{section}] {k} must be a whole number >= 1, got {v!r}")


@gate_kind("oracle-kl", check=check_thresholds)
async def _run_oracle_kl(call: GateCall, name: str, thresholds: dict | None) -> GateResult:
    if not call.store:
        return GateResult(name, "error", error="oracle-kl needs --reference-store")
    try:
        ref = call.load_reference()
    except Exception as e:  # a missing/incompatible store means this gate could not run
        return GateResult(name, "error", error=f"reference store {call.store}: {e}")
    return await run_gate(name, oracle_kl, call.client, ref, call.settings, thresholds, prompt_as=call.prompt_as)


@gate_kind("batch-invariance", check=check_thresholds)
async def _run_batch_invariance(call: GateCall, name: str, thresholds: dict | None) -> GateResult:
    return await run_gate(name, batch_invariance, call.client, call.settings, thresholds)


@gate_kind("decode-vs-prefill", check=check_thresholds)
async def _run_decode_vs_prefill(call: GateCall, name: str, thresholds: dict | None) -> GateResult:
    return await run_gate(name, decode_vs_prefill, call.client, call.settings, thresholds)


@gate_kind("prefix-cache", check=check_thresholds)
async def _run_prefix_cache(call: GateCall, name: str, thresholds: dict | None) -> GateResult:
    return await run_gate(name, prefix_cache, call.client, call.settings, thresholds)


# ---- comparing two sets of per-token logprobs ---------------------------------------------------------------------------

def topk_kl(p_top: dict[str, float], q_top: dict[str, float]) -> float:
    """KL(p || q) between two top-k lists coarsened onto (keys both return) + one tail bucket. Both distributions are known
    exactly on that partition, so this is an exact KL of the coarsened pair and a lower bound of the full-vocabulary KL."""
    common = [k for k in p_top if k in q_top and p_top[k] is not None and q_top[k] is not None]
    lp = np.array([p_top[k] for k in common], dtype=np.float64)
    lq = np.array([q_top[k] for k in common], dtype=np.float64)
    kl = float(np.sum(np.exp(lp) * (lp - lq)))
    pt = max(0.0, 1.0 - float(np.exp(lp).sum()))
    qt = max(0.0, 1.0 - float(np.exp(lq).sum()))
    if pt > 1e-12:
        kl += pt * (math.log(pt) - math.log(max(qt, 1e-12)))
    return max(kl, 0.0)


@dataclass
class SeqDiff:
    identical: bool
    max_abs: float
    kl_mean: float
    first_divergence: int | None
    compared: int = 0  # positions of the common prefix where both sides carry a logprob
    expected: int = 0  # positions of the common prefix that should (an echo's first token has none)


def compare_positions(a: list[TokenLogprob], b: list[TokenLogprob], echo: bool = False) -> SeqDiff:
    """Tokens must match position by position; logprob deltas are taken over the common prefix of equal tokens.
    `echo`: position 0 is an echoed first token, which has no logprob on either side."""
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i].token != b[i].token), None)
    identical = first is None and len(a) == len(b)
    upto = n if first is None else first
    deltas, kls = [], []
    expected = 0
    for i in range(upto):
        if not (echo and i == 0):
            expected += 1
        if a[i].logprob is not None and b[i].logprob is not None:
            deltas.append(abs(a[i].logprob - b[i].logprob))
        if a[i].top and b[i].top:
            kls.append(topk_kl(a[i].top, b[i].top))
    return SeqDiff(identical, max(deltas, default=0.0), float(np.mean(kls)) if kls else 0.0, first,
                   compared=len(deltas), expected=expected)


def coverage_error(gate: str, items: list[tuple[str, int, int]], s: "GateSettings", what: str) -> GateResult | None:
    """An error result when fewer than `s.min_coverage` of the positions that should carry logprobs do, naming the
    items (prompt, case or row; compared, expected) short of it; None when coverage is enough. A gate measured on
    a sliver of its positions would pass on no evidence."""
    compared, expected = sum(c for _, c, _ in items), sum(e for _, _, e in items)
    frac = compared / expected if expected else 0.0
    if expected and frac >= s.min_coverage:
        return None
    short = [f"{name} ({c}/{e})" for name, c, e in items if e and c / e < s.min_coverage]
    more = f" and {len(short) - 8} more" if len(short) > 8 else ""
    return GateResult(gate, "error", measured={"coverage": frac, "compared": compared, "expected": expected},
                      error=f"only {compared} of {expected} {what} ({100 * frac:.1f} %) could be compared, below the "
                            f"minimum coverage {100 * s.min_coverage:g} %: the engine left out logprobs; short: "
                            f"{', '.join(short[:8])}{more}")


def _generated(c: Completion, echo: bool) -> list[TokenLogprob]:
    lp = c.logprobs or []
    if echo:
        n = int(c.usage.get("completion_tokens", 0))
        return lp[len(lp) - n:] if n else []
    return lp


def _need_logprobs(c: Completion, what: str):
    if c.logprobs is None:
        raise EngineError(f"{what}: the engine returned no logprobs")


# ---- batch-invariance ---------------------------------------------------------------------------------------------------

async def batch_invariance(client: EngineClient, s: GateSettings, thresholds: dict | None = None) -> GateResult:
    prompts = [s.prompt_prefix + p for p in s.prompts]
    notes = []
    if client.config.concurrency < max(s.batch_sizes):
        notes.append(f"client concurrency {client.config.concurrency} < batch size {max(s.batch_sizes)}: batches are smaller than asked")

    async def one(i: int, tag: str) -> Completion:
        c = await client.completion(prompts[i], max_tokens=s.max_tokens, logprobs=s.top_k, tag=f"batch-invariance/{tag}/{i}")
        _need_logprobs(c, f"prompt {i}")
        return c

    alone = [await one(i, "alone") for i in range(len(prompts))]  # strictly one at a time
    rows = []
    for b in s.batch_sizes:
        for start in range(len(prompts)):
            members = [(start + j) % len(prompts) for j in range(b)]
            batch = await asyncio.gather(*(one(i, f"b{b}-at{start}") for i in members))
            i, c = members[0], batch[0]
            d = compare_positions(alone[i].logprobs, c.logprobs)
            rows.append({"prompt": i, "batch_size": b, "identical": d.identical, "max_abs_dlogprob": d.max_abs,
                         "first_divergence": d.first_divergence, "alone": alone[i].text, "batched": c.text,
                         "compared": d.compared, "expected": d.expected})
    short = coverage_error("batch-invariance", [(f"prompt {r['prompt']} batch {r['batch_size']}", r["compared"],
                                                 r["expected"]) for r in rows], s, "generated positions")
    if short:
        return short
    few = too_little_evidence("batch-invariance", sum(r["compared"] > 0 for r in rows),
                              sum(r["compared"] for r in rows), thresholds, "generated positions")
    if few:
        return few
    measured = {"identical": float(np.mean([r["identical"] for r in rows])),
                "max_abs_dlogprob": max(r["max_abs_dlogprob"] for r in rows), "pairs": len(rows),
                "coverage": sum(r["compared"] for r in rows) / sum(r["expected"] for r in rows)}
    worst = sorted(rows, key=lambda r: (r["identical"], -r["max_abs_dlogprob"]))[: s.worst]
    th = _thresholds("batch-invariance", thresholds)
    return _verdict("batch-invariance", _checks(th, measured), measured=measured, worst=worst, notes=notes)


# ---- decode-vs-prefill --------------------------------------------------------------------------------------------------

async def decode_vs_prefill(client: EngineClient, s: GateSettings, thresholds: dict | None = None) -> GateResult:
    """Generations run concurrently; each prefill then runs alone right after an unrelated flush request, so an engine with a
    single-entry prefix cache recomputes the prompt instead of replaying the decode's own cache."""
    prompts = [s.prompt_prefix + p for p in s.prompts]
    flush_prompt = s.prompt_prefix + "Unrelated text to evict single-entry caches."

    async def generate(i: int) -> Completion:
        gen = await client.completion(prompts[i], max_tokens=s.max_tokens, logprobs=s.top_k, tag=f"decode-vs-prefill/gen/{i}")
        _need_logprobs(gen, f"prompt {i} generation")
        return gen

    gens = await asyncio.gather(*(generate(i) for i in range(len(prompts))))
    done, shift_kl = [], {}
    for i, gen in enumerate(gens):
        await client.completion(flush_prompt, max_tokens=1, tag=f"decode-vs-prefill/flush/{i}")
        pre = await client.completion(prompts[i] + gen.text, max_tokens=1, logprobs=s.top_k, echo=True,
                                      tag=f"decode-vs-prefill/prefill/{i}")
        _need_logprobs(pre, f"prompt {i} prefill")
        done.append((i, gen, gen.logprobs, _prefilled_span(pre, gen.logprobs)))
        for d, kls in decode_echo_shifts(gen.logprobs, pre.logprobs, _prefilled_start(pre, gen.logprobs)).items():
            shift_kl.setdefault(d, []).extend(kls)

    rows, notes = [], []
    for i, gen, decoded, prefilled in done:
        if [t.token for t in prefilled] != [t.token for t in decoded]:
            notes.append(f"prompt {i}: prompt+generation re-tokenizes differently; compared up to the first differing token")
        d = compare_positions(decoded, prefilled)
        deltas = [abs(a.logprob - b.logprob) for a, b in zip(decoded, prefilled)
                  if a.token == b.token and a.logprob is not None and b.logprob is not None]
        same = sum(a.token == b.token for a, b in zip(decoded, prefilled))
        rows.append({"prompt": i, "positions": len(deltas), "max_abs_dlogprob": d.max_abs, "kl_mean": d.kl_mean,
                     "generation": gen.text, "aligned": same})
    short = coverage_error("decode-vs-prefill", [(f"prompt {r['prompt']}", r["positions"], r["aligned"]) for r in rows],
                           s, "aligned generated positions")
    if short and short.measured["expected"]:
        short.notes = notes
        return short
    n = sum(r["positions"] for r in rows)
    if n == 0:
        return GateResult("decode-vs-prefill", "error", error="no generated position could be aligned with its prefill", notes=notes)
    few = too_little_evidence("decode-vs-prefill", sum(r["positions"] > 0 for r in rows), n, thresholds,
                              "aligned generated positions")
    if few:
        few.notes = notes
        return few
    measured = {"max_abs_dlogprob": max(r["max_abs_dlogprob"] for r in rows),
                "kl_mean": float(sum(r["kl_mean"] * r["positions"] for r in rows) / n), "positions": n}
    scored = [r for r in rows if r["positions"]]
    worst_prompt = max(scored, key=lambda r: r["kl_mean"])        # self-consistency "worst mean": per prompt
    measured.update({"worst_prompt_kl_mean": worst_prompt["kl_mean"], "worst_prompt": worst_prompt["prompt"],
                     "prompts": [{k: r[k] for k in ("prompt", "positions", "kl_mean", "max_abs_dlogprob")} for r in rows]})
    worst = sorted(rows, key=lambda r: -r["max_abs_dlogprob"])[: s.worst]
    th = _thresholds("decode-vs-prefill", thresholds)
    result = _verdict("decode-vs-prefill", _checks(th, measured), measured=measured, worst=worst, notes=notes)
    d, means = echo_shift(shift_kl)
    if result.status == "fail" and d:
        measured["echo_shift"] = d
        result.notes.insert(0, misalignment_note(d, means, "the decode's own logprobs vs the prefill's echo"))
    return result


def _prefilled_span(pre: Completion, decoded: list[TokenLogprob]) -> list[TokenLogprob]:
    """The echo entries of the generated tokens (from `_prefilled_start`)."""
    start = _prefilled_start(pre, decoded)
    return pre.logprobs[start:start + len(decoded)]


def _prefilled_start(pre: Completion, decoded: list[TokenLogprob]) -> int:
    """Where the generated tokens start in the echo: it ends with the prompt+generation, then (usually) the one token the
    prefill request generated, which some engines leave out; take the placement whose tokens match."""
    echo, n = pre.logprobs, len(decoded)
    n_gen = int(pre.usage.get("completion_tokens", 1))
    want = [t.token for t in decoded]
    starts = [len(echo) - n_gen - n, len(echo) - n] if n_gen else [len(echo) - n]
    for start in starts:
        if start >= 0 and [t.token for t in echo[start:start + n]] == want:
            return start
    return max(starts[0], 0)


# ---- prefix-cache -------------------------------------------------------------------------------------------------------

async def prefix_cache(client: EngineClient, s: GateSettings, thresholds: dict | None = None) -> GateResult:
    """Sequential on purpose: the order of requests is what makes a computation cold or warm. "Cold" is the first request after an
    unrelated flush request; an engine with a multi-entry cache may still serve it from cache (then this measures warm vs warm)."""
    base = s.prompt_prefix + " ".join((s.prompts * s.long_prompt_repeats)[: len(s.prompts) * s.long_prompt_repeats // 2 + 1])
    suffixes = [" " + p for p in s.prompts[: max(2, len(s.prompts) // 2)]]
    flush_prompt = s.prompt_prefix + "Unrelated text to evict single-entry caches."

    async def ask(prompt: str, tag: str) -> Completion:
        c = await client.completion(prompt, max_tokens=s.max_tokens, logprobs=s.top_k, echo=True, tag=f"prefix-cache/{tag}")
        _need_logprobs(c, tag)
        return c

    async def flush(tag: str):
        await client.completion(flush_prompt, max_tokens=1, tag=f"prefix-cache/flush/{tag}")

    pairs = []
    await flush("long")
    cold = await ask(base, "long/cold")
    warm = await ask(base, "long/warm")
    pairs.append(("long prompt", cold, warm))
    for j, suf in enumerate(suffixes):
        await flush(f"suffix{j}")
        c = await ask(base + suf, f"suffix{j}/cold")
        await ask(base, f"suffix{j}/prime")
        w = await ask(base + suf, f"suffix{j}/warm")
        pairs.append((f"shared prefix + suffix {j}", c, w))
    rows = []
    for label, c, w in pairs:
        d = compare_positions(c.logprobs, w.logprobs, echo=True)
        rows.append({"case": label, "identical": d.identical and c.text == w.text, "max_abs_dlogprob": d.max_abs,
                     "first_divergence": d.first_divergence, "positions": len(c.logprobs), "compared": d.compared,
                     "expected": d.expected})
    short = coverage_error("prefix-cache", [(r["case"], r["compared"], r["expected"]) for r in rows], s,
                           "echoed and generated positions")
    if short:
        return short
    few = too_little_evidence("prefix-cache", sum(r["compared"] > 0 for r in rows), sum(r["compared"] for r in rows),
                              thresholds, "echoed and generated positions")
    if few:
        return few
    measured = {"identical": float(np.mean([r["identical"] for r in rows])),
                "max_abs_dlogprob": max(r["max_abs_dlogprob"] for r in rows), "cases": len(rows),
                "long_prompt_tokens": int(cold.usage.get("prompt_tokens", 0))}
    worst = sorted(rows, key=lambda r: (r["identical"], -r["max_abs_dlogprob"]))[: s.worst]
    th = _thresholds("prefix-cache", thresholds)
    return _verdict("prefix-cache", _checks(th, measured), measured=measured, worst=worst, notes=[" ".join(prefix_cache.__doc__.split(". ", 1)[1].split())])


# ---- oracle-kl ----------------------------------------------------------------------------------------------------------

@dataclass
class ReferenceRow:
    """One panel row of the reference: `logprobs[j]` is the oracle's full log-distribution (length V) for predicting
    `tokens[scored[j]]` from `tokens[:scored[j]]`."""

    id: str
    domain: str
    tokens: list[int]
    scored: list[int]
    logprobs: np.ndarray  # [len(scored), V]


@dataclass
class Reference:
    rows: list[ReferenceRow]
    pieces: list[str]  # decoded text of each token id alone (what engines put in `top_logprobs` keys)
    detokenize: Callable[[list[int]], str]  # ids -> text with special tokens kept, for engines that only take text
    special_ids: set[int] = field(default_factory=set)  # tokens an engine may leave out of its echo (llama-cpp-python drops BOS)

    def piece_ids(self) -> dict[str, int]:
        """Unambiguous text -> id. Left out (their mass goes to the tail bucket): pieces several ids decode to, and pieces that
        engines render differently (partial UTF-8 bytes: U+FFFD here, "" in llama-cpp-python; "" for special tokens)."""
        seen: dict[str, int] = {}
        for i, p in enumerate(self.pieces):
            seen[p] = -1 if p in seen else i
        ambiguous = self.ambiguous_texts()
        return {p: i for p, i in seen.items() if i >= 0 and p not in ambiguous}

    def ambiguous_texts(self) -> set[str]:
        """Texts an engine may use for more than one id: "", anything with U+FFFD, and what partial-UTF-8 pieces become
        when an engine drops the undecodable bytes (" \ufffd" -> " ", which is also the space token)."""
        out = {""}
        for p in self.pieces:
            if not _renderable(p):
                out.add(p)
                out.add(p.replace("\ufffd", ""))
        return out


def _renderable(piece: str) -> bool:
    return piece != "" and "\ufffd" not in piece


@dataclass
class PositionKL:
    kl: float  # KL(ref || engine) on the partition {engine's returned ids} + one tail bucket: a lower bound of the full KL
    tail_mass: float  # reference probability outside the engine's returned ids: the full KL exceeds `kl` by tail_mass * KL(tails)
    top1_agree: bool | None  # None: the engine's text-keyed answer cannot tell
    engine_nll: float = math.nan  # -log q_engine(true token), from the engine's logprob of it
    ref_nll: float = math.nan  # -log p_ref(true token)


def position_kl(ref_lp: np.ndarray, engine: dict[int, float]) -> PositionKL:
    """The top-k estimator. The engine gives log q for a set E of ids (its top-k and the actual token); the reference gives
    log p for every id. On the partition {x} for x in E, plus T = everything else, both distributions are known exactly, so
    KL_E = sum_E p log(p/q) + p(T) log(p(T)/q(T)) is exact for the coarsened pair and, by the data-processing inequality, never
    above the full-vocabulary KL. The gap is p(T) * KL(p|T || q|T): it is small when p(T) is, and p(T) is reported with it.
    When the engine returns the full distribution, T is empty and KL_E is the full KL."""
    ids = np.fromiter(engine.keys(), dtype=np.int64)
    lq = np.fromiter(engine.values(), dtype=np.float64)
    lp = ref_lp[ids].astype(np.float64)
    p = np.exp(lp)
    kl = float(np.sum(p * (lp - lq)))
    pt = max(0.0, 1.0 - float(p.sum()))
    qt = max(0.0, 1.0 - float(np.exp(lq).sum()))
    if pt > 1e-12:
        kl += pt * (math.log(pt) - math.log(max(qt, 1e-12)))
    return PositionKL(max(kl, 0.0), pt, int(ids[np.argmax(lq)]) == int(np.argmax(ref_lp)))


def _top1_agree(tl: TokenLogprob, ref_lp: np.ndarray, ref: "Reference", ambiguous: set[str]) -> bool | None:
    """Engine top-1 vs reference top-1: by id when the engine gives ids, else by text; None (not counted) when the text cannot
    tell (either top-1 is a text several ids share: text-keyed top lists also lose entries to such collisions)."""
    best = int(np.argmax(ref_lp))
    if tl.top_ids:
        return max(tl.top_ids, key=tl.top_ids.get) == best
    if not tl.top:
        return None
    key, piece = max(tl.top, key=tl.top.get), ref.pieces[best]
    if key in ambiguous or piece in ambiguous or (best in ref.special_ids and key == ""):
        return None
    return key == piece


def _engine_position(tl: TokenLogprob, actual: int, piece_ids: dict[str, int]) -> dict[int, float]:
    out: dict[int, float] = {}
    if tl.top_ids:
        out.update({i: v for i, v in tl.top_ids.items() if v is not None})
    else:
        for text, v in tl.top.items():
            if v is not None and text in piece_ids:
                out[piece_ids[text]] = v
    if tl.logprob is not None:
        out[actual] = tl.logprob
    return out


def _same_token(tl: TokenLogprob | None, tok: int, ref: Reference) -> bool:
    if tl is None:
        return True  # vLLM's first prompt position
    if tl.token_id is not None:
        return tl.token_id == tok
    piece = ref.pieces[tok]
    return tl.token == piece or "\ufffd" in piece or (tok in ref.special_ids and tl.token == "")


def align_echo(row: ReferenceRow, echoed: list[TokenLogprob | None], ref: Reference, generated: int = 0) -> dict[int, int]:
    """Reference position -> index in the engine's echo, whose last `generated` entries (at most) are generated tokens.
    Engines may leave special tokens out (a leading BOS, or every BOS); any other difference means the engine saw other
    tokens, which is an error, not a measurement."""
    where, e = {}, 0
    for t, tok in enumerate(row.tokens):
        if e < len(echoed) and _same_token(echoed[e], tok, ref):
            where[t] = e
            e += 1
        elif tok in ref.special_ids or t == 0:
            continue
        else:
            got = echoed[e].token if e < len(echoed) and echoed[e] is not None else "<end of echo>"
            raise EngineError(f"row {row.id} position {t}: engine echoed {got!r}, the reference has {ref.pieces[tok]!r} "
                              f"(the engine tokenized the row differently)", tag=f"oracle-kl/{row.id}")
    if not 0 <= len(echoed) - e <= generated:
        raise EngineError(f"row {row.id}: engine echoed {len(echoed)} tokens ({generated} generated), {e} matched the reference row of "
                          f"{len(row.tokens)}", tag=f"oracle-kl/{row.id}")
    return where


async def _row_prompt(client: EngineClient, row: ReferenceRow, ref: Reference, mode: str):
    if mode == "ids":
        return row.tokens
    text = ref.detokenize(row.tokens)
    if mode == "text":
        return text
    ids = await client.tokenize(text)
    return text if ids == row.tokens else row.tokens


async def oracle_kl(client: EngineClient, ref: Reference, s: GateSettings, thresholds: dict | None = None,
                    prompt_as: str = "auto") -> GateResult:
    """prompt_as: "ids" sends token ids, "text" the detokenized row, "auto" text when the engine's tokenizer gives back exactly the
    reference ids, else ids."""
    piece_ids, ambiguous = ref.piece_ids(), ref.ambiguous_texts()
    where_kl: list[dict] = []
    vocab = len(ref.pieces)

    def ids_in_vocabulary(row: ReferenceRow):
        """A reply naming a token id outside the reference's vocabulary is a protocol error (never journaled), not an
        index into it."""
        def check(c: Completion):
            for what, entries in (("prompt_logprobs", c.prompt_logprobs), ("logprobs", c.logprobs)):
                for j, tl in enumerate(entries or []):
                    if tl is None:
                        continue
                    ids = [*(tl.top_ids or {})] + ([tl.token_id] if tl.token_id is not None else [])
                    bad = [i for i in ids if not 0 <= i < vocab]
                    if bad:
                        raise EngineProtocolError(f"row {row.id}: {what}[{j}] names token id {bad[0]}, outside the "
                                                  f"reference's vocabulary of {vocab}", tag=f"oracle-kl/{row.id}")
        return check

    async def one(row: ReferenceRow):
        prompt = await _row_prompt(client, row, ref, prompt_as)
        if s.prompt_logprobs:  # vLLM: ids and logprobs of every prompt token, one entry per position
            c = await client.completion(prompt, max_tokens=1, prompt_logprobs=s.top_k, tag=f"oracle-kl/{row.id}",
                                        validate=ids_in_vocabulary(row))
            echoed = c.prompt_logprobs
            if echoed is None or len(echoed) != len(row.tokens):
                raise EngineError(f"row {row.id}: asked for prompt_logprobs, got {None if echoed is None else len(echoed)} "
                                  f"entries for {len(row.tokens)} tokens", tag=f"oracle-kl/{row.id}")
            where = {t: t for t in range(len(row.tokens))}
        else:
            c = await client.completion(prompt, max_tokens=1, logprobs=s.top_k, echo=True, tag=f"oracle-kl/{row.id}",
                                        validate=ids_in_vocabulary(row))
            _need_logprobs(c, f"row {row.id}")
            echoed = c.logprobs  # prompt tokens, then the generated one (which some engines leave out when it is special)
            where = align_echo(row, echoed, ref, generated=int(c.usage.get("completion_tokens", 1)))
        per = []
        for j, t in enumerate(row.scored):
            e = where.get(t)
            tl = echoed[e] if e is not None else None
            if tl is None:
                continue
            if tl.logprob is None and tl.top_ids and row.tokens[t] in tl.top_ids:
                tl = TokenLogprob(tl.token, tl.top_ids[row.tokens[t]], tl.top, row.tokens[t], tl.top_ids)
            if tl.logprob is None:
                continue
            eng = _engine_position(tl, row.tokens[t], piece_ids)
            pk = position_kl(row.logprobs[j], eng)
            pk.top1_agree = _top1_agree(tl, row.logprobs[j], ref, ambiguous)
            pk.engine_nll, pk.ref_nll = -float(tl.logprob), -float(row.logprobs[j][row.tokens[t]])
            per.append(pk)
            top = tl.top_ids or tl.top
            where_kl.append({"row": row.id, "position": t, "token": ref.pieces[row.tokens[t]], "kl": pk.kl,
                             "ref_tail_mass": pk.tail_mass, "reference_top1": ref.pieces[int(np.argmax(row.logprobs[j]))],
                             "engine_top1": max(top, key=top.get) if top else None, "top1_agree": pk.top1_agree})
        echoes[row.id] = (prompt, echoed, where)
        for d, kls in oracle_echo_shifts(row, echoed, where, piece_ids).items():
            shift_kl.setdefault(d, []).extend(kls)
        return row, per

    echoes: dict[str, tuple] = {}
    shift_kl: dict[int, list[float]] = {}
    rows, all_pos, by_row, covered = [], [], [], []
    for row, per in await asyncio.gather(*(one(r) for r in ref.rows)):
        covered.append((f"row {row.id}", len(per), len(row.scored)))
        if not per:
            continue
        all_pos += per
        by_row.append((row, per))
        told = [p.top1_agree for p in per if p.top1_agree is not None]
        rows.append({"row": row.id, "domain": row.domain, "positions": len(per), "kl_mean": float(np.mean([p.kl for p in per])),
                     "kl_max": max(p.kl for p in per), "top1": float(np.mean(told)) if told else None,
                     "tail_mass_max": max(p.tail_mass for p in per)})
    if not all_pos:
        return GateResult("oracle-kl", "error", error="no scored position could be compared")
    short = coverage_error("oracle-kl", covered, s, "scored positions")
    if short:
        return short
    few = too_little_evidence("oracle-kl", len(rows), len(all_pos), thresholds, "scored positions")
    if few:
        return few
    kl = np.array([p.kl for p in all_pos])
    tail = np.array([p.tail_mass for p in all_pos])
    told = [p.top1_agree for p in all_pos if p.top1_agree is not None]
    measured = {"kl_mean": float(kl.mean()), "top1": float(np.mean(told)) if told else float("nan"),
                "top1_undecidable": len(all_pos) - len(told),
                "kl_max": float(kl.max()), "kl_p99": float(np.quantile(kl, 0.99)), "positions": len(all_pos), "rows": len(rows),
                "coverage": len(all_pos) / sum(e for _, _, e in covered),
                "ref_tail_mass_mean": float(tail.mean()), "ref_tail_mass_max": float(tail.max()), "top_k": s.top_k,
                "estimator": "KL(ref||engine) on engine top-k ids + one tail bucket: a lower bound of the full KL; "
                             "the gap is tail_mass * KL(ref tail || engine tail), tail_mass reported as ref_tail_mass_*"}
    measured["rows_worst"] = sorted(rows, key=lambda r: -r["kl_mean"])[: s.worst]
    measured.update(oracle_kl_statistics(by_row, n_boot=s.bootstrap))
    worst = sorted(where_kl, key=lambda w: -w["kl"])[: s.worst]  # positions: row, position, token, both top-1s
    th = _thresholds("oracle-kl", thresholds)
    result = _verdict("oracle-kl", _checks(th, measured), measured=measured, worst=worst)
    if result.status == "fail" and not s.prompt_logprobs:
        await _diagnose_echo(client, ref, s, echoes, shift_kl, result)
    return result


def oracle_kl_statistics(by_row: list[tuple[ReferenceRow, list[PositionKL]]], n_boot: int = 2000, seed: int = 0) -> dict:
    """oracle-kl's numbers with compare's statistics (fidelity.measuring.stats: row-bootstrap 95% intervals stratified by
    domain), overall, per domain (`domains`) and domains-equal: KL(ref || engine) (the top-k estimator), top-1 agreement
    (decidable positions only), the engine's NLL and perplexity of the panel's tokens next to the reference's, ΔNLL
    (engine - reference) with its SE, and rows worse (rows whose mean NLL rose) with a sign test."""
    from ...measuring.stats import NONNEGATIVE, SHARE, SIGNED, UNIT, RatioBootstrap, RowGroups, ratio_scopes, sign_test

    groups = RowGroups.build(np.repeat(np.arange(len(by_row)), [len(p) for _, p in by_row]), [r.domain for r, _ in by_row])
    pos = [p for _, per in by_row for p in per]
    told = np.array([np.nan if p.top1_agree is None else float(p.top1_agree) for p in pos])
    eng, ref_nll = np.array([p.engine_nll for p in pos]), np.array([p.ref_nll for p in pos])
    has_nll = np.isfinite(eng) & np.isfinite(ref_nll)
    cols = {"n": np.ones(len(pos)), "kl": np.array([p.kl for p in pos]), "tail": np.array([p.tail_mass for p in pos]),
            "n_top1": np.isfinite(told).astype(float), "top1": np.nan_to_num(told), "n_nll": has_nll.astype(float),
            "engine_nll": np.where(has_nll, eng, 0.0), "ref_nll": np.where(has_nll, ref_nll, 0.0),
            "dnll": np.where(has_nll, eng - ref_nll, 0.0)}
    table = {k: groups.row_sums(v) for k, v in cols.items()}
    scored = table["n_nll"] > 0
    table["row_scored"] = scored.astype(float)
    table["row_worse"] = (scored & (table["dnll"] > 0)).astype(float)
    table["row_better"] = (scored & (table["dnll"] < 0)).astype(float)
    boot = RatioBootstrap.run(table, groups, n_boot, seed)
    S = lambda num, den, bounds: ratio_scopes(boot, num, den, groups, bounds=bounds)
    kl, top1, tail = S("kl", "n", NONNEGATIVE), S("top1", "n_top1", SHARE), S("tail", "n", UNIT)
    # an engine's logprob may exceed 0 by rounding (the client accepts up to 1e-3): its NLL is not bounded at 0
    eng_nll, r_nll = S("engine_nll", "n_nll", SIGNED), S("ref_nll", "n_nll", NONNEGATIVE)
    dnll, worse = S("dnll", "n_nll", SIGNED), S("row_worse", "row_scored", SHARE)
    exp = lambda v: float(np.exp(v)) if v is not None else None
    exp_ci = lambda ci: [exp(c) for c in ci] if ci is not None else None

    def scope(pick, sel_rows=None) -> dict:
        out = {"kl_mean": pick(kl).value, "kl_mean_ci95": pick(kl).ci(), "top1": pick(top1).value,
               "top1_ci95": pick(top1).ci(), "engine_nll_mean": pick(eng_nll).value,
               "engine_nll_mean_ci95": pick(eng_nll).ci(), "engine_ppl": exp(pick(eng_nll).value),
               "engine_ppl_ci95": exp_ci(pick(eng_nll).ci()), "ref_ppl": exp(pick(r_nll).value),
               "delta_nll_mean": pick(dnll).value, "delta_nll_mean_ci95": pick(dnll).ci(),
               "delta_nll_mean_se": pick(dnll).se(), "ref_tail_mass_mean": pick(tail).value}
        if sel_rows is None:
            out["rows_worse_share"], out["rows_worse_share_ci95"] = pick(worse).value, pick(worse).ci()
        else:
            w, b = int(table["row_worse"][sel_rows].sum()), int(table["row_better"][sel_rows].sum())
            out["rows_worse"] = {"rows": int(table["row_scored"][sel_rows].sum()), "worse": w, "better": b,
                                 "share": pick(worse).value, "share_ci95": pick(worse).ci(), "sign_test_p": sign_test(w, b)}
            out["positions"], out["rows"] = int(table["n"][sel_rows].sum()), int(sel_rows.sum())
        return out

    overall = scope(lambda e: e.overall, np.ones(groups.n_rows, bool))
    return {"statistics": {"overall": overall,
                           "domains": {name: scope(lambda e, i=i: e.domains[i], groups.row_domain == i)
                                       for i, name in enumerate(groups.domains)},
                           "domains_equal": scope(lambda e: e.equal)},
            "kl_mean_ci95": overall["kl_mean_ci95"], "engine_ppl": overall["engine_ppl"],
            "ref_ppl": overall["ref_ppl"], "delta_nll_mean": overall["delta_nll_mean"]}


async def _diagnose_echo(client: EngineClient, ref: Reference, s: GateSettings, echoes: dict, shift_kl: dict,
                         result: GateResult) -> None:
    """A failed oracle-kl: is the echo misaligned? Against the reference (entry t vs the reference at t + d), and against
    the engine itself: its own next-token answer after a whole row must be the echo's entry after the row's last token."""
    d, means = echo_shift(shift_kl)
    own = {}
    row = next((r for r in ref.rows if r.id in echoes and len(echoes[r.id][2]) >= 2), None)
    if row is not None:
        prompt, echoed, where = echoes[row.id]
        nxt = await client.completion(prompt, max_tokens=1, logprobs=s.top_k, tag=f"oracle-kl/next-token/{row.id}")
        after = where[max(where)] + 1  # where the echo should hold the distribution after the row
        if nxt.logprobs and nxt.logprobs[0].top:
            own = {k: [topk_kl(nxt.logprobs[0].top, echoed[after - k].top)] for k in (0, *ECHO_SHIFTS)
                   if 0 <= after - k < len(echoed) and echoed[after - k] is not None and echoed[after - k].top}
    own_d, own_means = echo_shift(own)
    if d == 0 and own_d == 0:
        return
    shift = d or own_d
    result.measured["echo_shift"] = shift
    note = misalignment_note(shift, means if d else own_means,
                             "against the reference" if d else f"row {row.id}: the engine's own next-token answer")
    if d and own_d == d:
        note += (f" Confirmed by the engine itself: its next-token logprobs after row {row.id} are the echo's entry "
                 f"{d} position{'s' * (abs(d) > 1)} {'earlier' if d > 0 else 'later'}.")
    result.notes.insert(0, note)


# ---- echo misalignment ----------------------------------------------------------------------------------------------

ECHO_SHIFTS = (-2, -1, 1, 2)
MISALIGNED_FACTOR = 10.0  # a shift is named when it fits this many times better than the echo as returned


SAME_ENGINE_KL = 1e-3  # an engine's two answers for one context differ by less (when d = 0 cannot be paired)


def echo_shift(kl_by_shift: dict[int, list[float]]) -> tuple[int, dict[int, float]]:
    """(the shift d whose pairing fits best, mean divergence per shift): entry of position t compared with the
    distribution of position t + d. 0 unless some d != 0 fits MISALIGNED_FACTOR times better than d = 0 (or, where
    no entry pairs at d = 0, fits within SAME_ENGINE_KL)."""
    means = {d: float(np.mean(v)) for d, v in kl_by_shift.items() if v}
    if not means:
        return 0, means
    best = min(means, key=lambda d: (means[d], abs(d)))
    if best == 0:
        return 0, means
    fits = means[best] * MISALIGNED_FACTOR < means[0] if 0 in means else means[best] <= SAME_ENGINE_KL
    return (best if fits else 0), means


def misalignment_note(d: int, means: dict[int, float], what: str) -> str:
    which = "after" if d > 0 else "before"
    n = abs(d)
    fix = ("llama-cpp-python does this when a prompt does not start with BOS. Fix to try: start every prompt with the BOS "
           "token (gate.toml [settings] prompt_prefix = the BOS text; for oracle-kl a panel and store whose rows begin "
           "with BOS), or gate an engine that returns prompt_logprobs by id ([settings] prompt_logprobs = true, vLLM)"
           if d == 1 else
           "Fix to try: check how the engine builds echo logprobs (the entry for a token must hold the distribution that "
           "predicted it), or use prompt_logprobs ([settings] prompt_logprobs = true, vLLM)")
    returned = f"{means[0]:.4g}" if 0 in means else "no entry"
    return (f"echo misalignment: the engine's echo logprobs are shifted by {d:+d} position{'s' * (n > 1)}: the entry for "
            f"each token holds the distribution of the token {n} {which} it ({what}: mean KL {returned} as returned, "
            f"{means[d]:.4g} shifted by {d:+d}); the measurement above compares misaligned positions. {fix}")


def oracle_echo_shifts(row: "ReferenceRow", echoed: list, where: dict[int, int], piece_ids: dict[str, int],
                       shifts=(0, *ECHO_SHIFTS)) -> dict[int, list[float]]:
    """KL(reference at position t + d || the engine's entry for position t), per shift d, over this row's scored
    positions (each entry's values come from one distribution, whichever position it belongs to)."""
    index = {t: j for j, t in enumerate(row.scored)}
    out: dict[int, list[float]] = {d: [] for d in shifts}
    for t, e in where.items():
        tl = echoed[e] if e is not None and e < len(echoed) else None
        if tl is None or tl.logprob is None:
            continue
        eng = _engine_position(tl, row.tokens[t], piece_ids)
        for d in shifts:
            j = index.get(t + d)
            if j is not None:
                out[d].append(position_kl(row.logprobs[j], eng).kl)
    return out


def decode_echo_shifts(decoded: list[TokenLogprob], echo: list[TokenLogprob], start: int,
                       shifts=(0, *ECHO_SHIFTS)) -> dict[int, list[float]]:
    """KL(the decode's distribution for generated token i || the echo's entry start + i - d), per shift d: with the echo
    shifted by d, entry p holds the distribution of position p + d."""
    out: dict[int, list[float]] = {d: [] for d in shifts}
    for i, a in enumerate(decoded):
        for d in shifts:
            e = start + i - d
            if a.top and 0 <= e < len(echo) and echo[e] is not None and echo[e].top:
                out[d].append(topk_kl(a.top, echo[e].top))
    return out
