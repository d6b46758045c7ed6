"""The self-consistency gates: the engine against itself, no reference needed.

- batch-invariance: each prompt alone vs inside concurrent batches; greedy continuations and per-token logprobs must be
  equal.
- decode-vs-prefill: greedy generation with logprobs vs the same tokens prefilled with `echo` (a failure checks whether
  the echo is shifted against the decode's own logprobs, `echo.py`).
- prefix-cache: a long prompt cold vs warm, and a shared prefix with different suffixes cold vs warm (generated tokens,
  no echo), with the engine's own count of cached prompt tokens where it states one.
"""
from __future__ import annotations

import asyncio
import secrets

import numpy as np

from ..client import Completion, EngineClient, TokenLogprob
from .echo import decode_echo_shifts, echo_shift, misalignment_note
from .kinds import GateCall, check_thresholds, gate_kind, run_gate
from .logprobs import compare_positions, need_logprobs
from .settings import (GateResult, GateSettings, coverage_error, gate_thresholds, threshold_checks, too_little_evidence,
                       verdict)


# ---- batch-invariance ------------------------------------------------------------------------------------------------

async def batch_invariance(client: EngineClient, s: GateSettings, thresholds: dict | None = None) -> GateResult:
    prompts = [s.prompt_prefix + p for p in s.prompts]
    notes = []
    if client.config.concurrency < max(s.batch_sizes):
        notes.append(
            f"client concurrency {client.config.concurrency} < batch size {max(s.batch_sizes)}: batches are smaller "
            f"than asked"
        )

    async def one(i: int, tag: str) -> Completion:
        c = await client.completion(
            prompts[i], max_tokens=s.max_tokens, logprobs=s.top_k, tag=f"batch-invariance/{tag}/{i}"
        )
        need_logprobs(c, f"prompt {i}")
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
    th = gate_thresholds("batch-invariance", thresholds)
    return verdict("batch-invariance", threshold_checks(th, measured), measured=measured, worst=worst, notes=notes)


@gate_kind("batch-invariance", check=check_thresholds)


async def _run_batch_invariance(call: GateCall, name: str, thresholds: dict | None) -> GateResult:
    return await run_gate(name, batch_invariance, call.client, call.settings, thresholds)


# ---- decode-vs-prefill -----------------------------------------------------------------------------------------------


