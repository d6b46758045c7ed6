"""The report of a small real compare run (tiny random Llama vs perturbed copies): its numbers against HF transformers +
plain torch, computed independently here, and the page opened in headless Chromium."""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from fidelity.cli import main as cli_main
from fidelity.report import render
from test_report import close_to_printed, md_tables, overall_rows, parse_with_ci

pytest.importorskip("fidelity.measuring.compare")
pytest.importorskip("fidelity.commands.compare")
pytest.importorskip("fidelity.commands.reference")
T = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

WORDS = (
    "the a cat dog sat on mat ran fast slow red blue green big small house tree river code def return if else for in "
    "print x y z one two three four plus minus equals hello world please thanks answer question is was and or not"
).split()
DOMAINS = ("code", "math", "chat")


@dataclass
class RealRun:
    base: Path
    out: Path
    panel: Path
    report: dict
    models: dict            # label -> HF model (native included)
    tokenizer: object
    rows: list              # (row id, domain, token ids)


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")     # words joined by spaces
    return T.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def _perturbed(model, cfg, scale: float, seed: int):
    m = T.LlamaForCausalLM(cfg).eval()
    m.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=g))
    return m


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> RealRun:
    from fidelity.panels.panel import PanelRow, write_panel

    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed {seed}")
    base = tmp_path_factory.mktemp("real_compare")
    tok = _tokenizer()
    cfg = T.LlamaConfig(vocab_size=len(WORDS) + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    native = T.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in native.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)  # sharper distributions than HF's init, so confidence buckets fill
    models = {
        "native": native,
        "q8": _perturbed(native, cfg, 0.01, seed + 1),
        "q4": _perturbed(native, cfg, 0.05, seed + 2),
    }
    for label, m in models.items():
        m.save_pretrained(base / label)
        tok.save_pretrained(base / label)
    rnd = random.Random(seed)
    rows = [PanelRow(f"{d}-{i}", d, text=" ".join(rnd.choice(WORDS) for _ in range(rnd.randint(20, 32))))
            for d in DOMAINS for i in range(4)]
    write_panel(base / "panel", rows, name="tiny-words")
    out = base / "run"
    packs = [str(base / x) for x in ("native", "q8", "q4")]
    assert (
        cli_main(["reference", packs[0], "--panel", str(base / "panel"), "-o", str(base / "store"), "--top-k", "5"])
        == 0
    )
    assert cli_main(["compare", *packs, "--panel", str(base / "panel"), "--reference-store", str(base / "store"),
                     "--bootstrap", "200", "--json", str(base / "compare.json"), "--out", str(out)]) == 0
    token_rows = [(r.id, r.domain, tok(r.text)["input_ids"]) for r in rows]
    return RealRun(base, out, base / "panel", json.loads((base / "compare.json").read_text()), models, tok, token_rows)


def independent_kl(run: RealRun, label: str) -> dict:
    """HF transformers fp32 logits for native and pack; KL(P_ref || Q_pack) in float64 plain torch, per scored
    position."""
    out = {"row": [], "position": [], "kl": [], "pmax": [], "ref_top1": [], "pack_top1": [], "ref_top5": []}
    with torch.no_grad():
        for rid, _, ids in run.rows:
            x = torch.tensor([ids])
            p = run.models["native"](x).logits[0, :-1].double().log_softmax(-1)
            q = run.models[label](x).logits[0, :-1].double().log_softmax(-1)
            kl = (p.exp() * (p - q)).sum(-1)
            out["row"] += [rid] * kl.numel()
            out["position"] += list(range(1, len(ids)))      # logits at t-1 predict token t, the record's position
            out["kl"] += kl.tolist()
            out["pmax"] += p.exp().amax(-1).tolist()
            out["ref_top1"] += p.argmax(-1).tolist()
            out["pack_top1"] += q.argmax(-1).tolist()
            out["ref_top5"] += p.exp().topk(5, -1).values.tolist()
    return {k: np.asarray(v) for k, v in out.items()}


