"""The committed golden subset (tests/fixtures/golden_subset, README there): its files are the bytes its SHA256SUMS
names, they fit in 1 MB, the copied files are their sources' published bytes, and, where ../shared is here, every
file is what build.py derives from the full sets today; a digest comparison fails on a one-bit change."""
from __future__ import annotations

import gzip
import sys
from pathlib import Path

import pytest
import torch

import _golden

sys.path.insert(0, str(_golden.SUBSET))
import build  # noqa: E402  (tests/fixtures/golden_subset/build.py)

LIMIT_BYTES = 1_000_000


def _sums(path: Path) -> dict[str, str]:
    return {name: sha for sha, name in (line.split() for line in path.read_text().splitlines() if line.strip())}


def test_subset_files_have_their_recorded_hashes_and_fit_in_1mb():
    sums = _sums(_golden.SUBSET / "SHA256SUMS")
    files = {p.relative_to(_golden.SUBSET).as_posix() for p in _golden.SUBSET.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts}
    assert files - set(sums) == {"README.md", "SHA256SUMS", "SOURCES.sha256", "build.py"}
    for name, sha in sums.items():
        assert _golden.sha256_file(_golden.SUBSET / name) == sha, name
    total = sum((_golden.SUBSET / f).stat().st_size for f in files)
    assert total <= LIMIT_BYTES, total


def test_copies_are_their_sources_published_bytes():
    """The tarball is byte for byte ../shared's (SOURCES.sha256 holds the golden folder's SHA256SUMS line), the IFEval
    gzip unpacks to the file of the sha256 its README publishes, and the test data path hands out those bytes."""
    sources = _sums(_golden.SUBSET / "SOURCES.sha256")
    for copy, src in build.COPIED.items():
        assert _golden.sha256_file(_golden.SUBSET / copy) == sources[src], copy
    unpacked = gzip.decompress((_golden.SUBSET / "ifeval" / "input_data.jsonl.gz").read_bytes())
    assert _golden.sha256_bytes(unpacked) == sources["data/ifeval/input_data.jsonl"] == _golden.IFEVAL_SHA256
    assert _golden.sha256_file(_golden.ifeval_jsonl()) == _golden.IFEVAL_SHA256
    assert len(unpacked.splitlines()) == 541


def test_subset_is_what_build_derives_from_the_full_sets(tmp_path):
    shared = _golden.SHARED
    if not (shared / "golden" / "exl3").exists():
        pytest.skip(f"full data only: the subset's sources ({shared}/golden/exl3) are checked where they are present")
    published = _sums(shared / "golden" / "exl3" / "SHA256SUMS")
    sources = _sums(_golden.SUBSET / "SOURCES.sha256")
    for src, sha in sources.items():
        assert _golden.sha256_file(shared / src) == sha, src
        if src.startswith("golden/exl3/"):
            assert published[src.removeprefix("golden/exl3/")] == sha, src
    assert sources["data/ifeval/input_data.jsonl"] == _golden.IFEVAL_SHA256
    build.build(shared, tmp_path)
    for name in _sums(_golden.SUBSET / "SHA256SUMS"):
        ours, fresh = (_golden.SUBSET / name).read_bytes(), (tmp_path / name).read_bytes()
        if name.endswith(".gz"):        # gzip's bytes may vary with zlib's version; its content may not
            ours, fresh = gzip.decompress(ours), gzip.decompress(fresh)
        assert ours == fresh, name
    assert (tmp_path / "SOURCES.sha256").read_text() == (_golden.SUBSET / "SOURCES.sha256").read_text()


def test_a_digest_tells_a_one_bit_change(rng_seed):
    t = torch.randn(64, 32).half()
    stored = _golden.Golden({"x": t.clone()}, {}, {}, Path("x"), True)
    by_digest = _golden.Golden({}, {"x": _golden.digest(t)}, {}, Path("x"), False)
    flipped = t.clone().view(torch.int16)
    i = int(torch.randint(0, t.numel(), (1,)))
    flipped.view(-1)[i] ^= 1 << int(torch.randint(0, 16, (1,)))
    flipped = flipped.view(torch.float16)
    for g in (stored, by_digest):
        assert g.same_bits("x", t.clone())
        assert not g.same_bits("x", flipped)
        assert not g.same_bits("x", t.float())                   # same values, other dtype
        assert not g.same_bits("x", t.reshape(32, 64).clone())   # same bytes, other shape
