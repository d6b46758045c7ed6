"""Engram layers of DeepSeek-V4.1 (as exllamav3's `architecture/deepseek_v41.py` and `modules/ngram_embedding.py`
describe them): each token's last 2..ngram_size tokens are hashed, per n-gram length, into `heads_per_ngram` rows of a
huge table (one row range per head, each range a prime number of rows); the rows, concatenated, project to one key per
hc stream plus one shared value; each stream's RMS-normed activation dotted with its normed key gates the value
(sigmoid of the signed square root of dot / sqrt(hidden)), and the gated value is added to that stream.

The tables are ~200 GB in the real model, so they are never loaded: `RowTable` reads the rows a forward touches, row
by row, straight from the safetensors file (`os.pread`), and nothing else of the table enters memory.

Token ids are first mapped to the "compressed vocabulary" (tokens whose normalised text is equal share an id);
`compressed_token_map` builds that map from tokenizer.json.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, normalizers

from ...errors import ConfigError, PackError
from ...packs.safetensors_io import DTYPES, SafetensorsFile
from ...packs.staging import CPU, to_device
from ..common import rms_norm
from ...packs.fp8 import DEFAULT_BLOCK, E8M0_DTYPES, FLOAT_SCALE_DTYPES, FP8_DTYPES, e8m0_to_float, scale_layout

ARCH = "DeepseekV41ForCausalLM"
ROW_DTYPES = ("F32", "F16", "BF16")
GATE_FLOOR = 1e-6


# ---------------------------------------------------------------------------------------------------------------------
# config: per-head table sizes (consecutive primes) and per-layer hash multipliers
# ---------------------------------------------------------------------------------------------------------------------
def next_prime(p: int) -> int:
    """The smallest prime > p."""
    def is_prime(v: int) -> bool:
        if v < 2:
            return False
        if v % 2 == 0:
            return v == 2
        d = 3
        while d * d <= v:
            if v % d == 0:
                return False
            d += 2
        return True
    p += 1
    while not is_prime(p):
        p += 1
    return p


def head_vocab_sizes(cfg: dict) -> dict[int, list[int]]:
    """layer -> rows of each of its (ngram_size - 1) * n_heads hash heads: consecutive primes above
    engram_vocab_size - 1, continuing from one Engram layer to the next; each layer's sum must equal its
    engram_num_embeddings entry."""
    layers = list(cfg.get("engram_layer_ids") or [])
    totals = list(cfg.get("engram_num_embeddings") or [])
    ngram, n_heads = int(cfg.get("engram_max_ngram_size", 4)), int(cfg.get("engram_n_heads", 8))
    if len(totals) != len(layers):
        raise ConfigError(f"config.json of {ARCH}: engram_num_embeddings has {len(totals)} entries for "
                          f"{len(layers)} engram_layer_ids")
    p = int(cfg.get("engram_vocab_size", 0)) - 1
    out = {}
    for layer, total in zip(layers, totals):
        sizes = []
        for _ in range((ngram - 1) * n_heads):
            p = next_prime(p)
            sizes.append(p)
        if sum(sizes) != total:
            raise ConfigError(f"config.json of {ARCH}: Engram layer {layer}'s heads sum to {sum(sizes)} rows, but "
                              f"engram_num_embeddings says {total}")
        out[layer] = sizes
    return out


def layer_multipliers(layer: int, ngram_size: int, compressed_vocab_size: int) -> list[int]:
    """Odd int64 multipliers, one per n-gram position, drawn from numpy's PCG64 seeded with 10007 * layer."""
    bound = (2 ** 63 - 1) // compressed_vocab_size // 2
    rng = np.random.default_rng(10007 * layer)
    return (rng.integers(0, bound, size=ngram_size, dtype=np.int64) * 2 + 1).tolist()


