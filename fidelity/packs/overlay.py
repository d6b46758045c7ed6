"""Overlay packs: a base pack plus a folder of tensors that replace the base's ("each build's own tensors loaded,
everything else official").

A folder holding `fidelity_overlay.json` ({"base": "<path>"}, relative to that folder or absolute) is opened by
`open_pack` as an overlay of its own safetensors over that base. The overlay folder decodes with its own
config.json / quantization config if it has one, else with the base's quantization config (so a folder of FP8 or
compressed-tensors tensors overlays an FP8 or compressed-tensors base). Every overlay tensor must replace a base
tensor of the same logical shape; `origin(name)` / `sources()` say which tensors came from where.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import PackError
from .base import LogicalTensor, Pack
from .folder import SafetensorsPack, read_json
from .opening import open_pack, register_folder_marker
from ..pack_settings import PackSettings

MARKER = "fidelity_overlay.json"


class OverlayFolder(SafetensorsPack):
    """The overlay's own safetensors, falling back to the base's quantization config when it has none."""

    def __init__(self, path: str | Path, fallback_quant_config: dict | None, settings: PackSettings = PackSettings()):
        self._fallback_quant_config = fallback_quant_config
        super().__init__(path, settings)

    def _quant_config(self) -> dict | None:
        return super()._quant_config() or self._fallback_quant_config


class OverlayPack(Pack):
    format = "overlay"

    def __init__(self, base: Pack | str | Path, overlay: Pack | str | Path, settings: PackSettings = PackSettings()):
        base = base if isinstance(base, Pack) else open_pack(base, settings)
        if not isinstance(overlay, Pack):
            overlay = OverlayFolder(overlay, getattr(base, "quant_config", None), settings)
        super().__init__(overlay.path, settings)
        self.base, self.overlay = base, overlay
        self.config = base.config
        self._origin: dict[str, str] = {}
        for name in base.names():
            self._entries[name] = _forward(base, name)
            self._origin[name] = "base"
        for name in overlay.names():
            if name not in self._entries:
                raise PackError(f"overlay tensor has no counterpart in the base pack {base.path}",
                                file=_file_of(overlay, name), tensor=name)
            new, old = overlay.storage(name), base.storage(name)
            if tuple(new.shape) != tuple(old.shape):
                raise PackError(
                    f"overlay shape {list(new.shape)} in {_file_of(overlay, name)} differs from the base's "
                    f"{list(old.shape)} in {_file_of(base, name)}",
                    file=_file_of(overlay, name),
                    tensor=name,
                )
            self._entries[name] = _forward(overlay, name)
            self._origin[name] = "overlay"

    @classmethod
    def from_marker(cls, marker: str | Path, settings: PackSettings = PackSettings()) -> "OverlayPack":
        marker = Path(marker)
        spec = read_json(marker)
        if not isinstance(spec, dict) or not isinstance(spec.get("base"), str):
            raise PackError('overlay marker must be a JSON object {"base": "<path of the base pack>"}', file=marker)
        folder = marker.parent
        base = Path(spec["base"]).expanduser()
        base = (base if base.is_absolute() else folder / base).resolve()
        if base == folder.resolve():
            raise PackError("overlay marker names its own folder as the base", file=marker)
        if not base.exists():
            raise PackError(f"overlay base {base} does not exist", file=marker)
        return cls(open_pack(base, settings), folder, settings)

    # -- the listing ------------------------------------------------------------------------------------------------
    def origin(self, name: str) -> str:
        """'overlay' or 'base'."""
        self._entry(name)
        return self._origin[name]

    def sources(self) -> dict[str, list[str]]:
        """{'overlay': names replaced by the overlay, 'base': names taken from the base}."""
        out: dict[str, list[str]] = {"overlay": [], "base": []}
        for name, where in self._origin.items():
            out[where].append(name)
        return out

    def stage(self, names: list[str], pin: bool = False) -> list:
        mine = {"overlay": [], "base": []}
        for name in names:
            if name in self._origin:
                mine[self._origin[name]].append(name)
        return [("overlay", self.overlay.stage(mine["overlay"], pin)), ("base", self.base.stage(mine["base"], pin))]

    def unstage(self, keys: list) -> None:
        for where, inner in keys:
            (self.overlay if where == "overlay" else self.base).unstage(inner)

    def tokenizer_source(self) -> Path | None:
        return self.base.tokenizer_source()

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(self.base.fingerprint().encode())
        h.update(self.overlay.fingerprint().encode())
        h.update(json.dumps(sorted(self.sources()["overlay"])).encode())
        return h.hexdigest()[:32]

    def __repr__(self) -> str:
        n = len(self.sources()["overlay"])
        return f"<OverlayPack {n} tensors from {self.overlay.path} over {self.base!r}>"


def _forward(pack: Pack, name: str) -> LogicalTensor:
    return LogicalTensor(pack.storage(name), lambda device: pack.tensor(name, device=device), on_device=True)


def _file_of(pack: Pack, name: str) -> str:
    files = pack.storage(name).files
    return files[0] if files else str(pack.path)


register_folder_marker("fidelity_overlay.json", OverlayPack.from_marker)
