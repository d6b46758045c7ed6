"""fidelity.measuring.attribute's routing tables on a tiny Qwen3Moe against HF transformers' own router logits: expert
counts, routing-weight shares, top-k agreement (a permuted router found, and by how much), routing-weighted bits per
weight."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from fidelity import open_pack
from fidelity.measuring.attribute import Settings, attribute
from test_bpw_routing import expected_per_token_bpw, hf_expert_counts, skewed_moe, well_routed_tokens
from test_oracle import COMMON

N_EXPERTS, K, PERMUTED_LAYER = 8, 2, 1


def hf_router(folder, tokens):
    model = T.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    with torch.no_grad():
        return model, model(input_ids=tokens, use_cache=False, output_router_logits=True).router_logits


@pytest.fixture
def moe(tmp_path, rng_seed):
    skewed_moe(tmp_path / "ref", rng_seed)
    g = torch.Generator().manual_seed(rng_seed)
    perm = torch.roll(torch.randperm(N_EXPERTS, generator=g), 1)          # then made a derangement below
    while bool((perm == torch.arange(N_EXPERTS)).any()):
        perm = torch.randperm(N_EXPERTS, generator=g)
    dst = tmp_path / "permuted"
    dst.mkdir()
    for f in (tmp_path / "ref").iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    w = load_file(str(tmp_path / "ref" / "model.safetensors"))
    name = f"model.layers.{PERMUTED_LAYER}.mlp.gate.weight"
    w[name] = w[name][perm].contiguous()            # pack router row e = reference row perm[e]
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    models = [
        T.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval() for d in (tmp_path / "ref", dst)
    ]
    tokens = well_routed_tokens(models, (3, 19), K, COMMON["vocab_size"], generator=g)
    return tmp_path / "ref", dst, perm, tokens


def test_self_agreement_counts_and_shares_equal_transformers(moe):
    ref, _, _, tokens = moe
    res = attribute(ref, ref, rows=tokens.tolist(), settings=Settings(sensitivity=False))
    _, logits = hf_router(ref, tokens)
    counts = hf_expert_counts(T.AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32).eval(), tokens, K)
    assert len(res.routing_layers) == COMMON["num_hidden_layers"]
    for layer in res.routing_layers:
        i = layer["layer"]
        assert layer["jaccard_mean"] == 1.0 and layer["jaccard_min"] == 1.0 and layer["same_set"] == 1.0
        assert layer["tokens"] == tokens.numel() and layer["top_k"] == K
        rows = [r for r in res.routing if r["layer"] == i]
        assert [r["expert"] for r in rows] == list(range(N_EXPERTS))
        ours = np.array([r["counts_ref"] for r in rows])
        assert ours.sum() == tokens.numel() * K
        assert ours.tolist() == counts[i].tolist() == [r["counts_pack"] for r in rows]
        # routing-weight share: HF's softmax -> top-k -> renormalised (norm_topk_prob) weights summed per expert
        p = torch.softmax(logits[i].double(), -1)
        w, idx = p.topk(K, -1)
        w = w / w.sum(-1, keepdim=True)
        mass = torch.zeros(N_EXPERTS, dtype=torch.float64).index_add_(0, idx.flatten(), w.flatten())
        assert [r["weight_share_ref"] for r in rows] == pytest.approx((mass / mass.sum()).tolist(), abs=1e-6)
        energy = np.array([r["energy_share_ref"] for r in rows])
        assert energy.sum() == pytest.approx(1.0, rel=1e-12) and (energy >= 0).all()
        assert [r["energy_share_pack"] for r in rows] == energy.tolist()
        assert layer["super_experts_ref"] == [e for e in range(N_EXPERTS) if energy[e] >= 0.2]
    assert res.summary["pack_kld_mean"] == 0.0 and all(r["identical"] for r in res.swaps)


def test_permuted_router_is_found_with_the_overlap_transformers_implies(moe):
    ref, permuted, perm, tokens = moe
    res = attribute(ref, permuted, rows=tokens.tolist(), settings=Settings(sensitivity=False))
    by = {r["layer"]: r for r in res.routing_layers}
    assert by[0]["jaccard_mean"] == 1.0                    # before the permuted layer nothing differs
    # layer 1's input is the reference's bit for bit, so the pack picks e exactly where the reference picks perm[e]
    _, logits = hf_router(ref, tokens)
    ref_sets = logits[PERMUTED_LAYER].topk(K, -1).indices
    inverse = torch.argsort(perm)
    jac = [len(set(s.tolist()) & set(inverse[s].tolist())) / len(set(s.tolist()) | set(inverse[s].tolist()))
           for s in ref_sets]
    print("permuted router: Jaccard", by[PERMUTED_LAYER]["jaccard_mean"], "expected", np.mean(jac))
    assert by[PERMUTED_LAYER]["jaccard_mean"] == pytest.approx(float(np.mean(jac)), abs=1e-12)
    assert by[PERMUTED_LAYER]["jaccard_mean"] < 1.0
    swaps = {r["group"]: r for r in res.swaps}
    router = swaps[f"layers.{PERMUTED_LAYER}.router"]
    assert router["share"] == 1.0 and router["kld_mean"] == pytest.approx(res.summary["pack_kld_mean"], rel=1e-12)
    # routing-weighted bpw: the pack's own routing (HF on the pack) weighting each expert tensor's storage bits
    pack = open_pack(permuted)
    model = T.AutoModelForCausalLM.from_pretrained(str(permuted), dtype=torch.float32).eval()
    share = {}
    for layer, c in enumerate(hf_expert_counts(model, tokens, K)):
        assert [r["counts_pack"] for r in res.routing if r["layer"] == layer] == c.tolist()
        for e in range(N_EXPERTS):
            for w in ("gate_proj", "up_proj", "down_proj"):
                share[f"model.layers.{layer}.mlp.experts.{e}.{w}.weight"] = c[e] / tokens.numel()
    bpw = res.summary["bits_per_weight_routed"]
    assert bpw["per_decoded_token_measured"]["bpw"] == pytest.approx(expected_per_token_bpw(pack, share), rel=1e-12)
    assert bpw["per_decoded_token_measured_excluding_head"]["bpw"] == pytest.approx(
        expected_per_token_bpw(pack, share, exclude_head=True), rel=1e-12)


def test_expert_modules_are_groups_of_their_own(moe):
    ref, _, _, tokens = moe
    res = attribute(ref, ref, rows=tokens.tolist(), settings=Settings(modules="expert", sensitivity=False,
                                                                        noise_control=False))
    groups = [r["group"] for r in res.swaps]
    assert (
        f"layers.0.experts.{N_EXPERTS - 1}" in groups and "layers.0.router" in groups and "layers.0.attention" in groups
    )
    res = attribute(ref, ref, rows=tokens.tolist(), settings=Settings(modules="layer", sensitivity=False))
    assert [r["group"] for r in res.swaps] == [f"layers.{i}" for i in range(COMMON["num_hidden_layers"])] + \
        ["embedding", "head"]


def test_report_shows_the_attribution_tables_and_figures(moe, tmp_path):
    import json as _json

    from fidelity.report import render
    from fidelity.report.tables import num
    ref, permuted, _, tokens = moe
    res = attribute(ref, permuted, rows=tokens.tolist(), settings=Settings(noise_levels=(2.0 ** -6, 2.0 ** -4)))
    doc = tmp_path / "attr.json"
    doc.write_text(_json.dumps(res.to_json()))
    rep = render([doc], tmp_path / "report")
    html = rep.index_html.read_text()
    md = rep.summary_md.read_text()
    names = sorted(p.name for p in rep.figures)
    assert names == ["attribution_layers_1.png", "attribution_routing_1.png", "attribution_sensitivity_1.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in rep.figures)
    for text in (html, md):
        assert "Swap-one-in attribution" in text and "Routing agreement" in text and "Sensitivity" in text
        assert num(res.summary["pack_kld_mean"]) in text
        assert num(res.routing_layers[PERMUTED_LAYER]["jaccard_mean"]) in text
