"""Talking to serving engines: the OpenAI-compatible client, the request journal, the gates and `serve`."""
from .client import (
    ChatCompletion,
    ClientConfig,
    Completion,
    EngineClient,
    EngineError,
    EngineHTTPError,
    EngineProtocolError,
    TokenLogprob,
    ToolCall,
)
from .journal import Journal, request_key

__all__ = [
    "ChatCompletion",
    "ClientConfig",
    "Completion",
    "EngineClient",
    "EngineError",
    "EngineHTTPError",
    "EngineProtocolError",
    "Journal",
    "TokenLogprob",
    "ToolCall",
    "request_key",
]
