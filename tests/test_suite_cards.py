"""Suites as the seed cards run them (issue 44 item 3) and the bench's label and failure counts (item 4), on a fake
OpenAI-compatible engine served over HTTP (a word tokenizer, a needle reader that forgets the last fifth of its context,
scripted tool calls, reasoning only when the `thinking` template key is on) and on the fault server."""
from __future__ import annotations

import ast
import asyncio
import copy
import json
import random
import re
import subprocess
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import jinja2
import numpy as np
import pytest
from scipy import stats

from fidelity.cli import main as cli
from fidelity.engine.client import ClientConfig, EngineClient, EngineHTTPError
from fidelity.engine.serve import JsonHandler
from fidelity.panels.build import EngineSettings
from fidelity.suites import make_suite
from fidelity.suites.paired import compare_runs
from fidelity.suites.records import read_manifest, read_records
from fidelity.suites.runner import Item, Settings, request_body, run_suite

from test_suite_scoring import first_option, plain_answer

NEEDLE = re.compile(r"The special magic number for ([a-z]+-[a-z]+) is (\d{7})\.")
FORGETS_AFTER = 0.8  # the fake engine's needle reader misses needles past this share of the prompt's words


class FakeEngine:
    """State and answers of the fake engine (the HTTP handler calls `answer`)."""

    def __init__(self):
        self.script: dict[str, dict] = {}  # last user message -> message to answer with (tool calls)
        self.reasoning_words = 3  # reasoning length = this + (words of the question % 5), when `thinking` is on
        self.usage_reasoning = False  # report reasoning_tokens in usage (else the client tokenizes the reasoning)
        self.context = 700
        self.bodies: list[dict] = []

    def answer(self, path: str, body: dict) -> tuple[int, dict]:
        if path == "/v1/models":
            return 200, {"data": [{"id": "fake", "max_model_len": self.context}]}
        if path == "/tokenize":
            return 200, {"tokens": list(range(len((body.get("prompt") or "").split())))}
        if path != "/v1/chat/completions":
            return 404, {"error": f"no route {path}"}
        self.bodies.append(body)
        text = body["messages"][-1]["content"]
        words = len(" ".join(m.get("content") or "" for m in body["messages"]).split())
        msg = {"role": "assistant", "content": ""}
        if body.get("max_tokens") == 1:
            pass
        elif text in self.script:
            msg.update(copy.deepcopy(self.script[text]))
        elif "magic number" in text:
            msg["content"] = needle_answer(text)
        usage = {"prompt_tokens": words + 7, "completion_tokens": 5}
        if (body.get("chat_template_kwargs") or {}).get("thinking"):  # read as DeepSeek V3.1+ templates read it
            n = self.reasoning_words + len(text.split()) % 5
            msg["reasoning_content"] = " ".join(["think"] * n)
            if self.usage_reasoning:
                usage["completion_tokens_details"] = {"reasoning_tokens": n}
        reply = {
            "choices": [
                {"index": 0, "message": msg, "finish_reason": "tool_calls" if msg.get("tool_calls") else "stop"}
            ],
            "usage": usage,
        }
        return 200, reply


def needle_answer(prompt: str) -> str:
    """Each needle found before FORGETS_AFTER of the words, else 0; one line per asked key."""
    words = prompt.split()
    pos = {m.group(1): (len(prompt[: m.start()].split()) / len(words), m.group(2)) for m in NEEDLE.finditer(prompt)}
    asked = re.search(r"magic numbers? for (.+?) mentioned", prompt).group(1).replace(" and ", ", ").split(", ")
    values = {k: (v if p < FORGETS_AFTER else "0") for k, (p, v) in pos.items()}
    if len(asked) == 1:
        return values[asked[0]]
    return "\n".join(f"{k}: {values[k]}" for k in asked)


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine()

    class Handler(JsonHandler):
        def do_GET(self):
            self.send_json(*engine.answer(self.path, {}))

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            self.send_json(*engine.answer(self.path, body))

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    engine.url = f"http://127.0.0.1:{srv.server_address[1]}"
    yield engine
    srv.shutdown()


