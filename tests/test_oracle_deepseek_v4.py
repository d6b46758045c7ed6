"""DeepSeek-V4 oracle vs transformers fp32 (eager) on tiny random models: sliding, CSA and HCA layers with contexts
longer than the window and than index_topk entries, hash-routed and biased-routed MoE layers, clamped SwiGLU,
hyper-connections; plus official-name packs and bad input."""
from __future__ import annotations

import copy
import json
import os
import shutil
from functools import partial

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from fidelity import open_pack
from fidelity.errors import ConfigError, PackError
from fidelity.oracle import Oracle
from _deepseek_configs import build_v4, edit_config, make_variant, tiny_v4
from _deepseek_configs import reference_ties_to_lower_index  # noqa: F401 (autouse)
from test_oracle_support import assert_oracle_matches_hf, hf_logits

TOL = 1e-4

BASE = tiny_v4(["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                "compressed_sparse_attention"], ["hash_moe", "hash_moe", "moe", "moe"])

CASES = {
    "mixed-default-rope": {},
    "yarn-compress-csa2-hca5-tied": dict(
        tie_word_embeddings=True,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 5},
        index_topk=4,
        hc_mult=2,
        sliding_window=7,
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        layer_types=[
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "sliding_attention",
            "compressed_sparse_attention",
        ],
        rope_parameters=dict(
            rope_type="yarn", factor=8.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1
        ),
    ),
}


make = partial(make_variant, T.DeepseekV4Config, build_v4, BASE, CASES)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The 'mixed-default-rope' model, built once per module (fresh seed, printed; FIDELITY_TEST_MODULE_SEED=N
    replays it: a failure of a test on this model needs both seeds) to keep the tests fast."""
    seed = int(os.environ.get("FIDELITY_TEST_MODULE_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"module model seed {seed}")
    folder = tmp_path_factory.mktemp("v4") / "mixed-default-rope"
    return build_v4(T.DeepseekV4Config(**BASE), folder, seed), folder


@pytest.fixture
def mixed(built, tmp_path):
    """(a private copy of the built model, its pack folder copied to tmp_path: tests may edit both)."""
    model, folder = built
    shutil.copytree(folder, tmp_path / "mixed-default-rope")
    return copy.deepcopy(model), tmp_path / "mixed-default-rope"


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers_past_window_and_topk(tmp_path, rng_seed, case):
    model, pack = make(tmp_path, case, rng_seed)
    cfg = model.config
    T_len = 26
    assert T_len > cfg.sliding_window and T_len // cfg.compress_rates["compressed_sparse_attention"] > cfg.index_topk
    tokens = torch.randint(0, cfg.vocab_size, (2, T_len))
    assert_oracle_matches_hf(model, pack, tokens, TOL, f"{case}: T={T_len}")


def official_name(saved: str) -> str:
    """transformers' save_pretrained V4 name -> DeepSeek's official checkpoint name."""
    special = {"model.embed_tokens.weight": "embed.weight", "model.hc_head.hc_fn": "hc_head_fn",
               "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
    if saved in special:
        return special[saved]
    name = saved.removeprefix("model.")
    return name.replace(".attn.norm.", ".attn.kv_norm.")


@pytest.mark.parametrize("naming", ["official", "exl3-hf"])
def test_official_and_exl3_names_load(mixed, rng_seed, naming):
    """The same weights stored under DeepSeek's official names, or under the Hugging Face names the EXL3 layouts map
    official names to, give the same logits as transformers."""
    from fidelity.packs.exl3.layouts import official_to_hf
    model, folder = mixed
    tensors = load_file(folder / "model.safetensors")
    rename = official_name if naming == "official" else (lambda n: official_to_hf(official_name(n)))
    renamed = {rename(k): v for k, v in tensors.items()}
    assert len(renamed) == len(tensors)
    if naming == "official":
        assert "layers.1.attn.kv_norm.weight" in renamed and "layers.0.ffn.experts.3.w2.weight" in renamed
    else:
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in renamed
    save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    tokens = torch.randint(0, BASE["vocab_size"], (1, 17))
    got = Oracle(open_pack(folder)).logits(tokens)
    assert (got - hf_logits(model, tokens)).abs().max().item() <= TOL


def test_official_config_keys(tmp_path, rng_seed):
    """A config.json in the official style (compress_ratios 0/4/128, num_hash_layers, qk_rope_head_dim, flat
    rope_scaling; compress_ratios running past the layers, onto the MTP block) reads like transformers folds it; a
    140-token row finishes one 128-token HCA window."""
    over = dict(layer_types=None, mlp_layer_types=None, compress_rates=None, partial_rotary_factor=None,
                compress_ratios=[128, 4, 0, 4], num_hash_layers=1, qk_rope_head_dim=4, num_hidden_layers=4,
                rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64))
    model, pack = make(tmp_path, "mixed-default-rope", rng_seed, **over)
    official = {k: v for k, v in BASE.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates",
                                                           "partial_rotary_factor")}
    official.update(architectures=["DeepseekV4ForCausalLM"], compress_ratios=[128, 4, 0, 4, 4], num_hash_layers=1,
                    qk_rope_head_dim=4, rope_theta=10000.0, compress_rope_theta=160000.0,
                    rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=64),
                    hc_eps=1e-6, scoring_func="sqrtsoftplus")
    (tmp_path / "mixed-default-rope" / "config.json").write_text(json.dumps(official))
    tokens = torch.randint(0, BASE["vocab_size"], (1, 140))
    got = Oracle(open_pack(tmp_path / "mixed-default-rope")).logits(tokens)
    assert (got - hf_logits(model, tokens)).abs().max().item() <= TOL


def test_indexer_keeps_top_k_and_selection_matters(mixed, rng_seed):
    """Late queries of a CSA layer keep exactly index_topk of their finished entries (fewer than they have), and
    keeping all of them instead moves the logits well past the tolerance."""
    from fidelity.oracle.deepseek import dsv4_ops as deepseek_v4
    pack = open_pack(mixed[1])
    tokens = torch.randint(0, BASE["vocab_size"], (1, 30))
    kept = []
    original = deepseek_v4.Indexer.selected

    def spy(self, *args):
        keep = original(self, *args)
        kept.append(keep)
        return keep

    deepseek_v4.Indexer.selected = spy
    try:
        sparse = Oracle(pack).logits(tokens)
    finally:
        deepseek_v4.Indexer.selected = original
    finished = deepseek_v4.finished_entries(30, 3, "cpu")
    assert len(kept) == 2
    for keep in kept:
        assert bool((keep[0] <= finished).all())
        assert keep[0].sum(-1).tolist()[-1] == BASE["index_topk"] < int(finished[-1].sum())
    dense_oracle = Oracle(pack)
    dense_oracle.family.args.index_topk = 10**9     # every finished entry kept: the indexer is not run
    deepseek_v4.Indexer.selected = lambda *a: pytest.fail("indexer run although it keeps every entry")
    try:
        dense = dense_oracle.logits(tokens)
    finally:
        deepseek_v4.Indexer.selected = original
    assert (dense - sparse).abs().max().item() > 100 * TOL


def test_hash_routing_reads_the_table(mixed, rng_seed):
    """Hash layers read exactly the experts tid2eid names for the row's tokens."""
    model, pack = mixed[0], open_pack(mixed[1])
    tokens = torch.randint(0, BASE["vocab_size"], (1, 3))
    read = []
    original = pack.tensor
    pack.tensor = lambda name: (read.append(name), original(name))[1]
    Oracle(pack).logits(tokens)
    table = model.model.layers[0].mlp.gate.tid2eid
    want = set(table[tokens[0]].flatten().tolist())
    got = {int(n.split(".experts.")[1].split(".")[0]) for n in read if n.startswith("model.layers.0.ffn.experts.")}
    assert got == want


# -- bad input --------------------------------------------------------------------------------------------------------

def test_missing_tensor_named_in_stored_naming(mixed):
    folder = mixed[1]
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.3.attn.indexer.compressor.ape"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PackError, match=r"layers\.3\.attn\.indexer\.compressor\.ape"):
        Oracle(open_pack(folder))


@pytest.mark.parametrize("edit,needle", [
    (dict(layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]),
     "layer_types"),
    (dict(index_topk=None), "index_n_heads/index_head_dim/index_topk"),
    (dict(scoring_func="relu"), "scoring_func 'relu'"),
    (dict(mlp_layer_types=["moe"]), "mlp_layer_types"),
    (dict(hc_mult=None), "'hc_mult'"),
])
def test_bad_config_named(mixed, edit, needle):
    edit_config(mixed[1], **edit)
    with pytest.raises(ConfigError) as e:
        Oracle(open_pack(mixed[1]))
    assert needle in str(e.value) and "DeepseekV4ForCausalLM" in str(e.value)


