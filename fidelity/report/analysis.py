"""Numbers the report derives from per-position records: KL quantiles, KL by reference confidence, worst positions and
rows."""

from __future__ import annotations

from dataclasses import dataclass
import numpy as np
import pandas as pd

from ..measuring.stats import CONFIDENCE_EDGES   # compare's buckets (exllamav3 model_diff's): one definition
from .inputs import CompareRun

QUANTILES = (0.5, 0.9, 0.99, 0.999)


def scored_kl(run: CompareRun, label: str) -> pd.DataFrame | None:
    """One pack's scored positions with finite KL (compare counts the others), joined with the reference store's records
    (top-K) when the run has them."""
    if label not in run.pack_positions:
        return None
    df = run.pack_positions[label]
    if run.positions is not None:
        ref = run.positions.drop(columns=[c for c in ("domain", "token") if c in df.columns])
        df = df.merge(ref, on=["row_id", "position"], how="left", suffixes=("", "_ref"))
    if "scored" in df.columns:
        df = df[df["scored"].fillna(True).astype(bool)]
    if "finite" in df.columns:
        df = df[df["finite"].astype(bool)]
    return df[np.isfinite(df["kl"].to_numpy(dtype=np.float64))]


def row_tokens(run: CompareRun, label: str) -> tuple[dict[str, pd.DataFrame], bool]:
    """Tokens of each row by position: every token from the reference store, else only the pack's scored tokens."""
    if run.positions is not None:
        src, full = run.positions, True
    else:
        src, full = run.pack_positions[label], False
    return {rid: g.sort_values("position") for rid, g in src[["row_id", "position", "token"]].groupby("row_id")}, full


def kl_quantiles(kl: np.ndarray, qs=QUANTILES) -> dict[str, float]:
    kl = np.asarray(kl, dtype=np.float64)
    out = {f"p{q * 100:g}": float(np.quantile(kl, q)) for q in qs}
    out["max"] = float(kl.max())
    out["mean"] = float(kl.mean())
    return out


def reference_top1_prob(df: pd.DataFrame) -> np.ndarray | None:
    """Reference confidence: probability of its own top token (`ref_pmax`, or the best of the stored top-K logprobs)."""
    if "ref_pmax" in df.columns:
        return df["ref_pmax"].to_numpy(dtype=np.float64)
    if "ref_top_logprobs" in df.columns:
        return np.exp(np.array([float(np.max(lp)) for lp in df["ref_top_logprobs"]], dtype=np.float64))
    return None


def kl_by_confidence(df: pd.DataFrame, edges=CONFIDENCE_EDGES) -> pd.DataFrame | None:
    """Mean KL and position count per reference top-1 probability bucket [lo, hi) (the last one closed)."""
    p = reference_top1_prob(df)
    if p is None:
        return None
    kl = df["kl"].to_numpy(dtype=np.float64)
    idx = np.clip(np.searchsorted(edges, p, side="right") - 1, 0, len(edges) - 2)
    rows = []
    for b in range(len(edges) - 1):
        m = idx == b
        rows.append(
            {
                "bucket": f"[{edges[b]:g}, {edges[b + 1]:g}{']' if b == len(edges) - 2 else ')'}",
                "lo": edges[b],
                "hi": edges[b + 1],
                "positions": int(m.sum()),
                "kld_mean": float(kl[m].mean()) if m.any() else float("nan"),
            }
        )
    return pd.DataFrame(rows)


def confidence_from_json(buckets) -> pd.DataFrame | None:
    """compare's `kld_by_ref_confidence` (ConfidenceBucket: ref_confidence [lo, hi], positions, kld_mean) in
    kl_by_confidence's shape."""
    if not buckets:
        return None
    rows = []
    for i, b in enumerate(buckets):
        lo, hi = b.ref_confidence
        last = i == len(buckets) - 1
        rows.append(
            {
                "bucket": f"[{lo:g}, {hi:g}{']' if last else ')'}",
                "lo": lo,
                "hi": hi,
                "positions": int(b.positions),
                "kld_mean": float("nan") if b.kld_mean is None else float(b.kld_mean),
            }
        )
    return pd.DataFrame(rows)


