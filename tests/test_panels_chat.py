"""Agentic and thinking conversations in the OpenAI chat format: tool calls, tool results, reasoning, multi-part
content, rendered with a tool-capable chat template; token-exact rows; the errors that name the row."""
import copy
import json

import numpy as np
import pytest

from fidelity.panels.panel import PanelError, PanelRow, load_panel, parse_row, render_chat, tokenize_row, write_panel

# A tool-capable template in the Hermes / Qwen style (tools in the system turn, <think> reasoning, <tool_call> JSON,
# tool results as <tool_response> in a user turn), written for this test on SmolLM2's <|im_start|>/<|im_end|> tokens.
TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n' }}{%- endif %}"
    "{{- message.content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' "
    "+ (call.function.arguments | tojson)"
    " + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
]
CITIES = ["Paris", "Lima", "Oslo", "Kyoto", "Accra", "Quito", "Perth"]


@pytest.fixture(scope="module")
def smol_tok(smollm2_gguf):
    from fidelity.packs import open_pack
    from fidelity.packs.tokenizer import load_tokenizer
    return load_tokenizer(open_pack(smollm2_gguf))


@pytest.fixture(scope="module")
def tool_tok(smol_tok):
    tok = copy.deepcopy(smol_tok)
    tok.chat_template = TOOL_TEMPLATE
    return tok


