"""Row parallel: the oracle's row batches dealt to ranks, hidden states and logits broadcast batch by batch."""
from __future__ import annotations

import re

import torch

from ...errors import FidelityError
from .group import Group, RankFailed

def deal(batches: list[list[int]], lengths: list[int], world_size: int) -> list[int]:
    """Owner rank of each batch: largest batches (in tokens) first, each to the least-loaded rank (lowest on ties)."""
    load = [0] * world_size
    owner = [0] * len(batches)
    sizes = [len(b) * lengths[b[0]] for b in batches]
    for b in sorted(range(len(batches)), key=lambda b: (-sizes[b], b)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[b], load[r] = r, load[r] + sizes[b]
    return owner


class RowParallel:
    """An Oracle whose `hidden_states` and `logits` split the row batches across ranks; everything else delegates."""

    def __init__(self, oracle, g: Group):
        self.oracle, self.group = oracle, g

    def __getattr__(self, name):
        return getattr(self.oracle, name)

    def _plan(self, rows) -> tuple[list[list[int]], list[int], list[int]]:
        tensors = [self.oracle._validate_row(r, i) for i, r in enumerate(rows)]
        lengths = [len(t) for t in tensors]
        batches = self.oracle._batches(tensors)
        return batches, deal(batches, lengths, self.group.world_size), lengths

    def _local(self, rows, batches, owner, lengths, progress: bool) -> dict[int, torch.Tensor]:
        """Hidden states of this rank's rows. Its batches keep their global order, so the oracle regroups them into
        exactly the same batches (only a length's last batch is partial, and it stays last). Rope tables are built
        for the longest row of all ranks, as one process builds them: an elementwise kernel may round the tail of a
        tensor differently from its vectorised body, so a shorter table could differ in the last ulp."""
        g = self.group
        mine = [i for b, o in zip(batches, owner) if o == g.rank for i in b]
        family = self.oracle.family
        own_tables = vars(family).get("rope_tables")
        build = family.rope_tables
        family.rope_tables = lambda length, dtype, device: build(max(lengths, default=length), dtype, device)
        try:
            if mine:
                hidden = self.oracle.hidden_states([rows[i] for i in mine], progress=progress and g.rank == 0)
            else:
                hidden = []
                if self.oracle.shards is not None:  # no rows here, but its share is needed
                    for i in range(family.n_layers):
                        self.oracle.load_layer(i)
        except RankFailed:
            raise
        except FidelityError as e:  # the oracle counted this rank's rows; name them as the caller numbers them
            message = re.sub(r"\brow (\d+)", lambda m: f"row {mine[int(m.group(1))]}", str(e))
            g.post_error(message)
            raise FidelityError(f"rank {g.rank}: {message}") from None
        finally:
            if own_tables is None:
                del family.rope_tables
            else:
                family.rope_tables = own_tables
        return dict(zip(mine, hidden))

    def hidden_states(self, rows, progress: bool = True) -> list[torch.Tensor]:
        g = self.group
        batches, owner, lengths = self._plan(rows)
        local = self._local(rows, batches, owner, lengths, progress)
        g.checkpoint("the exchange of hidden states")
        out: list[torch.Tensor | None] = [None] * len(rows)
        for b, o in zip(batches, owner):
            if o == g.rank:
                buf = torch.stack([local[i] for i in b])
            else:
                buf = torch.empty(len(b), lengths[b[0]], self.oracle.family.hidden_size, dtype=self.oracle.dtype,
                                  device=self.oracle.device)
            g.broadcast(buf, src=o)
            for j, i in enumerate(b):
                out[i] = buf[j]
        return out

    def logits(self, tokens: torch.Tensor, progress: bool = False) -> torch.Tensor:
        """As Oracle.logits: each rank applies the head to its own batches (same shapes as one process), then the
        logits are broadcast batch by batch."""
        if tokens.dim() != 2:
            raise FidelityError(f"tokens must be a [batch, length] tensor, got shape {list(tokens.shape)}")
        g = self.group
        rows = tokens.tolist()
        batches, owner, lengths = self._plan(rows)
        local = self._local(rows, batches, owner, lengths, progress)
        B, T = tokens.shape
        vocab = self.oracle.head_weight().shape[0] if B * T else self.oracle.family.vocab_size
        out = torch.empty(B, T, vocab, dtype=self.oracle.dtype)
        for b, o in zip(batches, owner):
            if o == g.rank:
                self.oracle._head_into(torch.stack([local[i] for i in b]), out[b[0]:b[-1] + 1])
        g.checkpoint("the exchange of logits")
        for b, o in zip(batches, owner):
            g.broadcast(out[b[0]:b[-1] + 1], src=o)
        return out
