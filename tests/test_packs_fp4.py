"""MXFP4 (gpt-oss blocks) against transformers' own dequantizer and an e2m1 bit formula; ModelOpt NVFP4 against the
bit formula times torch's e4m3 cast, multiplied in float64 (exact) and rounded once."""
import json

import pytest
import torch

from fidelity import PackError, open_pack
from fidelity.commands.inspect import inspect_pack
from fidelity.packs.safetensors_io import write_safetensors


def e2m1_by_formula(packed: torch.Tensor) -> torch.Tensor:
    """float64 value of each nibble: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; low nibble first."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).to(torch.int64)
    sign = torch.where(codes & 8 > 0, -1.0, 1.0).double()
    exp, man = (codes >> 1) & 3, (codes & 1).double()
    mag = torch.where(exp == 0, man * 0.5, torch.pow(2.0, (exp - 1).double()) * (1 + man / 2))
    return sign * mag


def expand(s: torch.Tensor, group: int, cols: int) -> torch.Tensor:
    return s[..., torch.arange(cols) // group]


def gpt_oss_tensors(E: int, hidden: int, inter: int, scale_dtype: str):
    t = {}
    for proj, (out, inn) in {"gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}.items():
        blocks = torch.randint(0, 256, (E, out, inn // 32, 16), dtype=torch.uint8)
        exps = torch.randint(110, 135, (E, out, inn // 32), dtype=torch.uint8)
        name = f"model.layers.0.mlp.experts.{proj}"
        t[name + "_blocks"] = blocks
        t[name + "_scales"] = exps.view(torch.float8_e8m0fnu) if scale_dtype == "F8_E8M0" else exps
        t[name + "_bias"] = torch.randn(E, out).bfloat16()
    t["model.layers.0.mlp.router.weight"] = torch.randn(E, hidden).bfloat16()
    return t


def write_pack(path, tensors, config):
    write_safetensors(path / "model.safetensors", tensors)
    (path / "config.json").write_text(json.dumps(config))


GPT_OSS_CFG = {
    "architectures": ["GptOssForCausalLM"],
    "num_local_experts": 3,
    "num_experts_per_tok": 2,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.mlp.router"]},
}


@pytest.mark.parametrize("scale_dtype", ["U8", "F8_E8M0"])
def test_gpt_oss_mxfp4_equals_transformers_dequantizer(tmp_path, rng_seed, scale_dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    E, hidden, inter = 3, 96, 160
    ts = gpt_oss_tensors(E, hidden, inter, scale_dtype)
    write_pack(tmp_path, ts, GPT_OSS_CFG)
    pack = open_pack(tmp_path)
    assert pack.format == "mxfp4"
    gu, down = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"
    assert sorted(pack.names()) == sorted([gu, down, gu + "_bias", down + "_bias", "model.layers.0.mlp.router.weight"])
    for name, shape in ((gu, (E, hidden, 2 * inter)), (down, (E, inter, hidden))):
        exps = ts[name + "_scales"].view(torch.uint8)
        ref = convert_moe_packed_tensors(ts[name + "_blocks"], exps, dtype=torch.float32)
        got = pack.tensor(name)
        assert got.shape == shape == ref.shape
        assert torch.equal(got, ref), name
        # and the bit formula with torch's own e8m0 cast, in the stored [E, out, in] orientation
        scales = exps.view(torch.float8_e8m0fnu).to(torch.float64)
        q = e2m1_by_formula(ts[name + "_blocks"]).reshape(E, shape[2], -1)
        assert torch.equal(got.transpose(1, 2), (q * expand(scales, 32, q.shape[-1])).float())
        st = pack.storage(name)
        assert st.format == "mxfp4" and st.bits == 4.25  # 4 bits + one 8-bit scale per 32
    assert pack.bits_per_weight()["per_decoded_token"]["params"] < pack.bits_per_weight()["all_linear"]["params"]


def test_gpt_oss_gate_up_interleave_matches_hf_layout(tmp_path, rng_seed):
    """Row j of the stored gate_up blocks is column j of HF's gate_up_proj: gate = [..., ::2], up = [..., 1::2]."""
    E, hidden, inter = 2, 64, 32
    ts = gpt_oss_tensors(E, hidden, inter, "U8")
    write_pack(tmp_path, ts, GPT_OSS_CFG)
    w = open_pack(tmp_path).tensor("model.layers.0.mlp.experts.gate_up_proj")
    blocks, exps = (
        ts["model.layers.0.mlp.experts.gate_up_proj_blocks"],
        ts["model.layers.0.mlp.experts.gate_up_proj_scales"],
    )
    row = 2 * 7 + 1  # up-projection row 7 of expert 1
    q = e2m1_by_formula(blocks[1, row]).reshape(-1) * expand(torch.pow(2.0, exps[1, row].double() - 127), 32, hidden)
    assert torch.equal(w[1, :, 1::2][:, 7], q.float())


