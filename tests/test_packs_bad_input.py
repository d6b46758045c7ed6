"""Bad input across formats: tensor shapes disagreeing with config.json, unknown quant_method, scale tensors of a
type no format uses. Each error names the file and the tensor. (Per-format scale grids and NaN scales are tested
beside each format: test_packs_fp8/fp4/compressed.)"""
import json

import pytest
import torch

from fidelity import PackError, open_pack
from fidelity.commands.inspect import inspect_pack
from fidelity.packs.config_check import check_against_config, config_problems
from fidelity.packs.safetensors_io import write_safetensors

CFG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 50, "hidden_size": 16, "intermediate_size": 24,
       "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}


def llama_tensors(n_layers=2, hidden=16, vocab=50, inter=24, q_out=16, kv_out=8):
    t = {"model.embed_tokens.weight": torch.randn(vocab, hidden), "lm_head.weight": torch.randn(vocab, hidden),
         "model.norm.weight": torch.randn(hidden)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": torch.randn(q_out, hidden),
                  p + "self_attn.k_proj.weight": torch.randn(kv_out, hidden),
                  p + "self_attn.v_proj.weight": torch.randn(kv_out, hidden),
                  p + "self_attn.o_proj.weight": torch.randn(hidden, q_out),
                  p + "mlp.gate_proj.weight": torch.randn(inter, hidden),
                  p + "mlp.up_proj.weight": torch.randn(inter, hidden),
                  p + "mlp.down_proj.weight": torch.randn(hidden, inter),
                  p + "input_layernorm.weight": torch.randn(hidden),
                  p + "post_attention_layernorm.weight": torch.randn(hidden)})
    return t


def write_pack(path, tensors, cfg):
    write_safetensors(path / "model.safetensors", tensors)
    (path / "config.json").write_text(json.dumps(cfg))
    return open_pack(path)


def test_consistent_pack_has_no_problems(tmp_path):
    pack = write_pack(tmp_path, llama_tensors(), CFG)
    check_against_config(pack)
    assert config_problems(pack) == [] and inspect_pack(str(tmp_path))["problems"] == []


def test_explicit_head_dim_is_used(tmp_path):
    """Qwen3-style: head_dim * heads != hidden_size."""
    cfg = dict(CFG, head_dim=8)
    pack = write_pack(tmp_path, llama_tensors(q_out=32, kv_out=16), cfg)
    check_against_config(pack)


def test_embed_tokens_disagreeing_with_vocab_size(tmp_path):
    t = llama_tensors()
    t["model.embed_tokens.weight"] = torch.randn(49, 16)
    pack = write_pack(tmp_path, t, CFG)
    with pytest.raises(
        PackError,
        match=r"\[49, 16\] disagrees with .*config\.json: vocab_size x hidden_size = \[50, 16\]"
        r".*embed_tokens\.weight.*model\.safetensors",
    ) as e:
        check_against_config(pack)
    assert e.value.tensor == "model.embed_tokens.weight"
    assert any("embed_tokens" in p for p in inspect_pack(str(tmp_path))["problems"])


def test_kv_heads_and_hidden_size_disagreement_lists_every_tensor(tmp_path):
    pack = write_pack(tmp_path, llama_tensors(kv_out=16), CFG)
    names = sorted(e.tensor for e in config_problems(pack))
    assert names == sorted(f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "kv")
    with pytest.raises(PackError, match=r"kv_out x hidden_size = \[8, 16\] \(and 3 more\)"):
        check_against_config(pack)


def test_layer_count_disagreement(tmp_path):
    pack = write_pack(tmp_path, llama_tensors(n_layers=2), dict(CFG, num_hidden_layers=3))
    with pytest.raises(PackError, match=r"num_hidden_layers=3.*\[2\].*model\.layers\.2"):
        check_against_config(pack)
    pack = write_pack(tmp_path, llama_tensors(n_layers=3), CFG)
    with pytest.raises(PackError, match=r"num_hidden_layers=2.*layers up to 2.*model\.layers\.2"):
        check_against_config(pack)


