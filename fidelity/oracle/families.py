"""Which oracle family computes an architecture (config.json "architectures"[0]): the families register themselves
with `@ARCHITECTURES.register(...)` (fidelity/registry.py)."""
from __future__ import annotations

from ..errors import ConfigError
from ..registry import ARCHITECTURES
from .common import Family


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def family_for(config: dict) -> Family:
    archs = config.get("architectures") or []
    if not archs:
        raise ConfigError(f"config.json names no architecture; supported: {supported_architectures()}")
    arch = archs[0]
    family = ARCHITECTURES.get(arch)
    if family is None:
        raise ConfigError(f"architecture {arch!r} is not supported by the oracle; supported: {supported_architectures()}")
    return family(config)