NVFP4_QC = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}


def random_e4m3_scales(*shape) -> torch.Tensor:
    b = torch.randint(0x08, 0x7F, shape, dtype=torch.uint8)  # positive, finite, not zero
    return b.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("in_features", [48, 40, 16])
def test_modelopt_nvfp4(tmp_path, rng_seed, in_features):
    out = 37
    name = "model.layers.0.self_attn.q_proj"
    w = torch.randint(0, 256, (out, in_features // 2), dtype=torch.uint8)
    s = random_e4m3_scales(out, -(-in_features // 16))
    s2 = torch.rand(()) * 1e-3
    ts = {name + ".weight": w, name + ".weight_scale": s, name + ".weight_scale_2": s2,
          name + ".input_scale": torch.rand(()), "lm_head.weight": torch.randn(11, in_features).bfloat16()}
    write_pack(tmp_path, ts, {"architectures": ["LlamaForCausalLM"], "quantization_config": NVFP4_QC})
    pack = open_pack(tmp_path)
    assert pack.format == "modelopt"
    ref = (e2m1_by_formula(w) * expand(s.to(torch.float64), 16, in_features) * s2.double()).float()
    got = pack.tensor(name + ".weight")
    assert got.shape == (out, in_features)
    assert torch.equal(got, ref)
    st = pack.storage(name + ".weight")
    assert st.format == "nvfp4" and st.nbytes == out * in_features // 2 + s.numel() + 4
    assert (name + ".input_scale") in pack.names()  # activation scale stays a plain tensor


def test_modelopt_nvfp4_from_hf_quant_config_json(tmp_path, rng_seed):
    """Older ModelOpt exports carry the scheme in hf_quant_config.json, not config.json."""
    w = torch.randint(0, 256, (3, 2, 8), dtype=torch.uint8)  # a 3-D expert stack
    s = random_e4m3_scales(3, 2, 1)
    s2 = torch.tensor([0.25])
    write_safetensors(tmp_path / "model.safetensors", {"e.weight": w, "e.weight_scale": s, "e.weight_scale_2": s2})
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    (tmp_path / "hf_quant_config.json").write_text(
        json.dumps({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16}})
    )
    pack = open_pack(tmp_path)
    assert pack.format == "modelopt"
    ref = (e2m1_by_formula(w) * expand(s.to(torch.float64), 16, 16) * 0.25).float()
    assert torch.equal(pack.tensor("e.weight"), ref)


def test_inspect_reports_fp4_storage(tmp_path):
    write_pack(tmp_path, gpt_oss_tensors(2, 64, 32, "U8"), GPT_OSS_CFG)
    rep = inspect_pack(str(tmp_path))
    assert {"format": "mxfp4", "dtype": "E2M1 x U8 e8m0 per-32", "count": 2} in rep["storage"]


# -- bad input ----------------------------------------------------------------------------------------------------
def test_mxfp4_scales_wrong_grid(tmp_path):
    ts = gpt_oss_tensors(2, 64, 32, "U8")
    ts["model.layers.0.mlp.experts.down_proj_scales"] = torch.full((2, 64, 2), 127, dtype=torch.uint8)
    write_pack(tmp_path, ts, GPT_OSS_CFG)
    with pytest.raises(PackError, match=r"wrong grid.*experts\.down_proj_scales.*model\.safetensors"):
        open_pack(tmp_path)


def test_mxfp4_nan_scale(tmp_path):
    ts = gpt_oss_tensors(2, 64, 32, "U8")
    ts["model.layers.0.mlp.experts.gate_up_proj_scales"][1, 3, 0] = 255
    write_pack(tmp_path, ts, GPT_OSS_CFG)
    with pytest.raises(PackError, match=r"NaN in scales.*gate_up_proj_scales.*model\.safetensors"):
        open_pack(tmp_path).tensor("model.layers.0.mlp.experts.gate_up_proj")


def test_nvfp4_wrong_grid_and_nan(tmp_path):
    ts = {"a.weight": torch.randint(0, 256, (4, 16), dtype=torch.uint8), "a.weight_scale": random_e4m3_scales(4, 3),
          "a.weight_scale_2": torch.tensor(0.5)}
    write_pack(tmp_path, ts, {"quantization_config": NVFP4_QC})
    with pytest.raises(PackError, match=r"wrong grid.*\[4, 2\].*a\.weight_scale.*model\.safetensors"):
        open_pack(tmp_path)
    s = random_e4m3_scales(4, 2)
    s.view(torch.uint8)[2, 1] = 0x7F  # e4m3 NaN
    ts["a.weight_scale"] = s
    write_pack(tmp_path, ts, {"quantization_config": NVFP4_QC})
    with pytest.raises(PackError, match=r"NaN in scales.*a\.weight_scale.*model\.safetensors"):
        open_pack(tmp_path).tensor("a.weight")


def test_nvfp4_missing_global_scale(tmp_path):
    ts = {"a.weight": torch.randint(0, 256, (4, 16), dtype=torch.uint8), "a.weight_scale": random_e4m3_scales(4, 2)}
    write_pack(tmp_path, ts, {"quantization_config": NVFP4_QC})
    with pytest.raises(PackError, match=r"weight_scale_2.*a\.weight.*model\.safetensors"):
        open_pack(tmp_path)


def test_modelopt_unsupported_algo(tmp_path):
    write_pack(tmp_path, {"a.weight": torch.randn(2, 2)}, {"quantization_config": {"quant_method": "modelopt",
                                                                                   "quant_algo": "W4A8_AWQ"}})
    with pytest.raises(PackError, match=r"W4A8_AWQ.*config\.json"):
        open_pack(tmp_path)


def test_modelopt_nvfp4_agrees_with_compressed_tensors_converter(tmp_path, rng_seed):
    """Cross-check of the ModelOpt convention (weight_scale_2 multiplies) with an independent library: compressed-
    tensors' own ModelOpt->CT converter (1/weight_scale_2 becomes its dividing global scale), then its decompress.
    Its order of operations, q * (s / fl(1/s2)), rounds three times where ModelOpt's (q * s) * s2 rounds once: the two
    agree to within 2 ulp (about one element in ten differs; 2 ulp was the worst over 300 seeds)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    out, inp = 24, 64
    name = "model.layers.0.mlp.up_proj"
    ts = {name + ".weight": torch.randint(0, 256, (out, inp // 2), dtype=torch.uint8),
          name + ".weight_scale": random_e4m3_scales(out, inp // 16), name + ".weight_scale_2": torch.rand(()) * 1e-2,
          name + ".input_scale": torch.rand(())}
    write_pack(tmp_path, ts, {"quantization_config": NVFP4_QC})
    ours = open_pack(tmp_path).tensor(name + ".weight")
    ct = ModelOptNvfp4Converter(targets=[f"re:{name}"]).process(dict(ts))
    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16)
    q = unpack_fp4_from_uint8(ct[name + ".weight_packed"], out, inp, dtype=torch.float32)
    theirs = dequantize(q, ct[name + ".weight_scale"].float(), args=args, dtype=torch.float32,
                        global_scale=ct[name + ".weight_global_scale"].reshape(1))
    assert (torch.sign(ours) == torch.sign(theirs)).all()
    assert (ours.view(torch.int32) - theirs.view(torch.int32)).abs().max() <= 2  # ulp distance
    assert (ours != 0).any()
