"""Oracle vs HF transformers fp32 (eager attention) on tiny random-init models of every supported architecture."""
from __future__ import annotations

import pytest
import torch
import transformers as T

from fidelity import open_pack
from fidelity.errors import ConfigError, FidelityError, PackError
from fidelity.oracle import Oracle, supported_architectures
from fidelity.oracle.llama import MIN_QUERY_BLOCK
from test_oracle_support import assert_oracle_matches_hf, build, hf_logits

TOL = 1e-4

# Odd sizes on purpose: head_dim != hidden/heads, kv heads < heads, vocab and widths not powers of two.
COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=72, num_hidden_layers=3, num_attention_heads=6,
              num_key_value_heads=2, head_dim=12, max_position_embeddings=256, rms_norm_eps=1e-5)

DENSE = {
    "llama-llama3-untied-bias": (T.LlamaConfig, T.LlamaForCausalLM, dict(
        attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=500.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=16))),
    "llama-linear-tied": (T.LlamaConfig, T.LlamaForCausalLM, dict(
        tie_word_embeddings=True, rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=3.0))),
    "mistral-sliding-window": (T.MistralConfig, T.MistralForCausalLM, dict(
        sliding_window=5, tie_word_embeddings=False)),
    "qwen2-yarn-tied": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=1000.0, factor=4.0, original_max_position_embeddings=32))),
    "qwen3-qknorm-default": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(tie_word_embeddings=False, attention_bias=True)),
    "qwen2-sliding-from-layer-1": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(
        use_sliding_window=True, sliding_window=4, max_window_layers=1, tie_word_embeddings=False)),
}


def make(tmp_path, case: str, seed: int, cases=DENSE):
    cfg_cls, model_cls, extra = cases[case]
    config = cfg_cls(**{**COMMON, **extra})
    model = build(config, model_cls, tmp_path / case, seed)
    return model, open_pack(tmp_path / case)


@pytest.mark.parametrize("case", sorted(DENSE))
def test_dense_matches_transformers(tmp_path, rng_seed, case):
    model, pack = make(tmp_path, case, rng_seed)
    got = assert_oracle_matches_hf(model, pack, torch.randint(0, COMMON["vocab_size"], (3, 23)), TOL, case)
    assert got.dtype == torch.float32


def test_variable_length_rows_match_individual_runs(tmp_path, rng_seed):
    """Rows of different lengths in one call: each equals HF run on that row alone (no padding leakage)."""
    model, pack = make(tmp_path, "qwen3-qknorm-default", rng_seed)
    lengths = [7, 19, 7, 1, 12]
    rows = [torch.randint(0, COMMON["vocab_size"], (n,)).tolist() for n in lengths]
    oracle = Oracle(pack)
    hidden = oracle.hidden_states(rows, progress=False)
    for row, h in zip(rows, hidden):
        want = hf_logits(model, torch.tensor([row]))[0]
        assert h.shape == (len(row), COMMON["hidden_size"])
        assert (oracle.apply_head(h) - want).abs().max().item() <= TOL


def test_head_chunks_and_map_logits(tmp_path, rng_seed):
    model, pack = make(tmp_path, "llama-llama3-untied-bias", rng_seed)
    tokens = torch.randint(0, COMMON["vocab_size"], (2, 9))
    oracle = Oracle(pack)
    hidden = torch.stack(oracle.hidden_states(tokens.tolist(), progress=False))
    full = oracle.apply_head(hidden, chunk_positions=4)
    want = hf_logits(model, tokens)
    assert (full - want).abs().max().item() <= TOL
    seen = []
    for where, chunk in oracle.iter_logits(hidden, chunk_positions=5):
        assert chunk.shape[0] <= 5
        seen.append(where)
    assert [s.start for s in seen] == [0, 5, 10, 15]
    argmax = oracle.map_logits(hidden, lambda c: c.argmax(-1), chunk_positions=7)
    assert torch.equal(argmax, want.argmax(-1))


@pytest.mark.parametrize("case", ["mistral-sliding-window", "qwen2-sliding-from-layer-1", "llama-llama3-untied-bias"])
def test_rows_spanning_several_query_blocks_match_transformers(tmp_path, rng_seed, case):
    """Attention runs in query blocks (only the diagonal block masked when there is no window); rows of several
    blocks, with a window that crosses block edges, still match HF, and partial last blocks too."""
    model, pack = make(tmp_path, case, rng_seed)
    tokens = torch.randint(0, COMMON["vocab_size"], (2, 3 * MIN_QUERY_BLOCK + 5))
    delta = (Oracle(pack).logits(tokens) - hf_logits(model, tokens)).abs().max().item()
    print(f"{case}, {tokens.shape[1]} positions: max |dlogit| = {delta:.3g}")
    assert delta <= TOL


