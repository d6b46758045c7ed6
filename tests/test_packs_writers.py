"""Pack writers: write_native round-trips exactly; write_gguf gives the bytes llama.cpp's own quantizer gives, re-opens
in our reader, and (SmolLM2) loads and runs in llama.cpp."""
from __future__ import annotations

import ctypes
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import gguf
from fidelity.errors import PackError
from fidelity.packs import open_pack
from fidelity.packs.writers import quantize_array, write_gguf, write_native
from testkit.raw_gguf import write_gguf_tensors

LEGACY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
FILE_TYPES = LEGACY + ["Q6_K", "Q4_K_M", "Q2_K"]


def tiny_llama(root: Path, seed: int, *, hidden=320, n_head=5, n_kv=1, inter=512, layers=8, vocab=512,
               tied=False, moe_experts=0) -> Path:
    """A native fp32 pack with random weights: llama (hidden 320 is not a 256 multiple, so K-quants fall back
    where llama.cpp falls back) or, with moe_experts, qwen3_moe."""
    g = torch.Generator().manual_seed(seed)
    head_dim = hidden // n_head

    def w(*shape):
        scale = torch.rand(shape[0], 1, generator=g) * 0.2 + 0.01 if len(shape) == 2 else 1.0
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    t = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=g)}
    if not tied:
        t["lm_head.weight"] = w(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
              p + "post_attention_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
              p + "self_attn.q_proj.weight": w(n_head * head_dim, hidden),
              p + "self_attn.k_proj.weight": w(n_kv * head_dim, hidden),
              p + "self_attn.v_proj.weight": w(n_kv * head_dim, hidden),
              p + "self_attn.o_proj.weight": w(hidden, n_head * head_dim)}
        if moe_experts:
            t[p + "mlp.gate.weight"] = w(moe_experts, hidden)
            t[p + "self_attn.q_norm.weight"] = 1 + 0.1 * torch.randn(head_dim, generator=g)
            t[p + "self_attn.k_norm.weight"] = 1 + 0.1 * torch.randn(head_dim, generator=g)
            for e in range(moe_experts):
                t |= {p + f"mlp.experts.{e}.gate_proj.weight": w(inter, hidden),
                      p + f"mlp.experts.{e}.up_proj.weight": w(inter, hidden),
                      p + f"mlp.experts.{e}.down_proj.weight": w(hidden, inter)}
        else:
            t |= {p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
                  p + "mlp.down_proj.weight": w(hidden, inter)}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": n_head,
              "num_key_value_heads": n_kv, "head_dim": head_dim, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "max_position_embeddings": 2048, "vocab_size": vocab, "tie_word_embeddings": tied,
              "torch_dtype": "float32"}
    if moe_experts:
        config |= {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": moe_experts,
                   "num_experts_per_tok": 2, "moe_intermediate_size": inter}
    root.mkdir(parents=True, exist_ok=True)
    save_file(t, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(config))
    return root


