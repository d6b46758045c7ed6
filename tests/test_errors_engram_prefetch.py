"""Bad Engram tables and wiring (fidelity.oracle.deepseek.engram, the V4.1 family's table/tokenizer reads) and a failing
layer load under the prefetcher (fidelity.oracle.parallel.Prefetcher): each error names the layer, tensor and file. Tiny
V4.1 packs from test_oracle_deepseek_v41's `write_pack`."""
from __future__ import annotations

import pytest
import torch
import transformers as T

from fidelity import open_pack
from fidelity.oracle.parallel import Prefetcher
from fidelity.errors import FidelityError, PackError
from fidelity.oracle import LoadChain, Oracle, family_for
from fidelity.oracle.deepseek.engram import RowTable
from fidelity.packs.safetensors_io import write_safetensors
from test_oracle import COMMON
from test_oracle_deepseek_v41 import base_config, write_pack
from test_oracle_support import build

TABLE = "layers.0.engram.embed.weight"
WKV = "layers.0.engram.wkv.weight"


ROWS = base_config()["engram_num_embeddings"][0]     # layer 0's table rows in the tiny V4.1 config


def tokens(g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, base_config()["vocab_size"], (1, 6), generator=g)


# ---------------------------------------------------------------------------------------------------------------------
# the V4.1 family's reads
# ---------------------------------------------------------------------------------------------------------------------
def test_engram_layer_without_a_bound_pack(tmp_path, rng_seed):
    """A bare family (family_for, no Oracle) has no pack to read tokenizer.json or the table from; binding the pack
    is what it lacked."""
    pack = open_pack(write_pack(tmp_path / "p", base_config(), rng_seed))
    fetch = Oracle(pack).fetch
    fam = family_for(pack.config)
    fam.resolve_names(pack.names())
    with pytest.raises(PackError, match=r"Engram layers read tokenizer\.json from the pack, but no pack is bound"):
        fam.load_layer(0, fetch)
    with pytest.raises(PackError, match=r"Engram layer 0 reads its table from the pack, but no pack is bound"):
        fam.table(0)
    fam.bind_pack(pack)
    assert fam.load_layer(0, fetch).engram.table.n_rows == ROWS


def test_table_width_against_wkv(tmp_path, rng_seed):
    """Rows of the wrong width for wkv (4 heads x 8 = 32 inputs): the error names the layer, both widths, wkv and the
    table's file."""
    g = torch.Generator().manual_seed(rng_seed)
    root = write_pack(tmp_path / "p", base_config(), rng_seed)
    width = int(torch.randint(1, 8, (1,), generator=g)) * 2 - 1     # odd: never 8
    rows = ROWS
    write_safetensors(root / "model-engram.safetensors", {TABLE: torch.randn(rows, width, generator=g)})
    with pytest.raises(PackError, match=rf"Engram layer 0: 4 heads x table rows of {width} \(the table in "
                                        rf".*model-engram\.safetensors\) do not match wkv's input width 32") as err:
        Oracle(open_pack(root)).logits(tokens(g))
    assert err.value.tensor == WKV


def test_pack_without_the_table(tmp_path, rng_seed):
    root = write_pack(tmp_path / "p", base_config(), rng_seed, tables=False)
    oracle = Oracle(open_pack(root))             # the table is read when layer 0 loads, not at open
    with pytest.raises(PackError, match=rf"pack has no Engram table {TABLE} or layers\.0\.engram\.embed\.shard_0"
                                        rf"\.weight") as err:
        oracle.logits(tokens(torch.Generator().manual_seed(rng_seed)))
    assert err.value.tensor == TABLE and err.value.file == str(root)


