"""Issue 41, defects 1, 7 and 8: text no UTF-8 can carry, files that are not what was written, and writes that fail.

1. A lone surrogate ("\\ud800": an engine's JSON may hold one, json.loads makes it a str no UTF-8 encoder takes) in a
   model reply, an exception text or a panel row round-trips through every journal and file written (suite run and its
   resume, panel build --engine, panels), with the identity hashes that include such text kept consistent.
7. Every could-not-run path exits 2 naming the file (and line): a journal line that is not UTF-8, a full disk while
   compare keeps a pass, a journal append that fails.
8. Every file a resume trusts is checksummed: an edited routing.json is refused; a journal line that changed after it
   was written (one flipped bit in a logprob) is never used: its request is asked again, with a warning naming it.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from fidelity.engine.journal import Journal, request_key
from fidelity.panels.panel import PanelError, PanelRow, load_panel, rows_sha256, tokenize_row, write_panel
from fidelity.suites.records import ItemJournal, Record, RunError, prompt_hash, read_records
from fidelity.suites.runner import Item, Outcome, Suite, run_suite

LONE = ["\ud800", "\udbff", "\udc00", "\udfff"]  # high and low halves of a UTF-16 pair, each alone


def _hostile(rng: np.random.Generator, n: int = 12) -> str:
    """Fresh random text: ASCII, accented and astral characters, and one lone surrogate somewhere inside."""
    pool = list("abcdef xyz.") + ["é", "ß", "中", "\U0001F600", "\u2028"]
    chars = [pool[i] for i in rng.integers(0, len(pool), n)]
    chars.insert(int(rng.integers(0, n + 1)), LONE[int(rng.integers(0, len(LONE)))])
    return "".join(chars)


# -- a stand-in engine whose replies hold whatever text a test asks for ------------------------------------------------
class StubEngine:
    """An OpenAI-compatible loopback server answering /v1/chat/completions with `reply(body)` as the message content,
    serialized by json.dumps (so a lone surrogate travels as its "\\udXXX" escape, as a real server's JSON would)."""

    def __init__(self, reply):
        self.reply, self.requests = reply, 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests += 1
                out = {"id": "stub", "object": "chat.completion", "model": "stub",
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": stub.reply(body)},
                                    "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
                data = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    engines = []

    def make(reply):
        engines.append(StubEngine(reply))
        return engines[-1]

    yield make
    for e in engines:
        e.close()


class EchoSuite(Suite):
    """Judges the reply as it is: passed when it starts with "ok"; a reply holding "boom" makes the scorer raise an
    exception whose text holds the reply (a lone surrogate included)."""

    name, metric, modes = "echo", "passed", ("chat",)

    def __init__(self, n: int):
        self.n = n

    def load(self):
        return [Item(f"e{i}", f"prompt {i}") for i in range(self.n)]

    def score(self, item, text, calls):
        if "boom" in text:
            raise ValueError(f"cannot judge {text!r}: {text}")
        return Outcome(extracted=text, passed=text.startswith("ok"), verdict=f"saw {text}")


def _prompt_index(body: dict) -> int:
    return int(body["messages"][-1]["content"].split()[-1])


# -- 1. lone surrogates round-trip -------------------------------------------------------------------------------------
def test_a_suite_run_and_its_resume_keep_replies_and_exception_texts_with_lone_surrogates(stub, tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    replies = ["ok " + _hostile(rng), "ok plain é 中", "boom " + _hostile(rng), "no " + _hostile(rng)]
    engine = stub(lambda body: replies[_prompt_index(body)])
    run = tmp_path / "run"
    first = asyncio.run(run_suite(EchoSuite(4), run, engine=engine.url, model="m"))
    assert (first.items, first.errors, first.passed) == (4, 1, 2)
    df = read_records(run).set_index("item_id")
    assert list(df["response"]) == replies    # the exact str, lone surrogate and all, back from records.parquet
    assert df.loc["e0", "extracted"] == replies[0] and df.loc["e0", "verdict"] == "saw " + replies[0]
    assert df.loc["e2", "error"] == f"scorer error: ValueError: cannot judge {replies[2]!r}: {replies[2]}"
    assert list(df["lone_surrogates"]) == [True, False, True, True]   # recorded where it happened
    lines = [json.loads(raw) for raw in (run / "records.jsonl").read_bytes().split(b"\n") if raw]
    assert {ln["item_id"]: ln.get("lone_surrogates", False) for ln in lines} == \
        {"e0": True, "e1": False, "e2": True, "e3": True}
    plain = next(raw for raw in (run / "records.jsonl").read_bytes().split(b"\n") if b'"e1"' in raw)
    assert "ok plain é 中".encode() in plain                     # text without a lone surrogate stays readable
    sent = engine.requests
    again = asyncio.run(run_suite(EchoSuite(4), run, engine=engine.url, model="m"))
    assert engine.requests == sent               # the resume asked nothing: every reply came back from the journal
    assert (again.resumed, again.errors) == (3, 1)
    df2 = read_records(run).set_index("item_id")
    assert df2[["response", "extracted", "verdict", "error"]].equals(df[["response", "extracted", "verdict", "error"]])


def test_panel_build_from_an_engine_answering_a_lone_surrogate(stub, tmp_path, rng_seed):
    from fidelity.panels.build import build_panel_from_engine

    rng = np.random.default_rng(rng_seed)
    answers = [_hostile(rng), "plain answer é"]
    engine = stub(lambda body: answers[_prompt_index(body)])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "domain": "d", "prompt": f"question {i}"}) + "\n"
                               for i in range(2)))
    built = build_panel_from_engine(prompts, engine.url, "m", tmp_path / "panel", progress=False)
    manifest = json.loads((tmp_path / "panel" / "manifest.json").read_text())
    assert manifest["lone_surrogate_rows"] == ["p0"]
    panel = load_panel(tmp_path / "panel")
    assert [r.messages[-1]["content"] for r in panel.rows] == answers
    data = (tmp_path / "panel" / "panel.jsonl").read_bytes()
    assert panel.sha256 == built.sha256 == hashlib.sha256(data).hexdigest() == rows_sha256(panel.rows)
    sent = engine.requests
    again = build_panel_from_engine(prompts, engine.url, "m", tmp_path / "panel", progress=False)
    assert engine.requests == sent and again.sha256 == built.sha256   # resumed from the journal, the same panel