def test_deepseek_mtp_layer_is_not_a_problem(tmp_path):
    pack = write_pack(tmp_path, llama_tensors(n_layers=3), dict(CFG, num_nextn_predict_layers=1))
    check_against_config(pack)


def test_quantized_tensor_shape_checked_in_logical_form(tmp_path):
    """An FP8 lm_head checks its logical [vocab, hidden] shape, not its scales."""
    t = llama_tensors()
    t["lm_head.weight"] = torch.randn(48, 16).to(torch.float8_e4m3fn)
    t["lm_head.weight_scale_inv"] = torch.ones(1, 1)
    pack = write_pack(
        tmp_path, t, dict(CFG, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    )
    assert [e.tensor for e in config_problems(pack)] == ["lm_head.weight"]


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes"])
def test_unknown_quant_method_names_config_file(tmp_path, method):
    write_safetensors(tmp_path / "model.safetensors", {"a.weight": torch.randn(2, 2)})
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": method}}))
    with pytest.raises(PackError, match=rf"unknown quant_method '{method}'.*compressed-tensors.*fp8.*config\.json"):
        open_pack(tmp_path)


def test_scale_of_an_integer_type(tmp_path):
    t = {
        "a.weight": torch.randn(4, 4).to(torch.float8_e4m3fn),
        "a.weight_scale_inv": torch.ones(1, 1, dtype=torch.int32),
    }
    write_safetensors(tmp_path / "model.safetensors", t)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(PackError, match=r"scale dtype I32.*a\.weight_scale_inv.*model\.safetensors"):
        open_pack(tmp_path).tensor("a.weight")


def test_mla_attention_and_vision_tower_are_not_false_problems(tmp_path):
    """DeepSeek-V2-Lite MLA: q_proj is heads x (nope + rope), o_proj reads heads x v_head_dim; a vision tower's own
    layers neither count as language-model layers nor use its sizes."""
    t = llama_tensors()
    for i in range(2):
        p = f"model.layers.{i}.self_attn."
        del t[p + "k_proj.weight"], t[p + "v_proj.weight"]
        t[p + "q_proj.weight"] = torch.randn(4 * (6 + 2), 16)
        t[p + "o_proj.weight"] = torch.randn(16, 4 * 5)
    t["vision_tower.encoder.layers.7.self_attn.q_proj.weight"] = torch.randn(3, 3)
    cfg = dict(CFG, kv_lora_rank=4, qk_nope_head_dim=6, qk_rope_head_dim=2, v_head_dim=5)
    check_against_config(write_pack(tmp_path, t, cfg))
    cfg["v_head_dim"] = 4
    with pytest.raises(PackError, match=r"hidden_size x o_in = \[16, 16\].*o_proj\.weight"):
        check_against_config(write_pack(tmp_path, t, cfg))


def test_multimodal_prefix_checked_against_text_config(tmp_path):
    t = {k.replace("model.", "model.language_model.", 1): v for k, v in llama_tensors().items()}
    t["model.language_model.layers.1.mlp.up_proj.weight"] = torch.randn(25, 16)
    pack = write_pack(tmp_path, t, {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": CFG})
    assert [e.tensor for e in config_problems(pack)] == ["model.language_model.layers.1.mlp.up_proj.weight"]


def test_inspect_cli_prints_the_tensor_and_file_of_a_problem(tmp_path, capsys):
    """Problems quote "[tensor ..., file ...]", which rich would otherwise swallow as markup."""
    import argparse

    from fidelity.commands import inspect as inspect_command
    from fidelity.environment import Environment

    t = llama_tensors()
    t["lm_head.weight"] = torch.randn(51, 16)
    write_pack(tmp_path, t, CFG)
    args = argparse.Namespace(pack=str(tmp_path), json_out=None, decode=False, environment=Environment.from_environ({}))
    rc = inspect_command.run(args)
    out = capsys.readouterr().out
    assert rc == 1 and "'lm_head.weight'" in out and "model.safetensors" in out
