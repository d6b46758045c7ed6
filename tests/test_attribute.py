"""fidelity.measuring.attribute on tiny random Llamas: swap-one-in KL, layer divergence, weight error and sensitivity
against HF transformers and numpy written here."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
import transformers as T
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file, save_file

from fidelity.measuring.attribute import Settings, attribute, noise_seed
from fidelity.errors import ConfigError, PackError
from test_oracle import COMMON, DENSE
from test_oracle_support import build

CASE = "llama-llama3-untied-bias"
CHANGED = ("model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.up_proj.weight",
           "model.layers.2.self_attn.v_proj.weight", "lm_head.weight")


def tiny_llama(tmp_path, seed):
    cfg_cls, model_cls, extra = DENSE[CASE]
    return build(cfg_cls(**{**COMMON, **extra}), model_cls, tmp_path / "ref", seed)


def perturbed_copy(src, dst, names, rel: float, seed: int):
    """A pack whose `names` are the reference's times (1 + rel * N(0, 1)) elementwise, the rest identical."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    w = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for n in names:
        w[n] = w[n] * (1 + rel * torch.randn(w[n].shape, generator=g))
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def hf_with(ref_folder, tensors: dict):
    model = T.AutoModelForCausalLM.from_pretrained(str(ref_folder), dtype=torch.float32, attn_implementation="eager")
    sd = model.state_dict()
    with torch.no_grad():
        for n, t in tensors.items():
            sd[n].copy_(t)
    return model.eval()


