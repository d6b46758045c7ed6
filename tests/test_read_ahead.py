"""Routed experts read ahead in batches (RoutedExperts.read_ahead -> Fetch.read_ahead -> Pack.tensors) on the DeepSeek
V4 miniature packs (EXL3 experts at K 1-4 cycled over the experts): the experts a call routes to decode together, one
batched decode per codebook, rate and shape; the hidden states are those of one-by-one decodes, bit for bit; an
expert's gate and up stay where the batch wrote them (no copy); under a budget the same experts are kept."""
from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch

from fidelity import open_pack
from fidelity.packs.exl3.encoder import EncodingCache
from testkit.minipacks_v4 import V4MiniSpec, write_all
from fidelity.oracle import Oracle, moe
from fidelity.oracle.common import Fetch, adjacent_rows
from fidelity.packs.exl3 import layouts

FIXTURES = Path(__file__).parent / "fixtures" / "v4"
HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.device, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA")])]
LAYOUTS = ("deepseek_v41_exl3", "cuda-exl3", "exl3-mixed")


@pytest.fixture(scope="module")
def v4_packs(tmp_path_factory):
    return write_all(open_pack(FIXTURES / "tiny_v4"), tmp_path_factory.mktemp("v4packs"), V4MiniSpec(),
                     EncodingCache(FIXTURES / "tiny_v4_encodings.safetensors"))


def rows_for(pack, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, pack.config["vocab_size"], (n,), generator=g).tolist() for n in (23, 9, 5)]


def one_by_one(pack, device, **options) -> Oracle:
    oracle = Oracle(pack, device=device, **options)
    oracle.fetch.read_many = None              # RoutedExperts.read_ahead does nothing: every expert decodes alone
    return oracle


