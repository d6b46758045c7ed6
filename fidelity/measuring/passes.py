"""compare's kept passes: the reference's logits kept across the passes of one run (`reference_logits_cache`), and
every finished pass kept in a folder so a rerun recomputes only the rest (`Resume`); the per-position records files
(Parquet) both write."""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import fields
from pathlib import Path
from typing import Callable

import torch
import pyarrow as pa
import pyarrow.parquet as pq

from ..content_hash import tree_digest
from ..errors import FidelityError, PackError
from ..oracle import parallel
from ..panels.panel import Panel, TokenizedRow
from .metrics import PositionMetrics
from .routing import RoutingCounts
from .store import ReferenceRun, scored_index, write_store

# On a CPU oracle the reference's logits are kept across packs when all of them fit in this many bytes, so each pack
# after the first computes only its own head (the same tensors: bit-identical numbers, one head GEMM per pack saved)
REF_LOGITS_CACHE_BYTES = 1 << 30


def reference_logits_cache(ref: ReferenceRun, ref_oracle, budget: int | None = None) -> dict | None:
    """An empty {row index: reference logits} for compare's passes to fill and reuse, or None when the reference's
    logits of every scored position would take more than `budget` bytes (or live on a device)."""
    budget = REF_LOGITS_CACHE_BYTES if budget is None else budget
    if ref_oracle.device.type != "cpu":
        return None
    positions = sum(len(t) for t in ref.targets)
    head = ref_oracle.head_weight()
    return {} if positions * head.shape[0] * 4 <= budget else None


class ResumeError(PackError):
    """A pass kept for resuming cannot be trusted (unreadable, other positions, bytes changed): the run stops."""


class WriteError(FidelityError):
    """A file compare keeps (a pass for resuming, the records of `--out`) could not be written (a full disk...): the
    run stops, naming the file; the passes kept before it are resumed by a rerun."""


def position_columns(rows: list[TokenizedRow]) -> dict[str, list]:
    """row id, domain, position and target token of every scored position, in metric order."""
    cols = {"row_id": [], "domain": [], "position": [], "token": []}
    for r in rows:
        pos, tgt = scored_index(r)
        cols["row_id"] += [r.id] * len(pos)
        cols["domain"] += [r.domain] * len(pos)
        cols["position"] += (pos + 1).tolist()
        cols["token"] += tgt.tolist()
    return cols


def write_metrics(path: Path, positions: dict[str, list], pm: PositionMetrics) -> Path:
    """`positions` (from `position_columns`) and every metric, atomically (a killed run leaves the old file or none):
    a reader never sees half a table."""
    cols = {**positions, **pm.to_numpy()}
    tmp = path.with_name(path.name + ".partial")
    try:
        pq.write_table(pa.table(cols), tmp)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise WriteError(f"cannot write {path}: {e}") from None
    return path


def records_name(label: str) -> str:
    """The file name of a pack's records in `--out`: the label with anything but letters, digits and . _ - + # = made
    `_`, no leading dot (`--label ../..` or `x/y` never leave the folder or name a subfolder)."""
    safe = re.sub(r"[^A-Za-z0-9._+#=-]", "_", label).strip(".") or "pack"
    return f"{safe}.parquet"


def records_names(labels: list[str]) -> dict[str, str]:
    """Each label's records file name (`records_name`), a clash made unique by the label's index."""
    out, used = {}, set()
    for i, label in enumerate(labels):
        name = records_name(label)
        if name in used:
            name = name[:-len(".parquet")] + f"-{i}.parquet"
        used.add(name)
        out[label] = name
    return out


