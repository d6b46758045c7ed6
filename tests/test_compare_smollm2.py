"""compare() on real SmolLM2-135M-Instruct packs: native fp32 vs GGUF Q8_0 / Q6_K / Q4_K_M / Q2_K built by the demo."""
import pytest
import torch

from fidelity.commands.demo import build_demo_packs
from fidelity.measuring.compare import compare
from fidelity.panels.panel import load_panel, tokenize_panel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def packs(tmp_path_factory, smollm2_gguf):
    # one cache per test session, shared with test_demo.py
    return build_demo_packs(tmp_path_factory.getbasetemp() / "fidelity_cache" / "demo")


@pytest.fixture(scope="module")
def panel():
    return load_panel().subset(2)


@pytest.fixture(scope="module")
def result(packs, panel):
    return compare(packs["native"], [packs[q] for q in ("Q8_0", "Q6_K", "Q4_K_M", "Q2_K")], panel=panel,
                   labels=["Q8_0", "Q6_K", "Q4_K_M", "Q2_K"], n_boot=500, progress=False)


def test_q4_k_m_matches_transformers(packs, panel, result):
    """KL(native||Q4_K_M), top-1 and both PPLs equal plain torch on HF transformers' fp32 logits (the GGUF loaded by
    transformers' own GGUF path) within 1e-4 relative."""
    from transformers import AutoModelForCausalLM
    from fidelity.packs import open_pack
    from fidelity.packs.tokenizer import load_tokenizer
    ref_model = AutoModelForCausalLM.from_pretrained(str(packs["native"]), dtype=torch.float32).eval()
    q = packs["Q4_K_M"]
    pack_model = AutoModelForCausalLM.from_pretrained(str(q.parent), gguf_file=q.name, dtype=torch.float32).eval()
    rows = tokenize_panel(panel, load_tokenizer(open_pack(packs["native"])))
    kl, agree, nll_ref, nll_pack = [], [], [], []
    with torch.no_grad():
        for r in rows:
            pos = torch.tensor([t - 1 for t, s in enumerate(r.scored) if s])
            tgt = torch.tensor(r.tokens)[pos + 1]
            ids = torch.tensor([r.tokens])
            lp = torch.log_softmax(ref_model(ids).logits[0, pos].double(), -1)
            lq = torch.log_softmax(pack_model(ids).logits[0, pos].double(), -1)
            kl.append((lp.exp() * (lp - lq)).sum(-1))
            agree.append(lp.argmax(-1) == lq.argmax(-1))
            nll_ref.append(-lp.gather(1, tgt[:, None])[:, 0])
            nll_pack.append(-lq.gather(1, tgt[:, None])[:, 0])
    o = next(r for r in result.report["results"] if r["label"] == "Q4_K_M")["overall"]
    print("Q4_K_M", o["kld_mean"], o["top1"], o["ppl"], o["ppl_ref"])
    assert o["kld_mean"] == pytest.approx(float(torch.cat(kl).mean()), rel=1e-4)
    assert o["top1"] == pytest.approx(float(torch.cat(agree).double().mean()), rel=1e-4)
    assert o["ppl"] == pytest.approx(float(torch.cat(nll_pack).mean().exp()), rel=1e-4)
    assert o["ppl_ref"] == pytest.approx(float(torch.cat(nll_ref).mean().exp()), rel=1e-4)


def test_more_bits_mean_closer(result):
    o = {r["label"]: r["overall"] for r in result.report["results"]}
    kld = [o[q]["kld_mean"] for q in ("Q8_0", "Q6_K", "Q4_K_M", "Q2_K")]
    top1 = [o[q]["top1"] for q in ("Q8_0", "Q6_K", "Q4_K_M", "Q2_K")]
    print("kld", kld, "top1", top1, "noise floor", o["Q8_0"]["noise_floor_kld"])
    assert kld[0] < kld[1] < kld[2] < kld[3]
    assert top1[0] >= top1[1] >= top1[2] > top1[3] and top1[0] > top1[2]
    paired = {(p["a"], p["b"]): p for p in result.report["paired"]}
    for a, b in (("Q8_0", "Q6_K"), ("Q6_K", "Q4_K_M"), ("Q4_K_M", "Q2_K")):
        assert paired[(a, b)]["kld_mean_diff"] < 0 and paired[(a, b)]["ci95"][1] < 0, (a, b)
    assert o["Q8_0"]["noise_floor_kld"] < kld[0]
