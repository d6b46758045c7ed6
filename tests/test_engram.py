"""Engram (DeepSeek-V4.1 hashed n-gram layers) against independent formulations: a naive per-position loop with Python
integers for the hashing, a whole-table loop for the layer, a sieve for the prime table sizes; and a multi-GB sparse
table file read with resident memory growing only by the rows touched."""
from __future__ import annotations

import json
import math
import os
import struct
import unicodedata

import numpy as np
import pytest
import torch

from fidelity.errors import ConfigError, PackError
from fidelity.oracle.deepseek.engram import (EngramArgs, EngramLayer, RowTable, compressed_token_map, head_vocab_sizes,
                                             layer_multipliers, ngram_rows)
from fidelity.packs.safetensors_io import write_safetensors


def primes_above(start: int, count: int) -> list[int]:
    limit = max(100, start * 2 + 200)
    while True:
        sieve = np.ones(limit + 1, dtype=bool)
        sieve[:2] = False
        for i in range(2, int(limit ** 0.5) + 1):
            if sieve[i]:
                sieve[i * i::i] = False
        found = [int(p) for p in np.nonzero(sieve)[0] if p > start][:count]
        if len(found) == count:
            return found
        limit *= 2


def small_args(rng: np.random.Generator, hc=2, hidden=8, ngram=4, heads=3, dim=5) -> EngramArgs:
    sizes = primes_above(int(rng.integers(20, 60)), (ngram - 1) * heads)
    mult = [int(m) * 2 + 1 for m in rng.integers(0, 2 ** 62, size=ngram, dtype=np.int64)]
    return EngramArgs(layer=1, ngram_size=ngram, heads_per_ngram=heads, head_sizes=sizes, multipliers=mult,
                      pad_id=int(rng.integers(0, 30)), hc_mult=hc, hidden_size=hidden, eps=1e-6)


def as_int64(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def naive_rows(ids: list[int], a: EngramArgs) -> list[list[int]]:
    offsets = [sum(a.head_sizes[:h]) for h in range(a.n_heads)]
    out = []
    for t in range(len(ids)):
        token = lambda s: ids[t - s] if t - s >= 0 else a.pad_id  # noqa: E731
        row = []
        for g in range(2, a.ngram_size + 1):
            mixed = 0
            for s in range(g):
                mixed ^= as_int64(token(s) * a.multipliers[s])
            for k in range(a.heads_per_ngram):
                h = (g - 2) * a.heads_per_ngram + k
                row.append(as_int64(mixed) % a.head_sizes[h] + offsets[h])
        out.append(row)
    return out


HAS_CUDA = torch.cuda.is_available()
CUDA = pytest.param("cuda", marks=[pytest.mark.device, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")])
DEVICES = ["cpu", CUDA]


@pytest.mark.parametrize("device", DEVICES)
def test_hash_rows_match_naive_loop(rng_seed, device):
    """Hashed where the ids are (on CUDA: the same wrapping int64 products, XORs and floor remainders)."""
    rng = np.random.default_rng(rng_seed)
    a = small_args(rng)
    ids = torch.as_tensor(rng.integers(0, 1000, size=(3, 17)))
    ids[0, :3] = torch.tensor([2 ** 40, 2 ** 62 - 1, 129_279])       # products that wrap
    got = ngram_rows(ids.to(device), a)
    assert got.device.type == device
    got = got.cpu()
    assert got.shape == (3, 17, a.n_heads)
    for b in range(3):
        assert got[b].tolist() == naive_rows(ids[b].tolist(), a)
    assert int(got.max()) < sum(a.head_sizes) and int(got.min()) >= 0


def test_config_sizes_and_multipliers(rng_seed):
    rng = np.random.default_rng(rng_seed)
    vocab, ngram, heads = int(rng.integers(100, 5000)), 3, 2
    primes = primes_above(vocab - 1, 2 * (ngram - 1) * heads)
    per = (ngram - 1) * heads
    cfg = dict(engram_layer_ids=[2, 5], engram_vocab_size=vocab, engram_max_ngram_size=ngram, engram_n_heads=heads,
               engram_num_embeddings=[sum(primes[:per]), sum(primes[per:])])
    assert head_vocab_sizes(cfg) == {2: primes[:per], 5: primes[per:]}
    mult = layer_multipliers(5, ngram, 1000)
    assert mult == layer_multipliers(5, ngram, 1000) != layer_multipliers(2, ngram, 1000)
    assert all(m % 2 == 1 and 0 < m < 2 ** 63 // 1000 for m in mult)
    cfg["engram_num_embeddings"][1] += 1
    with pytest.raises(ConfigError, match="Engram layer 5"):
        head_vocab_sizes(cfg)


def write_table(path, name, table: torch.Tensor):
    write_safetensors(path, {name: table})


def naive_layer(streams, ids, a, table, wkv, k_weight, q_weight):
    B, T, hc, D = streams.shape
    out = streams.clone()
    for b in range(B):
        rows = naive_rows(ids[b].tolist(), a)
        for t in range(T):
            embed = torch.cat([table[r] for r in rows[t]])
            kv = wkv @ embed
            value = kv[hc * D:]
            for h in range(hc):
                k = kv[h * D:(h + 1) * D]
                k = k / torch.sqrt((k * k).mean() + a.eps) * k_weight[h * D:(h + 1) * D]
                s = streams[b, t, h]
                q = s / torch.sqrt((s * s).mean() + a.eps) * q_weight[h * D:(h + 1) * D]
                g = float(q @ k) / math.sqrt(D)
                w = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(g), 1e-6)), g)))
                out[b, t, h] = s + w * value
    return out


