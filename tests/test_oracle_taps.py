"""The oracle's taps, one declared object (`OracleTaps`) handed to the passes of a `with oracle.tapped(taps)` block:
observers see exactly the passes inside it, the ones before it are back after it, and a tap the oracle does not
declare is refused instead of being set and never read."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fidelity.errors import FidelityError
from fidelity.oracle import Oracle, OracleTaps, moe
from fidelity.oracle.common import rms_norm
from fidelity.measuring.routing import RoutingCounts
from test_oracle import COMMON, make_moe


@pytest.fixture
def routed(monkeypatch):
    """Every RoutedExperts call's (layer key, indices), recorded from the call's own arguments."""
    seen = []
    original = moe.RoutedExperts.__call__

    def recording(self, x, indices, weights):
        seen.append((tuple(self.names(0)), indices.clone()))
        return original(self, x, indices, weights)
    monkeypatch.setattr(moe.RoutedExperts, "__call__", recording)
    return seen


def test_routing_counts_see_the_passes_inside_the_block_only(tmp_path, rng_seed, routed):
    _, pack = make_moe(tmp_path, "qwen3moe-renorm-sparse-step", rng_seed)
    tokens = torch.randint(0, COMMON["vocab_size"], (3, 17), generator=torch.Generator().manual_seed(rng_seed))
    oracle = Oracle(pack)
    before = oracle.fetch.taps
    counts = RoutingCounts()
    with oracle.tapped(OracleTaps(routing_counts=counts)):
        oracle.logits(tokens)
    inside = list(routed)
    oracle.logits(tokens[:1])               # after the block: nobody counts
    assert oracle.fetch.taps is before and len(routed) > len(inside) > 0
    want: dict[tuple, np.ndarray] = {}
    for key, indices in inside:
        n = counts.layers[key]["counts"].shape[0]
        want[key] = want.get(key, np.zeros(n, np.int64)) + np.bincount(indices.reshape(-1).numpy(), minlength=n)
    assert list(counts.layers) == list(want)
    for key, entry in counts.layers.items():
        assert entry["counts"].tolist() == want[key].tolist(), key
        assert entry["tokens"] == tokens.numel() and entry["counts"].sum() == 3 * tokens.numel()   # 3 experts a token


def failing(x):
    raise RuntimeError("observer failed")


def test_layer_outputs_and_the_observers_back_after_a_raise(tmp_path, rng_seed):
    _, pack = make_moe(tmp_path, "mixtral", rng_seed)
    rows = [torch.randint(0, COMMON["vocab_size"], (n,), generator=torch.Generator().manual_seed(rng_seed + n)).tolist()
            for n in (5, 9, 5)]
    oracle = Oracle(pack)
    last = oracle.family.n_layers - 1
    seen: list[torch.Tensor] = []
    outer = OracleTaps(routing_counts=RoutingCounts())
    with oracle.tapped(outer):
        with oracle.tapped(OracleTaps(layer_outputs={last: seen.append})):
            batches, hidden = oracle._forward(rows, progress=False)
        assert oracle.fetch.taps is outer
        with pytest.raises(RuntimeError, match="observer failed"):
            with oracle.tapped(OracleTaps(layer_outputs={0: failing})):
                oracle._forward(rows, progress=False)
        assert oracle.fetch.taps is outer
    assert not outer.routing_counts.layers      # the inner blocks replaced it: it saw no pass
    norm = oracle.fetch(oracle.family.norm_name)
    assert len(seen) == len(batches) == 2
    for x, h in zip(seen, hidden):
        assert torch.equal(rms_norm(x, norm, oracle.family.rms_norm_eps), h)


def test_undeclared_taps_are_refused(tmp_path, rng_seed):
    """Setting a sink the modules never read was silently accepted (`oracle.fetch.routing_counts = counts` once worked
    and would now count nothing): the Fetch and OracleTaps declare their attributes."""
    _, pack = make_moe(tmp_path, "mixtral", rng_seed)
    oracle = Oracle(pack)
    with pytest.raises(AttributeError):
        oracle.fetch.routing_counts = RoutingCounts()
    with pytest.raises(AttributeError):
        OracleTaps().routing_count = RoutingCounts()
    with pytest.raises(FidelityError, match="taps must be an OracleTaps, not dict"):
        with oracle.tapped({"routing_counts": RoutingCounts()}):
            pass
