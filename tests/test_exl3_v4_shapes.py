"""EXL3 stores linears padded to multiples of 128; the unpadded [out, in] comes from the config. For DeepSeek-V4's
attention it must equal what transformers' own DeepseekV4 model builds."""
import pytest
import torch

from fidelity.packs.exl3.layouts import logical_shape

transformers = pytest.importorskip("transformers")


def round_up(x: int) -> int:
    return -(-x // 128) * 128


def test_v4_attention_shapes_match_transformers():
    cfg = transformers.DeepseekV4Config(
        vocab_size=300, hidden_size=96, moe_intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        head_dim=64, q_lora_rank=48, n_routed_experts=4, num_experts_per_tok=2, o_groups=2, o_lora_rank=40,
        index_n_heads=2, index_head_dim=32, index_topk=8, hc_mult=2, sliding_window=8, num_nextn_predict_layers=0)
    with torch.device("meta"):
        model = transformers.DeepseekV4ForCausalLM(cfg)
    config = cfg.to_dict()
    checked = 0
    for name, p in model.named_parameters():
        if p.dim() != 2 or ".self_attn." not in name or not name.endswith("proj.weight"):
            continue
        if any(part in name for part in ("compressor", "indexer")):
            continue
        out, inp = p.shape
        assert logical_shape(name, config, (round_up(out), round_up(inp))) == (out, inp), name
        checked += 1
    assert checked >= 5  # q_a, q_b, kv, o_a, o_b of at least one layer