@dataclass
class EngramArgs:
    layer: int
    ngram_size: int
    heads_per_ngram: int
    head_sizes: list
    multipliers: list
    pad_id: int                # compressed id the n-grams of the first tokens are padded with
    hc_mult: int
    hidden_size: int
    eps: float

    @property
    def n_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def head_offsets(self) -> list[int]:
        return np.cumsum([0] + self.head_sizes[:-1]).tolist()

    @classmethod
    def from_config(cls, cfg: dict, layer: int, token_map: torch.Tensor | None = None) -> "EngramArgs":
        sizes = head_vocab_sizes(cfg)
        if layer not in sizes:
            raise ConfigError(f"config.json of {ARCH}: layer {layer} is not in engram_layer_ids {list(sizes)}")
        compressed = int(cfg.get("engram_compressed_vocab_size") or 0)
        if compressed <= 0:
            raise ConfigError(f"config.json of {ARCH} has no engram_compressed_vocab_size")
        ngram = int(cfg.get("engram_max_ngram_size", 4))
        pad = int(cfg.get("engram_pad_token_id", cfg.get("engram_pad_id", 2)))   # HF / the reference's key
        return cls(layer=layer, ngram_size=ngram, heads_per_ngram=int(cfg.get("engram_n_heads", 8)),
                   head_sizes=sizes[layer], multipliers=layer_multipliers(layer, ngram, compressed),
                   pad_id=int(token_map[pad]) if token_map is not None else pad,
                   hc_mult=int(cfg["hc_mult"]), hidden_size=int(cfg["hidden_size"]),
                   eps=float(cfg.get("rms_norm_eps", 1e-6)))


# ---------------------------------------------------------------------------------------------------------------------
# hashing
# ---------------------------------------------------------------------------------------------------------------------
def ngram_rows(ids: torch.Tensor, a: EngramArgs) -> torch.Tensor:
    """Compressed token ids [B, T] (rows start at the sequence start) -> global table rows [B, T, n_heads].

    For n-gram length g (2..ngram_size), position t mixes its last g tokens: XOR over s < g of token[t - s] *
    multiplier[s] (int64, wrapping), padded with pad_id before the start; head h of that length takes the mix modulo
    its size, offset to its row range."""
    B, T = ids.shape
    ctx = a.ngram_size - 1
    history = torch.cat((ids.new_full((B, ctx), a.pad_id), ids.long()), dim=1)
    shifted = [history[:, ctx - s: ctx - s + T] for s in range(a.ngram_size)]
    mult = torch.tensor(a.multipliers, dtype=torch.int64, device=ids.device)
    sizes = torch.tensor(a.head_sizes, dtype=torch.int64, device=ids.device).view(a.ngram_size - 1, a.heads_per_ngram)
    offsets = torch.tensor(a.head_offsets, dtype=torch.int64, device=ids.device).view(a.ngram_size - 1,
                                                                                         a.heads_per_ngram)
    blocks = []
    mixed = shifted[0] * mult[0]
    for g in range(2, a.ngram_size + 1):
        mixed = torch.bitwise_xor(mixed, shifted[g - 1] * mult[g - 1])
        blocks.append(torch.remainder(mixed.unsqueeze(-1), sizes[g - 2]) + offsets[g - 2])
    return torch.cat(blocks, dim=-1)


# ---------------------------------------------------------------------------------------------------------------------
# the table, read row by row
# ---------------------------------------------------------------------------------------------------------------------
MAX_GAP_BYTES = 1 << 16     # touched rows closer than this come in one pread (reading the gap is cheaper than a call)
MAX_READ_BYTES = 1 << 26    # no single pread longer than this


