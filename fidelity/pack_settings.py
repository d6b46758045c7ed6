"""`PackSettings`: how an opened pack hashes its files and decodes its tensors, passed to `open_pack` (the command
line's come from the environment: `Environment.pack_settings()`). The defaults are an empty environment's."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackSettings:
    """`hash_cache`: the folder `Pack.fingerprint()` caches file digests in (None: `content_hash.default_cache_dir()`,
    ~/.cache/fidelity/content-hash). `exl3_sums`: the EXL3 Hadamard sums, "float64", "int64" or "int8" (None: by
    device, `packs.exl3.codec.default_sums`); every choice gives the same bits."""

    hash_cache: Path | None = None
    exl3_sums: str | None = None
