"""Tiny DeepSeek test models shared by the V3.2 and V4 oracle tests (no tests here): a named variant of a base config
built into a pack folder, V4's tiny config and builder, config.json edits for the bad-input tests, and the top-k tie
rule the transformers references run under (`reference_ties_to_lower_index`, autouse where imported)."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable

import pytest
import torch
import transformers as T

from fidelity import open_pack
from test_oracle_support import randomize


def make_variant(config_cls, build_model: Callable, base: dict, cases: dict, tmp_path: Path, case: str, seed: int,
                 **over):
    """(model, pack): `base` updated by cases[case] then `over`, built by build_model(config, folder=, seed=) into
    tmp_path/case."""
    folder = tmp_path / case
    model = build_model(config_cls(**{**base, **cases[case], **over}), folder=folder, seed=seed)
    return model, open_pack(folder)


def tiny_v4(layer_types: list[str], mlp_layer_types: list[str]) -> dict:
    """The tiny DeepSeek-V4 config the V4 oracle and drafter tests share, with these attention and MLP layer kinds
    (one layer each)."""
    return dict(vocab_size=61, hidden_size=32, moe_intermediate_size=12, num_hidden_layers=len(layer_types),
                num_attention_heads=4, head_dim=16, partial_rotary_factor=0.25, q_lora_rank=12, num_experts_per_tok=2,
                n_routed_experts=6, hc_mult=3, hc_sinkhorn_iters=5, sliding_window=5, o_groups=2, o_lora_rank=8,
                index_n_heads=4, index_head_dim=8, index_topk=3, swiglu_limit=0.8, routed_scaling_factor=1.7,
                rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False, layer_types=layer_types,
                compress_rates={"compressed_sparse_attention": 3, "heavily_compressed_attention": 4},
                mlp_layer_types=mlp_layer_types)


def edit_config(folder: Path, **edit) -> Path:
    """Sets keys of folder/config.json; a None value removes the key. Returns folder."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in edit.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))
    return folder


def build_v4(config, folder, seed: int):
    """Random-init fp32 V4 (`random_v4`) saved with save_pretrained."""
    model = random_v4(config, seed)
    model.save_pretrained(folder)
    return model


def random_v4(config, seed: int):
    """Random-init fp32 V4 (hash tables get distinct random experts per token)."""
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = T.DeepseekV4ForCausalLM(config).to(torch.float32).eval()
    model.set_experts_implementation("eager")
    randomize(model, seed)
    return model


def topk_ties_to_lower_index(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """torch.topk with equal values ranked by index, lower first (a stable sort): the tie rule of the oracle's
    selection. torch.topk leaves ties to its implementation (the CPU's and CUDA's differ), and DeepSeek's indexer
    scores tie at exactly 0 wherever every head's relu is 0, so transformers' top-k is only comparable under one
    rule."""
    order = torch.sort(x, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((order.values.narrow(dim, 0, k), order.indices.narrow(dim, 0, k)))


@pytest.fixture(autouse=True)
def reference_ties_to_lower_index(monkeypatch):
    """Autouse in the modules that import it: transformers' (and any) torch.topk breaks ties by index."""
    monkeypatch.setattr(torch, "topk", topk_ties_to_lower_index)
    monkeypatch.setattr(torch.Tensor, "topk", topk_ties_to_lower_index)


@contextlib.contextmanager
def float32_casts_kept_float64():
    """transformers' DeepSeek-V4 code casts to float32 inside its forward (RMSNorm, hyper-connections, compressor
    softmax, indexer scores), so a `.double()` model is float32-accurate there (~1e-7 relative from the first layer on).
    Within this context those casts leave float64 tensors float64: a float64 reference for float64 comparisons. The
    rotary tables keep their float32 angles, as the oracle's `rope_table` does (DeepSeek's reference computes them
    so)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    original_float, original_to, original_softmax = torch.Tensor.float, torch.Tensor.to, torch.Tensor.softmax
    original_rope = hf.DeepseekV4RotaryEmbedding.forward
    keep = [True]

    def keep_float(self, *args, **kwargs):
        return self if keep[0] and self.dtype == torch.float64 else original_float(self, *args, **kwargs)

    def keep_to(self, *args, **kwargs):
        if keep[0] and self.dtype == torch.float64:
            if kwargs.get("dtype") is torch.float32:
                kwargs = {**kwargs, "dtype": torch.float64}
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        return original_to(self, *args, **kwargs)

    def keep_softmax(self, *args, **kwargs):
        if keep[0] and self.dtype == torch.float64 and kwargs.get("dtype") is torch.float32:
            kwargs = {**kwargs, "dtype": torch.float64}
        return original_softmax(self, *args, **kwargs)

    def rope_as_stored(self, *args, **kwargs):
        keep[0] = False
        try:
            return original_rope(self, *args, **kwargs)
        finally:
            keep[0] = True

    torch.Tensor.float, torch.Tensor.to, torch.Tensor.softmax = keep_float, keep_to, keep_softmax
    hf.DeepseekV4RotaryEmbedding.forward = rope_as_stored
    try:
        yield
    finally:
        torch.Tensor.float, torch.Tensor.to, torch.Tensor.softmax = original_float, original_to, original_softmax
        hf.DeepseekV4RotaryEmbedding.forward = original_rope
