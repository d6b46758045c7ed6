"""oracle-kl: the engine's prompt logprobs on the reference store's panel vs the oracle's exact distributions, scored
row by row (`score_row`) with the top-k estimator (`logprobs.position_kl`) and summarized with compare's statistics.
A failure checks whether the engine's echo is shifted (`echo.diagnose_echo`)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from ...measuring.bootstrap import (RatioBootstrap, RowGroups, add_rows_worse, ratio_scopes, row_scopes, rows_worse,
                                   rows_worse_share)
from ...measuring.intervals import NONNEGATIVE, SHARE, SIGNED, UNIT
from ..client import Completion, EngineClient, EngineError, EngineProtocolError, TokenLogprob
from ..reference import Reference, ReferenceRow
from .echo import EchoedRow, diagnose_echo, oracle_echo_shifts
from .kinds import GateCall, check_thresholds, gate_kind, run_gate
from .logprobs import PositionKL, engine_position, need_logprobs, position_kl
from .settings import (GateResult, GateSettings, coverage_error, gate_thresholds, threshold_checks, too_little_evidence,
                       verdict)

ESTIMATOR = ("KL(ref||engine) on engine top-k ids + one tail bucket: a lower bound of the full KL; the gap is "
             "tail_mass * KL(ref tail || engine tail), tail_mass reported as ref_tail_mass_*")


async def oracle_kl(client: EngineClient, ref: Reference, s: GateSettings, thresholds: dict | None = None,
                    prompt_as: str = "auto") -> GateResult:
    """prompt_as: "ids" sends token ids, "text" the detokenized row, "auto" text when the engine's tokenizer gives back
    exactly the reference ids, else ids."""
    piece_ids, ambiguous = ref.piece_ids(), ref.ambiguous_texts()
    scored = await asyncio.gather(*(score_row(client, ref, row, s, prompt_as, piece_ids=piece_ids, ambiguous=ambiguous)
                                    for row in ref.rows))
    covered = [(f"row {r.row.id}", len(r.positions), len(r.row.scored)) for r in scored]
    answered = [r for r in scored if r.positions]
    if not answered:
        return GateResult("oracle-kl", "error", error="no scored position could be compared")
    short = coverage_error("oracle-kl", covered, s, "scored positions")
    if short:
        return short
    few = too_little_evidence("oracle-kl", len(answered), sum(len(r.positions) for r in answered), thresholds,
                              "scored positions")
    if few:
        return few
    measured = oracle_kl_measured(answered, covered, s)
    worst = sorted((w for r in scored for w in r.records), key=lambda w: -w["kl"])[: s.worst]  # positions
    checks = threshold_checks(gate_thresholds("oracle-kl", thresholds), measured)
    result = verdict("oracle-kl", checks, measured=measured, worst=worst)
    if result.status == "fail" and not s.prompt_logprobs:
        shift_kl: dict[int, list[float]] = {}
        for r in scored:
            for d, kls in r.shift_kl.items():
                shift_kl.setdefault(d, []).extend(kls)
        probe = next((r.echo for r in scored if len(r.echo.where) >= 2), None)
        await diagnose_echo(client, probe, s.top_k, shift_kl, result)
    return result


@gate_kind("oracle-kl", check=check_thresholds)


async def _run_oracle_kl(call: GateCall, name: str, thresholds: dict | None) -> GateResult:
    if not call.store:
        return GateResult(name, "error", error="oracle-kl needs --reference-store")
    try:
        ref = call.load_reference()
    except Exception as e:  # a missing/incompatible store means this gate could not run
        return GateResult(name, "error", error=f"reference store {call.store}: {e}")
    return await run_gate(name, oracle_kl, call.client, ref, call.settings, thresholds, prompt_as=call.prompt_as)


# ---- one row ---------------------------------------------------------------------------------------------------------


@dataclass
class ScoredRow:
    """One panel row as the engine answered it: its compared positions, one record per position for the gate's worst
    list (row, position, token, KL, both top-1s), its KLs per echo shift and the echo itself (for the echo
    diagnosis)."""

    row: ReferenceRow
    positions: list[PositionKL]
    records: list[dict]
    shift_kl: dict[int, list[float]]
    echo: EchoedRow


async def score_row(client: EngineClient, ref: Reference, row: ReferenceRow, s: GateSettings, prompt_as: str, *,
                    piece_ids: dict[str, int], ambiguous: set[str]) -> ScoredRow:
    """Ask the engine for its logprobs of one row's tokens, align them with the reference, and score each scored
    position the engine gave a logprob for (`piece_ids` / `ambiguous`: the reference's text keys,
    `Reference.piece_ids()` and `.ambiguous_texts()`)."""
    prompt = await _row_prompt(client, row, ref, prompt_as)
    echoed, where = await _prompt_logprobs(client, ref, row, prompt, s)
    positions, records = [], []
    for j, t in enumerate(row.scored):
        e = where.get(t)
        tl = echoed[e] if e is not None else None
        if tl is None:
            continue
        if tl.logprob is None and tl.top_ids and row.tokens[t] in tl.top_ids:
            tl = TokenLogprob(tl.token, tl.top_ids[row.tokens[t]], tl.top, row.tokens[t], tl.top_ids)
        if tl.logprob is None:
            continue
        pk = position_kl(row.logprobs[j], engine_position(tl, row.tokens[t], piece_ids))
        pk.top1_agree = _top1_agree(tl, row.logprobs[j], ref, ambiguous)
        pk.engine_nll, pk.ref_nll = -float(tl.logprob), -float(row.logprobs[j][row.tokens[t]])
        positions.append(pk)
        top = tl.top_ids or tl.top
        records.append({"row": row.id, "position": t, "token": ref.pieces[row.tokens[t]], "kl": pk.kl,
                        "ref_tail_mass": pk.tail_mass, "reference_top1": ref.pieces[int(np.argmax(row.logprobs[j]))],
                        "engine_top1": max(top, key=top.get) if top else None, "top1_agree": pk.top1_agree})
    return ScoredRow(row, positions, records, oracle_echo_shifts(row, echoed, where, piece_ids),
                     EchoedRow(row.id, prompt, echoed, where))


async def _prompt_logprobs(client: EngineClient, ref: Reference, row: ReferenceRow, prompt,
                           s: GateSettings) -> tuple[list[TokenLogprob | None], dict[int, int]]:
    """The engine's logprob entries for the row's tokens and where each reference position is among them."""
    tag, validate = f"oracle-kl/{row.id}", ids_in_vocabulary(row, len(ref.pieces))
    if s.prompt_logprobs:  # vLLM: ids and logprobs of every prompt token, one entry per position
        c = await client.completion(prompt, max_tokens=1, prompt_logprobs=s.top_k, tag=tag, validate=validate)
        echoed = c.prompt_logprobs
        if echoed is None or len(echoed) != len(row.tokens):
            raise EngineError(f"row {row.id}: asked for prompt_logprobs, got {None if echoed is None else len(echoed)} "
                              f"entries for {len(row.tokens)} tokens", tag=tag)
        return echoed, {t: t for t in range(len(row.tokens))}
    c = await client.completion(prompt, max_tokens=1, logprobs=s.top_k, echo=True, tag=tag, validate=validate)
    need_logprobs(c, f"row {row.id}")
    echoed = c.logprobs  # prompt tokens, then the generated one (which some engines leave out when it is special)
    return echoed, align_echo(row, echoed, ref, generated=int(c.usage.get("completion_tokens", 1)))


def ids_in_vocabulary(row: ReferenceRow, vocab: int):
    """A reply check: a reply naming a token id outside the reference's vocabulary of `vocab` ids is a protocol error
    (never journaled), not an index into it."""
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


async def _row_prompt(client: EngineClient, row: ReferenceRow, ref: Reference, mode: str):
    if mode == "ids":
        return row.tokens
    text = ref.detokenize(row.tokens)
    if mode == "text":
        return text
    ids = await client.tokenize(text)
    return text if ids == row.tokens else row.tokens


def _top1_agree(tl: TokenLogprob, ref_lp: np.ndarray, ref: Reference, ambiguous: set[str]) -> bool | None:
    """Engine top-1 vs reference top-1: by id when the engine gives ids, else by text; None (not counted) when the text
    cannot tell (either top-1 is a text several ids share: text-keyed top lists also lose entries to such
    collisions)."""
    best = int(np.argmax(ref_lp))
    if tl.top_ids:
        return max(tl.top_ids, key=tl.top_ids.get) == best
    if not tl.top:
        return None
    key, piece = max(tl.top, key=tl.top.get), ref.pieces[best]
    if key in ambiguous or piece in ambiguous or (best in ref.special_ids and key == ""):
        return None
    return key == piece


def _same_token(tl: TokenLogprob | None, tok: int, ref: Reference) -> bool:
    if tl is None:
        return True  # vLLM's first prompt position
    if tl.token_id is not None:
        return tl.token_id == tok
    piece = ref.pieces[tok]
    return tl.token == piece or "\ufffd" in piece or (tok in ref.special_ids and tl.token == "")


def align_echo(
    row: ReferenceRow, echoed: list[TokenLogprob | None], ref: Reference, generated: int = 0
) -> dict[int, int]:
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
            raise EngineError(
                f"row {row.id} position {t}: engine echoed {got!r}, the reference has {ref.pieces[tok]!r} "
                f"(the engine tokenized the row differently)",
                tag=f"oracle-kl/{row.id}",
            )
    if not 0 <= len(echoed) - e <= generated:
        raise EngineError(
            f"row {row.id}: engine echoed {len(echoed)} tokens ({generated} generated), {e} matched the reference row "
            f"of {len(row.tokens)}",
            tag=f"oracle-kl/{row.id}",
        )
    return where


# ---- the gate's numbers ----------------------------------------------------------------------------------------------


def oracle_kl_measured(answered: list[ScoredRow], covered: list[tuple[str, int, int]], s: GateSettings) -> dict:
    """The gate's measured block: KL, top-1 and the reference's tail mass over every compared position, the worst rows
    and the row-bootstrap statistics (`oracle_kl_statistics`). `covered`: (row, compared, scored) of every row."""
    all_pos = [p for r in answered for p in r.positions]
    rows = [_row_summary(r) for r in answered]
    kl = np.array([p.kl for p in all_pos])
    tail = np.array([p.tail_mass for p in all_pos])
    told = [p.top1_agree for p in all_pos if p.top1_agree is not None]
    measured = {
        "kl_mean": float(kl.mean()),
        "top1": float(np.mean(told)) if told else float("nan"),
        "top1_undecidable": len(all_pos) - len(told),
        "kl_max": float(kl.max()),
        "kl_p99": float(np.quantile(kl, 0.99)),
        "positions": len(all_pos),
        "rows": len(rows),
        "coverage": len(all_pos) / sum(e for _, _, e in covered),
        "ref_tail_mass_mean": float(tail.mean()),
        "ref_tail_mass_max": float(tail.max()),
        "top_k": s.top_k,
        "estimator": ESTIMATOR,
    }
    measured["rows_worst"] = sorted(rows, key=lambda r: -r["kl_mean"])[: s.worst]
    measured.update(oracle_kl_statistics([(r.row, r.positions) for r in answered], n_boot=s.bootstrap))
    return measured


def _row_summary(r: ScoredRow) -> dict:
    per = r.positions
    told = [p.top1_agree for p in per if p.top1_agree is not None]
    return {
        "row": r.row.id,
        "domain": r.row.domain,
        "positions": len(per),
        "kl_mean": float(np.mean([p.kl for p in per])),
        "kl_max": max(p.kl for p in per),
        "top1": float(np.mean(told)) if told else None,
        "tail_mass_max": max(p.tail_mass for p in per),
    }


def oracle_kl_statistics(
    by_row: list[tuple[ReferenceRow, list[PositionKL]]], n_boot: int = 2000, seed: int = 0
) -> dict:
    """oracle-kl's numbers with compare's statistics (fidelity.measuring.stats: row-bootstrap 95% intervals stratified
    by domain), overall, per domain (`domains`) and domains-equal: KL(ref || engine) (the top-k estimator), top-1
    agreement (decidable positions only), the engine's NLL and perplexity of the panel's tokens next to the reference's,
    ΔNLL (engine - reference) with its SE, and rows worse (rows whose mean NLL rose) with a sign test."""
    groups = RowGroups.build(
        np.repeat(np.arange(len(by_row)), [len(p) for _, p in by_row]), [r.domain for r, _ in by_row]
    )
    pos = [p for _, per in by_row for p in per]
    told = np.array([np.nan if p.top1_agree is None else float(p.top1_agree) for p in pos])
    eng, ref_nll = np.array([p.engine_nll for p in pos]), np.array([p.ref_nll for p in pos])
    has_nll = np.isfinite(eng) & np.isfinite(ref_nll)
    cols = {"n": np.ones(len(pos)), "kl": np.array([p.kl for p in pos]), "tail": np.array([p.tail_mass for p in pos]),
            "n_top1": np.isfinite(told).astype(float), "top1": np.nan_to_num(told), "n_nll": has_nll.astype(float),
            "engine_nll": np.where(has_nll, eng, 0.0), "ref_nll": np.where(has_nll, ref_nll, 0.0),
            "dnll": np.where(has_nll, eng - ref_nll, 0.0)}
    table = {k: groups.row_sums(v) for k, v in cols.items()}
    add_rows_worse(table, "n_nll", "dnll")
    boot = RatioBootstrap.run(table, groups, n_boot, seed)

    def S(num, den, bounds):
        return ratio_scopes(boot, num, den, groups, bounds=bounds)

    kl, top1, tail = S("kl", "n", NONNEGATIVE), S("top1", "n_top1", SHARE), S("tail", "n", UNIT)
    # an engine's logprob may exceed 0 by rounding (the client accepts up to 1e-3): its NLL is not bounded at 0
    eng_nll, r_nll = S("engine_nll", "n_nll", SIGNED), S("ref_nll", "n_nll", NONNEGATIVE)
    dnll, worse = S("dnll", "n_nll", SIGNED), rows_worse_share(boot, groups)

    def exp(v):
        return float(np.exp(v)) if v is not None else None

    def exp_ci(ci):
        return [exp(c) for c in ci] if ci is not None else None

    def scope(where) -> dict:
        pick = where.pick
        out = {"kl_mean": pick(kl).value, "kl_mean_ci95": pick(kl).ci(), "top1": pick(top1).value,
               "top1_ci95": pick(top1).ci(), "engine_nll_mean": pick(eng_nll).value,
               "engine_nll_mean_ci95": pick(eng_nll).ci(), "engine_ppl": exp(pick(eng_nll).value),
               "engine_ppl_ci95": exp_ci(pick(eng_nll).ci()), "ref_ppl": exp(pick(r_nll).value),
               "delta_nll_mean": pick(dnll).value, "delta_nll_mean_ci95": pick(dnll).ci(),
               "delta_nll_mean_se": pick(dnll).se(), "ref_tail_mass_mean": pick(tail).value}
        if where.rows is None:   # domains-equal: a mean of the domains' shares, no rows to count
            out["rows_worse_share"], out["rows_worse_share_ci95"] = pick(worse).value, pick(worse).ci()
        else:
            out["rows_worse"] = rows_worse(table, where, worse)
            out["positions"], out["rows"] = where.total(table, "n"), int(where.rows.sum())
        return out

    overall_scope, domain_scopes, equal_scope = row_scopes(groups)
    overall = scope(overall_scope)
    return {"statistics": {"overall": overall, "domains": {d.name: scope(d) for d in domain_scopes},
                           "domains_equal": scope(equal_scope)},
            "kl_mean_ci95": overall["kl_mean_ci95"], "engine_ppl": overall["engine_ppl"],
            "ref_ppl": overall["ref_ppl"], "delta_nll_mean": overall["delta_nll_mean"]}