def test_float64_mode_agrees(tmp_path, rng_seed):
    model, pack = make(tmp_path, "mistral-sliding-window", rng_seed)
    tokens = torch.randint(0, COMMON["vocab_size"], (2, 11))
    got = Oracle(pack, dtype=torch.float64).logits(tokens)
    assert got.dtype == torch.float64
    assert (got - hf_logits(model, tokens).double()).abs().max().item() <= TOL


def test_deterministic(tmp_path, rng_seed):
    _, pack = make(tmp_path, "qwen2-yarn-tied", rng_seed)
    tokens = torch.randint(0, COMMON["vocab_size"], (2, 13))
    assert torch.equal(Oracle(pack).logits(tokens), Oracle(pack).logits(tokens))


# -- bad input --------------------------------------------------------------------------------------------------------

def test_unsupported_architecture_names_it_and_lists_supported(tmp_path, rng_seed):
    _, pack = make(tmp_path, "qwen3-qknorm-default", rng_seed)
    pack.config = {**pack.config, "architectures": ["GPTNeoXForCausalLM"]}
    with pytest.raises(ConfigError) as e:
        Oracle(pack)
    assert "GPTNeoXForCausalLM" in str(e.value)
    for arch in supported_architectures():
        assert arch in str(e.value)


def test_missing_layer_tensor_fails_before_compute(tmp_path, rng_seed, monkeypatch):
    from safetensors.torch import load_file, save_file
    _, _ = make(tmp_path, "llama-linear-tied", rng_seed)
    folder = tmp_path / "llama-linear-tied"
    tensors = load_file(folder / "model.safetensors")
    victim = "model.layers.2.mlp.up_proj.weight"
    del tensors[victim]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    pack = open_pack(folder)
    reads = []
    monkeypatch.setattr(pack, "tensor", lambda name: reads.append(name))
    with pytest.raises(PackError) as e:
        Oracle(pack).logits(torch.zeros(1, 3, dtype=torch.long))
    assert victim in str(e.value) and e.value.tensor == victim
    assert reads == []  # nothing was read, let alone computed


def test_nan_in_a_layer_reports_layer_and_row(tmp_path, rng_seed):
    _, pack = make(tmp_path, "qwen3-qknorm-default", rng_seed)
    original = pack.tensor

    def poisoned(name):
        t = original(name)
        if name == "model.layers.1.self_attn.o_proj.weight":
            t[0, 0] = float("nan")
        return t

    pack.tensor = poisoned
    with pytest.raises(FidelityError) as e:
        Oracle(pack).logits(torch.randint(0, COMMON["vocab_size"], (2, 5)))
    assert "NaN" in str(e.value) and "layer 1" in str(e.value) and "row 0" in str(e.value)


def test_nan_in_one_row_names_that_row(tmp_path, rng_seed):
    _, pack = make(tmp_path, "llama-linear-tied", rng_seed)
    original = pack.tensor
    poison_token = 5

    def poisoned(name):
        t = original(name)
        if name == "model.embed_tokens.weight":
            t[poison_token, 3] = float("nan")
        return t

    pack.tensor = poisoned
    rows = [[1, 2, 3, 4], [6, 7, 8, 9], [1, poison_token, 2, 3]]
    with pytest.raises(FidelityError) as e:
        Oracle(pack).hidden_states(rows, progress=False)
    assert "row 2" in str(e.value) and "position 1" in str(e.value)


def test_token_outside_vocab_names_row_and_position(tmp_path, rng_seed):
    _, pack = make(tmp_path, "llama-linear-tied", rng_seed)
    with pytest.raises(FidelityError) as e:
        Oracle(pack).hidden_states([[1, 2], [3, COMMON["vocab_size"] + 4]], progress=False)
    assert "row 1 position 1" in str(e.value) and str(COMMON["vocab_size"] + 4) in str(e.value)


# -- mixture of experts -----------------------------------------------------------------------------------------------

MOE_COMMON = {k: v for k, v in COMMON.items() if k != "intermediate_size"}
# the sizes both DeepSeek-V3 cases share
DEEPSEEK_V3 = dict(num_attention_heads=4, num_key_value_heads=4, head_dim=None, intermediate_size=44,
                   moe_intermediate_size=16, kv_lora_rank=20)
