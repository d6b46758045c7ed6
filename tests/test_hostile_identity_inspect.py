"""Hostile inputs to a pack's identity, to `inspect`, to GGUF headers and to a folder without config.json (issue 41,
defects 2, 9 and 10): an in-place edit that restores size and mtime, a pack missing a tensor its architecture needs,
tensor counts and dimensions no file can hold, `compare --truncate`."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import fidelity.content_hash as content_hash
from fidelity import PackError, open_pack
from fidelity.pack_settings import PackSettings
from fidelity.packs.safetensors_io import SafetensorsFile, write_safetensors
from test_packs_bad_input import CFG, llama_tensors


# -- defect 2: a pack edited in place keeps its identity --------------------------------------------------------------
@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The content-hash folder: passed to the library, and the command line's (FIDELITY_CACHE)."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("FIDELITY_CACHE", str(folder))
    return folder / "content-hash"


def edit_in_place(path: Path, offset: int, byte: int) -> None:
    """Write one byte at `offset`, then put size and mtime back as `rsync --inplace -t` / `touch -r` do."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes([byte]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)


def fresh_digest(path: Path) -> str:
    """BLAKE3 of every byte, by the blake3 package directly (no cache)."""
    from blake3 import blake3
    return blake3(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("racy_ns", [0, content_hash.RACY_NS], ids=["cached", "fresh-file"])
def test_a_byte_edited_in_place_with_size_and_mtime_restored_changes_the_fingerprint(tmp_path, cache, monkeypatch,
                                                                                   rng_seed, racy_ns):
    """A real pack: one byte of one tensor changed, size and mtime restored (os.utime with ns). `cached`: the first
    fingerprint was cached (no racy window), so the entry's ctime must expose the edit; `fresh-file`: the default
    window, where a file changed this recently is not cached at all."""
    monkeypatch.setattr(content_hash, "RACY_NS", racy_ns)
    g = torch.Generator().manual_seed(rng_seed)
    write_safetensors(tmp_path / "model.safetensors", {k: torch.randn(v.shape, generator=g)
                                                       for k, v in llama_tensors().items()})
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    shard = tmp_path / "model.safetensors"
    before = open_pack(tmp_path, PackSettings(hash_cache=cache)).fingerprint()
    assert len(list(cache.glob("*.json"))) == (1 if racy_ns == 0 else 0)
    info = SafetensorsFile(shard).info("model.layers.1.self_attn.k_proj.weight")
    offset = int(torch.randint(info.begin, info.end, (1,), generator=g))
    old = shard.read_bytes()[offset]
    time.sleep(0.05)   # past the filesystem's timestamp tick: the edit gets a ctime of its own
    edit_in_place(shard, offset, old ^ 0x40)
    pack = open_pack(tmp_path, PackSettings(hash_cache=cache))
    assert pack.fingerprint() != before
    assert content_hash.file_digest(shard, cache_dir=cache) == fresh_digest(shard)


def test_a_cache_entry_whose_sampled_blocks_differ_is_not_trusted(tmp_path, cache, monkeypatch, rng_seed):
    """Where the key cannot show an edit (a filesystem whose ctime was set back: simulated by moving the old entry to
    the edited file's key), the sampled blocks checked on every hit do: a byte in the tail block changed."""
    monkeypatch.setattr(content_hash, "RACY_NS", 0)
    rng = np.random.default_rng(rng_seed)
    path = tmp_path / "blob.bin"
    path.write_bytes(rng.integers(0, 256, 3 * content_hash.SAMPLE_BLOCKS * content_hash.SAMPLE_BYTES + 17,
                                  dtype=np.uint8).tobytes())
    first = content_hash.file_digest(path, cache_dir=cache)
    (old_entry,) = cache.glob("*.json")
    time.sleep(0.05)
    offset = path.stat().st_size - 1 - int(rng.integers(0, 100))
    edit_in_place(path, offset, path.read_bytes()[offset] ^ int(rng.integers(1, 256)))
    key, ident = content_hash._version_key(path, "blake3")
    forged = {**json.loads(old_entry.read_text()), **ident}
    (cache / f"{key}.json").write_text(json.dumps(forged))
    assert content_hash.file_digest(path, cache_dir=cache) == fresh_digest(path) != first


def test_a_file_changed_within_the_racy_window_is_not_cached(tmp_path, cache, rng_seed):
    path = tmp_path / "new.bin"
    path.write_bytes(os.urandom(1000))
    assert content_hash.file_digest(path, cache_dir=cache) == fresh_digest(path)
    assert not cache.exists() or not list(cache.glob("*.json"))


@pytest.mark.slow
def test_compare_out_measures_a_pack_edited_in_place_instead_of_reusing_its_kept_pass(tmp_path_factory, smollm2_gguf,
                                                                                    tmp_path, cache, monkeypatch):
    """`compare --out` twice into one folder, one byte of the pack's model.norm.weight changed in between with size and
    mtime restored: the second run measures the edited bytes (its numbers are a fresh run's on them), it does not read
    back the first run's pass. No racy window: the pack is cached as one written long ago would be."""
    from fidelity.cli import main
    from fidelity.panels.panel import PanelRow, write_panel
    from test_compare import noisy_packs, tiny_setting

    monkeypatch.setattr(content_hash, "RACY_NS", 0)
    root, tok, gen = tiny_setting(tmp_path_factory, smollm2_gguf, "edited")
    _, _, packs = noisy_packs(root, tok, gen, {"small": 0.01})
    panel = write_panel(
        root / "panel",
        [
            PanelRow("t1", "text", text="The river flows through the old town to the sea."),
            PanelRow("t2", "text", text="def square(x):\n    return x * x\n"),
        ],
        name="edit-test",
    ).path

    def run(out: Path, json_path: Path) -> dict:
        assert main(["compare", str(packs["ref"]), str(packs["small"]), "--panel", str(panel), "--out", str(out),
                     "--json", str(json_path), "--no-noise-floor", "--bootstrap", "50"]) == 0
        return json.loads(json_path.read_text())

    first = run(tmp_path / "out", tmp_path / "first.json")
    shard = packs["small"] / "model.safetensors"
    info = SafetensorsFile(shard).info("model.norm.weight")
    element = int(torch.randint(0, (info.end - info.begin) // 4, (1,), generator=gen))
    time.sleep(0.05)
    edit_in_place(shard, info.begin + 4 * element + 3, 0x43)   # the element's sign and exponent: |w| in [128, 512)
    second = run(tmp_path / "out", tmp_path / "second.json")
    monkeypatch.setenv("FIDELITY_CACHE", str(tmp_path / "other-cache"))
    fresh = run(tmp_path / "fresh-out", tmp_path / "fresh.json")

    (r1,), (r2,), (r3,) = first["results"], second["results"], fresh["results"]
    assert r2["fingerprint"] != r1["fingerprint"] and r2["fingerprint"] == r3["fingerprint"]
    assert second["resumed"] == ["reference"]                   # the reference's kept store, not the pack's old pass
    assert r2["overall"] == r3["overall"] and r2["overall"]["kld_mean"] > 10 * r1["overall"]["kld_mean"]


# -- defect 10: GGUF header counts no file can hold -------------------------------------------------------------------
@pytest.fixture
def gguf_bytes(tmp_path, rng_seed):
    from test_gguf_file import random_gguf
    path = random_gguf(tmp_path / "r.gguf", np.random.default_rng(rng_seed))
    return path.read_bytes()


def gguf_error(tmp_path, data: bytes) -> str:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    with pytest.raises(PackError) as e:
        open_pack(bad)
    assert e.value.file == str(bad) and str(bad) in str(e.value)
    assert "a string of" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("count", [2**40, 2**64 - 1])
def test_a_tensor_count_no_file_can_hold_is_named(tmp_path, gguf_bytes, count):
    msg = gguf_error(tmp_path, gguf_bytes[:8] + count.to_bytes(8, "little") + gguf_bytes[16:])
    assert f"tensor count {count} (at byte 8)" in msg


def test_a_metadata_count_no_file_can_hold_is_named(tmp_path, gguf_bytes):
    msg = gguf_error(tmp_path, gguf_bytes[:16] + (2**40).to_bytes(8, "little") + gguf_bytes[24:])
    assert f"metadata key/value count {2**40} (at byte 16)" in msg


@pytest.mark.parametrize("n_dims", [5, 1000, 2**32 - 1])
def test_a_tensor_of_too_many_dimensions_is_named(tmp_path, gguf_bytes, n_dims):
    name = b"blk.2.tQ8_0"
    at = gguf_bytes.rfind(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    assert int.from_bytes(gguf_bytes[at:at + 4], "little") == 2
    msg = gguf_error(tmp_path, gguf_bytes[:at] + n_dims.to_bytes(4, "little") + gguf_bytes[at + 4:])
    assert f"tensor 'blk.2.tQ8_0': n_dims {n_dims} (at byte {at})" in msg


def test_an_array_length_no_file_can_hold_names_the_key(tmp_path, gguf_bytes):
    key = b"t.floats"
    at = gguf_bytes.find(len(key).to_bytes(8, "little") + key) + 8 + len(key) + 4 + 4   # past value type, element type
    assert int.from_bytes(gguf_bytes[at:at + 8], "little") == 77
    msg = gguf_error(tmp_path, gguf_bytes[:at] + (2**40).to_bytes(8, "little") + gguf_bytes[at + 8:])
    assert f"metadata key 't.floats': array length {2**40} (at byte {at})" in msg


# -- defect 9: inspect checks the tensors the architecture needs ------------------------------------------------------
def inspect_json(folder: Path) -> tuple[int, dict]:
    from fidelity.cli import main
    rc = main(["inspect", str(folder), "--json", str(folder.parent / f"{folder.name}.json")])
    return rc, json.loads((folder.parent / f"{folder.name}.json").read_text())


def test_inspect_names_a_missing_k_proj_and_compare_fails_on_the_same_tensor(tmp_path):
    from fidelity.oracle import Oracle
    tensors = llama_tensors()
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    write_safetensors(tmp_path / "model.safetensors", tensors)
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    rc, rep = inspect_json(tmp_path)
    assert rc == 1 and rep["problems"] == ["model.layers.1.self_attn.k_proj.weight: absent, and the LlamaForCausalLM "
                                           "oracle loads it"]
    assert rep["required_tensors"] == {"checked": len(llama_tensors()), "missing": 1, "not_checked": None}
    with pytest.raises(PackError) as e:
        Oracle(open_pack(tmp_path))
    assert e.value.tensor == "model.layers.1.self_attn.k_proj.weight"


@pytest.mark.parametrize("tied", [False, True])
def test_inspect_names_the_absent_head_of_untied_embeddings(tmp_path, tied):
    tensors = llama_tensors()
    del tensors["lm_head.weight"]
    write_safetensors(tmp_path / "model.safetensors", tensors)
    (tmp_path / "config.json").write_text(json.dumps({**CFG, "tie_word_embeddings": tied}))
    rc, rep = inspect_json(tmp_path)
    if tied:   # the head is the embedding: nothing is missing
        assert rc == 0 and rep["problems"] == [] and rep["required_tensors"]["missing"] == 0
    else:
        assert rc == 1 and rep["problems"] == ["lm_head.weight: absent, and the LlamaForCausalLM oracle loads it"]


def test_inspect_of_an_architecture_without_an_oracle_family_says_it_did_not_check(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", {"x.weight": torch.randn(4, 4)})
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"]}))
    rc, rep = inspect_json(tmp_path)
    assert rc == 0 and rep["required_tensors"]["checked"] is None
    assert "GPTNeoXForCausalLM" in rep["required_tensors"]["not_checked"]


HF_FAMILIES = {  # test_oracle's tiny configurations of each family: (dense or MoE table, case)
    "llama": ("DENSE", "llama-llama3-untied-bias"), "qwen3": ("DENSE", "qwen3-qknorm-default"),
    "qwen3moe": ("MOE", "qwen3moe-renorm-sparse-step"), "mixtral": ("MOE", "mixtral"),
    "deepseek-v3": ("MOE", "deepseek-v3-qlora-yarn"),
}


@pytest.mark.parametrize("family", sorted(HF_FAMILIES))
def test_inspect_finds_any_one_tensor_removed_from_a_transformers_checkpoint(tmp_path, rng_seed, family):
    """A tiny random model saved by transformers (its own list of what the architecture stores), one tensor chosen at
    random removed: inspect names exactly that one; the full checkpoint has no problem."""
    import test_oracle
    from safetensors.torch import load_file, save_file

    table, case = HF_FAMILIES[family]
    make = test_oracle.make if table == "DENSE" else test_oracle.make_moe
    make(tmp_path, case, rng_seed)
    folder = tmp_path / case
    rc, rep = inspect_json(folder)
    assert rc == 0 and rep["problems"] == [] and rep["required_tensors"]["missing"] == 0
    tensors = load_file(folder / "model.safetensors")
    assert rep["required_tensors"]["checked"] == len(tensors)
    victim = sorted(tensors)[torch.randint(0, len(tensors), (1,)).item()]
    del tensors[victim]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    rc, rep = inspect_json(folder)
    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    assert rc == 1 and rep["problems"] == [f"{victim}: absent, and the {arch} oracle loads it"]


def test_inspect_finds_any_one_tensor_removed_from_the_deepseek_v4_fixture(tmp_path, rng_seed):
    """DeepSeek-V4 in its official names (tests/fixtures/v4/tiny_v4, written by transformers then renamed): one tensor
    chosen at random removed, inspect names it."""
    import shutil
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "tiny_v4"
    shutil.copytree(Path(__file__).parent / "fixtures" / "v4" / "tiny_v4", folder)
    tensors = load_file(folder / "model.safetensors")
    victim = sorted(tensors)[torch.randint(0, len(tensors), (1,)).item()]
    del tensors[victim]
    save_file(tensors, folder / "model.safetensors")
    rc, rep = inspect_json(folder)
    assert rc == 1 and rep["problems"] == [f"{victim}: absent, and the DeepseekV4ForCausalLM oracle loads it"]
    assert rep["required_tensors"]["checked"] == len(tensors) + 1


# -- defect 10: a missing config.json ---------------------------------------------------------------------------------
def test_a_folder_without_config_json_is_named_as_missing_it(tmp_path):
    from fidelity.errors import ConfigError
    from fidelity.oracle import Oracle
    write_safetensors(tmp_path / "model.safetensors", llama_tensors())
    with pytest.raises(ConfigError, match=rf"the folder {tmp_path} has no config\.json") as e:
        Oracle(open_pack(tmp_path))
    assert "names no architecture" not in str(e.value)
    rc, rep = inspect_json(tmp_path)
    assert f"the folder {tmp_path} has no config.json" in rep["required_tensors"]["not_checked"]
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 50}))   # present, but naming no architecture
    with pytest.raises(ConfigError, match=r"config\.json names no architecture"):
        Oracle(open_pack(tmp_path))


# -- defect 10: compare --truncate leaves its mark --------------------------------------------------------------------
@pytest.mark.slow
def test_compare_truncate_is_recorded_in_the_json_markdown_and_kept_passes(tmp_path_factory, smollm2_gguf, tmp_path):
    """Rows longer than max_position_embeddings (8 here) cut by --truncate: the JSON's panel block says so, with the
    rows and tokens cut counted from the tokenizer's own lengths; the kept passes' identity carries the same record."""
    from fidelity.cli import main
    from fidelity.panels.panel import PanelRow, write_panel
    from test_compare import noisy_packs, tiny_setting

    root, tok, gen = tiny_setting(tmp_path_factory, smollm2_gguf, "truncate")
    _, _, packs = noisy_packs(root, tok, gen, {"small": 0.01})
    context = 8
    for name in ("ref", "small"):
        cfg = json.loads((packs[name] / "config.json").read_text())
        (packs[name] / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": context}))
    texts = {"long1": "The river flows through the old town towards the sea, past the mill and the bridge.",
             "short": "Red and blue.", "long2": "def square(x):\n    return x * x\n\nprint(square(12))\n"}
    panel = write_panel(root / "panel", [PanelRow(i, "text", text=t) for i, t in texts.items()], name="trunc").path
    lengths = {i: len(tok(t, add_special_tokens=True)["input_ids"]) for i, t in texts.items()}
    long = [i for i in texts if lengths[i] > context]
    assert long == ["long1", "long2"] and lengths["short"] <= context

    args = ["compare", str(packs["ref"]), str(packs["small"]), "--panel", str(panel), "--no-noise-floor",
            "--bootstrap", "50", "--out", str(tmp_path / "out"), "--json", str(tmp_path / "r.json"),
            "--markdown", str(tmp_path / "r.md")]
    assert main(args) == 2                                      # without --truncate: refused, nothing measured
    assert "'long1' (text) is" in json.loads((tmp_path / "r.json").read_text())["error"]
    assert main(args + ["--truncate"]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    cut = sum(lengths[i] - context for i in long)
    want = {"enabled": True, "max_len": context, "rows_cut": 2, "tokens_cut": cut, "scored_tokens_cut": cut,
            "row_ids": long}
    assert report["panel"]["truncation"] == want
    assert report["panel"]["scored_positions"] == 2 * (context - 1) + lengths["short"] - 1
    assert f"--truncate cut 2 row(s) to {context} tokens: {cut} tokens ({cut} scored) not measured" in \
        (tmp_path / "r.md").read_text()
    done = [json.loads(p.read_text()) for p in (tmp_path / "out" / "passes").glob("*.done.json")]
    assert len(done) == 2 and all(d["truncation"] == want for d in done)
