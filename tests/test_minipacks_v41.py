"""Miniature DeepSeek-V4.1 packs (testkit/minipacks_v41.py) derived from the committed tiny V4: the V4.1 layout of
the native pack (pool owners, index keys, Engram shard, no hc_head), every seed layout opening with its Engram table
FP8 per row in its own shard (rows read lazily equal a float8 cast x scale computed here), EXL3 experts from the V4
fixture's encodings, the oracle on each, and `fidelity compare` end to end."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fidelity import open_pack
from fidelity.oracle import Oracle
from fidelity.oracle.deepseek.engram import RowTable
from fidelity.packs.exl3.layouts import official_to_hf, routed_expert
from fidelity.packs.exl3.encoder import EncodingCache
from testkit.minipacks_v4 import FP8_DECLARED, LAYOUTS
from testkit.minipacks_v41 import V41_SPEC, build_native_v41, write_all_v41
from test_oracle_support import compare_cli_kl

V4_FIXTURES = Path(__file__).parent / "fixtures" / "v4"
TABLE = "layers.0.engram.embed"
COMPARED = ("deepseek_v41_exl3", "cuda-exl3", "fp8-mxfp4")


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    return build_native_v41(V4_FIXTURES / "tiny_v4", tmp_path_factory.mktemp("v41") / "native")


@pytest.fixture(scope="module")
def packs(native, tmp_path_factory):
    cache = EncodingCache(V4_FIXTURES / "tiny_v4_encodings.safetensors")
    out = write_all_v41(native, tmp_path_factory.mktemp("v41packs"), V41_SPEC, cache)
    assert cache.misses == 0, "the V4.1 miniature's experts/head/wo_a drifted from the tiny V4's encodings"
    return out


def test_native_is_a_v41_layout(native):
    pack = open_pack(native)
    names = set(pack.names())
    cfg = pack.config
    assert cfg["architectures"] == ["DeepseekV41ForCausalLM"] and cfg["engram_layer_ids"] == [0]
    assert not any(n.startswith("hc_head_") for n in names) and not any(".tid2eid" in n for n in names)
    assert {n for n in names if ".compressor." in n} == {f"layers.1.attn.compressor.{w}"
                                                         for w in ("wkv.weight", "wgate.weight", "norm.weight")}
    assert {"layers.1.attn.indexer.wk.weight", "layers.2.attn.indexer.wq_b.weight"} <= names
    assert "layers.2.attn.indexer.wk.weight" not in names
    with safe_open(str(native / "model-engram-L00.safetensors"), "pt") as f:
        assert list(f.keys()) == [f"{TABLE}.weight"]
        assert f.get_slice(f"{TABLE}.weight").get_shape()[0] == cfg["engram_num_embeddings"][0]


def fp8_rows_reference(w: torch.Tensor) -> torch.Tensor:
    """Per row: s = amax / 448, value = float8_e4m3(w / s) * s."""
    out = torch.empty_like(w)
    for r in range(w.shape[0]):
        s = w[r].abs().max().item() / 448.0
        out[r] = (w[r] / s).to(torch.float8_e4m3fn).float() * s
    return out


def fp8_block_reference(w: torch.Tensor, block: int) -> torch.Tensor:
    """Block FP8 with power-of-two scales, one block at a time: s = 2^ceil(log2(amax / 448))."""
    out = torch.empty_like(w)
    for r in range(0, w.shape[0], block):
        for c in range(0, w.shape[1], block):
            part = w[r:r + block, c:c + block]
            s = 2.0 ** math.ceil(math.log2(part.abs().max().item() / 448.0))
            out[r:r + block, c:c + block] = (part / s).to(torch.float8_e4m3fn).float() * s
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_opens_engram_rows_exact_and_oracle_runs(native, packs, layout, rng_seed):
    pack = open_pack(packs[layout])
    ref = open_pack(native)
    storage = pack.storage(f"{TABLE}.weight")
    assert storage.format == "fp8_e4m3" and {Path(f).name for f in storage.files} == {"model-engram-L00.safetensors"}
    table = RowTable.from_pack(pack, TABLE)
    stored = (lambda n: n) if layout == "fp8-mxfp4" else official_to_hf
    g = torch.Generator().manual_seed(rng_seed)
    index = torch.randint(0, table.n_rows, (50,), generator=g)
    want = fp8_rows_reference(ref.tensor(f"{TABLE}.weight")[index])
    assert torch.equal(table.rows(index), want)
    for name in ("layers.1.attn.wq_a.weight", "layers.0.engram.wkv.weight", "layers.1.attn.indexer.wk.weight"):
        st = pack.storage(stored(name))
        block = 32 if layout in FP8_DECLARED else 128     # the V4.1 release's grid where the layout can state it
        assert st.format == "fp8_e4m3", name
        assert st.block == (block, block) or st.numel <= block * block, name       # one block: per tensor
        assert torch.equal(pack.tensor(stored(name)), fp8_block_reference(ref.tensor(name), block)), name
    formats = {pack.storage(stored(n)).format for n in ref.names() if routed_expert(n) is not None}
    assert formats == ({"mxfp4"} if layout == "fp8-mxfp4" else {"exl3"})
    tokens = torch.randint(0, ref.config["vocab_size"], (1, 40), generator=g)
    oracle = Oracle(pack)
    logits = oracle.logits(tokens)
    engram_rows = oracle.family.table(0).rows_read
    assert torch.isfinite(logits).all() and 0 < engram_rows <= 40 * 4 < table.n_rows


@pytest.mark.slow
def test_compare_cli_end_to_end(native, packs, tmp_path, rng_seed):
    words = ["engram", "pool", "index", "window", "Sparse", "Token", "scale", "hyper", "stream", "drift", "K", "bits"]
    report, kl = compare_cli_kl(
        native, packs, COMPARED, words, rows=4, words_per_row=10, bootstrap=100, tmp_path=tmp_path, seed=rng_seed
    )
    assert report["panel"]["scored_positions"] > 4 * 30
    print("V4.1 compare KL (nats/token):", {k: f"{v:.4g}" for k, v in kl.items()})
    assert set(kl) == set(COMPARED) and all(math.isfinite(v) and v > 0 for v in kl.values())
    assert all(kl["fp8-mxfp4"] < kl[lay] for lay in COMPARED if lay != "fp8-mxfp4")
