"""Which oracle family computes an architecture (config.json "architectures"[0]): the families register themselves
with `@ARCHITECTURES.register(...)` (fidelity/registry.py)."""
from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from ..registry import ARCHITECTURES
from .common import Family


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def family_for(config: dict, config_file: str | Path | None = None) -> Family:
    """The family of `config`'s architecture; `config_file`: the config.json it was read from (or looked for), so
    that a missing one is named as missing."""
    archs = config.get("architectures") or []
    if not archs:
        if config_file is not None and not Path(config_file).exists():
            raise ConfigError(f"the folder {Path(config_file).parent} has no config.json: the oracle reads the model's "
                              f"architecture and settings from it")
        raise ConfigError(f"config.json names no architecture; supported: {supported_architectures()}")
    arch = archs[0]
    family = ARCHITECTURES.get(arch)
    if family is None:
        raise ConfigError(
            f"architecture {arch!r} is not supported by the oracle; supported: {supported_architectures()}"
        )
    return family(config)


def family_for_pack(pack) -> Family:
    """The family of the pack's architecture, bound to the pack, its stored names resolved: the oracle's family, and
    what `missing_tensors` asks without building a layer."""
    family = family_for(pack.config, getattr(pack, "config_file", None))
    family.bind_pack(pack)
    family.resolve_names(pack.names())
    return family


def missing_tensors(family: Family, names) -> list[str]:
    """The tensors `family` loads (`required_names`: embeddings, final norm, head, every layer's) that are not in
    `names`, in the family's order."""
    have = set(names)
    return [n for n in dict.fromkeys(family.required_names()) if n not in have]
