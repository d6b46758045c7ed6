"""`open_pack(path, settings)`: sniff a path's format and open it. Reads headers only; tensors are decoded on request.

A folder format recognised by a marker file (the overlay's `fidelity_overlay.json`) registers its opener here, so it can
open its own base pack through `open_pack` without importing the package that imports it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..errors import PackError
from .base import Pack
from .folder import SafetensorsPack
from ..pack_settings import PackSettings

# marker file name -> opener(marker path, settings) -> Pack; checked before a folder is read as safetensors or GGUF
FOLDER_MARKERS: dict[str, Callable[[Path, PackSettings], Pack]] = {}


def register_folder_marker(filename: str, opener: Callable[[Path, PackSettings], Pack]) -> None:
    FOLDER_MARKERS[filename] = opener


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def open_pack(path: str | Path, settings: PackSettings = PackSettings()) -> Pack:
    """Open a pack, sniffing its format. Reads headers only; tensors are decoded on request, as `settings` say."""
    p = Path(path).expanduser()
    if not p.exists():
        raise PackError("pack path does not exist", file=p)
    if p.is_file():
        if _is_gguf(p):
            from .gguf import GGUFPack  # noqa: PLC0415 (gguf-py loads only for a GGUF)
            return GGUFPack(p, settings)
        if p.suffix == ".safetensors":
            return SafetensorsPack(p, settings)
        raise PackError("not a pack: expected a .gguf file, a .safetensors file or a folder", file=p)
    for filename, opener in FOLDER_MARKERS.items():
        if (p / filename).exists():
            return opener(p / filename, settings)
    ggufs = sorted(p.glob("*.gguf"))
    if ggufs and not list(p.glob("*.safetensors")) and not (p / "model.safetensors.index.json").exists():
        if len(ggufs) > 1:
            raise PackError(f"folder holds {len(ggufs)} .gguf files; name one", file=p)
        from .gguf import GGUFPack  # noqa: PLC0415 (gguf-py loads only for a GGUF)
        return GGUFPack(ggufs[0], settings)
    return SafetensorsPack(p, settings)
