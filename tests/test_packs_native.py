import json
import struct

import pytest
import torch
from safetensors.torch import load_file

from fidelity import PackError, open_pack
from fidelity.packs.safetensors_io import write_safetensors


def _tensors():
    return {
        "model.embed_tokens.weight": torch.randn(37, 12).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(12, 12).to(torch.float16),
        "model.layers.0.input_layernorm.weight": torch.randn(12),
        "lm_head.weight": torch.randn(37, 12, dtype=torch.float64).float().double(),
    }


@pytest.mark.parametrize("sharded", [False, True])
def test_native_equals_safetensors_library(tmp_path, rng_seed, sharded):
    ts = _tensors()
    if sharded:
        names = sorted(ts)
        wm = {}
        for i, chunk in enumerate([names[:2], names[2:]]):
            fn = f"model-{i:05d}-of-00002.safetensors"
            write_safetensors(tmp_path / fn, {n: ts[n] for n in chunk})
            wm.update({n: fn for n in chunk})
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    else:
        write_safetensors(tmp_path / "model.safetensors", ts)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    pack = open_pack(tmp_path)
    assert pack.format == "native"
    assert sorted(pack.names()) == sorted(ts)
    ref = {}
    for f in tmp_path.glob("*.safetensors"):
        ref.update(load_file(f))
    for n in ts:
        got = pack.tensor(n)
        assert got.dtype == torch.float32
        assert torch.equal(got, ref[n].to(torch.float32)), n
    assert pack.storage("model.embed_tokens.weight").dtype == "BF16"
    assert pack.storage("model.embed_tokens.weight").bits == 16
    bpw = pack.bits_per_weight()
    assert bpw["dense_linear"]["bpw"] == 16 and bpw["head"]["bpw"] == 64


def test_truncated_shard_names_file_and_tensor(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", {"a.weight": torch.randn(4, 4), "b.weight": torch.randn(64, 64)})
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(PackError, match=r"truncated.*b\.weight.*model\.safetensors"):
        open_pack(tmp_path)


def test_shard_truncated_after_open_is_refused_not_a_crash(tmp_path):
    """Touching mapped pages past a file's new end kills the process (SIGBUS); the read must be refused first."""
    a, b = torch.randn(4, 4), torch.randn(64, 64)
    write_safetensors(tmp_path / "model.safetensors", {"a.weight": a, "b.weight": b})
    pack = open_pack(tmp_path)
    assert torch.equal(pack.tensor("a.weight"), a)
    with open(tmp_path / "model.safetensors", "r+b") as f:   # rewritten in place while the pack is open
        f.truncate(f.seek(0, 2) - 4096)
    with pytest.raises(PackError, match=r"shrank to \d+ bytes after it was opened.*b\.weight.*model\.safetensors"):
        pack.tensor("b.weight")
    assert torch.equal(pack.tensor("a.weight"), a)           # data still inside the file reads as before


def test_header_shape_dtype_disagreement(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", {"a.weight": torch.randn(4, 4)})
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header["a.weight"]["shape"] = [4, 8]  # 32 elements * 4 bytes != 64 bytes on disk
    h = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    f.write_bytes(data[:8] + h + data[8 + n:])
    with pytest.raises(PackError, match=r"a\.weight.*model\.safetensors"):
        open_pack(tmp_path)


def one_shard_with_index(folder, extra: dict[str, str]):
    """s1.safetensors holding a.weight, and an index mapping a.weight there plus `extra` (name -> shard)."""
    write_safetensors(folder / "s1.safetensors", {"a.weight": torch.randn(4, 4)})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a.weight": "s1.safetensors", **extra}}))


def test_missing_tensor_named_in_index(tmp_path):
    one_shard_with_index(tmp_path, {"b.weight": "s1.safetensors"})
    with pytest.raises(PackError, match=r"does not hold.*b\.weight.*s1\.safetensors"):
        open_pack(tmp_path)


def test_absent_shard_is_an_error_only_when_requested(tmp_path):
    one_shard_with_index(tmp_path, {"engram.table": "s9-absent.safetensors"})
    pack = open_pack(tmp_path)
    assert torch.equal(pack.tensor("a.weight"), load_file(tmp_path / "s1.safetensors")["a.weight"])
    with pytest.raises(PackError, match=r"absent.*engram\.table.*s9-absent"):
        pack.tensor("engram.table")


def test_unknown_quant_method(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", {"a.weight": torch.randn(4, 4)})
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "made-up-q"}}))
    with pytest.raises(PackError, match=r"made-up-q.*config\.json"):
        open_pack(tmp_path)


def test_unknown_tensor_name(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", {"a.weight": torch.randn(4, 4)})
    with pytest.raises(PackError, match=r"nope"):
        open_pack(tmp_path).tensor("nope")


def test_inspect_cli(tmp_path, capsys):
    from fidelity.cli import main

    write_safetensors(tmp_path / "model.safetensors", {"model.layers.0.mlp.up_proj.weight": torch.randn(8, 4).half()})
    assert main(["inspect", str(tmp_path), "--decode", "--json", str(tmp_path / "r.json")]) == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["format"] == "native" and rep["bits_per_weight"][0]["bpw"] == 16


def test_tied_embedding_is_reported_as_head_and_counted_once(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", {
        "model.embed_tokens.weight": torch.randn(50, 8).half(),
        "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8),
        "model.layers.0.mlp.experts.gate_up_proj_bias": torch.randn(4, 32),
    })
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    bpw = open_pack(tmp_path).bits_per_weight()
    assert bpw["head"] == {"params": 400, "bytes": 800, "bpw": 16.0}
    assert bpw["total"]["params"] == 400 + 128 + 128
    assert "routed_experts" not in bpw.rows  # an expert bias is not an expert weight
    assert bpw["all_linear"]["params"] == 400 + 128


def test_fingerprint_sees_content_changes(tmp_path, rng_seed):
    w = torch.randn(300, 200)
    for name, t in (
        ("a", w),
        ("b", w.clone()),
        ("c", torch.where(torch.arange(w.numel()).view_as(w) == 12345, w + 1, w)),
    ):
        (tmp_path / name).mkdir()
        write_safetensors(tmp_path / name / "model.safetensors", {"x.weight": t})
    fa, fb, fc = (open_pack(tmp_path / n).fingerprint() for n in "abc")
    assert fa == fb and fa != fc