# -- write_native ---------------------------------------------------------------------------------------------------
def test_write_native_round_trips_a_gguf_pack_exactly(tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    hp = {"block_count": 1, "context_length": 512, "embedding_length": 256, "feed_forward_length": 96,
          "attention.head_count": 4, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-6,
          "rope.freq_base": 1e6, "vocab_size": 100}
    rows = {"token_embd.weight": (100, 256, "Q8_0"), "blk.0.ffn_up.weight": (96, 256, "Q4_K"),
            "blk.0.ffn_down.weight": (256, 96, "Q5_1"), "blk.0.attn_norm.weight": (None, 256, "F32")}
    tensors = {}
    for name, (r, c, q) in rows.items():
        x = rng.standard_normal((r, c) if r else (c,)).astype(np.float32)
        tensors[name] = (quantize_array(x, q) if q != "F32" else x, q)
    src = open_pack(write_gguf_tensors(tmp_path / "src.gguf", "qwen3", hp, tensors))
    out = write_native(src, tmp_path / "native", max_shard_bytes=60_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2 and set(index["weight_map"]) == set(src.names())
    native = open_pack(out)
    assert native.format == "native" and sorted(native.names()) == sorted(src.names())
    for name in src.names():
        assert torch.equal(native.tensor(name), src.tensor(name)), name
    assert json.loads((out / "config.json").read_text()) == src.config
    assert not (out / "tokenizer.json").exists()  # the source has no tokenizer

    half = open_pack(write_native(src, tmp_path / "bf16", dtype=torch.bfloat16))
    assert half.storage("model.embed_tokens.weight").dtype == "BF16" and half.config["torch_dtype"] == "bfloat16"
    for name in src.names():
        assert torch.equal(half.tensor(name), src.tensor(name).to(torch.bfloat16).float()), name


def test_write_native_refuses_int_dtype(tmp_path):
    src = open_pack(tiny_llama(tmp_path / "m", 0, layers=1, vocab=16))
    with pytest.raises(PackError) as e:
        write_native(src, tmp_path / "x", dtype=torch.int8)
    assert "int8" in str(e.value) and str(tmp_path / "x") in str(e.value)


# -- write_gguf -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("moe", [0, 3])
def test_write_gguf_f32_round_trips_names_rows_and_config_exactly(tmp_path, rng_seed, moe):
    src = open_pack(tiny_llama(tmp_path / "m", rng_seed, layers=2, vocab=64, moe_experts=moe, tied=bool(moe)))
    back = open_pack(write_gguf(src, tmp_path / "f32.gguf", "F32"))
    names = set(src.names()) - ({"lm_head.weight"} if src.config["tie_word_embeddings"] else set())
    assert set(back.names()) == names
    for name in names:  # F32 everywhere: exact, so the Q/K permutation and its inverse agree
        assert torch.equal(back.tensor(name), src.tensor(name)), name
    for key, value in src.config.items():
        if key not in ("architectures",):
            assert back.config[key] == pytest.approx(value), key


def test_write_gguf_carries_llama3_rope_scaling(tmp_path, rng_seed):
    root = tiny_llama(tmp_path / "m", rng_seed, layers=1, vocab=32)
    cfg = json.loads((root / "config.json").read_text())
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    (root / "config.json").write_text(json.dumps(cfg | {"rope_theta": 500000.0, "rope_scaling": scaling}))
    back = open_pack(write_gguf(open_pack(root), tmp_path / "r.gguf", "Q8_0"))
    assert back.config["rope_scaling"] == scaling and "rope_freqs.weight" in back.skipped


@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_K_M", "Q2_K", "IQ4_XS"])
def test_write_gguf_reopens_to_the_reference_dequantization(tmp_path, rng_seed, ftype):
    src = open_pack(tiny_llama(tmp_path / "m", rng_seed, hidden=256, n_head=4, layers=2, vocab=64))
    path = write_gguf(src, tmp_path / "q.gguf", ftype)
    back = open_pack(path)
    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    for name in back.names():
        stored = by_name[back.storage(name).raw[0]]
        source = src.tensor(name)
        # rows move intact under the Q/K permutation, so quantizing commutes with it: the re-opened tensor is the
        # quantize -> gguf-py dequantize round trip of the source rows
        qtype = stored.tensor_type
        want = source if qtype.name == "F32" else torch.from_numpy(np.array(
            gguf.quants.dequantize(quantize_array(source.numpy(), qtype.name), qtype), dtype=np.float32))
        assert torch.equal(back.tensor(name), want.reshape(source.shape)), name
    kinds = {back.storage(n).dtype for n in back.names()}
    assert {"Q8_0": {"Q8_0"}, "Q4_K_M": {"Q4_K", "Q6_K"}, "Q2_K": {"Q2_K", "Q3_K"}, "IQ4_XS": {"IQ4_XS"}}[
        ftype
    ] <= kinds


def test_write_gguf_bad_requests_name_what_is_wrong(tmp_path):
    src = open_pack(tiny_llama(tmp_path / "m", 0, layers=1, vocab=16))
    with pytest.raises(PackError, match="Q9_9"):
        write_gguf(src, tmp_path / "x.gguf", "Q9_9")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg | {"model_type": "gpt_neox"}))
    with pytest.raises(PackError) as e:
        write_gguf(open_pack(tmp_path / "m"), tmp_path / "x.gguf", "Q8_0")
    assert "gpt_neox" in str(e.value) and str(tmp_path / "m") in str(e.value)


