"""Where the golden reference data is: the full sets in ../shared (or $FIDELITY_SHARED, also how a test run pretends
to be a plain clone: FIDELITY_SHARED=/nonexistent), else the committed subset in tests/fixtures/golden_subset (its
README: what it holds, from which files, their sha256). A file stored there only as a digest (dtype, shape, sha256 of
its bytes) is compared bit for bit through that digest.

Skip reasons (tests/conftest.py turns the first kind into failures under FIDELITY_CI): "missing data: ..." where neither
set has what a test reads; "full data only: ..." where only the full set in ../shared has it (the subset's README lists
what that leaves out of a plain clone)."""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import tarfile
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

TESTS = Path(__file__).resolve().parent
SHARED = Path(os.environ.get("FIDELITY_SHARED") or TESTS.parents[1] / "shared")
SUBSET = TESTS / "fixtures" / "golden_subset"
EXL3_FULL = SHARED / "golden" / "exl3"
EXL3_SUBSET = SUBSET / "exl3"
IFEVAL_FULL = SHARED / "data" / "ifeval" / "input_data.jsonl"
IFEVAL_SUBSET = SUBSET / "ifeval" / "input_data.jsonl.gz"
IFEVAL_SHA256 = "67ffeee0fcb87c317c5b08a2de85557b4a7e96ada6178aa645b4954fe4b53d49"   # ../shared/data/ifeval/README.md


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    return sha256_bytes(Path(path).read_bytes())


def digest(t: torch.Tensor) -> dict:
    """dtype, shape and the sha256 of a tensor's bytes (row-major, native byte order)."""
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": sha256_bytes(raw)}


def full_data_only(what: str):
    pytest.skip(f"full data only: {what} is only in the full golden set ({EXL3_FULL}, absent here), not in the "
                f"committed subset (tests/fixtures/golden_subset)")


class Golden:
    """One golden file's tensors: those stored, by key, and the others as digests (the subset's large tensors)."""

    def __init__(self, tensors: dict, digests: dict, meta: dict, where: Path, full: bool):
        self.tensors, self.digests, self.meta, self.where, self.full = tensors, digests, meta, where, full

    def keys(self) -> set[str]:
        return set(self.tensors) | set(self.digests)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.tensors:
            if key in self.digests or not self.full:
                full_data_only(f"tensor {key} of {self.where.name}")
            raise KeyError(f"{key} is not in {self.where}")
        return self.tensors[key]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape) if key in self.tensors else tuple(self.digests[key]["shape"])

    def same_bits(self, key: str, t: torch.Tensor) -> bool:
        """t has the golden tensor's dtype, shape and bytes."""
        if key in self.tensors:
            ref = self.tensors[key]
            return (ref.dtype == t.dtype and ref.shape == t.shape
                    and torch.equal(ref.contiguous().reshape(-1).view(torch.uint8),
                                    t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)))
        return digest(t) == self.digests[key]


def _safetensors(path: Path, full: bool) -> Golden:
    with safe_open(str(path), "pt") as f:
        meta = json.loads((f.metadata() or {}).get("json", "{}"))
    return Golden(load_file(path), meta.pop("digests", {}), meta, path, full)


def in_subset(relpath: str) -> bool:
    """The subset holds this file (its SHA256SUMS lists it)."""
    sums = SUBSET / "SHA256SUMS"
    return sums.exists() and any(line.split()[1] == relpath for line in sums.read_text().splitlines() if line.strip())


def _exl3(name: str) -> tuple[Path, bool]:
    """(path, full) of an EXL3 golden file: ../shared's where present, else the subset's."""
    if (EXL3_FULL / name).exists():
        return EXL3_FULL / name, True
    if not in_subset(f"exl3/{name}"):
        full_data_only(name)
    if not (EXL3_SUBSET / name).exists():
        pytest.skip(f"missing data: {EXL3_SUBSET / name} (listed in {SUBSET / 'SHA256SUMS'}) is not here")
    return EXL3_SUBSET / name, False


def exl3_codebooks() -> Golden:
    """exllamav3's codebook tables (`codebook.{3inst,mcg,mul1}`, fp16 per 16-bit state) and `states`."""
    full = EXL3_FULL / "codebooks.safetensors"
    if full.exists():
        return _safetensors(full, True)
    path, _ = _exl3("codebooks.json")
    meta = json.loads(path.read_text())
    return Golden({}, meta.pop("digests"), meta, path, False)


def exl3_linears(codebook: str) -> Golden:
    """exllamav3's quantized linears of one codebook: per prefix `trellis`, `suh`, `svh` (`mul1`), `inner`, `recon`;
    `weight.<shape>`; meta["entries"][prefix] as recorded. The subset: rows 0..127 of every K's s256x128 linear
    (prefix `k<K>.<cb>.s256x128.in0-127`, inner and recon as digests), and the encoder's k4.mul1.s256x128 case."""
    path, full = _exl3(f"linears_{codebook}.safetensors")
    return _safetensors(path, full)


def exl3_logits() -> Golden:
    """input_ids [rows, T] and logits [rows, T, 1024] of the golden tiny Llama (the subset: row 0, its first
    positions)."""
    path, full = _exl3("logits.safetensors")
    return _safetensors(path, full)


def exl3_checkpoint(name: str, into: Path) -> Path:
    """The golden checkpoint `name` (an exllamav3 conversion or tiny_llama_fp16) unpacked under `into`."""
    tar, _ = _exl3(f"{name}.tar.gz")
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    return into / name


def exl3_original(unpacked: Path | None) -> Golden:
    """The unquantized tiny Llama's tensors: from its unpacked checkpoint, or the subset's digests of them."""
    if unpacked is not None:
        return Golden(load_file(unpacked / "model.safetensors"), {}, {}, unpacked, True)
    path, _ = _exl3("tiny_llama_fp16.json")
    meta = json.loads(path.read_text())
    return Golden({}, meta.pop("digests"), meta, path, False)


def ifeval_jsonl() -> Path:
    """IFEval's input_data.jsonl (541 prompts): ../shared's, else the subset's gzip unpacked once into the temp folder
    (checked against the file's published sha256 every time)."""
    if IFEVAL_FULL.exists():
        return IFEVAL_FULL
    if not IFEVAL_SUBSET.exists():
        return IFEVAL_FULL            # the caller's own check names it as missing data
    data = gzip.decompress(IFEVAL_SUBSET.read_bytes())
    if sha256_bytes(data) != IFEVAL_SHA256:
        raise AssertionError(f"{IFEVAL_SUBSET} unpacks to bytes whose sha256 is not IFeval's {IFEVAL_SHA256}")
    out = Path(tempfile.gettempdir()) / f"fidelity-golden-{os.getuid()}" / IFEVAL_SHA256[:16] / "input_data.jsonl"
    if not out.exists() or sha256_file(out) != IFEVAL_SHA256:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, out)
    return out
