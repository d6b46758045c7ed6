"""The oracle's declared layer-loading chain (`fidelity.oracle.runner.LoadChain`): prefetch -> cache -> shards -> read
-> decode -> layer transforms, in that order whatever stages a run picks, each stage built by the oracle itself.
Combined stages give the numbers the plain oracle (and the noise floor's earlier subclass composition) gives."""
from __future__ import annotations

import threading
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fidelity.measuring.noise_floor as C
from fidelity import open_pack
from fidelity.errors import FidelityError
from fidelity.oracle import LoadChain, Oracle
from fidelity.oracle.parallel import Prefetcher, ShardedLoads
from test_noise_floor_roles import _rows, _tiny_llama
from _deepseek_configs import reference_ties_to_lower_index  # noqa: F401 (autouse)

V4_NATIVE = Path(__file__).parent / "fixtures" / "v4" / "tiny_v4"


class OneRank:
    """A process group of one: ShardedLoads deals every tensor to rank 0, which reads them all into `fetch.ready`;
    the exchange itself is a no-op (a real one runs under torchrun in test_distributed)."""
    rank, world_size, backend = 0, 1, "gloo"

    def checkpoint(self, what, channel="main"):
        pass

    def broadcast_all(self, what, items):
        assert all(src == 0 for _, src in items)


def counting_reads(pack) -> list[str]:
    read, original = [], pack.tensor
    pack.tensor = lambda name, **where: (read.append(name), original(name, **where))[1]
    return read


@pytest.fixture
def llama(tmp_path, rng_seed):
    return _tiny_llama(tmp_path / "llama", torch.Generator().manual_seed(rng_seed))


def test_stages_run_in_the_declared_order_on_the_loader_thread(llama):
    """Shards, the family's build and the layer transforms run for each layer in chain order, below prefetch (on its
    loader thread), once per layer and pass; keep_weights' cache sits above the shards: a second pass runs none."""
    events = []
    where = lambda: threading.current_thread().name

    def shards(oracle):
        def stage(i, build):
            events.append(("shards", i, where()))
            return build(i)
        return stage

    def first(i, layer):
        events.append(("first", i, where()))
        return layer

    def second(i, layer):
        events.append(("second", i, where()))
        return layer

    oracle = Oracle(open_pack(llama), keep_weights=True,
                    chain=LoadChain(layer=(first, second), shards=shards, prefetch=Prefetcher))
    want = Oracle(open_pack(llama)).hidden_states([[1, 2, 3], [4, 5]], progress=False)
    got = oracle.hidden_states([[1, 2, 3], [4, 5]], progress=False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    loader = "fidelity-prefetch_0"
    assert events == [(stage, i, loader) for i in range(2) for stage in ("shards", "first", "second")]
    events.clear()
    again = oracle.hidden_states([[1, 2, 3], [4, 5]], progress=False)
    assert events == [] and all(torch.equal(a, b) for a, b in zip(again, want))


@pytest.mark.parametrize("which", ["llama", "v4"])
def test_sharded_loads_under_prefetch_give_the_plain_numbers(which, llama, rng_seed):
    """The real ShardedLoads below the real Prefetcher (one rank, staged bytes): every non-expert tensor of a layer is
    read once, into `fetch.ready`, before the family builds the layer from it; logits equal the plain oracle's."""
    folder = llama if which == "llama" else V4_NATIVE
    pack = open_pack(folder)
    rows = _rows(pack, torch.Generator().manual_seed(rng_seed))
    tokens = torch.tensor([rows[0][:4], rows[1][:4]])
    want = Oracle(open_pack(folder)).logits(tokens)
    read = counting_reads(pack)
    oracle = Oracle(pack, chain=LoadChain(shards=partial(ShardedLoads, group=OneRank()),
                                          prefetch=partial(Prefetcher, stage=True)))
    built = []
    real_build = oracle.family.load_layer

    def build(i, fetch):  # the family sees every exchanged tensor already placed
        built.append(sorted(fetch.ready))
        return real_build(i, fetch)
    oracle.family.load_layer = build
    got = oracle.logits(tokens)
    assert torch.equal(got, want)
    assert oracle.fetch.ready == {} and len(built) == oracle.family.n_layers
    for i, names in enumerate(built):
        shared = [n for n in oracle.family.layer_names(i) if ".experts." not in n and pack.storage(n).shape]
        assert names == sorted(shared)
        layer_reads = [n for n in read if n in oracle.family.layer_names(i)]
        assert sorted(n for n in layer_reads if ".experts." not in n) == sorted(shared)   # each read once


def test_noise_floor_under_prefetch_equals_the_subclass_composition(llama, rng_seed):
    """The noise floor as a layer transform of a prefetching chain gives bit for bit what it gave as an Oracle
    subclass perturbing in load_layer (its form before the chain), with and without prefetch."""
    pack = open_pack(llama)
    rows = _rows(pack, torch.Generator().manual_seed(rng_seed))
    seed = rng_seed % 1000

    class PerturbedOracle(Oracle):  # the noise floor before the load chain (compare.py at 9008a03)
        def load_layer(self, i):
            layer = super().load_layer(i)
            for role, attr in C.sub_blocks(layer).items():
                offset = seed * 1_000_003 + 2 * i + C.NOISE_ROLES.index(role)
                setattr(layer, attr, C._perturb(getattr(layer, attr), offset, C.NOISE_REL))
            return layer

    want = PerturbedOracle(pack).hidden_states(rows, progress=False)
    exact = Oracle(pack).hidden_states(rows, progress=False)
    noisy = C.perturbed_oracle(pack, seed=seed)
    assert isinstance(noisy.prefetcher, Prefetcher) and noisy.chain.layer == (C.Perturbation(seed, C.NOISE_REL),)
    plain = Oracle(pack, chain=LoadChain(layer=(C.Perturbation(seed),)))
    for oracle in (noisy, plain):
        got = oracle.hidden_states(rows, progress=False)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert not any(torch.equal(a, b) for a, b in zip(got, exact))


def test_expert_stage_is_the_fetch_hook(rng_seed):
    """LoadChain(experts=) is what RoutedExperts hands its calls to; a stage that combines as one process does gives
    the same logits."""
    calls = []

    def combine(experts, x, indices, weights):
        calls.append(indices.shape)
        experts.fetch.expert_parallel = None
        try:
            return experts(x, indices, weights)
        finally:
            experts.fetch.expert_parallel = hook
    hook = SimpleNamespace(combine=combine)
    pack = open_pack(V4_NATIVE)
    tokens = torch.tensor(_rows(pack, torch.Generator().manual_seed(rng_seed))[1:])
    want = Oracle(pack).logits(tokens)
    oracle = Oracle(pack, chain=LoadChain(experts=hook))
    assert oracle.fetch.expert_parallel is hook
    assert torch.equal(oracle.logits(tokens), want) and len(calls) > 0


def test_a_chain_must_be_a_load_chain(llama):
    with pytest.raises(FidelityError, match="chain must be a LoadChain, not list"):
        Oracle(open_pack(llama), chain=[Prefetcher])
