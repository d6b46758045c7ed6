"""`fidelity serve`: the oracle as an OpenAI-compatible engine, checked against transformers and gated against
itself."""

from __future__ import annotations

import asyncio
import sys

import httpx
import numpy as np
import pytest

from fidelity.engine.client import ClientConfig, EngineClient, EngineHTTPError
from testkit.faults import Spawned, free_port

from _gate_cli import gate_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(smollm2_gguf, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [sys.executable, "-m", "fidelity", "serve", str(smollm2_gguf), "--port", str(port), "--model-name", "smol"]
    with Spawned(cmd, port, timeout_s=300, log=str(log)) as srv:
        yield srv


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    from fidelity.packs import open_pack
    from fidelity.packs.tokenizer import load_tokenizer

    pack = open_pack(smollm2_gguf)
    return pack, load_tokenizer(pack)


def client_run(url, coro_fn):
    async def go():
        async with EngineClient(ClientConfig(url, model="smol", concurrency=4, timeout_s=600)) as c:
            return await coro_fn(c)
    return asyncio.run(go())


def test_served_logprobs_equal_transformers(served, smol, smollm2_gguf, rng_seed):
    import torch
    from transformers import AutoModelForCausalLM

    pack, tok = smol
    rng = np.random.default_rng(rng_seed)
    words = ["honey", "river", "blue", "seven", "quiet", "engine", "paper", "north"]
    text = "<|im_start|>" + " ".join(rng.choice(words, size=6))
    comp = client_run(served.url, lambda c: c.completion(text, max_tokens=2, logprobs=5, echo=True, tag="hf",
                                                         extra={"return_tokens_as_token_ids": True}))
    ids = tok.encode(text, add_special_tokens=False)
    all_ids = [t.token_id for t in comp.logprobs]
    assert all_ids[: len(ids)] == ids and len(all_ids) == len(ids) + 2
    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, torch_dtype=torch.float32
    )
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([all_ids])).logits[0].double(), -1)
    want = [lp[t - 1, x].item() for t, x in enumerate(all_ids) if t > 0]
    got = [t.logprob for t in comp.logprobs[1:]]
    assert comp.logprobs[0].logprob is None and len(got) == len(want)
    np.testing.assert_allclose(got, want, atol=2e-4)
    # greedy: each generated token is the argmax of its distribution
    for t in comp.logprobs[len(ids):]:
        assert t.logprob == pytest.approx(max(t.top_ids.values()), abs=1e-12)


def test_serve_passes_all_four_gates_against_itself(served, smol, smollm2_gguf, tmp_path):
    """The whole CLI path: a reference store from `fidelity reference`'s builder, `fidelity gate` against `fidelity
    serve`. Three processes each compute for the first time here; their first vector-math calls once made this flaky
    (issue 6, see vector_math.warm_up_vector_math)."""
    import json
    import xml.etree.ElementTree as ET

    from fidelity.commands.reference import build_store
    from fidelity.panels.panel import PanelRow, write_panel

    pack, tok = smol
    panel = write_panel(
        tmp_path / "panel",
        [
            PanelRow(
                "fruit",
                "chat",
                messages=[{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "An apple."}],
            ),
            PanelRow(
                "sum",
                "math",
                messages=[{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "4."}],
            ),
        ],
        name="serve-gate",
    )
    store = tmp_path / "store"
    build_store(pack, panel.path, store, progress=False)
    cfg = tmp_path / "gate.toml"
    cfg.write_text('[settings]\nprompts = ["The capital of France is", "Bees make"]\nprompt_prefix = "<|im_start|>"\n'
                   'max_tokens = 3\ntop_k = 20\nbatch_sizes = [2]\nlong_prompt_repeats = 2\n'
                   '[oracle-kl]\nmin_rows = 2\nmin_positions = 7\n')   # this panel: 2 rows, 7 scored positions
    js, xml = tmp_path / "gate.json", tmp_path / "gate.xml"
    r = gate_cli("--engine", served.url, "--model", "smol", "--reference-store", str(store), "--reference-pack",
                 str(smollm2_gguf), "--panel", str(panel.path), "--config", str(cfg), "--json", str(js), "--junit",
                 str(xml), timeout=900)
    print(r.stdout[-3000:], r.stderr[-2000:])
    rep = json.loads(js.read_text())
    assert r.returncode == 0 and [g["status"] for g in rep["gates"]] == ["pass"] * 4
    okl = rep["gates"][0]["measured"]
    scored = json.loads((store / "manifest.json").read_text())["panel"]["scored_positions"]
    # the head computes every position alike (runner.HEAD_ROWS), so serve's logits equal the store's bit for bit; this
    # also needs equal hidden states: both rows (39 and 42 tokens) run alone in the store as in serve (rows of one
    # length
    # are batched together, and the layers are not batch-invariant)
    assert okl["positions"] == scored and okl["kl_mean"] == 0.0 and okl["top1"] == 1.0
    by = {g["gate"]: g["measured"] for g in rep["gates"]}
    assert by["batch-invariance"]["max_abs_dlogprob"] == 0.0 and by["prefix-cache"]["max_abs_dlogprob"] == 0.0
    assert by["decode-vs-prefill"]["max_abs_dlogprob"] < 1e-4
    assert ET.parse(xml).getroot().get("tests") == "4"


def test_chat_tokenize_and_bad_requests(served, smol):
    pack, tok = smol
    chat = client_run(
        served.url,
        lambda c: c.chat(
            [{"role": "user", "content": "Say hi."}], max_tokens=4, logprobs=True, top_logprobs=2, tag="chat"
        ),
    )
    assert isinstance(chat.content, str) and len(chat.logprobs) == chat.usage["completion_tokens"] <= 4
    ids = client_run(served.url, lambda c: c.tokenize("Hello there, world"))
    assert ids == tok.encode("Hello there, world", add_special_tokens=False)
    with pytest.raises(EngineHTTPError, match="token id 999999 is outside the vocabulary") as e:
        client_run(served.url, lambda c: c.completion([1, 999999], max_tokens=1, tag="bad"))
    assert e.value.status == 400
    r = httpx.post(served.url + "/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400
