"""Overlay packs: overlay tensors replace the base's, everything else comes from the base, and the listing says
which."""

import json

import pytest
import torch
from safetensors.torch import load_file

from fidelity import PackError, open_pack
from fidelity.commands.inspect import inspect_pack
from fidelity.packs.overlay import OverlayPack
from fidelity.packs.safetensors_io import write_safetensors

NAMES = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
         "lm_head.weight"]
SHAPES = {NAMES[0]: (50, 16), NAMES[1]: (16, 16), NAMES[2]: (16, 40), NAMES[3]: (50, 16)}


def make_base(path, qc=None):
    path.mkdir()
    ts = {n: torch.randn(SHAPES[n]).bfloat16() for n in NAMES}
    write_safetensors(path / "model.safetensors", ts)
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 50, "hidden_size": 16}
    if qc:
        cfg["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(cfg))
    return ts


def make_overlay(path, tensors, base="../base"):
    path.mkdir()
    write_safetensors(path / "build.safetensors", tensors)
    (path / "fidelity_overlay.json").write_text(json.dumps({"base": base}))


def test_overlay_replaces_named_tensors_and_lists_sources(tmp_path, rng_seed):
    base_ts = make_base(tmp_path / "base")
    over = {NAMES[1]: torch.randn(16, 16), NAMES[2]: torch.randn(16, 40).half()}
    make_overlay(tmp_path / "build", over)
    pack = open_pack(tmp_path / "build")
    assert isinstance(pack, OverlayPack) and pack.format == "overlay"
    assert sorted(pack.names()) == sorted(NAMES)
    ref_over = load_file(tmp_path / "build" / "build.safetensors")
    ref_base = load_file(tmp_path / "base" / "model.safetensors")
    for n in NAMES:
        want = (ref_over if n in over else ref_base)[n].float()
        assert torch.equal(pack.tensor(n), want), n
        assert pack.origin(n) == ("overlay" if n in over else "base")
    listing = {k: sorted(v) for k, v in pack.sources().items()}
    assert listing == {"overlay": sorted(over), "base": sorted(set(NAMES) - set(over))}
    assert pack.storage(NAMES[2]).dtype == "F16" and pack.storage(NAMES[0]).dtype == "BF16"
    assert pack.storage(NAMES[1]).files == (str(tmp_path / "build" / "build.safetensors"),)
    assert pack.config["vocab_size"] == 50 and pack.tokenizer_source() == tmp_path / "base"
    # bpw: q_proj is fp32 now, down_proj fp16
    assert pack.bits_per_weight()["dense_linear"]["bpw"] == pytest.approx((256 * 32 + 640 * 16) / (256 + 640))
    assert pack.fingerprint() != open_pack(tmp_path / "base").fingerprint()
    assert not torch.equal(base_ts[NAMES[1]].float(), pack.tensor(NAMES[1]))


def test_overlay_constructed_from_paths_with_absolute_base(tmp_path, rng_seed):
    make_base(tmp_path / "base")
    make_overlay(tmp_path / "build", {NAMES[3]: torch.randn(50, 16)}, base=str(tmp_path / "base"))
    a = open_pack(tmp_path / "build")
    b = OverlayPack(tmp_path / "base", tmp_path / "build")
    assert torch.equal(a.tensor(NAMES[3]), b.tensor(NAMES[3]))
    assert b.origin(NAMES[3]) == "overlay" and b.origin(NAMES[0]) == "base"


def test_overlay_decodes_with_the_base_quant_config(tmp_path, rng_seed):
    """The overlay folder has no config.json: its FP8 tensors use the base's 32x32 block size."""
    qc = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    make_base(tmp_path / "base", qc)
    q = torch.randn(16, 40).to(torch.float8_e4m3fn)
    s = torch.rand(1, 2)
    make_overlay(tmp_path / "build", {NAMES[2]: q, NAMES[2] + "_scale_inv": s})
    pack = open_pack(tmp_path / "build")
    ref = (q.double() * s.double()[:, torch.arange(40) // 32]).float()
    assert torch.equal(pack.tensor(NAMES[2]), ref)
    assert pack.storage(NAMES[2]).format == "fp8_e4m3"
    rep = inspect_pack(str(tmp_path / "build"), decode=True)
    assert rep["format"] == "overlay" and rep["problems"] == []


# -- bad input ----------------------------------------------------------------------------------------------------
def test_overlay_shape_mismatch_names_both_files(tmp_path):
    make_base(tmp_path / "base")
    make_overlay(tmp_path / "build", {NAMES[1]: torch.randn(16, 17)})
    with pytest.raises(PackError, match=r"\[16, 17\].*build\.safetensors.*\[16, 16\].*base/model\.safetensors"
                                        r".*q_proj\.weight") as e:
        open_pack(tmp_path / "build")
    assert e.value.tensor == NAMES[1]


def test_overlay_tensor_missing_from_base(tmp_path):
    make_base(tmp_path / "base")
    make_overlay(tmp_path / "build", {"model.layers.9.mlp.up_proj.weight": torch.randn(2, 2)})
    with pytest.raises(PackError, match=r"no counterpart.*layers\.9\.mlp\.up_proj\.weight.*build\.safetensors"):
        open_pack(tmp_path / "build")


@pytest.mark.parametrize("marker", ['{"bas": "x"}', '{"base": "../nowhere"}', '{"base": "."}', "not json"])
def test_bad_marker(tmp_path, marker):
    make_base(tmp_path / "base")
    make_overlay(tmp_path / "build", {NAMES[1]: torch.randn(16, 16)})
    (tmp_path / "build" / "fidelity_overlay.json").write_text(marker)
    with pytest.raises(PackError, match=r"fidelity_overlay\.json"):
        open_pack(tmp_path / "build")
