"""Every format decoded where the oracle runs: `pack.tensor(name, device=...)` sends the stored bytes to the device and
decodes them there (fidelity/packs/staging.py), and the layer prefetcher stages a layer's stored bytes ahead.

CPU (CI): the `device` argument path equals the default decode and the independent references of tests/test_packs_*.py
and tests/test_exl3_*.py (torch's own casts times index-expanded scale grids in float64, transformers' MXFP4
dequantizer, compressed-tensors' own dequantize, gguf-py, an independent bit-level EXL3 decoder with a float64 numpy
rebuild); EXL3's integer Hadamard sums equal its float64 sums bit for bit; the prefetcher's staging keeps layer order,
overlaps the next layer's staging with the current layer's compute, names the tensor of a failed read, and neither loses
nor repeats a layer.
`device` (CUDA): torch.equal(CUDA decode, CPU decode) for every format and variant below, at most the stored bytes
sent, and a layer's visible load time below its compute time.

Packs hold random stored bytes (every bit pattern but NaN/inf scales), built without any format library so the device
machine can build them too.
"""
from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
from functools import partial

import numpy as np
import pytest
import torch

from conftest import SHARED
from fidelity import PackError, open_pack
from fidelity.oracle import LoadChain, Oracle
from fidelity.oracle.parallel import Prefetcher
from testkit.synthetic import SyntheticPack, llama_config
from fidelity.packs import staging
from fidelity.packs.exl3 import codec
from fidelity.packs.safetensors_io import SafetensorsFile, write_safetensors
from test_packs_fp4 import e2m1_by_formula, expand, random_e4m3_scales
from test_packs_fp8 import expand_grid, random_fp8, reference

