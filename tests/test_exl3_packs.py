"""Standard exllamav3 checkpoints (golden tiny Llama converted by exllamav3 1.6.5) open with open_pack and decode. The
golden data: ../shared/golden/exl3, else the committed subset (tests/_golden.py), which holds exl3_4p0_mul1, digests of
the unquantized model's tensors and 4 positions of the golden logits."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import _golden
from fidelity import PackError, open_pack

MODELS = ("exl3_4p0_mul1", "exl3_3p0_3inst")


@pytest.fixture(scope="module")
def golden_models(tmp_path_factory):
    """Unpacked checkpoints by name, on first use (the subset has no exl3_3p0_3inst and no unquantized model)."""
    class Models(dict):
        def __missing__(self, name):
            self[name] = _golden.exl3_checkpoint(name, tmp_path_factory.mktemp(name))
            return self[name]
    return Models()


def _original(golden_models) -> _golden.Golden:
    """The unquantized model's tensors; from the subset, their digests only."""
    if (_golden.EXL3_FULL / "tiny_llama_fp16.tar.gz").exists():
        return _golden.exl3_original(golden_models["tiny_llama_fp16"])
    return _golden.exl3_original(None)


@pytest.mark.parametrize("model", MODELS)
def test_golden_checkpoint_opens_and_every_linear_decodes(golden_models, model):
    pack = open_pack(golden_models[model])
    orig = _original(golden_models)
    assert pack.format == "exl3"
    assert sorted(pack.names()) == sorted(orig.keys())
    qc = json.loads((golden_models[model] / "quantization_config.json").read_text())
    bits, codebook = qc["bits"], qc["codebook"]
    n_exl3 = 0
    for name in pack.names():
        s = pack.storage(name)
        t = pack.tensor(name)
        assert t.shape == orig.shape(name), name
        if s.format != "exl3":
            assert orig.same_bits(name, t.half()) and torch.equal(t.half().float(), t), name
            continue
        n_exl3 += 1
        K = 6 if name == "lm_head.weight" else bits
        assert s.dtype == f"exl3 K={K:g} {codebook}", name
        if orig.full:   # the subset's digests cannot give an error; its logits test checks every linear's numbers
            rel = ((t - orig[name].float()).pow(2).mean() / orig[name].float().pow(2).mean()).item()
            # EXL3's error roughly quarters per extra bit; a wrong permutation or scale would give rel >= 1
            assert rel < {3: 0.06, 4: 0.015, 6: 0.003}[K], (name, rel)
    assert n_exl3 == 15


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_golden_logits_close_to_exllamav3_dequantized(golden_models, model):
    from fidelity.oracle import Oracle

    pack = open_pack(golden_models[model])
    logits = _golden.exl3_logits()
    ours = Oracle(pack).logits(logits["input_ids"])
    ref = logits[f"logits.{model}.dequant_hf_fp32"]      # transformers on exllamav3's fp16-rounded weights
    quant_effect = (ref - logits["logits.orig.hf_fp32"]).abs().max().item()
    diff = (ours - ref).abs().max().item()
    assert diff < 0.02 and diff < 0.05 * quant_effect, (diff, quant_effect)


def _copy(golden_models, tmp_path, model="exl3_4p0_mul1"):
    dst = tmp_path / model
    shutil.copytree(golden_models[model], dst)
    return dst


def _edit_tensors(path, fn):
    f = path / "model.safetensors"
    ts = load_file(f)
    fn(ts)
    save_file(ts, str(f))


def test_stated_bits_disagreeing_with_trellis(golden_models, tmp_path):
    dst = _copy(golden_models, tmp_path)
    q = json.loads((dst / "quantization_config.json").read_text())
    q["tensor_storage"]["model.layers.1.mlp.up_proj"]["bits_per_weight"] = 5
    (dst / "quantization_config.json").write_text(json.dumps(q))
    with pytest.raises(
        PackError, match=r"states K=5 .* implies K=4.*model\.layers\.1\.mlp\.up_proj\.trellis.*model\.safetensors"
    ):
        open_pack(dst)


@pytest.mark.parametrize("edit,needle", [
    (lambda ts: ts.pop("model.layers.0.self_attn.q_proj.suh"), r"no suh .*q_proj\.suh.*model\.safetensors"),
    (lambda ts: ts.__setitem__("model.layers.0.mlp.up_proj.svh", torch.ones(128).half()),
     r"svh has shape \[128\].*needs \[256\].*up_proj\.svh.*model\.safetensors"),
    (lambda ts: ts.__setitem__("model.layers.0.mlp.up_proj.trellis", torch.zeros(8, 16, 20, dtype=torch.int16)),
     r"not divisible by 16.*up_proj\.trellis.*model\.safetensors"),
    (lambda ts: ts.__setitem__("model.layers.0.mlp.up_proj.trellis", torch.zeros(8, 16, 144, dtype=torch.int16)),
     r"K=9, outside 1\.\.8.*up_proj\.trellis.*model\.safetensors"),
])
def test_bad_exl3_tensors_name_tensor_and_file(golden_models, tmp_path, edit, needle):
    dst = _copy(golden_models, tmp_path)
    (dst / "quantization_config.json").unlink()   # no stated K: the shape checks themselves must fire
    _edit_tensors(dst, edit)
    with pytest.raises(PackError, match=needle):
        open_pack(dst)


def test_bias_is_its_own_logical_tensor_cut_to_the_config_shape(golden_models, tmp_path, rng_seed):
    dst = _copy(golden_models, tmp_path)
    bias = torch.randn(128).half()                       # k_proj has 64 outputs, stored padded to 128
    _edit_tensors(dst, lambda ts: ts.__setitem__("model.layers.0.self_attn.k_proj.bias", bias))
    pack = open_pack(dst)
    assert pack.storage("model.layers.0.self_attn.k_proj.bias").shape == (64,)
    assert torch.equal(pack.tensor("model.layers.0.self_attn.k_proj.bias"), bias[:64].float())
    assert pack.tensor("model.layers.0.self_attn.k_proj.weight").shape == (64, 128)


def test_legacy_sign_bitfields_decode_like_the_signs_they_encode(golden_models, tmp_path):
    from fidelity.packs.exl3 import codec

    dst = _copy(golden_models, tmp_path)
    base = "model.layers.1.mlp.down_proj"
    ts = load_file(dst / "model.safetensors")
    signs_u, signs_v = ts[f"{base}.suh"].sign(), ts[f"{base}.svh"].sign()

    def bits(signs):
        neg = (signs < 0).to(torch.int64).view(-1, 16)
        words = (neg << torch.arange(16)).sum(1)
        return (((words + 32768) & 0xFFFF) - 32768).to(torch.int16)

    def edit(t):
        t[f"{base}.su"], t[f"{base}.sv"] = bits(signs_u), bits(signs_v)
        del t[f"{base}.suh"], t[f"{base}.svh"]
    _edit_tensors(dst, edit)
    got = open_pack(dst).tensor(f"{base}.weight")
    ref = codec.decode_weight(ts[f"{base}.trellis"], signs_u, signs_v, "mul1")
    assert torch.equal(got, ref)