def test_report_numbers_equal_an_independent_computation(real_run, tmp_path):
    """`fidelity report compare.json RECORDS_DIR` (the compare --out folder): the JSON's numbers printed, the records'
    KL quantiles / confidence buckets / worst positions against HF transformers logits through plain torch."""
    assert cli_main(["report", str(real_run.base / "compare.json"), str(real_run.out), "-o", str(tmp_path / "report"),
                     "--panel", str(real_run.panel), "--worst", "2"]) == 0
    rep = render([real_run.base / "compare.json", real_run.out], tmp_path / "report", panel=real_run.panel, worst=2)
    assert (tmp_path / "report" / "summary.md").read_text().split("## Provenance")[
        0
    ] == rep.summary_md.read_text().split("## Provenance")[0]
    md = rep.summary_md.read_text()
    t = md_tables(md)
    overall = overall_rows(t)
    quant = {r["pack"]: r for r in t["KL distribution per pack"]}
    conf = t["Mean KL by reference confidence (reference probability of its top token)"]
    for res in real_run.report["results"]:
        label, o = res["label"], res["overall"]
        ind = independent_kl(real_run, label)
        kl = ind["kl"]
        assert int(quant[label]["positions"]) == kl.size == o["positions"]
        # compare's own numbers, printed: equal the JSON's, and the JSON's equal the independent computation
        m, lo, hi = parse_with_ci(overall[label]["KLD mean [95% CI]"])
        close_to_printed(repr(m), o["kld_mean"])
        assert o["kld_mean"] == pytest.approx(kl.mean(), rel=1e-4)
        assert lo < kl.mean() < hi
        assert o["top1"] == pytest.approx((ind["ref_top1"] == ind["pack_top1"]).mean(), abs=1e-12)
        assert overall[label]["top-1 flips clear / near-tie"] == f"{o['top1_flips_clear']} / {o['top1_flips_near_tie']}"
        close_to_printed(overall[label]["KL p99.9"], o["kld_p999"])
        assert float(overall[label]["× noise floor"].rstrip("×")) == pytest.approx(o["x_noise_floor"], rel=5e-3)
        # the report's own record-derived numbers against the independent KL
        for header, v in (("mean", kl.mean()), ("median", np.median(kl)), ("p90", np.quantile(kl, 0.9)),
                          ("p99", np.quantile(kl, 0.99)), ("p99.9", np.quantile(kl, 0.999)), ("max", kl.max())):
            assert float(quant[label][header]) == pytest.approx(v, rel=1e-3), header
        edges = [0.0, 0.25, 0.5, 0.75, 0.95, 1.0]     # compare's buckets (exllamav3 model_diff's), written out
        for row, a, b in zip(conf, edges[:-1], edges[1:]):
            sel = (ind["pmax"] >= a) & ((ind["pmax"] < b) if b < 1 else (ind["pmax"] <= b))
            assert int(row["positions"]) == int(sel.sum())
            if sel.any():
                assert float(row[label]) == pytest.approx(kl[sel].mean(), rel=1e-3)
        # the worst position: where the independent KL peaks, with the tokens and top-1s HF gives there
        w = next(x for x in rep.groups[0].worst if x.label == label)
        j = int(kl.argmax())
        assert (w.row_id, w.position) == (ind["row"][j], ind["position"][j])
        ids = next(r[2] for r in real_run.rows if r[0] == w.row_id)
        tok = real_run.tokenizer
        assert w.before + w.token + w.after == tok.decode(ids[max(0, w.position - 24):w.position + 5])
        assert w.token.strip() == tok.decode([ids[w.position]])
        assert w.reference_top[0][0] == tok.decode([int(ind["ref_top1"][j])])
        # the reference's top-5 comes from the store `fidelity compare --reference-store` recorded in the JSON
        assert [p for _, p in w.reference_top] == pytest.approx(ind["ref_top5"][j].tolist(), abs=1e-5)
        assert w.pack_top[0][0] == tok.decode([int(ind["pack_top1"][j])])
    assert real_run.report["panel"]["sha256"] in md


def test_real_compare_report_opens_in_chromium(real_run, tmp_path):
    browser = pytest.importorskip("test_report_browser")
    if browser.CHROMIUM is None:
        pytest.skip("missing tool: chromium is not installed")
    rep = render([real_run.base / "compare.json", real_run.out], tmp_path / "report")
    check = browser.open_page(rep.index_html, tmp_path)
    (tmp_path / "report" / "screenshot.png").write_bytes(check.screenshot)
    assert len(check.images) == len(rep.figures) == 4
    assert all(i["complete"] and i["width"] > 0 and i["height"] > 0 for i in check.images), check.images
    assert check.console_errors == []
    assert check.requests == [rep.index_html.resolve().as_uri()]
    shot = browser._decoded(check.screenshot)
    assert shot.shape[0] > 1500 and shot[..., :3].std() > 0.05


def test_report_finds_the_reference_compare_kept_for_resuming(real_run, tmp_path):
    """`compare --out DIR` without a reference store keeps the reference run in DIR/passes/reference-store (for
    resuming); the report reads the reference's top tokens from there, as from a store given explicitly."""
    packs = [str(real_run.base / x) for x in ("native", "q4")]
    out, js = tmp_path / "run", tmp_path / "compare.json"
    assert cli_main(["compare", *packs, "--panel", str(real_run.panel), "--bootstrap", "50", "--no-noise-floor",
                     "--json", str(js), "--out", str(out)]) == 0
    assert (out / "passes" / "reference-store" / "manifest.json").is_file()
    rep = render([js, out], tmp_path / "report", panel=real_run.panel, worst=1)
    (w,) = [x for x in rep.groups[0].worst if x.label == "q4"]
    kl = independent_kl(real_run, "q4")
    j = int(kl["kl"].argmax())
    assert (w.row_id, w.position) == (kl["row"][j], kl["position"][j])
    assert [p for _, p in w.reference_top] == pytest.approx(kl["ref_top5"][j].tolist()[:len(w.reference_top)], abs=1e-5)
    assert len(w.reference_top) >= 5
