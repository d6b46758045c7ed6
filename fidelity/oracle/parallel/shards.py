"""Sharded layer loads: each rank reads about 1/N of a layer's tensors and receives the rest by broadcast."""
from __future__ import annotations

import math

import torch

from .group import Group

def deal_tensors(sizes: list[int], world_size: int) -> list[int]:
    """Reader rank of each tensor: largest first, each to the least-loaded rank (lowest on ties)."""
    load = [0] * world_size
    owner = [0] * len(sizes)
    for t in sorted(range(len(sizes)), key=lambda t: (-sizes[t], t)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[t], load[r] = r, load[r] + sizes[t]
    return owner


class ShardedLoads:
    """The load chain's shards stage (`LoadChain(shards=partial(ShardedLoads, group=g))`): before layer i is built,
    this rank reads its share of the layer's tensors (routed experts excepted: they are read only when a token routes
    to them), every share is broadcast into `oracle.fetch.ready`, and the layer is built from the exchanged tensors.
    Every rank must load the same layers in the same order (row parallel does)."""

    def __init__(self, oracle, group: Group):
        self.oracle, self.group = oracle, group

    def plan(self, i: int) -> tuple[list[str], list[int]]:
        fetch = self.oracle.fetch
        names = [n for n in self.oracle.family.layer_names(i) if ".experts." not in n and fetch.shape_of
                 and len(fetch.shape_of(n)) > 0]
        sizes = [math.prod(fetch.shape_of(n)) for n in names]
        return names, deal_tensors(sizes, self.group.world_size)

    def __call__(self, i: int, build):
        g, fetch = self.group, self.oracle.fetch
        names, owners = self.plan(i)
        mine = {n: fetch(n) for n, o in zip(names, owners) if o == g.rank}
        ready = {n: mine[n] if o == g.rank else torch.empty(fetch.shape_of(n), device=fetch.device, dtype=fetch.dtype)
                 for n, o in zip(names, owners)}
        what = f"the exchange of layer {i}'s weights"
        if g.backend != "nccl":  # gloo blocks inside the collective: first make sure every share was read. NCCL's
            g.checkpoint(what, channel=f"layer{i}")  # wait is watched (broadcast_all), which names a reader that failed
        g.broadcast_all(what, [(ready[n], o) for n, o in zip(names, owners)])
        fetch.ready.update(ready)
        del mine, ready
        try:
            return build(i)
        finally:
            for n in names:  # any the family did not ask for
                fetch.ready.pop(n, None)
