"""DeepSeek-V4 oracle at the real attention geometry (head_dim 512, 64 rotary dims, sliding window 128, CSA ratio 4 with
index_topk 512, HCA ratio 128, YaRN factor 16, hc_mult 4, 20 Sinkhorn iterations) on a 2200-token row, against
transformers fp32 (on the GPU with TF32 off where there is one, else on the CPU). Other sizes are small so the model
fits a test. Seen on the CPU (2600 tokens): max |dlogit| 5.0e-6 at logit scale 5.8."""
from __future__ import annotations

import pytest
import torch
import transformers as T

from fidelity import open_pack
from fidelity.oracle import Oracle
from _deepseek_configs import build_v4, reference_ties_to_lower_index  # noqa: F401 (autouse: the indexer's exact-0 ties)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(T, "DeepseekV4Config"), reason="missing tool: transformers without DeepSeek-V4"),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

REAL_GEOMETRY = dict(
    vocab_size=1000, hidden_size=1024, moe_intermediate_size=256, num_hidden_layers=4, num_attention_heads=16,
    head_dim=512, partial_rotary_factor=64 / 512, q_lora_rank=256, num_experts_per_tok=2, n_routed_experts=8,
    hc_mult=4, hc_sinkhorn_iters=20, sliding_window=128, o_groups=8, o_lora_rank=128, index_n_heads=8,
    index_head_dim=128, index_topk=512, swiglu_limit=10.0, routed_scaling_factor=1.5, rms_norm_eps=1e-6,
    max_position_embeddings=1 << 20, tie_word_embeddings=False,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    rope_parameters=dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=65536, beta_fast=32,
                         beta_slow=1))


def test_real_attention_geometry_long_row_matches_transformers(tmp_path, rng_seed):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = build_v4(T.DeepseekV4Config(**REAL_GEOMETRY), tmp_path / "v4", rng_seed).to(DEVICE)
    T_len = 2200   # 550 CSA entries > index_topk 512, 17 HCA entries, far past the 128-token window
    tokens = torch.randint(0, REAL_GEOMETRY["vocab_size"], (1, T_len))
    with torch.no_grad():
        want = model(input_ids=tokens.to(DEVICE), use_cache=False).logits.float().cpu()
    got = Oracle(open_pack(tmp_path / "v4"), device=DEVICE).logits(tokens)
    delta = (got - want).abs().max().item()
    print(
        f"V4 real geometry on {DEVICE}, T={T_len}: max |dlogit| = {delta:.3g}, "
        f"logit scale {want.abs().max().item():.3g}"
    )
    assert delta <= 1e-4
