"""compressed-tensors packs (work in progress)."""
from __future__ import annotations

from .folder import KNOWN_QUANT_METHODS  # noqa: F401
