"""fidelity: measure how far a quantized LLM pack is from its reference, and whether an engine computes the model
right."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

from .errors import ConfigError, FidelityError, PackError  # noqa: E402

_LAZY = {"open_pack", "packs"}
__all__ = ["open_pack", "FidelityError", "PackError", "ConfigError", "__version__"]


def __getattr__(name: str):
    # fidelity.packs (and so open_pack) is imported on first use: it imports torch (seconds), which the command line's
    # --help and argument parsing never need
    if name in _LAZY:
        packs = importlib.import_module(f"{__name__}.packs")
        globals()["open_pack"] = packs.open_pack
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY)
