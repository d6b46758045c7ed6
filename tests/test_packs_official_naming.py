"""DeepSeek's official checkpoint naming (`X.weight` + `X.scale`, inference/convert.py): FP8 block-128 and MXFP4 weights
decode through the same formulas as their HF-named twins; a scaled type left without scales is refused, never read
raw."""

import json

import pytest
import torch

from fidelity import PackError, open_pack
from fidelity.packs.safetensors_io import write_safetensors
from test_packs_fp4 import e2m1_by_formula, expand
from test_packs_fp8 import expand_grid, random_fp8, reference


def write_official(path, tensors, quant_config=None):
    write_safetensors(path / "model.safetensors", tensors)
    cfg = {"architectures": ["DeepseekV4ForCausalLM"]}
    if quant_config:
        cfg["quantization_config"] = quant_config
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("scale_dtype", ["f32", "e8m0"])
def test_fp8_weight_with_official_scale(tmp_path, rng_seed, scale_dtype):
    r, c = 576, 300
    q = random_fp8(r, c)
    if scale_dtype == "f32":
        s = torch.rand(-(-r // 128), -(-c // 128)) * 1e-2 + 1e-6
        s_f64 = s.double()
    else:
        e = torch.randint(110, 135, (-(-r // 128), -(-c // 128)), dtype=torch.uint8)
        s = e.view(torch.float8_e8m0fnu)
        s_f64 = torch.pow(2.0, e.double() - 127)
    write_official(tmp_path, {"layers.0.attn.wq_a.weight": q, "layers.0.attn.wq_a.scale": s,
                              "layers.0.attn_norm.weight": torch.randn(300)},
                   {"quant_method": "fp8", "weight_block_size": [128, 128],
                    **({"scale_fmt": "ue8m0"} if scale_dtype == "e8m0" else {})})
    pack = open_pack(tmp_path)
    assert "layers.0.attn.wq_a.scale" not in pack.names()
    want = reference(q, expand_grid(s_f64, r, c, 128, 128))
    assert torch.equal(pack.tensor("layers.0.attn.wq_a.weight"), want)
    assert pack.storage("layers.0.attn.wq_a.weight").nbytes == q.numel() + s.numel() * s.element_size()


def test_mxfp4_weight_with_official_scale(tmp_path, rng_seed):
    out, inp = 72, 96
    packed = torch.randint(-128, 128, (out, inp // 2), dtype=torch.int8)
    e = torch.randint(115, 135, (out, inp // 32), dtype=torch.uint8)
    write_official(tmp_path, {"layers.1.ffn.experts.3.w1.weight": packed,
                              "layers.1.ffn.experts.3.w1.scale": e.view(torch.float8_e8m0fnu)})
    pack = open_pack(tmp_path)
    values = e2m1_by_formula(packed.view(torch.uint8)).double()
    want = (values * expand(torch.pow(2.0, e.double() - 127), 32, inp)).float()
    got = pack.tensor("layers.1.ffn.experts.3.w1.weight")
    assert got.shape == (out, inp) and torch.equal(got, want)
    assert pack.storage("layers.1.ffn.experts.3.w1.weight").format == "mxfp4"


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_scaled_type_without_scales_is_refused(tmp_path, dtype):
    w = random_fp8(16, 32) if dtype == torch.float8_e4m3fn else torch.randint(-5, 5, (16, 32), dtype=torch.int8)
    write_official(tmp_path, {"layers.0.attn.wo.weight": w})
    pack = open_pack(tmp_path)
    with pytest.raises(PackError, match=r"no format module claimed.*layers\.0\.attn\.wo\.weight.*model\.safetensors"):
        pack.tensor("layers.0.attn.wo.weight")