HAS_CUDA = torch.cuda.is_available()
HAVE_TRITON = importlib.util.find_spec("triton") is not None
CUDA = pytest.param("cuda", marks=[pytest.mark.device, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")])
DEVICES = ["cpu", CUDA]
STAGING = LoadChain(prefetch=partial(Prefetcher, stage=True))   # prefetch, stored bytes staged ahead on the CPU too


def write_pack(path, tensors: dict, config: dict):
    path.mkdir(parents=True, exist_ok=True)
    write_safetensors(path / "model.safetensors", tensors)
    (path / "config.json").write_text(json.dumps(config))
    return path


def check_on(pack, device: str, refs: dict | None = None, names=None) -> dict:
    """Every tensor decoded on `device` equals the default (CPU) decode bit for bit, and its reference where given;
    off the CPU at most its stored bytes were sent. Returns the CPU decodes."""
    out = {}
    for name in names or pack.names():
        if pack.storage(name).format == "absent":       # a shard the index names is not there (expert-packs layout)
            continue
        try:
            cpu = pack.tensor(name)
        except PackError as e:                          # a tensor the CPU refuses is refused alike on the device
            with pytest.raises(PackError) as on_device:
                pack.tensor(name, device=device)
            assert str(on_device.value) == str(e), name
            continue
        before = staging.bytes_sent()
        got = pack.tensor(name, device=device)
        sent = staging.bytes_sent() - before
        assert got.device.type == device and got.dtype == torch.float32 and got.shape == cpu.shape, name
        assert torch.equal(got.cpu(), cpu), f"{name}: max |d| {(got.cpu() - cpu).abs().max()}"
        assert sent <= pack.storage(name).nbytes, (name, sent, pack.storage(name).nbytes)
        if device != "cpu" and pack.storage(name).format != "gguf":
            assert sent > 0, f"{name}: nothing sent, so it was not decoded on the device"
        if refs is not None and name in refs:
            assert torch.equal(cpu, refs[name]), f"{name}: max |d| {(cpu - refs[name]).abs().max()}"
        out[name] = cpu
    return out


# ---------------------------------------------------------------------------------------------------------------------
# native casts
# ---------------------------------------------------------------------------------------------------------------------
def random_bits(shape, dtype) -> torch.Tensor:
    """Every finite bit pattern of a 16-bit float type (NaN/inf patterns replaced by 1.0)."""
    b = torch.randint(-32768, 32768, shape, dtype=torch.int16).view(dtype)
    return torch.where(torch.isfinite(b.float()), b, torch.ones((), dtype=dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_native_casts(tmp_path, rng_seed, device):
    from safetensors.torch import load_file
    ts = {"model.layers.0.mlp.up_proj.weight": random_bits((67, 130), torch.bfloat16),
          "model.layers.0.mlp.down_proj.weight": random_bits((130, 67), torch.float16),
          "model.layers.0.input_layernorm.weight": torch.randn(130),
          "model.norm.weight": torch.randn(130).double()}            # float64 that float32 holds exactly
    pack = open_pack(write_pack(tmp_path, ts, {"architectures": ["LlamaForCausalLM"]}))
    refs = {k: v.float() for k, v in load_file(tmp_path / "model.safetensors").items()}   # the safetensors library
    check_on(pack, device, refs)


# ---------------------------------------------------------------------------------------------------------------------
# FP8: every scale layout
# ---------------------------------------------------------------------------------------------------------------------
DEEPSEEK_QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def fp8_variant(variant: str):
    """(tensors, quantization_config, references) of one FP8 scale layout."""
    name = "model.layers.0.mlp.gate_proj.weight"
    if variant == "block_f32":
        q, s = random_fp8(130, 257), torch.rand(2, 3) * 1e-2 + 1e-6
        return (
            {name: q, name + "_scale_inv": s},
            DEEPSEEK_QC,
            {name: reference(q, expand_grid(s.double(), 130, 257, 128, 128))},
        )
    if variant.startswith("ue8m0_"):
        q, e = random_fp8(300, 200), torch.randint(100, 140, (3, 2), dtype=torch.uint8)
        e[2, 1] = 0                                                    # 2**-127: an fp32 subnormal
        s_ref = torch.pow(2.0, e.double() - 127)
        s = {"ue8m0_F8_E8M0": e.view(torch.float8_e8m0fnu), "ue8m0_U8": e,
             "ue8m0_F32": torch.pow(2.0, e.float() - 127)}[variant]
        return ({name: q, name + "_scale_inv": s}, {**DEEPSEEK_QC, "scale_fmt": "ue8m0"},
                {name: reference(q, expand_grid(s_ref, 300, 200, 128, 128))})
    if variant in ("tensor", "channel"):
        q = random_fp8(37, 65)
        s = torch.rand(()) + 1e-3 if variant == "tensor" else torch.rand(37) + 1e-3
        s_ref = s.double().reshape(()) if variant == "tensor" else s.double().reshape(-1, 1)
        return (
            {name: q, name[: -len(".weight")] + ".weight_scale": s},
            {"quant_method": "fp8", "activation_scheme": "static"},
            {name: reference(q, s_ref)},
        )
    if variant == "e5m2_experts":
        q, s = random_fp8(3, 200, 130, dtype=torch.float8_e5m2), torch.rand(3, 2, 2) + 0.5
        return (
            {name: q, name + "_scale_inv": s},
            DEEPSEEK_QC,
            {name: reference(q, expand_grid(s.double(), 200, 130, 128, 128))},
        )
    if variant == "block_32x64":
        q, s = random_fp8(100, 70), torch.rand(4, 2)
        return ({name: q, name + "_scale_inv": s}, {**DEEPSEEK_QC, "weight_block_size": [32, 64]},
                {name: reference(q, expand_grid(s.double(), 100, 70, 32, 64))})
    if variant == "modelopt_pb_wo":
        q, s = random_fp8(200, 256), torch.rand(2, 1, 2, 1) + 0.1
        return (
            {name: q, name[: -len(".weight")] + ".weight_scale": s},
            {"quant_method": "modelopt", "quant_algo": "FP8_PB_WO"},
            {name: reference(q, expand_grid(s.double().reshape(2, 2), 200, 256, 128, 128))},
        )
    if variant == "mxfp8":
        q, e = random_fp8(5, 96), torch.randint(110, 140, (5, 3), dtype=torch.uint8)
        return (
            {name: q, name[: -len(".weight")] + ".weight_scale": e},
            {"quant_method": "modelopt", "quant_algo": "MXFP8"},
            {name: reference(q, expand_grid(e.view(torch.float8_e8m0fnu).double(), 5, 96, 1, 32))},
        )
    raise AssertionError(variant)


FP8_VARIANTS = ["block_f32", "ue8m0_F8_E8M0", "ue8m0_U8", "ue8m0_F32", "tensor", "channel", "e5m2_experts",
                "block_32x64", "modelopt_pb_wo", "mxfp8"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", FP8_VARIANTS)
def test_fp8(tmp_path, rng_seed, device, variant):
    tensors, qc, refs = fp8_variant(variant)
    pack = open_pack(
        write_pack(tmp_path, tensors, {"architectures": ["DeepseekV3ForCausalLM"], "quantization_config": qc})
    )
    check_on(pack, device, refs)


# ---------------------------------------------------------------------------------------------------------------------
# MXFP4 / NVFP4
# ---------------------------------------------------------------------------------------------------------------------
def fp4_variant(variant: str):
    if variant.startswith("gpt_oss_"):
        E, out, inn = 3, 64, 96
        blocks = torch.randint(0, 256, (E, out, inn // 32, 16), dtype=torch.uint8)
        exps = torch.randint(110, 135, (E, out, inn // 32), dtype=torch.uint8)
        name = "model.layers.0.mlp.experts.down_proj"
        scales = exps.view(torch.float8_e8m0fnu) if variant.endswith("F8_E8M0") else exps
        q = e2m1_by_formula(blocks).reshape(E, out, inn)
        ref = (q * expand(torch.pow(2.0, exps.double() - 127), 32, inn)).float().transpose(1, 2)
        cfg = {"architectures": ["GptOssForCausalLM"], "num_local_experts": E, "num_experts_per_tok": 2,
               "quantization_config": {"quant_method": "mxfp4"}}
        return {name + "_blocks": blocks, name + "_scales": scales}, cfg, {name: ref}
    if variant == "deepseek_mxfp4":
        name = "layers.0.ffn.shared_experts.w1"
        w = torch.randint(-128, 128, (48, 64), dtype=torch.int8)
        e = torch.randint(110, 140, (48, 4), dtype=torch.uint8)
        ref = (e2m1_by_formula(w.view(torch.uint8)) * expand(torch.pow(2.0, e.double() - 127), 32, 128)).float()
        return ({name + ".weight": w, name + ".scale": e.view(torch.float8_e8m0fnu)}, {"architectures": ["X"]},
                {name + ".weight": ref})
    if variant == "modelopt_nvfp4":
        name, cols = "model.layers.0.self_attn.q_proj", 40                      # a partial last group of 16
        w = torch.randint(0, 256, (37, cols // 2), dtype=torch.uint8)
        s, s2 = random_e4m3_scales(37, 3), torch.rand(()) * 1e-3
        ref = (e2m1_by_formula(w) * expand(s.to(torch.float64), 16, cols) * s2.double()).float()
        cfg = {"architectures": ["LlamaForCausalLM"],
               "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}}
        return (
            {name + ".weight": w, name + ".weight_scale": s, name + ".weight_scale_2": s2},
            cfg,
            {name + ".weight": ref},
        )
    raise AssertionError(variant)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["gpt_oss_U8", "gpt_oss_F8_E8M0", "deepseek_mxfp4", "modelopt_nvfp4"])
def test_fp4(tmp_path, rng_seed, device, variant):
    tensors, cfg, refs = fp4_variant(variant)
    check_on(open_pack(write_pack(tmp_path, tensors, cfg)), device, refs)


def test_gpt_oss_device_argument_equals_transformers_dequantizer(tmp_path, rng_seed):
    convert = pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors
    tensors, cfg, _ = fp4_variant("gpt_oss_U8")
    pack = open_pack(write_pack(tmp_path, tensors, cfg))
    name = "model.layers.0.mlp.experts.down_proj"
    ref = convert(tensors[name + "_blocks"], tensors[name + "_scales"], dtype=torch.float32)
    assert torch.equal(pack.tensor(name, device="cpu"), ref)


# ---------------------------------------------------------------------------------------------------------------------
# compressed-tensors
# ---------------------------------------------------------------------------------------------------------------------
def ct_args(num_bits, type_, symmetric, strategy, group_size=None, block=None) -> dict:
    a = {"num_bits": num_bits, "type": type_, "symmetric": symmetric, "strategy": strategy}
    if group_size is not None:
        a["group_size"] = group_size
    if block is not None:
        a["block_structure"] = block
    return a


# (format, weights args, [rows, cols], with activation-order g_idx)
CT_CASES = {
    "int4_group_asym_gidx": ("pack-quantized", ct_args(4, "int", False, "group", 32), (37, 128), True),
    "int8_channel_sym": ("pack-quantized", ct_args(8, "int", True, "channel"), (45, 100), False),
    "int3_group_asym": ("pack-quantized", ct_args(3, "int", False, "group", 16), (29, 80), False),
    "int4_tensor_asym": ("pack-quantized", ct_args(4, "int", False, "tensor"), (9, 24), False),
    "int8_naive_group_asym": ("int-quantized", ct_args(8, "int", False, "group", 16), (19, 48), False),
    "fp8_block": ("float-quantized", ct_args(8, "float", True, "block", block=[128, 128]), (300, 200), False),
    "fp8_channel": ("float-quantized", ct_args(8, "float", True, "channel"), (31, 64), False),
    "mxfp8": ("mxfp8-quantized", ct_args(8, "float", True, "group", 32), (10, 96), False),
    "nvfp4": ("nvfp4-pack-quantized", ct_args(4, "float", True, "tensor_group", 16), (37, 48), False),
    "mxfp4": ("mxfp4-pack-quantized", ct_args(4, "float", True, "group", 32), (21, 96), False),
}


def ct_random_module(fmt: str, args: dict, shape, g_idx: bool) -> dict:
    """The stored tensors of one module, random (any bit pattern of the packed words, positive finite scales)."""
    rows, cols = shape
    bits, strategy, gs = args["num_bits"], args["strategy"], args.get("group_size")
    n_groups = {"tensor": 1, "channel": 1}.get(strategy) or (-(-cols // gs) if gs else None)
    scale_shape = {"tensor": (1,), "channel": (rows, 1)}.get(strategy) or (
        (-(-rows // 128), -(-cols // 128)) if strategy == "block" else (rows, n_groups))
    sd = {"weight_scale": (torch.rand(scale_shape) * 1e-2 + 1e-4).bfloat16()}
    if fmt == "pack-quantized":
        sd["weight_packed"] = torch.randint(-(2**31), 2**31, (rows, -(-cols * bits // 32)), dtype=torch.int64).to(
            torch.int32
        )
        sd["weight_shape"] = torch.tensor([rows, cols])
        if not args["symmetric"]:
            if strategy == "tensor":
                sd["weight_zero_point"] = torch.randint(-8, 8, (1,), dtype=torch.int8)
            else:
                sd["weight_zero_point"] = torch.randint(-2**31, 2**31, (-(-rows * bits // 32), n_groups),
                                                        dtype=torch.int64).to(torch.int32)
        if g_idx:
            sd["weight_g_idx"] = torch.randint(0, n_groups, (cols,), dtype=torch.int32)
    elif fmt == "int-quantized":
        sd["weight"] = torch.randint(-128, 128, shape, dtype=torch.int8)
        if not args["symmetric"]:
            sd["weight_zero_point"] = torch.randint(-20, 20, scale_shape, dtype=torch.int8)
    elif fmt == "float-quantized":
        sd["weight"] = random_fp8(*shape)
    elif fmt == "mxfp8-quantized":
        sd["weight"], sd["weight_scale"] = random_fp8(*shape), torch.randint(110, 140, scale_shape, dtype=torch.uint8)
    elif fmt == "nvfp4-pack-quantized":
        sd["weight_packed"] = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8)
        sd["weight_scale"] = random_e4m3_scales(*scale_shape)
        sd["weight_global_scale"] = torch.rand(1) * 100 + 1
    elif fmt == "mxfp4-pack-quantized":
        sd["weight_packed"] = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8)
        sd["weight_scale"] = torch.randint(110, 140, scale_shape, dtype=torch.uint8)
    return sd


def write_ct(path, module: str, sd: dict, fmt: str, args: dict):
    qc = {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": args, "format": fmt}}}
    return write_pack(path, {f"{module}.{k}": v for k, v in sd.items()},
                      {"architectures": ["LlamaForCausalLM"], "quantization_config": qc})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(CT_CASES))
def test_compressed_tensors(tmp_path, rng_seed, device, case):
    fmt, args, shape, g_idx = CT_CASES[case]
    pack = open_pack(
        write_ct(tmp_path, "model.layers.0.mlp.down_proj", ct_random_module(fmt, args, shape, g_idx), fmt, args)
    )
    assert pack.format == "compressed-tensors"
    check_on(pack, device)


@pytest.mark.parametrize("case", ["int4_group_asym", "int3_group_asym", "int8_naive_group_asym", "fp8_block", "mxfp8",
                                  "nvfp4", "mxfp4"])
def test_compressed_device_argument_equals_the_library(tmp_path, rng_seed, case):
    """On the CPU: compressed-tensors' own dequantize of what its own compressors wrote
    (tests/test_packs_compressed)."""
    pytest.importorskip("compressed_tensors")
    from test_packs_compressed import CASES, compress, library_fp32, scheme_json, write_ct_pack
    fmt, args, shape = CASES[case]
    w = (torch.randn(shape) * torch.rand(shape[0], 1) * 0.1).bfloat16()
    comp, scheme, stored = compress(w, args, fmt)
    write_ct_pack(tmp_path, {"m": stored}, {"group_0": scheme_json(scheme)}, fmt)
    assert torch.equal(
        open_pack(tmp_path).tensor("m.weight", device="cpu"), library_fp32(comp, scheme, stored, fmt).float()
    )


# ---------------------------------------------------------------------------------------------------------------------
# EXL3: every codebook, integer and half-integer K, both sign encodings; float64 and integer Hadamard sums
# ---------------------------------------------------------------------------------------------------------------------
EXL3_CASES = [("3inst", 2, "suh"), ("mcg", 4, "suh"), ("mul1", 3, "suh"), ("mul1", 1.5, "suh"), ("mul1", 2.5, "suh"),
              ("mul1", 3.5, "suh"), ("3inst", 5, "su"), ("mul1", 3, "su"), ("mcg", 8, "su")]


def exl3_linear(codebook: str, K: float, signs: str, k_p: int = 256, n_p: int = 128) -> dict:
    """Stored tensors of one EXL3 linear (exllamav3 naming): random trellis bits, fp16 scales or sign bitfields."""
    t = {"trellis": torch.randint(-32768, 32768, (k_p // 16, n_p // 16, codec.Bitrate.of(K).words), dtype=torch.int16),
         **codec.codebook_marker(codebook)}
    if signs == "suh":
        t["suh"], t["svh"] = (torch.randn(k_p) * 0.1).half(), (torch.randn(n_p) * 0.1).half()
    else:                                            # legacy sign bitfields
        t["su"] = torch.randint(-32768, 32768, (k_p // 16,), dtype=torch.int16)
        t["sv"] = torch.randint(-32768, 32768, (n_p // 16,), dtype=torch.int16)
    return t


def write_exl3(path, linears: dict[str, dict], bias: dict | None = None):
    tensors = {f"{base}.{k}": v for base, t in linears.items() for k, v in t.items()}
    tensors.update(bias or {})
    return write_pack(
        path, tensors, {"architectures": ["LlamaForCausalLM"], "quantization_config": {"quant_method": "exl3"}}
    )


def exl3_reference(t: dict, codebook: str, K: float) -> torch.Tensor:
    """Independent bit-level decoder and float64 numpy rebuild (tests/test_exl3_decode), rounded once to float32."""
    from test_exl3_decode import _numpy_exact_rebuild, _numpy_reference_inner
    golden = SHARED / "golden" / "exl3" / "codebooks.safetensors"
    if golden.exists():                              # exllamav3's own codebook tables
        from safetensors.torch import load_file
        table = load_file(golden)[f"codebook.{codebook}"].float().numpy()
    else:                                            # ours, which test_exl3_decode checks against those tables
        table = codec.codebook_values(codebook).numpy()
    inner = torch.from_numpy(_numpy_reference_inner(t["trellis"].numpy(), K, table))
    suh = t["suh"] if "suh" in t else codec.unpack_sign_bits(t["su"])
    svh = t["svh"] if "svh" in t else codec.unpack_sign_bits(t["sv"])
    return torch.from_numpy(_numpy_exact_rebuild(inner, suh, svh).T.astype(np.float32).copy())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codebook,K,signs", EXL3_CASES)
def test_exl3(tmp_path, rng_seed, device, codebook, K, signs):
    t = exl3_linear(codebook, K, signs)
    base = "model.layers.0.mlp.down_proj"
    bias = {f"{base}.bias": torch.randn(128).half()}
    pack = open_pack(write_exl3(tmp_path, {base: t}, bias))
    refs = {f"{base}.bias": bias[f"{base}.bias"].float()}
    if device == "cpu":
        refs[f"{base}.weight"] = exl3_reference(t, codebook, K)
    check_on(pack, device, refs)


def exl3_extremes(codebook: str, K: float) -> list[dict]:
    """Trellises whose every window is one state (all bits 0 or 1: the Hadamard sums concentrate 128 x 128 equal
    values in one element) with the largest and smallest fp16 scales, plus a random one."""
    out = []
    for fill in (0, -1):
        t = exl3_linear(codebook, K, "suh")
        t["trellis"].fill_(fill)
        t["suh"][:] = torch.tensor([65504.0, -6e-8, 1.0, -2.0 ** -14]).half().repeat(64)
        out.append(t)
    out.append(exl3_linear(codebook, K, "suh", k_p=384, n_p=256))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codebook,K", [("3inst", 1), ("mcg", 3), ("mul1", 2.5), ("mul1", 8), ("3inst", 6)])
def test_exl3_integer_sums_equal_float64_sums(rng_seed, device, codebook, K):
    """The exact path for GPUs with slow float64 (integer butterflies on the fp16 values times 2**24) gives the float64
    matmul path's bits; on a GPU both equal the CPU's."""
    for t in exl3_extremes(codebook, K):
        args = [t["trellis"], t["suh"], t["svh"]]
        cpu = codec.decode_weight(*args, codebook, sums="float64")
        for sums in ("float64", "int64"):
            got = codec.decode_weight(*[a.to(device) for a in args], codebook, sums=sums)
            assert got.device.type == device
            assert torch.equal(got.cpu(), cpu), (sums, (got.cpu() - cpu).abs().max())


NEEDS_TRITON = pytest.mark.skipif(not HAVE_TRITON, reason="missing tool: triton")
TRITON_CASES = [pytest.param("cpu", marks=NEEDS_TRITON), pytest.param("cuda", marks=[*CUDA.marks, NEEDS_TRITON])]


@pytest.mark.parametrize("device", TRITON_CASES)
@pytest.mark.parametrize("codebook,K,signs", EXL3_CASES)
def test_exl3_fused_kernel_equals_the_float64_decode(rng_seed, device, codebook, K, signs):
    """The one-kernel decode (codec "int8" sums: trellis -> states -> integer codebook -> both Hadamard sums as int8
    digits on tensor cores -> float32) gives the float64 decode's bits, padding cut or not; on the CPU it runs in
    Triton's interpreter, on CUDA compiled."""
    t = exl3_linear(codebook, K, signs, k_p=256, n_p=384)
    suh = t["suh"] if "suh" in t else codec.unpack_sign_bits(t["su"])
    svh = t["svh"] if "svh" in t else codec.unpack_sign_bits(t["sv"])
    args = [t["trellis"], suh, svh]
    for shape in (None, (380, 250), (129, 1)):
        cpu = codec.decode_weight(*args, codebook, sums="float64", shape=shape)
        got = codec.decode_weight(*[a.to(device) for a in args], codebook, sums="int8", shape=shape)
        assert got.device.type == device and got.shape == cpu.shape and got.is_contiguous()
        assert torch.equal(got.cpu(), cpu), (shape, (got.cpu() - cpu).abs().max())


@pytest.mark.parametrize("device", TRITON_CASES)
@pytest.mark.parametrize("codebook,K", [("3inst", 1), ("mcg", 3), ("mul1", 2.5), ("mul1", 8), ("3inst", 6)])
def test_exl3_fused_kernel_at_the_extremes(rng_seed, device, codebook, K):
    """All-zero / all-one trellises (one state everywhere: the Hadamard sums reach their largest magnitude, 128 x 128
    equal values, the digits' widest case) with the largest and smallest fp16 scales."""
    for t in exl3_extremes(codebook, K):
        args = [t["trellis"], t["suh"], t["svh"]]
        cpu = codec.decode_weight(*args, codebook, sums="float64")
        got = codec.decode_weight(*[a.to(device) for a in args], codebook, sums="int8")
        assert torch.equal(got.cpu(), cpu), (got.cpu() - cpu).abs().max()


BATCHED_SUMS = [("cpu", "float64"), pytest.param("cuda", "float64", marks=CUDA.marks),
                pytest.param("cuda", "int64", marks=CUDA.marks),
                *[pytest.param(case.values[0], "int8", marks=case.marks) for case in TRITON_CASES]]


@pytest.mark.parametrize("device,sums", BATCHED_SUMS)
@pytest.mark.parametrize("codebook,K,signs", [EXL3_CASES[0], EXL3_CASES[4], EXL3_CASES[8]])
def test_exl3_batched_decode_equals_each_matrix(rng_seed, device, sums, codebook, K, signs):
    """decode_weights over three matrices of one codebook, rate and shape (with sums 'int8' one kernel launch for
    all) gives each one's float64 CPU decode, padding cut or not."""
    ts = [exl3_linear(codebook, K, signs, k_p=256, n_p=384) for _ in range(3)]
    trellis = torch.stack([t["trellis"] for t in ts])
    suh = torch.stack([t["suh"] if "suh" in t else codec.unpack_sign_bits(t["su"]) for t in ts])
    svh = torch.stack([t["svh"] if "svh" in t else codec.unpack_sign_bits(t["sv"]) for t in ts])
    for shape in (None, (380, 250)):
        got = codec.decode_weights(trellis.to(device), suh.to(device), svh.to(device), codebook, shape=shape, sums=sums)
        assert got.device.type == device and tuple(got.shape) == (3, *(shape or (384, 256)))
        for m in range(3):
            want = codec.decode_weight(trellis[m], suh[m], svh[m], codebook, sums="float64", shape=shape)
            assert torch.equal(got[m].cpu(), want), (m, shape, (got[m].cpu() - want).abs().max())
    with pytest.raises(ValueError, match=r"decode_weights takes trellis \[E, kt, nt, words\]"):
        codec.decode_weights(trellis[0], suh, svh, codebook)


@pytest.mark.parametrize("device", DEVICES)
def test_exl3_pack_tensors_decode_each_kind_together(tmp_path, rng_seed, device, monkeypatch):
    """Pack.tensors: the linears of one codebook, trellis shape and scale encoding go through one batched decode,
    the others alone, every tensor equal to its own decode on the CPU (and to the independent reference); at most
    the stored bytes travel."""
    from fidelity.packs.exl3 import layouts
    linears = {"model.layers.0.mlp.gate_proj": exl3_linear("mul1", 3, "suh"),
               "model.layers.0.mlp.up_proj": exl3_linear("mul1", 3, "suh"),
               "model.layers.0.mlp.down_proj": exl3_linear("mul1", 3, "su"),
               "model.layers.0.self_attn.q_proj": exl3_linear("3inst", 2, "suh"),
               "model.layers.0.self_attn.k_proj": exl3_linear("mul1", 3, "suh", k_p=256, n_p=256)}
    pack = open_pack(write_exl3(tmp_path, linears))
    names = [f"{b}.weight" for b in linears]
    sizes = []
    original = layouts.decode_weights
    monkeypatch.setattr(
        layouts, "decode_weights", lambda t, *a, **k: (sizes.append(t.shape[0]), original(t, *a, **k))[1]
    )
    before = staging.bytes_sent()
    got = pack.tensors(names, device=device)
    sent = staging.bytes_sent() - before
    assert list(got) == names and sorted(sizes) == [1, 1, 1, 2]
    assert sent <= sum(pack.storage(n).nbytes for n in names) and (device == "cpu" or sent > 0)
    for (base, t), name in zip(linears.items(), names):
        want = pack.tensor(name)
        assert got[name].device.type == device and torch.equal(got[name].cpu(), want), name
        K, codebook = (2, "3inst") if "q_proj" in base else (3, "mul1")
        assert torch.equal(want, exl3_reference(t, codebook, K)), name


def test_pack_tensors_refuses_a_batched_decode_that_loses_tensors(tmp_path, monkeypatch):
    """A format's batched decode that returns fewer tensors than it was given: a PackError naming the pack and the
    first tensor of the batch, not a silently shorter result."""
    from fidelity.packs.exl3 import layouts
    linears = {f"model.layers.0.mlp.{p}_proj": exl3_linear("mul1", 3, "suh") for p in ("gate", "up")}
    pack = open_pack(write_exl3(tmp_path, linears))
    monkeypatch.setattr(layouts, "decode_weights", lambda t, *a, **k: torch.zeros(1, 128, 256))
    with pytest.raises(PackError, match=r"a batched decode of 2 tensors returned 1") as e:
        pack.tensors([f"{b}.weight" for b in linears])
    assert "model.layers.0.mlp.gate_proj.weight" in str(e.value) and str(tmp_path) in str(e.value)


def test_stack_to_device_takes_one_shape_and_dtype():
    ts = [torch.randn(3, 2).half() for _ in range(3)]
    assert torch.equal(staging.stack_to_device(ts, torch.device("cpu")), torch.stack(ts))
    with pytest.raises(ValueError, match="one shape and dtype"):
        staging.stack_to_device([ts[0], ts[1].float()], torch.device("meta"))


def test_exl3_fused_kernel_refuses_where_it_cannot_run(monkeypatch):
    """sums 'int8' without Triton, or on CPU tensors outside Triton's interpreter: a clear error, no other decode."""
    args = (torch.zeros(16, 8, 32, dtype=torch.int16), torch.ones(256).half(), torch.ones(128).half(), "3inst")
    if not HAVE_TRITON:
        with pytest.raises(RuntimeError, match="'int8' run in a Triton kernel, but triton is not installed"):
            codec.decode_weight(*args, sums="int8")
        return
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="'int8' run on a CUDA device .* not on cpu"):
        codec.decode_weight(*args, sums="int8")


def test_exl3_integer_codebooks_and_digits():
    """The fused kernel's integer tables: every codebook value times 2^CODEBOOK_SHIFT is an integer (checked here
    against the float64 codebook independently of the table builder) and the digit counts hold its sums."""
    for codebook in codec.CODEBOOKS:
        values = codec._codebook_f64(codebook)
        scaled = values * 2.0 ** codec.CODEBOOK_SHIFT
        assert torch.equal(scaled, scaled.round()) and values.abs().max() < 4
        table, biggest = codec._int_codebook(codebook)
        assert torch.equal(table.double() * 2.0 ** -codec.CODEBOOK_SHIFT, values)
        for bound in (biggest, 128 * biggest):
            d = codec._digits(bound)
            assert bound <= 127 * 256 ** (d - 1) and (d == 1 or bound > 127 * 256 ** (d - 2))
    assert [codec._digits(b) for b in (127, 128, 127 * 256, 127 * 256 + 1)] == [1, 2, 2, 3]


def test_exl3_sums_by_device():
    # FIDELITY_EXL3_SUMS overriding it (and 'fast' refused): tests/test_environment.py, through the command line
    assert codec.default_sums(torch.device("cpu")) == "float64"
    if HAS_CUDA:
        want = "int8" if HAVE_TRITON and torch.cuda.get_device_capability() >= (8, 0) else None
        assert want is None or codec.default_sums(torch.device("cuda")) == want
    with pytest.raises(ValueError, match="Hadamard sums 'float32'"):
        codec.decode_weight(torch.zeros(16, 8, 32, dtype=torch.int16), torch.ones(256).half(), torch.ones(128).half(),
                           "3inst", sums="float32")


@pytest.mark.parametrize("device", [CUDA])
def test_v4_and_v41_miniature_layouts_decode_on_the_device_like_the_cpu(tmp_path, device):
    """The five EXL3 seed layouts and the FP8/MXFP4 pack of tests/test_minipacks_v4 and _v41 (mixed K, wo_a slices,
    FP8 ue8m0 on 128 and 32 blocks, MXFP4 shared experts, FP8 Engram rows, official names): every tensor."""
    from test_minipacks_v4 import ENCODINGS, NATIVE, SPEC
    from fidelity.packs.exl3.encoder import EncodingCache
    from testkit.minipacks_v4 import write_all
    from testkit.minipacks_v41 import V41_SPEC, build_native_v41, write_all_v41
    packs = write_all(open_pack(NATIVE), tmp_path / "v4", SPEC, EncodingCache(ENCODINGS))
    v41 = build_native_v41(NATIVE, tmp_path / "v41native")
    packs |= {
        f"v4.1 {k}": v for k, v in write_all_v41(v41, tmp_path / "v41", V41_SPEC, EncodingCache(ENCODINGS)).items()
    }
    for layout, path in packs.items():
        check_on(open_pack(path), device)


# ---------------------------------------------------------------------------------------------------------------------
# GGUF: torch decoders where gguf-py's dequantizer is a few fp32 operations; gguf-py on the CPU for the rest
# ---------------------------------------------------------------------------------------------------------------------
GGUF_TORCH = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
GGUF_ON_CPU = ["IQ4_XS", "TQ2_0"]        # moved as fp32 (gguf-py's CPU decode)
# byte offsets of the fp16 fields of each block (kept finite; every other byte random)
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
              "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,), "TQ2_0": (64,)}


def gguf_stored(qtype: str, rows: int, cols: int, g: torch.Generator) -> np.ndarray:
    import gguf
    if qtype == "F32":
        return torch.randn(rows, cols, generator=g).numpy()
    if qtype == "F16":
        return random_bits((rows, cols), torch.float16).numpy()
    if qtype == "BF16":
        return random_bits((rows, cols), torch.bfloat16).view(torch.uint8).numpy()
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    b = torch.randint(0, 256, (rows, cols // block, size), dtype=torch.uint8, generator=g)
    for off in F16_FIELDS[qtype]:
        b[..., off : off + 2] = (
            (torch.rand(rows, cols // block, generator=g) * 0.02 + 1e-4)
            .half()
            .view(torch.uint8)
            .view(rows, cols // block, 2)
        )
    return b.reshape(rows, -1).numpy()


def gguf_pack(tmp_path, qtype: str, g: torch.Generator, arch: str = "qwen3"):
    from testkit.raw_gguf import write_gguf_tensors
    from test_packs_gguf import HPARAMS
    import gguf
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    cols = 256 if block == 256 else 64
    stored = gguf_stored(qtype, 33, cols, g)
    tensors = {"blk.1.ffn_down.weight": (stored, qtype), "blk.1.ffn_norm.weight": (torch.randn(cols).numpy(), "F32")}
    if arch == "llama":                              # q/k rows permuted by llama.cpp: unpermuted on the device too
        tensors["blk.0.attn_q.weight"] = (gguf_stored(qtype, 64, cols, g), qtype)
    hp = {**HPARAMS, "embedding_length": cols}
    return open_pack(write_gguf_tensors(tmp_path / "t.gguf", arch, hp, tensors)), stored


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", GGUF_TORCH + GGUF_ON_CPU)
def test_gguf(tmp_path, rng_seed, device, qtype):
    pytest.importorskip("gguf")
    pack, _ = gguf_pack(tmp_path, qtype, torch.Generator().manual_seed(rng_seed), arch="llama")
    check_on(pack, device)


@pytest.mark.parametrize("qtype", GGUF_TORCH)
def test_gguf_torch_decoders_equal_gguf_py(tmp_path, rng_seed, qtype):
    """The decoders the device runs, run on the CPU: bit for bit gguf-py's dequantize."""
    gguf = pytest.importorskip("gguf")
    from fidelity.packs.gguf import TORCH_DECODERS, stored_bytes
    stored = gguf_stored(qtype, 33, 256, torch.Generator().manual_seed(rng_seed))
    ref = np.array(gguf.quants.dequantize(stored, gguf.GGMLQuantizationType[qtype]), dtype=np.float32)
    got = TORCH_DECODERS[qtype](stored_bytes(stored)).reshape(ref.shape)
    assert torch.equal(got, torch.from_numpy(ref))


# ---------------------------------------------------------------------------------------------------------------------
# staging: stored bytes read ahead, decoded from the host copy
# ---------------------------------------------------------------------------------------------------------------------
def llama_pack(path, n_layers=4, hidden=64, inner=96, dtype=torch.bfloat16, seed=0):
    cfg = llama_config(hidden, inner, n_layers, 128, 4, 2)
    synthetic = SyntheticPack(cfg, seed=seed)
    return open_pack(write_pack(path, {n: synthetic.tensor(n).to(dtype) for n in synthetic.names()}, cfg))


@pytest.mark.parametrize("dtype", [torch.float8_e8m0fnu, torch.float8_e4m3fn, torch.uint16, torch.int16, torch.uint32,
                                   torch.bfloat16, torch.int64, torch.bool])
def test_host_copy_keeps_every_stored_dtype_bit_for_bit(dtype):
    raw = torch.randint(0, 256, (3, 5 * torch.empty((), dtype=dtype).element_size()), dtype=torch.uint8)
    t = (raw & 1).bool() if dtype == torch.bool else raw.view(dtype)
    for x in (t, t[1, 2]):                                          # a 0-dim one too
        y = staging.host_copy(x, pin=HAS_CUDA)
        assert y.dtype == x.dtype and y.shape == x.shape and y.is_pinned() == HAS_CUDA
        assert torch.equal(y.reshape(-1).view(torch.uint8), x.reshape(-1).view(torch.uint8))


def test_staged_bytes_are_what_decode_reads(tmp_path, rng_seed, monkeypatch):
    tensors, qc, refs = fp8_variant("block_f32")
    pack = open_pack(write_pack(tmp_path, tensors, {"architectures": ["X"], "quantization_config": qc}))
    name = next(iter(refs))
    keys = pack.stage([name], pin=False)
    assert len(keys) == 2 and pack.raw.staged.nbytes() == pack.storage(name).nbytes      # weight and scales
    assert pack.stage([name]) == keys                                                    # a second hold
    reads = []
    original = SafetensorsFile.get
    monkeypatch.setattr(SafetensorsFile, "get", lambda self, n: (reads.append(n), original(self, n))[1])
    assert torch.equal(pack.tensor(name), refs[name]) and reads == []                   # no file touched
    pack.unstage(keys)
    assert torch.equal(pack.tensor(name), refs[name]) and reads == []                   # still held once
    pack.unstage(keys)
    assert len(pack.raw.staged) == 0
    assert torch.equal(pack.tensor(name), refs[name]) and sorted(reads) == sorted(pack.storage(name).raw)


def staging_prefetch_case(tmp_path, seed: int, rows: int, length: int, n: int = 4):
    """(an n-layer Llama pack, random tokens [rows, length], the plain oracle's logits, a prefetching oracle that
    stages stored bytes)."""
    pack = llama_pack(tmp_path, n_layers=n, seed=seed)
    tokens = torch.randint(0, 128, (rows, length), generator=torch.Generator().manual_seed(seed))
    return pack, tokens, Oracle(pack).logits(tokens), Oracle(pack, chain=STAGING)


def test_prefetch_stages_in_order_overlaps_compute_and_keeps_the_numbers(tmp_path, rng_seed):
    n = 4
    pack, tokens, want, oracle = staging_prefetch_case(tmp_path, rng_seed, 2, 11, n)
    loader: Prefetcher = oracle.prefetcher
    events = []
    stage = pack.stage

    def slow_stage(names, pin=False):
        layer = int(names[0].split(".")[2])
        events.append(("stage", layer, "start", time.perf_counter(), threading.current_thread().name))
        time.sleep(0.05)
        keys = stage(names, pin)
        events.append(("stage", layer, "end", time.perf_counter(), threading.current_thread().name))
        return keys
    pack.stage = slow_stage
    build = loader.load

    def timed_build(i):
        layer = build(i)

        def run(*args):
            events.append(("compute", i, "start", time.perf_counter(), threading.current_thread().name))
            time.sleep(0.05)
            out = layer(*args)
            events.append(("compute", i, "end", time.perf_counter(), threading.current_thread().name))
            return out
        return run
    loader.load = timed_build
    for _ in range(2):                                                 # a second pass: the same again
        events.clear()
        assert torch.equal(oracle.logits(tokens), want)
        staged = [e[1] for e in events if e[0] == "stage" and e[2] == "start"]
        assert staged == list(range(n))                                # each layer once, in order, none lost
        assert all(e[4].startswith("fidelity-prefetch") for e in events if e[0] == "stage")
        at = {(kind, layer, edge): t for kind, layer, edge, t, _ in events if kind == "stage" or edge == "end"}
        for i in range(n - 1):    # layer i+1's bytes were being read while layer i computed
            assert at[("stage", i + 1, "start")] < at[("compute", i, "end")], i
        held = {k[1] for k in pack.raw.staged._held}                   # only the last layer stays held
        assert held and all(name.startswith(f"model.layers.{n - 1}.") for name in held)
        assert [t.layer for t in list(loader.timeline)[-n:]] == list(range(n))
        assert all(t.staged_bytes > 0 and t.wait_s >= 0 for t in list(loader.timeline)[-n:])
    loader.release(keep=None)
    assert len(pack.raw.staged) == 0


def test_prefetch_read_failure_names_the_tensor_and_stops_the_queue(tmp_path, rng_seed):
    n = 4
    pack, tokens, want, oracle = staging_prefetch_case(tmp_path, rng_seed, 1, 7, n)
    k = int(torch.randint(0, n - 1, (1,)))
    stage, staged, broken = pack.stage, [], [True]

    def failing(names, pin=False):
        layer = int(names[0].split(".")[2])
        staged.append(layer)
        if broken[0] and layer == k:
            raise PackError("read failed: Input/output error", file=tmp_path / "model.safetensors", tensor=names[0])
        return stage(names, pin)
    pack.stage = failing
    with pytest.raises(PackError, match=rf"Input/output error \[tensor 'model\.layers\.{k}\.") as err:
        oracle.logits(tokens)
    assert err.value.tensor.startswith(f"model.layers.{k}.")
    assert staged == list(range(k + 1))                               # nothing read behind the failed layer
    broken[0] = False
    staged.clear()
    assert torch.equal(oracle.logits(tokens), want) and staged == list(range(n))


def test_prefetch_stages_routed_experts_off_the_compute_thread(monkeypatch, rng_seed):
    """A MoE layer's experts decode on the compute thread when a token routes to them, from bytes the loader thread
    staged: no expert file read happens on the compute thread (the tiny DeepSeek-V4 fixture, 4 experts a layer)."""
    from test_minipacks_v4 import NATIVE
    pack = open_pack(NATIVE)
    tokens = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(rng_seed))
    want = Oracle(pack).logits(tokens)
    reads = []
    original = SafetensorsFile.get
    monkeypatch.setattr(SafetensorsFile, "get",
                        lambda self, n: (reads.append((n, threading.current_thread().name)), original(self, n))[1])
    oracle = Oracle(pack, chain=STAGING)
    assert torch.equal(oracle.logits(tokens), want)
    experts = [(n, thread) for n, thread in reads if ".experts." in n]
    assert experts and all(thread.startswith("fidelity-prefetch") for _, thread in experts)


# ---------------------------------------------------------------------------------------------------------------------
# device: a layer's load hidden behind its compute
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", [CUDA])
def test_visible_load_time_below_compute_time(tmp_path, device):
    """bf16 Llama layers of 2048 x 5632 (about 100 MB stored each), 8 rows x 2048 tokens: after layer 0 the compute
    thread waits less for each next layer than that layer computes."""
    n = 6
    pack = llama_pack(tmp_path, n_layers=n, hidden=2048, inner=5632)
    tokens = torch.randint(0, 128, (8, 2048), generator=torch.Generator().manual_seed(0))
    oracle = Oracle(pack, device=device, chain=LoadChain(prefetch=Prefetcher))
    loader: Prefetcher = oracle.prefetcher
    oracle.hidden_states(tokens.tolist(), progress=False)           # warm-up pass (kernels, page cache)
    t_pass = time.perf_counter()
    oracle.hidden_states(tokens.tolist(), progress=False)
    torch.cuda.synchronize()
    total = time.perf_counter() - t_pass
    timeline = list(loader.timeline)[-n:]
    visible = sum(t.wait_s for t in timeline[1:])
    load = sum(t.stage_s + t.build_s for t in timeline[1:])
    per_layer = (total - sum(t.wait_s for t in timeline)) / n        # compute (and head) per layer
    print(f"pass {total:.3f} s: {n - 1} loads {load:.3f} s, visible {visible:.3f} s; compute {per_layer:.3f} s a layer")
    assert all(t.staged_bytes > 90e6 for t in timeline)
    assert max(t.wait_s for t in timeline[1:]) < per_layer and visible < 0.5 * load, (visible, load, per_layer)


def test_prefetch_stages_only_what_this_rank_decodes(tmp_path, rng_seed):
    """Under sharded loads a rank reads ahead only its own share of a layer (the rest arrives by broadcast); under
    expert parallelism only its own experts."""
    from types import SimpleNamespace
    from fidelity.oracle.parallel import ExpertParallel, deal_tensors
    from test_minipacks_v4 import NATIVE
    oracle = Oracle(open_pack(NATIVE))
    loader = Prefetcher(oracle, stage=True)
    everything = loader.stage_names(0)
    experts = [n for n in everything if ".experts." in n]
    assert len(experts) == 4 * 3                                    # 4 routed experts x (w1, w2, w3)

    shared = [n for n in everything if ".experts." not in n]
    owners = deal_tensors([oracle.pack.storage(n).nbytes for n in shared], 2)
    shards = SimpleNamespace(plan=lambda i: (shared, owners), group=SimpleNamespace(rank=1))
    sharded = Oracle(open_pack(NATIVE), chain=LoadChain(prefetch=STAGING.prefetch, shards=lambda oracle: shards))
    mine = sharded.prefetcher.stage_names(0)
    assert set(mine) == {n for n, o in zip(shared, owners) if o == 1} | set(experts)

    experts_split = ExpertParallel(SimpleNamespace(rank=1, world_size=2))
    mine = Oracle(open_pack(NATIVE), chain=LoadChain(prefetch=STAGING.prefetch, experts=experts_split)
                  ).prefetcher.stage_names(0)
    assert set(mine) == set(shared) | {n for n in experts if ".experts.2." in n or ".experts.3." in n}


# ---------------------------------------------------------------------------------------------------------------------
# the staging budget (host memory held read ahead)
# ---------------------------------------------------------------------------------------------------------------------
def meminfo_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


@pytest.mark.parametrize("share", [0.3, 0.8, 2.0])
def test_prefetch_holds_at_most_its_host_budget(tmp_path, rng_seed, share):
    """The bytes held read ahead, as the pack's staging store counts them after every stage and at every layer's
    compute, never exceed the budget; a layer over half the budget stages part of itself and reads the rest at decode,
    with the same numbers; staged + left out = the layer's stored bytes."""
    n = 4
    pack = llama_pack(tmp_path, n_layers=n, seed=rng_seed)
    tokens = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(rng_seed))
    want = Oracle(pack).logits(tokens)
    oracle = Oracle(pack, chain=STAGING)
    loader: Prefetcher = oracle.prefetcher
    layer_bytes = sum(pack.storage(name).nbytes for name in loader.stage_names(1))
    budget = int(share * layer_bytes)
    loader.budget_bytes = budget
    held = []
    stage, build = pack.stage, loader.load

    def counting_stage(names, pin=False):
        keys = stage(names, pin)
        held.append(pack.raw.staged.nbytes())
        return keys

    def counting_build(i):
        layer = build(i)

        def run(*args):
            held.append(pack.raw.staged.nbytes())
            return layer(*args)
        return run
    pack.stage, loader.load = counting_stage, counting_build
    for _ in range(2):
        assert torch.equal(oracle.logits(tokens), want)
    assert held and max(held) <= budget, (max(held), budget)
    for t in list(loader.timeline)[-n:]:
        full = sum(pack.storage(name).nbytes for name in loader.stage_names(t.layer))
        assert t.staged_bytes + t.unstaged_bytes == full
        assert t.staged_bytes <= budget // 2
        if share >= 2.0:
            assert t.unstaged_bytes == 0
        else:
            assert t.unstaged_bytes > 0 and t.staged_bytes > 0
    loader.release(keep=None)
    assert len(pack.raw.staged) == 0 and not loader.staged_host_bytes


def test_staging_budget_takes_routed_experts_first_and_is_chosen_from_host_memory(monkeypatch):
    """Experts decode on the compute thread, so under a budget they are staged before the rest (the tiny V4 fixture);
    the default budget is half the host memory available (MemAvailable), RunSettings / FIDELITY_STAGE_BUDGET_BYTES
    override it, and pinned copies are counted at the power-of-two size torch's pinned allocator reserves."""
    from fidelity.environment import Environment
    from fidelity.oracle import parallel
    from fidelity.errors import FidelityError
    from test_minipacks_v4 import NATIVE
    oracle = Oracle(open_pack(NATIVE))
    names = Prefetcher(oracle, stage=True, budget_bytes=0).stage_names(0)
    size = {n: oracle.pack.storage(n).nbytes for n in names}
    experts = [n for n in names if ".experts." in n and "shared" not in n]
    assert experts and len(experts) < len(names)
    loader = Prefetcher(oracle, stage=True, budget_bytes=2 * sum(size[n] for n in experts))
    taken, left_out = loader.within_budget(names)
    assert set(taken) == set(experts) and left_out == sum(size.values()) - sum(size[n] for n in experts)
    assert taken == [n for n in names if n in set(experts)]                     # in the layer's order
    assert Prefetcher(oracle, stage=True, budget_bytes=0).within_budget(names) == ([], sum(size.values()))

    if os.path.exists("/proc/meminfo"):
        before = meminfo_available()
        chosen = Prefetcher(oracle, stage=True).budget_bytes
        after = meminfo_available()
        assert 0.5 * min(before, after) * 0.95 <= chosen <= 0.5 * max(before, after) * 1.05
    settings = parallel.RunSettings(stage_budget_bytes=12345)
    assert parallel.load_chain("cpu", settings).prefetch(oracle, stage=True).budget_bytes == 12345
    environment = Environment.from_environ({"FIDELITY_STAGE_BUDGET_BYTES": "4096"})
    assert parallel.RunSettings(**environment.run_settings()).stage_budget_bytes == 4096
    with pytest.raises(FidelityError, match="staging budget must be >= 0 bytes"):
        Prefetcher(oracle, stage=True, budget_bytes=-1)
    assert [parallel.held_host_bytes(b, pin=True) for b in (0, 1, 1000, 1024, 1025)] == [0, 1, 1024, 1024, 2048]
    assert parallel.held_host_bytes(1025, pin=False) == 1025
