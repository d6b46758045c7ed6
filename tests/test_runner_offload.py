"""Activations that do not fit the device's budget wait in host memory and travel per batch: the numbers are the same
bits whatever the budget, and the activations held on the device between layers stay within the budget plus the one
batch in flight (the runner's own accounting, which on CUDA sits beside the allocator's peak)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from fidelity.environment import Environment
from fidelity.errors import FidelityError
from fidelity.oracle import Oracle, parallel, runner
from testkit.synthetic import SyntheticPack, llama_config

HIDDEN = 64


def _pack(seed: int):
    cfg = llama_config(hidden_size=HIDDEN, intermediate_size=96, n_layers=3, vocab_size=500, n_heads=4, n_kv_heads=2)
    return SyntheticPack(cfg, seed=seed)


def _rows(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [40, 40, 40, 17, 17, 33, 40, 9]
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in lengths]


def _batch_bytes(rows, batch_tokens) -> list[int]:
    by_len: dict[int, int] = {}
    for r in rows:
        by_len[len(r)] = by_len.get(len(r), 0) + 1
    out = []
    for length, count in by_len.items():
        per = max(1, batch_tokens // length)
        out += [min(per, count - s) * length * HIDDEN * 4 for s in range(0, count, per)]
    return out


@pytest.mark.parametrize("budget_batches", [0, 1.5, 3])
def test_small_device_budget_gives_the_same_bits_and_bounded_device_activations(rng_seed, monkeypatch, budget_batches):
    monkeypatch.setattr(runner, "BATCH_TOKENS", 80)       # several batches of each length
    pack, rows = _pack(rng_seed % 10_000), _rows(rng_seed)
    want = Oracle(pack).hidden_states(rows, progress=False)
    sizes = _batch_bytes(rows, 80)
    budget = int(budget_batches * max(sizes))
    oracle = Oracle(pack, activation_budget=budget)
    started = time.perf_counter()
    got = oracle.hidden_states(rows, progress=False)
    elapsed = time.perf_counter() - started
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    r = oracle.last_forward
    assert r["budget_bytes"] == budget and r["resident_batches"] + r["offloaded_batches"] == len(sizes)
    assert r["peak_device_activation_bytes"] <= budget + max(sizes)
    kept = []                                              # first come first kept: what the budget holds
    for s in sizes:
        kept.append(sum(kept) + s <= budget)
        kept[-1] = s if kept[-1] else 0
    assert r["offloaded_batches"] == sum(k == 0 for k in kept) and r["host_activation_bytes"] == sum(sizes) - sum(kept)
    assert r["offloaded_batches"] >= (1 if budget < sum(sizes) else 0)
    # one host buffer per waiting batch, allocated once and reused by every later layer and by its final output
    assert r["host_allocs"] == r["offloaded_batches"] and r["host_alloc_bytes"] == r["host_activation_bytes"]
    # the seconds those allocations took: some where there were any, none where there were none, within the forward
    if r["host_allocs"]:
        assert 0 < r["host_alloc_seconds"] < elapsed, (r["host_alloc_seconds"], elapsed)
    else:
        assert r["host_alloc_seconds"] == 0
    tokens = torch.tensor([rows[0], rows[1], rows[2], rows[6]])
    assert torch.equal(Oracle(pack, activation_budget=budget).logits(tokens), Oracle(pack).logits(tokens))


def test_no_budget_keeps_everything_and_reports_it(rng_seed):
    pack, rows = _pack(rng_seed % 10_000), _rows(rng_seed)
    oracle = Oracle(pack)
    oracle.hidden_states(rows, progress=False)
    r = oracle.last_forward
    assert r["budget_bytes"] is None and r["offloaded_batches"] == 0 and r["host_activation_bytes"] == 0
    assert r["host_allocs"] == 0 and r["host_alloc_bytes"] == 0 and r["host_alloc_seconds"] == 0
    total = sum(len(x) for x in rows) * HIDDEN * 4
    assert r["peak_device_activation_bytes"] == total


def test_budget_from_the_environment_and_a_bad_value(rng_seed, monkeypatch):
    pack, rows = _pack(rng_seed % 10_000), _rows(rng_seed)
    settings = parallel.RunSettings(**Environment.from_environ({"FIDELITY_DEVICE_ACTIVATIONS_GIB": "0"}).run_settings())
    oracle = parallel.make_oracle(pack, settings=settings)
    oracle.hidden_states(rows[:3], progress=False)
    assert oracle.last_forward["budget_bytes"] == 0 and oracle.last_forward["resident_batches"] == 0
    with pytest.raises(FidelityError, match=r"FIDELITY_DEVICE_ACTIVATIONS_GIB='lots': expected a number of GiB"):
        Environment.from_environ({"FIDELITY_DEVICE_ACTIVATIONS_GIB": "lots"})


TINY_V4 = Path(__file__).parent / "fixtures" / "v4" / "tiny_v4"


@pytest.mark.parametrize("name", ["v4", "v41"])
def test_deepseek_v4_streams_and_v41_state_survive_offloading(rng_seed, name, tmp_path):
    """V4's [B, T, hc, hidden] streams and V4.1's cross-layer state (keyed by the batch's token tensor) through host
    memory: the same bits as all on the device."""
    from fidelity import open_pack
    from testkit.minipacks_v41 import build_native_v41
    pack = open_pack(TINY_V4 if name == "v4" else build_native_v41(TINY_V4, tmp_path / "v41"))
    g = torch.Generator().manual_seed(rng_seed)
    vocab = pack.config["vocab_size"]
    rows = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (24, 24, 11)]
    want = Oracle(pack).hidden_states(rows, progress=False)
    oracle = Oracle(pack, activation_budget=0)
    got = oracle.hidden_states(rows, progress=False)
    r = oracle.last_forward
    assert r["offloaded_batches"] == 2
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    # V4's final output is [B, T, hidden], its streams [B, T, hc, hidden]: a buffer of its own per batch
    hc = pack.config["hc_mult"]
    assert r["host_allocs"] == 4 and r["host_alloc_bytes"] == r["host_activation_bytes"] * (1 + 1 / hc)


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_offloaded_batches_equal_resident_ones(rng_seed, monkeypatch):
    monkeypatch.setattr(runner, "BATCH_TOKENS", 80)
    pack, rows = _pack(rng_seed % 10_000), _rows(rng_seed)
    want = Oracle(pack, device="cuda").hidden_states(rows, progress=False)
    before = runner.pinned_pool_stats()
    oracle = Oracle(pack, device="cuda", activation_budget=0)
    got = oracle.hidden_states(rows, progress=False)
    after = runner.pinned_pool_stats()
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(want, got))
    r = oracle.last_forward
    assert r["offloaded_batches"] == len(_batch_bytes(rows, 80)) and r["cuda_peak_allocated_bytes"] > 0
    assert all(h.device.type == "cpu" and h.is_pinned() for h in got)
    assert r["host_allocs"] == r["offloaded_batches"] and r["host_alloc_bytes"] == r["host_activation_bytes"]
    # torch's pinned pool, where this torch reports it: what it grew by during the forward (blocks its cache could not
    # serve, weight staging counted too) is part of what it grew by around the whole call, a block created adds bytes
    # (nothing returns blocks to CUDA meanwhile), and the waiting batches' buffers, alive in `got`, are pool blocks
    assert ("pinned_pool" in r) == (before is not None)
    if before is not None:
        pool = r["pinned_pool"]
        assert 0 <= pool["new_blocks"] <= after["new_blocks"] - before["new_blocks"], (pool, before, after)
        assert 0 <= pool["new_block_seconds"] <= after["new_block_seconds"] - before["new_block_seconds"] + 1e-9
        assert (pool["reserved_bytes"] > 0) == (pool["new_blocks"] > 0), pool
        assert after["reserved_bytes"] >= r["host_alloc_bytes"] > 0, (after, r["host_alloc_bytes"])
    again = Oracle(pack, device="cuda", activation_budget=0)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(want, again.hidden_states(rows, progress=False)))


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_free_memory_budget_counts_the_allocators_cached_blocks(rng_seed, monkeypatch):
    """The budget read from free memory counts torch's cached blocks: a pass's freed blocks stay reserved, and before
    they were counted the second of two identical forwards got a budget smaller by the first one's reserve
    (realscale, V4.1 at 317k tokens: 2.2 GiB, then 35 of 39 batches offloaded and 6.4 s of new pinned buffers in the
    repeat). What a pass leaves allocated for good (its caches) is not free, and the budget says so."""
    pack, rows = _pack(rng_seed % 10_000), _rows(rng_seed)
    oracle = Oracle(pack, device="cuda")
    oracle.hidden_states(rows[:1], progress=False)               # kernels, cuBLAS workspace
    device = oracle.device
    held = torch.cuda.memory_allocated(device)
    usable = runner.device_free_bytes(device) + held
    big = [r * 200 for r in rows]                                # a pass that grows the allocator's reserve
    first = oracle.hidden_states(big, progress=False)
    budget = oracle.last_forward["budget_bytes"]
    del first
    kept = torch.cuda.memory_allocated(device) - held            # what the pass left allocated
    assert torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) > 256 * 2**20
    # free for torch + allocated is what the device offers this process, before and after the pass alike (a few MiB
    # of slack: kernels loaded lazily on first use take device memory outside torch's allocator)
    assert abs(runner.device_free_bytes(device) + torch.cuda.memory_allocated(device) - usable) <= 16 * 2**20
    again = oracle.hidden_states(big, progress=False)
    repeat = oracle.last_forward["budget_bytes"]
    assert budget is not None and abs(repeat - (budget - 0.9 * kept)) <= 16 * 2**20, (budget, repeat, kept)
    del again
