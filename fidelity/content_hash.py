"""Content hashes of whole files, computed once per file version.

A pack's identity (`Pack.fingerprint()`) and the checksum of a kept compare pass are hashes of every byte, not of a
sample: two packs that differ in one byte anywhere never share a result. BLAKE3 (the `blake3` package) hashes a file
through a memory map on all cores; files are hashed in parallel. Each digest is cached in a folder the caller names
(a pack's `PackSettings.hash_cache`; the command line's is `$FIDELITY_CACHE/content-hash/`), by default
`~/.cache/fidelity/content-hash/`, so a 500 GB pack is read in full once.

A cached digest is used only where the cache can show the bytes are the ones it hashed:
- the entry is keyed by (path, device, inode, size, mtime_ns, ctime_ns). Tools restore size and mtime after an edit in
  place (`rsync --inplace -t`, `cp -p`, `touch -r`, `os.utime`), but not ctime: every write, and restoring the mtime
  itself, sets ctime to the present.
- the entry holds a digest of sampled blocks (head, tail and blocks spread between, `SAMPLE_BLOCKS` x `SAMPLE_BYTES`),
  read again and compared on every hit: a changed sampled byte is seen even where ctime could be set back (a clock
  moved back, a filesystem that stores what it is told).
- a file whose ctime lies within `RACY_NS` of the moment its hash was started is not cached: a second edit in the same
  timestamp tick (or under a skewed clock) could leave every key field as it was, so the next run hashes it in full.

A pack folder's `MANIFEST.sha256` (`sha256sum` lines: `<hex>  <relative path>`) is used where present: every listed
file it reads is verified against it (sha256 of the whole file, cached the same way), a mismatch is a `PackError` naming
the file, and the verified sha256 is that file's digest.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from blake3 import blake3

from .errors import PackError

MANIFEST = "MANIFEST.sha256"
_CHUNK = 16 << 20
SAMPLE_BYTES = 64 << 10   # bytes per sampled block
SAMPLE_BLOCKS = 16        # head, tail and 14 spread evenly between
RACY_NS = 2_000_000_000   # timestamp granularity and clock skew a later edit could hide within


def default_cache_dir() -> Path:
    """Where digests are cached when the caller names no folder."""
    return Path.home() / ".cache" / "fidelity" / "content-hash"


def _version_key(path: Path, algorithm: str) -> tuple[str, dict]:
    st = path.stat()
    ident = {"path": str(path.resolve()), "dev": st.st_dev, "inode": st.st_ino, "size": st.st_size,
             "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "algorithm": algorithm}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest(), ident


def sample_offsets(size: int) -> list[int]:
    """Start of each sampled block of a file of `size` bytes: the head, the tail and blocks spread evenly between
    (the whole file where it is shorter than the blocks together)."""
    if size <= SAMPLE_BLOCKS * SAMPLE_BYTES:
        return list(range(0, size, SAMPLE_BYTES))
    last = size - SAMPLE_BYTES
    return [last * i // (SAMPLE_BLOCKS - 1) for i in range(SAMPLE_BLOCKS)]


def sample_digest(path: Path) -> str:
    """sha256 of the file's size and its sampled blocks (`sample_offsets`)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(size.to_bytes(8, "little"))
        for at in sample_offsets(size):
            h.update(os.pread(f.fileno(), SAMPLE_BYTES, at))
    return h.hexdigest()


