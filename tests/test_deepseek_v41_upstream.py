"""The V4.1 oracle against DeepSeek's own upstream `inference/model.py`, on the whole-model dump an independent project
made of it (../shared/golden/deepseek_v41/model_forward.json: 6 layers of every attention mode, 11-token prefill then
six single-token decode steps through upstream's KV cache; its README says how it was made).

Under numerics "deepseek" the oracle rounds what model.py rounds (window KV FP8, compressed KV FP4, indexer q/k FP4;
the dump's weights are float32, so no linear input is rounded) and agrees with every prefill output and decode position
11 to ~1e-6. Decode positions 12-16 follow from upstream's cache path, which a one-pass forward (and upstream's own
prefill) never takes: at a decode step that completes no ratio-2 group (12, 14, 16), layer 1's indexer scores its
queries against the last *published* index keys, which are layer 3's ratio-1 keys (positions 0..), not its own; 13 and
15 inherit that through the window entries written at 12 and 14. `upstream_decode_path` emulates exactly that, test
only.
"""
from __future__ import annotations

import json

import pytest
import torch

from fidelity import open_pack
from fidelity.oracle import Oracle, OracleTaps
from fidelity.oracle.deepseek import v41
from fidelity.oracle.deepseek.quant import DeepSeekRounding, identity
from _upstream_v41 import GOLDEN, write_upstream_pack

FIXTURE = GOLDEN / "model_forward.json"
BOUND = 1e-5          # relative to the reference's largest magnitude, per compared tensor
QUIRK_POSITIONS = (12, 14, 16)

pytestmark = pytest.mark.skipif(not FIXTURE.is_file(), reason=f"missing data: {FIXTURE} (../shared/golden)")


@pytest.fixture(scope="module")
def dump() -> dict:
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def pack(dump, tmp_path_factory):
    return open_pack(write_upstream_pack(dump, tmp_path_factory.mktemp("upstream_v41")))


def run(oracle: Oracle, ids: list[int]) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """({layer: streams [T, hc, dim]}, final hidden [T, dim], logits [T, vocab]) of one pass."""
    blocks: dict[int, torch.Tensor] = {}
    taps = {layer: (lambda layer: lambda x: blocks.__setitem__(layer, x[0].cpu()))(layer)
            for layer in range(oracle.family.n_layers)}
    with oracle.tapped(OracleTaps(layer_outputs=taps)):
        _, acts = oracle._forward([ids], False)
    final = acts[0][0]
    return blocks, final.cpu(), oracle.apply_head(final).cpu()


def errors(dump: dict, blocks: dict, final: torch.Tensor, logits: torch.Tensor) -> list[dict]:
    """Per upstream step: the largest relative error of its logits, final hidden and each layer's streams."""
    c, out = dump["config"], []
    for s in dump["steps"]:
        st, n = s["start"], s["len"]
        rel = lambda got, want: float((got.double() - want.double()).abs().max() / want.double().abs().max())  # noqa: E731
        layers = [rel(blocks[i][st:st + n], torch.tensor(b).reshape(n, c["hc_mult"], c["dim"]))
                  for i, b in enumerate(s["blocks"])]
        out.append({"start": st, "len": n, "logits": rel(logits[st + n - 1], torch.tensor(s["logits"])),
                    "final": rel(final[st:st + n], torch.tensor(s["final"]).reshape(n, c["dim"])),
                    "layers": max(layers)})
    return out


def worst(errs: list[dict], starts) -> float:
    return max(max(e["logits"], e["final"], e["layers"]) for e in errs if e["start"] in starts)


def ids_of(dump) -> list[int]:
    return [i for s in dump["steps"] for i in s["ids"]]


PREFILL_AND_FIRST_DECODE = (0, 11)


