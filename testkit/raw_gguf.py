"""Raw GGUF files for tests: metadata and tensors exactly as given, no pack behind them."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def write_gguf_tensors(path: str | Path, arch: str, hparams: dict, tensors: dict[str, tuple[np.ndarray, str]],
                       extra: dict[str, object] | None = None) -> Path:
    """A raw GGUF for tests: `hparams` become `{arch}.{key}` metadata (ints -> uint32, floats -> float32),
    `tensors` maps llama.cpp names to (stored array, GGML type name): uint8 bytes [..., bytes per row] for quantized
    types, the values for F32/F16. `extra` adds string/int metadata under its full key."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in hparams.items():
        if isinstance(value, bool):
            writer.add_bool(f"{arch}.{key}", value)
        elif isinstance(value, int):
            writer.add_uint32(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_string(f"{arch}.{key}", str(value))
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, int(value))
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=None if qtype in ("F32", "F16") else gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
