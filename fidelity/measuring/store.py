"""The reference store: one reference run of a panel, kept so packs can be compared without re-running the reference.

`records.parquet` has one record per token of every panel row: row id, domain, position, token, scored flag, and for
scored tokens the reference NLL, its top-K ids and log-probabilities and the final hidden state (float32) that produced
that distribution. Re-applying the reference pack's head to the hidden state gives back the *exact* full-vocabulary
logits (checked against the stored top-K every time they are re-derived). Per scored position it keeps 4·hidden bytes
(+ 8·K for the top-K) where llama.cpp's KLD base file keeps 2·vocab (uint16 logits): ~1/40 of it for SmolLM2-135M
(vocab 49152, hidden 576), ~1/15 for Llama-3-8B (128256, 4096), ~1/9 for DeepSeek-V3 (129280, 7168), before parquet's
compression. Re-derived logits are bit-exact only through the same reference pack on the same torch, BLAS and CPU code
path. `manifest.json` pins the panel (sha256), the reference pack (fingerprint), the tokenizer (fingerprint) and the
library version; a store is refused for any other panel, pack or tokenizer. It also records where the panel and the
reference pack were read from (`panel.path`, `reference_pack.path`, absolute), so readers can default to them
(`stored_sources`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
import re
import hashlib

import numpy as np
import torch
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from .. import __version__
from ..errors import FidelityError
from ..panels.panel import Panel, TokenizedRow
from ..oracle.runner import HEAD_ROWS
from .metrics import MetricKernel, PositionMetrics, device_metrics_columns, finish_columns, topk_logprobs

RECORDS_FILE = "records.parquet"
MANIFEST_FILE = "manifest.json"
TOP_K = 20


class StoreError(FidelityError):
    """A reference store is malformed, or was built for another panel, pack or tokenizer."""


@dataclass
class ReferenceRun:
    """The reference's side of a comparison: for every row, the final hidden states at the positions that predict its
    scored tokens (`hidden[i]` [n_i, hidden]) and those tokens (`targets[i]` [n_i]). `topk` is set when it came from a
    store (ids, logprobs per row) and is checked when logits are re-derived."""

    rows: list[TokenizedRow]
    hidden: list[torch.Tensor]
    targets: list[torch.Tensor]
    topk: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    built_with: dict | None = None  # the store's `numerics()` record, named when a re-derivation disagrees
    device: str = "cpu"  # where the re-deriving oracle runs

    @property
    def scored_positions(self) -> int:
        return sum(len(t) for t in self.targets)


def scored_index(row: TokenizedRow) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions whose logits predict a scored token, those tokens)."""
    pos = torch.tensor([t - 1 for t, s in enumerate(row.scored) if s], dtype=torch.long)
    return pos, torch.tensor(row.tokens, dtype=torch.long)[pos + 1]


def run_reference(oracle, rows: list[TokenizedRow], progress: bool = True) -> ReferenceRun:
    full = oracle.hidden_states([r.tokens for r in rows], progress=progress)
    hidden, targets = [], []
    for r, h in zip(rows, full):
        pos, tgt = scored_index(r)
        hidden.append(h[pos].to(torch.float32).contiguous())
        targets.append(tgt)
    return ReferenceRun(rows, hidden, targets)


