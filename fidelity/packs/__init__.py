"""Packs: open any supported checkpoint and ask it for exact fp32 tensors in Hugging Face naming.

Each format module registers a claimer (safetensors formats) or a Pack class (GGUF); `open_pack` sniffs the format.
"""
from __future__ import annotations

from .base import BitsReport, LogicalTensor, Pack, Storage, tensor_role
from .folder import KNOWN_QUANT_METHODS, SafetensorsPack
from . import compressed, fp4, fp8, native  # noqa: F401  (claimers; order: registry.CLAIMERS)
from .exl3 import layouts as _exl3_layouts  # noqa: F401  (the EXL3 claimer)
from . import overlay  # noqa: F401  (registers its folder marker, fidelity_overlay.json)
from .opening import open_pack

__all__ = ["open_pack", "Pack", "Storage", "LogicalTensor", "BitsReport", "tensor_role", "SafetensorsPack",
           "KNOWN_QUANT_METHODS"]
