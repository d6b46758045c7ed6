"""Chat-request options that reach the engine's chat template, defined once for every command that sends chats
(`suite run`, `panel build`).

Thinking: templates read different variables. Qwen3 and the vLLM / SGLang convention read `enable_thinking`; DeepSeek
V3.1+ Jinja templates read `thinking` (an undefined `thinking` means off there, so a request carrying only
`enable_thinking: true` runs with thinking off); vLLM's DeepSeek V4 / V4.1 encoder wrappers take either (and default to
thinking on when neither is given). Both keys are always sent together, with the same value.

Reasoning: OpenAI-compatible servers return a reply's reasoning as `message.reasoning_content` (vLLM, SGLang, DeepSeek)
or `message.reasoning` (newer vLLM, llama.cpp), and may count its tokens in
`usage.completion_tokens_details.reasoning_tokens`.
"""
from __future__ import annotations

THINKING_KEYS = ("enable_thinking", "thinking")


def thinking_template_kwargs(thinking: bool | None) -> dict | None:
    """`chat_template_kwargs` for a thinking switch: None leaves the template's default (nothing sent)."""
    if thinking is None:
        return None
    if not isinstance(thinking, bool):
        raise TypeError(f"thinking is True, False or None, not {thinking!r}")
    return {key: thinking for key in THINKING_KEYS}


def reply_reasoning(raw_reply: dict) -> str | None:
    """The reasoning text of a chat reply's first choice, or None when the reply carries none."""
    choices = raw_reply.get("choices") if isinstance(raw_reply, dict) else None
    msg = (choices[0].get("message") if choices and isinstance(choices[0], dict) else None) or {}
    for key in ("reasoning_content", "reasoning"):
        text = msg.get(key)
        if isinstance(text, str) and text:
            return text
    return None


def usage_reasoning_tokens(usage: dict) -> int | None:
    """`usage.completion_tokens_details.reasoning_tokens` where the engine reports it."""
    details = (usage or {}).get("completion_tokens_details")
    n = details.get("reasoning_tokens") if isinstance(details, dict) else None
    return int(n) if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None
