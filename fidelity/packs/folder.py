"""Safetensors packs: a single file or a folder of shards (+ index), decoded by format modules that each claim
the stored tensors they understand and turn them into logical fp32 tensors."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from ..errors import PackError
from ..registry import CLAIMERS
from .base import LogicalTensor, Pack
from .safetensors_io import RawTensorInfo, SafetensorsFile
from ..pack_settings import PackSettings
from .staging import StagedBytes, host_copy


class RawIndex:
    """Every stored tensor of a pack: name -> file. Headers are read on first use of a file; a file that the index
    names but that is absent is an error only when one of its tensors is actually requested."""

    def __init__(self, root: Path, weight_map: dict[str, str]):
        self.root = root
        self.weight_map = weight_map  # raw name -> file name relative to root
        self._files: dict[str, SafetensorsFile] = {}
        self.staged = StagedBytes()   # stored tensors a prefetcher read ahead (raw name -> host copy)

    def names(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def file_path(self, name: str) -> Path:
        try:
            return self.root / self.weight_map[name]
        except KeyError:
            raise PackError("tensor not present in the pack", file=self.root, tensor=name) from None

    def available(self, name: str) -> bool:
        return self.file_path(name).exists()

    def _file(self, name: str) -> SafetensorsFile:
        rel = self.weight_map.get(name)
        if rel is None:
            raise PackError("tensor not present in the pack", file=self.root, tensor=name)
        f = self._files.get(rel)
        if f is None:
            path = self.root / rel
            if not path.exists():
                raise PackError("the index names a shard that is absent", file=path, tensor=name)
            f = self._files[rel] = SafetensorsFile(path)
        if name not in f.tensors:
            raise PackError("the index names this tensor but its shard does not hold it", file=f.path, tensor=name)
        return f

    def info(self, name: str) -> RawTensorInfo:
        return self._file(name).info(name)

    def get(self, name: str) -> torch.Tensor:
        """Stored tensor in its stored dtype (memory-mapped view, or the host copy `stage` read ahead)."""
        held = self.staged.get((str(self.root), name))
        return self._file(name).get(name) if held is None else held

    def stage(self, names, pin: bool) -> list:
        """Read stored tensors into host memory now (pinned when `pin`); `get` returns these copies until dropped."""
        keys = []
        for name in names:
            if name not in self.weight_map or not self.available(name):
                continue  # an absent part is an error when the tensor is decoded, not when it is read ahead
            key = (str(self.root), name)
            self.staged.hold(key, lambda name=name: host_copy(self._file(name).get(name), pin))
            keys.append(key)
        return keys

    def files_of(self, *names: str) -> tuple[str, ...]:
        return tuple(sorted({str(self.file_path(n)) for n in names}))


# A claimer looks at the unclaimed raw names of a pack, takes those it understands (removing them from `pool`)
# and returns logical tensors. Claimers run in `fidelity.registry.CLAIMERS` order; `native` runs last and takes whatever
# is left.
Claimer = Callable[["SafetensorsPack", set], dict[str, LogicalTensor]]
# quant_method values we know how to read (the pack's `format` is this, or "native")
KNOWN_QUANT_METHODS: set[str] = set()


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PackError(f"invalid JSON: {e}", file=path) from None


class SafetensorsPack(Pack):
    def __init__(self, path: str | Path, settings: PackSettings = PackSettings()):
        super().__init__(path, settings)
        p = self.path
        if p.is_file():
            root, weight_map = p.parent, {n: p.name for n in SafetensorsFile(p).names()}
        else:
            root = p
            index = p / "model.safetensors.index.json"
            if index.exists():
                weight_map = dict(read_json(index).get("weight_map", {}))
                # shards beside the index that it does not mention are still part of the pack
                listed = set(weight_map.values())
                for f in sorted(p.glob("*.safetensors")):
                    if f.name not in listed:
                        for n in SafetensorsFile(f).names():
                            weight_map.setdefault(n, f.name)
            else:
                files = sorted(p.glob("*.safetensors"))
                if not files:
                    raise PackError("no .safetensors files and no index in this folder", file=p)
                weight_map = {}
                for f in files:
                    for n in SafetensorsFile(f).names():
                        if n in weight_map:
                            raise PackError(f"tensor stored twice (also in {weight_map[n]})", file=f, tensor=n)
                        weight_map[n] = f.name
        self.root = root
        cfg_path = root / "config.json"
        self.config_file = cfg_path
        self.config = read_json(cfg_path) if cfg_path.exists() else {}
        self.quant_config = self._quant_config()
        claimers = list(
            CLAIMERS.values()
        )  # imports every format module: each adds its quant_method to KNOWN_QUANT_METHODS
        method = (self.quant_config or {}).get("quant_method")
        if method is not None and method not in KNOWN_QUANT_METHODS:
            raise PackError(f"unknown quant_method {method!r}; supported: {sorted(KNOWN_QUANT_METHODS)}", file=cfg_path)
        self.format = method or "native"
        self.raw = RawIndex(root, weight_map)
        pool = set(self.raw.names())
        for claim in claimers:
            for name, entry in claim(self, pool).items():
                if name in self._entries:
                    raise PackError("two stored tensors decode to the same logical name", file=root, tensor=name)
                self._entries[name] = entry
        if pool:
            raise PackError(
                f"{len(pool)} stored tensors no format module understands, e.g. {sorted(pool)[:3]}", file=root
            )

    def _quant_config(self) -> dict | None:
        qc = self.config.get("quantization_config")
        if qc is None:
            for fname in ("quantization_config.json", "hf_quant_config.json"):
                f = self.root / fname
                if f.exists():
                    qc = read_json(f)
                    if "quantization" in qc and "quant_method" not in qc:  # ModelOpt's hf_quant_config.json
                        qc = {"quant_method": "modelopt", **qc["quantization"]}
                    break
        return qc

    def stage(self, names: list[str], pin: bool = False) -> list:
        raw: list[str] = []
        for name in names:
            if name in self._entries:
                raw.extend(self._entries[name].storage.raw)
        return self.raw.stage(raw, pin)

    def unstage(self, keys: list) -> None:
        self.raw.staged.release(keys)

    def tokenizer_source(self) -> Path | None:
        return self.root
