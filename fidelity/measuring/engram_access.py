"""Measured Engram row access: how many lookups each row of each Engram table served on a panel.

The V4.1 oracle's `EngramLayer` hands every call's table rows (`ngram_rows`: one row per token, n-gram length and
head) to `OracleTaps.engram_access` when one is set (attribute sets an `EngramAccess` for its reference pass).
`coverage()` gives the curve a row cache is sized from: the top N most-read rows' share of all lookups."""
from __future__ import annotations

import numpy as np
import torch


class EngramAccess:
    """Per Engram table (keyed by its layer): the distinct rows read, ascending, and each one's lookup count."""

    def __init__(self):
        self.tables: dict[int, dict] = {}

    def add(self, layer: int, n_rows: int, rows: torch.Tensor) -> None:
        """`rows`: the global table rows of one call (any shape; every element is one lookup)."""
        ids, counts = np.unique(rows.reshape(-1).cpu().numpy().astype(np.int64), return_counts=True)
        entry = self.tables.get(layer)
        if entry is None:
            self.tables[layer] = {"n_rows": int(n_rows), "rows": ids, "counts": counts.astype(np.int64)}
            return
        merged, inverse = np.unique(np.concatenate((entry["rows"], ids)), return_inverse=True)
        entry["counts"] = np.bincount(inverse, weights=np.concatenate((entry["counts"], counts)),
                                      minlength=len(merged)).astype(np.int64)
        entry["rows"] = merged

    def coverage(self, layer: int, points: list[int] | None = None) -> list[dict]:
        """Top-N rows (by lookups) -> share of the table's lookups, at N = 1, 10, 100, ... below the distinct rows,
        1 % and 10 % of the distinct rows, and all of them (share 1)."""
        counts = np.sort(self.tables[layer]["counts"])[::-1]
        distinct, total = len(counts), int(counts.sum())
        if points is None:
            points = [10 ** k for k in range(len(str(distinct))) if 10 ** k < distinct]
            points += [max(1, distinct // 100), max(1, distinct // 10), distinct]
        cum = np.cumsum(counts)
        out = []
        for n in sorted(set(int(p) for p in points if 1 <= p <= distinct)):
            label = {max(1, distinct // 100): "1% of distinct", max(1, distinct // 10): "10% of distinct",
                     distinct: "all distinct"}.get(n, "")
            out.append({"top_rows": n, "share": int(cum[n - 1]) / total, "of": label})
        return out

    def summary(self) -> list[dict]:
        """Per table: lookups, distinct rows, the table's rows, the coverage curve."""
        return [{"layer": layer, "lookups": int(e["counts"].sum()), "distinct_rows": int(len(e["rows"])),
                 "table_rows": e["n_rows"], "coverage": self.coverage(layer)} for layer, e in self.tables.items()]


def coverage_rows(summary: list[dict]) -> list[dict]:
    """`summary()` flattened to one row per table and coverage point: layer, n (top rows), share, of, and the table's
    lookups, distinct_rows, table_rows (the `--out` parquet and the report's table)."""
    return [{"layer": t["layer"], "n": c["top_rows"], "share": c["share"], "of": c["of"], "lookups": t["lookups"],
             "distinct_rows": t["distinct_rows"], "table_rows": t["table_rows"]}
            for t in summary for c in t["coverage"]]