def test_layer_matches_naive_loop(tmp_path, rng_seed):
    rng = np.random.default_rng(rng_seed)
    a = small_args(rng)
    dim, D, hc = 5, a.hidden_size, a.hc_mult
    table = torch.randn(sum(a.head_sizes), dim)
    write_table(tmp_path / "t.safetensors", "layers.1.engram.embed.weight", table)
    wkv = torch.randn((hc + 1) * D, a.n_heads * dim) / math.sqrt(a.n_heads * dim)
    k_weight, q_weight = 1 + 0.2 * torch.randn(hc * D), 1 + 0.2 * torch.randn(hc * D)
    layer = EngramLayer(a, RowTable([(tmp_path / "t.safetensors", "layers.1.engram.embed.weight")]), wkv,
                        k_weight, q_weight)
    streams = torch.randn(2, 9, hc, D)
    ids = torch.as_tensor(rng.integers(0, 500, size=(2, 9)))
    got = layer(streams, ids)
    want = naive_layer(streams, ids, a, table, wkv, k_weight, q_weight)
    assert (got - want).abs().max().item() <= 1e-5
    assert (got - streams).abs().max().item() > 0.1   # the layer adds something


def test_sharded_table_from_pack(tmp_path, rng_seed):
    """A table split into shard_N tensors across files reads the same rows as the whole table."""
    from fidelity import open_pack
    g = torch.Generator().manual_seed(rng_seed)
    table = torch.randn(23, 4, generator=g).to(torch.bfloat16)
    folder = tmp_path / "pack"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["DeepseekV41ForCausalLM"]}))
    shards = {"model-00001-of-00002.safetensors": {"layers.0.engram.embed.shard_0.weight": table[:10],
                                                   "layers.0.engram.embed.shard_1.weight": table[10:20]},
              "model-00002-of-00002.safetensors": {"layers.0.engram.embed.shard_2.weight": table[20:]}}
    weight_map = {}
    for file, tensors in shards.items():
        write_safetensors(folder / file, tensors)
        weight_map.update({n: file for n in tensors})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    rt = RowTable.from_pack(open_pack(folder), "layers.0.engram.embed")
    index = torch.randint(0, 23, (3, 7), generator=g)
    assert rt.n_rows == 23 and torch.equal(rt.rows(index), table.float()[index])
    with pytest.raises(PackError, match="layers.0.engram.nope"):
        RowTable.from_pack(open_pack(folder), "layers.0.engram.nope")
    with pytest.raises(PackError, match="outside the table's 23 rows"):
        rt.rows(torch.tensor([23]))


