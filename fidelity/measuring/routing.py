"""Measured expert routing: how many tokens each routed expert of each MoE layer served on a panel.

The oracle's `RoutedExperts` hands every call's expert choices to `OracleTaps.routing_counts` when one is set (compare
taps each pack's oracle with a `RoutingCounts`). `fractions()` turns the counts into, per expert tensor, the share of
tokens that read it: the weights of `Pack.bits_per_weight(routing=...)`'s measured per-decoded-token rows."""
from __future__ import annotations

import numpy as np
import torch


class RoutingCounts:
    """Per MoE layer (keyed by its expert 0's module names): tokens routed to each expert, and tokens seen."""

    def __init__(self):
        self.layers: dict[tuple, dict] = {}

    def add(self, experts, indices: torch.Tensor) -> None:
        """`experts`: the layer's RoutedExperts (`n_experts`, `names(e)` -> module names); `indices` [tokens, k]."""
        key = tuple(experts.names(0))
        entry = self.layers.get(key)
        if entry is None:
            entry = self.layers[key] = {"modules": [tuple(experts.names(e)) for e in range(experts.n_experts)],
                                        "counts": np.zeros(experts.n_experts, np.int64), "tokens": 0}
        per_expert = torch.bincount(indices.reshape(-1).long(), minlength=experts.n_experts)
        entry["counts"] += per_expert.cpu().numpy()[:experts.n_experts]
        entry["tokens"] += int(indices.shape[0])

    def all_reduce(self, group) -> None:
        """Sums the counts over the ranks of a row-parallel run (each rank routed its own rows; a rank without rows
        holds no layer at all, so the ranks' tables are gathered and merged rather than reduced layer by layer)."""
        group.checkpoint("the exchange of routing counts")
        tables: list = [None] * group.world_size
        group.dist.all_gather_object(tables, self.to_json())
        merged = RoutingCounts()
        for table in tables:
            for key, entry in RoutingCounts.from_json(table).layers.items():
                have = merged.layers.setdefault(key, {**entry, "counts": np.zeros_like(entry["counts"]), "tokens": 0})
                have["counts"] = have["counts"] + entry["counts"]
                have["tokens"] += entry["tokens"]
        order = [k for k in self.layers] + [k for k in merged.layers if k not in self.layers]
        self.layers = {k: merged.layers[k] for k in order}

    def fractions(self) -> dict[str, float]:
        """Tensor name -> share of the layer's tokens routed to that tensor's expert (each token picks k experts, so a
        layer's shares sum to k)."""
        out = {}
        for entry in self.layers.values():
            if not entry["tokens"]:
                continue
            for modules, c in zip(entry["modules"], entry["counts"]):
                for m in modules:
                    out[f"{m}.weight"] = float(c) / entry["tokens"]
        return out

    def to_json(self) -> dict:
        return {"layers": [{"modules": [list(m) for m in e["modules"]], "counts": e["counts"].tolist(),
                            "tokens": e["tokens"]} for e in self.layers.values()]}

    @classmethod
    def from_json(cls, data: dict) -> "RoutingCounts":
        out = cls()
        for e in data["layers"]:
            modules = [tuple(m) for m in e["modules"]]
            out.layers[modules[0]] = {"modules": modules, "counts": np.asarray(e["counts"], np.int64),
                                      "tokens": int(e["tokens"])}
        return out
