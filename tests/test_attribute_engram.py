"""fidelity.measuring.attribute's Engram row-access ledger on the tiny V4.1: per-row lookup counts equal a brute-force
count of the rows recomputed here from the hashing's definition (test_engram.naive_rows: Python ints, position by
position), lookups = tokens x n-gram lengths x heads, and the coverage curve is the sorted counts' running share
(monotone, 1 at all distinct rows)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from fidelity.measuring.attribute import Settings, attribute
from fidelity.commands.attribute import print_tables
from testkit.minipacks_v41 import build_native_v41
from fidelity.oracle.deepseek.engram import EngramArgs, compressed_token_map
from test_engram import naive_rows

V4_NATIVE = Path(__file__).parent / "fixtures" / "v4" / "tiny_v4"


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    return build_native_v41(V4_NATIVE, tmp_path_factory.mktemp("v41") / "native")


def hot_and_tail_rows(cfg: dict, seed: int) -> list[list[int]]:
    """A few tokens repeated (hot n-grams) and some drawn from the whole vocabulary (a long tail)."""
    g = torch.Generator().manual_seed(seed)
    hot = torch.randint(3, cfg["vocab_size"], (4,), generator=g)
    rows = []
    for length in (13, 9, 17):
        r = hot[torch.randint(0, 4, (length,), generator=g)]
        wild = torch.rand(length, generator=g) < 0.3
        r[wild] = torch.randint(3, cfg["vocab_size"], (int(wild.sum()),), generator=g)
        rows.append(r.tolist())
    return rows


def brute_force_counts(pack: Path, cfg: dict, layer: int, rows: list[list[int]]) -> Counter:
    token_map = compressed_token_map(pack / "tokenizer.json")
    a = EngramArgs.from_config(cfg, layer, token_map)
    return Counter(x for r in rows for pos in naive_rows([int(token_map[t]) for t in r], a) for x in pos)


def test_engram_ledger_counts_equal_brute_force(v41, rng_seed):
    cfg = json.loads((v41 / "config.json").read_text())
    rows = hot_and_tail_rows(cfg, rng_seed)
    res = attribute(v41, v41, rows=rows, settings=Settings(modules="layer", groups=["embedding"],
                                                          noise_control=False, sensitivity=False))
    assert [r["layer"] for r in res.engram_access] == cfg["engram_layer_ids"]
    for entry, table_rows in zip(res.engram_access, cfg["engram_num_embeddings"]):
        expected = brute_force_counts(v41, cfg, entry["layer"], rows)
        n_heads = (cfg["engram_max_ngram_size"] - 1) * cfg["engram_n_heads"]
        assert entry["lookups"] == sum(map(len, rows)) * n_heads == sum(expected.values())
        assert entry["distinct_rows"] == len(expected) and entry["table_rows"] == table_rows
        assert max(expected.values()) > 1, "the panel should repeat some n-grams"
        counts = sorted(expected.values(), reverse=True)
        total, distinct = sum(counts), len(counts)
        curve = {c["top_rows"]: c["share"] for c in entry["coverage"]}
        want_points = {1, 10, 100} & set(range(1, distinct)) | {max(1, distinct // 100), max(1, distinct // 10),
                                                                distinct}
        assert set(curve) == want_points
        for n, share in curve.items():
            assert share == sum(counts[:n]) / total
        shares = [curve[n] for n in sorted(curve)]
        assert shares == sorted(shares) and shares[-1] == 1.0 and shares[0] < 1.0
    assert res.to_json()["engram_access"] == res.engram_access


def test_engram_sink_counts_each_row(v41, rng_seed):
    """The sink itself, row for row, against np.unique on the rows recomputed here."""
    from fidelity.measuring.engram_access import EngramAccess
    cfg = json.loads((v41 / "config.json").read_text())
    token_map = compressed_token_map(v41 / "tokenizer.json")
    a = EngramArgs.from_config(cfg, cfg["engram_layer_ids"][0], token_map)
    g = torch.Generator().manual_seed(rng_seed)
    calls = [torch.randint(0, 8, (2, 11), generator=g), torch.randint(0, int(token_map.max()) + 1, (1, 7), generator=g)]
    access = EngramAccess()
    from fidelity.oracle.deepseek.engram import ngram_rows
    for ids in calls:
        access.add(a.layer, 1000, ngram_rows(ids, a))
    naive = np.array([x for ids in calls for r in ids.tolist() for pos in naive_rows(r, a) for x in pos])
    want_rows, want_counts = np.unique(naive, return_counts=True)
    entry = access.tables[a.layer]
    np.testing.assert_array_equal(entry["rows"], want_rows)
    np.testing.assert_array_equal(entry["counts"], want_counts)


def test_console_line(v41, capsys):
    from rich.console import Console
    res = attribute(v41, v41, rows=[[5, 6, 5, 6, 5, 6, 7]], settings=Settings(modules="layer", groups=["embedding"],
                                                                              noise_control=False, sensitivity=False))
    print_tables(res, Console(width=300))
    out = capsys.readouterr().out
    assert f"Engram layer 0: {7 * 4} lookups" in out and "top 1 = " in out


def test_cli_parquet_and_report_show_the_ledger(v41, rng_seed, tmp_path):
    """`attribute --json --out`: engram_access.parquet equals the JSON's ledger; `fidelity report` on that JSON has the
    coverage table (numbers read back from the HTML and summary.md equal the brute-force count) and the curve figure."""
    import re

    import pandas as pd

    from fidelity.cli import main
    from fidelity.report import render
    cfg = json.loads((v41 / "config.json").read_text())
    rows = hot_and_tail_rows(cfg, rng_seed + 1)
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    assert main(["attribute", str(v41), str(v41), "--rows", str(tmp_path / "rows.json"), "--modules", "layer",
                 "--groups", "embedding", "--no-noise-control", "--no-sensitivity", "--json", str(tmp_path / "a.json"),
                 "--out", str(tmp_path / "tables")]) == 0
    doc = json.loads((tmp_path / "a.json").read_text())
    parquet = pd.read_parquet(tmp_path / "tables" / "engram_access.parquet")
    assert list(parquet.columns) == ["layer", "n", "share", "of", "lookups", "distinct_rows", "table_rows"]
    from_json = [(t["layer"], c["top_rows"], c["share"], c["of"], t["lookups"], t["distinct_rows"], t["table_rows"])
                 for t in doc["engram_access"] for c in t["coverage"]]
    assert [tuple(r) for r in parquet.itertuples(index=False)] == from_json

    # the report's rows, written here from the brute-force count (not from the ledger)
    want = []
    for layer, table_rows in zip(cfg["engram_layer_ids"], cfg["engram_num_embeddings"]):
        counts = sorted(brute_force_counts(v41, cfg, layer, rows).values(), reverse=True)
        distinct, total = len(counts), sum(counts)
        labels = {max(1, distinct // 100): " (1% of distinct)", max(1, distinct // 10): " (10% of distinct)",
                  distinct: " (all distinct)"}
        for n in sorted({1, 10, 100} & set(range(1, distinct)) | set(labels)):
            want.append([str(layer), str(total), str(distinct), str(table_rows), f"{n}{labels.get(n, '')}",
                         f"{100 * sum(counts[:n]) / total:.2f} %"])
    assert len(want) == len(parquet)
    rep = render([tmp_path / "a.json"], tmp_path / "report")
    md = rep.summary_md.read_text()
    section = md.split("### Engram row access")[1].split("\n\n")[1]
    md_rows = [[c.strip() for c in line.strip("|").split(" | ")] for line in section.splitlines()[2:]]
    assert md_rows == want
    html = rep.index_html.read_text()
    tbody = html.split("Engram row access")[1].split("<tbody>")[1].split("</tbody>")[0]
    assert [re.findall(r"<td>(.*?)</td>", tr) for tr in re.findall(r"<tr>(.*?)</tr>", tbody)] == want
    fig = [p for p in rep.figures if p.name == "attribution_engram_coverage_1.png"]
    assert len(fig) == 1 and fig[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import base64
    assert base64.b64encode(fig[0].read_bytes()).decode() in html and "(attribution_engram_coverage_1.png)" in md
