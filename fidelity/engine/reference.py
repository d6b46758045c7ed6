"""Gate references (`Reference`: the oracle's full log-distributions on panel rows, `ReferenceRow`s, and the token
pieces), either from a reference store written by `fidelity reference` or computed live from a pack."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import FidelityError
from ..pack_settings import PackSettings


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
    # tokens an engine may leave out of its echo (llama-cpp-python drops BOS)
    special_ids: set[int] = field(default_factory=set)

    def piece_ids(self) -> dict[str, int]:
        """Unambiguous text -> id. Left out (their mass goes to the tail bucket): pieces several ids decode to, and
        pieces that engines render differently (partial UTF-8 bytes: U+FFFD here, "" in llama-cpp-python; "" for special
        tokens)."""
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


def token_pieces(tokenizer, vocab: int) -> list[str]:
    """Text of each token id alone, as engines spell `top_logprobs` keys."""
    n = min(vocab, len(tokenizer))
    return [tokenizer.decode([i]) for i in range(n)] + [""] * (vocab - n)


def reference_from_oracle(pack, rows: list[dict], *, oracle=None) -> Reference:
    """rows: [{"id", "domain", "tokens": [...], "scored": [positions]}] (scored defaults to every position after the
    first). Runs the fp32 oracle on `pack` and keeps the full log-distributions of the scored positions."""
    # torch, the oracle and the packs load here: the gate's parser imports this module (tests/test_cli_startup.py)
    import torch  # noqa: PLC0415 (CLI startup)

    from ..oracle import Oracle  # noqa: PLC0415 (CLI startup)
    from ..packs.tokenizer import load_tokenizer  # noqa: PLC0415 (CLI startup)

    oracle = oracle or Oracle(pack)
    tok = load_tokenizer(pack)
    hidden = oracle.hidden_states([r["tokens"] for r in rows], progress=False)
    out = []
    for r, h in zip(rows, hidden):
        scored = list(r.get("scored") or range(1, len(r["tokens"])))
        if not scored or min(scored) < 1 or max(scored) >= len(r["tokens"]):
            raise FidelityError(f"reference row {r['id']!r}: scored positions must lie in 1..{len(r['tokens']) - 1}")
        logits = oracle.apply_head(h[torch.tensor(scored) - 1])
        lp = torch.log_softmax(logits.double(), dim=-1).numpy()
        out.append(
            ReferenceRow(
                id=str(r["id"]), domain=str(r.get("domain", "")), tokens=list(r["tokens"]), scored=scored, logprobs=lp
            )
        )
    return Reference(
        rows=out,
        pieces=token_pieces(tok, oracle.family.vocab_size),
        detokenize=lambda ids: tok.decode(ids, skip_special_tokens=False),
        special_ids=set(tok.all_special_ids),
    )


def reference_from_store(store_dir, reference_pack=None, panel=None, *, rows_per_domain: int | None = None,
                         device: str = "cpu", pack_settings: PackSettings = PackSettings()) -> Reference:
    """A reference store (from `fidelity reference`) as a gate Reference. The store keeps final hidden states; the
    reference pack's head turns them back into the exact full-vocabulary distributions (checked against the stored
    top-K). The store is refused for another panel, pack or tokenizer. `reference_pack` and `panel` default to the paths
    the store's manifest records. `rows_per_domain` keeps the first N rows of each domain. `pack_settings`: how the pack
    is opened."""
    import torch  # noqa: PLC0415 (CLI startup)

    from ..measuring.compare import _oracle, prepare  # noqa: PLC0415 (CLI startup)
    from ..measuring.store import check_topk, load_store, read_manifest, stored_sources  # noqa: PLC0415 (CLI startup)
    from ..packs.tokenizer import load_tokenizer  # noqa: PLC0415 (CLI startup)

    stored_pack, stored_panel = stored_sources(store_dir)
    if reference_pack is None:
        if stored_pack is None:
            raise FidelityError(f"reading reference store {store_dir} needs the reference pack it was built from "
                                f"(--reference-pack): its manifest records no pack path")
        if not Path(stored_pack).exists():
            raise FidelityError(
                f"reference store {store_dir} was built from reference pack {stored_pack}, which is not "
                f"there any more: pass the pack's new place with --reference-pack"
            )
        reference_pack = stored_pack
    if panel is None and stored_panel is not None:
        if not Path(stored_panel).exists():
            raise FidelityError(
                f"reference store {store_dir} was built on panel {stored_panel}, which is not there any "
                f"more: pass the panel's new place with --panel"
            )
        panel = stored_panel
    ref_pack, panel, rows, tok_fp = prepare(reference_pack, panel, pack_settings=pack_settings)
    oracle = _oracle(ref_pack, device, read_manifest(store_dir).get("oracle_numerics", "exact"))  # the store's own
    run = load_store(
        store_dir, panel, rows, pack_fingerprint=ref_pack.fingerprint(), tokenizer_fingerprint=tok_fp, oracle=oracle
    )
    keep, seen = [], {}
    for i, r in enumerate(run.rows):
        if rows_per_domain is None or seen.get(r.domain, 0) < rows_per_domain:
            keep.append(i)
            seen[r.domain] = seen.get(r.domain, 0) + 1
    out = []
    for i in keep:
        r = run.rows[i]
        logits = oracle.apply_head(run.hidden[i])
        check_topk(run, i, logits, store_dir)
        scored = [t for t, s in enumerate(r.scored) if s]
        out.append(ReferenceRow(id=r.id, domain=r.domain, tokens=list(r.tokens), scored=scored,
                                logprobs=torch.log_softmax(logits.double(), dim=-1).numpy()))
    tok = load_tokenizer(ref_pack)
    return Reference(
        rows=out,
        pieces=token_pieces(tok, oracle.family.vocab_size),
        detokenize=lambda ids: tok.decode(ids, skip_special_tokens=False),
        special_ids=set(tok.all_special_ids),
    )
