"""FP8 packs against an independent formula: torch's own fp8 / e8m0 casts times the scale grid expanded by index
arithmetic, multiplied in float64 (exact) and rounded once to float32."""
import json

import pytest
import torch

from fidelity import PackError, open_pack
from fidelity.commands.inspect import inspect_pack
from fidelity.packs.safetensors_io import write_safetensors

try:  # HF transformers' own FP8 block dequantizer (private; the formula below is the reference when it is gone)
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight as transformers_fp8_dequantize
except ImportError:
    transformers_fp8_dequantize = None


def random_fp8(*shape, dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """Every bit pattern but NaN, so subnormals, zeros of both signs and the extremes all occur."""
    b = torch.randint(0, 256, shape, dtype=torch.uint8)
    nan = (b & 0x7F) == 0x7F if dtype == torch.float8_e4m3fn else (b & 0x7C) == 0x7C
    b[nan] = 0x3C
    return b.view(dtype)


def expand_grid(s: torch.Tensor, rows: int, cols: int, bh: int, bw: int) -> torch.Tensor:
    r = torch.arange(rows) // bh
    c = torch.arange(cols) // bw
    return s[..., r, :][..., :, c]


def reference(q: torch.Tensor, s_f64: torch.Tensor) -> torch.Tensor:
    return (q.to(torch.float64) * s_f64).to(torch.float32)


def write_pack(path, tensors, quant_config):
    write_safetensors(path / "model.safetensors", tensors)
    cfg = {"architectures": ["DeepseekV3ForCausalLM"]}
    if quant_config is not None:
        cfg["quantization_config"] = quant_config
    (path / "config.json").write_text(json.dumps(cfg))


DEEPSEEK_QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def test_deepseek_block_fp32_scales_ceil_div_grid(tmp_path, rng_seed):
    shapes = {"model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (576, 300),
              "model.layers.0.mlp.down_proj.weight": (130, 257),
              "model.layers.0.self_attn.o_proj.weight": (256, 128)}
    tensors, ref = {}, {}
    for name, (r, c) in shapes.items():
        q = random_fp8(r, c)
        s = torch.rand(-(-r // 128), -(-c // 128)) * 1e-2 + 1e-6
        tensors[name], tensors[name + "_scale_inv"] = q, s
        ref[name] = reference(q, expand_grid(s.double(), r, c, 128, 128))
    tensors["model.embed_tokens.weight"] = torch.randn(7, 300).bfloat16()
    write_pack(tmp_path, tensors, DEEPSEEK_QC)
    pack = open_pack(tmp_path)
    assert pack.format == "fp8"
    assert sorted(pack.names()) == sorted([*shapes, "model.embed_tokens.weight"])
    for name, (r, c) in shapes.items():
        got = pack.tensor(name)
        assert got.dtype == torch.float32 and got.shape == (r, c)
        assert torch.equal(got, ref[name]), name
        if transformers_fp8_dequantize is not None:
            hf = transformers_fp8_dequantize(tensors[name], tensors[name + "_scale_inv"], [128, 128], torch.float32)
            assert torch.equal(got, hf), name
        st = pack.storage(name)
        assert st.format == "fp8_e4m3" and st.block == (128, 128)
        assert st.nbytes == r * c + 4 * (-(-r // 128)) * (-(-c // 128))  # scales counted
        assert st.raw == (name, name + "_scale_inv")
    bpw = pack.bits_per_weight()["dense_linear"]
    n = sum(r * c for r, c in shapes.values())
    assert bpw["bpw"] == pytest.approx(8 * (n + 4 * (15 + 6 + 2)) / n)


@pytest.mark.parametrize("stored_as", ["F8_E8M0", "U8", "F32"])
def test_ue8m0_power_of_two_scales(tmp_path, rng_seed, stored_as):
    r, c = 300, 200
    q = random_fp8(r, c)
    e = torch.randint(100, 140, (3, 2), dtype=torch.uint8)
    e[2, 1] = 0  # 2**-127: an fp32 subnormal, still a power of two
    if stored_as == "F8_E8M0":
        s = e.view(torch.float8_e8m0fnu)
        s_ref = s.to(torch.float64)  # torch's own e8m0 cast
    elif stored_as == "U8":
        s = e
        s_ref = torch.pow(2.0, e.to(torch.float64) - 127)
    else:
        s = torch.pow(2.0, e.to(torch.float32) - 127)
        s_ref = s.double()
    name = "model.layers.0.mlp.gate_proj.weight"
    write_pack(tmp_path, {name: q, name + "_scale_inv": s}, {**DEEPSEEK_QC, "scale_fmt": "ue8m0"})
    pack = open_pack(tmp_path)
    assert torch.equal(pack.tensor(name), reference(q, expand_grid(s_ref, r, c, 128, 128)))
    assert stored_as in pack.storage(name).dtype
    if transformers_fp8_dequantize is not None and stored_as != "U8":
        assert torch.equal(pack.tensor(name), transformers_fp8_dequantize(q, s, [128, 128], torch.float32))


def test_e8m0_smallest_exponent_is_exact(tmp_path):
    """e = 0 is 2**-127, an fp32 subnormal: the decode must not flush it."""
    q = torch.tensor([[1.0, -448.0, 0.5]]).to(torch.float8_e4m3fn)
    s = torch.tensor([[0, 1, 2]], dtype=torch.uint8)[:, :1]
    name = "m.weight"
    write_pack(tmp_path, {name: q, name + "_scale_inv": s}, DEEPSEEK_QC)
    got = open_pack(tmp_path).tensor(name)
    assert torch.equal(got.double(), q.double() * 2.0 ** -127)


@pytest.mark.parametrize("scale_shape,method", [("scalar", "fp8"), ("one", "modelopt"), ("channel", "fp8"),
                                                ("channel_col", "fbgemm_fp8")])
def test_per_tensor_and_per_channel_weight_scale(tmp_path, rng_seed, scale_shape, method):
    r, c = 37, 65
    q = random_fp8(r, c)
    s = {"scalar": torch.rand(()), "one": torch.rand(1), "channel": torch.rand(r),
         "channel_col": torch.rand(r, 1)}[scale_shape]
    s = s + 1e-3
    name = "model.layers.0.self_attn.q_proj.weight"
    write_pack(tmp_path, {name: q, "model.layers.0.self_attn.q_proj.weight_scale": s},
               {"quant_method": method, "activation_scheme": "static"})
    pack = open_pack(tmp_path)
    assert pack.format == method
    s_ref = s.double().reshape(-1, 1) if s.numel() > 1 else s.double().reshape(())
    assert torch.equal(pack.tensor(name), reference(q, s_ref))
    assert pack.names() == [name]


def test_e5m2_and_3d_expert_block_scales(tmp_path, rng_seed):
    q = random_fp8(3, 200, 130, dtype=torch.float8_e5m2)
    s = torch.rand(3, 2, 2) + 0.5
    name = "model.layers.1.mlp.experts.gate_up_proj"
    write_pack(tmp_path, {name + ".weight": q, name + ".weight_scale_inv": s}, DEEPSEEK_QC)
    pack = open_pack(tmp_path)
    assert torch.equal(pack.tensor(name + ".weight"), reference(q, expand_grid(s.double(), 200, 130, 128, 128)))
    assert pack.storage(name + ".weight").format == "fp8_e5m2"


def test_custom_block_size_from_config(tmp_path, rng_seed):
    q = random_fp8(100, 70)
    s = torch.rand(4, 3)
    write_pack(tmp_path, {"a.weight": q, "a.weight_scale_inv": s}, {**DEEPSEEK_QC, "weight_block_size": [32, 32]})
    assert torch.equal(open_pack(tmp_path).tensor("a.weight"), reference(q, expand_grid(s.double(), 100, 70, 32, 32)))


def test_inspect_reports_fp8_storage(tmp_path):
    q = random_fp8(130, 130)
    write_pack(tmp_path, {"x.weight": q, "x.weight_scale_inv": torch.rand(2, 2)}, DEEPSEEK_QC)
    rep = inspect_pack(str(tmp_path), decode=True)
    assert rep["format"] == "fp8"
    assert rep["storage"] == [{"format": "fp8_e4m3", "dtype": "F8_E4M3 x F32 block 128x128", "count": 1}]
    assert rep["problems"] == []


# -- bad input ----------------------------------------------------------------------------------------------------
def test_wrong_block_grid_names_scale_tensor_and_file(tmp_path):
    name = "model.layers.3.self_attn.kv_a_proj_with_mqa.weight"
    write_pack(tmp_path, {name: random_fp8(576, 256), name + "_scale_inv": torch.rand(4, 2)}, DEEPSEEK_QC)
    with pytest.raises(
        PackError, match=r"wrong grid.*\[5, 2\].*kv_a_proj_with_mqa\.weight_scale_inv.*model\.safetensors"
    ):
        open_pack(tmp_path)


@pytest.mark.parametrize("bad", ["nan", "inf", "e8m0_nan"])
def test_nan_in_scales_names_tensor_and_file(tmp_path, bad):
    name = "model.layers.0.mlp.up_proj.weight"
    if bad == "e8m0_nan":
        s = torch.full((2, 2), 120, dtype=torch.uint8)
        s[1, 0] = 255
    else:
        s = torch.rand(2, 2)
        s[0, 1] = float(bad)
    write_pack(tmp_path, {name: random_fp8(200, 200), name + "_scale_inv": s}, DEEPSEEK_QC)
    pack = open_pack(tmp_path)
    with pytest.raises(PackError, match=r"(NaN|inf) in scales.*up_proj\.weight_scale_inv.*model\.safetensors"):
        pack.tensor(name)
    assert any("weight_scale_inv" in p for p in inspect_pack(str(tmp_path), decode=True)["problems"])


def test_ue8m0_declared_but_scales_not_powers_of_two(tmp_path):
    s = torch.tensor([[0.5, 0.75]])
    write_pack(
        tmp_path, {"a.weight": random_fp8(16, 200), "a.weight_scale_inv": s}, {**DEEPSEEK_QC, "scale_fmt": "ue8m0"}
    )
    with pytest.raises(PackError, match=r"powers of two.*a\.weight_scale_inv"):
        open_pack(tmp_path).tensor("a.weight")


def test_scale_in_an_absent_shard_makes_the_weight_absent_not_unscaled(tmp_path):
    """The weight's shard is here, its scale's is not: the weight must not decode as if unscaled."""
    name = "model.layers.0.mlp.up_proj.weight"
    write_safetensors(tmp_path / "s1.safetensors", {name: random_fp8(130, 64)})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        name: "s1.safetensors", name + "_scale_inv": "s2.safetensors"}}))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": DEEPSEEK_QC}))
    pack = open_pack(tmp_path)
    assert pack.names() == [name] and pack.storage(name).format == "absent"
    with pytest.raises(PackError, match=r"absent.*up_proj\.weight.*s2\.safetensors"):
        pack.tensor(name)


def test_modelopt_fp8_pb_wo_four_dim_block_scales(tmp_path, rng_seed):
    """ModelOpt FP8_PB_WO exports weight_scale as [out_blocks, 1, in_blocks, 1] (vLLM squeezes it)."""
    q = random_fp8(200, 256)
    s = torch.rand(2, 1, 2, 1) + 0.1
    write_pack(tmp_path, {"m.weight": q, "m.weight_scale": s}, {"quant_method": "modelopt", "quant_algo": "FP8_PB_WO"})
    pack = open_pack(tmp_path)
    assert torch.equal(pack.tensor("m.weight"), reference(q, expand_grid(s.double().reshape(2, 2), 200, 256, 128, 128)))
    assert pack.storage("m.weight").block == (128, 128)


def test_modelopt_mxfp8_e8m0_per_32(tmp_path, rng_seed):
    q = random_fp8(5, 96)
    e = torch.randint(110, 140, (5, 3), dtype=torch.uint8)
    write_pack(tmp_path, {"m.weight": q, "m.weight_scale": e}, {"quant_method": "modelopt", "quant_algo": "MXFP8"})
    got = open_pack(tmp_path).tensor("m.weight")
    assert torch.equal(got, reference(q, expand_grid(e.view(torch.float8_e8m0fnu).double(), 5, 96, 1, 32)))
