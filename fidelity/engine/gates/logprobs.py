"""Comparing an engine's per-token logprobs: with another answer of the same engine (`compare_positions`, `topk_kl`) and
with the reference's full distribution (`position_kl`, the top-k estimator)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..client import Completion, EngineError, TokenLogprob


def topk_kl(p_top: dict[str, float], q_top: dict[str, float]) -> float:
    """KL(p || q) between two top-k lists coarsened onto (keys both return) + one tail bucket. Both distributions are
    known exactly on that partition, so this is an exact KL of the coarsened pair and a lower bound of the
    full-vocabulary KL."""
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


def need_logprobs(c: Completion, what: str):
    if c.logprobs is None:
        raise EngineError(f"{what}: the engine returned no logprobs")


@dataclass


class PositionKL:
    # KL(ref || engine) on the partition {engine's returned ids} + one tail bucket: a lower bound of the full KL
    kl: float
    # reference probability outside the engine's returned ids: the full KL exceeds `kl` by tail_mass * KL(tails)
    tail_mass: float
    top1_agree: bool | None  # None: the engine's text-keyed answer cannot tell
    engine_nll: float = math.nan  # -log q_engine(true token), from the engine's logprob of it
    ref_nll: float = math.nan  # -log p_ref(true token)


def position_kl(ref_lp: np.ndarray, engine: dict[int, float]) -> PositionKL:
    """The top-k estimator. The engine gives log q for a set E of ids (its top-k and the actual token); the reference
    gives log p for every id. On the partition {x} for x in E, plus T = everything else, both distributions are known
    exactly, so KL_E = sum_E p log(p/q) + p(T) log(p(T)/q(T)) is exact for the coarsened pair and, by the
    data-processing inequality, never above the full-vocabulary KL. The gap is p(T) * KL(p|T || q|T): it is small when
    p(T) is, and p(T) is reported with it. When the engine returns the full distribution, T is empty and KL_E is the
    full KL."""
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


def engine_position(tl: TokenLogprob, actual: int, piece_ids: dict[str, int]) -> dict[int, float]:
    """The engine's answer at one position as {token id: logprob}: its top list (by id, or by text where the text names
    one id) and the actual token's logprob."""
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

