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
        for e in torch.unique(indices).tolist():
            if self.owner(e, experts.n_experts) != g.rank:
                continue
            token, slot = torch.where(indices == e)
            y = experts.expert(e)(x[token]) * weights[token, slot, None]
            order = (indices[token] < e).sum(dim=1)  # e's position among the token's experts, ascending
            slots[token, order] = y
        g.checkpoint("an expert exchange")
        g.all_reduce_sum(slots)
        out = torch.zeros_like(x)
        for j in range(k):
            out += slots[:, j]
        return out