async def decode_vs_prefill(client: EngineClient, s: GateSettings, thresholds: dict | None = None) -> GateResult:
    """Generations run concurrently; each prefill then runs alone right after an unrelated flush request, so an engine
    with a single-entry prefix cache recomputes the prompt instead of replaying the decode's own cache."""
    prompts = [s.prompt_prefix + p for p in s.prompts]
    flush_prompt = s.prompt_prefix + "Unrelated text to evict single-entry caches."

    async def generate(i: int) -> Completion:
        gen = await client.completion(
            prompts[i], max_tokens=s.max_tokens, logprobs=s.top_k, tag=f"decode-vs-prefill/gen/{i}"
        )
        need_logprobs(gen, f"prompt {i} generation")
        return gen

    gens = await asyncio.gather(*(generate(i) for i in range(len(prompts))))
    done, shift_kl = [], {}
    for i, gen in enumerate(gens):
        await client.completion(flush_prompt, max_tokens=1, tag=f"decode-vs-prefill/flush/{i}")
        pre = await client.completion(prompts[i] + gen.text, max_tokens=1, logprobs=s.top_k, echo=True,
                                      tag=f"decode-vs-prefill/prefill/{i}")
        need_logprobs(pre, f"prompt {i} prefill")
        done.append((i, gen, gen.logprobs, _prefilled_span(pre, gen.logprobs)))
        for d, kls in decode_echo_shifts(gen.logprobs, pre.logprobs, _prefilled_start(pre, gen.logprobs)).items():
            shift_kl.setdefault(d, []).extend(kls)

    rows, notes = [], []
    for i, gen, decoded, prefilled in done:
        if [t.token for t in prefilled] != [t.token for t in decoded]:
            notes.append(
                f"prompt {i}: prompt+generation re-tokenizes differently; compared up to the first differing token"
            )
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
        return GateResult(
            "decode-vs-prefill", "error", error="no generated position could be aligned with its prefill", notes=notes
        )
    few = too_little_evidence("decode-vs-prefill", sum(r["positions"] > 0 for r in rows), n, thresholds,
                              "aligned generated positions")
    if few:
        few.notes = notes
        return few
    measured = {"max_abs_dlogprob": max(r["max_abs_dlogprob"] for r in rows),
                "kl_mean": float(sum(r["kl_mean"] * r["positions"] for r in rows) / n), "positions": n}
    scored = [r for r in rows if r["positions"]]
    worst_prompt = max(scored, key=lambda r: r["kl_mean"])        # self-consistency "worst mean": per prompt
    measured.update(
        {
            "worst_prompt_kl_mean": worst_prompt["kl_mean"],
            "worst_prompt": worst_prompt["prompt"],
            "prompts": [{k: r[k] for k in ("prompt", "positions", "kl_mean", "max_abs_dlogprob")} for r in rows],
        }
    )
    worst = sorted(rows, key=lambda r: -r["max_abs_dlogprob"])[: s.worst]
    th = gate_thresholds("decode-vs-prefill", thresholds)
    result = verdict("decode-vs-prefill", threshold_checks(th, measured), measured=measured, worst=worst, notes=notes)
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
    """Where the generated tokens start in the echo: it ends with the prompt+generation, then (usually) the one token
    the prefill request generated, which some engines leave out; take the placement whose tokens match."""
    echo, n = pre.logprobs, len(decoded)
    n_gen = int(pre.usage.get("completion_tokens", 1))
    want = [t.token for t in decoded]
    starts = [len(echo) - n_gen - n, len(echo) - n] if n_gen else [len(echo) - n]
    for start in starts:
        if start >= 0 and [t.token for t in echo[start:start + n]] == want:
            return start
    return max(starts[0], 0)


@gate_kind("decode-vs-prefill", check=check_thresholds)


async def _run_decode_vs_prefill(call: GateCall, name: str, thresholds: dict | None) -> GateResult:
    return await run_gate(name, decode_vs_prefill, call.client, call.settings, thresholds)


# ---- prefix-cache ----------------------------------------------------------------------------------------------------


PREFIX_CACHE_NOTE = ("cold: each case's first request (its prompts begin with a nonce of their own, so nothing cached "
                     "them before); warm: the same prompt after the engine has seen it (shared-prefix cases: after a "
                     "request with the same prefix and another suffix); compared: the generated tokens and logprobs")


