"""DeepSeek-V4.1's Engram layer and DSpark drafter against DeepSeek's own upstream `inference/model.py`, on the dumps an
independent project made of it (../shared/golden/deepseek_v41: engram_module.json, dspark_forward.json; its README
says how). The fixtures are read where they lie; the tests skip when they are absent.

- Engram: our `EngramLayer` built from each case's table (written as a BF16 safetensors tensor and read back through
  `RowTable`), wkv, q/k norm weights, given the case's already hashed rows, its input streams and token mask.
- DSpark: our `DSparkDrafter` over the V4.1 pack of model_forward.json + the dump's `mtp.*` tensors
  (`_upstream_v41.write_upstream_pack`), fed the dump's `main_hidden` (the target rows upstream produced), under
  numerics "deepseek" (its window KV rounded to FP8 as upstream rounds it).
"""
from __future__ import annotations

import json

import pytest
import torch

from _upstream_v41 import GOLDEN
from fidelity.oracle.deepseek.engram import EngramArgs, EngramLayer, RowTable
from fidelity.packs.safetensors_io import write_safetensors

ENGRAM = GOLDEN / "engram_module.json"
ENGRAM_BOUND = 1e-6      # max |ours - upstream| / max |upstream y|, per case


def missing(path):
    return pytest.mark.skipif(not path.is_file(), reason=f"missing data: {path} (../shared/golden)")


# ---------------------------------------------------------------------------------------------------------------------
# Engram
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engram_cases() -> list[dict]:
    return json.loads(ENGRAM.read_text())["cases"]


def engram_layer(case: dict, folder, eps: float | None = None) -> EngramLayer:
    """Our layer on the case's weights; its table stored as BF16 (the dump's table is bf16-valued) and read row by row."""
    hc, dim = case["hc"], case["dim"]
    table = torch.tensor(case["table"]).view(case["rows"], case["headDim"])
    assert torch.equal(table.bfloat16().float(), table)
    path = folder / f"engram_{case['name']}.safetensors"
    write_safetensors(path, {"engram.embed.weight": table.bfloat16()})
    heads = case["cols"]
    # the dump hashes nothing (its rows are given): the hashing fields below only describe a table of that many rows
    a = EngramArgs(layer=1, ngram_size=3, heads_per_ngram=heads // 2, head_sizes=[case["rows"] // heads] * heads,
                   multipliers=[1, 1, 1], pad_id=0, hc_mult=hc, hidden_size=dim,
                   eps=case["eps"] if eps is None else eps)
    wkv = torch.tensor(case["wkv"]).view((hc + 1) * dim, heads * case["headDim"])
    return EngramLayer(a, RowTable([(str(path), "engram.embed.weight")]), wkv, torch.tensor(case["kWeight"]),
                       torch.tensor(case["qWeight"]))


def engram_error(case: dict, layer: EngramLayer, use_mask: bool = True) -> float:
    T, hc, dim = case["tokens"], case["hc"], case["dim"]
    x = torch.tensor(case["x"]).view(1, T, hc, dim)
    rows = torch.tensor(case["hashIds"]).view(1, T, case["cols"])
    mask = None if case["mask"] is None or not use_mask else torch.tensor(case["mask"]).view(1, T)
    got = layer.from_rows(x, rows, mask)
    want = torch.tensor(case["y"]).view(1, T, hc, dim)
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


@missing(ENGRAM)
@pytest.mark.parametrize("name", ["plain", "masked", "hc4"])
def test_engram_layer_reproduces_upstream(engram_cases, name, tmp_path):
    case = next(c for c in engram_cases if c["name"] == name)
    err = engram_error(case, engram_layer(case, tmp_path))
    print(f"{name}: max |d| / max |y| = {err:.3g}")
    assert err <= ENGRAM_BOUND


@missing(ENGRAM)
def test_engram_controls_depart(engram_cases, tmp_path):
    """The bound separates: the normalisation eps 1e-6 -> 1e-2, or the token mask ignored, moves the output far past it."""
    for case in engram_cases:
        err = engram_error(case, engram_layer(case, tmp_path, eps=1e-2))
        print(f"{case['name']} eps 1e-2: {err:.3g}")
        assert err > 100 * ENGRAM_BOUND
    for case in (c for c in engram_cases if c["mask"] is not None):
        err = engram_error(case, engram_layer(case, tmp_path), use_mask=False)
        print(f"{case['name']} mask ignored: {err:.3g}")
        assert err > 0.1
