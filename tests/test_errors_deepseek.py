"""Bad input to the DeepSeek drafters (fidelity.oracle.deepseek.mtp) and to the V4.1 config (deepseek_v41): each
error names the architecture, layer, option or tensor it is about. Tiny packs from the builders of
test_oracle_deepseek_mtp / test_oracle_deepseek_v41 and the checked-in tiny V4 fixture."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from fidelity import open_pack
from fidelity.errors import ConfigError, FidelityError, PackError
from fidelity.oracle import Oracle, family_for
from fidelity.oracle.deepseek.mtp import DSPARK_ARCHS, NEXTN_ARCHS, DSparkDrafter, NextNDrafter
from _deepseek_configs import edit_config
from test_oracle import COMMON
from test_oracle_deepseek_mtp import build as build_dspark
from test_oracle_deepseek_mtp import build_v3_mtp
from test_oracle_deepseek_v41 import base_config
from test_oracle_support import build as build_hf

TINY_V4 = Path(__file__).parent / "fixtures" / "v4" / "tiny_v4"


@pytest.fixture(scope="module")
def dspark(tmp_path_factory):
    """A V4 trunk + DSpark drafter pack (the MTP tests' builder); tests copy it before editing."""
    *_, folder = build_dspark(tmp_path_factory.mktemp("dspark"), 11)
    return folder


def copy_of(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    build_hf(T.LlamaConfig(**{**COMMON, "tie_word_embeddings": False}), T.LlamaForCausalLM, folder, 3)
    return folder


# ---------------------------------------------------------------------------------------------------------------------
# DSpark
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [0, -2, None])
def test_dspark_block_size_must_be_positive(dspark, tmp_path, block):
    folder = edit_config(copy_of(dspark, tmp_path), dspark_block_size=block)
    with pytest.raises(ConfigError, match=r"config\.json of DeepseekV4ForCausalLM has no positive 'dspark_block_size'"):
        Oracle(open_pack(folder)).drafter()


def test_drafter_of_an_architecture_without_one(llama):
    """A Llama pack: `oracle.drafter()` names the architecture and the ones that have drafters; the drafters' own
    constructors refuse it too, each naming what it is implemented for."""
    oracle = Oracle(open_pack(llama))
    with pytest.raises(ConfigError, match=r"runs no drafter of LlamaForCausalLM packs") as err:
        oracle.drafter()
    assert all(arch in str(err.value) for arch in DSPARK_ARCHS + NEXTN_ARCHS)
    with pytest.raises(ConfigError, match=r"DSpark drafter is implemented for .*DeepseekV41ForCausalLM'\] packs, "
                                          r"not LlamaForCausalLM"):
        DSparkDrafter(oracle)
    with pytest.raises(ConfigError, match=r"next-token-prediction module is implemented for .*, not LlamaForCausalLM"):
        NextNDrafter(oracle)


def test_v4_pack_without_a_drafter(tmp_path):
    """The tiny V4 fixture has no drafter: without DSpark keys the config error names the key; with them, the pack
    error names the first missing drafter tensor and the pack's folder (and no block index below 0)."""
    folder = copy_of(TINY_V4, tmp_path)
    oracle = Oracle(open_pack(folder))
    with pytest.raises(ConfigError, match=r"DeepseekV4ForCausalLM has no 'dspark_target_layer_ids'"):
        oracle.drafter()
    with pytest.raises(ConfigError, match=r"next-token-prediction module is implemented for .*, not "
                                          r"DeepseekV4ForCausalLM"):
        NextNDrafter(oracle)
    edit_config(folder, dspark_target_layer_ids=[0, 2], dspark_block_size=4, dspark_noise_token_id=1)
    with pytest.raises(PackError, match=r"no complete DSpark drafter: lacks \d+ tensor\(s\), first "
                                        r"'mtp\.0\.main_proj\.weight'") as err:
        Oracle(open_pack(folder)).drafter()
    assert err.value.tensor == "mtp.0.main_proj.weight" and err.value.file == str(folder)
    assert "mtp.-1" not in str(err.value)


def test_drafter_with_a_tap_projection_but_no_block(dspark, tmp_path):
    """mtp.0.main_proj/main_norm stored, no block: the error names block 0's first tensor, not a block -1."""
    folder = copy_of(dspark, tmp_path)
    tensors = {k: v for k, v in load_file(folder / "model.safetensors").items()
               if not k.startswith("mtp.") or k.startswith("mtp.0.main_")}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PackError, match=r"no complete DSpark drafter.* first 'mtp\.0\.") as err:
        DSparkDrafter(Oracle(open_pack(folder)))
    assert err.value.tensor.startswith("mtp.0.") and "mtp.-1" not in str(err.value)