CUDA = pytest.param("cuda", marks=[pytest.mark.device, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                            reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_deepseek_numerics_reproduce_upstream_prefill_and_first_decode(dump, pack, dtype, device):
    errs = errors(dump, *run(Oracle(pack, dtype=dtype, numerics="deepseek", device=device), ids_of(dump)))
    for e in errs:
        print(e)
    assert worst(errs, PREFILL_AND_FIRST_DECODE) <= BOUND
    # the later decode positions are upstream's cache path (next test), not a tolerance question
    assert all(e["logits"] > 1e-2 for e in errs if e["start"] in QUIRK_POSITIONS)


def test_exact_numerics_are_not_upstreams(dump, pack):
    """The control of the whole: without the reference's rounding the logits are ~0.1-1 of max|logit| away."""
    errs = errors(dump, *run(Oracle(pack, numerics="exact"), ids_of(dump)))
    assert min(e["logits"] for e in errs) > 1e-2


class Without(DeepSeekRounding):
    """The V4.1 rounding with one of its roundings switched off (the controls)."""

    def __init__(self, rounding: DeepSeekRounding, off: str):
        super().__init__(**{f: getattr(rounding, f) for f in rounding.__dataclass_fields__})
        object.__setattr__(self, "off", off)

    def window_kv(self, kv, rope_dim):
        return kv if self.off == "window_kv" else super().window_kv(kv, rope_dim)

    def compressed_kv(self, kv, rope_dim):
        return kv if self.off == "compressed_kv" else super().compressed_kv(kv, rope_dim)

    def index_qk(self, x):
        return x if self.off == "index_qk" else super().index_qk(x)


@pytest.mark.parametrize("off", ["window_kv", "compressed_kv", "index_qk"])
def test_each_rounding_is_needed(dump, pack, off):
    oracle = Oracle(pack, numerics="deepseek")
    oracle.family.rounding = Without(oracle.family.rounding, off)
    errs = errors(dump, *run(oracle, ids_of(dump)))
    print(off, [f"{e['logits']:.2g}" for e in errs])
    assert worst(errs, PREFILL_AND_FIRST_DECODE) > 100 * BOUND


def test_a_changed_config_field_departs(dump, tmp_path):
    changed = open_pack(
        write_upstream_pack(dump, tmp_path / "changed", swiglu_limit=dump["config"]["swiglu_limit"] * 2)
    )
    errs = errors(dump, *run(Oracle(changed, numerics="deepseek"), ids_of(dump)))
    assert worst(errs, PREFILL_AND_FIRST_DECODE) > 100 * BOUND


@pytest.fixture
def upstream_decode_path(pack, dump, monkeypatch):
    """Layer 1's selection at positions 12, 14 and 16 scored against layer 3's index keys, as upstream's cache path
    does (module docstring); layer 2 reuses that selection as it reuses layer 1's."""
    pools = {}
    build_pool, select = v41.Attention.build_pool, v41.Attention.select

    def recording_build_pool(self, x):
        pools[self.layer] = pool = build_pool(self, x)
        return pool

    monkeypatch.setattr(v41.Attention, "build_pool", recording_build_pool)
    run(Oracle(pack, numerics="deepseek"), ids_of(dump))
    published = pools[3].index_keys          # layer 3's ratio-1 keys, one per position: positions 0.. are prefill's

    def upstream_select(self, x, q_latent, keys, compress_rope, state):
        keep = select(self, x, q_latent, keys, compress_rope, state)
        if self.layer == 1:
            stale = select(self, x, q_latent, published[:, :keys.shape[1]].to(keys.device), compress_rope, state)
            keep[:, list(QUIRK_POSITIONS)] = stale[:, list(QUIRK_POSITIONS)]
        return keep

    monkeypatch.setattr(v41.Attention, "build_pool", build_pool)
    monkeypatch.setattr(v41.Attention, "select", upstream_select)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_later_decode_positions_follow_from_upstreams_cache_path(dump, pack, upstream_decode_path, device):
    errs = errors(dump, *run(Oracle(pack, numerics="deepseek", device=device), ids_of(dump)))
    for e in errs:
        print(e)
    assert worst(errs, [s["start"] for s in dump["steps"]]) <= BOUND


def test_exact_numerics_round_nothing(pack):
    oracle = Oracle(pack, numerics="exact")
    assert oracle.numerics == "exact" and oracle.family.rounding is None
    assert Oracle(pack, numerics="deepseek").family.rounding.window_kv is not identity
