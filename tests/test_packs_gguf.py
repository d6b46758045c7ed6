"""GGUF packs: every writable GGML type decodes bit-exactly like gguf-py; names, Q/K rows and config like transformers'
GGUF loader; the real SmolLM2 GGUF written out as a native fp32 pack equals transformers' own GGUF load."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gguf
from fidelity.errors import PackError
from fidelity.packs import open_pack
from fidelity.packs.gguf import supported_types
from fidelity.packs.writers import quantize_array
from testkit.raw_gguf import write_gguf_tensors

HPARAMS = {"block_count": 2, "context_length": 4096, "embedding_length": 64, "feed_forward_length": 96,
           "attention.head_count": 4, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-6,
           "rope.freq_base": 1000000.0, "vocab_size": 1000}


def _block(qtype: str) -> int:
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]


def _random_rows(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    # a spread of magnitudes per row and a few outliers, so scales, mins and sub-block scales all vary
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 3.0, (rows, 1)).astype(np.float32)
    w[rng.random(w.shape) < 0.01] *= 20
    return w


def test_every_dequantizable_type_is_writable():
    writable = {t for t in supported_types()}
    assert {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M",
            "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "MXFP4", "TQ1_0", "TQ2_0",
            "BF16", "F16", "F32"} <= writable


# llama.cpp's IQ1/IQ2 quantizers build large search tables on first use (seconds each): run those with the slow set
_SLOW_TO_QUANTIZE = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S"}


@pytest.mark.parametrize("qtype", [pytest.param(t, marks=pytest.mark.slow) if t in _SLOW_TO_QUANTIZE else t
                                   for t in sorted(supported_types())])
def test_type_decodes_bit_exact_to_gguf_py(tmp_path, rng_seed, qtype):
    rng = np.random.default_rng(rng_seed)
    block = _block(qtype)
    rows = int(rng.integers(3, 40)) | 1          # odd row counts: no format needs rows in blocks
    cols = block * int(rng.integers(1, 4)) if block > 1 else int(rng.integers(5, 70))
    w = _random_rows(rng, rows, cols)
    stored = quantize_array(w, qtype) if qtype != "F16" else w.astype(np.float16)
    norm = rng.standard_normal(cols).astype(np.float32)
    path = write_gguf_tensors(tmp_path / "t.gguf", "qwen3", HPARAMS,
                              {"blk.1.ffn_down.weight": (stored, qtype), "blk.1.ffn_norm.weight": (norm, "F32")})
    pack = open_pack(path)
    assert pack.format == "gguf"
    got = pack.tensor("model.layers.1.mlp.down_proj.weight")
    reference = torch.from_numpy(np.array(gguf.quants.dequantize(stored, gguf.GGMLQuantizationType[qtype]),
                                          dtype=np.float32))
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert torch.equal(got, reference), f"max |d| {(got - reference).abs().max()}"
    assert torch.equal(pack.tensor("model.layers.1.post_attention_layernorm.weight"), torch.from_numpy(norm))
    s = pack.storage("model.layers.1.mlp.down_proj.weight")
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    assert s.dtype == qtype and s.shape == (rows, cols) and s.nbytes == stored.nbytes
    assert s.bits == pytest.approx(8 * type_size / block_size)


def test_llama_q_k_rows_unpermuted_as_transformers_does(tmp_path, rng_seed):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rng = np.random.default_rng(rng_seed)
    n_head, n_kv, head_dim, hidden = 4, 2, 16, 64
    q = _random_rows(rng, n_head * head_dim, hidden)
    k_bytes = quantize_array(_random_rows(rng, n_kv * head_dim, hidden), "Q8_0")
    path = write_gguf_tensors(tmp_path / "l.gguf", "llama", HPARAMS | {"rope.dimension_count": head_dim},
                              {"blk.0.attn_q.weight": (q, "F32"), "blk.0.attn_k.weight": (k_bytes, "Q8_0")})
    pack = open_pack(path)
    hf = LlamaTensorProcessor(config={"num_attention_heads": n_head, "num_key_value_heads": n_kv})
    want_q = hf.process(q, "blk.0.attn_q.weight").weights
    want_k = hf.process(gguf.quants.dequantize(k_bytes, gguf.GGMLQuantizationType.Q8_0), "blk.0.attn_k.weight").weights
    assert not np.array_equal(want_q, q)  # the permutation is not the identity for these shapes
    assert torch.equal(
        pack.tensor("model.layers.0.self_attn.q_proj.weight"), torch.from_numpy(np.ascontiguousarray(want_q))
    )
    assert torch.equal(
        pack.tensor("model.layers.0.self_attn.k_proj.weight"), torch.from_numpy(np.ascontiguousarray(want_k))
    )


def test_qwen3moe_experts_split_one_tensor_each(tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    n_exp, inter, hidden = 3, 5, 256
    stacked = np.stack([_random_rows(rng, inter, hidden) for _ in range(n_exp)])
    stored = quantize_array(stacked, "Q4_K")
    router = rng.standard_normal((n_exp, hidden)).astype(np.float32)
    path = write_gguf_tensors(
        tmp_path / "m.gguf",
        "qwen3moe",
        HPARAMS | {"expert_count": n_exp, "expert_used_count": 2, "expert_feed_forward_length": inter},
        {"blk.0.ffn_gate_exps.weight": (stored, "Q4_K"), "blk.0.ffn_gate_inp.weight": (router, "F32")},
    )
    pack = open_pack(path)
    reference = gguf.quants.dequantize(stored, gguf.GGMLQuantizationType.Q4_K)
    for e in range(n_exp):
        name = f"model.layers.0.mlp.experts.{e}.gate_proj.weight"
        assert torch.equal(pack.tensor(name), torch.from_numpy(np.array(reference[e])))
        assert pack.storage(name).nbytes * n_exp == stored.nbytes
    assert torch.equal(pack.tensor("model.layers.0.mlp.gate.weight"), torch.from_numpy(router))
    c = pack.config
    assert (c["model_type"], c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]) == \
        ("qwen3_moe", n_exp, 2, inter)
    assert pack.bits_per_weight()["routed_experts"]["bpw"] == pytest.approx(4.5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe"])
def test_config_agrees_with_transformers_gguf_config(tmp_path, rng_seed, arch):
    from transformers import AutoConfig

    rng = np.random.default_rng(rng_seed)
    n_kv = int(rng.choice([1, 2, 4]))
    hp = HPARAMS | {
        "block_count": int(rng.integers(1, 40)),
        "context_length": int(rng.choice([2048, 32768])),
        "feed_forward_length": int(rng.integers(64, 4096)),
        "attention.head_count_kv": n_kv,
        "attention.layer_norm_rms_epsilon": float(rng.choice([1e-5, 1e-6])),
        "rope.freq_base": float(rng.choice([10000.0, 500000.0])),
        "vocab_size": int(rng.integers(100, 200000)),
    }
    if arch in ("qwen3", "qwen3moe"):  # Qwen3 head_dim is not hidden/heads in general; llama.cpp stores it
        hp |= {"attention.key_length": 24, "attention.value_length": 24}
    if arch == "qwen3moe":
        hp |= {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32}
    if arch == "llama":
        hp |= {"rope.dimension_count": 16}
    tensors = {"output.weight": (np.zeros((7, 64), np.float32), "F32")} if rng.random() < 0.5 else {}
    path = write_gguf_tensors(tmp_path / "c.gguf", arch, hp, tensors,
                              extra={"tokenizer.ggml.bos_token_id": 5, "tokenizer.ggml.eos_token_id": 6})
    ours = open_pack(path).config
    their_config = AutoConfig.from_pretrained(str(tmp_path), gguf_file="c.gguf")
    theirs = their_config.to_dict()
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "rms_norm_eps", "max_position_embeddings", "vocab_size", "tie_word_embeddings", "bos_token_id",
                "eos_token_id"):
        assert ours[key] == theirs[key], key
    assert ours["rope_theta"] == theirs["rope_parameters"]["rope_theta"]
    # transformers maps head_dim for llama (rope.dimension_count) and qwen3moe (key_length) only
    assert (
        ours["head_dim"]
        == {"llama": theirs.get("head_dim"), "qwen2": 64 // 4, "qwen3": 24, "qwen3moe": theirs.get("head_dim")}[arch]
    )
    assert ours["model_type"] == theirs["model_type"]
    if arch == "qwen3moe":
        assert (ours["num_experts"], ours["num_experts_per_tok"]) == \
            (their_config.num_experts, their_config.num_experts_per_tok) == (8, 2)


def test_mistral_named_llama_file_and_qwen2_biases(tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    q = _random_rows(rng, 64, 64)
    path = write_gguf_tensors(tmp_path / "mi.gguf", "llama", HPARAMS | {"rope.dimension_count": 16},
                              {"blk.0.attn_q.weight": (q, "F32")}, extra={"general.name": "Mistral-7B-Instruct-v0.3"})
    pack = open_pack(path)
    assert (pack.config["model_type"], pack.config["architectures"]) == ("mistral", ["MistralForCausalLM"])
    assert not torch.equal(pack.tensor("model.layers.0.self_attn.q_proj.weight"), torch.from_numpy(q))  # unpermuted

    bias = rng.standard_normal(64).astype(np.float32)
    pack = open_pack(write_gguf_tensors(tmp_path / "q2.gguf", "qwen2", HPARAMS, {"blk.0.attn_q.bias": (bias, "F32")}))
    assert torch.equal(pack.tensor("model.layers.0.self_attn.q_proj.bias"), torch.from_numpy(bias))  # no permutation
    assert pack.config["attention_bias"] is True and pack.config["model_type"] == "qwen2"


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path, rng_seed):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rng = np.random.default_rng(rng_seed)
    factor, theta, head_dim = float(rng.choice([8.0, 16.0, 32.0])), 500000.0, 16
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    hf = LlamaConfig(
        hidden_size=64, num_attention_heads=4, head_dim=head_dim, rope_theta=theta, rope_scaling=dict(scaling)
    )
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    plain = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    factors = (plain / scaled).numpy().astype(np.float32)  # what llama.cpp's converter stores as rope_freqs
    hp = HPARAMS | {"rope.freq_base": theta, "rope.dimension_count": head_dim}
    pack = open_pack(write_gguf_tensors(tmp_path / "r.gguf", "llama", hp, {"rope_freqs.weight": (factors, "F32")}))
    assert pack.config["rope_scaling"] == scaling and "rope_freqs.weight" not in pack.names()

    bad = factors.copy()
    bad[len(bad) // 2] *= 1.5
    path = write_gguf_tensors(tmp_path / "b.gguf", "llama", hp, {"rope_freqs.weight": (bad, "F32")})
    with pytest.raises(PackError) as e:
        open_pack(path)
    assert "rope_freqs.weight" in str(e.value) and str(path) in str(e.value)


# -- bad input ----------------------------------------------------------------------------------------------------
def _small(tmp_path, name="s.gguf", arch="qwen3", qtype="Q8_0"):
    w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    return write_gguf_tensors(
        tmp_path / name, arch, HPARAMS, {"blk.0.ffn_up.weight": (quantize_array(w, qtype), qtype)}
    )


@pytest.mark.parametrize("keep", [0.5, 0.995])
def test_truncated_gguf_names_the_file(tmp_path, keep):
    path = _small(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(PackError) as e:
        open_pack(path)
    assert str(path) in str(e.value)


def test_unknown_architecture_names_file_and_arch(tmp_path):
    path = _small(tmp_path, arch="gpt2")
    with pytest.raises(PackError) as e:
        open_pack(path)
    assert str(path) in str(e.value) and "'gpt2'" in str(e.value)


def test_unsupported_tensor_type_names_file_and_tensor(tmp_path):
    import libgguf

    w = np.random.default_rng(1).standard_normal((4, 128)).astype(np.float32)
    stored = libgguf.quantize_rows(w, int(gguf.GGMLQuantizationType.Q1_0))  # llama.cpp has it, gguf-py cannot decode it
    path = write_gguf_tensors(tmp_path / "u.gguf", "qwen3", HPARAMS, {"blk.0.ffn_up.weight": (stored, "Q1_0")})
    with pytest.raises(PackError) as e:
        open_pack(path)
    assert "Q1_0" in str(e.value) and "blk.0.ffn_up.weight" in str(e.value) and str(path) in str(e.value)


def test_tensor_without_hf_name_is_an_error(tmp_path):
    path = write_gguf_tensors(tmp_path / "n.gguf", "qwen3", HPARAMS,
                              {"blk.0.mystery.weight": (np.zeros((2, 32), np.float32), "F32")})
    with pytest.raises(PackError) as e:
        open_pack(path)
    assert "blk.0.mystery.weight" in str(e.value) and str(path) in str(e.value)


def test_missing_metadata_names_the_key(tmp_path):
    hp = {k: v for k, v in HPARAMS.items() if k != "embedding_length"}
    path = write_gguf_tensors(tmp_path / "k.gguf", "qwen3", hp, {})
    with pytest.raises(PackError) as e:
        open_pack(path)
    assert "qwen3.embedding_length" in str(e.value) and str(path) in str(e.value)


# -- the real model -----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_native_fp32_equals_transformers_gguf_loader(smollm2_gguf, tmp_path):
    from transformers import AutoModelForCausalLM
    from fidelity.packs.tokenizer import load_tokenizer
    from fidelity.packs.writers import write_native

    pack = open_pack(smollm2_gguf)
    assert pack.format == "gguf" and len(pack.names()) == 272
    native_dir = write_native(pack, tmp_path / "native")
    native = open_pack(native_dir)
    assert native.format == "native"

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                 dtype=torch.float32)
    reference = {k: v.float() for k, v in model.state_dict().items()}
    assert set(native.names()) == set(reference) - {"lm_head.weight"}  # tied head: one tensor in both
    assert torch.equal(reference["lm_head.weight"], reference["model.embed_tokens.weight"])
    worst = max((native.tensor(k) - reference[k]).abs().max().item() for k in native.names())
    assert worst == 0.0
    assert all(native.storage(k).dtype == "F32" for k in native.names())

    theirs = model.config.to_dict()
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "model_type"):
        assert native.config[key] == theirs[key], key
    assert native.config["architectures"] == ["LlamaForCausalLM"] and native.config["torch_dtype"] == "float32"
    assert native.config["rope_theta"] == theirs["rope_parameters"]["rope_theta"]

    gguf_tok = load_tokenizer(pack)
    assert load_tokenizer(pack) is gguf_tok
    native_tok = load_tokenizer(native)
    text = "Quantized models drift: naïve 4-bit grids, 3.14159 and emoji 🙂 — tabs\tand\nnewlines."
    ids = gguf_tok(text)["input_ids"]
    assert native_tok(text)["input_ids"] == ids and native_tok.decode(ids) == text
    try:  # llama.cpp's own tokenizer on the original file, when installed, is the independent reference
        import llama_cpp
        llm = llama_cpp.Llama(str(smollm2_gguf), n_ctx=64, vocab_only=True, verbose=False)
        assert llm.tokenize(text.encode(), add_bos=False) == ids
    except ImportError:
        pass
    chat = [{"role": "user", "content": "What is 2+2?"}]
    rendered = native_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == gguf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in rendered and rendered.endswith("<|im_start|>assistant\n")
    assert gguf_tok.chat_template == pack.metadata_chat_template == native_tok.chat_template