class Resume:
    """compare's finished passes kept in a folder, so a rerun after a kill recomputes only what was unfinished.

    Per pass (each pack, the noise floor): `<name>.parquet` (its per-position records, as compare's `write_records`
    writes them), for a pack `<name>.routing.json` (its measured expert routing), and `<name>.done.json`, written after
    them, holding what the numbers depend on (panel, tokenization, reference and pack fingerprints, device, noise seed,
    library version) and a BLAKE3 checksum of every file of the pass; a pass is reused only when that identity matches
    exactly, and one whose files no longer match their checksum (or with a file the checksum does not list) is refused,
    naming the file. A file that cannot be written (a full disk) stops the run with a `WriteError` naming it.
    The reference run is kept as a reference store (`reference-store/`), which is re-verified when read back: its
    top-K must be reproduced bit for bit from its hidden states on this machine. Under torchrun rank 0 writes and
    decides; every rank must see the folder."""

    def __init__(self, folder: str | Path, identity: dict, rows: list[TokenizedRow]):
        self.folder, self.identity = Path(folder), identity
        self.positions = position_columns(rows)
        self.reused: list[str] = []

    @property
    def store(self) -> Path:
        return self.folder / "reference-store"

    def _done(self, name: str) -> Path:
        return self.folder / f"{name}.done.json"

    def _routing(self, name: str) -> Path:
        return self.folder / f"{name}.routing.json"

    def _pass_files(self, name: str) -> list[Path]:
        return [self.folder / f"{name}.parquet", self._routing(name)]

    @staticmethod
    def _digest(files: list[Path]) -> dict[str, str]:
        """{file name (a folder's files: their paths inside it): BLAKE3} of those of `files` that exist."""
        out = {}
        for f in files:
            if f.exists():
                out.update(tree_digest(f))
        return out

    def _key(self, name: str, extra: dict) -> dict:
        return {**self.identity, "pass": name, **extra}

    def _finished(self, name: str, data: Path, extra: dict) -> bool:
        """Rank 0's answer, on every rank (so all ranks skip or run a pass together): `data` exists and the pass's
        identity file matches."""
        try:
            done = json.loads(self._done(name).read_text())
            found = (data.exists() and isinstance(done, dict) and "checksum" in done
                     and {k: v for k, v in done.items() if k != "checksum"} == self._key(name, extra))
        except (OSError, ValueError):
            found = False
        g = parallel.current_group()
        if g is None:
            return found
        flag = torch.tensor([int(found)])
        g.broadcast(flag, src=0)
        return bool(flag.item())

    def _write(self, name: str, extra: dict, write: Callable[[], None], files: list[Path]) -> None:
        """Rank 0 only: the identity file goes, `write()` runs, the identity file comes back with the checksum of
        `files` (so a kill in between leaves a pass that is recomputed, never one that is trusted half-written)."""
        if not parallel.is_main():
            return
        done = self._done(name)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            done.unlink(missing_ok=True)
            write()
            done.write_text(json.dumps({**self._key(name, extra), "checksum": self._digest(files)}, indent=1) + "\n")
        except OSError as e:
            done.unlink(missing_ok=True)
            where = "" if e.filename else f" ({files[0]})"
            raise WriteError(f"cannot keep the finished pass {name!r} for resuming: {e}{where}") from None

    def _verify(self, name: str, files: list[Path]) -> None:
        """A finished pass whose files differ from the checksum written with them (one changed, went missing, or is
        not listed) is refused, naming the file."""
        want = json.loads(self._done(name).read_text())["checksum"]
        got = self._digest(files)
        if got != want:
            bad = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
            where = files[0] / bad[0] if files[0].is_dir() else self.folder / bad[0]
            raise ResumeError(f"the finished pass {name!r} kept for resuming changed after it was written (its BLAKE3 "
                            f"checksum differs: {', '.join(bad)}); delete it to recompute it", file=where)

    def load(self, name: str, **extra) -> PositionMetrics | None:
        data = self.folder / f"{name}.parquet"
        if not self._finished(name, data, extra):
            return None
        self._verify(name, self._pass_files(name))
        try:
            table = pq.read_table(data)
        except Exception as e:
            raise ResumeError(
                f"cannot read the finished pass {name!r} kept for resuming ({e}); delete it to recompute it", file=data
            ) from None
        if any(f.name not in table.column_names for f in fields(PositionMetrics)):
            return None     # kept by a version without a metric this one records: recomputed
        if any(table.column(k).to_pylist() != v for k, v in self.positions.items()):
            raise ResumeError(f"the finished pass {name!r} kept for resuming holds other positions than this panel's; "
                            f"delete it to recompute it", file=data)
        self.reused.append(name)
        return PositionMetrics(**{f.name: torch.from_numpy(table.column(f.name).to_numpy().copy())
                                  for f in fields(PositionMetrics)})

    def save(self, name: str, pm: PositionMetrics, routing: RoutingCounts | None = None, **extra) -> None:
        """The pass's records and, where measured, its expert routing, under one checksum (rank 0 only)."""
        data, routing_file = self._pass_files(name)

        def write():
            routing_file.unlink(missing_ok=True)
            write_metrics(data, self.positions, pm)
            if routing is not None:
                routing_file.write_text(json.dumps(routing.to_json()) + "\n")

        self._write(name, extra, write, [data, routing_file])

    def load_routing(self, name: str) -> RoutingCounts | None:
        """The routing of a pass `load` has verified (its checksum covers the file); None for a pass without one."""
        path = self._routing(name)
        if not path.exists():
            return None
        try:
            return RoutingCounts.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ResumeError(f"cannot read the routing of the finished pass {name!r} kept for resuming ({e}); delete "
                              f"the pass to recompute it", file=path) from None

    def reference_store(self) -> Path | None:
        """The kept reference store when it is finished for this identity (and counted as reused), else None."""
        if not self._finished("reference-store", self.store / "manifest.json", {}):
            return None
        self._verify("reference-store", [self.store])
        self.reused.append("reference")
        return self.store

    def save_reference(
        self, ref: ReferenceRun, oracle, panel: Panel, *, pack_fingerprint: str, tokenizer_fingerprint: str
    ):
        def write():
            tmp = self.folder / "reference-store.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            write_store(tmp, ref, oracle, panel, pack_fingerprint=pack_fingerprint,
                        tokenizer_fingerprint=tokenizer_fingerprint)
            shutil.rmtree(self.store, ignore_errors=True)
            os.replace(tmp, self.store)

        self._write("reference-store", {}, write, [self.store])
