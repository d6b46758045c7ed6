"""fidelity: measure how far a quantized LLM pack is from its reference, and whether an engine computes the model right."""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import ConfigError, FidelityError, PackError  # noqa: E402
from .packs import open_pack  # noqa: E402

__all__ = ["open_pack", "FidelityError", "PackError", "ConfigError", "__version__"]