def test_a_panel_row_with_a_lone_surrogate_round_trips_and_tokenizing_it_names_the_row(tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    text, reply = _hostile(rng), _hostile(rng)
    rows = [
        PanelRow("t", "text", text=text),
        PanelRow("c", "chat", messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": reply}]),
        PanelRow("ok", "text", text="plain é\u2028line\x85end"),
    ]
    folder = write_panel(tmp_path / "p", rows, name="p")
    back = load_panel(tmp_path / "p")
    assert [r.to_json() for r in back.rows] == [r.to_json() for r in rows]
    assert back.sha256 == folder.sha256 == rows_sha256(rows) == rows_sha256(back.rows)
    # a bare .jsonl panel (the escape as a real file holds it): its identity is its rows' serialization, as before
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r.to_json()) + "\n" for r in rows))
    bare = load_panel(jsonl)
    assert bare.sha256 == folder.sha256 and [r.to_json() for r in bare.rows] == [r.to_json() for r in rows]
    # a row without a lone surrogate keeps the bytes (and so the sha256) it always had
    assert rows_sha256(rows[2:]) == hashlib.sha256((json.dumps(rows[2].to_json(), ensure_ascii=False) + "\n")
                                                   .encode()).hexdigest()
    tok = _word_tokenizer()
    for row, what in ((rows[0], "its text"), (rows[1], "message 1")):
        with pytest.raises(PanelError, match=rf"row '{row.id}' \({row.domain}\): {what} holds a lone surrogate"):
            tokenize_row(row, tok)
    assert tokenize_row(rows[2], tok).tokens


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel({"[UNK]": 0, "plain": 1}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]")
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    return tok


def test_identity_hashes_take_any_text_and_keep_every_valid_texts_hash(rng_seed):
    rng = np.random.default_rng(rng_seed)
    valid = "prompt é 中 \U0001F600 " + str(rng.integers(1 << 30))
    canon = json.dumps({"path": "/v1/x", "body": {"p": valid}, "tag": "t"}, sort_keys=True, separators=(",", ":"),
                       ensure_ascii=False)
    assert request_key("/v1/x", {"p": valid}, "t") == hashlib.sha256(canon.encode("utf-8")).hexdigest()
    assert (
        prompt_hash({"prompt": valid})
        == hashlib.sha256(
            json.dumps({"messages": None, "prompt": valid, "tools": None}, sort_keys=True, ensure_ascii=False).encode()
        ).hexdigest()[:16]
    )
    # lone surrogates hash, and differently from each other and from any valid text (no collision with U+FFFD either)
    keys = {request_key("/v1/x", {"p": valid + s}) for s in LONE + ["\ufffd", ""]}
    hashes = {prompt_hash({"prompt": valid + s}) for s in LONE + ["\ufffd", ""]}
    assert len(keys) == len(hashes) == len(LONE) + 2


