"""Device independence of the DeepSeek oracles, checked on the CPU (CI has no GPU):

- selection.top_k_mask / top_k_indices keep what a plain Python ranking by (score desc, index asc) keeps, on tie-heavy
  inputs with masked (-inf) entries;
- the V3.2, V4 and V4.1 logits do not change when torch.topk breaks ties another (valid) way: the indexers' scores tie
  at exactly 0 wherever every head's relu is 0, and CUDA's topk orders ties unlike the CPU's, which is what made CUDA
  disagree with the CPU past the first top-k selection;
- every layer computes on its input's device: the layers run on the `meta` device, where a tensor made on the CPU
  and mixed in (as the compressors' RoPE angles were) raises.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fidelity import open_pack
from fidelity.oracle import Oracle
from fidelity.oracle.common import Fetch, layer_call_args
from fidelity.oracle.selection import top_k_indices, top_k_mask

V4_FIXTURES = Path(__file__).parent / "fixtures" / "v4"
TORCH_TOPK = torch.Tensor.topk


def ranked(row: list[float], k: int) -> list[int]:
    """Indices of the k best finite scores, ties to the lower index, ascending."""
    finite = [i for i, v in enumerate(row) if v != float("-inf")]
    return sorted(sorted(finite, key=lambda i: (-row[i], i))[:k])


@pytest.mark.parametrize("k", [1, 3, 8, 40])
def test_top_k_matches_a_ranking_by_score_then_index(rng_seed, k):
    g = torch.Generator().manual_seed(rng_seed)
    scores = torch.randint(-2, 3, (6, 5, 24), generator=g).double()      # few distinct values: ties everywhere
    scores[torch.rand(scores.shape, generator=g) < 0.3] = float("-inf")
    scores[0, 0] = float("-inf")                                          # a row with nothing to keep
    mask, indices = top_k_mask(scores, k), top_k_indices(scores, min(k, scores.shape[-1]))
    for b in range(scores.shape[0]):
        for t in range(scores.shape[1]):
            row = scores[b, t].tolist()
            want = ranked(row, k)
            assert mask[b, t].nonzero().flatten().tolist() == want
            # indices include -inf entries only when fewer than k are finite (callers mask those)
            assert indices[b, t].tolist()[:len(want)] == want or set(want) <= set(indices[b, t].tolist())
            assert indices[b, t].tolist() == sorted(indices[b, t].tolist())


def other_tie_order(counter: list):
    """A valid torch.topk whose ties go to the highest index (CUDA and the CPU each have their own order); counts the
    calls whose kept set differs from torch's own."""

    def topk(x, k, dim=-1, largest=True, sorted=True):
        n = x.shape[dim]
        order = torch.sort(x.flip(dim), dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
        indices = (n - 1) - order
        own = TORCH_TOPK(x, k, dim, largest, sorted).indices
        if not torch.equal(indices.sort(dim).values, own.sort(dim).values):
            counter.append(1)
        return torch.return_types.topk((x.gather(dim, indices), indices))

    return topk


def logits_with_other_ties(monkeypatch, pack, tokens, dtype=torch.float64):
    want = Oracle(pack, dtype=dtype).logits(tokens)
    differing: list = []
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "topk", other_tie_order(differing))
        m.setattr(torch, "topk", other_tie_order(differing))
        got = Oracle(pack, dtype=dtype).logits(tokens)
    return want, got, len(differing)


def v41_native(tmp_path) -> Path:
    from testkit.minipacks_v41 import build_native_v41
    return build_native_v41(V4_FIXTURES / "tiny_v4", tmp_path / "v41")


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_logits_do_not_depend_on_how_topk_breaks_ties(tmp_path, monkeypatch, rng_seed, arch):
    """Rows long enough for many top-k selections (CSA/pool entries >> index_topk), tie-heavy (2 index heads)."""
    pack = open_pack(V4_FIXTURES / "tiny_v4" if arch == "v4" else v41_native(tmp_path))
    tokens = torch.randint(0, pack.config["vocab_size"], (2, 103), generator=torch.Generator().manual_seed(rng_seed))
    want, got, differing = logits_with_other_ties(monkeypatch, pack, tokens)
    print(f"{arch}: {differing} topk calls kept another set under the other tie order")
    assert differing > 0, "no top-k call met a tie: the test would not catch tie-order dependence"
    assert torch.equal(want, got)


