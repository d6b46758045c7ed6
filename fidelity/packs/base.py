"""The Pack seam: every format answers "tensor name -> exact fp32 tensor" in Hugging Face naming."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..errors import PackError
from ..pack_settings import PackSettings
from .staging import as_device
from ..content_hash import files_digest


@dataclass(frozen=True)
class Storage:
    """How one logical tensor is stored."""

    name: str                      # logical (HF) name
    format: str                    # e.g. "bf16", "fp8_e4m3", "mxfp4", "gguf", "exl3", "int4-pack-quantized"
    dtype: str                     # stored element type / quant type, e.g. "BF16", "F8_E4M3", "Q4_K", "exl3 K=4"
    shape: tuple[int, ...]         # logical shape ([out, in] for dense weights)
    nbytes: int                    # bytes on disk for this tensor, scales and side tensors included
    block: tuple[int, ...] | None = None   # scale block shape, if any
    files: tuple[str, ...] = ()    # files holding it
    raw: tuple[str, ...] = ()      # stored tensor names it is built from

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def bits(self) -> float:
        """Bits per weight, scales and side tensors included."""
        return 8.0 * self.nbytes / max(self.numel, 1)


@dataclass(frozen=True)
class BatchDecode:
    """How a format decodes several tensors of one kind at once (`Pack.tensors`): the entries whose `decode_many` and
    `key` are equal go to one call `decode_many(device, [their parts])`, which returns their tensors in that order, each
    bit for bit what its entry's own `decode(device)` gives."""

    decode_many: Callable[..., list]
    key: tuple
    part: object


@dataclass
class LogicalTensor:
    """A logical tensor a format module recognised: its storage and how to decode it exactly.

    `on_device=True`: `decode(device)` reads the stored bytes, sends them to `device` and decodes there (bit for bit
    the CPU's result); otherwise `decode()` returns a CPU tensor that `Pack.tensor` moves. `batch`: how it decodes
    together with others of its kind (BatchDecode; on-device entries only), or None."""

    storage: Storage
    decode: Callable[..., torch.Tensor]
    on_device: bool = False
    batch: BatchDecode | None = None


_NON_LINEAR = re.compile(
    r"(norm|embed_tokens|wte|tok_embeddings|[._]bias$|e_score_correction_bias|\.gate\.weight$|router)"
)


def tensor_role(name: str, shape: tuple[int, ...]) -> str:
    """Classify a logical tensor for bpw accounting: head, embedding, routed_expert, linear, other."""
    if name in ("lm_head.weight", "head.weight", "output.weight"):
        return "head"
    if "embed" in name or name.endswith("wte.weight"):
        return "embedding"
    if len(shape) < 2 or _NON_LINEAR.search(name):
        return "other"
    if re.search(r"\.experts\.(\d+\.)?", name) and "shared_expert" not in name:
        return "routed_expert"
    return "linear"


@dataclass
class BitsReport:
    """bpw accounting as the seed cards report it."""

    rows: dict[str, dict[str, float]] = field(default_factory=dict)  # category -> {params, bytes, bpw}

    def __getitem__(self, k: str) -> dict[str, float]:
        return self.rows[k]

    def table(self) -> list[dict]:
        return [{"category": k, **v} for k, v in self.rows.items()]


