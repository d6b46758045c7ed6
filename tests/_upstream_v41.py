"""DeepSeek's own V4.1 `inference/model.py` dumps (../shared/golden/deepseek_v41, its README says how they were made) as
packs our oracle opens: the dump's parameters written as one native safetensors file under their official names, and
upstream's `ModelArgs` mapped key by key to our V4.1 config.json.

    from _upstream_v41 import GOLDEN, write_upstream_pack
    folder = write_upstream_pack(GOLDEN / "model_forward.json", tmp_path)  # the trunk alone
    # + dspark_forward.json's drafter:
    folder = write_upstream_pack(GOLDEN / "model_forward.json", tmp_path, with_mtp=True)
    # a control: one field changed:
    folder = write_upstream_pack(GOLDEN / "model_forward.json", tmp_path, swiglu_limit=6.0)

The fixtures are read where they lie, never copied into the repository; tests skip when they are absent (`GOLDEN`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

# ../shared beside the checkout; FIDELITY_SHARED names another copy (the device machine, where ../shared does not
# travel)
SHARED = Path(os.environ.get("FIDELITY_SHARED") or Path(__file__).resolve().parents[2] / "shared")
GOLDEN = SHARED / "golden" / "deepseek_v41"
DSPARK_FIXTURE = "dspark_forward.json"


def load_fixture(fixture_json) -> dict:
    """A fixture's parsed JSON from its path (or the dict itself, already parsed)."""
    return fixture_json if isinstance(fixture_json, dict) else json.loads(Path(fixture_json).read_text())


def upstream_config(c: dict) -> dict:
    """upstream ModelArgs -> our V4.1 config.json, key by key (sliding layers rope at rope_theta, compressing ones at
    compress_rope_theta with YaRN; no hash layers; untied head)."""
    partial = c["rope_head_dim"] / c["head_dim"]
    return dict(
        architectures=["DeepseekV41ForCausalLM"], model_type="deepseek_v41", vocab_size=c["vocab_size"],
        hidden_size=c["dim"], num_hidden_layers=c["n_layers"], num_attention_heads=c["n_heads"],
        head_dim=c["head_dim"], qk_rope_head_dim=c["rope_head_dim"], partial_rotary_factor=partial,
        q_lora_rank=c["q_lora_rank"], o_groups=c["o_groups"], o_lora_rank=c["o_lora_rank"],
        sliding_window=c["window_size"], index_n_heads=c["index_n_heads"], index_head_dim=c["index_head_dim"],
        index_topk=c["index_topk"], hc_mult=c["hc_mult"], hc_sinkhorn_iters=c["hc_sinkhorn_iters"], hc_eps=c["hc_eps"],
        rms_norm_eps=c["norm_eps"], max_position_embeddings=c["max_seq_len"], n_routed_experts=c["n_routed_experts"],
        num_experts_per_tok=c["n_activated_experts"], moe_intermediate_size=c["moe_inter_dim"], n_shared_experts=1,
        routed_scaling_factor=c["route_scale"], swiglu_limit=c["swiglu_limit"], scoring_func="sqrtsoftplus",
        compress_ratios=list(c["compress_ratios"]), kv_source_layer_ids=list(c["kv_source_layers"]),
        index_source_layer_ids=list(c["index_source_layers"]), candidate_source_layer_id=c["candidate_source_layer"],
        candidate_topk_blocks=c["candidate_topk_blocks"], candidate_block_size=c["candidate_block_size"],
        num_hash_layers=0, tie_word_embeddings=False, hidden_act="silu",
        rope_parameters={
            "main": {"rope_type": "default", "rope_theta": c["rope_theta"], "partial_rotary_factor": partial},
            "compress": {"rope_type": "yarn", "rope_theta": c["compress_rope_theta"], "factor": c["rope_factor"],
                         "original_max_position_embeddings": c["original_seq_len"], "beta_fast": 32, "beta_slow": 1,
                         "attention_factor": 1.0, "partial_rotary_factor": partial}})


def dspark_config(c: dict) -> dict:
    """upstream ModelArgs' DSpark fields -> the keys mtp.py reads. Upstream's compress_ratios run on past the trunk
    (one 0 per drafter block), which is how the official config.json counts the drafter's blocks too."""
    return dict(dspark_block_size=c["dspark_block_size"], dspark_noise_token_id=c["dspark_noise_token_id"],
                dspark_target_layer_ids=list(c["dspark_target_layer_ids"]), dspark_markov_rank=c["dspark_markov_rank"],
                dspark_num_experts=c["dspark_n_routed_experts"],
                dspark_num_experts_per_tok=c["dspark_n_activated_experts"],
                compress_ratios=list(c["compress_ratios"]))


def tensors_of(values: dict, shapes: dict) -> dict[str, torch.Tensor]:
    """The dump's flattened float32 values (9 significant digits: each parses back to its float32) as tensors."""
    return {name: torch.tensor(v, dtype=torch.float32).reshape(shapes[name]) for name, v in values.items()}


def write_upstream_pack(fixture_json, tmp_dir, with_mtp=False, **config_over) -> Path:
    """Writes model_forward.json (`fixture_json`: its path or parsed dict) as a native V4.1 pack in `tmp_dir`
    (model.safetensors + config.json) and returns the folder. `with_mtp`: also the DSpark drafter of
    dspark_forward.json (True: the one beside `fixture_json`; or its path / parsed dict), whose config (same backbone)
    then supplies the DSpark keys. `config_over`: config.json keys set last (a control's one changed field)."""
    from safetensors.torch import save_file
    trunk = load_fixture(fixture_json)
    tensors = tensors_of(trunk["params"], trunk["shapes"])
    config = upstream_config(trunk["config"])
    if with_mtp is not False:
        if with_mtp is True:
            if isinstance(fixture_json, dict):
                raise ValueError("with_mtp=True finds dspark_forward.json beside the trunk fixture's path; given the "
                                 "parsed trunk fixture, pass the drafter's fixture (path or dict) as with_mtp")
            with_mtp = Path(fixture_json).with_name(DSPARK_FIXTURE)
        drafter = load_fixture(with_mtp)
        backbone = {k: v for k, v in drafter["config"].items()
                    if k in trunk["config"] and k not in ("compress_ratios", "n_mtp_layers")}
        differ = {k for k, v in backbone.items() if v != trunk["config"][k]}
        if differ:
            raise ValueError(f"the drafter's fixture describes another backbone: {sorted(differ)} differ")
        tensors.update(tensors_of(drafter["mtp_params"], drafter["mtp_shapes"]))
        config.update(dspark_config(drafter["config"]))
    folder = Path(tmp_dir)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**config, **config_over}, indent=1))
    return folder
