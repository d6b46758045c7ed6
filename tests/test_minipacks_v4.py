"""Miniature DeepSeek-V4 packs (testkit/minipacks_v4.py) from the committed tiny V4 in tests/fixtures/v4: the fixture is
transformers' own model; every layout opens, every tensor decodes (FP8 ue8m0 and MXFP4 bit-exact against formulations
written here, EXL3 error shrinking with K), the V4 oracle runs, `fidelity compare` runs end to end, and a stated K that
disagrees with a trellis is refused naming the tensor and file."""
from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from fidelity import open_pack
from fidelity.errors import PackError
from fidelity.oracle import Oracle
from fidelity.packs.exl3.layouts import PLAN_FILE, official_to_hf, routed_expert
from fidelity.packs.exl3.encoder import EncodingCache
from testkit.minipacks_v4 import (EXL3_LAYOUTS, LAYOUTS, TINY_V4, V4MiniSpec, kind_of, official_name,
                                         write_all)
from _deepseek_configs import reference_ties_to_lower_index  # noqa: F401 (autouse)
from test_exl3_layouts import raw_tensors, standard_decode
from test_oracle_support import compare_cli_kl

FIXTURES = Path(__file__).parent / "fixtures" / "v4"
NATIVE = FIXTURES / "tiny_v4"
ENCODINGS = FIXTURES / "tiny_v4_encodings.safetensors"
SPEC = V4MiniSpec()
FORMAT = {"exllamav3": "exl3", "fp8-mxfp4": "fp8"}


@pytest.fixture(scope="module")
def native():
    return open_pack(NATIVE)


@pytest.fixture(scope="module")
def packs(native, tmp_path_factory):
    cache = EncodingCache(ENCODINGS)
    out = write_all(native, tmp_path_factory.mktemp("v4packs"), SPEC, cache)
    assert cache.misses == 0, "tiny_v4 and tiny_v4_encodings.safetensors drifted apart: rerun make_fixtures.py"
    return out


def stored_name(layout: str, official: str) -> str:
    """The name a layout's pack exposes an official tensor under."""
    return official if layout == "fp8-mxfp4" else official_to_hf(official)


# ---------------------------------------------------------------------------------------------------------------------
# the fixture is transformers' DeepSeek-V4
# ---------------------------------------------------------------------------------------------------------------------
def test_native_fixture_is_transformers_v4(native, tmp_path, rng_seed):
    """The committed official-named weights, put back under transformers' names, load into DeepseekV4ForCausalLM with
    nothing missing or left over, and the oracle on the official-named pack matches it (fp32 compute)."""
    import transformers as T
    from safetensors.torch import load_file, save_file

    cfg = T.DeepseekV4Config.from_pretrained(NATIVE)
    assert cfg.hc_mult > 1 and cfg.mlp_layer_types[0] == "hash_moe"
    assert len(set(cfg.layer_types)) == 3           # sliding, CSA, HCA: different compress ratios
    cfg._attn_implementation = "eager"
    model = T.DeepseekV4ForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "hf")
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    ours = load_file(NATIVE / "model.safetensors")
    assert {official_name(k) for k in saved} == set(ours)
    save_file({k: ours[official_name(k)].to(saved[k].dtype) for k in saved}, tmp_path / "hf" / "model.safetensors",
              metadata={"format": "pt"})
    model = T.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    model.set_experts_implementation("eager")
    tokens = torch.randint(0, cfg.vocab_size, (2, 40))       # past the window (8) and index_topk (4) x ratio (4)
    with torch.no_grad():
        want = model(tokens).logits.float()
    got = Oracle(native).logits(tokens)
    delta = (got - want).abs().max().item()
    print(f"native oracle vs transformers: max |dlogit| {delta:.3g}, logit scale {want.abs().max().item():.3g}")
    assert delta <= 1e-4 and want.abs().max() > 1.0


# ---------------------------------------------------------------------------------------------------------------------
# references written here
# ---------------------------------------------------------------------------------------------------------------------
def fp8_ue8m0_reference(w: torch.Tensor) -> torch.Tensor:
    """DeepSeek block-128 FP8 with ue8m0 scales, one block at a time: s = 2^ceil(log2(amax / 448))."""
    out = torch.empty_like(w)
    for r in range(0, w.shape[0], 128):
        for c in range(0, w.shape[1], 128):
            block = w[r:r + 128, c:c + 128]
            s = 2.0 ** math.ceil(math.log2(block.abs().max().item() / 448.0))
            out[r:r + 128, c:c + 128] = (block / s).to(torch.float8_e4m3fn).float() * s
    return out


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def mxfp4_reference(w: torch.Tensor) -> torch.Tensor:
    """OCP MXFP4, element by element: shared scale 2^(floor(log2 amax) - 2) per 32 inputs, nearest e2m1 value with ties
    to the even code, saturating at 6."""
    out = torch.empty_like(w)
    for r in range(w.shape[0]):
        for g in range(0, w.shape[1], 32):
            vals = w[r, g:g + 32].tolist()
            s = 2.0 ** (math.floor(math.log2(max(abs(v) for v in vals))) - 2)
            for j, v in enumerate(vals):
                x = abs(v) / s
                code = min(range(8), key=lambda i: (abs(x - E2M1[i]), i % 2))
                out[r, g + j] = math.copysign(E2M1[code] * s, v)
    return out