def kl_mean(ref_logits, logits):
    lp, lq = torch.log_softmax(ref_logits.double(), -1), torch.log_softmax(logits.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


@pytest.fixture
def packs(tmp_path, rng_seed):
    tiny_llama(tmp_path, rng_seed)
    pack = perturbed_copy(tmp_path / "ref", tmp_path / "pack", CHANGED, 0.05, rng_seed)
    tokens = torch.randint(0, COMMON["vocab_size"], (3, 17), generator=torch.Generator().manual_seed(rng_seed))
    return tmp_path / "ref", pack, tokens


def test_swap_one_in_equals_transformers_with_that_group_swapped(packs):
    ref, pack, tokens = packs
    res = attribute(ref, pack, rows=tokens.tolist(), settings=Settings(sensitivity=False))
    pw = load_file(str(pack / "model.safetensors"))
    by = {r["group"]: r for r in res.swaps}
    with torch.no_grad():
        ref_logits = hf_with(ref, {})(tokens).logits[:, :-1].reshape(-1, COMMON["vocab_size"])

        def hf_kl(names):
            logits = hf_with(ref, {n: pw[n] for n in names})(tokens).logits[:, :-1]
            return kl_mean(ref_logits, logits.reshape(-1, COMMON["vocab_size"]))

        for group, names in {"layers.1.mlp": CHANGED[:2], "layers.2.attention": CHANGED[2:3],
                             "head": CHANGED[3:]}.items():
            want = hf_kl(names)
            print(group, by[group]["kld_mean"], want)
            assert by[group]["kld_mean"] == pytest.approx(want, rel=1e-4)
            assert not by[group]["identical"] and by[group]["noise_kld_mean"] > 0
        whole = hf_kl(CHANGED)
    assert res.summary["pack_kld_mean"] == pytest.approx(whole, rel=1e-4)
    # untouched groups are the reference itself: exactly 0, and the shares of the rest sum to 1
    for g, r in by.items():
        if g not in ("layers.1.mlp", "layers.2.attention", "head"):
            assert r["identical"] and r["kld_mean"] == 0.0 and r["share"] == 0.0, g
    assert sum(r["share"] for r in res.swaps) == pytest.approx(1.0, rel=1e-12)
    parts = sum(by[g]["kld_mean"] for g in ("layers.1.mlp", "layers.2.attention", "head"))
    assert res.summary["additivity"] == pytest.approx(parts / res.summary["pack_kld_mean"], rel=1e-12)
    # the noise control has the same weight-error norm as the real error
    err = math.sqrt(sum(float((pw[n].double() - load_file(str(ref / "model.safetensors"))[n].double()).pow(2).sum())
                        for n in CHANGED[:2]))
    assert by["layers.1.mlp"]["weight_err_norm"] == pytest.approx(err, rel=1e-9)
    json.dumps(res.to_json())   # JSON-able


def test_layer_divergence_and_weight_error_equal_numpy(packs):
    ref, pack, tokens = packs
    res = attribute(ref, pack, rows=tokens.tolist(), settings=Settings(sensitivity=False, noise_control=False))
    with torch.no_grad():
        hr = hf_with(ref, {})(tokens, output_hidden_states=True).hidden_states
        pw = load_file(str(pack / "model.safetensors"))
        hp = hf_with(ref, pw)(tokens, output_hidden_states=True).hidden_states
    layers = {r["layer"]: r for r in res.layers}
    # HF's hidden_states[0] are the embeddings, [i + 1] layer i's output (the last one after the final norm: skipped)
    for i in range(-1, COMMON["num_hidden_layers"] - 1):
        r, p = hr[i + 1].double().numpy().reshape(-1, COMMON["hidden_size"]), \
            hp[i + 1].double().numpy().reshape(-1, COMMON["hidden_size"])
        d = p - r
        rel = np.sqrt((d ** 2).sum() / (r ** 2).sum()) if i >= 0 else 0.0
        cos = np.mean((p * r).sum(1) / (np.linalg.norm(p, axis=1) * np.linalg.norm(r, axis=1)))
        print(i, layers[i]["rel_fro"], rel, layers[i]["cosine"], cos)
        assert layers[i]["rel_fro"] == pytest.approx(rel, rel=1e-3, abs=1e-6)
        assert layers[i]["cosine"] == pytest.approx(cos, abs=1e-6)
        if rel > 1e-4:
            assert layers[i]["sqnr_db"] == pytest.approx(10 * np.log10((r ** 2).sum() / (d ** 2).sum()), abs=1e-2)
    assert layers[0]["rel_fro"] == 0.0 and layers[1]["rel_fro"] > 0   # layer 1's MLP is the first change
    rw, pwn = load_numpy(str(ref / "model.safetensors")), load_numpy(str(pack / "model.safetensors"))
    tens = {r["tensor"]: r for r in res.tensors}
    assert set(tens) == set(rw)
    for n in rw:
        a, b = rw[n].astype(np.float64), pwn[n].astype(np.float64)
        err = np.sqrt(((b - a) ** 2).sum())
        assert tens[n]["rel_fro"] == pytest.approx(err / np.sqrt((a ** 2).sum()), rel=1e-12, abs=0), n
        assert tens[n]["sqnr_db"] == (pytest.approx(20 * np.log10(np.sqrt((a ** 2).sum()) / err), rel=1e-12)
                                      if err else math.inf), n
        assert (err > 0) == (n in CHANGED)


def test_sensitivity_equals_transformers_with_the_same_noise(packs):
    ref, pack, tokens = packs
    levels = (2.0 ** -7, 2.0 ** -5, 2.0 ** -3)
    layer = 1
    res = attribute(ref, pack, rows=tokens.tolist(), settings=Settings(noise_control=False, noise_levels=levels,
                                                                       groups=["head"], seed=5))
    row = res.sensitivity[layer]
    model = hf_with(ref, {})
    with torch.no_grad():
        ref_logits = model(tokens).logits[:, :-1].reshape(-1, COMMON["vocab_size"])
        want = []
        for j, eps in enumerate(levels):
            def hook(module, args, out, j=j, eps=eps):
                g = torch.Generator().manual_seed(noise_seed(5, layer, j))
                n = torch.randn(out.shape, generator=g, dtype=torch.float64)
                return out + (n * (eps * float(out.double().pow(2).mean().sqrt()))).float()
            h = model.model.layers[layer].mlp.register_forward_hook(hook)
            want.append(kl_mean(ref_logits, model(tokens).logits[:, :-1].reshape(-1, COMMON["vocab_size"])))
            h.remove()
    print(row, want)
    assert row["kld_mean"] == pytest.approx(want, rel=1e-4)
    e2 = np.asarray(levels) ** 2
    assert row["dkl_deps2"] == pytest.approx(float((e2 * np.asarray(want)).sum() / (e2 ** 2).sum()), rel=1e-4)
    assert 1.5 < row["loglog_slope"] < 2.5        # KL is quadratic in a small perturbation
    assert [r["layer"] for r in res.sensitivity] == list(range(COMMON["num_hidden_layers"]))


def test_bad_input_names_the_tensor_or_group(packs, tmp_path):
    ref, pack, tokens = packs
    with pytest.raises(ConfigError, match="unknown module group"):
        attribute(ref, pack, rows=tokens.tolist(), settings=Settings(groups=["layers.9.mlp"]))
    with pytest.raises(ConfigError, match=r"sensitivity layers \[7\] are outside the model's 3 layers"):
        attribute(ref, pack, rows=tokens.tolist(), settings=Settings(sensitivity_layers=[1, 7], groups=["head"]))
    with pytest.raises(ConfigError, match="--modules"):
        attribute(ref, pack, rows=tokens.tolist(), settings=Settings(modules="bogus"))
    w = load_file(str(pack / "model.safetensors"))
    del w["model.layers.0.self_attn.q_proj.weight"]
    (tmp_path / "short").mkdir()
    shutil.copy(pack / "config.json", tmp_path / "short" / "config.json")
    save_file(w, str(tmp_path / "short" / "model.safetensors"))
    with pytest.raises(PackError, match="model.layers.0.self_attn.q_proj.weight"):
        attribute(ref, tmp_path / "short", rows=tokens.tolist())


def test_cli_writes_the_api_numbers(packs, tmp_path):
    from fidelity.cli import main
    ref, pack, tokens = packs
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps(tokens.tolist()))
    out = tmp_path / "attr.json"
    assert main(["attribute", str(ref), str(pack), "--rows", str(rows), "--json", str(out), "--sensitivity-layers", "2",
                 "--noise-levels", "0.01,0.05", "--out", str(tmp_path / "tables"),
                 "--activation-control"]) == 0
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")
    doc = json.loads(out.read_text(), parse_constant=refuse)   # standard JSON: no Infinity / NaN
    exact = [r for r in doc["layers"] + doc["tensors"] if r["rel_fro"] == 0]
    assert exact and all(r["sqnr_db"] is None for r in exact)   # infinite SQNR (no error) is written as null
    assert all(r["sqnr_db"] > 0 for r in doc["tensors"] if r["rel_fro"] > 0)
    assert {r["group"]: r for r in doc["swaps"]}["layers.1.mlp"]["x_act"] > 0
    api = attribute(ref, pack, rows=tokens.tolist(), settings=Settings(sensitivity=False))
    assert doc["summary"]["pack_kld_mean"] == api.summary["pack_kld_mean"]
    assert [r["kld_mean"] for r in doc["swaps"]] == [r["kld_mean"] for r in api.swaps]
    assert [r["layer"] for r in doc["sensitivity"]] == [2] and doc["summary"]["noise_levels"] == [0.01, 0.05]
    assert (
        doc["sensitivity"][0]["kld_mean"]
        == attribute(
            ref,
            pack,
            rows=tokens.tolist(),
            settings=Settings(groups=["head"], noise_control=False, sensitivity_layers=[2], noise_levels=(0.01, 0.05)),
        ).sensitivity[0]["kld_mean"]
    )
    import pandas as pd
    assert pd.read_parquet(tmp_path / "tables" / "swaps.parquet")["kld_mean"].tolist() == \
        [r["kld_mean"] for r in api.swaps]


