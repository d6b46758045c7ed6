"""compressed-tensors packs built with the library's own compressors from random weights, decoded and compared with the
library's own decompress: bit for bit in fp32 (scales widened to fp32 first, the library computes in the scale's
dtype) and, for the library's untouched bf16 path, our value rounded to bf16."""
import json
import math

import pytest
import torch

pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.base import BaseCompressor  # noqa: E402
from compressed_tensors.compressors.mx_utils import decompress_mx_scale  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam  # noqa: E402

from fidelity import PackError, open_pack  # noqa: E402
from fidelity.commands.inspect import inspect_pack  # noqa: E402
from fidelity.packs.safetensors_io import write_safetensors  # noqa: E402


def observe(w: torch.Tensor, a: QuantizationArgs):
    """min/max per scale cell, as llm-compressor's min-max observer sees them."""
    rows, cols = w.shape
    if a.strategy in ("group", "tensor_group"):
        g = w.reshape(rows, -1, a.group_size)
        return g.amin(-1), g.amax(-1)
    if a.strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if a.strategy == "block":
        bh, bw = a.block_structure
        R, C = math.ceil(rows / bh), math.ceil(cols / bw)
        p = torch.nn.functional.pad(w, (0, C * bw - cols, 0, R * bh - rows))
        b = p.reshape(R, bh, C, bw)
        return b.amin((1, 3)), b.amax((1, 3))
    return w.amin().reshape(1), w.amax().reshape(1)


def compress(w: torch.Tensor, args: dict, fmt: str):
    a = QuantizationArgs(**args)
    scheme = QuantizationScheme(targets=["Linear"], weights=a, format=fmt)
    mn, mx = observe(w.float(), a)
    sd = {"weight": w}
    if fmt == "nvfp4-pack-quantized":
        g = generate_gparam(w.float().amin(), w.float().amax()).reshape(1)
        s, zp = calculate_qparams(mn, mx, a, global_scale=g)
        sd["weight_global_scale"] = g
    else:
        s, zp = calculate_qparams(mn, mx, a)
    sd["weight_scale"] = s.to(torch.bfloat16) if s.dtype == torch.float32 else s
    sd["weight_zero_point"] = zp
    comp = BaseCompressor.get_value_from_registry(fmt)
    return comp, scheme, comp.compress(sd, scheme)


def library_fp32(comp, scheme, stored: dict, fmt: str) -> torch.Tensor:
    """The library's own dequantization with scales widened to fp32 (so its arithmetic is fp32)."""
    if fmt == "nvfp4-pack-quantized":
        p = stored["weight_packed"]
        q = unpack_fp4_from_uint8(p, p.shape[0], 2 * p.shape[1], dtype=torch.float32)
        return dequantize(q, stored["weight_scale"].float(), args=scheme.weights, dtype=torch.float32,
                          global_scale=stored["weight_global_scale"])
    if fmt == "mxfp4-pack-quantized":
        p = stored["weight_packed"]
        q = unpack_fp4_from_uint8(p, p.shape[0], 2 * p.shape[1], dtype=torch.float32)
        return dequantize(q, decompress_mx_scale(stored["weight_scale"]).float(), args=scheme.weights,
                          dtype=torch.float32)
    if fmt == "mxfp8-quantized":  # power-of-two scales: the library's bf16 products are exact
        return comp.decompress(stored, scheme)["weight"].float()
    sd = dict(stored, weight_scale=stored["weight_scale"].float())
    return comp.decompress(sd, scheme)["weight"]


def write_ct_pack(path, modules: dict[str, dict], schemes: dict[str, dict], fmt: str, extra=None):
    tensors = {f"{m}.{k}": v for m, sd in modules.items() for k, v in sd.items()}
    tensors.update(extra or {})
    write_safetensors(path / "model.safetensors", tensors)
    qc = {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
          "config_groups": schemes, "ignore": ["lm_head"]}
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "quantization_config": qc}))


def scheme_json(scheme) -> dict:
    return json.loads(scheme.model_dump_json())


