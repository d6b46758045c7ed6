"""What the transformers floor (5.18, see DEVELOPERS.md "Supported dependency versions") guards: the tokenizer of a
byte-level BPE GGUF and the tokenizer metadata write_gguf builds from the files write_native saved. transformers
5.0-5.17 convert such a GGUF Llama-style (byte fallback and SentencePiece decoders, which write_gguf refuses; before 5.6
a BOS before every text), take EOS from the BOS id, and cannot read a GGUF that has no BOS id; these tests fail there.
llama.cpp (llama-cpp-python) tokenizes the same GGUF as the independent reference."""
from __future__ import annotations

import random

import gguf
import pytest
from test_packs_writers import tiny_llama

from fidelity.packs import open_pack
from fidelity.packs.tokenizer import load_tokenizer
from fidelity.packs.writers import write_gguf

llama_cpp = pytest.importorskip("llama_cpp")

# digits only right after a letter: transformers' GGUF conversion drops SmolLM2's Digits pre-tokenizer, so whitespace
# before a digit ("\n 0") splits differently from llama.cpp in every transformers version (not a floor question)
_PIECES = ["the", " quick", " brown", " fox", " KL=0.013", "  ", "\n", "\n\n", "\t", "é", "naïve", " café", "日本語",
           "—", "🙂", "def f(x):", "    return", " x**2", "v1234567", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
           "user", "assistant", "!", "?", "'s", " I'm", "https://example.org/a?b=c"]


def _random_texts(seed: int, n: int = 12) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 24))) for _ in range(n)]


def _llama_cpp_ids(path, texts: list[str]) -> list[list[int]]:
    model = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    add_bos = bool(model.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true")
    return [model.tokenize(t.encode(), add_bos=add_bos, special=True) for t in texts]


def _field(reader: gguf.GGUFReader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id")


def test_gguf_tokenizer_encodes_as_llama_cpp_and_keeps_the_special_tokens(smollm2_gguf, rng_seed):
    texts = _random_texts(rng_seed)
    tok = load_tokenizer(open_pack(smollm2_gguf))
    want = _llama_cpp_ids(smollm2_gguf, texts)
    for text, ids in zip(texts, want):
        assert tok(text, add_special_tokens=True)["input_ids"] == ids, text
    meta = gguf.GGUFReader(smollm2_gguf)
    assert tok.bos_token_id == _field(meta, "tokenizer.ggml.bos_token_id")
    assert tok.eos_token_id == _field(meta, "tokenizer.ggml.eos_token_id")  # <|im_end|>; transformers < 5.18: BOS
    assert tok.pad_token_id == _field(meta, "tokenizer.ggml.padding_token_id")


def test_write_gguf_carries_the_saved_gguf_tokenizer(smollm2_gguf, tmp_path, rng_seed):
    """write_native saves load_tokenizer's files; write_gguf rebuilds GGUF metadata from them: the token list, merges,
    special ids and chat template equal the source GGUF's, and the written GGUF tokenizes as llama.cpp does the
    source."""
    root = tiny_llama(tmp_path / "m", rng_seed, hidden=64, n_head=2, n_kv=1, inter=128, layers=1, vocab=49152)
    load_tokenizer(open_pack(smollm2_gguf)).save_pretrained(str(root))
    path = write_gguf(open_pack(root), tmp_path / "t.gguf", "Q8_0", tokenizer_pre="smollm")
    src, out = gguf.GGUFReader(smollm2_gguf), gguf.GGUFReader(path)
    for key in ("model", "pre", "tokens", "merges", *_SPECIAL_IDS):
        assert _field(out, f"tokenizer.ggml.{key}") == _field(src, f"tokenizer.ggml.{key}"), key
    assert _field(out, "tokenizer.chat_template") == _field(src, "tokenizer.chat_template")
    control = int(gguf.TokenType.CONTROL)
    kinds = _field(out, "tokenizer.ggml.token_type")
    assert (
        kinds[_field(src, "tokenizer.ggml.eos_token_id")]
        == kinds[_field(src, "tokenizer.ggml.bos_token_id")]
        == control
    )
    texts = _random_texts(rng_seed + 1)
    tok = load_tokenizer(open_pack(path))
    for text, ids in zip(texts, _llama_cpp_ids(smollm2_gguf, texts)):
        assert tok(text, add_special_tokens=True)["input_ids"] == ids, text