def numpy_scale_corr(w: np.ndarray, d: np.ndarray, group: int = 16):
    """Pearson r of the error's RMS against the weight's max |w| over groups of `group` along a row, and n_groups."""
    e = np.sqrt((d.reshape(-1, group) ** 2).mean(1))
    m = np.abs(w.reshape(-1, group)).max(1)
    return float(np.corrcoef(e, m)[0, 1]), e.size


def test_error_structure_separates_a_scaled_error_from_its_isotropic_control(packs):
    """The pack's error is w * 0.05 N (it grows with |w|, as a blockwise quantizer's does): err_scale_corr equals
    numpy's per tensor and pooled per group, is far outside the independence null, and the isotropic control of the same
    norm is inside it; x_noise_ci is a bootstrap interval around x_noise."""
    ref, pack, tokens = packs
    res = attribute(ref, pack, rows=tokens.tolist(), settings=Settings(sensitivity=False, noise_repeats=3,
                                                                       groups=["layers.1.mlp", "layers.2.attention"]))
    rw, pwn = load_numpy(str(ref / "model.safetensors")), load_numpy(str(pack / "model.safetensors"))
    tens = {r["tensor"]: r for r in res.tensors}
    want = {}
    for n in CHANGED:
        a, b = rw[n].astype(np.float64), pwn[n].astype(np.float64)
        if a.shape[1] % 16:
            assert tens[n]["err_scale_corr"] is None and tens[n]["err_scale_groups"] == 0, n    # down_proj: 72 columns
            continue
        want[n] = numpy_scale_corr(a, b - a)
        print(n, tens[n]["err_scale_corr"], want[n])
        assert (
            tens[n]["err_scale_corr"] == pytest.approx(want[n][0], rel=1e-9)
            and tens[n]["err_scale_groups"] == want[n][1]
        )
    assert all(tens[n]["err_scale_corr"] is None for n in rw if n not in CHANGED)     # no error, no statistic
    by = {r["group"]: r for r in res.swaps}
    for group, names in {"layers.1.mlp": CHANGED[1:2], "layers.2.attention": CHANGED[2:3]}.items():
        r = by[group]
        s, n = sum(want[k][0] * want[k][1] for k in names), sum(want[k][1] for k in names)
        assert r["err_scale_corr"] == pytest.approx(s / n, rel=1e-9)
        assert r["err_scale_z"] == pytest.approx(s / math.sqrt(n), rel=1e-9)
        print(group, r["err_scale_corr"], r["err_scale_z"], r["noise_err_scale_z"], r["x_noise"], r["x_noise_ci"])
        assert abs(r["noise_err_scale_z"]) < 4.5      # the control is independent of W: z ~ N(0, 1)
        lo, hi = r["x_noise_ci"]
        assert lo < hi and len(r["noise_kld_each"]) == 3
        assert r["kl_vs_noise"] == ("more harmful" if lo > 1 else "less harmful" if hi < 1 else "not separable")
    json.dumps(res.to_json())


