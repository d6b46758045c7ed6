"""What the llama.cpp engine tests share: llama-cpp-python's OpenAI server started on loopback."""
from __future__ import annotations

import sys
from pathlib import Path

from fidelity.engine.spawn import Spawned, free_port


def llama_server(model_path: Path, log_dir: Path, flags: list[str]) -> Spawned:
    """llama-cpp-python's server for the GGUF `model_path` on a free loopback port, with the server's own `flags`
    (context, threads, ...); its log is `log_dir`/llama-PORT.log."""
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model_path), "--host", "127.0.0.1", "--port",
           str(port), *flags]
    return Spawned(cmd, port, timeout_s=180, log=str(log_dir / f"llama-{port}.log"))
