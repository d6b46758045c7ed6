"""The oracle's numerics through the CLI on the tiny V4.1 mini packs: `compare --numerics deepseek` end to end with its
numerics floor checked against a direct oracle run, the choice recorded in the JSON, Markdown, store manifest and kept
passes, and a store or a kept pass made under the other numerics refused or recomputed, never reused."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fidelity import open_pack
from fidelity.cli import main
from fidelity.packs.exl3.encoder import EncodingCache
from testkit.minipacks_v41 import V41_SPEC, build_native_v41, write_all_v41
from fidelity.measuring.compare import prepare
from fidelity.oracle import Oracle
from test_oracle_support import write_word_panel

V4_FIXTURES = Path(__file__).parent / "fixtures" / "v4"
WORDS = ["engram", "pool", "index", "window", "Sparse", "Token", "scale", "hyper", "stream", "drift", "K", "bits"]


@pytest.fixture(scope="module")
def minis(tmp_path_factory):
    root = tmp_path_factory.mktemp("v41numerics")
    native = build_native_v41(V4_FIXTURES / "tiny_v4", root / "native")
    packs = write_all_v41(
        native,
        root / "packs",
        V41_SPEC,
        EncodingCache(V4_FIXTURES / "tiny_v4_encodings.safetensors"),
        layouts=("fp8-mxfp4",),
    )
    return native, packs["fp8-mxfp4"]


def kl_per_position(p_logits: torch.Tensor, q_logits: torch.Tensor) -> np.ndarray:
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1).numpy()


@pytest.mark.slow
def test_compare_deepseek_numerics_end_to_end_with_the_numerics_floor(minis, tmp_path, rng_seed):
    native, fp8 = minis
    panel = write_word_panel(tmp_path / "panel.jsonl", WORDS, rows=6, words_per_row=10, seed=rng_seed)
    out, md = tmp_path / "report.json", tmp_path / "report.md"
    assert main(["compare", str(native), str(fp8), "--panel", str(panel), "--numerics", "deepseek", "--json", str(out),
                 "--markdown", str(md), "--no-noise-floor", "--bootstrap", "200", "--out", str(tmp_path / "o")]) == 0
    report = json.loads(out.read_text())
    assert report["numerics"] == "deepseek" and "V4.1 inference/model.py" in report["numerics_label"]
    floor = report["numerics_floor"]
    assert floor["reference_numerics"] == "deepseek" and floor["other_numerics"] == "exact"
    assert "Numerics: `deepseek`" in md.read_text() and "numerics floor" in md.read_text()

    # the floor and the pack's KLD, against the oracle run directly on the same scored positions
    ref_pack, _, rows, _ = prepare(native, str(panel))
    tokens = [r.tokens for r in rows]
    by_numerics = {n: [Oracle(ref_pack, numerics=n).logits(torch.tensor([t]))[0] for t in tokens]
                   for n in ("deepseek", "exact")}
    pack_logits = [Oracle(open_pack(fp8), numerics="deepseek").logits(torch.tensor([t]))[0] for t in tokens]
    floor_kl, pack_kl = [], []
    for i, r in enumerate(rows):
        scored = [j - 1 for j, s in enumerate(r.scored) if s and j > 0]
        floor_kl.append(kl_per_position(by_numerics["deepseek"][i][scored], by_numerics["exact"][i][scored]))
        pack_kl.append(kl_per_position(by_numerics["deepseek"][i][scored], pack_logits[i][scored]))
    want_floor, want_pack = np.concatenate(floor_kl).mean(), np.concatenate(pack_kl).mean()
    print(f"numerics floor {floor['overall']['kld_mean']:.6g} (direct {want_floor:.6g}); fp8-mxfp4 under deepseek "
          f"{report['results'][0]['overall']['kld_mean']:.6g} (direct {want_pack:.6g})")
    assert floor["overall"]["kld_mean"] == pytest.approx(want_floor, rel=1e-5)
    assert report["results"][0]["overall"]["kld_mean"] == pytest.approx(want_pack, rel=1e-5)
    assert want_floor > 1e-6
    lo, hi = floor["overall"]["kld_mean_ci95"]
    assert lo <= floor["overall"]["kld_mean"] <= hi
    assert set(floor["domains"]) == set(report["panel"]["domains"])

    # a kept pass under the other numerics is not reused; the same numerics are
    again = tmp_path / "again.json"
    assert main(["compare", str(native), str(fp8), "--panel", str(panel), "--json", str(again), "--no-noise-floor",
                 "--bootstrap", "200", "--out", str(tmp_path / "o")]) == 0
    exact_report = json.loads(again.read_text())
    assert exact_report["numerics"] == "exact" and exact_report["resumed"] == []
    assert exact_report["numerics_floor"]["direction"] == "KL(reference under exact || reference under deepseek)"
    assert main(["compare", str(native), str(fp8), "--panel", str(panel), "--numerics", "deepseek", "--json",
                 str(again), "--no-noise-floor", "--bootstrap", "200", "--out", str(tmp_path / "o")]) == 0
    assert json.loads(again.read_text())["resumed"]


@pytest.mark.slow
def test_a_store_under_other_numerics_is_refused_by_name(minis, tmp_path, rng_seed, capsys):
    native, fp8 = minis
    panel = write_word_panel(tmp_path / "panel.jsonl", WORDS, rows=2, words_per_row=6, seed=rng_seed)
    store = tmp_path / "store"
    assert main(["reference", str(native), "--panel", str(panel), "-o", str(store), "--numerics", "deepseek"]) == 0
    assert json.loads((store / "manifest.json").read_text())["oracle_numerics"] == "deepseek"
    rc = main(["compare", str(native), str(fp8), "--panel", str(panel), "--reference-store", str(store),
               "--no-noise-floor", "--no-numerics-floor", "--bootstrap", "50"])
    err = capsys.readouterr().err
    assert rc == 2 and "built under numerics 'deepseek'" in err and "--numerics exact" in err
    assert main(["compare", str(native), str(fp8), "--panel", str(panel), "--reference-store", str(store),
                 "--numerics", "deepseek", "--no-noise-floor", "--no-numerics-floor", "--bootstrap", "50"]) == 0



@pytest.mark.slow
def test_attribute_under_deepseek_numerics(minis, rng_seed):
    """attribute --numerics deepseek: its whole-pack KL is the KL between the two oracles under deepseek (computed
    directly), a swap of an unchanged module changes nothing, and a swapped tensor's input rounds as the pack stores it
    (the bf16 reference's wq_a input is not rounded, the FP8 pack's is)."""
    from fidelity.measuring.attribute import Settings, attribute, pack_names
    from fidelity.measuring.attribute_trunk import Reader, variant_rounding
    native, fp8 = minis
    ref, pack = open_pack(native), open_pack(fp8)
    g = torch.Generator().manual_seed(rng_seed)
    rows = torch.randint(0, ref.config["vocab_size"], (2, 24), generator=g).tolist()
    res = attribute(ref, pack, rows=rows, device="cpu", progress=False,
                    settings=Settings(numerics="deepseek", noise_control=False, sensitivity=False, modules="layer"))
    assert res.summary["numerics"] == "deepseek"
    p_logits = Oracle(ref, numerics="deepseek").logits(torch.tensor(rows))
    q_logits = Oracle(pack, numerics="deepseek").logits(torch.tensor(rows))
    want = np.mean([kl_per_position(p_logits[i, :-1], q_logits[i, :-1]) for i in range(len(rows))])
    assert res.summary["pack_kld_mean"] == pytest.approx(want, rel=1e-9)
    exact = attribute(ref, pack, rows=rows, device="cpu", progress=False,
                      settings=Settings(noise_control=False, sensitivity=False, modules="layer"))
    assert abs(exact.summary["pack_kld_mean"] - res.summary["pack_kld_mean"]) > 1e-6

    ref_oracle, pack_oracle = Oracle(ref, numerics="deepseek"), Oracle(pack, numerics="deepseek")
    fam = ref_oracle.family
    wq_a = "layers.0.attn.wq_a.weight"
    assert not fam.rounding.rounds_input(wq_a) and pack_oracle.family.rounding.rounds_input(wq_a)
    names = pack_names(fam, pack_oracle.family, pack)
    read = Reader(ref, pack, swapped={fam.n(wq_a)}, names=names)
    bound = variant_rounding(fam.rounding, fam, read)
    assert bound.rounds_input(wq_a) and not bound.rounds_input("layers.0.attn.wkv.weight")


@pytest.mark.slow
def test_gate_a_deepseek_served_engine_against_stores_of_both_numerics(minis, tmp_path, rng_seed):
    """`fidelity serve --numerics deepseek` is an engine that rounds as DeepSeek's reference does: gated against a
    store built under deepseek it is exact (KL 0), against a store under exact it is not, and the gate's JSON and
    console say which numerics the store holds."""
    import subprocess
    import sys

    from testkit.faults import Spawned, free_port
    native, _ = minis
    panel = write_word_panel(tmp_path / "panel.jsonl", WORDS, rows=4, words_per_row=8, seed=rng_seed)
    stores = {}
    for numerics in ("deepseek", "exact"):
        stores[numerics] = tmp_path / f"store-{numerics}"
        assert main(["reference", str(native), "--panel", str(panel), "-o", str(stores[numerics]),
                     "--numerics", numerics]) == 0
    port = free_port()
    cmd = [sys.executable, "-m", "fidelity", "serve", str(native), "--port", str(port), "--model-name", "mini",
           "--numerics", "deepseek"]
    cfg = tmp_path / "gate.toml"
    cfg.write_text("[oracle-kl]\nmin_rows = 2\nmin_positions = 8\n")
    measured = {}
    with Spawned(cmd, port, timeout_s=300, log=str(tmp_path / "serve.log")) as srv:
        for numerics, store in stores.items():
            js = tmp_path / f"gate-{numerics}.json"
            r = subprocess.run([sys.executable, "-m", "fidelity", "gate", "--engine", srv.url, "--model", "mini",
                                "--reference-store", str(store), "--panel", str(panel), "--only", "oracle-kl",
                                "--config", str(cfg), "--json", str(js)], capture_output=True, text=True, timeout=600)
            print(r.stdout[-2000:], r.stderr[-2000:])
            rep = json.loads(js.read_text())
            assert rep["reference_numerics"] == numerics and f"numerics {numerics}" in r.stdout
            measured[numerics] = rep["gates"][0]["measured"]
    # equal up to float rounding: the store batched its rows by length, serve runs each alone (layers are not batch
    # invariant); 4e-16 seen, against 9.8e-4 for the store under the other numerics
    assert measured["deepseek"]["kl_mean"] <= 1e-12 and measured["deepseek"]["top1"] == 1.0
    assert measured["exact"]["kl_mean"] > 1e-4
