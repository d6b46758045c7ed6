"""DeepSeek-V4 oracle vs transformers fp32 (eager) on tiny random models: sliding, CSA and HCA layers with contexts
longer than the window and than index_topk entries, hash-routed and biased-routed MoE layers, clamped SwiGLU,
hyper-connections; plus official-name packs and bad input."""
from __future__ import annotations

import json
import math

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from fidelity import open_pack
from fidelity.errors import ConfigError, PackError
from fidelity.oracle import Oracle
from test_oracle_support import hf_logits, randomize

TOL = 1e-4

BASE = dict(vocab_size=61, hidden_size=32, moe_intermediate_size=12, num_hidden_layers=4, num_attention_heads=4,
            head_dim=16, partial_rotary_factor=0.25, q_lora_rank=12, num_experts_per_tok=2, n_routed_experts=6,
            hc_mult=3, hc_sinkhorn_iters=5, sliding_window=5, o_groups=2, o_lora_rank=8, index_n_heads=4,
            index_head_dim=8, index_topk=3, swiglu_limit=0.8, routed_scaling_factor=1.7, rms_norm_eps=1e-6,
            max_position_embeddings=4096, tie_word_embeddings=False,
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                         "compressed_sparse_attention"],
            compress_rates={"compressed_sparse_attention": 3, "heavily_compressed_attention": 4},
            mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"])

CASES = {
    "mixed-default-rope": {},
    "yarn-compress-csa2-hca5": dict(
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 5}, index_topk=4,
        hc_mult=2, sliding_window=7, mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention",
                     "compressed_sparse_attention"],
        rope_parameters=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=64, beta_fast=32,
                             beta_slow=1)),
}


def build_v4(config, folder, seed: int):
    """Random-init fp32 V4 saved with save_pretrained; hash tables get distinct random experts per token."""
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = T.DeepseekV4ForCausalLM(config).to(torch.float32).eval()
    model.set_experts_implementation("eager")
    randomize(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("scale"):  # hyper-connection scales: O(1) so pre/post/comb really vary
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                perms = torch.stack([torch.randperm(config.n_routed_experts, generator=g)[:config.num_experts_per_tok]
                                     for _ in range(config.vocab_size)])
                gate.tid2eid.copy_(perms)
    model.save_pretrained(folder)
    return model


def make(tmp_path, case: str, seed: int, **over):
    config = T.DeepseekV4Config(**{**BASE, **CASES[case], **over})
    model = build_v4(config, tmp_path / case, seed)
    return model, open_pack(tmp_path / case)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers_past_window_and_topk(tmp_path, rng_seed, case):
    model, pack = make(tmp_path, case, rng_seed)
    cfg = model.config
    T_len = 26
    assert T_len > cfg.sliding_window and T_len // cfg.compress_rates["compressed_sparse_attention"] > cfg.index_topk
    tokens = torch.randint(0, cfg.vocab_size, (2, T_len))
    want = hf_logits(model, tokens)
    got = Oracle(pack).logits(tokens)
    delta = (got - want).abs().max().item()
    print(f"{case}: T={T_len} max |dlogit| = {delta:.3g}, logit scale {want.abs().max().item():.3g}")
    assert got.shape == want.shape and delta <= TOL
    assert want.abs().max() > 1.0
