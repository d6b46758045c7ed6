"""The five EXL3 seed layouts, written by fidelity.packs.exl3.writer from a tiny random-init DeepSeek-V3-style model
(tests/fixtures/exl3; encodings pre-computed on a GPU by our reference encoder, see the README there). Scope of the
exactness claim: each layout's reader gives, bit for bit, what the standard exllamav3 layout's reader gives for the same
stored tensors, which is codec.decode_weight, itself bit-exact against exllamav3 1.6.5 on the golden data
(test_exl3_decode). How close an encoding is to its native weight is the encoder's business, not tested here."""
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fidelity import PackError, open_pack
from fidelity.packs.exl3 import writer as minipacks
from fidelity.packs.exl3.encoder import EncodingCache
from fidelity.packs.exl3 import codec
from fidelity.packs.exl3.layouts import hf_to_official, official_to_hf

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "exl3"
SPEC = minipacks.MiniPackSpec()
FORMATS = {"exllamav3": "exl3", "cuda-exl3": "cuda-exl3", "deepseek_v41_exl3": "deepseek_v41_exl3",
           "exl3-expert-packs": "exl3-expert-packs", "exl3-mixed": "exl3-mixed"}


@pytest.fixture(scope="module")
def native():
    return open_pack(FIXTURES / "tiny_deepseek")


@pytest.fixture(scope="module")
def packs(native, tmp_path_factory):
    cache = EncodingCache(FIXTURES / "tiny_deepseek_encodings.safetensors")
    paths = minipacks.write_all(native, tmp_path_factory.mktemp("minipacks"), SPEC, cache)
    assert cache.misses == 0, "fixture encodings are stale: rerun tests/fixtures/exl3/make_fixtures.py encodings"
    return paths


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _expected_k(layout: str, name: str) -> float | None:
    m = re.search(r"\.experts\.(\d+)\.", name)
    if m:
        return SPEC.layer_k if layout == "cuda-exl3" else SPEC.expert_bits(int(m.group(1)))
    if layout in ("exllamav3", "deepseek_v41_exl3"):
        if name == "lm_head.weight":
            return SPEC.head_k
        if re.search(r"_(proj|mqa)\.weight$", name) or (name.endswith("wo_a.weight") and layout == "deepseek_v41_exl3"):
            return SPEC.dense_k
    return None


def test_name_maps_round_trip(native):
    for n in native.names():
        assert official_to_hf(hf_to_official(n)) == n
    assert official_to_hf("layers.3.ffn.experts.17.w1.weight") == "model.layers.3.mlp.experts.17.gate_proj.weight"
    assert official_to_hf("layers.3.ffn.experts.17.w3.weight") == "model.layers.3.mlp.experts.17.up_proj.weight"
    assert official_to_hf("layers.3.ffn.experts.17.w2.weight") == "model.layers.3.mlp.experts.17.down_proj.weight"


@pytest.mark.parametrize("layout", minipacks.LAYOUTS)
def test_layout_opens_and_every_tensor_decodes(packs, native, layout):
    pack = open_pack(packs[layout])
    assert pack.format == FORMATS[layout]
    extra = {"engram.tables.0.weight"} if layout == "exl3-expert-packs" else set()
    assert set(pack.names()) == set(native.names()) | extra
    n_exl3 = 0
    raw = raw_tensors(packs[layout])
    for name in native.names():
        ref = native.tensor(name)
        got = pack.tensor(name)
        s = pack.storage(name)
        assert got.shape == ref.shape, name
        K = _expected_k(layout, name)
        if K is None:
            if s.format == "fp8_e4m3":   # torch's e4m3 times the 128x128 block's multiplier, from the raw tensors
                base = hf_to_official(name)[: -len(".weight")]
                scale = raw[f"{base}.scale"].float().repeat_interleave(128, 0).repeat_interleave(128, 1)
                assert torch.equal(got, raw[f"{base}.weight"].float() * scale[: ref.shape[0], : ref.shape[1]]), name
            else:
                dtype = torch.float16 if layout == "exllamav3" else torch.bfloat16
                assert torch.equal(got, ref.to(dtype).float()), name
            continue
        n_exl3 += 1
        assert s.format == "exl3" and s.dtype.startswith(f"exl3 K={K:g} {SPEC.codebook}"), (name, s.dtype)
        # the values: bit for bit the standard layout's decode (test_each_layout_decodes_as_the_standard_layout...)
        assert torch.equal(got, standard_decode(raw, name, tuple(ref.shape))), name
    assert (
        n_exl3
        == {"exllamav3": 29, "cuda-exl3": 12, "deepseek_v41_exl3": 30, "exl3-expert-packs": 12, "exl3-mixed": 12}[
            layout
        ]
    )
    bpw = pack.bits_per_weight()
    assert "routed_experts" in bpw.rows