def _llama_cpp_quantize(src: Path, dst: Path, ftype: str):
    llama_cpp = pytest.importorskip("llama_cpp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 1
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) == 0


def _same_bytes(a: Path, b: Path) -> list[str]:
    ta = {t.name: t for t in gguf.GGUFReader(a).tensors}
    tb = {t.name: t for t in gguf.GGUFReader(b).tensors}
    assert set(ta) == set(tb)
    return [n for n in ta if ta[n].tensor_type != tb[n].tensor_type
            or not np.array_equal(np.asarray(ta[n].data), np.asarray(tb[n].data))]


@pytest.mark.parametrize("ftype", [pytest.param(f, marks=pytest.mark.slow) if f in ("Q4_0", "Q5_0", "Q5_1") else f
                                   for f in FILE_TYPES])
def test_write_gguf_equals_llama_cpp_quantize_byte_for_byte(tmp_path, rng_seed, ftype):
    pytest.importorskip("llama_cpp")
    src = open_pack(tiny_llama(tmp_path / "m", rng_seed))
    f32 = write_gguf(src, tmp_path / "f32.gguf", "F32")
    _llama_cpp_quantize(f32, tmp_path / "ref.gguf", ftype)
    ours = write_gguf(src, tmp_path / "ours.gguf", ftype)
    assert _same_bytes(tmp_path / "ref.gguf", ours) == []


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q2_K"])
def test_write_gguf_qwen3moe_equals_llama_cpp_quantize(tmp_path, rng_seed, ftype):
    pytest.importorskip("llama_cpp")
    src = open_pack(tiny_llama(tmp_path / "m", rng_seed, hidden=256, n_head=4, n_kv=2, inter=256, layers=8,
                               vocab=256, moe_experts=4))
    f32 = write_gguf(src, tmp_path / "f32.gguf", "F32")
    _llama_cpp_quantize(f32, tmp_path / "ref.gguf", ftype)
    assert _same_bytes(tmp_path / "ref.gguf", write_gguf(src, tmp_path / "ours.gguf", ftype)) == []


# -- the real model -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_native(smollm2_gguf, tmp_path_factory):
    pack = open_pack(smollm2_gguf)
    return pack, open_pack(write_native(pack, tmp_path_factory.mktemp("smollm2") / "native"))


@pytest.mark.slow
def test_smollm2_q4_1_requantization_reproduces_the_original_file(smollm2_native, smollm2_gguf, tmp_path):
    _, native = smollm2_native
    ours = write_gguf(native, tmp_path / "q4_1.gguf", "Q4_1")
    assert _same_bytes(smollm2_gguf, ours) == []  # weights sit on the Q4_1 grid (and the Q8_0 embedding on its own)