def test_v32_logits_do_not_depend_on_how_topk_breaks_ties(tmp_path, monkeypatch, rng_seed):
    from test_oracle_deepseek_v32 import BASE, make
    _, pack = make(tmp_path, "default-rope", rng_seed, index_n_heads=1)   # one head: a score is 0 for half the keys
    tokens = torch.randint(0, BASE["vocab_size"], (2, 60), generator=torch.Generator().manual_seed(rng_seed))
    want, got, differing = logits_with_other_ties(monkeypatch, pack, tokens)
    assert differing > 0, "no top-k call met a tie: the test would not catch tie-order dependence"
    assert torch.equal(want, got)


def meta_fetch(pack) -> Fetch:
    """Weights decoded on the CPU, then moved to the meta device (their values are not needed)."""
    return Fetch(lambda name, device=None: pack.tensor(name), lambda n: tuple(pack.storage(n).shape), "meta",
                 torch.float32)


def run_layers_on_meta(monkeypatch, oracle: Oracle, T: int) -> list:
    """Every layer of the oracle's family built on the meta device and run on meta activations; routed experts (whose
    grouping reads the routing) are replaced by a device-following stand-in. Returns the layers' outputs."""
    from fidelity.oracle import moe

    monkeypatch.setattr(
        moe.RoutedExperts, "__call__", lambda self, x, indices, weights: x * weights.sum(-1, keepdim=True)
    )
    fam, fetch = oracle.family, meta_fetch(oracle.pack)
    tokens = torch.zeros(2, T, dtype=torch.long, device="meta")
    x = fam.embed_hook(torch.empty(2, T, fam.hidden_size, device="meta"))
    rope = fam.rope_tables(T, torch.float32, "meta")
    outs, state = [], fam.new_pass_state()
    for i in range(fam.n_layers):
        layer = fam.load_layer(i, fetch)
        x = layer(x, rope, *layer_call_args(fam, tokens, state))
        outs.append(x)
    return outs


def test_v4_layers_follow_the_input_device(monkeypatch):
    oracle = Oracle(open_pack(V4_FIXTURES / "tiny_v4"))
    outs = run_layers_on_meta(monkeypatch, oracle, 103)
    assert all(o.device.type == "meta" and o.shape == outs[0].shape for o in outs)


def test_v41_layers_follow_the_input_device(tmp_path, monkeypatch):
    """Engram reads its table rows on the host from the token ids (the layers without it run on meta token ids; the
    Engram module itself gets host ids and meta streams); everything else stays on the input's device."""
    oracle = Oracle(open_pack(v41_native(tmp_path)))
    fam = oracle.family
    engram = fam.engram(fam.v41.engram_layers[0], meta_fetch(oracle.pack))
    streams = torch.empty(2, 103, fam.args.hc_mult, fam.hidden_size, device="meta")
    ids = fam.token_map()[torch.randint(0, fam.vocab_size, (2, 103))]
    assert engram(streams, ids).device.type == "meta"
    monkeypatch.setattr(fam.v41, "engram_layers", [])
    outs = run_layers_on_meta(monkeypatch, oracle, 103)
    assert all(o.device.type == "meta" for o in outs)


def test_v32_layers_follow_the_input_device(tmp_path, monkeypatch, rng_seed):
    from test_oracle_deepseek_v32 import make
    _, pack = make(tmp_path, "default-rope", rng_seed)
    outs = run_layers_on_meta(monkeypatch, Oracle(pack), 40)   # > index_topk: the indexer runs
    assert all(o.device.type == "meta" for o in outs)