def test_rows_of_different_lengths_including_shorter_than_a_window(mixed, rng_seed):
    model, pack = mixed[0], open_pack(mixed[1])
    rows = [torch.randint(0, BASE["vocab_size"], (n,)).tolist() for n in (1, 2, 9, 21)]
    oracle = Oracle(pack)
    for row, h in zip(rows, oracle.hidden_states(rows, progress=False)):
        assert (oracle.apply_head(h) - hf_logits(model, torch.tensor([row]))[0]).abs().max().item() <= TOL


def test_query_chunking_changes_nothing(mixed, rng_seed, monkeypatch):
    """One query per chunk in the attention and the indexer (what long rows get) gives transformers' logits too."""
    from fidelity.oracle.deepseek import dsv4_ops as deepseek_v4
    model, pack = mixed[0], open_pack(mixed[1])
    monkeypatch.setattr(deepseek_v4, "ATTENTION_CHUNK_BYTES", 1)
    tokens = torch.randint(0, BASE["vocab_size"], (2, 20))
    assert (Oracle(pack).logits(tokens) - hf_logits(model, tokens)).abs().max().item() <= TOL


@pytest.mark.parametrize("edit,needle", [
    (dict(layer_types=None, compress_ratios=[0, 4, -1, 4]), "compress_ratios"),
    (dict(layer_types=None, compress_ratios=[0, 4]), "compress_ratios"),
    (dict(o_groups=3), "o_groups 3"),
])
def test_more_bad_configs_named(mixed, edit, needle):
    edit_config(mixed[1], **edit)
    with pytest.raises(ConfigError) as e:
        Oracle(open_pack(mixed[1]))
    assert needle in str(e.value) and "DeepseekV4ForCausalLM" in str(e.value)
