import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fidelity.panels.panel import (
    PanelError,
    PanelRow,
    load_hf_panel,
    load_panel,
    render_chat,
    tokenize_row,
    write_panel,
)


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    from fidelity.packs import open_pack
    from fidelity.packs.tokenizer import load_tokenizer
    return load_tokenizer(open_pack(smollm2_gguf))


def _rows(rng, n=6):
    words = ["alpha", "beta", "gamma", "delta", "tool", "code", "math"]
    pick = lambda k: " ".join(rng.choice(words, k))
    rows = []
    for i in range(n):
        if i % 2:
            rows.append(PanelRow(f"r{i}", ["code", "chat"][i % 2], text=pick(8)))
        else:
            rows.append(PanelRow(f"r{i}", "chat", messages=[{"role": "user", "content": pick(5)},
                                                           {"role": "assistant", "content": pick(6)},
                                                           {"role": "user", "content": pick(3)},
                                                           {"role": "assistant", "content": pick(4)}]))
    return rows


def test_folder_roundtrip_and_sha(tmp_path, rng_seed):
    import hashlib
    import numpy as np
    rows = _rows(np.random.default_rng(rng_seed))
    write_panel(tmp_path / "p", rows, name="mini", sources=[{"source": "written for this test", "license": "CC0-1.0"}])
    p = load_panel(tmp_path / "p")
    assert p.name == "mini" and [r.to_json() for r in p.rows] == [r.to_json() for r in rows]
    assert p.sha256 == hashlib.sha256((tmp_path / "p" / "panel.jsonl").read_bytes()).hexdigest()
    assert json.loads((tmp_path / "p" / "manifest.json").read_text())["sha256"] == p.sha256
    with open(tmp_path / "p" / "panel.jsonl", "a") as f:
        f.write(json.dumps({"id": "extra", "domain": "x", "text": "more"}) + "\n")
    with pytest.raises(PanelError, match=r"panel\.jsonl: sha256 .* differs from the manifest"):
        load_panel(tmp_path / "p")


def test_only_assistant_tokens_are_scored(tokenizer, rng_seed):
    import numpy as np
    row = _rows(np.random.default_rng(rng_seed))[0]
    tokens, scored = render_chat(row, tokenizer)
    full = tokenizer.apply_chat_template(row.messages, tokenize=False)
    assert tokenizer.decode(tokens) == full
    scored_text = tokenizer.decode([t for t, s in zip(tokens, scored) if s])
    expected = "".join(m["content"] + "<|im_end|>" for m in row.messages if m["role"] == "assistant")
    assert scored_text == expected


def test_text_rows_score_every_token_after_the_first(tokenizer):
    t = tokenize_row(PanelRow("t", "writing", text="The quick brown fox jumps."), tokenizer)
    assert t.scored == [False] + [True] * (len(t.tokens) - 1)
    assert t.tokens == tokenizer("The quick brown fox jumps.")["input_ids"]


def test_bad_rows_are_named(tmp_path, tokenizer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "ok", "domain": "a", "text": "x y"}) + "\n" +
                   json.dumps({"id": "d7", "domain": ["code"], "text": "x y"}) + "\n")
    with pytest.raises(
        PanelError, match=r"bad\.jsonl line 2 \(row 'd7'\): field 'domain' must be a non-empty string, got list"
    ):
        load_panel(bad)
    bad.write_text(json.dumps({"id": "u1", "domain": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(PanelError, match=r"line 1 \(row 'u1'\): a chat row needs an assistant message"):
        load_panel(bad)
    with pytest.raises(PanelError, match=r"row 'one' \(misc\) has no scored tokens"):
        tokenize_row(PanelRow("one", "misc", text="Hi"), tokenizer)
    long_row = PanelRow("long", "misc", text="word " * 50)
    with pytest.raises(PanelError, match=r"row 'long' \(misc\) is \d+ tokens, longer than the model's context of 16"):
        tokenize_row(long_row, tokenizer, max_len=16)
    t = tokenize_row(long_row, tokenizer, max_len=16, truncate=True)
    assert len(t.tokens) == 16 and t.truncated and t.n_scored == 15
    dup = tmp_path / "dup.jsonl"
    dup.write_text((json.dumps({"id": "x", "domain": "a", "text": "x y"}) + "\n") * 2)
    with pytest.raises(PanelError, match="row id 'x' appears twice"):
        load_panel(dup)


def test_parquet_and_hf_datasets_loaders_read_local_files(tmp_path, rng_seed):
    import numpy as np
    rows = _rows(np.random.default_rng(rng_seed))
    records = [r.to_json() for r in rows]
    table = pa.Table.from_pylist([{**{"messages": None, "text": None}, **r} for r in records])
    pq.write_table(table, tmp_path / "p.parquet")
    from_parquet = load_panel(tmp_path / "p.parquet")
    assert [r.to_json() for r in from_parquet.rows] == records
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for builder, f in (("json", "p.jsonl"), ("parquet", "p.parquet")):
        ds_panel = load_hf_panel(builder, data_files=str(tmp_path / f), cache_dir=str(tmp_path / "hf_cache"))
        assert [r.to_json() for r in ds_panel.rows] == records, builder
    assert from_parquet.sha256 == ds_panel.sha256
    with pytest.raises(PanelError, match="datasets cannot load 'json'"):
        load_hf_panel("json", data_files=str(tmp_path / "missing.jsonl"), cache_dir=str(tmp_path / "hf_cache"))


def test_invalid_json_line_names_file_and_line(tmp_path):
    from fidelity.panels.build import read_prompts
    from fidelity.panels.panel import PanelError, read_jsonl

    bad = tmp_path / "rows.jsonl"
    bad.write_text('\n{"id": "b", "domain": \n{"id": "c", "domain": "math", "text": "1 + 1 = 2"}\n')
    for reader in (read_jsonl, read_prompts):
        with pytest.raises(PanelError, match=r"rows\.jsonl line 2: invalid JSON"):
            reader(bad)


def test_an_answer_cut_short_scores_its_content_but_not_the_end_of_turn(tokenizer, rng_seed):
    answer = "The capital of France is Paris, a city on the river"
    messages = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": answer}]
    whole = render_chat(PanelRow("w", "knowledge", messages=messages), tokenizer)
    cut = render_chat(PanelRow("c", "knowledge", messages=[messages[0], {**messages[1], "truncated": True}]), tokenizer)
    assert cut[0] == whole[0]  # the same rendering; only what is scored differs
    scored_whole = tokenizer.decode([t for t, s in zip(*whole) if s])
    scored_cut = tokenizer.decode([t for t, s in zip(*cut) if s])
    assert scored_whole.startswith(scored_cut) and scored_whole != scored_cut
    assert scored_cut.strip() == answer
    assert "<|im_end|>" in scored_whole and "<|im_end|>" not in scored_cut


def test_the_default_panel_is_the_repositorys_panels_default():
    # found from the module's own path: moving the module (fidelity/panels.py -> fidelity/measuring/) once broke it
    from pathlib import Path

    from fidelity.panels.panel import DEFAULT_PANEL

    assert DEFAULT_PANEL == Path(__file__).resolve().parents[1] / "panels" / "default"
    assert load_panel(None).rows and load_panel(None).path == DEFAULT_PANEL
