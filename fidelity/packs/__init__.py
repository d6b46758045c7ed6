"""Packs: open any supported checkpoint and ask it for exact fp32 tensors in Hugging Face naming.

Each format module registers a claimer (safetensors formats) or a Pack class (GGUF); `open_pack` sniffs the format.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import PackError
from .base import BitsReport, LogicalTensor, Pack, Storage, tensor_role
from .folder import KNOWN_QUANT_METHODS, SafetensorsPack, register_claimer
from . import compressed, fp4, fp8  # noqa: F401  (safetensors quantized formats: register their claimers)
from . import exl3  # noqa: F401  (EXL3 trellis packs, all five layouts; registers itself first)
from . import native  # noqa: F401  (registers the fallback claimer; keep it imported last among claimers)

__all__ = ["open_pack", "Pack", "Storage", "LogicalTensor", "BitsReport", "tensor_role", "SafetensorsPack",
           "register_claimer", "KNOWN_QUANT_METHODS"]


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def open_pack(path: str | Path) -> Pack:
    """Open a pack, sniffing its format. Reads headers only; tensors are decoded on request."""
    p = Path(path).expanduser()
    if not p.exists():
        raise PackError("pack path does not exist", file=p)
    if p.is_file():
        if _is_gguf(p):
            from .gguf import GGUFPack
            return GGUFPack(p)
        if p.suffix == ".safetensors":
            return SafetensorsPack(p)
        raise PackError("not a pack: expected a .gguf file, a .safetensors file or a folder", file=p)
    overlay_marker = p / "fidelity_overlay.json"
    if overlay_marker.exists():
        from .overlay import OverlayPack
        return OverlayPack.from_marker(overlay_marker)
    ggufs = sorted(p.glob("*.gguf"))
    if ggufs and not list(p.glob("*.safetensors")) and not (p / "model.safetensors.index.json").exists():
        if len(ggufs) > 1:
            raise PackError(f"folder holds {len(ggufs)} .gguf files; name one", file=p)
        from .gguf import GGUFPack
        return GGUFPack(ggufs[0])
    return SafetensorsPack(p)
