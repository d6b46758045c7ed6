"""DeepSeek-V3.2 oracle vs transformers fp32 (eager) on tiny random models, with contexts longer than index_topk so the
lightning indexer's sparse selection is exercised, and the dense-equivalent short-context path."""
from __future__ import annotations

from functools import partial

import pytest
import torch
import transformers as T

from fidelity import open_pack
from fidelity.errors import ConfigError
from fidelity.oracle import Oracle
from _deepseek_configs import edit_config, make_variant, reference_ties_to_lower_index  # noqa: F401 (autouse)
from test_oracle_support import assert_oracle_matches_hf, build, hf_logits

TOL = 1e-4

BASE = dict(vocab_size=89, hidden_size=40, intermediate_size=52, moe_intermediate_size=18, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=20, kv_lora_rank=14, qk_nope_head_dim=10,
            qk_rope_head_dim=6, v_head_dim=12, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3,
            n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.0, norm_topk_prob=True,
            index_n_heads=8, index_head_dim=16, index_topk=7, rms_norm_eps=1e-6, max_position_embeddings=512,
            tie_word_embeddings=False)

CASES = {
    "default-rope": {},
    "yarn-no-renorm-two-dense": dict(
        norm_topk_prob=False, first_k_dense_replace=2, index_topk=11, n_shared_experts=2,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
                             mscale=1.0, mscale_all_dim=0.7, beta_fast=32, beta_slow=1)),
}


make = partial(make_variant, T.DeepseekV32Config, partial(build, model_cls=T.DeepseekV32ForCausalLM), BASE, CASES)


def hf_indexer_selections(model, tokens) -> list[torch.Tensor]:
    """Each layer's top-k indices as transformers' indexer returns them."""
    picks = []
    hooks = [layer.self_attn.indexer.register_forward_hook(lambda m, i, o: picks.append(o.long()))
             for layer in model.model.layers]
    hf_logits(model, tokens)
    for h in hooks:
        h.remove()
    return picks


@pytest.mark.parametrize("case", sorted(CASES))
def test_sparse_context_matches_transformers(tmp_path, rng_seed, case):
    model, pack = make(tmp_path, case, rng_seed)
    topk = model.config.index_topk
    tokens = torch.randint(0, BASE["vocab_size"], (2, 4 * topk + 3))
    assert_oracle_matches_hf(model, pack, tokens, TOL, f"{case}: T={tokens.shape[1]} topk={topk}")


def test_indexer_selection_equals_transformers_and_matters(tmp_path, rng_seed):
    """The oracle's kept keys are, per query, HF's top-k clipped to the causal past; and selection changes the output
    (turning the indexer off, i.e. dense MLA, moves the logits far beyond the tolerance)."""
    from fidelity.oracle.deepseek.v32 import IndexedMLA
    model, pack = make(tmp_path, "default-rope", rng_seed)
    T_len, topk = 30, model.config.index_topk
    tokens = torch.randint(0, BASE["vocab_size"], (1, T_len))
    hf_picks = hf_indexer_selections(model, tokens)
    oracle = Oracle(pack, keep_weights=True)
    kept = []
    original = IndexedMLA.__call__

    def spy(self, x, rope):
        q, k, v, q_latent = self.project(x, rope)
        kept.append(self.indexer.selected(x, q_latent, rope))
        return original(self, x, rope)

    IndexedMLA.__call__ = spy
    try:
        sparse = oracle.logits(tokens)
    finally:
        IndexedMLA.__call__ = original
    causal = torch.ones(T_len, T_len, dtype=torch.bool).tril()
    for layer, (mine, theirs) in enumerate(zip(kept, hf_picks)):
        want = torch.zeros(T_len, T_len, dtype=torch.bool).scatter_(-1, theirs[0], True) & causal
        assert torch.equal(mine[0], want), f"layer {layer}"
        assert int(mine[0].sum(-1).max()) == topk  # late queries keep exactly top-k of their > top-k past tokens
    for layer in oracle._layers.values():
        layer.attn.index.topk = 10**9  # every earlier token: dense MLA
    dense = oracle.logits(tokens)
    assert (dense - sparse).abs().max().item() > 100 * TOL


def test_short_context_is_dense_and_skips_the_indexer(tmp_path, rng_seed, monkeypatch):
    from fidelity.oracle.deepseek import v32 as deepseek_v32
    model, pack = make(tmp_path, "default-rope", rng_seed)
    tokens = torch.randint(0, BASE["vocab_size"], (3, model.config.index_topk))
    monkeypatch.setattr(deepseek_v32.LightningIndexer, "selected", lambda *a: pytest.fail("indexer computed"))
    got = Oracle(pack).logits(tokens)
    assert (got - hf_logits(model, tokens)).abs().max().item() <= TOL