def test_error_scale_corr_tells_a_blockwise_error_from_noise(rng_seed):
    """On a 256 x 512 tensor (8192 groups): a blockwise absmax round-to-nearest error (step = the group's max |w| / 2,
    as a 2-bit quantizer) and a multiplicative one are far outside the independence null; isotropic noise is inside
    it."""
    from fidelity.measuring.attribute import isotropic_noise
    from fidelity.measuring.attribute_divergence import error_scale_corr
    g = torch.Generator().manual_seed(rng_seed)
    w = torch.randn(256, 512, generator=g, dtype=torch.float64) * torch.rand(256, 1, generator=g, dtype=torch.float64)
    blocks = w.reshape(-1, 16)
    step = blocks.abs().amax(1, keepdim=True) / 2
    quant = ((blocks / step).round().clamp(-2, 1) * step).reshape(w.shape)
    for name, d in {"blockwise": quant - w, "multiplicative": w * 0.05 * torch.randn(w.shape, generator=g,
                                                                                   dtype=torch.float64)}.items():
        r, n = error_scale_corr(w, d)
        assert n == 8192 and r == pytest.approx(numpy_scale_corr(w.numpy(), d.numpy())[0], rel=1e-9)
        noise = isotropic_noise(tuple(w.shape), float(d.norm()), rng_seed % 1000).double()
        r0, _ = error_scale_corr(w, noise)
        print(name, r, r * math.sqrt(n), r0 * math.sqrt(n))
        assert r * math.sqrt(n) > 20 and abs(r0 * math.sqrt(n)) < 4.5
    assert error_scale_corr(w[:, :40], w[:, :40]) == (None, 0) and error_scale_corr(w[0], w[0]) == (None, 0)