def read_rows(fd: int, begin: int, row_bytes: int, rows: np.ndarray, path) -> np.ndarray:
    """Rows `rows` (ascending, distinct) of a table of `row_bytes`-byte rows stored from file offset `begin` ->
    uint8 [len(rows), row_bytes]. Runs of nearby rows are read with one pread each (the bytes between them dropped),
    so a forward that touches most of a small table reads it in a few calls, and a sparse one a row per call."""
    out = np.empty((len(rows), row_bytes), dtype=np.uint8)
    if len(rows) == 0:
        return out
    gap_rows = max(1, MAX_GAP_BYTES // row_bytes)
    span_rows = max(1, MAX_READ_BYTES // row_bytes)
    new_run = np.ones(len(rows), dtype=bool)
    new_run[1:] = (np.diff(rows) > gap_rows) | (rows[1:] // span_rows != rows[:-1] // span_rows)
    starts = np.flatnonzero(new_run).tolist()
    for s, e in zip(starts, starts[1:] + [len(rows)]):
        first, last = int(rows[s]), int(rows[e - 1])
        length = (last - first + 1) * row_bytes
        data = os.pread(fd, length, begin + first * row_bytes)
        if len(data) != length:
            raise PackError(f"Engram table rows {first}..{last}: the file ends {length - len(data)} bytes early",
                            file=path)
        out[s:e] = np.frombuffer(data, dtype=np.uint8).reshape(-1, row_bytes)[rows[s:e] - first]
    return out


@dataclass(frozen=True)
class RowScales:
    """The scales of an FP8 table shard, read with the rows: `layout` is fp8.py's ScaleLayout (one value, one per row,
    or one per block of rows x columns)."""
    path: str
    begin: int
    dtype: str
    shape: tuple
    layout: object

    def for_rows(self, fd_of, rows: np.ndarray, dim: int, device: torch.device = CPU) -> torch.Tensor:
        """fp32 multipliers [len(rows), dim] on `device` for the given local rows (ascending); each scale row touched is
        read once (nearby ones in one pread) and its stored bytes are converted on `device`."""
        kind = self.layout.kind
        torch_dtype, size = DTYPES[self.dtype]
        rows = np.asarray(rows, dtype=np.int64)
        if kind == "tensor":
            cols, grid_rows, block = 1, np.zeros_like(rows), None
        elif kind == "channel":
            cols, grid_rows, block = 1, rows, None
        else:
            block = self.layout.block
            cols, grid_rows = self.shape[-1], rows // block[0]
        wanted, inverse = np.unique(grid_rows, return_inverse=True)
        raw = to_device(torch.from_numpy(read_rows(fd_of(self.path), self.begin, cols * size, wanted, self.path)),
                        device)
        if self.dtype in ("F8_E8M0", "U8"):
            values = e8m0_to_float(raw)
        else:
            values = raw.view(torch_dtype).float()
        if not bool(torch.isfinite(values).all()):            # every scale row read is used by some row
            raise PackError("Engram table scales hold NaN or inf", file=self.path)
        out = values[torch.from_numpy(inverse.reshape(-1)).to(device)]
        return out.repeat_interleave(block[1], dim=1)[:, :dim] if kind == "block" else out.expand(-1, dim)


class RowTable:
    """Rows of a [rows, dim] table stored as one or more safetensors tensors (shards with equal row counts, the last
    may be shorter), read on request with `os.pread` (one call per run of nearby touched rows, `read_rows`). Nothing
    is cached or mapped. FP8 shards (e4m3 or
    e5m2) come with their scales (per tensor, per row, or per block), which are read row by row as well; a row's
    value is float(fp8) * scale in fp32, exactly as the pack decodes the whole tensor."""

    def __init__(self, shards: list[tuple[str, str]], scales: list[tuple[str, str, tuple | None]] | None = None):
        """shards: (file, tensor name) in row order; scales (FP8 shards only): (file, scale tensor name, block or
        None for DeepSeek's default 128 x 128) per shard."""
        self.parts = []   # (path, begin, rows, row_bytes, torch dtype, RowScales or None)
        self.dim = None
        for i, (path, name) in enumerate(shards):
            info = SafetensorsFile(path).info(name)
            fp8 = info.dtype in FP8_DTYPES
            if (info.dtype not in ROW_DTYPES and not fp8) or len(info.shape) != 2:
                raise PackError(f"an Engram table must be a 2-D {'/'.join(ROW_DTYPES)} tensor or FP8 with scales, "
                                f"found {info.dtype} {list(info.shape)}", file=path, tensor=name)
            scale = None
            if fp8:
                if not scales or scales[i] is None:
                    raise PackError("FP8 Engram table shard has no scale tensor", file=path, tensor=name)
                spath, sname, block = scales[i]
                sinfo = SafetensorsFile(spath).info(sname)
                if sinfo.dtype not in E8M0_DTYPES + FLOAT_SCALE_DTYPES:
                    raise PackError(f"scale dtype {sinfo.dtype} is not a float or e8m0 type", file=spath, tensor=sname)
                blocks = [tuple(block) if block else DEFAULT_BLOCK]
                layout = scale_layout(info.shape, sinfo.shape, blocks, file=spath, tensor=sname)
                scale = RowScales(str(spath), sinfo.begin, sinfo.dtype, tuple(sinfo.shape), layout)
            if self.dim is not None and info.shape[1] != self.dim:
                raise PackError(f"Engram table shard has {info.shape[1]} columns, the first has {self.dim}",
                                file=path, tensor=name)
            self.dim = info.shape[1]
            dtype, size = DTYPES[info.dtype]
            self.parts.append((str(path), info.begin, info.shape[0], info.shape[1] * size, dtype, scale))
        self.rows_per_shard = self.parts[0][2]
        self.n_rows = sum(p[2] for p in self.parts)
        if any(p[2] != self.rows_per_shard for p in self.parts[:-1]) or self.parts[-1][2] > self.rows_per_shard:
            raise PackError("Engram table shards must hold equal row counts (the last may be shorter)",
                            file=self.parts[0][0], tensor=shards[0][1])
        self.rows_read = 0

    @classmethod
    def from_pack(cls, pack, prefix: str) -> "RowTable":
        """`{prefix}.weight`, or `{prefix}.shard_0.weight`, `{prefix}.shard_1.weight`... of a safetensors pack (an
        FP8 shard with its `.scale` / `.weight_scale_inv` / `.weight_scale`, as the pack pairs them)."""
        have = set(pack.names())
        if f"{prefix}.weight" in have:
            names = [f"{prefix}.weight"]
        else:
            names = []
            while f"{prefix}.shard_{len(names)}.weight" in have:
                names.append(f"{prefix}.shard_{len(names)}.weight")
        if not names:
            raise PackError(f"pack has no Engram table {prefix}.weight or {prefix}.shard_0.weight",
                            file=getattr(pack, "path", None), tensor=f"{prefix}.weight")
        raw = getattr(pack, "raw", None)
        shards, scales = [], []
        for name in names:
            storage = pack.storage(name)
            stored = storage.raw or (name,)
            if raw is None or len(stored) > 2 or (len(stored) == 2 and not storage.format.startswith("fp8")):
                raise PackError(f"Engram table stored as {storage.format} ({storage.dtype}) cannot be read row by row; "
                                f"plain float or FP8 with scales can", tensor=name, file=getattr(pack, "path", None))
            shards.append((raw.file_path(stored[0]), stored[0]))
            scales.append((raw.file_path(stored[1]), stored[1], storage.block) if len(stored) == 2 else None)
        return cls(shards, scales if any(scales) else None)

    def rows(self, index: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
        """Rows `index` (any shape of int64) -> float32 [*index.shape, dim] on `device` (default: index's device).
        The distinct rows are found where `index` lives; each is read once, as stored bytes, and those bytes (not fp32)
        go to `device`, where they are converted and scaled (the same exact fp8/fp16 -> fp32 casts and one fp32
        product on every device) and the repeats gathered."""
        device = index.device if device is None else torch.device(device)
        unique, inverse = torch.unique(index.reshape(-1), return_inverse=True)      # ascending
        wanted = unique.cpu().numpy()
        outside = wanted[(wanted < 0) | (wanted >= self.n_rows)]
        if len(outside):
            raise PackError(f"Engram row {int(outside[0])} outside the table's {self.n_rows} rows",
                            file=self.parts[0][0])
        shard_of = wanted // self.rows_per_shard
        shards = np.unique(shard_of).tolist()
        out = None if len(shards) == 1 else torch.empty(len(wanted), self.dim, dtype=torch.float32, device=device)
        fds = {}

        def fd_of(path):
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            return fd

        try:
            for shard in shards:
                at = np.flatnonzero(shard_of == shard)
                local = wanted[at] - shard * self.rows_per_shard
                path, begin, _, row_bytes, dtype, scale = self.parts[shard]
                stored = torch.from_numpy(read_rows(fd_of(path), begin, row_bytes, local, path))
                values = to_device(stored, device).view(dtype).float()
                if scale is not None:
                    values *= scale.for_rows(fd_of, local, self.dim, device)
                if out is None:
                    out = values
                else:
                    out[torch.from_numpy(at).to(device)] = values
        finally:
            for fd in fds.values():
                os.close(fd)
        if out is None:                                      # an empty index
            out = torch.empty(0, self.dim, dtype=torch.float32, device=device)
        self.rows_read += len(wanted)
        return out[inverse.to(device)].view(*index.shape, self.dim)


# ---------------------------------------------------------------------------------------------------------------------
# the layer
# ---------------------------------------------------------------------------------------------------------------------
class EngramLayer:
    """streams [B, T, hc, hidden] + compressed token ids [B, T] -> streams + gated n-gram value.

    Weights (official names under `layers.L.engram.`): `embed` table [rows, dim], `wkv.weight`
    [(hc + 1) * hidden, n_heads * dim], `k_weight` and `q_weight` [hc * hidden] (per-stream RMSNorm weights)."""

    def __init__(self, a: EngramArgs, table: RowTable, wkv: torch.Tensor, k_weight: torch.Tensor,
                 q_weight: torch.Tensor, fetch=None):
        self.a, self.table, self.wkv, self.fetch = a, table, wkv, fetch
        self.act_quant = lambda x: x     # fake quantisation of wkv's input (quant.py), or none
        self.k_weight = k_weight.reshape(a.hc_mult, a.hidden_size)
        self.q_weight = q_weight.reshape(a.hc_mult, a.hidden_size)

    @staticmethod
    def names(layer: int) -> list[str]:
        return [f"layers.{layer}.engram.{w}" for w in ("wkv.weight", "k_weight", "q_weight")]

    def __call__(self, streams: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows = ngram_rows(ids, self.a)   # hashed where the ids are (the oracle's device), decoded onto the streams'
        access = None if self.fetch is None else self.fetch.taps.engram_access   # lookups per row (OracleTaps)
        if access is not None:
            access.add(self.a.layer, self.table.n_rows, rows)
        return self.from_rows(streams, rows)

    def from_rows(self, streams: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The layer on already hashed table rows [B, T, n_heads]; `mask` [B, T] (bool): tokens whose streams get the
        gated value (DeepSeek's reference takes one; every token where None)."""
        a = self.a
        B, T, hc, D = streams.shape
        embed = self.table.rows(rows, streams.device).flatten(2).to(streams)   # [B, T, heads*dim]
        kv = F.linear(self.act_quant(embed), self.wkv)
        key = rms_norm(kv[..., :hc * D].view(B, T, hc, D), self.k_weight, a.eps)
        value = kv[..., hc * D:]
        query = rms_norm(streams, self.q_weight, a.eps)
        gate = (query * key).sum(-1) * D ** -0.5
        # signed square root, |dot| floored at 1e-6 as DeepSeek's V4.1 reference does (a zero dot gates at
        # sigmoid(+1e-3), not 0.5)
        weight = torch.sigmoid(torch.copysign(gate.abs().clamp_min(GATE_FLOOR).sqrt(), gate))
        if mask is not None:
            weight = weight * mask.to(device=weight.device, dtype=weight.dtype).unsqueeze(-1)
        return streams + weight.unsqueeze(-1) * value.unsqueeze(-2)


# ---------------------------------------------------------------------------------------------------------------------
# compressed vocabulary
# ---------------------------------------------------------------------------------------------------------------------
def compressed_token_map(tokenizer_json: str | os.PathLike) -> torch.Tensor:
    """token id -> compressed id: tokens whose decoded text normalises (NFKC, NFD, accents stripped, lower case,
    whitespace runs to one space, then stripped unless the text is only a space) to the same key share an id, in order
    of first appearance; a token that decodes to invalid UTF-8 keys on its own token string."""
    tokenizer = Tokenizer.from_file(str(Path(tokenizer_json)))
    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), "\ue000"),
        normalizers.Strip(), normalizers.Replace("\ue000", " "),
    ])
    keys: dict[str, int] = {}
    ids = []
    for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([i], skip_special_tokens=False)
        key = tokenizer.id_to_token(i) if "\ufffd" in text else normalizer.normalize_str(text) or text
        ids.append(keys.setdefault(key, len(keys)))
    return torch.tensor(ids, dtype=torch.long)