def _compute(path: Path, algorithm: str) -> str:
    if algorithm == "blake3":
        h = blake3(max_threads=blake3.AUTO)
        if path.stat().st_size:
            h.update_mmap(str(path))
        return h.hexdigest()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_digest(path: str | Path, algorithm: str = "blake3", *, cache: bool = True,
                cache_dir: Path | None = None) -> str:
    """Hex digest of every byte of `path` ("blake3" or "sha256"), from the cache in `cache_dir` (None:
    `default_cache_dir()`) when this version of the file (same device, inode, size, mtime and ctime, the same sampled
    blocks) was hashed before (see the module's notes). `cache=False` always reads the file (checksums that must catch
    a byte changed without a new mtime)."""
    path = Path(path)
    if not cache:
        try:
            return _compute(path, algorithm)
        except OSError as e:
            raise PackError(f"cannot read the file to hash it ({e.strerror or e})", file=path) from None
    try:
        started = time.time_ns()
        key, ident = _version_key(path, algorithm)
        sample = sample_digest(path)
    except OSError as e:
        raise PackError(f"cannot read the file to hash it ({e.strerror or e})", file=path) from None
    entry = (cache_dir if cache_dir is not None else default_cache_dir()) / f"{key}.json"
    try:
        cached = json.loads(entry.read_text())
        if ({k: cached.get(k) for k in ident} == ident and cached.get("sample") == sample
                and isinstance(cached.get("digest"), str)):
            return cached["digest"]
    except (OSError, ValueError):
        pass
    try:
        digest = _compute(path, algorithm)
        unchanged = _version_key(path, algorithm)[0] == key and sample_digest(path) == sample
    except OSError as e:
        raise PackError(f"cannot read the file to hash it ({e.strerror or e})", file=path) from None
    if not unchanged:  # changed while it was read: the digest is of no one version
        raise PackError("the file changed while it was being hashed", file=path)
    if ident["ctime_ns"] >= started - RACY_NS:
        return digest  # changed too recently for its key to show the next change: not cached
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f"{entry.name}.{os.getpid()}.partial")
        tmp.write_text(json.dumps({**ident, "sample": sample, "digest": digest}))
        os.replace(tmp, entry)
    except OSError:
        pass  # an unwritable cache only costs time
    return digest


def tree_digest(root: Path) -> dict[str, str]:
    """{relative path: blake3 hex} of every file under `root` (or of `root` itself when it is a file), read in full."""
    root = Path(root)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {(p.name if p == root else str(p.relative_to(root))): file_digest(p, cache=False) for p in files}


def read_manifest(folder: Path) -> dict[str, str] | None:
    """{resolved path: sha256 hex} of a folder's MANIFEST.sha256, None when it has none."""
    m = folder / MANIFEST
    if not m.is_file():
        return None
    out = {}
    for n, line in enumerate(m.read_text(errors="replace").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.strip().split(maxsplit=1)
        digest = parts[0].lower()
        if len(parts) != 2 or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise PackError(f"line {n} is not '<sha256 hex>  <file>'", file=m)
        out[str((folder / parts[1].lstrip("*")).resolve())] = digest
    return out


def files_digest(files: list[str | Path], manifest_folder: Path | None = None,
                 cache_dir: Path | None = None) -> dict[str, str]:
    """{file: "algorithm:hex"} of every file, hashed in parallel (digests cached in `cache_dir`, see `file_digest`);
    files a MANIFEST.sha256 in `manifest_folder` lists are verified against it."""
    manifest = read_manifest(manifest_folder) if manifest_folder is not None and manifest_folder.is_dir() else None
    paths = [Path(f) for f in files]

    def one(p: Path) -> str:
        want = manifest.get(str(p.resolve())) if manifest else None
        if want is None:
            return "blake3:" + file_digest(p, "blake3", cache_dir=cache_dir)
        got = file_digest(p, "sha256", cache_dir=cache_dir)
        if got != want:
            raise PackError(
                f"sha256 {got} differs from {want} in {manifest_folder / MANIFEST}: the file is not the one "
                f"the manifest describes",
                file=p,
            )
        return "sha256:" + got

    if len(paths) <= 1:
        return {str(p): one(p) for p in paths}
    with ThreadPoolExecutor(max_workers=min(len(paths), os.cpu_count() or 1)) as ex:
        return dict(zip(map(str, paths), ex.map(one, paths)))