def test_ratio_ci_covers_the_ratio_and_needs_two_rows_and_draws():
    from fidelity.measuring.attribute import ratio_ci
    g = np.random.default_rng(0)
    control = g.gamma(4.0, 0.25, (4, 40))                 # 4 draws x 40 rows, per-row KL sums around 1
    lo, hi = ratio_ci(2.0 * control.mean(0) * g.uniform(0.9, 1.1, 40), control, seed=1)
    assert 1.6 < lo < 2.0 < hi < 2.4
    lo, hi = ratio_ci(control[0], control[1:], seed=1)  # the pack is one more draw of the control: not separable
    assert lo < 1 < hi
    assert (
        ratio_ci(control[0], control[:1], seed=1) is None and ratio_ci(control[0, :1], control[:, :1], seed=1) is None
    )


def test_activation_control_equals_transformers_with_that_noise_at_the_layer_output(packs):
    """exllamav3's control: layer 1's output of the reference plus noise with, per position, the norm of the error the
    swapped MLP leaves there (both from transformers), then the rest of the model: its KL per draw."""
    from fidelity.measuring.attribute import act_seed
    ref, pack, tokens = packs
    res = attribute(ref, pack, rows=tokens.tolist(), settings=Settings(
        sensitivity=False, noise_control=False, activation_control=True, noise_repeats=2, seed=3,
        groups=["layers.1.mlp", "head"]))
    by = {r["group"]: r for r in res.swaps}
    assert "act_kld_each" not in by["head"]                       # not a one-layer group
    pw = load_file(str(pack / "model.safetensors"))
    model = hf_with(ref, {})
    with torch.no_grad():
        ref_logits = model(tokens).logits[:, :-1].reshape(-1, COMMON["vocab_size"])
        clean = model(tokens, output_hidden_states=True).hidden_states[2]
        swapped = hf_with(ref, {n: pw[n] for n in CHANGED[:2]})(tokens, output_hidden_states=True).hidden_states[2]
        err = (swapped.double() - clean.double())
        want = []
        for rep in range(2):
            z = torch.randn(err.shape, generator=torch.Generator().manual_seed(act_seed(3, rep)), dtype=torch.float64)
            z = z / z.norm(dim=-1, keepdim=True) * err.norm(dim=-1, keepdim=True)
            h = model.model.layers[1].register_forward_hook(lambda m, a, out, z=z: out + z.float())
            want.append(kl_mean(ref_logits, model(tokens).logits[:, :-1].reshape(-1, COMMON["vocab_size"])))
            h.remove()
    r = by["layers.1.mlp"]
    print(r["act_kld_each"], want, r["x_act"], r["x_act_ci"], r["kl_vs_act"])
    assert r["act_kld_each"] == pytest.approx(want, rel=1e-4)
    assert r["x_act"] == pytest.approx(r["kld_mean"] / np.mean(want), rel=1e-4)
    lo, hi = r["x_act_ci"]
    assert lo < hi and r["kl_vs_act"] == ("more harmful" if lo > 1 else "less harmful" if hi < 1 else "not separable")
