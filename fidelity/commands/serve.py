"""Serve a pack through the fp32 oracle as an OpenAI-compatible endpoint (completions with echo/logprobs, chat,
tokenize)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser):
    from .compare import add_numerics_argument
    p.add_argument("pack", help="pack folder, .safetensors or .gguf file")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", help="the model id the server reports and accepts (default: the pack's file name)")
    p.add_argument("--device", default="cpu")
    add_numerics_argument(p)


def run(args) -> int:
    from ..engine.serve import serve
    from ..packs import open_pack

    pack = open_pack(args.pack, args.environment.pack_settings())

    def ready(httpd, engine):
        print(
            f"fidelity serve: {engine.model_name} ({pack.format}) on http://{args.host}:{httpd.server_address[1]}",
            flush=True,
        )

    serve(pack, host=args.host, port=args.port, model_name=args.model_name, device=args.device, ready=ready,
          numerics=args.numerics, activation_budget=args.environment.device_activations_bytes)
    return 0