class Pack:
    """Base class. Subclasses fill `self._entries` (logical name -> LogicalTensor), `self.config`, `self.format`.
    `settings`: how it hashes its files and decodes (PackSettings)."""

    format: str = "unknown"

    def __init__(self, path: str | Path, settings: PackSettings = PackSettings()):
        self.path = Path(path)
        self.settings = settings
        self.config: dict = {}
        self.config_file: Path | None = None   # the config.json the config is read from (or was looked for); None: none
        self._entries: dict[str, LogicalTensor] = {}

    # -- the seam -----------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def _entry(self, name: str) -> LogicalTensor:
        try:
            return self._entries[name]
        except KeyError:
            raise PackError(
                f"pack has no tensor named {name!r} (format {self.format})", file=self.path, tensor=name
            ) from None

    def storage(self, name: str) -> Storage:
        return self._entry(name).storage

    def tensor(self, name: str, device: torch.device | str | None = None) -> torch.Tensor:
        """Exact float32 tensor in the original model's naming and layout, decoded on `device` (default: the CPU).
        Off the CPU the stored bytes travel and the decode runs there; the values are the CPU decode's, bit for bit."""
        entry = self._entry(name)
        device = as_device(device)
        return self._checked(name, entry, entry.decode(device) if entry.on_device else entry.decode().to(device))

    def tensors(self, names: list[str], device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """`tensor(name, device)` for every name, the same values, decoded together where the format can (entries with
        a BatchDecode of equal kind: one batched decode for them, e.g. one EXL3 kernel launch per codebook, rate and
        shape); {name: tensor} in the order given."""
        device = as_device(device)
        out: dict[str, torch.Tensor] = {}
        kinds: dict[tuple, list[str]] = {}
        for name in dict.fromkeys(names):
            entry = self._entry(name)
            batch = entry.batch
            if batch is None or not entry.on_device:
                out[name] = self.tensor(name) if device.type == "cpu" else self.tensor(name, device=device)
            else:
                kinds.setdefault((batch.decode_many, batch.key), []).append(name)
        for (decode_many, _), group in kinds.items():
            entries = [self._entry(n) for n in group]
            decoded = decode_many(device, [e.batch.part for e in entries])
            if len(decoded) != len(group):
                raise PackError(f"a batched decode of {len(group)} tensors returned {len(decoded)}", file=self.path,
                                tensor=group[0])
            for name, entry, t in zip(group, entries, decoded):
                out[name] = self._checked(name, entry, t)
        return {n: out[n] for n in names}

    def _checked(self, name: str, entry: LogicalTensor, t: torch.Tensor) -> torch.Tensor:
        if t.dtype != torch.float32:
            t = t.to(torch.float32)
        expected = entry.storage.shape
        if expected and tuple(t.shape) != tuple(expected):
            raise PackError(f"decoded shape {list(t.shape)} differs from the stored shape {list(expected)}",
                            file=self.path, tensor=name)
        return t.contiguous()

    def stage(self, names: list[str], pin: bool = False) -> list:
        """Read the stored bytes of these logical tensors ahead into host memory (pinned when `pin`), so that their
        decode reads no file; returns the keys to `unstage`. Formats without staging read nothing here."""
        return []

    def unstage(self, keys: list) -> None:
        """Release bytes `stage` read ahead."""

    def tokenizer_source(self) -> Path | None:
        """A folder or file a tokenizer can be loaded from (HF tokenizer files or the GGUF itself)."""
        return self.path if self.path.is_dir() else None

    # -- accounting -----------------------------------------------------------------------------------------
    def model_config(self) -> dict:
        """The language model's config: a multimodal config's `text_config` over its top level."""
        inner = self.config.get("text_config")
        return {**self.config, **inner} if isinstance(inner, dict) else self.config

    def bits_per_weight(self, routing: dict[str, float] | None = None) -> BitsReport:
        """Bits per weight by category (README, "Bits per weight"). Per decoded token, a routed expert tensor counts
        with the share of tokens that read it: k / n from the config, and, with `routing` (tensor name -> measured
        share, `fidelity.measuring.routing.RoutingCounts.fractions()`), with its measured share in the `*_measured` rows
        (expert tensors without a measurement keep k / n there; the row's `unmeasured_params` says how many)."""
        sums: dict[str, list[float]] = {}

        def add(cat: str, s: Storage, weight: float = 1.0):
            p, b = sums.setdefault(cat, [0.0, 0.0])
            sums[cat] = [p + weight * s.numel, b + weight * s.nbytes]

        per_token_fraction = self._active_expert_fraction()
        unmeasured = 0.0
        names = self.names()
        tied_head = None
        if not any(tensor_role(n, ()) == "head" for n in names) and self.model_config().get(
            "tie_word_embeddings", True
        ):
            tied_head = next((n for n in names if tensor_role(n, self.storage(n).shape) == "embedding"), None)
        for name in names:
            s = self.storage(name)
            role = tensor_role(name, s.shape)
            if name == tied_head:  # a tied embedding is also the head: the head row reports it, total counts it once
                role = "tied_head"
                add("head", s)
                add("all_linear", s)
            add("total", s)
            if role in ("linear", "routed_expert", "head"):
                add("all_linear", s)
            if role == "routed_expert":
                add("routed_experts", s)
            elif role in ("linear", "head"):
                add("dense_linear" if role == "linear" else "head", s)
            if role not in ("linear", "head", "tied_head", "routed_expert"):
                continue
            expert = role == "routed_expert"
            heads = ("", "_excluding_head") if role not in ("head", "tied_head") else ("",)
            measured = per_token_fraction
            if expert and routing is not None:
                if name in routing:
                    measured = routing[name]
                else:
                    unmeasured += s.numel
            for suffix in heads:
                add(f"per_decoded_token{suffix}", s, per_token_fraction if expert else 1.0)
                if routing is not None:
                    add(f"per_decoded_token_measured{suffix}", s, measured if expert else 1.0)
            if expert:
                add("routed_experts_per_decoded_token", s, per_token_fraction)
                if routing is not None:
                    add("routed_experts_per_decoded_token_measured", s, measured)
        rep = BitsReport()
        for cat in (
            "all_linear",
            "routed_experts",
            "dense_linear",
            "head",
            "per_decoded_token",
            "per_decoded_token_excluding_head",
            "routed_experts_per_decoded_token",
            "per_decoded_token_measured",
            "per_decoded_token_measured_excluding_head",
            "routed_experts_per_decoded_token_measured",
            "total",
        ):
            if cat in sums:
                p, b = sums[cat]
                rep.rows[cat] = {"params": p, "bytes": b, "bpw": 8.0 * b / p if p else float("nan")}
                if cat.endswith("_measured") or "_measured_" in cat:
                    rep.rows[cat]["unmeasured_params"] = unmeasured
        return rep

    def _active_expert_fraction(self) -> float:
        c = self.model_config()
        n = c.get("n_routed_experts") or c.get("num_local_experts") or c.get("num_experts")
        k = c.get("num_experts_per_tok") or c.get("moe_topk") or c.get("top_k")
        if n and k:
            return float(k) / float(n)
        return 1.0

    def fingerprint(self) -> str:
        """Identity of the pack: format, config, every tensor's storage, and a content hash of every byte of every file
        its tensors are read from (`fidelity.content_hash`: BLAKE3 on all cores, cached per file version, so a 500 GB
        pack is read in full once; files a MANIFEST.sha256 beside them lists are verified against it). Two packs that
        differ in any byte differ here. Cached."""
        if getattr(self, "_fingerprint", None) is None:
            h = hashlib.sha256()
            h.update(self.format.encode())
            h.update(json.dumps(self.config, sort_keys=True, default=str).encode())
            files: set[str] = set()
            for name in sorted(self.names()):
                s = self.storage(name)
                h.update(f"{name}|{s.format}|{s.dtype}|{s.shape}|{s.nbytes}".encode())
                files.update(s.files)
            if self.path.is_file():
                files.add(str(self.path))
            root = self.path if self.path.is_dir() else self.path.parent
            digests = files_digest(sorted(f for f in files if Path(f).exists()), root, self.settings.hash_cache)
            for f in sorted(files):
                h.update(f"{Path(f).name}|{digests.get(f, 'absent')}".encode())
            self._fingerprint = h.hexdigest()[:32]
        return self._fingerprint

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.format} {self.path} ({len(self._entries)} tensors)>"