@pytest.mark.slow
@pytest.mark.parametrize("ftype", ["F32", "Q4_K_M"])
def test_smollm2_gguf_loads_and_runs_in_llama_cpp(smollm2_native, tmp_path, ftype):
    llama_cpp = pytest.importorskip("llama_cpp")
    from transformers import AutoModelForCausalLM
    from fidelity.packs.tokenizer import load_tokenizer

    gguf_pack, native = smollm2_native
    path = write_gguf(native, tmp_path / f"{ftype}.gguf", ftype, tokenizer_pre="smollm")
    back = open_pack(path)
    assert set(back.names()) == set(native.names()) and back.config == native.config

    # llama.cpp on the GGUF vs transformers on exactly the weights our reader decodes from it
    model = AutoModelForCausalLM.from_pretrained(str(native.path), dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict({n: back.tensor(n) for n in back.names()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    llm = llama_cpp.Llama(str(path), n_ctx=128, logits_all=True, verbose=False)
    text = "<|im_start|>user\nName three colours of the French flag.<|im_end|>\n<|im_start|>assistant\n"
    ids = load_tokenizer(native)(text)["input_ids"]
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids
    llm.eval(ids)
    theirs = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
    with torch.no_grad():
        ours = model(torch.tensor([ids])).logits[0]
    p, q = torch.log_softmax(ours, -1), torch.log_softmax(theirs, -1)
    kl = (p.exp() * (p - q)).sum(-1)
    print(f"{ftype}: max |dlogit| {(ours - theirs).abs().max():.4f}, max KL {kl.max():.2e}, "
          f"top-1 agreement {(ours.argmax(-1) == theirs.argmax(-1)).float().mean():.3f}")
    if ftype == "F32":  # same weights, float compute on both sides: names, Q/K rows and metadata all right
        assert kl.max() < 1e-4 and bool((ours.argmax(-1) == theirs.argmax(-1)).all())
    else:  # llama.cpp rounds activations to 8 bits for quantized dot products (the original Q4_1 file: KL ~1e-2)
        assert kl.max() < 0.05 and (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.9
    assert back.reader.fields["tokenizer.chat_template"].contents() == gguf_pack.metadata_chat_template


def _save_tokenizer(root: Path, kind: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "the quick brown fox jumps over the lazy dog",
        "pack fidelity: 4-bit grids drift",
        "KL divergence 0.013",
    ] * 20
    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|end|>", "<|user|>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    else:
        tok = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>" if kind == "bpe" else None)
    fast.chat_template = "{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
    fast.save_pretrained(str(root))


def test_write_gguf_builds_tokenizer_metadata_transformers_reads_back(tmp_path, rng_seed):
    from transformers import AutoTokenizer
    from fidelity.packs.tokenizer import load_tokenizer

    root = tiny_llama(tmp_path / "m", rng_seed, layers=1, vocab=300)
    _save_tokenizer(root, "bpe")
    src = open_pack(root)
    path = write_gguf(src, tmp_path / "t.gguf", "Q8_0")
    from_gguf = load_tokenizer(open_pack(path))
    want = AutoTokenizer.from_pretrained(str(root))
    text = "the lazy fox: 4-bit drift, KL 0.013 <|user|>"
    assert from_gguf(text)["input_ids"] == want(text)["input_ids"]
    assert from_gguf.chat_template == want.chat_template
    reader = gguf.GGUFReader(path)
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert reader.fields["tokenizer.ggml.eos_token_id"].contents() == want.eos_token_id


def test_write_gguf_refuses_non_byte_level_tokenizers(tmp_path):
    root = tiny_llama(tmp_path / "m", 0, layers=1, vocab=16)
    _save_tokenizer(root, "wordlevel")
    with pytest.raises(PackError) as e:
        write_gguf(open_pack(root), tmp_path / "t.gguf", "Q8_0")
    assert str(root / "tokenizer.json") in str(e.value) and "tokenizer_from" in str(e.value)


# -- tokenizer ------------------------------------------------------------------------------------------------------
def test_load_tokenizer_without_tokenizer_names_the_pack(tmp_path):
    from fidelity.packs.tokenizer import load_tokenizer

    folder = open_pack(tiny_llama(tmp_path / "m", 0, layers=1, vocab=16))
    with pytest.raises(PackError) as e:
        load_tokenizer(folder)
    assert "tokenizer" in str(e.value) and str(tmp_path / "m") in str(e.value)
    bare = open_pack(write_gguf(folder, tmp_path / "bare.gguf", "Q8_0"))  # no tokenizer metadata to carry
    with pytest.raises(PackError) as e:
        load_tokenizer(bare)
    assert str(tmp_path / "bare.gguf") in str(e.value)