def every_code(dtype, rows: int, dim: int, g) -> torch.Tensor:
    """[rows, dim] of `dtype` holding every finite bit pattern (NaN/inf codes replaced by zero), shuffled."""
    width = torch.finfo(dtype).bits
    codes = torch.arange(2 ** width, dtype=torch.int32)
    codes = codes.to(torch.uint8) if width == 8 else codes.to(torch.int16)   # int16 wraps 32768.. to negatives
    values = codes.view(dtype)
    values = torch.where(torch.isfinite(values.float()), values, torch.zeros((), dtype=dtype))
    pick = torch.randint(0, values.numel(), (rows * dim,), generator=g)
    pick[:values.numel()] = torch.randperm(values.numel(), generator=g)[:rows * dim]
    return values[pick].view(rows, dim)


TABLE_KINDS = ["F32", "F16 every code", "BF16 every code", "e4m3 every code, per-row F32 scales",
               "e5m2 every code, e8m0 row groups down to 2**-127", "e4m3 every code, e8m0 blocks 8x16, 3 shards"]


@pytest.mark.parametrize("kind", TABLE_KINDS)
@pytest.mark.parametrize("device", DEVICES)
def test_rows_decode_where_asked_from_stored_bytes(tmp_path, rng_seed, device, kind):
    """RowTable.rows on `device` (the index there too): only the touched rows' stored bytes (and their scale rows) are
    sent, and the fp32 rows equal, bit for bit, torch's own casts times the index-expanded scale computed in float64
    and rounded once to fp32 (exact: an fp8 x fp32 product fits float64), subnormal products included; the CPU path
    gives the same bits."""
    from fidelity.packs import staging
    g = torch.Generator().manual_seed(rng_seed)
    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "e4m3": torch.float8_e4m3fn,
             "e5m2": torch.float8_e5m2}[kind.split()[0]]
    rows, dim, n_shards = (96 if dtype.itemsize != 2 else 1024), 64, (3 if "3 shards" in kind else 1)
    values = torch.randn(rows, dim, generator=g) if dtype == torch.float32 else every_code(dtype, rows, dim, g)
    full = torch.ones(rows, dim, dtype=torch.float64)
    stored_scale = None
    if "per-row F32" in kind:
        stored_scale = torch.rand(rows, generator=g) * 2 ** float(torch.randint(-30, 30, (1,), generator=g)) + 1e-3
        full = stored_scale.double()[:, None].expand(rows, dim)
        block = None
    elif "row groups" in kind:                 # V4.1's layout: [rows, dim / 32] e8m0, one per 32 columns of a row
        exps = torch.randint(0, 255, (rows, dim // 32), generator=g)
        exps[:4, 0] = torch.tensor([0, 1, 127, 254])
        stored_scale = exps.to(torch.uint8).view(torch.float8_e8m0fnu)
        full = torch.tensor([[2.0 ** (int(exps[r, c // 32]) - 127) for c in range(dim)] for r in range(rows)],
                            dtype=torch.float64)
        block = (1, 32)
    elif "blocks" in kind:
        exps = torch.randint(100, 150, (rows // n_shards // 8, dim // 16), generator=g)
        block = (8, 16)
    per_shard = rows // n_shards
    shards, scale_parts = [], []
    for k in range(n_shards):
        part = slice(k * per_shard, (k + 1) * per_shard)
        tensors = {"t.weight": values[part]}
        if "blocks" in kind:
            e = torch.randint(100, 150, (per_shard // 8, dim // 16), generator=g)
            tensors["t.scale"] = e.to(torch.uint8).view(torch.float8_e8m0fnu)
            full[part] = torch.tensor([[2.0 ** (int(e[r // 8, c // 16]) - 127) for c in range(dim)]
                                       for r in range(per_shard)], dtype=torch.float64)
        elif stored_scale is not None:
            tensors["t.scale"] = stored_scale[part]
        write_safetensors(tmp_path / f"s{k}.safetensors", tensors)
        shards.append((tmp_path / f"s{k}.safetensors", "t.weight"))
        scale_parts.append((tmp_path / f"s{k}.safetensors", "t.scale", block) if "t.scale" in tensors else None)
    table = RowTable(shards, scale_parts if any(scale_parts) else None)
    index = torch.randint(0, rows, (4, 9, 3), generator=g)
    index[0, 0, :] = torch.tensor([0, rows - 1, per_shard % rows])     # both ends, a shard's first row
    want = (values.double()[index] * full[index]).float()
    before = staging.bytes_sent()
    got = table.rows(index.to(device))
    sent = staging.bytes_sent() - before
    assert got.device.type == device and got.dtype == torch.float32 and got.shape == (4, 9, 3, dim)
    assert torch.equal(got.cpu(), want), f"max |d| {(got.cpu() - want).abs().max()}"
    assert torch.equal(got.cpu(), table.rows(index))                  # the CPU path, same bits
    touched = index.unique().numel()
    row_bytes = dim * values.element_size()
    scale_bytes = 0 if stored_scale is None and "blocks" not in kind else touched * (dim // 16 if "blocks" in kind else
                                                                                      (dim // 32 if block else 4))
    assert sent <= touched * row_bytes + scale_bytes, (sent, touched * row_bytes)
    if device != "cpu":
        assert sent >= touched * row_bytes                            # the rows travelled as stored bytes
    if "2**-127" in kind:                                            # the test reaches fp32 subnormal products
        assert bool(((want != 0) & (want.abs() < torch.finfo(torch.float32).tiny)).any())


def test_quantised_table_refused_naming_it(tmp_path):
    write_safetensors(
        tmp_path / "q.safetensors", {"layers.3.engram.embed.weight": torch.zeros(4, 8, dtype=torch.int16)}
    )
    with pytest.raises(PackError) as e:
        RowTable([(tmp_path / "q.safetensors", "layers.3.engram.embed.weight")])
    assert "layers.3.engram.embed.weight" in str(e.value) and "q.safetensors" in str(e.value)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc for resident memory")
def test_multi_gb_table_memory_grows_only_by_rows_touched(tmp_path, rng_seed):
    """A 4 GiB table (a sparse file: its header and a few written rows, holes elsewhere) is used through RowTable;
    resident memory grows by a few MB (the rows read), not by the table."""
    rows, dim = 1 << 20, 1024                          # 1M rows x 4 KiB = 4 GiB
    name = "layers.7.engram.embed.weight"
    header = json.dumps({name: {"dtype": "F32", "shape": [rows, dim], "data_offsets": [0, rows * dim * 4]}}).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "engram.safetensors"
    g = torch.Generator().manual_seed(rng_seed)
    written = torch.randint(0, rows, (64,), generator=g).unique()
    values = torch.randn(written.numel(), dim, generator=g)
    start = 8 + len(header)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(start + rows * dim * 4)
        for r, v in zip(written.tolist(), values):
            f.seek(start + r * dim * 4)
            f.write(v.numpy().tobytes())
    assert path.stat().st_size > 4 * 2 ** 30
    table = RowTable([(path, name)])
    index = torch.cat([written, torch.randint(0, rows, (2000,), generator=g)])
    table.rows(index[:8])                              # warm up allocator and file machinery
    before = resident_bytes()
    got = table.rows(index)
    grown = resident_bytes() - before
    touched = index.unique().numel() * dim * 4
    print(f"table {path.stat().st_size / 2**30:.1f} GiB, rows touched {touched / 2**20:.1f} MiB, "
          f"resident growth {grown / 2**20:.1f} MiB")
    assert grown < 4 * touched + 32 * 2 ** 20 < path.stat().st_size / 50
    assert torch.equal(got[:written.numel()], values)
    others = ~torch.isin(index[written.numel():], written)
    assert torch.count_nonzero(got[written.numel():][others]) == 0


def test_compressed_token_map_matches_python_normalisation(tmp_path):
    from tokenizers import Tokenizer, models
    vocab = ["Hello", "hello", "HÉLLO", " ", "  ", "\t", "world", "Wörld", "ﬁne", "fine", " x ", "x", "[PAD]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[PAD]"))
    tok.save(str(tmp_path / "tokenizer.json"))

    def key(text):
        s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
        s = "".join(c for c in s if unicodedata.category(c) != "Mn").lower()
        s = " ".join(part for part in s.replace("\t", " ").split(" ")) if s else s
        while "  " in s:
            s = s.replace("  ", " ")
        return s if s == " " else s.strip() or text

    keys, want = {}, []
    for w in vocab:
        want.append(keys.setdefault(key(tok.decode([vocab.index(w)])), len(keys)))
    got = compressed_token_map(tmp_path / "tokenizer.json")
    assert got.tolist() == want
    assert got[0] == got[1] == got[2] and got[6] == got[7] and got[8] == got[9] and got[10] == got[11]
    assert got[3] == got[4] == got[5] != got[11]


@pytest.mark.parametrize("edit,needle", [
    (dict(engram_num_embeddings=[5]), "engram_num_embeddings has 1 entries for 2 engram_layer_ids"),
    (dict(layer=3), "layer 3 is not in engram_layer_ids"),
    (dict(engram_compressed_vocab_size=None), "engram_compressed_vocab_size"),
])
def test_engram_config_errors_named(edit, needle):
    per = 2 * 2
    primes = primes_above(99, 2 * per)
    cfg = dict(engram_layer_ids=[1, 4], engram_vocab_size=100, engram_max_ngram_size=3, engram_n_heads=2,
               engram_num_embeddings=[sum(primes[:per]), sum(primes[per:])], engram_compressed_vocab_size=50,
               hc_mult=2, hidden_size=8)
    layer = edit.pop("layer", 1)
    cfg.update(edit)
    with pytest.raises(ConfigError) as e:
        EngramArgs.from_config({k: v for k, v in cfg.items() if v is not None}, layer)
    assert needle in str(e.value) and "DeepseekV41ForCausalLM" in str(e.value)


def test_engram_args_from_config_hash_like_the_naive_loop(rng_seed):
    per = 2 * 2
    primes = primes_above(99, 2 * per)
    cfg = dict(engram_layer_ids=[1, 4], engram_vocab_size=100, engram_max_ngram_size=3, engram_n_heads=2,
               engram_num_embeddings=[sum(primes[:per]), sum(primes[per:])], engram_compressed_vocab_size=50,
               engram_pad_token_id=7, hc_mult=2, hidden_size=8)
    token_map = torch.arange(60) % 50
    a = EngramArgs.from_config(cfg, 4, token_map)
    assert a.head_sizes == primes[per:] and a.pad_id == 7 and a.multipliers == layer_multipliers(4, 3, 50)
    ids = torch.randint(0, 50, (1, 11))
    assert ngram_rows(ids, a)[0].tolist() == naive_rows(ids[0].tolist(), a)


def test_row_table_shards_must_agree(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", {"t.shard_0.weight": torch.zeros(4, 3),
                                                   "t.shard_1.weight": torch.zeros(4, 5),
                                                   "t.shard_2.weight": torch.zeros(6, 3)})
    with pytest.raises(PackError, match="5 columns, the first has 3"):
        RowTable([(tmp_path / "a.safetensors", "t.shard_0.weight"), (tmp_path / "a.safetensors", "t.shard_1.weight")])
    with pytest.raises(PackError, match="equal row counts"):
        RowTable([(tmp_path / "a.safetensors", "t.shard_0.weight"), (tmp_path / "a.safetensors", "t.shard_2.weight"),
                  (tmp_path / "a.safetensors", "t.shard_0.weight")])