# -- 7. could-not-run paths exit 2 naming the file and line -----------------------------------------------------------
def test_gate_with_a_journal_line_that_is_not_utf8_exits_2_naming_file_and_line(tmp_path, capsys, rng_seed):
    from fidelity.cli import main

    journal = tmp_path / "journal.jsonl"
    j = Journal(journal)
    j.put("k1", {"choices": [{"text": "first"}]}, path="/v1/completions", tag="a")
    j.put("k2", {"choices": [{"text": "second ok"}]}, path="/v1/completions", tag="b")
    j.close()
    lines = journal.read_bytes().split(b"\n")
    at = lines[1].index(b"second") + int(np.random.default_rng(rng_seed).integers(0, 6))
    lines[1] = lines[1][:at] + b"\xff" + lines[1][at + 1:]
    journal.write_bytes(b"\n".join(lines))
    rc = main(["gate", "--engine", "http://127.0.0.1:9", "--model", "m", "--journal", str(journal),
               "--only", "batch-invariance"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"journal {journal}: line 2 is not UTF-8 text (byte 0xff" in err and "Traceback" not in err


def test_a_suite_record_line_that_is_not_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "records.jsonl"
    j = ItemJournal(path)
    for i in range(3):
        j.append(Record(f"i{i}", True, None, "h", "{}", f"reply {i}", "x", "ok", "", 0.1))
    j.close()
    data = bytearray(path.read_bytes())
    data[data.index(b"reply 2")] = 0xC3   # a UTF-8 lead byte followed by an ASCII byte: invalid
    path.write_bytes(bytes(data))
    with pytest.raises(RunError, match=r"line 3 is not UTF-8 text \(byte 0xc3 .*records\.jsonl"):
        ItemJournal(path)


def test_a_journal_append_that_fails_leaves_no_half_line_and_names_the_file(tmp_path):
    """A real failed write: RLIMIT_FSIZE lets the line's first bytes through, then the kernel refuses the rest
    (EFBIG, as ENOSPC would). The file is left as it was, and the error names it."""
    path = tmp_path / "requests.jsonl"
    j = Journal(path)
    j.put("k0", {"text": "before"})
    j.close()
    before = path.read_bytes()
    script = f"""
import resource, signal, sys
from fidelity.engine.journal import Journal
from fidelity.errors import FidelityError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
j = Journal({str(path)!r})
resource.setrlimit(resource.RLIMIT_FSIZE, ({len(before) + 20}, resource.RLIM_INFINITY))
try:
    j.put("k1", {{"text": "x" * 200}})
except FidelityError as e:
    print(e)
    sys.exit(3)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert out.returncode == 3, out.stderr
    assert f"journal {path}: cannot append a line" in out.stdout and "File too large" in out.stdout
    assert path.read_bytes() == before           # no half line for the next append to run into
    j = Journal(path)
    assert j.get("k0") == {"text": "before"} and len(j) == 1
    j.put("k1", {"text": "after"})
    j.close()
    assert Journal(path).get("k1") == {"text": "after"}


# -- compare on tiny packs: a full disk while keeping a pass, an edited routing.json
# ------------------------------------
@pytest.fixture(scope="module")
def packs(tmp_path_factory, smollm2_gguf):
    from test_compare import noisy_packs, tiny_setting

    root, tok, gen = tiny_setting(tmp_path_factory, smollm2_gguf, "hostile_text")
    cfg, w, built = noisy_packs(root, tok, gen, {"small": 0.01})
    rows = [PanelRow("c1", "chat", messages=[{"role": "user", "content": "Name three colors."},
                                             {"role": "assistant", "content": "Red, green and blue."}]),
            PanelRow("t1", "text", text="The river flows through the old town towards the sea.")]
    return {**built, "panel": write_panel(root / "panel", rows, name="hostile").path}


def _compare(packs, out, *extra):
    from fidelity.cli import main
    return main(["compare", str(packs["ref"]), str(packs["small"]), "--panel", str(packs["panel"]), "--out", str(out),
                 "--bootstrap", "50", *extra])


def test_a_full_disk_while_keeping_a_pass_exits_2_naming_it_and_the_rerun_resumes(packs, tmp_path, capsys):
    out = tmp_path / "out"
    (out / "passes").mkdir(parents=True)
    full = out / "passes" / "noise-floor.parquet.partial"
    full.symlink_to("/dev/full")                  # every write to the noise floor's pass fails: ENOSPC
    rc = _compare(packs, out, "--json", str(tmp_path / "a.json"))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "noise-floor" in err and "No space left on device" in err and "Traceback" not in err
    assert str(out / "passes" / "noise-floor.parquet") in err
    full.unlink(missing_ok=True)
    rc = _compare(packs, out, "--json", str(tmp_path / "b.json"))
    assert rc == 0
    assert json.loads((tmp_path / "b.json").read_text())["resumed"] == ["reference"]   # kept before the disk filled


def test_a_full_disk_while_writing_a_panel_is_a_panel_error_naming_the_file(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "panel.jsonl.partial").symlink_to("/dev/full")
    with pytest.raises(PanelError, match=r"panel\.jsonl: cannot write the panel: .*No space left on device"):
        write_panel(tmp_path / "p", [PanelRow("a", "d", text="x " * 5000)], name="p")


# -- 8. every file a resume trusts is checksummed ----------------------------------------------------------------------
def test_an_edited_routing_json_is_refused_on_resume(packs, tmp_path, capsys):
    out = tmp_path / "out"
    assert _compare(packs, out, "--no-noise-floor", "--json", str(tmp_path / "a.json")) == 0
    assert json.loads((tmp_path / "a.json").read_text())["results"][0]["routing"] is None   # a dense pack
    (routing,) = (out / "passes").glob("pack-*.routing.json")
    routing.write_text(json.dumps({"layers": [{"modules": [["model.layers.0.mlp.experts"]], "counts": [7, 1],
                                               "tokens": 8}]}) + "\n")
    capsys.readouterr()
    rc = _compare(packs, out, "--no-noise-floor", "--json", str(tmp_path / "b.json"))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"{routing.name}" in err and "changed after it was written" in err and str(routing) in err


@pytest.fixture(scope="module")
def fault_server():
    from testkit.faults import spawn_fault_server
    with spawn_fault_server() as srv:
        yield srv


def test_a_flipped_bit_in_a_gate_journal_is_asked_again_not_measured(fault_server, tmp_path, monkeypatch, rng_seed):
    """One flipped bit in a journaled logprob used to change the oracle-kl numbers silently (exit 0)."""
    from testkit.faults import set_plan
    from test_gate_coverage import _gate_cli, _texts

    texts = _texts(rng_seed, 4)   # enough rows for a verdict
    journal = tmp_path / "journal.jsonl"
    set_plan(fault_server.url)
    rc, js, _ = _gate_cli(tmp_path, monkeypatch, fault_server.url, texts, journal)
    truth = json.loads(js.read_text())["gates"][0]["measured"]
    assert rc == 0
    data = bytearray(journal.read_bytes())
    kl_line = next(i for i, ln in enumerate(data.split(b"\n")) if b'"tag": "oracle-kl/' in ln)
    start = sum(len(ln) + 1 for ln in data.split(b"\n")[:kl_line])
    rng = np.random.default_rng(rng_seed)
    spots = [start + k for k in range(len(data.split(b"\n")[kl_line]))
             if data[start + k:start + k + 12] == b'"logprob": -']
    at = spots[int(rng.integers(0, len(spots)))] + 12
    assert chr(data[at]).isdigit()
    data[at] ^= 0x01                                        # 0<->1, 2<->3, ...: still a number, a different one
    journal.write_bytes(bytes(data))
    with pytest.warns(
        UserWarning, match=rf"journal {journal}: line\(s\) {kl_line + 1} changed after they were written"
    ):
        rc, js, _ = _gate_cli(tmp_path, monkeypatch, fault_server.url, texts, journal)
    rep = json.loads(js.read_text())
    assert rc == 0 and rep["client"]["sent"] >= 1          # the changed line was asked again
    measured = rep["gates"][0]["measured"]
    assert (measured["kl_max"], measured["kl_mean"]) == (truth["kl_max"], truth["kl_mean"])


def test_a_changed_suite_record_is_run_again(stub, tmp_path):
    replies = ["ok fine", "no thanks"]
    engine = stub(lambda body: replies[_prompt_index(body)])
    run = tmp_path / "run"
    asyncio.run(run_suite(EchoSuite(2), run, engine=engine.url, model="m"))
    path = run / "records.jsonl"
    data = bytearray(path.read_bytes())
    at = data.index(b'"passed": false') + len(b'"passed": ')
    data[at:at + 5] = b"true "                               # the failed item now claims it passed
    path.write_bytes(bytes(data))
    lineno = data[:at].count(b"\n") + 1
    with pytest.warns(UserWarning, match=rf"records\.jsonl: line\(s\) {lineno} changed after they were written"):
        again = asyncio.run(run_suite(EchoSuite(2), run, engine=engine.url, model="m"))
    assert again.resumed == 1 and again.passed == 1           # the item was judged again, from its journaled reply
    assert list(read_records(run)["passed"]) == [True, False]
