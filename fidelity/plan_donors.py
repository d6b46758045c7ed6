"""Donor packs and stage budgets for `fidelity plan` (seed 003's allocation: per expert, a choice among existing
packs' tensors of the same model, within per-stage byte budgets).

A donor is a pack of the reference's model (any format fidelity reads: EXL3 at other K, FP8, MXFP4, ...). For each
routed-expert matrix of the reference it offers its own stored tensor: cost = the bytes the donor stores for it
(`Pack.storage(name).nbytes`: trellis + suh + svh + marker for EXL3, data + scales for FP8 / MXFP4), error =
||W_donor - W||_F^2 / ||W||_F^2 decoded from the donor against the reference ("measured": every donor tensor is
decoded once, by the command: fidelity/commands/plan.py `read_donors`). Donor tensors are matched to the reference's
by (layer, expert, matrix role), so a donor in another naming (HF / official) or layout serves.

A stage is a contiguous layer range with its own budget on its routed-expert bytes (in bytes, e.g. 24.37GiB, or in
bpw over its routed-expert params); the stages must cover every MoE layer once.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

UNITS = {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
         "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}
STAGE = re.compile(r"^\s*(\d+)(?:-(\d+))?\s*:\s*([0-9.eE+-]+)\s*([A-Za-z]+)\s*$")


# -- stages -----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stage:
    first: int
    last: int                       # inclusive
    bpw: float | None = None        # budget in bits per routed-expert weight of the stage ...
    nbytes: float | None = None     # ... or in bytes of its routed-expert tensors
    text: str = ""                  # as the user wrote it

    @property
    def layers(self) -> str:
        return f"{self.first}-{self.last}" if self.last != self.first else str(self.first)

    def holds(self, layer: int) -> bool:
        return self.first <= layer <= self.last

    def allowed_bytes(self, params: float) -> float:
        return self.nbytes if self.nbytes is not None else self.bpw * params / 8


def parse_stage_budgets(specs: list[str]) -> tuple[Stage, ...]:
    """["0-9:40GB,10-39:120GB"] or ["0-1:2.5bpw", "2:1000000B"] -> Stages, in layer order."""
    stages = []
    for spec in specs:
        for part in spec.split(","):
            m = STAGE.match(part)
            unit = m.group(4).upper() if m else ""
            if not m or (unit not in UNITS and unit != "BPW"):
                raise ConfigError(f"--stage-budgets {part.strip()!r}: expected LAYERS:BUDGET, e.g. 0-19:24.37GiB or "
                                  f"0-19:2.8bpw (units: bpw, {', '.join(u.replace('I', 'i') for u in UNITS)})")
            first, last = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
            try:
                value = float(m.group(3))
            except ValueError:
                raise ConfigError(f"--stage-budgets {part.strip()!r}: {m.group(3)!r} is not a number") from None
            if last < first:
                raise ConfigError(f"--stage-budgets {part.strip()!r}: layer range {first}-{last} runs backwards")
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"--stage-budgets {part.strip()!r}: the budget must be a positive number")
            stages.append(Stage(first, last, value if unit == "BPW" else None,
                                None if unit == "BPW" else value * UNITS[unit], part.strip()))
    stages.sort(key=lambda s: (s.first, s.last))
    for a, b in zip(stages, stages[1:]):
        if b.first <= a.last:
            raise ConfigError(f"--stage-budgets: stages {a.text!r} and {b.text!r} overlap (layers "
                              f"{b.first}-{min(a.last, b.last)})")
    return tuple(stages)


def check_stages(stages: tuple[Stage, ...], moe_layers: list[int], per_decoded_token: bool) -> None:
    """Every MoE layer in exactly one stage (overlaps are refused when parsing), no stage without one, byte budgets
    only in memory."""
    uncovered = [L for L in moe_layers if not any(s.holds(L) for s in stages)]
    if uncovered:
        raise ConfigError(f"--stage-budgets: MoE layer(s) {uncovered} are in no stage (stages: "
                          f"{', '.join(s.layers for s in stages)}; MoE layers: {moe_layers})")
    for s in stages:
        if not any(s.holds(L) for L in moe_layers):
            raise ConfigError(f"--stage-budgets: stage {s.text!r} holds no MoE layer (MoE layers: {moe_layers})")
        if per_decoded_token and s.nbytes is not None:
            raise ConfigError(f"--stage-budgets: stage {s.text!r} is in bytes, which count memory; a budget per "
                              f"decoded token is given in bpw (e.g. {s.layers}:2.8bpw)")


# -- donors -----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DonorTensor:
    donor: str          # the donor's label
    name: str           # the donor's own name of the tensor
    nbytes: int         # bytes the donor stores for it (side tensors included)
    format: str         # Storage.format, e.g. "exl3", "mxfp4", "fp8_e4m3"
    K: int | None       # the EXL3 K it is stored at (an integer K), else None
    error: float        # ||W_donor - W||^2 / ||W||^2 against the reference
    files: tuple[str, ...] = ()


@dataclass
class Donor:
    label: str
    path: str
    tensors: dict[tuple[int, int, str], DonorTensor]     # (layer, expert, role) -> its tensor


def exl3_k(storage) -> int | None:
    """The integer EXL3 K a tensor is stored at, from its Storage (`exl3 K=4 mul1`), else None."""
    if storage.format != "exl3":
        return None
    m = re.match(r"exl3 K=(\d+(?:\.\d+)?) ", storage.dtype)
    if not m or float(m.group(1)) != int(float(m.group(1))):
        return None
    return int(float(m.group(1)))


def parse_donor(spec: str) -> tuple[str, str]:
    """LABEL=PATH or PATH (label: the folder's name)."""
    label, sep, path = spec.partition("=")
    if not sep:
        label, path = Path(spec).name, spec
    if not label or not path:
        raise ConfigError(f"--donors {spec!r}: expected PATH or LABEL=PATH")
    return label, path
