"""Echo diagnosis: when oracle-kl or decode-vs-prefill fails, is the engine's echo shifted (entry t holding the
distribution of position t + d)? oracle-kl checks against the reference and against the engine's own next-token answer
after a row (`diagnose_echo`), decode-vs-prefill against the decode's own logprobs; a fitting shift is named first in
the notes (`measured["echo_shift"]`) with the fix to try (llama-cpp-python shifts by +1 for prompts without BOS)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..client import EngineClient, TokenLogprob
from ..reference import ReferenceRow
from .logprobs import engine_position, position_kl, topk_kl
from .settings import GateResult

ECHO_SHIFTS = (-2, -1, 1, 2)
MISALIGNED_FACTOR = 10.0  # a shift is named when it fits this many times better than the echo as returned
SAME_ENGINE_KL = 1e-3  # an engine's two answers for one context differ by less (when d = 0 cannot be paired)


@dataclass


class EchoedRow:
    """A panel row as oracle-kl sent it and the engine echoed it back: `where` maps a reference position to its
    entry."""

    row_id: str
    prompt: list[int] | str
    echoed: list[TokenLogprob | None]
    where: dict[int, int]


async def diagnose_echo(client: EngineClient, probe: EchoedRow | None, top_k: int, shift_kl: dict[int, list[float]],
                        result: GateResult) -> None:
    """A failed oracle-kl: is the echo misaligned? Against the reference (`shift_kl`: entry t vs the reference at t +
    d), and against the engine itself: its own next-token answer after the whole `probe` row must be the echo's entry
    after the row's last token."""
    d, means = echo_shift(shift_kl)
    own = {}
    if probe is not None:
        echoed = probe.echoed
        nxt = await client.completion(
            probe.prompt, max_tokens=1, logprobs=top_k, tag=f"oracle-kl/next-token/{probe.row_id}"
        )
        after = probe.where[max(probe.where)] + 1  # where the echo should hold the distribution after the row
        if nxt.logprobs and nxt.logprobs[0].top:
            own = {k: [topk_kl(nxt.logprobs[0].top, echoed[after - k].top)] for k in (0, *ECHO_SHIFTS)
                   if 0 <= after - k < len(echoed) and echoed[after - k] is not None and echoed[after - k].top}
    own_d, own_means = echo_shift(own)
    if d == 0 and own_d == 0:
        return
    shift = d or own_d
    result.measured["echo_shift"] = shift
    note = misalignment_note(
        shift,
        means if d else own_means,
        "against the reference" if d else f"row {probe.row_id}: the engine's own next-token answer",
    )
    if d and own_d == d:
        note += (
            f" Confirmed by the engine itself: its next-token logprobs after row {probe.row_id} are the echo's entry "
            f"{d} position{'s' * (abs(d) > 1)} {'earlier' if d > 0 else 'later'}."
        )
    result.notes.insert(0, note)


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
    fix = (
        "llama-cpp-python does this when a prompt does not start with BOS. Fix to try: start every prompt with the BOS "
        "token (gate.toml [settings] prompt_prefix = the BOS text; for oracle-kl a panel and store whose rows begin "
        "with BOS), or gate an engine that returns prompt_logprobs by id ([settings] prompt_logprobs = true, vLLM)"
        if d == 1
        else "Fix to try: check how the engine builds echo logprobs (the entry for a token must hold the distribution "
        "that predicted it), or use prompt_logprobs ([settings] prompt_logprobs = true, vLLM)"
    )
    returned = f"{means[0]:.4g}" if 0 in means else "no entry"
    return (
        f"echo misalignment: the engine's echo logprobs are shifted by {d:+d} position{'s' * (n > 1)}: the entry for "
        f"each token holds the distribution of the token {n} {which} it ({what}: mean KL {returned} as returned, "
        f"{means[d]:.4g} shifted by {d:+d}); the measurement above compares misaligned positions. {fix}"
    )


def oracle_echo_shifts(row: ReferenceRow, echoed: list, where: dict[int, int], piece_ids: dict[str, int],
                       shifts=(0, *ECHO_SHIFTS)) -> dict[int, list[float]]:
    """KL(reference at position t + d || the engine's entry for position t), per shift d, over this row's scored
    positions (each entry's values come from one distribution, whichever position it belongs to)."""
    index = {t: j for j, t in enumerate(row.scored)}
    out: dict[int, list[float]] = {d: [] for d in shifts}
    for t, e in where.items():
        tl = echoed[e] if e is not None and e < len(echoed) else None
        if tl is None or tl.logprob is None:
            continue
        eng = engine_position(tl, row.tokens[t], piece_ids)
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
