"""Top-k selection that does not depend on the backend: among equal scores the lower index wins.

`torch.topk` leaves the order of equal values to its implementation (the CPU's partial sort / nth_element, CUDA's radix
select), so two devices can keep different entries when the k-th best score is shared. The sparse attentions of
DeepSeek V3.2/V4/V4.1 meet such ties all the time: an indexer score sums relu'd head scores, so an entry every head
scores below zero scores exactly 0, and masked entries are all -inf. Here `topk` only supplies the k-th best value,
which is the same whatever its tie order; which of the tied entries are kept is decided by index.
"""
from __future__ import annotations

import torch


def top_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Bool, scores' shape: the k best finite scores along the last dim; of the entries equal to the k-th best, the
    lowest-indexed ones. -inf (masked) entries are never kept, so fewer than k are kept where fewer are finite."""
    k = min(k, scores.shape[-1])
    if k <= 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    kth = scores.topk(k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    above = scores > kth
    tied = scores == kth
    room = k - above.sum(dim=-1, keepdim=True, dtype=torch.int32)
    keep = above | (tied & (tied.cumsum(dim=-1, dtype=torch.int32) <= room))
    return keep & (scores != float("-inf"))


def top_k_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., k] of the k best scores along the last dim, ties to the lower index, in ascending index order (so
    whatever is summed over them is summed in one order on every device)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return order.sort(dim=-1).values


def mask_indices(mask: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The True entries of `mask` along its last dim as (indices [..., k] ascending, valid [..., k]); rows with fewer
    than k are padded with index 0, valid False. Rows must hold at most k (a top_k_mask of k does); of a row with
    more, the first k."""
    W = mask.shape[-1]
    position = mask.cumsum(dim=-1, dtype=torch.int32) - 1
    slot = torch.where(mask & (position < k), position, k).long()   # entries not kept go to a spare column
    indices = torch.zeros(*mask.shape[:-1], k + 1, dtype=torch.long, device=mask.device)
    indices.scatter_(-1, slot, torch.arange(W, device=mask.device).expand_as(slot))
    valid = torch.arange(k, device=mask.device) < mask.sum(dim=-1, keepdim=True)   # (at most k valid)
    return indices[..., :k], valid
