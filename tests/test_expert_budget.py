"""The decoded-expert budget (`Oracle(expert_budget_bytes=)`, `moe.DecodedExperts`): a layer keeps at most that many
bytes of decoded routed experts (first fit in the order of first use), decodes the others for each call and frees them
after it. The numbers are the same bits with any budget; the decode counts and peaks are the ones the routing implies
(recorded here from the experts' calls, not from the counters); the activation budget counts the experts as bounded."""
from __future__ import annotations

import math
import types
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from fidelity import open_pack
from fidelity.errors import FidelityError
from fidelity.oracle import LoadChain, Oracle, moe, runner
from fidelity.oracle.parallel import Prefetcher
from test_oracle import make_moe

TINY_V4 = Path(__file__).parent / "fixtures" / "v4" / "tiny_v4"
CASES = ["qwen3moe-renorm-sparse-step", "mixtral"]


def expert_bytes(cfg: dict) -> int:
    """fp32 bytes of one routed expert: gate and up [inter, hidden], down [hidden, inter]."""
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    return 3 * inter * cfg["hidden_size"] * 4


@pytest.fixture
def calls(monkeypatch):
    """Every RoutedExperts call's (layer table, sorted distinct experts), in call order."""
    seen = []
    original = moe.RoutedExperts.__call__

    def recording(self, x, indices, weights):
        seen.append((tuple(self.names(0)), sorted(set(indices.flatten().tolist()))))
        return original(self, x, indices, weights)
    monkeypatch.setattr(moe.RoutedExperts, "__call__", recording)
    return seen


def expected_decodes(calls: list, per_layer: int | None, together: int = 1) -> tuple[int, int, int, int]:
    """(decodes, distinct (layer, expert) pairs, most experts one layer kept, most one layer held at once) when each
    layer keeps the first `per_layer` experts it decodes (None: all), from the recorded calls; a layer's experts run
    in ascending order. Held at once: the kept ones, plus while experts over the budget run the ones decoded
    together (`together` at most, the next ones of the call: RoutedExperts.read_transients; 1 on a pack whose
    experts are all alike in size means one at a time)."""
    kept: dict[tuple, list] = {}
    decodes, used, peak = 0, set(), 0
    for layer, experts in calls:
        have = kept.setdefault(layer, [])
        over = 0
        for e in experts:
            used.add((layer, e))
            if e not in have:
                decodes += 1
                if per_layer is None or len(have) < per_layer:
                    have.append(e)
                    peak = max(peak, len(have))
                else:
                    over += 1
        if over:
            peak = max(peak, len(have) + min(together, over))
    return decodes, len(used), max((len(v) for v in kept.values()), default=0), peak