async def prefix_cache(client: EngineClient, s: GateSettings, thresholds: dict | None = None) -> GateResult:
    """Cold vs warm requests with a long shared prefix: the generated tokens and their logprobs must not change when the
    engine serves the prefix from its cache. Sequential on purpose: the order of requests makes a computation cold or
    warm. Each case's prompts begin with a nonce of its own, so no earlier request (of this run or another) can have
    cached them: a case's first request is cold on any cache. "long prompt": the same prompt again right after;
    "shared prefix + suffix j": the prompt again after a request with the same prefix and another suffix (a
    single-entry cache then holds the prefix and computes the suffix). No echo: an engine may skip its cache for a
    request that asks for prompt logprobs (vLLM does). Whether the warm requests were served from the cache is the
    engine's own count of cached prompt tokens (`Completion.cached_tokens`); an engine that states one and served no
    warm request from its cache leaves the gate nothing to judge (error), one that states none gets the verdict with
    the note that cache use is not observable."""
    body = " ".join((s.prompts * s.long_prompt_repeats)[: len(s.prompts) * s.long_prompt_repeats // 2 + 1])
    suffixes = [" " + p for p in s.prompts[: max(2, len(s.prompts) // 2)]]

    def fresh_prefix() -> str:
        return f"{s.prompt_prefix}[{secrets.token_hex(4)}] {body}"

    async def ask(prompt: str, tag: str) -> Completion:
        c = await client.completion(prompt, max_tokens=s.max_tokens, logprobs=s.top_k, tag=f"prefix-cache/{tag}")
        need_logprobs(c, tag)
        return c

    cases = []
    long_prompt = fresh_prefix()
    cold = await ask(long_prompt, "long/cold")
    cases.append(("long prompt", cold, None, await ask(long_prompt, "long/warm")))
    for j, suffix in enumerate(suffixes):
        prefix = fresh_prefix()
        c = await ask(prefix + suffix, f"suffix{j}/cold")
        prime = await ask(prefix + suffixes[(j + 1) % len(suffixes)], f"suffix{j}/prime")
        cases.append((f"shared prefix + suffix {j}", c, prime, await ask(prefix + suffix, f"suffix{j}/warm")))
    rows = []
    for label, c, prime, w in cases:
        d = compare_positions(c.logprobs, w.logprobs)
        rows.append({"case": label, "identical": d.identical and c.text == w.text, "max_abs_dlogprob": d.max_abs,
                     "first_divergence": d.first_divergence, "positions": len(c.logprobs), "compared": d.compared,
                     "expected": d.expected, "prompt_tokens": w.usage.get("prompt_tokens"),
                     "cold_cached_tokens": c.cached_tokens, "prime_cached_tokens": prime and prime.cached_tokens,
                     "warm_cached_tokens": w.cached_tokens})
    short = coverage_error("prefix-cache", [(r["case"], r["compared"], r["expected"]) for r in rows], s,
                           "generated positions")
    if short:
        return short
    few = too_little_evidence("prefix-cache", sum(r["compared"] > 0 for r in rows), sum(r["compared"] for r in rows),
                              thresholds, "generated positions")
    if few:
        return few
    cache = cache_use(rows)
    if cache["cache"] == "not used":
        return GateResult("prefix-cache", "error", measured=cache, worst=rows[: s.worst],
                          error="could not run: the engine states that it served none of the warm requests' prompt "
                                "tokens from its prefix cache (cached tokens 0), so cold and warm were both computed "
                                "and the cache was not tested (is prefix caching on? are the prompts shorter than its "
                                "cache block? raise [settings] long_prompt_repeats)")
    measured = {"identical": float(np.mean([r["identical"] for r in rows])),
                "max_abs_dlogprob": max(r["max_abs_dlogprob"] for r in rows), "cases": len(rows),
                "long_prompt_tokens": int(cold.usage.get("prompt_tokens", 0)), **cache}
    notes = [PREFIX_CACHE_NOTE]
    if cache["cache"] == "not observable":
        notes.insert(0, "cache use not observable: the engine states no cached prompt tokens (usage."
                        "prompt_tokens_details.cached_tokens or timings.cache_n), so cold and warm may both have been "
                        "computed; the verdict holds for the cache only if the engine used it")
    worst = sorted(rows, key=lambda r: (r["identical"], -r["max_abs_dlogprob"]))[: s.worst]
    th = gate_thresholds("prefix-cache", thresholds)
    return verdict("prefix-cache", threshold_checks(th, measured), measured=measured, worst=worst, notes=notes)


def cache_use(rows: list[dict]) -> dict:
    """What the engine said about its prefix cache over the gate's cases: "hit" (some warm request was served prompt
    tokens from it), "not used" (it states counts, all warm ones 0) or "not observable" (it states none)."""
    counts = [r[k] for r in rows for k in ("cold_cached_tokens", "prime_cached_tokens", "warm_cached_tokens")
              if r[k] is not None]
    warm = [r["warm_cached_tokens"] for r in rows if r["warm_cached_tokens"] is not None]
    if not warm:
        return {"cache": "not observable"}
    return {"cache": "hit" if any(warm) else "not used", "cache_hit_cases": sum(n > 0 for n in warm),
            "warm_cached_tokens_min": min(warm), "cached_tokens_total": sum(counts)}


@gate_kind("prefix-cache", check=check_thresholds)


async def _run_prefix_cache(call: GateCall, name: str, thresholds: dict | None) -> GateResult:
    return await run_gate(name, prefix_cache, call.client, call.settings, thresholds)