# ---- thinking
# -----------------------------------------------------------------------------------------------------------

# DeepSeek-V3.1's chat template decides thinking from the `thinking` variable alone (its switch, as in its
# tokenizer_config)
V31_SWITCH = ("{% if not thinking is defined %}{% set thinking = false %}{% endif %}"
              "{% for m in messages %}{{ '<｜User｜>' + m['content'] }}{% endfor %}"
              "{% if add_generation_prompt %}{% if not thinking %}{{ '<｜Assistant｜></think>' }}"
              "{% else %}{{ '<｜Assistant｜><think>' }}{% endif %}{% endif %}")


def test_thinking_reaches_a_template_that_reads_thinking():
    """Old code sent only enable_thinking: a V3.1 template saw `thinking` undefined and rendered thinking off for on."""
    suite = make_suite("needle", lengths=[512], depths=[0.5], seeds=1)
    for on in (True, False):
        body = request_body(suite, Item("x", "hi"), Settings(thinking=on), "m")
        kwargs = body["chat_template_kwargs"]
        assert kwargs == {"enable_thinking": on, "thinking": on}
        assert EngineSettings(thinking="on" if on else "off").template_kwargs() == kwargs  # panel build: the same keys
        wire = jinja2.Template(V31_SWITCH).render(messages=body["messages"], add_generation_prompt=True, **kwargs)
        assert wire.endswith("<｜Assistant｜><think>" if on else "<｜Assistant｜></think>"), (on, wire)
    assert "chat_template_kwargs" not in request_body(suite, Item("x", "hi"), Settings(), "m")