def as_standard(layout_dir: Path, out: Path) -> Path:
    """The EXL3 tensors of a layout's files (read raw, not through the layout reader) placed as a standard exllamav3
    checkpoint: Hugging Face names, one model.safetensors, `quant_method: exl3`. A wo_a head-group slice
    `layers.L.attn.wo_a.<g>` keeps its name (a linear of its own there)."""
    raw = raw_tensors(layout_dir)
    tensors = {}
    for key in sorted(k for k in raw if k.endswith(".trellis")):
        base = key[: -len(".trellis")]
        hf = official_to_hf(base + ".weight")[: -len(".weight")]
        for part in ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias"):
            if f"{base}.{part}" in raw:
                tensors[f"{hf}.{part}"] = raw[f"{base}.{part}"]
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((layout_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "exl3", "bits": SPEC.dense_k, "head_bits": SPEC.head_k,
                                     "codebook": SPEC.codebook}
    (out / "config.json").write_text(json.dumps(config))
    return out


def raw_tensors(folder: Path) -> dict[str, torch.Tensor]:
    raw = {}
    for f in sorted(folder.glob("*.safetensors")):
        raw.update(load_file(f))
    return raw


def standard_decode(raw: dict[str, torch.Tensor], name: str, shape: tuple[int, int]) -> torch.Tensor:
    """codec.decode_weight (exllamav3's decode, test_exl3_decode) of the stored pieces of the logical `name` (a name as
    the pack lists it, official or HF), read from the raw files; head-group slices `<base>.<g>` stacked."""
    for base in dict.fromkeys([name[: -len(".weight")], hf_to_official(name)[: -len(".weight")]]):
        pieces = sorted({k.rsplit(".", 1)[0] for k in raw if re.fullmatch(re.escape(base) + r"(\.\d+)?\.trellis", k)},
                        key=lambda b: (len(b), b))
        if pieces:
            break
    else:
        raise KeyError(f"no stored trellis for {name}")
    rows = shape[0] // len(pieces)
    parts = []
    for piece in pieces:
        codebook = "mul1" if f"{piece}.mul1" in raw else "mcg" if f"{piece}.mcg" in raw else "3inst"
        parts.append(codec.decode_weight(raw[f"{piece}.trellis"], raw[f"{piece}.suh"], raw[f"{piece}.svh"], codebook,
                                        shape=(rows, shape[1])))
    return torch.cat(parts)


@pytest.mark.parametrize("layout", minipacks.LAYOUTS)
def test_each_layout_decodes_as_the_standard_layout_bit_for_bit(packs, layout, tmp_path):
    """Every EXL3 tensor a layout's reader decodes equals, bit for bit, the decode of the same stored tensors placed in
    the standard exllamav3 layout, whose reader is codec.decode_weight (checked against exllamav3 1.6.5's own decode on
    the golden data in test_exl3_decode) - which this checks too, from the raw tensors."""
    pack, std = open_pack(packs[layout]), open_pack(as_standard(packs[layout], tmp_path / "std"))
    assert std.format == "exl3"
    raw = raw_tensors(packs[layout])
    compared = 0
    for name in pack.names():
        if pack.storage(name).format != "exl3":
            continue
        got, want = pack.tensor(name), std.tensor(name)
        assert want.shape == got.shape and torch.equal(got, want), (layout, name)
        assert std.storage(name).dtype == pack.storage(name).dtype, name
        assert torch.equal(want, standard_decode(raw, name, tuple(want.shape))), name
        compared += 1
    assert compared == {"exllamav3": 29, "cuda-exl3": 12, "deepseek_v41_exl3": 30, "exl3-expert-packs": 12,
                        "exl3-mixed": 12}[layout]


def test_same_encoding_decodes_identically_in_every_layout(packs):
    """Expert 1 is K=3 everywhere: five different file arrangements must give bit-identical tensors."""
    name = "model.layers.1.mlp.experts.1.down_proj.weight"
    tensors = [open_pack(p).tensor(name) for p in packs.values()]
    assert all(torch.equal(t, tensors[0]) for t in tensors[1:])


def test_expert_packs_absent_engram_shard_only_fails_when_read(packs):
    pack = open_pack(packs["exl3-expert-packs"])
    with pytest.raises(PackError, match=r"absent.*engram\.tables\.0\.weight.*model-00003-of-00003\.safetensors"):
        pack.tensor("engram.tables.0.weight")


def test_wo_a_head_group_slices_stack_along_output(packs, native):
    pack = open_pack(packs["deepseek_v41_exl3"])
    raw = load_file(packs["deepseek_v41_exl3"] / "model-exl3-dense.safetensors")
    assert {"layers.1.attn.wo_a.0.trellis", "layers.1.attn.wo_a.1.trellis"} <= set(raw)
    w = pack.tensor("layers.1.attn.wo_a.weight")
    for g in range(2):
        t = {p: raw[f"layers.1.attn.wo_a.{g}.{p}"] for p in ("trellis", "suh", "svh")}
        part = codec.decode_weight(t["trellis"], t["suh"], t["svh"], "mul1", shape=(32, 16))
        assert torch.equal(w[32 * g: 32 * (g + 1)], part)


# -- a K stated by a plan/config must equal the trellis' K -----------------------------------------------------------
def _edit_json(path: Path, fn):
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def _set_digit(digits: str, expert: int, k: int) -> str:
    return digits[:expert] + str(k) + digits[expert + 1:]


K_DISAGREEMENTS = {
    "exllamav3": (
        "quantization_config.json",
        lambda d: d["tensor_storage"]["model.layers.1.mlp.experts.2.up_proj"].__setitem__("bits_per_weight", 5),
        r"states K=5 but .* implies K=4.*experts\.2\.up_proj\.trellis.*model\.safetensors",
    ),
    "cuda-exl3": (
        "quantization_config.json",
        lambda d: d["expert_bits"].__setitem__("1", 4),
        r"expert_bits\[1\] states K=4 but .* implies K=3.*layers\.1\.ffn\.experts\.0\.w1\.trellis"
        r".*model-00002-of-00002",
    ),
    "deepseek_v41_exl3": (
        "exl3_moe_plan.json",
        lambda d: d["layers"].__setitem__("1", _set_digit(d["layers"]["1"], 2, 7)),
        r"expert plan .* states K=7 but .* implies K=4.*experts\.2\.w1\.trellis.*model-exl3-L01-p1",
    ),
    "exl3-expert-packs": (
        "exl3_moe_plan.json",
        lambda d: d["layers"][1].__setitem__("k", _set_digit(d["layers"][1]["k"], 0, 8)),
        r"states K=8 but .* implies K=2.*experts\.0\.w1\.trellis.*model-experts-L01",
    ),
}


@pytest.mark.parametrize("layout", sorted(K_DISAGREEMENTS))
def test_stated_k_disagreeing_with_trellis_is_caught(packs, tmp_path, layout):
    fname, edit, needle = K_DISAGREEMENTS[layout]
    dst = _copy(packs[layout], tmp_path / layout)
    _edit_json(dst / fname, edit)
    with pytest.raises(PackError, match=needle):
        open_pack(dst)


def test_mixed_k_reads_k_from_each_trellis(packs, tmp_path):
    pack = open_pack(packs["exl3-mixed"])
    for e in range(4):
        assert (
            pack.storage(f"model.layers.1.mlp.experts.{e}.gate_proj.weight").dtype
            == f"exl3 K={SPEC.expert_bits(e)} mul1"
        )
    dst = _copy(packs["exl3-mixed"], tmp_path / "mixed")
    ts = load_file(dst / "model.safetensors")
    ts["layers.1.ffn.experts.3.w2.trellis"] = ts["layers.1.ffn.experts.3.w2.trellis"][..., :72].contiguous()
    save_file(ts, str(dst / "model.safetensors"))
    with pytest.raises(
        PackError, match=r"last dim 72 is not divisible by 16.*experts\.3\.w2\.trellis.*model\.safetensors"
    ):
        open_pack(dst)


# -- bad plans and tensors -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "layout,edit,needle",
    [
        (
            "deepseek_v41_exl3",
            lambda d: d["layers"].__setitem__("1", "234"),
            r"layers\[1\] lists 3 experts.*n_routed_experts=4",
        ),
        ("deepseek_v41_exl3", lambda d: d["layers"].__setitem__("1", "23456"), r"layers\[1\] lists 5 experts"),
        ("deepseek_v41_exl3", lambda d: d["layers"].pop("1"), r"no entry for layers 1.*experts\.0\.w1"),
        ("deepseek_v41_exl3", lambda d: d["layers"].__setitem__("1", "2349"), r"K digits outside 1\.\.8"),
        ("exl3-expert-packs", lambda d: d["layers"][1].__setitem__("k", "23"), r"layers\[1\] lists 2 experts"),
    ],
)
def test_bad_plan_names_plan_file_and_item(packs, tmp_path, layout, edit, needle):
    dst = _copy(packs[layout], tmp_path / layout)
    _edit_json(dst / "exl3_moe_plan.json", edit)
    with pytest.raises(PackError, match=needle) as e:
        open_pack(dst)
    assert "exl3_moe_plan.json" in str(e.value)