def numerics(device: str | torch.device = "cpu") -> dict:
    """What decides the last float32 bits of the head's logits besides the inputs: recorded in the manifest so a
    re-derivation that disagrees can say what changed."""
    device = torch.device(device)
    out = {"torch": torch.__version__, "device": device.type, "head_rows": HEAD_ROWS}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["cuda"] = torch.version.cuda
    else:
        out["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        out["threads"] = torch.get_num_threads()
        mkl = re.search(r"Math Kernel Library Version (\S+)", torch.__config__.show())
        out["blas"] = f"mkl {mkl.group(1)}" if mkl else "other"
        out["mkl_cbwr"] = os.environ.get("MKL_CBWR")  # fidelity.blas: strict reproducibility mode
    return out


def _topk_on(logits: torch.Tensor, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """metrics.topk_logprobs computed where the store's top-K was (the oracle's device), returned on the CPU."""
    ids, lps = topk_logprobs(logits.to(device), k)
    return ids.cpu(), lps.cpu()


def check_topk(ref: ReferenceRun, i: int, logits: torch.Tensor, where: Path | str, first: int = 0) -> None:
    """Re-derived logits must reproduce the stored top-K exactly (ids and float32 log-probabilities). `logits` are
    those of row i's scored positions first, first + 1, ... (all of them by default)."""
    ids, lps = ref.topk[i]
    ids, lps = ids[first:first + logits.shape[0]], lps[first:first + logits.shape[0]]
    k = ids.shape[1]
    got_ids, got_lps = _topk_on(logits, k, ref.device)
    bad = ~((got_ids == ids).all(1) & (got_lps == lps).all(1))
    if bool(bad.any()):
        raise StoreError(f"{where}: {_first_mismatch(ref, i, bad, ids, lps, got_ids, got_lps, logits, first)}")


def _first_mismatch(ref: ReferenceRun, i: int, bad, ids, lps, got_ids, got_lps, logits, first: int = 0) -> str:
    """Names the first differing position, rank and token with stored and re-derived values and their distance."""
    row, k = ref.rows[i], ids.shape[1]
    j = int(bad.nonzero()[0])
    pos = int(scored_index(row)[0][first + j])
    moved = got_ids[j] != ids[j]  # a token that changed rank says more than a last-bit difference
    rank = int((moved if bool(moved.any()) else got_lps[j] != lps[j]).nonzero()[0])
    tok, want = int(ids[j, rank]), float(lps[j, rank])
    lse = torch.logsumexp(logits.float(), -1)  # as topk_logprobs computes it
    have = float(logits[j, tok].float() - lse[j]) if 0 <= tok < logits.shape[-1] else float("nan")
    ulps = abs(have - want) / abs(float(np.spacing(np.float32(want))))
    got = (
        f"re-derived {have:.9g}"
        if int(got_ids[j, rank]) == tok
        else f"re-derived rank {rank} is token {int(got_ids[j, rank])} ({float(got_lps[j, rank]):.9g}); "
        f"token {tok} now {have:.9g}"
    )
    dev = float((got_lps[bad] - lps[bad]).abs().max())
    again_ids, again_lps = _topk_on(
        logits, k, ref.device
    )  # tells a store that differs from arithmetic that is not repeatable here
    if torch.equal(again_ids, got_ids) and torch.equal(again_lps, got_lps):
        repeat = "the same logits give the same log-probs again"
    else:
        same = torch.equal(again_ids[j], ids[j]) and torch.equal(again_lps[j], lps[j])
        repeat = (
            f"the same logits give other log-probs on a second pass here (max change "
            f"{float((again_lps - got_lps).abs().max()):.3g}; the second pass {'matches' if same else 'differs from'} "
            f"the store at this position): this process's arithmetic is not repeatable"
        )
    env = ""
    if ref.built_with is not None:
        now = numerics(ref.device)
        changed = {key: (ref.built_with.get(key), now.get(key)) for key in sorted(set(now) | set(ref.built_with))
                   if ref.built_with.get(key) != now.get(key)}
        env = (" Store built with " + ", ".join(f"{key}={a} (now {b})" for key, (a, b) in changed.items()) + "."
               if changed else f" Same numerics as the store's build ({ref.built_with}).")
    return (
        f"row {row.id!r} position {pos}: logits re-derived from the stored hidden state do not reproduce the stored "
        f"top-{k}: first at rank {rank}, token {tok} (predicting token {row.tokens[pos + 1]}): stored log-prob "
        f"{want:.9g}, {got} (|diff| {abs(have - want):.3g}, {ulps:.0f} float32 ulp); {int(bad.sum())} of "
        f"{len(bad)} scored positions of this row differ, max log-prob deviation {dev:.3g}; {repeat}. The reference "
        f"pack's head or this machine's matmul differs from the one that built the store.{env}"
    )


def head_sha256(oracle) -> str:
    """Content hash of the float32 head the store's hidden states go through (pack fingerprints describe storage
    only, so two packs of one layout share them)."""
    return hashlib.sha256(oracle.head_weight().detach().cpu().float().contiguous().numpy().tobytes()).hexdigest()[:16]


def write_store(out_dir: str | Path, ref: ReferenceRun, oracle, panel: Panel, *, pack_fingerprint: str,
                tokenizer_fingerprint: str, k: int = TOP_K) -> dict:
    """Write records.parquet + manifest.json; the reference NLL and top-K come from the same head the store
    re-applies."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cols = {
        k_: []
        for k_ in ("row_id", "domain", "position", "token", "scored", "nll", "topk_ids", "topk_logprobs", "hidden")
    }
    for r, h, tgt in zip(ref.rows, ref.hidden, ref.targets):
        if oracle.device.type == "cpu":
            logits = oracle.apply_head(h).float()
            ids, lps = topk_logprobs(logits, k)
            nll = (torch.logsumexp(logits.double(), -1) - logits.double().gather(1, tgt[:, None])[:, 0]).float()
        else:
            ids, lps, nll = _device_topk_nll(oracle, h, tgt, k)
        h = h.cpu()   # a CUDA oracle's hidden states
        j = 0
        for t, (tok, s) in enumerate(zip(r.tokens, r.scored)):
            cols["row_id"].append(r.id)
            cols["domain"].append(r.domain)
            cols["position"].append(t)
            cols["token"].append(tok)
            cols["scored"].append(bool(s))
            if s:
                cols["nll"].append(float(nll[j]))
                cols["topk_ids"].append(ids[j].to(torch.int32).numpy())
                cols["topk_logprobs"].append(lps[j].numpy())
                cols["hidden"].append(h[j].numpy().tobytes())
                j += 1
            else:
                for c in ("nll", "topk_ids", "topk_logprobs", "hidden"):
                    cols[c].append(None)
    # top-K as variable-length lists: pyarrow < 26 cannot write a fixed-size list column with nulls to Parquet
    table = pa.table({
        "row_id": pa.array(cols["row_id"], pa.string()), "domain": pa.array(cols["domain"], pa.string()),
        "position": pa.array(cols["position"], pa.int32()), "token": pa.array(cols["token"], pa.int32()),
        "scored": pa.array(cols["scored"], pa.bool_()), "nll": pa.array(cols["nll"], pa.float32()),
        "topk_ids": pa.array(cols["topk_ids"], pa.list_(pa.int32())),
        "topk_logprobs": pa.array(cols["topk_logprobs"], pa.list_(pa.float32())),
        "hidden": pa.array(cols["hidden"], pa.binary()),
    })
    pq.write_table(table, out / RECORDS_FILE, compression="zstd")
    nbytes = (out / RECORDS_FILE).stat().st_size
    scored = ref.scored_positions
    pack_path = getattr(getattr(oracle, "pack", None), "path", None)
    manifest = {
        "panel": {
            "name": panel.name,
            "sha256": panel.sha256,
            "rows": len(ref.rows),
            "scored_positions": scored,
            "path": str(Path(panel.path).resolve()) if panel.path else None,
        },
        "pack_fingerprint": pack_fingerprint,
        "head_sha256": head_sha256(oracle),
        "reference_pack": {
            "path": str(Path(pack_path).resolve()) if pack_path else None,
            "fingerprint": pack_fingerprint,
        },
        "tokenizer_fingerprint": tokenizer_fingerprint,
        "fidelity_version": __version__,
        "top_k": k,
        "hidden_size": int(ref.hidden[0].shape[1]) if ref.hidden else 0,
        "hidden_dtype": "float32",
        "bytes": nbytes,
        "bytes_per_scored_position": nbytes / max(scored, 1),
        "numerics": numerics(oracle.device),
        "oracle_numerics": getattr(oracle, "numerics", "exact"),
    }
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _device_topk_nll(oracle, hidden: torch.Tensor, targets: torch.Tensor, k: int):
    """A row's top-K and reference NLL with the logits kept on the oracle's device (chunk by chunk): (ids, log-probs,
    NLL) on the CPU."""
    ids, lps, nll = [], [], []
    targets = targets.to(oracle.device)
    for where, logits in oracle.iter_logits(hidden):
        logits = logits.float()
        i, lp = topk_logprobs(logits, k)
        t = targets[where]
        ids.append(i.cpu())
        lps.append(lp.cpu())
        nll.append((torch.logsumexp(logits.double(), -1) - logits.double().gather(1, t[:, None])[:, 0]).float().cpu())
    if not ids:
        return torch.zeros(0, k, dtype=torch.int64), torch.zeros(0, k), torch.zeros(0)
    return torch.cat(ids), torch.cat(lps), torch.cat(nll)


# Logits per side per chunk when head and metrics run on the device (1 GiB of float32 each at most).
DEVICE_HEAD_CHUNK_BYTES = 2**30


def device_chunk_positions(vocab: int, head_rows: int) -> int:
    """Positions per chunk of `device_row_metrics`: whole head blocks, DEVICE_HEAD_CHUNK_BYTES of logits per side."""
    return head_rows * max(1, DEVICE_HEAD_CHUNK_BYTES // (head_rows * vocab * 4))


def device_row_metrics(ref: ReferenceRun, ref_oracle, pack_hidden: list[torch.Tensor], pack_oracle, *,
                       store_path=None, chunk_positions: int | None = None, desc: str = "metrics",
                       progress: bool = True, kernel=None):
    """compare's head and metrics with the logits on the oracles' device: every row's scored positions in chunks
    of whole head blocks (rows run into each other; a position's logits do not depend on its neighbours, see
    runner.HEAD_ROWS), both heads into two reused [chunk, vocab] buffers, the stored top-K (if any) checked there,
    metrics by metrics.device_metrics_columns (`kernel`: its MetricKernel, None the default); only the per-position
    numbers reach the host. Any device, the CPU
    included (the tests' check of the chunking); compare takes it for non-CPU oracles."""
    device = ref_oracle.device
    counts = [len(t) for t in ref.targets]
    total = sum(counts)
    if total == 0:
        return PositionMetrics.concat([finish_columns(torch.zeros(0, 6, dtype=torch.float64),
                                                      torch.zeros(0, 2, dtype=torch.int64), True)])
    vocab = ref_oracle.head_weight().shape[0]
    chunk = min(chunk_positions or device_chunk_positions(vocab, HEAD_ROWS), total)
    starts = np.concatenate([[0], np.cumsum(counts)])
    targets = torch.cat(ref.targets).to(device)
    buf_ref = torch.empty(chunk, vocab, dtype=ref_oracle.dtype, device=device)
    buf_pack = torch.empty(chunk, vocab, dtype=pack_oracle.dtype, device=device)
    outs, tops = [], []
    bar = tqdm(total=total, desc=desc, disable=not progress, unit="pos", leave=False)
    for start in range(0, total, chunk):
        end = min(total, start + chunk)
        n = end - start
        rows = range(int(np.searchsorted(starts, start, "right")) - 1, int(np.searchsorted(starts, end, "left")))
        ref_logits, pack_logits = buf_ref[:n], buf_pack[:n]
        ref_oracle.head_into(_positions(ref.hidden, starts, rows, start, end, device), ref_logits)
        pack_oracle.head_into(_positions(pack_hidden, starts, rows, start, end, device), pack_logits)
        ref_logits, pack_logits = ref_logits.float(), pack_logits.float()
        if ref.topk is not None:
            _check_chunk(ref, ref_logits, starts, rows, start, end, store_path)
        out, top = device_metrics_columns(ref_logits, pack_logits, targets[start:end], kernel or MetricKernel())
        outs.append(out)
        tops.append(top)
        bar.update(n)
    bar.close()
    return finish_columns(torch.cat(outs), torch.cat(tops), reverse=True)


def _positions(per_row: list[torch.Tensor], starts, rows, start: int, end: int, device) -> torch.Tensor:
    """Positions start..end of the rows' concatenated [n_i, hidden] tensors, on `device` in one copy."""
    parts = [per_row[i][max(start, starts[i]) - starts[i]:min(end, starts[i + 1]) - starts[i]] for i in rows]
    return (parts[0] if len(parts) == 1 else torch.cat([p.to(device) for p in parts])).to(device)


def _check_chunk(ref: ReferenceRun, logits: torch.Tensor, starts, rows, start: int, end: int, where) -> None:
    """The stored top-K of every position in the chunk. On the device one top-K of the whole chunk (fixed-shape
    blocks), compared row by row; a row that differs goes to check_topk for its message. On the CPU check_topk row
    by row, as compare always did."""
    k = ref.topk[0][0].shape[1]
    ids, lps = _topk_on(logits, k, logits.device) if logits.device.type != "cpu" else (None, None)
    for i in rows:
        lo, hi = max(start, starts[i]), min(end, starts[i + 1])
        a, b = int(lo - starts[i]), int(hi - starts[i])
        if ids is not None:
            want_ids, want_lps = ref.topk[i]
            if torch.equal(ids[lo - start : hi - start], want_ids[a:b]) and torch.equal(
                lps[lo - start : hi - start], want_lps[a:b]
            ):
                continue
        check_topk(ref, i, logits[lo - start:hi - start], where, first=a)


def read_manifest(path: str | Path) -> dict:
    p = Path(path) / MANIFEST_FILE
    if not p.exists():
        raise StoreError(f"{Path(path)}: not a reference store ({MANIFEST_FILE} is missing)")
    return json.loads(p.read_text())


def stored_sources(path: str | Path) -> tuple[str | None, str | None]:
    """(reference pack path, panel path) the store was written from, as its manifest records them (None: not recorded,
    as in stores written before 2026-12-01, or a panel not read from a file)."""
    m = read_manifest(path)
    return (m.get("reference_pack") or {}).get("path"), m["panel"].get("path")


def load_store(path: str | Path, panel: Panel, rows: list[TokenizedRow], *, pack_fingerprint: str,
               tokenizer_fingerprint: str, oracle=None) -> ReferenceRun:
    """Read a store for `panel` tokenized as `rows`; refuse one built for another panel, pack or tokenizer."""
    path = Path(path)
    m = read_manifest(path)
    if m["panel"]["sha256"] != panel.sha256:
        raise StoreError(
            f"{path}: this store was built for panel {m['panel']['name']!r} (sha256 "
            f"{m['panel']['sha256'][:12]}...), not for panel {panel.name!r} (sha256 {panel.sha256[:12]}...)"
        )
    if m["tokenizer_fingerprint"] != tokenizer_fingerprint:
        raise StoreError(
            f"{path}: this store was built with tokenizer {m['tokenizer_fingerprint']}, the reference pack's "
            f"tokenizer is {tokenizer_fingerprint}"
        )
    head = head_sha256(oracle) if oracle is not None else m.get("head_sha256")
    if m["pack_fingerprint"] != pack_fingerprint or m.get("head_sha256") != head:
        raise StoreError(f"{path}: this store was built from reference pack {m['pack_fingerprint']} (head "
                         f"{m.get('head_sha256')}), not from {pack_fingerprint} (head {head}): its hidden states only "
                         f"give exact logits through the same head")
    stored, running = m.get("oracle_numerics", "exact"), getattr(oracle, "numerics", "exact") if oracle else None
    if running is not None and stored != running:
        raise StoreError(
            f"{path}: this store was built under numerics {stored!r}, this run's oracle computes under "
            f"{running!r}: build the store again with --numerics {running}, or run with --numerics {stored}"
        )
    table = pq.read_table(path / RECORDS_FILE)
    by_row: dict[str, dict] = {}
    row_ids = table.column("row_id").to_pylist()
    tokens = table.column("token").to_numpy()
    scored = table.column("scored").to_numpy(zero_copy_only=False)
    hidden_col = table.column("hidden").to_pylist()
    ids_col = table.column("topk_ids")
    lps_col = table.column("topk_logprobs")
    k = m["top_k"]
    start = 0
    for i in range(1, len(row_ids) + 1):
        if i == len(row_ids) or row_ids[i] != row_ids[start]:
            by_row[row_ids[start]] = {"slice": (start, i)}
            start = i
    hidden_size = m["hidden_size"]
    ref = ReferenceRun(rows, [], [], [], built_with=m.get("numerics"),
                       device=str(oracle.device) if oracle is not None else "cpu")
    for r in rows:
        entry = by_row.get(r.id)
        if entry is None:
            raise StoreError(f"{path}: row {r.id!r} of the panel is not in the store")
        s, e = entry["slice"]
        if tokens[s:e].tolist() != r.tokens or scored[s:e].tolist() != r.scored:
            raise StoreError(f"{path}: row {r.id!r}: stored tokens differ from the panel's tokenization")
        sel = [j for j in range(s, e) if scored[j]]
        hid = np.frombuffer(b"".join(hidden_col[j] for j in sel), dtype=np.float32).reshape(len(sel), hidden_size)
        ref.hidden.append(torch.from_numpy(hid.copy()))
        ref.targets.append(torch.tensor(tokens[sel], dtype=torch.long))
        ids = np.stack([ids_col[j].values.to_numpy() for j in sel]) if sel else np.zeros((0, k), np.int32)
        lps = np.stack([lps_col[j].values.to_numpy() for j in sel]) if sel else np.zeros((0, k), np.float32)
        ref.topk.append((torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(lps.copy())))
    return ref
