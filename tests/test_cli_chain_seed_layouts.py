"""The whole chain through the CLI on every seed layout of the DeepSeek-V4 and V4.1 mini packs (the five EXL3 layouts
and FP8/MXFP4): `fidelity panel build` (prompts answered greedily by the native pack's oracle), `fidelity reference`,
`fidelity compare` (from the store), `fidelity attribute` and `fidelity report`, each checked against a direct run of
the oracle: KL(P_ref || Q_pack) and top-1 agreement computed here in float64 numpy from `Oracle(pack).logits` of the
panel's tokenized rows, per position (the records) and pooled (the JSON); attribute's whole-pack KL equal to compare's;
the report's tables showing those numbers."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from fidelity import open_pack
from fidelity.cli import main
from fidelity.packs.exl3.encoder import EncodingCache
from testkit.minipacks_v4 import LAYOUTS, V4MiniSpec, write_all
from testkit.minipacks_v41 import V41_SPEC, build_native_v41, write_all_v41
from fidelity.measuring.compare import prepare
from fidelity.measuring.store import scored_index
from fidelity.oracle import Oracle
from _deepseek_configs import reference_ties_to_lower_index  # noqa: F401 (autouse)

V4_FIXTURES = Path(__file__).parent / "fixtures" / "v4"
PROMPTS = [{"id": "p0", "domain": "prose", "prompt": "The pool keeps"},
           {"id": "c0", "domain": "code", "prompt": "def index(x):"},
           {"id": "p1", "domain": "prose", "prompt": "Hyper streams mix"}]
MAX_NEW_TOKENS = 6


def cli(*argv) -> None:
    assert main([str(a) for a in argv]) == 0, argv


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict[str, dict]:
    """Per generation: the native pack, its packs per layout, a panel built by `fidelity panel build --pack` and the
    reference store `fidelity reference` wrote (shared by every layout)."""
    root = tmp_path_factory.mktemp("chain")
    cache = EncodingCache(V4_FIXTURES / "tiny_v4_encodings.safetensors")
    v41_native = build_native_v41(V4_FIXTURES / "tiny_v4", root / "v41native")
    gens = {
        "v4": {
            "native": V4_FIXTURES / "tiny_v4",
            "packs": write_all(V4_FIXTURES / "tiny_v4", root / "v4", V4MiniSpec(), cache),
        },
        "v41": {"native": v41_native, "packs": write_all_v41(v41_native, root / "v41", V41_SPEC, cache)},
    }
    assert cache.misses == 0, "tiny_v4 and its encodings drifted apart: rerun tests/fixtures/v4/make_fixtures.py"
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    for gen, g in gens.items():
        g["panel"], g["store"] = root / f"panel_{gen}", root / f"store_{gen}"
        cli("panel", "build", "--prompts", prompts, "--pack", g["native"], "-o", g["panel"],
            "--max-new-tokens", MAX_NEW_TOKENS)
        cli("reference", g["native"], "--panel", g["panel"], "-o", g["store"])
    return gens


def direct_metrics(native: Path, pack: Path, panel: Path) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """(row id per scored position, target tokens, KL(P_ref || Q_pack) in float64, top-1 agreement) from each pack's
    own oracle on the panel's tokenized rows, one row at a time."""
    _, _, rows, _ = prepare(open_pack(native), panel)
    ref, other = Oracle(open_pack(native)), Oracle(open_pack(pack))
    ids, targets, kls, same = [], [], [], []
    for r in rows:
        pos, tgt = scored_index(r)
        tokens = torch.tensor([r.tokens])
        lp = torch.log_softmax(ref.logits(tokens)[0, pos].double(), -1).numpy()
        lq = torch.log_softmax(other.logits(tokens)[0, pos].double(), -1).numpy()
        ids += [r.id] * len(pos)
        targets.append(tgt.numpy())
        kls.append((np.exp(lp) * (lp - lq)).sum(-1))
        same.append(lp.argmax(-1) == lq.argmax(-1))
    return ids, np.concatenate(targets), np.concatenate(kls), np.concatenate(same)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gen", ["v4", "v41"])
def test_chain_through_the_cli(chain, gen, layout, tmp_path):
    g = chain[gen]
    native, pack, panel = g["native"], g["packs"][layout], g["panel"]
    manifest = json.loads((panel / "manifest.json").read_text())
    assert manifest["rows"] == len(PROMPTS)
    recs = tmp_path / "records"
    cli("compare", native, pack, "--label", layout, "--panel", panel, "--reference-store", g["store"],
        "--json", recs / "compare.json", "--out", recs, "--no-noise-floor", "--no-numerics-floor", "--bootstrap", 50)
    report = json.loads((recs / "compare.json").read_text())
    overall = report["results"][0]["overall"]

    ids, targets, kl, same = direct_metrics(native, pack, panel)
    print(f"{gen} {layout}: {len(kl)} positions, KL {overall['kld_mean']:.7g} (direct {kl.mean():.7g}), "
          f"top-1 {overall['top1']:.4f} (direct {same.mean():.4f})")
    assert report["panel"]["scored_positions"] == overall["positions"] == len(kl) >= 3 * MAX_NEW_TOKENS
    assert kl.mean() > 0 and overall["kld_mean"] == pytest.approx(kl.mean(), rel=1e-6)
    assert round(overall["top1"] * len(kl)) == int(same.sum())
    records = pd.read_parquet(recs / f"{layout}.parquet")
    assert records["row_id"].tolist() == ids and records["token"].tolist() == targets.tolist()
    np.testing.assert_allclose(records["kld"].to_numpy(np.float64), kl, rtol=1e-5, atol=1e-7)
    assert records["ref_top1"].eq(records["pack_top1"]).tolist() == same.tolist()

    cli("attribute", native, pack, "--panel", panel, "--json", tmp_path / "attribute.json", "--modules", "layer",
        "--no-noise-control", "--no-sensitivity")
    attribution = json.loads((tmp_path / "attribute.json").read_text())
    assert attribution["summary"]["scored_positions"] == len(kl)
    assert attribution["summary"]["pack_kld_mean"] == pytest.approx(overall["kld_mean"], rel=1e-12)
    swaps = {r["group"]: r for r in attribution["swaps"]}
    assert set(swaps) == {"layers.0", "layers.1", "layers.2", "embedding", "head"}
    assert all(swaps[f"layers.{i}"]["kld_mean"] > 0 for i in range(3))

    cli("report", recs / "compare.json", tmp_path / "attribute.json", "-o", tmp_path / "report")
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert (tmp_path / "report" / "index.html").stat().st_size > 0
    assert "No per-position records" not in summary
    row = next(line for line in summary.splitlines() if line.startswith(f"| {layout} |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # 4 significant digits; a superscript after a number marks a missing interval and its reason below the table
    assert float(cells[2].split()[0].rstrip("¹²³⁴⁵⁶⁷⁸⁹⁰")) == pytest.approx(kl.mean(), rel=5e-4)
    assert cells[5] == f"{100 * same.mean():.2f}%"
    shown = re.search(r"\| pack KL \(nats\) \| ([0-9.e+-]+) \|", summary)
    assert shown and float(shown.group(1)) == pytest.approx(kl.mean(), rel=5e-4)