@pytest.mark.parametrize("edit,needle", [
    (lambda ts: ts.pop("layers.1.ffn.experts.2.w3.suh"), r"no suh.*experts\.2\.w3\.suh.*model-exl3-L01-p1"),
    (lambda ts: ts.__setitem__("layers.1.ffn.experts.2.w3.svh", torch.ones(256).half()),
     r"svh has shape \[256\].*needs \[128\].*experts\.2\.w3\.svh.*model-exl3-L01-p1"),
])
def test_bad_expert_tensors_name_tensor_and_file(packs, tmp_path, edit, needle):
    dst = _copy(packs["deepseek_v41_exl3"], tmp_path / "v41")
    f = dst / "model-exl3-L01-p1.safetensors"
    ts = load_file(f)
    edit(ts)
    save_file(ts, str(f))
    idx = json.loads((dst / "model.safetensors.index.json").read_text())
    idx["weight_map"] = {n: v for n, v in idx["weight_map"].items() if v != f.name}   # index follows the file
    (dst / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(PackError, match=needle):
        open_pack(dst)


def test_missing_expert_half_fails_only_for_its_experts(packs, tmp_path):
    dst = _copy(packs["deepseek_v41_exl3"], tmp_path / "v41")
    (dst / "model-exl3-L01-p1.safetensors").unlink()            # experts 2 and 3; the index still names the file
    pack = open_pack(dst)
    assert pack.tensor("model.layers.1.mlp.experts.1.up_proj.weight").shape == (32, 64)
    with pytest.raises(PackError, match=r"absent.*experts\.2\.up_proj\.weight.*model-exl3-L01-p1\.safetensors"):
        pack.tensor("model.layers.1.mlp.experts.2.up_proj.weight")


def test_plan_drafter_section_is_checked(packs, tmp_path):
    dst = _copy(packs["deepseek_v41_exl3"], tmp_path / "v41")
    _edit_json(dst / "exl3_moe_plan.json", lambda d: d["drafter"]["layers"].__setitem__("0", "22"))
    with pytest.raises(PackError, match=r"mtp\[0\] lists 2 experts.*exl3_moe_plan\.json"):
        open_pack(dst)


def test_cuda_exl3_layer_without_expert_bits(packs, tmp_path):
    dst = _copy(packs["cuda-exl3"], tmp_path / "cuda")
    _edit_json(dst / "quantization_config.json", lambda d: d.__setitem__("expert_bits", {"7": 3}))
    with pytest.raises(PackError, match=r"expert_bits has no entry for layer 1.*quantization_config\.json"):
        open_pack(dst)


def test_cuda_exl3_untouched_mxfp4_tensor(packs, tmp_path, rng_seed):
    """Official MXFP4 (int8 [out, in/2], low nibble first, e8m0 [out, in/32]) next to the EXL3 experts."""
    dst = _copy(packs["cuda-exl3"], tmp_path / "cuda")
    f = dst / "model-00001-of-00002.safetensors"
    ts = load_file(f)
    codes = torch.randint(0, 256, (32, 32), dtype=torch.uint8)
    exps = torch.randint(120, 130, (32, 2), dtype=torch.uint8)
    for k in ("layers.1.ffn.shared_experts.w1.weight", "layers.1.ffn.shared_experts.w1.scale"):
        ts.pop(k)
    ts["layers.1.ffn.shared_experts.w1.weight"] = codes.view(torch.int8)
    ts["layers.1.ffn.shared_experts.w1.scale"] = exps.view(torch.float8_e8m0fnu)
    save_file(ts, str(f))
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    ref = torch.empty(32, 64)
    for r in range(32):
        for c in range(64):
            byte = int(codes[r, c // 2])
            ref[r, c] = e2m1[(byte >> 4) if c % 2 else (byte & 15)] * 2.0 ** (int(exps[r, c // 32]) - 127)
    pack = open_pack(dst)
    assert pack.storage("model.layers.1.mlp.shared_experts.gate_proj.weight").format == "mxfp4"
    assert torch.equal(pack.tensor("model.layers.1.mlp.shared_experts.gate_proj.weight"), ref)


def test_official_fp8_with_weight_scale_inv_is_renamed_too(packs, native, tmp_path):
    """The fp8 claimer would take `.weight` + `.weight_scale_inv` under their official names; EXL3 packs claim first."""
    dst = _copy(packs["cuda-exl3"], tmp_path / "cuda")
    f = dst / "model-00001-of-00002.safetensors"
    ts = {re.sub(r"\.scale$", ".weight_scale_inv", k): v for k, v in load_file(f).items()}
    save_file(ts, str(f))
    idx = json.loads((dst / "model.safetensors.index.json").read_text())
    idx["weight_map"] = {re.sub(r"\.scale$", ".weight_scale_inv", k): v for k, v in idx["weight_map"].items()}
    (dst / "model.safetensors.index.json").write_text(json.dumps(idx))
    pack = open_pack(dst)
    assert set(pack.names()) == set(native.names())
    assert pack.storage("model.layers.0.self_attn.q_a_proj.weight").format == "fp8_e4m3"


@pytest.mark.slow
def test_oracle_runs_on_every_layout(packs, native, rng_seed):
    from fidelity.oracle import Oracle

    ids = torch.randint(0, native.config["vocab_size"], (1, 16))
    ref = Oracle(native).logits(ids)
    for layout, path in packs.items():
        pack = open_pack(path)
        got = Oracle(pack).logits(ids)
        # exactly the model of the tensors the reader decodes (written as a float32 native pack), and not the native one
        folder = path.parent / f"{layout}-decoded"
        folder.mkdir()
        save_file({n: pack.tensor(n).contiguous() for n in pack.names() if n != "engram.tables.0.weight"},
                  str(folder / "model.safetensors"))
        (folder / "config.json").write_text(
            json.dumps({k: v for k, v in pack.config.items() if k != "quantization_config"})
        )
        decoded = open_pack(folder)
        assert torch.equal(got, Oracle(decoded).logits(ids)), layout
        assert not torch.equal(got, ref), layout


def test_cuda_exl3_per_expert_bits_list(packs, tmp_path):
    dst = _copy(packs["cuda-exl3"], tmp_path / "cuda")
    _edit_json(dst / "quantization_config.json", lambda d: d["expert_bits"].__setitem__("1", [3, 3, 3, 3]))
    assert open_pack(dst).storage("model.layers.1.mlp.experts.3.gate_proj.weight").dtype == "exl3 K=3 mul1"
    _edit_json(dst / "quantization_config.json", lambda d: d["expert_bits"].__setitem__("1", [3, 3, 6, 3]))
    with pytest.raises(
        PackError, match=r"expert_bits\[1\]\[2\] states K=6 but .* implies K=3.*experts\.2\.w1\.trellis"
    ):
        open_pack(dst)