@dataclass
class WorstPosition:
    label: str
    row_id: str
    domain: str
    position: int
    kl: float
    before: str
    token: str
    after: str
    reference_top: list[tuple[str, float | None]]
    pack_top: list[tuple[str, float | None]] | None


def visible(text: str) -> str:
    """Whitespace a reader would not see, made visible (for token lists and a highlighted whitespace token)."""
    return (
        text.replace("\n", "⏎").replace("\t", "⇥").replace(" ", "␣")
        if text.strip() == "" or text != text.strip()
        else text
    )


class TokenText:
    """Token ids to text: a tokenizer when we have one, else the run folder's id->text map, else ⟨id⟩."""

    def __init__(self, tokenizer=None, table: dict[int, str] | None = None):
        self.tokenizer, self.table = tokenizer, table

    def piece(self, tid: int) -> str:
        return visible(self.text([tid]))

    def text(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids)
        if self.table is not None:
            return "".join(self.table.get(i, f"⟨{i}⟩") for i in ids)
        return "".join(f"⟨{i}⟩" for i in ids)

    def around(self, before, token: int, after) -> tuple[str, str, str]:
        """Text before, of, and after `token`, decoded together so word boundaries and spaces come out as in the full
        text."""
        head = self.text(before)
        with_token = self.text([*before, token])
        tok = with_token[len(head):] if with_token.startswith(head) else self.text([token])
        full = self.text([*before, token, *after])
        tail = full[len(with_token):] if full.startswith(with_token) else self.text(after)
        return head, visible(tok) if tok.strip() == "" else tok, tail


def _top(r, ids_key: str, lp_key: str, top1_key: str, text: TokenText, k: int) -> list[tuple[str, float | None]] | None:
    """Most likely tokens at a position: from stored top-K (with probabilities) or just the argmax id (probability
    unknown)."""
    if ids_key in r.index and lp_key in r.index and r[ids_key] is not None:
        ids, lps = r[ids_key], np.asarray(r[lp_key], dtype=np.float64)
        return [(text.piece(int(ids[j])), float(np.exp(lps[j]))) for j in np.argsort(-lps)[:k]]
    if top1_key in r.index and pd.notna(r[top1_key]):
        return [(text.piece(int(r[top1_key])), None)]
    return None


def worst_positions(run: CompareRun, label: str, text: TokenText, n: int = 8, context: int = 24, after: int = 4,
                    k: int = 5) -> list[WorstPosition]:
    """The n highest-KL scored positions with the text around them; the token at `position` is the one being
    predicted."""
    df = scored_kl(run, label)
    if df is None or df.empty:
        return []
    worst = df.nlargest(n, "kl")
    by_row, _ = row_tokens(run, label)
    out = []
    for _, r in worst.iterrows():
        row = by_row[r["row_id"]]
        pos = row["position"].to_numpy()
        toks = row["token"].to_numpy()
        out.append(
            WorstPosition(
                label=label,
                row_id=str(r["row_id"]),
                domain=str(r.get("domain", "")),
                position=int(r["position"]),
                kl=float(r["kl"]),
                **dict(
                    zip(
                        ("before", "token", "after"),
                        text.around(
                            toks[(pos < r["position"]) & (pos >= r["position"] - context)],
                            int(r["token"]),
                            toks[(pos > r["position"]) & (pos <= r["position"] + after)],
                        ),
                    )
                ),
                reference_top=_top(r, "ref_top_ids", "ref_top_logprobs", "ref_top1", text, k) or [],
                pack_top=_top(r, "top_ids", "top_logprobs", "pack_top1", text, k),
            )
        )
    return out


def worst_rows(run: CompareRun, label: str, n: int = 5) -> pd.DataFrame:
    """Rows with the highest mean KL over their scored positions."""
    df = scored_kl(run, label)
    if df is None or df.empty:
        return pd.DataFrame(columns=["row_id", "domain", "positions", "kld_mean", "kld_max"])
    cols = {"positions": ("kl", "size"), "kld_mean": ("kl", "mean"), "kld_max": ("kl", "max")}
    keys = ["row_id", "domain"] if "domain" in df.columns else ["row_id"]
    g = df.groupby(keys, sort=False).agg(**cols).reset_index()
    return g.nlargest(n, "kld_mean")