def test_table_in_a_format_without_row_reads(tmp_path, rng_seed):
    """An MXFP4 table (DeepSeek's official FP4 form: packed bytes + e8m0 scales per 32 columns) is a tensor the pack
    decodes, but its rows cannot be read one by one: refused naming the format, the table and the pack."""
    g = torch.Generator().manual_seed(rng_seed)
    root = write_pack(tmp_path / "p", base_config(), rng_seed)
    rows, dim = ROWS, base_config()["engram_head_dim"]
    packed = torch.randint(0, 256, (rows, dim // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 130, (rows, 1), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    write_safetensors(root / "model-engram.safetensors", {TABLE: packed, "layers.0.engram.embed.scale": scales})
    pack = open_pack(root)
    assert pack.storage(TABLE).format == "mxfp4" and pack.tensor(TABLE).shape == (rows, dim)
    with pytest.raises(PackError, match=r"Engram table stored as mxfp4 \(MXFP4\) cannot be read row by row") as err:
        Oracle(pack).logits(tokens(g))
    assert err.value.tensor == TABLE and err.value.file == str(root)


@pytest.mark.parametrize("table, shown", [
    (torch.zeros(12), r"F32 \[12\]"),
    (torch.zeros(2, 6, 4, dtype=torch.bfloat16), r"BF16 \[2, 6, 4\]"),
    (torch.zeros(6, 4, dtype=torch.float64), r"F64 \[6, 4\]"),
    (torch.zeros(6, 4, dtype=torch.int8), r"I8 \[6, 4\]"),
])
def test_table_rank_and_dtype(tmp_path, table, shown):
    write_safetensors(tmp_path / "t.safetensors", {TABLE: table})
    with pytest.raises(PackError, match=rf"an Engram table must be a 2-D F32/F16/BF16 tensor or FP8 with scales, "
                                        rf"found {shown}") as err:
        RowTable([(tmp_path / "t.safetensors", TABLE)])
    assert err.value.tensor == TABLE and err.value.file == str(tmp_path / "t.safetensors")


# ---------------------------------------------------------------------------------------------------------------------
# the prefetcher
# ---------------------------------------------------------------------------------------------------------------------
def test_prefetch_failure_names_the_failed_layer_and_stops_the_queue(tmp_path, rng_seed):
    """Layer k's read fails: the forward raises that error (its tensor named), the load queued behind it reads nothing
    and, asked for, names itself and layer k; the next pass, the read fixed, gives the plain oracle's numbers."""
    n = 4
    g = torch.Generator().manual_seed(rng_seed)
    build(T.LlamaConfig(**{**COMMON, "num_hidden_layers": n, "tie_word_embeddings": False}), T.LlamaForCausalLM,
          tmp_path / "m", rng_seed)
    pack = open_pack(tmp_path / "m")
    x = torch.randint(0, COMMON["vocab_size"], (2, 7), generator=g)
    want = Oracle(pack).logits(x)
    k = int(torch.randint(0, n - 1, (1,), generator=g))
    read, asked, broken = pack.tensor, [], [True]

    def tensor(name: str) -> torch.Tensor:
        asked.append(name)
        if broken[0] and name.startswith(f"model.layers.{k}."):
            raise PackError("read failed: Input/output error", file=tmp_path / "m" / "model.safetensors", tensor=name)
        return read(name)
    pack.tensor = tensor
    oracle = Oracle(pack, chain=LoadChain(prefetch=Prefetcher))
    with pytest.raises(PackError, match=rf"Input/output error \[tensor 'model\.layers\.{k}\.") as err:
        oracle.logits(x)
    assert err.value.tensor.startswith(f"model.layers.{k}.")
    later = [name for name in asked if any(name.startswith(f"model.layers.{j}.") for j in range(k + 1, n))]
    assert later == []                              # layer k + 1's load was queued but read nothing
    with pytest.raises(FidelityError, match=rf"^layer {k + 1} was not loaded: loading layer {k} failed first$"):
        oracle.load_layer(k + 1)
    broken[0] = False
    assert torch.equal(oracle.logits(x), want)


@pytest.mark.parametrize("where", ["negative", "past the end"])
def test_row_outside_the_table_is_the_one_named(tmp_path, rng_seed, where):
    """A negative row or one past the end is named itself, not the largest row asked for."""
    g = torch.Generator().manual_seed(rng_seed)
    rows = int(torch.randint(5, 40, (1,), generator=g))
    write_safetensors(tmp_path / "t.safetensors", {TABLE: torch.randn(rows, 3, generator=g)})
    table = RowTable([(tmp_path / "t.safetensors", TABLE)])
    step = int(torch.randint(0, 9, (1,), generator=g))
    wrong = -1 - step if where == "negative" else rows + step
    with pytest.raises(
        PackError, match=rf"^Engram row {wrong} outside the table's {rows} rows \[file .*t\.safetensors"
    ):
        table.rows(torch.tensor([[1, wrong], [rows - 1, 0]]))
