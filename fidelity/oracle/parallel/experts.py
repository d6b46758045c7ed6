"""Expert parallel: a MoE layer's routed experts split across ranks, outputs summed in one process's order."""
from __future__ import annotations

import torch

from .group import Group

class ExpertParallel:
    """Plugged into `oracle.fetch.expert_parallel`; `RoutedExperts` hands its call to `combine`."""

    def __init__(self, g: Group):
        self.group = g

    def owner(self, expert: int, n_experts: int) -> int:
        """Contiguous blocks of experts per rank."""
        return expert * self.group.world_size // n_experts

    def combine(self, experts, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Same result, bit for bit, as RoutedExperts.__call__ in one process: out = 0, then each token's weighted
        expert outputs added in ascending expert order. Slot j of a token holds its j-th smallest expert's output;
        only that expert's owner writes it, so the all_reduce adds zeros to it and changes nothing."""
        g = self.group
        N, k = indices.shape
        slots = x.new_zeros(N, k, x.shape[-1])

        def mine(e):
            return self.owner(e, experts.n_experts) == g.rank

        # this rank's experts through the one-process grouping (one sort, batched decodes, the budget)
        for e, rows, y in experts.routed_outputs(x, indices, weights, mine):
            slots[rows, (indices[rows] < e).sum(dim=1)] = y     # e's position among each token's experts, ascending
        g.checkpoint("an expert exchange")
        g.all_reduce_sum(slots)
        out = torch.zeros_like(x)
        for j in range(k):
            out += slots[:, j]
        return out