@pytest.mark.parametrize("tokens, starts, message", [
    ([1, 2, 3, 4], [1], r"tokens must be a \[batch, length >= 1\] tensor .*got shape \[4\]"),
    ([[[1, 2, 3]]], [1], r"tokens must be a \[batch, length >= 1\] tensor .*got shape \[1, 1, 3\]"),
    ([[], []], None, r"tokens must be a \[batch, length >= 1\] tensor .*got shape \[2, 0\]"),
    ([[1, 2, 3, 4]], [], r"draft starts must be seed positions 0\.\.3 .*got \[\]"),
    ([[1, 2, 3, 4]], [2, -1, 4], r"draft starts must be seed positions 0\.\.3 .*got \[-1, 4\]"),
])
def test_draft_inputs_named(dspark, tokens, starts, message):
    drafter = Oracle(open_pack(dspark)).drafter()
    with pytest.raises(FidelityError, match=message):
        drafter.draft(torch.tensor(tokens), starts)


# ---------------------------------------------------------------------------------------------------------------------
# the V3 / V3.2 MTP module
# ---------------------------------------------------------------------------------------------------------------------
def test_nextn_depth_other_than_one(tmp_path):
    *_, folder = build_v3_mtp(tmp_path, 4, nextn=2)
    oracle = Oracle(open_pack(folder))
    with pytest.raises(ConfigError, match=r"DeepseekV3ForCausalLM: num_nextn_predict_layers is 2; the MTP module is "
                                          r"implemented for exactly 1$"):
        oracle.drafter()
    edit_config(folder, num_nextn_predict_layers=1)
    assert isinstance(Oracle(open_pack(folder)).drafter(), NextNDrafter)   # the same pack with depth 1 is accepted


# ---------------------------------------------------------------------------------------------------------------------
# V4.1 config
# ---------------------------------------------------------------------------------------------------------------------
def v41_config(**over) -> dict:
    cfg = base_config(**{k: v for k, v in over.items() if v is not None})
    return {k: v for k, v in cfg.items() if k not in over or over[k] is not None}


@pytest.mark.parametrize("over, message", [
    (dict(compress_ratios=None), r"config\.json of DeepseekV41ForCausalLM has no compress_ratios"),
    (dict(index_source_layer_ids=[0, 1, 3, 4]),
     r"index_source_layer_ids names layer 0, which has no compressed pool to index \(compress_ratios\[0\] = 0\)"),
    (dict(candidate_topk_blocks=0), r"candidate_source_layer_id 3 needs candidate_topk_blocks and "
                                    r"candidate_block_size > 0, got 0 and 3"),
    (dict(candidate_block_size=-1), r"candidate_source_layer_id 3 needs .* got 2 and -1"),
    (dict(candidate_source_layer_id=1),
     r"layer 3 would filter by layer 1's candidate blocks but reads another pool \(layer 3's\)"),
    (dict(candidate_source_layer_id=9), r"candidate_source_layer_id 9 is not an index source layer"),
    (dict(candidate_source_layer_id=-2), r"candidate_source_layer_id -2 is neither a layer nor -1"),
    (dict(kv_source_layer_ids=[]), r"layer 1 compresses \(ratio 2\) but no kv_source_layer_ids entry is at or before "
                                   r"it$"),
    (dict(engram_layer_ids=[7]), r"engram_layer_ids names layer 7, outside the model's 5 layers"),
    (dict(engram_compressed_vocab_size=None), r"DeepseekV41ForCausalLM has no engram_compressed_vocab_size"),
])
def test_v41_config_errors_name_the_layer(over, message):
    cfg = v41_config(**over)
    assert all(cfg.get(k) == v for k, v in over.items())   # the edit reached the config
    with pytest.raises(ConfigError, match=message):
        family_for(cfg)
    nested = {"architectures": cfg["architectures"], "text_config": {k: v for k, v in cfg.items()
                                                                      if k != "architectures"}}
    with pytest.raises(ConfigError, match=message):       # the released layout: the model under text_config
        family_for(nested)


def test_v41_final_collapse_of_foreign_streams():
    """The final collapse needs the pre its pass's last layer carried; streams no layer produced are refused."""
    fam = family_for(base_config())
    streams = torch.randn(1, 5, fam.args.hc_mult, fam.hidden_size)
    with pytest.raises(FidelityError, match=r"final collapse: these streams did not come out of the last layer"):
        fam.final_hook(streams, None)