# the seed cards' placement of routed experts (packs/exl3/layouts.py)
EXPERT_FILE = {
    "exllamav3": lambda L, e: "model.safetensors",
    "exl3-mixed": lambda L, e: "model.safetensors",
    "cuda-exl3": lambda L, e: "model-00002-of-00002.safetensors",
    "fp8-mxfp4": lambda L, e: "model-00002-of-00002.safetensors",
    "deepseek_v41_exl3": lambda L, e: f"model-exl3-L{L:02d}-p{int(e >= TINY_V4['n_routed_experts'] // 2)}.safetensors",
    "exl3-expert-packs": lambda L, e: f"model-experts-L{L:02d}.safetensors",
}


# ---------------------------------------------------------------------------------------------------------------------
# every layout
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_opens_and_every_tensor_decodes(native, packs, layout):
    pack = open_pack(packs[layout])
    assert pack.format == FORMAT.get(layout, layout)
    expected = {stored_name(layout, n) for n in native.names()}
    extra = set(pack.names()) - expected
    assert expected <= set(pack.names()) and extra <= {"engram.tables.0.weight"}
    if layout == "exl3-expert-packs":        # the official index names an Engram shard the V4 pack does not carry
        with pytest.raises(PackError, match=r"engram\.tables\.0\.weight.*model-00003-of-00003"):
            pack.tensor("engram.tables.0.weight")
    expert_err: dict[int, list[float]] = {}
    kinds = {}
    raw = raw_tensors(
        packs[layout]
    )  # EXL3 values: bit for bit exl3.decode_weight of the stored pieces (standard layout)
    for name in native.names():
        want = native.tensor(name)
        got = pack.tensor(stored_name(layout, name))
        assert got.shape == want.shape and torch.isfinite(got).all(), name
        kind = kinds[name] = kind_of(name, want)
        storage = pack.storage(stored_name(layout, name)).format
        rel = ((got - want).norm() / want.norm()).item()
        if kind == "expert" and layout != "fp8-mxfp4":
            K = SPEC.expert_bits(layout, routed_expert(name)[1], routed_expert(name)[2])
            assert storage == "exl3", name
            assert torch.equal(got, standard_decode(raw, stored_name(layout, name), tuple(want.shape))), name
            expert_err.setdefault(K, []).append(rel)
        elif kind in ("expert", "shared"):
            assert storage == "mxfp4" and torch.equal(got, mxfp4_reference(want)), name
        elif kind in ("dense", "head", "wo_a") and storage != "exl3":
            assert storage == "fp8_e4m3" and torch.equal(got, fp8_ue8m0_reference(want)), name
        elif kind in ("head", "wo_a"):
            assert layout in ("exllamav3", "deepseek_v41_exl3") and storage == "exl3", name
            assert torch.equal(got, standard_decode(raw, stored_name(layout, name), tuple(want.shape))), name
        else:
            assert torch.equal(got, want), name                 # bf16 stays bf16; tid2eid exact
    assert {"expert", "shared", "dense", "head", "wo_a", "plain"} <= set(kinds.values())
    for name, kind in kinds.items():
        if kind == "expert":
            _, layer, e = routed_expert(name)
            assert {Path(f).name for f in pack.storage(stored_name(layout, name)).files} == {
                EXPERT_FILE[layout](layer, e)
            }
    if expert_err:
        mean = {K: sum(v) / len(v) for K, v in sorted(expert_err.items())}
        print(f"{layout}: EXL3 expert relative error by K {mean}")
        ks = sorted(mean)
        assert all(mean[a] > mean[b] for a, b in zip(ks, ks[1:]))    # the encodings: more bits, less error
        assert len(ks) >= 3                                      # mixed K really is mixed
    tokens = torch.randint(0, TINY_V4["vocab_size"], (1, 24))
    assert torch.isfinite(Oracle(pack).logits(tokens)).all()


