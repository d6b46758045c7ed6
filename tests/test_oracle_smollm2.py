"""Oracle on real weights: SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized), against transformers fp32 on real text, and
from its GGUF pack vs a native fp32 pack."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from fidelity import open_pack
from fidelity.oracle import Oracle

pytestmark = pytest.mark.slow

TEXTS = [
    "The quick brown fox jumps over the lazy dog. Meanwhile, in the kitchen, the kettle began to whistle.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Paris is the capital of France.",
    "Quantization maps each weight to one of a few levels; the question is how far the outputs drift.",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf, tmp_path_factory):
    """HF model built by transformers' own GGUF loader, its tokenizer, and a native fp32 pack saved from it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = smollm2_gguf.parent, smollm2_gguf.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    native = tmp_path_factory.mktemp("smollm2")
    save_native(model, native)
    return model, tokenizer, native


def save_native(model, folder):
    """save_pretrained refuses a model transformers marks as gguf-quantized; write the same fp32 files by hand."""
    from safetensors.torch import save_file
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (folder / "config.json").write_text(json.dumps(config, indent=2, default=str))


def test_native_pack_matches_transformers_on_real_text(smollm2):
    model, tokenizer, native = smollm2
    rows = [tokenizer(t)["input_ids"] for t in TEXTS]
    assert len({len(r) for r in rows}) > 1  # variable lengths in one oracle call
    oracle = Oracle(open_pack(native))
    hidden = oracle.hidden_states(rows, progress=False)
    worst = 0.0
    for row, h in zip(rows, hidden):
        with torch.no_grad():
            want = model(input_ids=torch.tensor([row]), use_cache=False).logits[0]
        got = oracle.apply_head(h)
        worst = max(worst, (got - want).abs().max().item())
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    print(f"SmolLM2 native pack vs transformers: max |dlogit| = {worst:.3g}")
    assert worst <= 1e-4


def test_gguf_pack_equals_native_pack(smollm2, smollm2_gguf):
    if importlib.util.find_spec("fidelity.packs.gguf") is None:
        pytest.skip("missing tool: fidelity.packs.gguf is not available yet")
    _, tokenizer, native = smollm2
    gguf_pack = open_pack(smollm2_gguf)
    assert gguf_pack.format == "gguf" or type(gguf_pack).__name__ == "GGUFPack"
    tokens = torch.tensor([tokenizer(TEXTS[0])["input_ids"][:20], tokenizer(TEXTS[3])["input_ids"][:20]])
    from_native = Oracle(open_pack(native)).logits(tokens)
    from_gguf = Oracle(gguf_pack).logits(tokens)
    assert torch.equal(from_gguf, from_native)