@pytest.mark.slow
def test_thinking_on_off_through_the_deepseek_v41_encoder():
    """vLLM's DeepSeek-V4.1 tokenizer (its port of DeepSeek's encoding_dsv41) renders the request's
    chat_template_kwargs; the mini packs' tokenizer files stand under it (their chat template is a stand-in, the encoder
    is code)."""
    from _vllm import VENV

    py = VENV / "bin" / "python"
    if not py.exists():
        pytest.skip(f"missing tool: vLLM's venv at {VENV} (.ci/install-vllm)")
    kw = {on: request_body(make_suite("needle", lengths=[512], depths=[0.5], seeds=1), Item("x", "hi"),
                           Settings(thinking=on), "m")["chat_template_kwargs"] for on in (True, False)}
    tok_dir = Path(__file__).parent / "fixtures" / "v4" / "tiny_v4"
    script = (
        "import json, sys\nfrom vllm.tokenizers.deepseek_v41 import DeepseekV41Tokenizer\n"
        f"tok = DeepseekV41Tokenizer.from_pretrained({str(tok_dir)!r})\n"
        "msgs = [{'role': 'user', 'content': 'hi'}]\n"
        "out = {k: tok.apply_chat_template(msgs, tokenize=False, **v) for k, v in json.loads(sys.argv[1]).items()}\n"
        "print(json.dumps(out))"
    )
    run = subprocess.run([str(py), "-c", script, json.dumps({"on": kw[True], "off": kw[False]})], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["on"].endswith("<｜User｜>hi<｜Assistant｜><think>") and "Reasoning Effort" in out["on"], out
    assert out["off"] == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>", out


# ---- needle
# ---------------------------------------------------------------------------------------------------------------

def expected_needle(run_dir: Path) -> dict:
    """(length, depth) -> [passed, items], from the prompts sent, by the fake engine's rule (not the suite's scorer)."""
    out = {}
    for _, r in read_records(run_dir).iterrows():
        prompt = json.loads(r["request"])["messages"][0]["content"]
        det = json.loads(r["details"])
        words = prompt.split()
        ok = all(len(prompt[: m.start()].split()) / len(words) < FORGETS_AFTER for m in NEEDLE.finditer(prompt))
        acc = out.setdefault((det["length"], det["depth"]), [0, 0])
        acc[0] += ok
        acc[1] += 1
    return out


def test_needle_grid_with_several_keys_up_to_the_engines_context(fake, tmp_path, capsys):
    fake.context = 700
    out = tmp_path / "needle"
    rc = cli(["suite", "run", "needle", "--engine", fake.url, "--model", "fake", "-o", str(out), "--lengths", "300,max",
              "--depths", "0,0.5,1", "--seeds", "2", "--keys", "2", "--max-tokens", "20", "--concurrency", "2",
              "--haystack", "generated"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    m = read_manifest(out)
    df = read_records(out)
    assert (
        m["suite_config"]["lengths"] == [300, 700] and m["suite_config"]["measure"] == "tokenize + template overhead 7"
    )
    assert m["data"]["source"].startswith("generated prose, seed 0")
    assert sorted(set(df["item_id"])) == sorted(
        f"L{n}-d{d}-s{s}" for n in (300, 700) for d in ("0", "0.5", "1") for s in (0, 1)
    )
    for _, r in df.iterrows():
        prompt = json.loads(r["request"])["messages"][0]["content"]
        det = json.loads(r["details"])
        assert len(NEEDLE.findall(prompt)) == 2 and det["cell"] == f"L{det['length']} d{det['depth']:g}"
        n = len(prompt.split()) + 7  # the fake's tokens
        assert det["prompt_tokens"] == n and det["length"] - 20 - 16 <= n <= det["length"] - 20, (r["item_id"], n)
    want = expected_needle(out)
    cells = {(c["length"], c["depth"]): [c["passed"], c["items"]] for c in m["summary"]["suite"]["cells"]}
    assert cells == want and 0 < sum(v[0] for v in want.values()) < len(df), want
    keys = m["summary"]["metrics"]["keys"]
    assert keys["of"] == 2 * len(df) and keys["followed"] == sum(
        k["found"] for d in df["details"] for k in json.loads(d)["keys"]
    )
    assert "needle, 2 key(s) per prompt" in printed
    for (n, d), (k, items) in want.items():  # the printed table's row for each length
        assert re.search(rf"^\s+{n}\b.*\b{k}/{items}", printed, re.M), printed


def test_needle_max_length_needs_a_stated_context(tmp_path):
    class NoContext:
        async def tokenize(self, text):
            return text.split()

        async def chat(self, messages, max_tokens=1, tag=""):
            from types import SimpleNamespace

            return SimpleNamespace(usage={"prompt_tokens": len(messages[0]["content"].split())})

    suite = make_suite("needle", lengths="max", depths=[0.5], seeds=1)
    with pytest.raises(Exception, match="give --context"):
        asyncio.run(suite.prepare(suite.load(), NoContext(), Settings()))
    suite = make_suite("needle", lengths="max", depths=[0.5], seeds=1, context=400)
    items = asyncio.run(suite.prepare(suite.load(), NoContext(), Settings(max_tokens=20)))
    assert [it.item_id for it in items] == ["L400-d0.5-s0"] and 380 - 16 <= items[0].data["prompt_tokens"] <= 380


# ---- toolcall: BFCL categories and call integrity
# ------------------------------------------------------------------------

def as_text(v):
    return ("true" if v else "false") if isinstance(v, bool) else v if isinstance(v, str) else json.dumps(v)


def test_bfcl_categories_and_call_integrity_through_a_run(fake, tmp_path, rng_seed):
    suite = make_suite("toolcall")
    rng = random.Random(rng_seed)
    by_cat: dict[str, list[Item]] = {}
    for it in suite.load():
        by_cat.setdefault(it.data["category"], []).append(it)
    assert sorted(by_cat) == sorted(suite.categories) and len(by_cat) == 13
    chosen, want, calls = [], {}, {"calls": 0, "well_formed": 0, "right_function": 0, "right_arguments": 0}
    asked: set[str] = set()
    for cat, items in by_cat.items():
        row_of = lambda it: suite._rows[it.item_id]
        pool = [it for it in items if cat in ("irrelevance", "live_irrelevance", "live_relevance")
                or plain_answer(row_of(it))]
        # the fake engine answers by the last message's text: items that share it (BFCL's live_parallel asks the same
        # Boston / San Francisco question in several rows) would get one another's scripted reply
        pool = list({it.messages[-1]["content"]: it for it in reversed(pool)
                     if it.messages[-1]["content"] not in asked}.values())[::-1]
        picked = rng.sample(pool, min(4, len(pool)))
        asked |= {it.messages[-1]["content"] for it in picked}
        chosen += picked
        passed = 0
        for j, it in enumerate(picked):
            row, text = row_of(it), it.messages[-1]["content"]
            mode = (
                2 if cat == "simple_java" and j % 3 == 0 else j % 3
            )  # Java's long values need a suffix: no right ones
            if cat in ("irrelevance", "live_irrelevance"):
                reply = {} if j % 2 == 0 else {"tool_calls": [{"id": "c", "type": "function", "function": {
                    "name": it.tools[0]["function"]["name"], "arguments": "{}"}}]}
                passed += j % 2 == 0
                calls["calls"] += j % 2
                calls["well_formed"] += j % 2
            elif cat == "live_relevance":
                reply = {"tool_calls": [{"id": "c", "type": "function", "function": {
                    "name": it.tools[0]["function"]["name"], "arguments": "{}"}}]}
                passed += 1
                calls = {k: v + 1 for k, v in calls.items()}
            elif mode == 0:  # the possible answer's first options: right
                tc = []
                for fn in row["answer"]:
                    (name, params), = fn.items()
                    args = {k: first_option(o) for k, o in params.items() if o and o[0] != ""}
                    if cat == "simple_javascript":
                        args = {k: as_text(v) for k, v in args.items()}
                    tc.append({"id": "c", "type": "function", "function": {"name": name.replace(".", "_"),
                                                                           "arguments": json.dumps(args)}})
                reply = {"tool_calls": tc}
                passed += 1
                calls = {k: v + len(tc) for k, v in calls.items()}
            elif mode == 1:  # the right function with no arguments: wrong arguments
                name = next(iter(row["answer"][0])).replace(".", "_")
                reply = {"tool_calls": [{"id": "c", "type": "function", "function": {"name": name, "arguments": "{}"}}]}
                calls["calls"] += 1
                calls["well_formed"] += 1
                calls["right_function"] += 1
                # {} matches only where the possible answer makes every parameter optional
                opt = all("" in o for o in next(iter(row["answer"][0].values())).values()) and len(row["answer"]) == 1
                calls["right_arguments"] += opt
                passed += opt
            else:  # arguments that are not JSON
                name = next(iter(row["answer"][0])).replace(".", "_")
                reply = {
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": name, "arguments": "{oops"}}]
                }
                calls["calls"] += 1
            fake.script[text] = {"content": "", **reply}
        want[cat] = [passed, len(picked)]
    suite.load = lambda: chosen
    out = tmp_path / "tool"
    summary = asyncio.run(run_suite(suite, out, engine=fake.url, model="fake", settings=Settings(max_tokens=64),
                                    concurrency=2))
    got = summary.suite
    assert summary.errors == 0
    assert {c: [v["passed"], v["items"]] for c, v in got["categories"].items()} == want
    assert got["calls"] == calls, (got["calls"], calls)
    assert set(got["not_covered"]) >= {"multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param",
                                       "multi_turn_long_context", "exec_simple", "rest", "sql"}
    m = summary.metrics
    df = read_records(out)
    wf = [json.loads(d)["well_formed_calls"] == json.loads(d)["calls"] for d in df["details"]]
    assert m["well_formed"]["followed"] == sum(wf) and m["well_formed"]["of"] == len(df)
    # suite compare: per-category McNemar on a second run where every right answer is withdrawn
    for text, reply in list(fake.script.items()):
        fake.script[text] = {"content": "I cannot help."}
    out_b = tmp_path / "tool_b"
    asyncio.run(run_suite(suite, out_b, engine=fake.url, model="fake", settings=Settings(max_tokens=64), concurrency=2))
    rep = compare_runs(out, out_b)
    assert rep["group_by"] == "category"
    for cat, (k, n) in want.items():
        g = rep["groups"][cat]
        irr = cat in ("irrelevance", "live_irrelevance")
        assert (g["items"], g["passed_a"], g["passed_b"]) == (n, k, n if irr else 0), (
            cat,
            g,
        )  # no call: irrelevance passes
        flips = (0, n - k) if irr else (k, 0)
        assert (g["flips_a_to_b"], g["flips_b_to_a"]) == flips
        assert g["p_value"] == pytest.approx(stats.binomtest(max(flips), sum(flips), 0.5).pvalue if sum(flips) else 1.0)


def test_tools_are_bfcls_convert_to_tool_on_every_item():
    """Our `to_tools` against BFCL's own convert_to_tool / _cast_to_openai_type, run from bfcl-eval's source (the module
    itself imports tree-sitter and tenacity, not installed)."""
    import importlib.util

    from fidelity.suites.toolcall import bfcl, to_tools

    src_path = Path(importlib.util.find_spec("bfcl_eval").origin).parent / "model_handler" / "utils.py"
    tree = ast.parse(src_path.read_text())
    keep = [
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("_cast_to_openai_type", "convert_to_tool")
    ]
    assert len(keep) == 2
    from bfcl_eval.constants.enums import ModelStyle

    ns = {
        "copy": copy,
        "re": re,
        "json": json,
        "ModelStyle": ModelStyle,
        "GORILLA_TO_OPENAPI": bfcl().GORILLA_TO_OPENAPI,
    }
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(src_path), "exec"), ns)
    suite = make_suite("toolcall")
    for rid, row in suite._rows.items():
        hinted = bfcl().language_hints(copy.deepcopy(row["function"]), row["category"])
        theirs = ns["convert_to_tool"](hinted, bfcl().GORILLA_TO_OPENAPI, ModelStyle.OPENAI_COMPLETIONS)
        assert to_tools(hinted) == theirs, rid


# ---- reasoning length and its paired change
# ----------------------------------------------------------------------------

def test_reasoning_length_recorded_and_its_paired_change(fake, tmp_path):
    suite = make_suite("needle", lengths=[200], depths=[0.0, 0.5, 1.0], seeds=4)
    runs = {}
    for name, words, usage in (("a", 3, False), ("b", 6, True), ("off", 3, False)):
        fake.reasoning_words, fake.usage_reasoning = words, usage
        thinking = name != "off"
        asyncio.run(run_suite(suite, tmp_path / name, engine=fake.url, model="fake",
                              settings=Settings(max_tokens=20, thinking=thinking), concurrency=2))
        runs[name] = read_records(tmp_path / name)
    a = np.array([json.loads(d)["reasoning"]["tokens"] for d in runs["a"]["details"]], dtype=float)
    b = np.array([json.loads(d)["reasoning"]["tokens"] for d in runs["b"]["details"]], dtype=float)
    words = np.array([len(json.loads(r)["messages"][0]["content"].split()) % 5 for r in runs["a"]["request"]])
    assert np.array_equal(a, 3 + words) and np.array_equal(b, 6 + words)  # tokenized by the engine (a), from usage (b)
    assert {json.loads(d)["reasoning"]["tokens_from"] for d in runs["a"]["details"]} == {"tokenize"}
    assert {json.loads(d)["reasoning"]["tokens_from"] for d in runs["b"]["details"]} == {"usage"}
    assert read_manifest(tmp_path / "a")["summary"]["reasoning"]["tokens_mean"] == pytest.approx(a.mean())
    off = read_manifest(tmp_path / "off")["summary"]["reasoning"]
    assert off["with_reasoning"] == 0 and off["tokens_total"] == 0  # thinking off: the fake never reasoned
    rep = compare_runs(tmp_path / "a", tmp_path / "b")["reasoning"]
    d = b - a
    assert rep["unit"] == "tokens" and rep["items"] == len(a) and rep["change_mean"] == pytest.approx(d.mean())
    assert rep["change_pct"] == pytest.approx(100 * (b.mean() / a.mean() - 1))
    # log ratio of means, delta-method variance, t quantile: written out
    n = len(a)
    var = b.var(ddof=1) / (n * b.mean() ** 2) + a.var(ddof=1) / (n * a.mean() ** 2) - \
        2 * np.cov(a, b)[0, 1] / (n * a.mean() * b.mean())
    half = stats.t.ppf(0.975, n - 1) * np.sqrt(var)
    lo, hi = (100 * (np.exp(np.log(b.mean() / a.mean()) + s * half) - 1) for s in (-1, 1))
    assert rep["change_pct_ci95"] == pytest.approx([lo, hi], rel=1e-9)
    same = rep["change_mean"] == 3.0 and rep["items_longer"] == n  # every item reasons 3 tokens more
    assert same and rep["p_value"] == 0.0
    assert compare_runs(tmp_path / "off", tmp_path / "off")["reasoning"]["note"].startswith("no reply")


# ---- bench label and failure counts; gate's tokenize probes
# ---------------------------------------------------------------

def test_bench_label_and_failure_counts_agree(tmp_path, capsys):
    """Old code: with --aa the JSON's errors held both runs' failures, requests.failed (the console's) only the
    first's."""
    from testkit.faults import spawn_fault_server

    with spawn_fault_server({"stream_drop_after": 2}) as srv:
        out = tmp_path / "bench.json"
        rc = cli(["bench", "--engine", srv.url, "--model", "toy", "--label", "build-A", "--sets", "code",
                  "--prompts-per-set", "1", "--streams", "", "--prefill", "", "--repeats", "1", "--max-tokens", "6",
                  "--retries", "0", "--aa", "--seed", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert rc == 2 and doc["label"] == "build-A" and "build-A" in printed
    failed = int(re.search(r"failed (\d+)", printed).group(1))
    assert failed == len(doc["errors"]) == doc["requests"]["failed"] == 2, (failed, doc["requests"], len(doc["errors"]))
    assert doc["aa"]["second"]["requests"]["failed"] == 1


def serve_routes(routes: dict):
    def handler(request: httpx.Request):
        status, body = routes.get(request.url.path, (404, {"error": "no route"}))
        return httpx.Response(status, json=body)
    return httpx.MockTransport(handler)


def test_tokenize_route_probes_are_not_request_errors():
    """Old code counted the 404 of each probed tokenize route in stats.errors (what `gate` reports as errors), and
    probed again on every call of a server that has none."""
    async def go(routes, calls=2):
        c = EngineClient(ClientConfig("http://engine", model="m", retries=0))
        await c._http.aclose()
        c._http = httpx.AsyncClient(base_url="http://engine", transport=serve_routes(routes))
        got = [await c.tokenize("a b") for _ in range(calls)]
        try:
            await c.completion("x")
        except EngineHTTPError:
            pass
        await c.aclose()
        return got, c.stats

    got, st = asyncio.run(
        go({"/extras/tokenize": (200, {"tokens": [1, 2]}), "/v1/completions": (400, {"error": "bad"})})
    )
    assert got == [[1, 2], [1, 2]] and st.errors == 1 and st.sent == 4  # one probe 404, two tokenizes, the real 400
    got, st = asyncio.run(go({"/v1/completions": (400, {"error": "bad"})}))
    assert got == [None, None] and st.errors == 1 and st.sent == 3  # two probes once, then known absent; the 400