# ---------------------------------------------------------------------------------------------------------------------
# fidelity compare end to end
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_compare_cli_end_to_end(packs, tmp_path, rng_seed):
    words = ["pack", "trellis", "expert", "window", "sparse", "token", "scale", "hyper", "stream", "drift", "K", "bits"]
    report, kl = compare_cli_kl(
        NATIVE, packs, LAYOUTS, words, rows=6, words_per_row=12, bootstrap=200, tmp_path=tmp_path, seed=rng_seed
    )
    assert report["panel"]["scored_positions"] > 6 * 40      # byte-level tokens: ~70 per row
    print("compare KL (nats/token):", {k: f"{v:.4g}" for k, v in kl.items()})
    print("bpw (EXL3 experts are 64x64 padded to 128x128):", {r["label"]: r["bpw"] for r in report["results"]})
    assert set(kl) == set(LAYOUTS)
    assert all(math.isfinite(v) and v > 0 for v in kl.values())
    # FP8 dense + MXFP4 experts beats the same pack with its experts at EXL3 K 1-4
    assert all(kl["fp8-mxfp4"] < kl[lay] for lay in EXL3_LAYOUTS)


# ---------------------------------------------------------------------------------------------------------------------
# a stated K that disagrees with the trellis
# ---------------------------------------------------------------------------------------------------------------------
def _restate(root: Path, layout: str, layer: int, expert: int, K: int) -> Path:
    """Edit the K the layout's metadata states for one routed expert; returns the edited file."""
    if layout == "exllamav3":
        f = root / "quantization_config.json"
        qc = json.loads(f.read_text())
        for w in ("gate_proj", "up_proj", "down_proj"):
            qc["tensor_storage"][f"model.layers.{layer}.mlp.experts.{expert}.{w}"]["bits_per_weight"] = K
    elif layout == "cuda-exl3":
        f = root / "quantization_config.json"
        qc = json.loads(f.read_text())
        digits = list(qc["expert_bits"][str(layer)])
        digits[expert] = str(K)
        qc["expert_bits"][str(layer)] = "".join(digits)
    else:
        f = root / PLAN_FILE
        qc = json.loads(f.read_text())
        entry = qc["layers"][str(layer)] if layout == "deepseek_v41_exl3" else qc["layers"][layer]["k"]
        digits = list(entry)
        digits[expert] = str(K)
        if layout == "deepseek_v41_exl3":
            qc["layers"][str(layer)] = "".join(digits)
        else:
            qc["layers"][layer]["k"] = "".join(digits)
    f.write_text(json.dumps(qc))
    return f


@pytest.mark.parametrize("layout", ["exllamav3", "cuda-exl3", "deepseek_v41_exl3", "exl3-expert-packs"])
def test_stated_k_disagreeing_with_trellis_is_refused(packs, tmp_path, layout):
    root = shutil.copytree(packs[layout], tmp_path / layout)
    layer, expert = 2, 1
    true_k = SPEC.expert_bits(layout, layer, expert)
    wrong = true_k + 1
    edited = _restate(root, layout, layer, expert, wrong)
    with pytest.raises(PackError) as err:
        pack = open_pack(root)
        for n in pack.names():
            pack.tensor(n)
    msg = str(err.value)
    print(f"{layout}: {msg}")
    assert f"K={wrong}" in msg and f"implies K={true_k}" in msg
    assert re.search(rf"layers\.{layer}\.(ffn|mlp)\.experts\.{expert}\.", msg) and ".trellis" in msg
    assert edited.name in msg or PLAN_FILE in msg or "quantization_config.json" in msg


def test_unknown_layout_is_named(native, tmp_path):
    from fidelity.errors import ConfigError
    from testkit.minipacks_v4 import write_v4_minipack

    with pytest.raises(ConfigError, match=r"unknown miniature V4 layout 'exl2'; one of exllamav3, cuda-exl3"):
        write_v4_minipack(native, "exl2", tmp_path / "x")


def test_cli_writes_the_requested_layouts_from_the_cache(tmp_path):
    from testkit.minipacks_v4 import main

    shutil.copy(ENCODINGS, tmp_path / "enc.safetensors")
    assert main([str(NATIVE), str(tmp_path / "out"), "--layouts", "cuda-exl3,fp8-mxfp4",
                 "--cache", str(tmp_path / "enc.safetensors")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["cuda-exl3", "fp8-mxfp4"]
    assert open_pack(tmp_path / "out" / "cuda-exl3").format == "cuda-exl3"
    assert (tmp_path / "enc.safetensors").read_bytes() == ENCODINGS.read_bytes()     # no misses: not rewritten
