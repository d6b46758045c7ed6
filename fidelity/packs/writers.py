"""Pack writers for tests and the demo: a native safetensors pack from any pack, and a GGUF quantized from a native
pack in llama.cpp's layout (names, Q/K row permutation, tokenizer metadata) so that llama.cpp can load it."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..errors import PackError
from .base import Pack, tensor_role

DEFAULT_SHARD_BYTES = 2 * 1024**3
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# -- native safetensors -------------------------------------------------------------------------------------------
def write_native(pack: Pack, out_dir: str | Path, dtype: torch.dtype = torch.float32,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write every tensor of `pack` as plain `dtype` safetensors (sharded with an index when large), its config.json
    and its tokenizer files (chat template included). Returns the folder."""
    from safetensors.torch import save_file

    if dtype not in _DTYPE_NAMES:
        raise PackError(f"write_native writes float32, bfloat16 or float16, not {dtype}", file=out_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in pack.names():
        t = pack.tensor(name).to(dtype)
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            for name, t in shard.items():
                weight_map[name] = fname
                total += t.numel() * t.element_size()
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config = {k: v for k, v in pack.config.items() if k != "quantization_config"}
    config["torch_dtype"] = _DTYPE_NAMES[dtype]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(pack, out)
    return out


def _write_tokenizer(pack: Pack, out: Path):
    from .tokenizer import load_tokenizer

    if pack.tokenizer_source() is None:
        return
    tok = load_tokenizer(pack)
    tok.save_pretrained(str(out))