def test_rows_of_different_lengths(tmp_path, rng_seed):
    model, pack = make(tmp_path, "default-rope", rng_seed)
    rows = [torch.randint(0, BASE["vocab_size"], (n,)).tolist() for n in (5, 19, 26)]
    oracle = Oracle(pack)
    for row, h in zip(rows, oracle.hidden_states(rows, progress=False)):
        assert (oracle.apply_head(h) - hf_logits(model, torch.tensor([row]))[0]).abs().max().item() <= TOL


# -- bad input --------------------------------------------------------------------------------------------------------

def _config_with(tmp_path, seed, **edit):
    make(tmp_path, "default-rope", seed)
    return open_pack(edit_config(tmp_path / "default-rope", **edit))


def test_missing_index_topk_names_the_key(tmp_path, rng_seed):
    pack = _config_with(tmp_path, rng_seed, index_topk=None)
    with pytest.raises(ConfigError, match="DeepseekV32ForCausalLM.*'index_topk'"):
        Oracle(pack)


def test_bad_mlp_layer_types_named(tmp_path, rng_seed):
    pack = _config_with(tmp_path, rng_seed, mlp_layer_types=["dense", "moe", "sparse"])
    with pytest.raises(ConfigError, match="mlp_layer_types"):
        Oracle(pack)


def test_query_chunking_changes_nothing(tmp_path, rng_seed, monkeypatch):
    from fidelity.oracle.deepseek import v32 as deepseek_v32
    model, pack = make(tmp_path, "default-rope", rng_seed)
    monkeypatch.setattr(deepseek_v32, "ATTENTION_CHUNK_BYTES", 1)
    tokens = torch.randint(0, BASE["vocab_size"], (2, 20))
    assert (Oracle(pack).logits(tokens) - hf_logits(model, tokens)).abs().max().item() <= TOL


def test_indexer_under_official_names(tmp_path, rng_seed):
    """A pack whose other tensors carry Hugging Face names (as the EXL3 layouts map them) but whose indexer keeps
    DeepSeek's official `layers.L.attn.indexer.*` names (left unmapped there) loads and matches transformers."""
    from safetensors.torch import load_file, save_file
    model, _ = make(tmp_path, "default-rope", rng_seed)
    path = tmp_path / "default-rope" / "model.safetensors"
    tensors = load_file(path)
    renamed = {k.replace("model.layers.", "layers.").replace(".self_attn.indexer.", ".attn.indexer.")
               if ".indexer." in k else k: v for k, v in tensors.items()}
    assert "layers.2.attn.indexer.wq_b.weight" in renamed
    save_file(renamed, path, metadata={"format": "pt"})
    tokens = torch.randint(0, BASE["vocab_size"], (1, 25))
    got = Oracle(open_pack(tmp_path / "default-rope")).logits(tokens)
    assert (got - hf_logits(model, tokens)).abs().max().item() <= TOL


@pytest.mark.parametrize("edit,needle", [
    (dict(index_head_dim=4), "index_head_dim 4"),
    (dict(index_topk=0), "index_topk"),
    (dict(q_lora_rank=None), "q_lora_rank"),
])
def test_more_bad_configs_named(tmp_path, rng_seed, edit, needle):
    pack = _config_with(tmp_path, rng_seed, **edit)
    with pytest.raises(ConfigError) as e:
        Oracle(pack)
    assert needle in str(e.value) and "DeepseekV32ForCausalLM" in str(e.value)


@pytest.mark.slow
def test_real_index_geometry_long_row(tmp_path, rng_seed):
    """The released indexer geometry (64 heads x 128, top-2048) on a 2300-token row, with YaRN: the 252 last positions
    keep 2048 of their up to 2300 past tokens. Seen: max |dlogit| 0.0, sparse-vs-dense effect 3.6."""
    cfg = dict(vocab_size=1000, hidden_size=512, intermediate_size=768, moe_intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256, kv_lora_rank=128,
               qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=8, n_shared_experts=1,
               num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
               norm_topk_prob=True, index_n_heads=64, index_head_dim=128, index_topk=2048,
               max_position_embeddings=163840,
               rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
                                    original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0,
                                    beta_fast=32, beta_slow=1))
    model = build(T.DeepseekV32Config(**cfg), T.DeepseekV32ForCausalLM, tmp_path / "real", rng_seed)
    tokens = torch.randint(0, cfg["vocab_size"], (1, 2300))
    want = hf_logits(model, tokens)
    got = Oracle(open_pack(tmp_path / "real")).logits(tokens)
    delta = (got - want).abs().max().item()
    print(f"V3.2 real index geometry, T=2300: max |dlogit| = {delta:.3g}, logit scale {want.abs().max().item():.3g}")
    assert delta <= TOL