MOE = {
    "qwen3moe-renorm-sparse-step": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, dict(
        num_experts=7, num_experts_per_tok=3, moe_intermediate_size=20, intermediate_size=36, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[1], tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=1000.0, factor=2.0, original_max_position_embeddings=16))),
    "qwen3moe-no-renorm-tied": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=20, norm_topk_prob=False,
        tie_word_embeddings=True)),
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, dict(
        num_local_experts=5, num_experts_per_tok=2, intermediate_size=28, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0))),
    "deepseek-v3-qlora-yarn": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM, dict(
        DEEPSEEK_V3, n_routed_experts=12, n_shared_experts=2, num_experts_per_tok=3, n_group=4, topk_group=2,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=24, qk_nope_head_dim=12,
        qk_rope_head_dim=8, v_head_dim=10, rope_interleave=True, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                             mscale=1.0, mscale_all_dim=0.8, beta_fast=32, beta_slow=1))),
    "deepseek-v3-no-qlora-no-renorm": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM, dict(
        DEEPSEEK_V3, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=0, routed_scaling_factor=1.7, norm_topk_prob=False, q_lora_rank=None,
        qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=14, rope_interleave=False, attention_bias=True,
        tie_word_embeddings=True)),
}


def make_moe(tmp_path, case: str, seed: int):
    cfg_cls, model_cls, extra = MOE[case]
    kwargs = {k: v for k, v in {**MOE_COMMON, **extra}.items() if v is not None or k != "head_dim"}
    config = cfg_cls(**kwargs)
    model = build(config, model_cls, tmp_path / case, seed)
    return model, open_pack(tmp_path / case)


@pytest.mark.parametrize("case", sorted(MOE))
def test_moe_matches_transformers(tmp_path, rng_seed, case):
    model, pack = make_moe(tmp_path, case, rng_seed)
    assert_oracle_matches_hf(model, pack, torch.randint(0, COMMON["vocab_size"], (3, 21)), TOL, case)


def test_experts_read_only_when_routed(tmp_path, rng_seed):
    """The experts the oracle reads are exactly those HF's router picks (from its own router logits)."""
    config = T.Qwen3MoeConfig(**{**MOE_COMMON, **MOE["qwen3moe-renorm-sparse-step"][2], "num_experts": 9,
                                 "num_experts_per_tok": 1, "mlp_only_layers": []})
    model = build(config, T.Qwen3MoeForCausalLM, tmp_path / "m", rng_seed)
    pack = open_pack(tmp_path / "m")
    tokens = torch.randint(0, COMMON["vocab_size"], (1, 3))
    with torch.no_grad():
        router_logits = model(input_ids=tokens, use_cache=False, output_router_logits=True).router_logits
    read = []
    original = pack.tensor
    pack.tensor = lambda name: (read.append(name), original(name))[1]
    Oracle(pack).logits(tokens)
    for layer, logits in enumerate(router_logits):
        routed = set(logits.topk(1, dim=-1).indices.flatten().tolist())
        fetched = {int(n.split(".experts.")[1].split(".")[0]) for n in read
                   if n.startswith(f"model.layers.{layer}.mlp.experts.")}
        assert fetched == routed and len(fetched) <= 3 < config.num_experts


# -- RoPE schedules against transformers' own init functions, legacy `rope_scaling` configs included ------------------

ROPE_CONFIGS = {
    "linear": dict(rope_theta=5e5, rope_scaling=dict(type="linear", factor=4.0)),
    "llama3": dict(rope_theta=5e5, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "yarn-deepseek-legacy": dict(rope_theta=1e4, rope_scaling=dict(
        type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1,
        original_max_position_embeddings=4096)),
    "yarn-mscale-ratio": dict(rope_theta=1e4, rope_scaling=dict(
        type="yarn", factor=16.0, mscale=0.9, mscale_all_dim=0.7, original_max_position_embeddings=2048)),
    "yarn-plain": dict(rope_theta=1e6, rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                         original_max_position_embeddings=32768)),
}


@pytest.mark.parametrize("case", sorted(ROPE_CONFIGS))
def test_rope_schedules_equal_transformers(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from fidelity.oracle.rope import RopeArgs, inverse_frequencies
    raw = {"architectures": ["LlamaForCausalLM"], "hidden_size": 1024, "num_attention_heads": 8, "head_dim": 128,
           "max_position_embeddings": 163840, **ROPE_CONFIGS[case]}
    hf_config = T.LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    rope_type = hf_config.rope_parameters["rope_type"]
    want, want_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    got, got_factor = inverse_frequencies(RopeArgs.from_config(raw, 128))
    assert torch.equal(got, want.to(torch.float32))
    assert got_factor == pytest.approx(want_factor, rel=1e-15)


def test_missing_routed_expert_fails_up_front(tmp_path, rng_seed):
    from safetensors.torch import load_file, save_file
    make_moe(tmp_path, "deepseek-v3-qlora-yarn", rng_seed)
    folder = tmp_path / "deepseek-v3-qlora-yarn"
    tensors = load_file(folder / "model.safetensors")
    victim = "model.layers.2.mlp.experts.11.down_proj.weight"
    del tensors[victim]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PackError) as e:
        Oracle(open_pack(folder))
    assert e.value.tensor == victim and victim in str(e.value)