def together(budget: int, one: int) -> int:
    """Experts over the budget decoded together: as many as min(budget, READ_AHEAD_BYTES) holds, at least one."""
    return max(1, min(budget, moe.READ_AHEAD_BYTES) // one)


@pytest.mark.parametrize("case", CASES)
def test_budgets_give_the_same_logits_and_the_decodes_the_routing_implies(tmp_path, rng_seed, monkeypatch, calls, case):
    monkeypatch.setattr(runner, "BATCH_TOKENS", 21)        # one row per batch: each MoE layer is called three times
    _, pack = make_moe(tmp_path, case, rng_seed)
    one = expert_bytes(pack.config)
    tokens = torch.randint(0, pack.config["vocab_size"], (3, 21), generator=torch.Generator().manual_seed(rng_seed))
    results = {}
    for budget, per_layer in ((None, None), (0, 0), (2 * one + one // 2, 2)):
        calls.clear()
        oracle = Oracle(pack, expert_budget_bytes=budget)
        logits = oracle.logits(tokens)
        e = oracle.last_forward["experts"]
        decodes, used, kept, peak = expected_decodes(calls, per_layer, 1 if budget is None else together(budget, one))
        assert e["budget_bytes"] == budget and e["used"] == used and e["decodes"] == decodes
        assert e["kept_bytes"] == kept * one and e["peak_bytes"] == peak * one
        if budget is not None:
            assert e["peak_bytes"] <= budget + together(budget, one) * one and e["kept_bytes"] <= budget
        results[budget] = logits, e
    (want, none), (_, z) = results[None], results[0]
    assert all(torch.equal(want, got) for got, _ in results.values())
    assert none["decodes"] == none["used"]                          # one decode per expert used
    assert z["decodes"] > z["used"] == none["used"] and z["kept_bytes"] == 0 and z["peak_bytes"] == one


def test_reads_follow_the_decodes_and_a_dropped_expert_is_freed(tmp_path, rng_seed, monkeypatch):
    """Each decode reads its expert's three tensors from the pack once; under budget 0 no earlier decoded expert (its
    module or tensors) is alive when the next one decodes, nor after the pass; kept ones live with their layer."""
    monkeypatch.setattr(runner, "BATCH_TOKENS", 21)
    _, pack = make_moe(tmp_path, "qwen3moe-renorm-sparse-step", rng_seed)
    reads = []
    tensor = pack.tensor
    pack.tensor = lambda name, **where: (reads.append(name), tensor(name, **where))[1]
    refs, offer = [], moe.DecodedExperts.offer
    alive_at_offer = []

    def watching(self, e, mlp, *held):
        alive_at_offer.append(sum(r() is not None for group in refs for r in group))
        out = offer(self, e, mlp, *held)
        if e not in self:                                        # transient: the caller's only
            refs.append([weakref.ref(mlp), weakref.ref(mlp.gate_up), weakref.ref(mlp.down)])
        return out
    monkeypatch.setattr(moe.DecodedExperts, "offer", watching)
    tokens = torch.randint(0, pack.config["vocab_size"], (3, 21), generator=torch.Generator().manual_seed(rng_seed))
    oracle = Oracle(pack, expert_budget_bytes=0)
    oracle.logits(tokens)
    e = oracle.last_forward["experts"]
    expert_reads = [n for n in reads if ".mlp.experts." in n]
    assert len(expert_reads) == 3 * e["decodes"] and len(refs) == e["decodes"] > 0
    assert alive_at_offer == [0] * e["decodes"]
    assert all(r() is None for group in refs for r in group)
    reads.clear()
    oracle = Oracle(pack)
    oracle.logits(tokens)
    expert_reads = [n for n in reads if ".mlp.experts." in n]
    assert len(expert_reads) == len(set(expert_reads)) == 3 * oracle.last_forward["experts"]["decodes"]


def test_budget_through_the_prefetcher_and_kept_layers(tmp_path, rng_seed, monkeypatch):
    """The loader thread builds the layers with the budget; a layer kept by keep_weights keeps its budget: under 0 it
    decodes again in every pass, with None a second pass decodes nothing and still reports what its layers keep."""
    monkeypatch.setattr(runner, "BATCH_TOKENS", 21)
    _, pack = make_moe(tmp_path, "mixtral", rng_seed)
    one, n_experts = expert_bytes(pack.config), pack.config["num_local_experts"]
    tokens = torch.randint(0, pack.config["vocab_size"], (3, 21), generator=torch.Generator().manual_seed(rng_seed))
    want = Oracle(pack).logits(tokens)
    assert torch.equal(Oracle(pack, expert_budget_bytes=0, chain=LoadChain(prefetch=Prefetcher)).logits(tokens), want)
    kept = Oracle(pack, keep_weights=True, expert_budget_bytes=0)
    kept.logits(tokens)
    assert torch.equal(kept.logits(tokens), want)
    assert kept.last_forward["experts"]["decodes"] > 0 and kept.last_forward["experts"]["kept_bytes"] == 0
    everything = Oracle(pack, keep_weights=True)
    everything.logits(tokens)
    first = everything.last_forward["experts"]
    assert torch.equal(everything.logits(tokens), want)
    second = everything.last_forward["experts"]
    assert (
        second["decodes"] == second["used"] == 0 and 0 < second["kept_bytes"] == first["kept_bytes"] <= n_experts * one
    )


def test_the_budget_is_validated_and_settable(tmp_path, rng_seed, monkeypatch, calls):
    monkeypatch.setattr(runner, "BATCH_TOKENS", 21)
    _, pack = make_moe(tmp_path, "mixtral", rng_seed)
    for bad in (-1, 1.5, "1024", True, float("nan")):
        with pytest.raises(FidelityError, match=r"expert_budget_bytes must be None .* or an int >= 0 .*, not "
                                                + repr(bad).replace(".", r"\.")):
            Oracle(pack, expert_budget_bytes=bad)
    oracle = Oracle(pack, expert_budget_bytes=np.int64(7))
    assert oracle.expert_budget_bytes == 7 and type(oracle.fetch.expert_budget_bytes) is int
    with pytest.raises(FidelityError, match="not -5"):
        oracle.expert_budget_bytes = -5
    assert oracle.expert_budget_bytes == 7
    tokens = torch.randint(0, pack.config["vocab_size"], (3, 21), generator=torch.Generator().manual_seed(rng_seed))
    oracle.expert_budget_bytes = None
    want = oracle.logits(tokens)
    e = oracle.last_forward["experts"]
    assert e["budget_bytes"] is None and e["decodes"] == e["used"] == expected_decodes(calls, None)[1]
    calls.clear()
    oracle.expert_budget_bytes = 0
    assert oracle.fetch.expert_budget_bytes == 0 and torch.equal(oracle.logits(tokens), want)
    e = oracle.last_forward["experts"]
    assert e["budget_bytes"] == 0 and e["decodes"] == expected_decodes(calls, 0)[0] > e["used"]
    assert Oracle(pack).fetch.expert_budget_bytes is None


def test_deepseek_v4_clamped_experts_under_a_budget(rng_seed, monkeypatch, calls):
    """V4's ClampedExperts decode ClampedGatedMLPs (SwiGLU limit, activation fake quantisation) through the same
    table; rows of three lengths are three batches: every budget gives the same hidden states."""
    pack = open_pack(TINY_V4)
    cfg = pack.config
    one = expert_bytes(cfg)
    g = torch.Generator().manual_seed(rng_seed)
    rows = [torch.randint(0, cfg["vocab_size"], (n,), generator=g).tolist() for n in (17, 9, 5)]
    offered = []
    original = moe.DecodedExperts.offer
    monkeypatch.setattr(moe.DecodedExperts, "offer", lambda self, e, mlp, *held: (
        offered.append((type(mlp).__name__, mlp.limit)), original(self, e, mlp, *held))[1])
    results = {}
    for budget, per_layer in ((None, None), (0, 0), (one, 1)):
        calls.clear()
        oracle = Oracle(pack, expert_budget_bytes=budget)
        results[budget] = oracle.hidden_states(rows, progress=False)
        e = oracle.last_forward["experts"]
        decodes, used, kept, peak = expected_decodes(calls, per_layer)
        assert (e["decodes"], e["used"], e["kept_bytes"], e["peak_bytes"]) == (decodes, used, kept * one, peak * one)
        assert budget is None or e["peak_bytes"] <= budget + one
    assert all(torch.equal(a, b) for got in results.values() for a, b in zip(results[None], got))
    assert expected_decodes(calls, 0)[0] > expected_decodes(calls, 0)[1]      # budget 0 re-decodes here
    assert offered and set(offered) == {("ClampedGatedMLP", cfg["swiglu_limit"])}


@pytest.mark.parametrize("budget_experts", [None, 0, 1.5, 3, 1000])
def test_activation_budget_counts_routed_experts_within_the_expert_budget(tmp_path, rng_seed, monkeypatch,
                                                                          budget_experts):
    """On a GPU the activation budget is what free memory leaves after two layers' weights and a batch's working
    memory; under an expert budget a layer's routed experts count as at most the budget plus what a call decodes over
    it at once (one expert, or experts together within min(budget, READ_AHEAD_BYTES)). Computed here from the pack's
    stored shapes and the config."""
    _, pack = make_moe(tmp_path, "qwen3moe-renorm-sparse-step", rng_seed)
    cfg = pack.config
    one = expert_bytes(cfg)
    budget = None if budget_experts is None else int(budget_experts * one)
    oracle = Oracle(pack, expert_budget_bytes=budget)
    layer_bytes, routed_bytes = [], []
    for i in range(cfg["num_hidden_layers"]):
        names = [n for n in pack.names() if n.startswith(f"model.layers.{i}.")]
        layer_bytes.append(4 * sum(math.prod(pack.storage(n).shape) for n in names))
        experts = [n for n in names if ".mlp.experts." in n]
        routed_bytes.append(4 * sum(math.prod(pack.storage(n).shape) for n in experts))
        assert len(experts) == (
            0 if i in cfg["mlp_only_layers"] else 3 * (cfg.get("num_experts") or cfg["num_local_experts"])
        )
    bounded = [
        total if budget is None else total - routed + min(routed, budget + max(one, min(budget, moe.READ_AHEAD_BYTES)))
        for total, routed in zip(layer_bytes, routed_bytes)
    ]
    assert [oracle._resident_layer_bytes(i) for i in range(len(bounded))] == bounded
    free, cached, T = 10 * 2**30, 3 * 2**30 + 4096, 37
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    # torch's allocator holds `cached` bytes reserved and unused (a previous pass's freed blocks): free for it too
    monkeypatch.setattr(
        torch.cuda,
        "memory_stats",
        lambda device=None: {
            "reserved_bytes.all.current": 5 * 2**30,
            "allocated_bytes.all.current": 5 * 2**30 - cached,
        },
    )
    integrated = [False]
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(is_integrated=integrated[0]))
    oracle.device = torch.device("cuda")                     # what _activation_budget reads on a GPU; nothing runs
    got = oracle._activation_budget([[0]], [torch.zeros(T, dtype=torch.long)])
    working = runner.WORK_FACTOR * T * cfg["hidden_size"] * 4
    want = int(0.9 * (free + cached - 2 * max(bounded) - working))
    assert got == want
    # keep_weights: the layers not yet kept still come (all of them, kept as they load); the kept ones are in use
    kept = Oracle(pack, expert_budget_bytes=budget, keep_weights=True)
    kept.device = torch.device("cuda")
    assert kept._activation_budget([[0]], [torch.zeros(T, dtype=torch.long)]) == \
        max(0, int(0.9 * (free + cached - sum(bounded) - working)))
    kept._layers = {0: object()}
    assert kept._activation_budget([[0]], [torch.zeros(T, dtype=torch.long)]) == \
        max(0, int(0.9 * (free + cached - sum(bounded[1:]) - working)))
    # unified memory (an integrated GPU, e.g. GB10): host memory is the same memory, so every batch stays
    integrated[0] = True
    assert oracle._activation_budget([[0]], [torch.zeros(T, dtype=torch.long)]) is None
    if budget_experts == 1000:                               # a budget above every layer's experts changes nothing
        assert bounded == layer_bytes
    if budget_experts == 0:
        assert max(bounded) < max(layer_bytes)