INT = dict(type="int")
CASES = {
    "int4_group_sym": ("pack-quantized", dict(num_bits=4, **INT, symmetric=True, strategy="group", group_size=32),
                       (70, 160)),
    "int4_group_asym": ("pack-quantized", dict(num_bits=4, **INT, symmetric=False, strategy="group", group_size=64),
                        (37, 192)),
    "int8_channel_sym": ("pack-quantized", dict(num_bits=8, type="int", symmetric=True, strategy="channel"), (45, 100)),
    "int4_channel_asym": ("pack-quantized", dict(num_bits=4, type="int", symmetric=False, strategy="channel"),
                          (37, 99)),
    "int4_tensor_asym": ("pack-quantized", dict(num_bits=4, **INT, symmetric=False, strategy="tensor"), (9, 24)),
    "int3_group_asym": ("pack-quantized", dict(num_bits=3, **INT, symmetric=False, strategy="group", group_size=16),
                        (29, 80)),
    "int8_naive_channel": ("int-quantized", dict(num_bits=8, type="int", symmetric=True, strategy="channel"), (33, 70)),
    "int8_naive_group_asym": ("int-quantized",
                              dict(num_bits=8, **INT, symmetric=False, strategy="group", group_size=16), (19, 48)),
    "fp8_tensor": ("float-quantized", dict(num_bits=8, type="float", symmetric=True, strategy="tensor"), (23, 41)),
    "fp8_block": (
        "float-quantized",
        dict(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[128, 128]),
        (300, 200),
    ),
    "fp8_channel": ("float-quantized", dict(num_bits=8, type="float", symmetric=True, strategy="channel"), (31, 64)),
    "mxfp8": (
        "mxfp8-quantized",
        dict(num_bits=8, type="float", symmetric=True, strategy="group", group_size=32, scale_dtype=torch.uint8),
        (10, 96),
    ),
    "nvfp4": (
        "nvfp4-pack-quantized",
        dict(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16,
             scale_dtype=torch.float8_e4m3fn),
        (37, 48),
    ),
    "mxfp4": (
        "mxfp4-pack-quantized",
        dict(num_bits=4, type="float", symmetric=True, strategy="group", group_size=32, scale_dtype=torch.uint8),
        (21, 96),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_equals_compressed_tensors_decompress(tmp_path, rng_seed, case):
    fmt, args, shape = CASES[case]
    w = (torch.randn(shape) * torch.rand(shape[0], 1) * 0.1).bfloat16()
    comp, scheme, stored = compress(w, args, fmt)
    name = "model.layers.0.mlp.down_proj"
    write_ct_pack(tmp_path, {name: stored}, {"group_0": scheme_json(scheme)}, fmt,
                  extra={"lm_head.weight": torch.randn(5, shape[1]).bfloat16()})
    pack = open_pack(tmp_path)
    assert pack.format == "compressed-tensors"
    assert sorted(pack.names()) == ["lm_head.weight", name + ".weight"]
    got = pack.tensor(name + ".weight")
    assert got.shape == shape and got.dtype == torch.float32
    ref = library_fp32(comp, scheme, stored, fmt)
    assert torch.equal(got, ref.float()), f"max |d| {(got - ref).abs().max()}"
    # the library's unmodified path returns bf16: our exact value rounded to bf16
    lib_bf16 = comp.decompress(stored, scheme)["weight"]
    assert lib_bf16.dtype == torch.bfloat16 and torch.equal(got.bfloat16(), lib_bf16)
    st = pack.storage(name + ".weight")
    assert st.nbytes == sum(v.numel() * v.element_size() for v in stored.values())  # scales, zp, shape counted
    assert set(st.raw) == {f"{name}.{k}" for k in stored}


def test_int4_group_with_activation_order_g_idx(tmp_path, rng_seed):
    """GPTQ act-order: the columns stay in model order and g_idx[j] names column j's group. Build it from a library-
    compressed group-ordered weight by permuting its columns; the decode must be the library's decode, permuted."""
    fmt, args, (rows, cols) = "pack-quantized", dict(num_bits=4, type="int", symmetric=False, strategy="group",
                                                     group_size=32), (40, 128)
    comp, scheme, stored = compress(torch.randn(rows, cols).bfloat16(), args, fmt)
    ref = library_fp32(comp, scheme, stored, fmt)
    perm = torch.randperm(cols)
    ints = unpack_from_int32(stored["weight_packed"], 4, torch.Size((rows, cols)))
    act_order = dict(stored, weight_packed=pack_to_int32(ints[:, perm].contiguous(), 4),
                     weight_g_idx=(perm // 32).to(torch.int32))
    name = "model.layers.2.self_attn.q_proj"
    write_ct_pack(tmp_path, {name: act_order}, {"group_0": scheme_json(scheme)}, fmt)
    pack = open_pack(tmp_path)
    assert torch.equal(pack.tensor(name + ".weight"), ref[:, perm].float())
    assert "g_idx" in pack.storage(name + ".weight").dtype


def test_g_idx_of_minus_one_means_column_order(tmp_path, rng_seed):
    fmt, args = "pack-quantized", dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    comp, scheme, stored = compress(torch.randn(8, 64).bfloat16(), args, fmt)
    stored = dict(stored, weight_g_idx=torch.full((64,), -1, dtype=torch.int32))
    write_ct_pack(tmp_path, {"m": stored}, {"group_0": scheme_json(scheme)}, fmt)
    assert torch.equal(
        open_pack(tmp_path).tensor("m.weight"),
        library_fp32(comp, scheme, {k: v for k, v in stored.items() if k != "weight_g_idx"}, fmt),
    )


def test_mixed_precision_schemes_matched_by_regex_targets(tmp_path, rng_seed):
    c4, s4, st4 = compress(torch.randn(16, 64).bfloat16(), CASES["int4_group_sym"][1], "pack-quantized")
    c8, s8, st8 = compress(torch.randn(16, 64).bfloat16(), CASES["fp8_channel"][1], "float-quantized")
    g4 = dict(scheme_json(s4), targets=["re:.*mlp\\..*"])
    g8 = dict(scheme_json(s8), targets=["re:.*self_attn\\..*"])
    write_ct_pack(tmp_path, {"model.layers.0.mlp.up_proj": st4, "model.layers.0.self_attn.o_proj": st8},
                  {"group_0": g4, "group_1": g8}, "mixed-precision")
    pack = open_pack(tmp_path)
    assert torch.equal(pack.tensor("model.layers.0.mlp.up_proj.weight"), library_fp32(c4, s4, st4, "pack-quantized"))
    assert torch.equal(
        pack.tensor("model.layers.0.self_attn.o_proj.weight"), library_fp32(c8, s8, st8, "float-quantized")
    )
    assert pack.storage("model.layers.0.self_attn.o_proj.weight").format == "fp8_e4m3"
    rep = inspect_pack(str(tmp_path), decode=True)
    assert {r["format"] for r in rep["storage"]} == {"int4-pack-quantized", "fp8_e4m3"} and rep["problems"] == []


# -- bad input ----------------------------------------------------------------------------------------------------
def _narrow_scales(stored):
    stored["weight_scale"] = stored["weight_scale"][:, :3].contiguous()


def _nan_scale(stored):
    stored["weight_scale"][1, 1] = float("nan")


def _wider_weight_shape(stored):
    stored["weight_shape"] = torch.tensor([16, 160])


@pytest.mark.parametrize("fmt, case, shape, module, tamper, read, match", [
    ("pack-quantized", "int4_group_sym", (16, 128), "model.layers.0.mlp.gate_proj", _narrow_scales, False,
     r"wrong grid.*\[16, 3\].*gate_proj\.weight_scale.*model\.safetensors"),
    ("float-quantized", "fp8_block", (130, 130), "model.layers.0.mlp.gate_proj", _nan_scale, True,
     r"NaN in scales.*gate_proj\.weight_scale.*model\.safetensors"),
    ("pack-quantized", "int4_group_sym", (16, 128), "m", _wider_weight_shape, False,
     r"does not hold weight_shape.*m\.weight_packed.*model\.safetensors"),
], ids=["group scales of the wrong grid", "NaN scale names its tensor", "packed width disagreeing with weight_shape"])
def test_a_bad_stored_tensor_is_named(tmp_path, fmt, case, shape, module, tamper, read, match):
    comp, scheme, stored = compress(torch.randn(*shape).bfloat16(), CASES[case][1], fmt)
    tamper(stored)
    write_ct_pack(tmp_path, {module: stored}, {"group_0": scheme_json(scheme)}, fmt)
    with pytest.raises(PackError, match=match):
        pack = open_pack(tmp_path)
        if read:
            pack.tensor(f"{module}.weight")


def test_unsupported_format_and_untargeted_module(tmp_path):
    fmt, args = "pack-quantized", CASES["int4_group_sym"][1]
    comp, scheme, stored = compress(torch.randn(16, 64).bfloat16(), args, fmt)
    write_ct_pack(tmp_path, {"m": stored}, {"group_0": dict(scheme_json(scheme), format="marlin-24")}, fmt)
    with pytest.raises(PackError, match=r"marlin-24.*m\.weight_scale"):
        open_pack(tmp_path)
    write_ct_pack(tmp_path, {"m": stored}, {"group_0": dict(scheme_json(scheme), targets=["re:nothing"])}, fmt)
    with pytest.raises(PackError, match=r"targets.*m\.weight_packed"):
        open_pack(tmp_path)


def test_config_without_format_infers_it_from_the_stored_tensors(tmp_path, rng_seed):
    """Older llm-compressor configs name no format: int32 weight_packed is pack-quantized."""
    fmt, args = "pack-quantized", CASES["int4_group_asym"][1]
    comp, scheme, stored = compress(torch.randn(24, 128).bfloat16(), args, fmt)
    group = {k: v for k, v in scheme_json(scheme).items() if k != "format"}
    write_ct_pack(tmp_path, {"m": stored}, {"group_0": group}, fmt)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["quantization_config"]["format"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert torch.equal(open_pack(tmp_path).tensor("m.weight"), library_fp32(comp, scheme, stored, fmt))


@pytest.mark.parametrize("key,value,message", [("sparsity_config", {"format": "sparse-24-bitmask"}, "sparsity format"),
                                               ("transform_config", {"config_groups": {"u": {}}}, "transform_config")])
def test_sparse_and_rotated_packs_are_refused(tmp_path, key, value, message):
    fmt, args = "pack-quantized", CASES["int4_group_sym"][1]
    comp, scheme, stored = compress(torch.randn(8, 64).bfloat16(), args, fmt)
    write_ct_pack(tmp_path, {"m": stored}, {"group_0": scheme_json(scheme)}, fmt)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"][key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PackError, match=rf"{message}.*config\.json"):
        open_pack(tmp_path)


@pytest.mark.slow
def test_real_smollm2_weights_in_every_safetensors_form(tmp_path, smollm2_gguf):
    """Trained weights (SmolLM2's layer-0 MLP, 576 rows as in DeepSeek's kv_a_proj) quantized by compressed-tensors
    (int4 group asym, FP8 128x128 block) and by the DeepSeek recipe (FP8 with weight_scale_inv), each read back."""
    from gguf import GGUFReader
    from gguf.quants import dequantize as gguf_dequantize

    reader = GGUFReader(smollm2_gguf)
    by_name = {t.name: t for t in reader.tensors}
    real = {hf: torch.from_numpy(gguf_dequantize(by_name[g].data, by_name[g].tensor_type).copy())
            for hf, g in [("mlp.down_proj", "blk.0.ffn_down.weight"), ("mlp.up_proj", "blk.0.ffn_up.weight")]}
    assert real["mlp.down_proj"].shape == (576, 1536)
    for fmt, args in [CASES["int4_group_asym"][:2], CASES["fp8_block"][:2]]:
        d = tmp_path / fmt
        d.mkdir()
        comps = {f"model.layers.0.{n}": compress(w.bfloat16(), args, fmt) for n, w in real.items()}
        scheme = scheme_json(comps["model.layers.0.mlp.up_proj"][1])
        write_ct_pack(d, {m: c[2] for m, c in comps.items()}, {"group_0": scheme}, fmt)
        pack = open_pack(d)
        for m, (comp, scheme, stored) in comps.items():
            assert torch.equal(pack.tensor(m + ".weight"), library_fp32(comp, scheme, stored, fmt)), (fmt, m)
    # DeepSeek's own recipe: per 128x128 block, scale = amax / 448, q = fp8(w / scale)
    w = real["mlp.down_proj"]
    grid = torch.nn.functional.pad(w, (0, 0, 0, 64)).reshape(5, 128, 12, 128).abs().amax((1, 3)) / 448.0
    s_full = grid[torch.arange(576) // 128][:, torch.arange(1536) // 128]
    q = (w / s_full).to(torch.float8_e4m3fn)
    d = tmp_path / "deepseek"
    d.mkdir()
    write_safetensors(d / "model.safetensors", {"model.layers.0.mlp.down_proj.weight": q,
                                                "model.layers.0.mlp.down_proj.weight_scale_inv": grid})
    (d / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8",
                                                                       "weight_block_size": [128, 128]}}))
    got = open_pack(d).tensor("model.layers.0.mlp.down_proj.weight")
    assert torch.equal(got, (q.double() * s_full.double()).float())
    assert (got - w).abs().max() <= w.abs().max() / 16  # and it is the trained weight, to fp8 precision


def test_zero_points_of_the_wrong_grid(tmp_path):
    fmt, args = "pack-quantized", CASES["int4_group_asym"][1]
    comp, scheme, stored = compress(torch.randn(16, 128).bfloat16(), args, fmt)
    stored["weight_zero_point"] = stored["weight_zero_point"][:1].contiguous()
    write_ct_pack(tmp_path, {"model.layers.0.mlp.gate_proj": stored}, {"group_0": scheme_json(scheme)}, fmt)
    with pytest.raises(PackError, match=r"zero points of the wrong grid.*\[2, 2\].*gate_proj\.weight_zero_point"):
        open_pack(tmp_path)