def kept_experts(oracle: Oracle) -> dict[int, list[int]]:
    from fidelity.oracle.moe import layer_routed_experts
    return {i: sorted(layer_routed_experts(layer).loaded) for i, layer in oracle._layers.items()
            if layer_routed_experts(layer) is not None}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_read_ahead_batches_the_experts_and_keeps_the_numbers(v4_packs, layout, device, rng_seed, monkeypatch):
    pack = open_pack(v4_packs[layout])
    rows = rows_for(pack, rng_seed)
    want = one_by_one(pack, device).hidden_states(rows, progress=False)
    batched, single, written = [], [], set()
    decode_weights, linear_weight = layouts.decode_weights, layouts.linear_weight

    def batched_decode(trellis, *args, **kw):
        out = decode_weights(trellis, *args, **kw)
        batched.append(trellis.shape[0])
        written.add(out.untyped_storage().data_ptr())
        return out
    monkeypatch.setattr(layouts, "decode_weights", batched_decode)
    monkeypatch.setattr(layouts, "linear_weight", lambda p, c, *a: (single.append(c.lin.trellis),
                                                                    linear_weight(p, c, *a))[1])
    oracle = Oracle(pack, device=device, keep_weights=True)
    got = oracle.hidden_states(rows, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    decodes = oracle.last_forward["experts"]["decodes"]
    single_experts = [n for n in single if ".experts." in n]
    print(f"{layout} on {device}: {decodes} expert decodes = {len(batched)} batched decodes of {sum(batched)} matrices "
          f"+ {len(single_experts)} one by one")
    assert 3 * decodes == sum(batched) + len(single_experts)
    assert batched and max(batched) > 1 and len(batched) < sum(batched)
    # the experts keep their weights where the batched decodes wrote them: gate and up joined without a copy
    from fidelity.oracle.moe import layer_routed_experts
    kept = [mlp for layer in oracle._layers.values() if (experts := layer_routed_experts(layer)) is not None
            for mlp in experts.loaded.values()]
    assert len(kept) == decodes
    assert all({m.gate_up.untyped_storage().data_ptr(), m.down.untyped_storage().data_ptr()} <= written for m in kept)


@pytest.mark.parametrize("layout", LAYOUTS[:1])
def test_under_a_budget_read_ahead_keeps_what_one_by_one_keeps(v4_packs, layout, rng_seed, monkeypatch):
    """First fit in the order experts are first used, whatever decodes them; the experts over the budget decode
    together (as many as the budget holds) and are freed after their call; the peak stays within budget +
    max(one expert, min(budget, READ_AHEAD_BYTES))."""
    pack = open_pack(v4_packs[layout])
    rows = rows_for(pack, rng_seed)
    cfg = pack.config
    one = 3 * cfg["moe_intermediate_size"] * cfg["hidden_size"] * 4
    chunks = []
    original = moe.RoutedExperts.read_transients

    def recording(self, experts):
        got = original(self, experts)
        chunks.append([weakref.ref(m.down) for m in got.values()])
        return got
    monkeypatch.setattr(moe.RoutedExperts, "read_transients", recording)
    for budget in (0, 2 * one, 5 * one):
        ref = one_by_one(pack, "cpu", keep_weights=True, expert_budget_bytes=budget)
        want = ref.hidden_states(rows, progress=False)
        chunks.clear()
        oracle = Oracle(pack, keep_weights=True, expert_budget_bytes=budget)
        got = oracle.hidden_states(rows, progress=False)
        # over the budget the experts of a call decode together, as many as the budget holds, and are freed after it
        most = max((len(c) for c in chunks), default=0)
        assert most == {0: 0, 2 * one: 2}[budget] if budget < 5 * one else most <= 5, (budget, most)
        assert all(r() is None for c in chunks for r in c)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        assert kept_experts(oracle) == kept_experts(ref)
        e, e_ref = oracle.last_forward["experts"], ref.last_forward["experts"]
        assert (e["decodes"], e["used"], e["kept_bytes"]) == (e_ref["decodes"], e_ref["used"], e_ref["kept_bytes"])
        assert e["peak_bytes"] <= budget + max(one, min(budget, moe.READ_AHEAD_BYTES))


def test_read_ahead_leaves_nothing_behind_and_batches_are_bounded(v4_packs, rng_seed, monkeypatch):
    """A read-ahead batch holds at most READ_AHEAD_BYTES of decoded experts; weights a decode did not take are
    dropped from `ready` after it (here: a family whose decode reads only gate and up)."""
    pack = open_pack(v4_packs["deepseek_v41_exl3"])
    cfg = pack.config
    one = 3 * cfg["moe_intermediate_size"] * cfg["hidden_size"] * 4
    monkeypatch.setattr(moe, "READ_AHEAD_BYTES", 2 * one)
    sizes = []
    original = Fetch.read_ahead
    monkeypatch.setattr(Fetch, "read_ahead", lambda self, names: (sizes.append(len(names)), original(self, names))[1])
    oracle = Oracle(pack)
    oracle.hidden_states(rows_for(pack, rng_seed), progress=False)
    assert sizes and set(sizes) == {6} | ({3} if 3 in sizes else set())    # two experts' three weights per batch
    assert not oracle.fetch.ready
    fetch = oracle.fetch
    fetch.ready.update({"x": torch.zeros(2, 3)})
    experts = moe.RoutedExperts(4, lambda e: (f"g{e}", f"u{e}", f"d{e}"), fetch, "silu")
    monkeypatch.setattr(experts, "weight_names", lambda e: [f"g{e}.weight", f"u{e}.weight", f"d{e}.weight"])
    monkeypatch.setattr(experts, "decoded_bytes", lambda e: 1)
    monkeypatch.setattr(
        fetch, "read_many", lambda names, **where: {n: torch.full((2, 3), float(len(n))) for n in names}
    )
    monkeypatch.setattr(experts, "decode", lambda e: (fetch(f"g{e}.weight"), fetch(f"u{e}.weight")))
    decoded = experts.read_ahead([0, 1])
    assert sorted(decoded) == [0, 1] and fetch.ready == {"x": fetch.ready["x"]}


def test_adjacent_rows_joins_only_parts_that_lie_in_order_in_one_storage():
    w = torch.randn(5, 4, 3)
    joined = adjacent_rows([w[1], w[2]])
    assert joined is not None and joined.data_ptr() == w[1].data_ptr() and torch.equal(joined, torch.cat([w[1], w[2]]))
    assert adjacent_rows([w[2], w[1]]) is None and adjacent_rows([w[0], w[2]]) is None
    assert adjacent_rows([w[0], torch.randn(4, 3)]) is None and adjacent_rows([w[0], w[1].double()]) is None
    assert adjacent_rows([w[0].t(), w[1].t()]) is None


class ThreadRanks:
    """`world` ranks as threads of this process, for ExpertParallel: all_reduce_sum adds the ranks' tensors in rank
    order and hands every rank the sum (what gloo or NCCL does, without processes)."""

    def __init__(self, world: int):
        import threading
        self.world, self.barrier, self.posted = world, threading.Barrier(world, timeout=120), [None] * world

    def group(self, rank: int):
        from types import SimpleNamespace
        return SimpleNamespace(rank=rank, world_size=self.world, checkpoint=lambda what: None,
                               all_reduce_sum=lambda t: self.all_reduce_sum(rank, t))

    def all_reduce_sum(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        self.posted[rank] = tensor
        self.barrier.wait()
        total = self.posted[0].clone()
        for other in self.posted[1:]:
            total += other
        self.barrier.wait()                     # every rank has its sum before any overwrites its own tensor
        return tensor.copy_(total)


@pytest.mark.parametrize("device", DEVICES)
def test_expert_parallel_ranks_read_their_experts_ahead_in_batches(v4_packs, device, rng_seed):
    """Under expert parallelism each rank's routed experts go through the one-process grouping: decoded together
    (Pack.tensors, several experts per call; none one by one), only its own, and the hidden states are one process's
    bit for bit (two ranks as threads)."""
    import threading
    from fidelity.oracle.parallel import ExpertParallel
    from fidelity.oracle.runner import LoadChain
    from fidelity.packs.exl3.layouts import routed_expert
    path = v4_packs["deepseek_v41_exl3"]
    rows = rows_for(open_pack(path), rng_seed)
    want = Oracle(open_pack(path), device=device).hidden_states(rows, progress=False)
    world, ranks = 2, ThreadRanks(2)
    got, batches, alone, errors = [None] * world, [[] for _ in range(world)], [[] for _ in range(world)], []

    def run(rank: int):
        try:
            pack = open_pack(path)
            tensor, tensors = pack.tensor, pack.tensors
            pack.tensor = lambda name, **where: (alone[rank].append(name), tensor(name, **where))[1]
            pack.tensors = lambda names, **where: (batches[rank].append(list(names)), tensors(names, **where))[1]
            split = ExpertParallel(ranks.group(rank))
            oracle = Oracle(pack, device=device, chain=LoadChain(experts=split))
            got[rank] = oracle.hidden_states(rows, progress=False)
        except BaseException as error:          # pragma: no cover - reported below
            errors.append((rank, error))
            ranks.barrier.abort()
    threads = [threading.Thread(target=run, args=(r, )) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    n_experts = open_pack(path).config["n_routed_experts"]
    for rank in range(world):
        assert all(torch.equal(a, b) for a, b in zip(want, got[rank])), f"rank {rank} differs from one process"
        experts_in = [{routed_expert(n)[2] for n in names if routed_expert(n) is not None} for names in batches[rank]]
        experts_in = [e for e in experts_in if e]
        assert experts_in and max(len(e) for e in experts_in) > 1, (rank, experts_in)
        assert all(e * world // n_experts == rank for batch in experts_in for e in batch), (rank, experts_in)
        assert not [n for n in alone[rank] if routed_expert(n) is not None], (rank, alone[rank])
