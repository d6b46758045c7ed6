"""fidelity.measuring.attribute's layer divergence per hyper-connection stream on the tiny DeepSeek-V4 fixture: every
layer's [B, T, hc, hidden] streams, taken from transformers' DeepseekV4ForCausalLM (forward hooks) for the reference and
for the pack, give per stream the relative Frobenius error, cosine and SQNR computed here in numpy."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from fidelity.measuring.attribute import Settings, attribute
from testkit.minipacks_v4 import official_name
from _deepseek_configs import reference_ties_to_lower_index  # noqa: F401 (autouse)

NATIVE = Path(__file__).parent / "fixtures" / "v4" / "tiny_v4"
CHANGED = ("layers.1.attn.wq_a.weight", "layers.1.ffn.shared_experts.w2.weight", "layers.2.attn.wo_b.weight")
# the last block's post bias of stream 0 ([pre (hc), post (hc), comb (hc * hc)] with hc = 2): the pack writes the FFN's
# output into stream 0 with a larger weight than the reference, so stream 0 leaves layer 2 with the larger error by
# construction (the random changes alone can leave both streams' errors within a percent of each other)
STREAM_0_POST, POST_SHIFT = ("layers.2.hc_ffn_base", 2), 1.0


def perturbed(dst: Path, seed: int) -> Path:
    """The fixture with CHANGED times (1 + 0.05 N(0, 1)) elementwise and STREAM_0_POST + POST_SHIFT (stored bf16 like
    the rest)."""
    shutil.copytree(NATIVE, dst)
    w = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for n in CHANGED:
        w[n] = (w[n].float() * (1 + 0.05 * torch.randn(w[n].shape, generator=g))).to(w[n].dtype)
    name, at = STREAM_0_POST
    w[name] = w[name].clone()
    w[name][at] += POST_SHIFT
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def hf_streams(folder: Path, scratch: Path, tokens: torch.Tensor) -> list[np.ndarray]:
    """transformers' V4 with `folder`'s official-named weights: the streams entering layer 0 (the embeddings, expanded)
    and leaving each layer, float64 [B, T, hc, hidden]."""
    cfg = T.DeepseekV4Config.from_pretrained(NATIVE)
    cfg._attn_implementation = "eager"
    T.DeepseekV4ForCausalLM(cfg).save_pretrained(scratch)
    saved = load_file(str(scratch / "model.safetensors"))
    ours = load_file(str(folder / "model.safetensors"))
    save_file({k: ours[official_name(k)].to(saved[k].dtype) for k in saved}, str(scratch / "model.safetensors"),
              metadata={"format": "pt"})
    model = T.DeepseekV4ForCausalLM.from_pretrained(scratch, dtype=torch.float32).eval()
    model.set_experts_implementation("eager")
    got = []
    hooks = [model.model.layers[0].register_forward_pre_hook(lambda m, args: got.append(args[0].clone()))]
    hooks += [layer.register_forward_hook(lambda m, args, out: got.append(out.clone())) for layer in model.model.layers]
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    return [x.double().numpy() for x in got]


def numpy_divergence(r: np.ndarray, p: np.ndarray) -> dict:
    r, p = r.reshape(-1, r.shape[-1]), p.reshape(-1, p.shape[-1])
    d = p - r
    cos = (p * r).sum(1) / (np.linalg.norm(p, axis=1) * np.linalg.norm(r, axis=1))
    return {"rel_fro": np.sqrt((d ** 2).sum() / (r ** 2).sum()), "cosine": cos.mean(),
            "sqnr_db": 10 * np.log10((r ** 2).sum() / (d ** 2).sum()) if (d ** 2).sum() else np.inf}


def test_layer_divergence_per_hc_stream_equals_numpy_on_transformers_streams(tmp_path, rng_seed):
    pack = perturbed(tmp_path / "pack", rng_seed)
    g = torch.Generator().manual_seed(rng_seed)
    tokens = torch.randint(0, 256, (2, 40), generator=g)      # past the window (8) and index_topk (4) x ratio (4)
    res = attribute(NATIVE, pack, rows=tokens.tolist(), settings=Settings(sensitivity=False, noise_control=False,
                                                                        groups=["head"]))
    ref_h = hf_streams(NATIVE, tmp_path / "hf_ref", tokens)
    pack_h = hf_streams(pack, tmp_path / "hf_pack", tokens)
    n_layers, hc = 3, 2
    assert len(ref_h) == n_layers + 1 and ref_h[0].shape == (2, 40, hc, 64)
    streams = {(r["layer"], r["stream"]): r for r in res.layer_streams}
    pooled = {r["layer"]: r for r in res.layers}
    assert sorted(streams) == [(i, s) for i in range(-1, n_layers) for s in range(hc)]
    for i in range(-1, n_layers):
        r, p = ref_h[i + 1], pack_h[i + 1]
        want = numpy_divergence(r, p)                    # all streams pooled: every (position, stream) one vector
        assert pooled[i]["rel_fro"] == pytest.approx(want["rel_fro"], rel=1e-3, abs=1e-6)
        for s in range(hc):
            want = numpy_divergence(r[:, :, s], p[:, :, s])
            got = streams[(i, s)]
            print(f"layer {i} stream {s}: rel_fro {got['rel_fro']:.6g} (numpy {want['rel_fro']:.6g}), cosine "
                  f"{got['cosine']:.8f} ({want['cosine']:.8f}), SQNR {got['sqnr_db']:.4f} ({want['sqnr_db']:.4f})")
            assert got["where"] == pooled[i]["where"]
            assert got["rel_fro"] == pytest.approx(want["rel_fro"], rel=1e-3, abs=1e-6)
            assert got["cosine"] == pytest.approx(want["cosine"], abs=1e-6)
            if i >= 1:                                   # layer 1's wq_a is the first change
                assert got["sqnr_db"] == pytest.approx(want["sqnr_db"], abs=1e-2)
            else:
                assert got["rel_fro"] == 0.0 and got["sqnr_db"] == float("inf") and got["cosine"] == pytest.approx(1.0)
    # the streams carry different errors (STREAM_0_POST), so the per-stream numbers say more than the pooled one
    after = [streams[(n_layers - 1, s)]["rel_fro"] for s in range(hc)]
    assert min(after) > 0 and after[0] > 1.5 * after[1], after
    # console, JSON and report carry the per-stream table
    import json

    from rich.console import Console

    from fidelity.commands.attribute import print_tables
    from fidelity.report import render
    from fidelity.report.tables import num
    con = Console(width=300, record=True)
    print_tables(res, con)
    text = con.export_text()
    assert "layer divergence per hyper-connection stream" in text and f"{after[1]:.4g}" in text
    doc = tmp_path / "attr.json"
    doc.write_text(json.dumps(res.to_json()))
    assert json.loads(doc.read_text())["layer_streams"][-1]["rel_fro"] == after[1]
    rep = render([doc], tmp_path / "report")
    for page in (rep.index_html.read_text(), rep.summary_md.read_text()):
        assert "Layer divergence per hyper-connection stream" in page and num(after[0]) in page