def agentic_row(seed: int, rid: str = "agent-1") -> dict:
    """Two tool calls, their results, a reasoning block, multi-part user content: an OpenAI chat-format row."""
    rng = np.random.default_rng(seed)
    a, b = rng.choice(CITIES, 2, replace=False)
    deg = int(rng.integers(-5, 35))
    hour = int(rng.integers(0, 24))
    return {"id": rid, "domain": "agentic", "tools": TOOLS, "messages": [
        {"role": "system", "content": "You are a travel assistant."},
        {"role": "user", "content": [{"type": "text", "text": f"Weather in {a}"},
                                     {"type": "text", "text": f" and the time in {b}?"}]},
        {"role": "assistant", "content": None, "reasoning_content": f"I need the weather of {a} and the time of {b}.",
         "tool_calls": [{"id": "call_a", "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps({"city": str(a)})}},
                        {"id": "call_b", "type": "function",
                         "function": {"name": "get_time", "arguments": json.dumps({"city": str(b)})}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": json.dumps({"temp_c": deg})},
        {"role": "tool", "tool_call_id": "call_b", "content": f"{hour:02d}:15"},
        {"role": "assistant", "content": f"It is {deg} C in {a}; in {b} it is {hour:02d}:15."}]}


def expected_by_hand(row: dict) -> tuple[list[dict], str, str, str]:
    """What the template must receive (content joined, arguments as objects), and the text of the assistant spans
    written out from the template's definition: with reasoning, without it, and the reasoning alone."""
    m = row["messages"]
    calls = [{"id": c["id"], "type": "function",
              "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
             for c in m[2]["tool_calls"]]
    as_template = [m[0], {"role": "user", "content": "".join(p["text"] for p in m[1]["content"])},
                   {"role": "assistant", "content": "", "reasoning_content": m[2]["reasoning_content"],
                    "tool_calls": calls},
                   {**m[3], "name": "get_weather"}, {**m[4], "name": "get_time"}, m[5]]
    call_text = "".join('<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>'
                        % (c["function"]["name"], json.dumps(c["function"]["arguments"])) for c in calls)
    reasoning = m[2]["reasoning_content"]
    with_r = f"<think>\n{reasoning}\n</think>\n{call_text}<|im_end|>{m[5]['content']}<|im_end|>"
    without_r = f"<think>\n\n</think>\n{call_text}<|im_end|>{m[5]['content']}<|im_end|>"
    return as_template, with_r, without_r, reasoning


def scored_text(tok, tokens, scored) -> str:
    return tok.decode([t for t, s in zip(tokens, scored) if s])


def test_tool_calls_results_and_reasoning_score_exactly_the_assistant_spans(tool_tok, rng_seed):
    obj = agentic_row(rng_seed)
    row = parse_row(obj, "test")
    assert row.tools == TOOLS and row.messages[3]["tool_call_id"] == "call_a"
    as_template, with_r, without_r, reasoning = expected_by_hand(obj)
    tokens, scored = render_chat(row, tool_tok)
    # the same tokens as transformers' own apply_chat_template given the conversation as the template expects it
    reference = tool_tok.apply_chat_template(as_template, tools=TOOLS, tokenize=True)
    reference = list(reference["input_ids"] if hasattr(reference, "keys") else reference)
    assert tokens == reference
    rendered = tool_tok.decode(tokens)
    assert "# Tools" in rendered and '"get_time"' in rendered and "<tool_response>" in rendered
    assert scored_text(tool_tok, tokens, scored) == with_r
    # nothing of the system, user or tool turns is scored: the token ranges transformers renders for them are unscored
    ids = lambda msgs, gen: len(tool_tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=gen,
                                                             tokenize=True, return_dict=True)["input_ids"])
    for lo, hi in ((0, ids(as_template[:2], True)), (ids(as_template[:3], False), ids(as_template[:5], True))):
        assert tokens[:hi] == reference[:hi] and not any(scored[lo:hi])
    tokens2, scored2 = render_chat(row, tool_tok, score_reasoning=False)
    assert tokens2 == tokens
    assert scored_text(tool_tok, tokens2, scored2) == without_r
    n_reasoning = len(tool_tok(reasoning, add_special_tokens=False)["input_ids"])
    assert sum(scored) - sum(scored2) == n_reasoning


def test_the_row_roundtrips_through_a_panel_folder(tmp_path, tool_tok, rng_seed):
    obj = agentic_row(rng_seed)
    panel = write_panel(tmp_path / "p", [parse_row(obj, "test")], name="agentic")
    back = load_panel(tmp_path / "p")
    assert back.sha256 == panel.sha256 and back.rows[0].to_json() == parse_row(obj, "x").to_json()
    assert render_chat(back.rows[0], tool_tok) == render_chat(parse_row(obj, "x"), tool_tok)


def test_token_exact_row_tokenizes_to_the_same_positions(tool_tok, rng_seed):
    chat = parse_row(agentic_row(rng_seed), "test")
    want = tokenize_row(chat, tool_tok)
    exact = parse_row({"id": "agent-1", "domain": "agentic", "tokens": want.tokens,
                       "scored": [int(s) for s in want.scored]}, "test")
    got = tokenize_row(exact, tool_tok)
    assert (got.tokens, got.scored) == (want.tokens, want.scored)
    start = next(i for i, s in enumerate(want.scored) if s)
    from_k = parse_row({"id": "t", "domain": "d", "tokens": want.tokens, "score_from": start}, "test")
    assert from_k.scored == [False] * start + [True] * (len(want.tokens) - start)
    assert parse_row(from_k.to_json(), "again").scored == from_k.scored


@pytest.mark.slow
def test_token_exact_row_gives_identical_compare_numbers(tmp_path, smollm2_gguf, tool_tok, monkeypatch, rng_seed):
    """compare() on the conversation and on the same row as token ids: every number of the report is the same."""
    import torch
    from safetensors.torch import save_file

    import fidelity.measuring.compare as C
    import fidelity.packs.tokenizer as T
    from fidelity.measuring.compare import compare
    from fidelity.packs import open_pack

    ref = open_pack(smollm2_gguf)
    # the pack's tokenizer with the tool template, wherever compare and the panel code look it up
    monkeypatch.setattr(T, "load_tokenizer", lambda pack: tool_tok)
    monkeypatch.setattr(C, "load_tokenizer", lambda pack: tool_tok)
    # a lossy candidate: an overlay of the reference with one projection perturbed
    name = "model.layers.3.mlp.down_proj.weight"
    w = ref.tensor(name)
    noise = torch.randn(w.shape, generator=torch.Generator().manual_seed(rng_seed))
    (tmp_path / "cand").mkdir()
    save_file({name: (w + 0.05 * w.abs().mean() * noise).contiguous()}, tmp_path / "cand" / "model.safetensors")
    (tmp_path / "cand" / "fidelity_overlay.json").write_text(json.dumps({"base": str(smollm2_gguf)}))
    chat = parse_row(agentic_row(rng_seed), "test")
    t = tokenize_row(chat, tool_tok)
    exact = PanelRow(chat.id, chat.domain, tokens=t.tokens, scored=t.scored)
    results = []
    for kind, row in (("chat", chat), ("tokens", exact)):
        p = write_panel(tmp_path / kind, [row], name="one")
        r = compare(ref, [open_pack(tmp_path / "cand")], panel=p.path, noise_floor=False, n_boot=200, progress=False)
        results.append(r.report["results"][0])
    print(results[0]["overall"])
    assert results[0]["overall"]["kld_mean"] > 0
    assert results[0]["overall"] == results[1]["overall"]
    assert results[0].get("domains") == results[1].get("domains")


@pytest.mark.parametrize("change, message", [
    (lambda m: m[3].update(tool_call_id="call_zzz"), r"row 'agent-1'\): message 3 \(tool\): tool_call_id 'call_zzz' "
                                                     r"answers no earlier assistant tool call"),
    (lambda m: m[4].update(tool_call_id="call_a"), r"message 4 \(tool\): tool_call_id 'call_a' answers no earlier"),
    (lambda m: m[3].pop("tool_call_id"), r"message 3 \(tool\): tool_call_id None answers no earlier"),
    (lambda m: m[2]["tool_calls"][1].update(id="call_a"), r"message 2: tool call id 'call_a' is used twice"),
    (lambda m: m[2]["tool_calls"][0]["function"].update(arguments="{city: Paris"),
     r"message 2: tool_calls\[0\]: function.arguments is not JSON"),
    (lambda m: m[1]["content"].append({"type": "image_url", "image_url": {"url": "x"}}),
     r"message 1: content part 2 is 'image_url'; only text parts"),
    (lambda m: m[5].update(content=None), r"message 5: an assistant message needs content, tool_calls or reasoning"),
])
def test_bad_conversations_are_named(rng_seed, change, message):
    obj = agentic_row(rng_seed)
    change(obj["messages"])
    with pytest.raises(PanelError, match=message):
        parse_row(obj, "panel.jsonl line 3")


def test_bad_token_rows_are_named(tool_tok, tmp_path):
    n = len(tool_tok)
    bad = tmp_path / "bad.jsonl"
    cases = [
        (
            {"tokens": [1, 2, n + 5, 3], "scored": [0, 1, 1, 1]},
            rf"row 'r1' \(d\): tokens\[2\] = {n + 5} is outside the pack's vocabulary of {n} ids",
        ),
        (
            {"tokens": [1, 2, 3], "scored": [0, 1]},
            r"line 1 \(row 'r1'\): 'scored' must have one flag per token "
            r"\(3\), got 2 entries",
        ),
        ({"tokens": [1, 2, 3], "scored": [1, 1, 1]}, r"scored\[0\] is true"),
        ({"tokens": [1, -2, 3], "score_from": 1}, r"tokens\[1\] is -2, not a token id"),
        ({"tokens": [1, 2, 3], "score_from": 3}, r"'score_from' must be an integer from 1 to 2"),
        ({"tokens": [1, 2], "scored": [0, 1], "score_from": 1}, r"exactly one of 'scored' .* or 'score_from'"),
        ({"tokens": [1, 2], "text": "hi"}, r"exactly one of 'messages' \(chat\), 'text' \(plain text\) or 'tokens'"),
    ]
    for body, message in cases:
        bad.write_text(json.dumps({"id": "r1", "domain": "d", **body}) + "\n")
        with pytest.raises(PanelError, match=message):
            tokenize_row(load_panel(bad).rows[0], tool_tok)


def test_template_without_reasoning_or_prefix_rendering_is_an_error_naming_the_row(smol_tok, tool_tok, rng_seed):
    row = parse_row(agentic_row(rng_seed, rid="think-7"), "test")
    no_reasoning = copy.deepcopy(tool_tok)
    no_reasoning.chat_template = TOOL_TEMPLATE.replace("message.reasoning_content", "message.no_such_field")
    with pytest.raises(PanelError, match=r"row 'think-7': message 2 has reasoning_content, but the pack's chat "
                                         r"template reads no reasoning"):
        render_chat(row, no_reasoning)
    # a template that renders earlier assistant turns differently (drops their reasoning) cannot be split by prefix
    drops = copy.deepcopy(tool_tok)
    drops.chat_template = TOOL_TEMPLATE.replace("{%- if message.reasoning_content %}",
                                                "{%- if message.reasoning_content and loop.last %}")
    with pytest.raises(PanelError, match=r"row 'think-7': the chat template does not render this conversation prefix "
                                         r"by prefix, so assistant turn 2 cannot be located"):
        render_chat(row, drops)


# ---- a pack whose chat format is code (DeepSeek's encoding/*.py), rendered only with --trust-pack-code
# -----------------

TOY_ENCODER = '''
import json

ASSISTANT = "<|im_start|>assistant\\n"


def encode_messages(messages, thinking_mode, drop_thinking=True, add_default_bos_token=True):
    """DSML-like wire text on SmolLM2's special tokens: tools on the system message, tool results merged into a
    user-side block, the assistant prefix (with <think> in thinking mode) after every user or tool turn."""
    out = "<|im_start|>" if add_default_bos_token else ""
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "system":
            tools = "\\nTOOLS " + json.dumps(m["tools"]) if m.get("tools") else ""
            out += "system " + m["content"] + tools + "<|im_end|>"
        elif role == "user":
            out += "<|im_start|>user\\n" + m["content"] + "<|im_end|>"
        elif role == "tool":
            out += "<|im_start|>result " + m["tool_call_id"] + "\\n" + m["content"] + "<|im_end|>"
        elif role == "assistant":
            if m.get("reasoning_content"):
                out += m["reasoning_content"]
            out += "</think>" + m["content"]
            for c in m.get("tool_calls") or []:
                out += "<call " + c["function"]["name"] + ">" + c["function"]["arguments"] + "</call>"
            out += "<|im_end|>"
        following = messages[i + 1]["role"] if i + 1 < len(messages) else None
        if role in ("user", "tool") and following in (None, "assistant"):
            out += ASSISTANT + ("<think>\\n" if thinking_mode == "thinking" else "")
    return out
'''


def test_pack_encoder_code_runs_only_when_trusted_and_gives_token_exact_rows(tmp_path, smol_tok, rng_seed):
    import importlib.util

    from fidelity.panels.encoding import encode_panel

    (tmp_path / "pack" / "encoding").mkdir(parents=True)
    (tmp_path / "pack" / "encoding" / "encoding_toy.py").write_text(TOY_ENCODER)
    obj = agentic_row(rng_seed, rid="dsml-1")
    write_panel(tmp_path / "chat", [parse_row(obj, "test")], name="chat")
    with pytest.raises(PanelError, match=r"encoding: rendering through encoding_toy\.py runs the pack's own Python "
                                         r"code; pass --trust-pack-code"):
        encode_panel(tmp_path / "chat", tmp_path / "pack", tmp_path / "out", tokenizer=smol_tok)
    assert not (tmp_path / "out").exists()
    panel = encode_panel(tmp_path / "chat", tmp_path / "pack", tmp_path / "out", trust_pack_code=True,
                         tokenizer=smol_tok)
    row = load_panel(tmp_path / "out").rows[0]
    assert row.tokens is not None and row.to_json() == panel.rows[0].to_json()
    # independently: the module's own text for the conversation in its input format, tokenized by the tokenizer
    spec = importlib.util.spec_from_file_location("toy_encoder", tmp_path / "pack" / "encoding" / "encoding_toy.py")
    toy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(toy)
    m = obj["messages"]
    wire = toy.encode_messages(
        [
            {**m[0], "tools": TOOLS},
            {"role": "user", "content": "".join(p["text"] for p in m[1]["content"])},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": m[2]["reasoning_content"],
                "tool_calls": m[2]["tool_calls"],
            },
            m[3],
            m[4],
            m[5],
        ],
        thinking_mode="thinking",
    )
    assert row.tokens == smol_tok(wire, add_special_tokens=False)["input_ids"]
    calls = "".join(f"<call {c['function']['name']}>{c['function']['arguments']}</call>" for c in m[2]["tool_calls"])
    want = f"{m[2]['reasoning_content']}</think>{calls}<|im_end|></think>{m[5]['content']}<|im_end|>"
    assert scored_text(smol_tok, row.tokens, row.scored) == want
    no_r = encode_panel(tmp_path / "chat", tmp_path / "pack", tmp_path / "out2", trust_pack_code=True,
                        tokenizer=smol_tok, score_reasoning=False).rows[0]
    assert scored_text(smol_tok, no_r.tokens, no_r.scored) == want.replace(m[2]["reasoning_content"], "", 1)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())["encoded"]
    assert manifest["encoder"] == "encoding/encoding_toy.py" and manifest["from_panel"]["name"] == "chat"


def test_chat_template_kwargs_shape_the_prompt_not_the_scored_answer(smol_tok):
    """Qwen3-style thinking off: the generation prompt holds an empty think block, so it is prompt, not answer."""
    tok = copy.deepcopy(smol_tok)
    tok.chat_template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
        "{%- if m.role == 'assistant' and (enable_thinking is defined and not enable_thinking) %}"
        "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{{- m.content + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
        "{%- endif %}")
    obj = {"id": "k1", "domain": "chat", "messages": [{"role": "user", "content": "Name a color."},
                                                      {"role": "assistant", "content": "Blue."}]}
    off = parse_row({**obj, "chat_template_kwargs": {"enable_thinking": False}}, "test")
    assert off.to_json()["chat_template_kwargs"] == {"enable_thinking": False}
    tokens, scored = render_chat(off, tok)
    assert tok.decode(tokens).count("<think>") == 1
    assert scored_text(tok, tokens, scored) == "Blue.<|im_end|>"
    tokens, scored = render_chat(parse_row(obj, "test"), tok)
    assert "<think>" not in tok.decode(tokens) and scored_text(tok, tokens, scored) == "Blue.<|im_end|>"


def test_engine_answers_with_tool_calls_and_reasoning_become_rendered_rows(tmp_path, tool_tok, monkeypatch, rng_seed):
    """What `panel build --engine` sends (tools, sampling settings, the thinking switch, earlier tool calls as JSON
    text) and how an answer with reasoning and tool calls becomes a row the tool template renders and scores."""
    from fidelity.engine import client as C
    from fidelity.panels.build import EngineSettings, build_panel_from_engine

    obj = agentic_row(rng_seed)
    m = obj["messages"]
    earlier_call = {**m[2], "tool_calls": [{**m[2]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": json.loads(m[2]["tool_calls"][0]["function"]["arguments"])}}]}
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "first", "domain": "agentic", "tools": TOOLS, "messages": m[:2]}) + "\n" +
                       json.dumps({"id": "after-tool", "domain": "agentic", "tools": TOOLS,
                                   "messages": m[:2] + [earlier_call, m[3]]}) + "\n")
    sent = []
    replies = {"first": {"model": "native", "choices": [{"finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "reasoning_content": m[2]["reasoning_content"],
        "tool_calls": m[2]["tool_calls"]}}]},
        "after-tool": {"model": "native", "choices": [{"finish_reason": "stop", "message": {
            "role": "assistant", "content": m[5]["content"], "reasoning": "The tool answered."}}]}}

    async def fake_chat(self, messages, **kw):
        sent.append((messages, kw))
        return C.parse_chat(replies[kw["tag"].removeprefix("panel:")])

    monkeypatch.setattr(C.EngineClient, "chat", fake_chat)
    settings = EngineSettings(max_new_tokens=77, temperature=0.6, seed=5, thinking="on", concurrency=1)
    panel = build_panel_from_engine(prompts, "http://127.0.0.1:9", "native", tmp_path / "p", settings, progress=False)
    for messages, kw in sent:
        assert kw["tools"] == TOOLS and kw["max_tokens"] == 77 and kw["temperature"] == 0.6 and kw["seed"] == 5
        assert kw["extra"] == {"chat_template_kwargs": {"enable_thinking": True, "thinking": True}}
    after = next(msgs for msgs, kw in sent if kw["tag"] == "panel:after-tool")
    assert after[2]["tool_calls"][0]["function"]["arguments"] == m[2]["tool_calls"][0]["function"]["arguments"]
    first, second = panel.rows
    assert first.messages[-1] == {"role": "assistant", "content": "", "reasoning_content": m[2]["reasoning_content"],
                                  "tool_calls": m[2]["tool_calls"]}
    assert second.messages[-1] == {"role": "assistant", "content": m[5]["content"],
                                   "reasoning_content": "The tool answered."}
    _, with_r, _, _ = expected_by_hand(obj)
    first_turn = with_r[:with_r.index("<|im_end|>") + len("<|im_end|>")]
    assert scored_text(tool_tok, *render_chat(first, tool_tok)) == first_turn
    assert json.loads((tmp_path / "p" / "manifest.json").read_text())["answers"]["finish_reasons"] == \
        {"tool_calls": 1, "stop": 1}
