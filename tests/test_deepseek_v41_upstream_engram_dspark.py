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

import dataclasses
import json

import pytest
import torch

from _upstream_v41 import GOLDEN, write_upstream_pack
from fidelity import open_pack
from fidelity.errors import FidelityError
from fidelity.oracle import Oracle
from fidelity.oracle.deepseek.engram import EngramArgs, EngramLayer, RowTable
from fidelity.oracle.deepseek.mtp import DSparkDrafter, acceptance
from fidelity.oracle.deepseek.quant import DeepSeekRounding
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
    """Our layer on the case's weights; its table stored as BF16 (the dump's table is bf16-valued) and read row by
    row."""
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
    """The bound separates: the normalisation eps 1e-6 -> 1e-2, or the token mask ignored, moves the output far past
    it."""
    for case in engram_cases:
        err = engram_error(case, engram_layer(case, tmp_path, eps=1e-2))
        print(f"{case['name']} eps 1e-2: {err:.3g}")
        assert err > 100 * ENGRAM_BOUND
    for case in (c for c in engram_cases if c["mask"] is not None):
        err = engram_error(case, engram_layer(case, tmp_path), use_mask=False)
        print(f"{case['name']} mask ignored: {err:.3g}")
        assert err > 0.1


# ---------------------------------------------------------------------------------------------------------------------
# DSpark
# ---------------------------------------------------------------------------------------------------------------------
DSPARK = GOLDEN / "dspark_forward.json"
TRUNK = GOLDEN / "model_forward.json"
DSPARK_BOUND = 1e-5      # max |ours - upstream| / max |upstream|, per seed position, logits and confidences alike
SEEDS = list(range(11, 17))


@pytest.fixture(scope="module")
def dspark() -> dict:
    return json.loads(DSPARK.read_text())


@pytest.fixture(scope="module")
def dspark_pack(tmp_path_factory):
    return write_upstream_pack(TRUNK, tmp_path_factory.mktemp("upstream_v41_dspark"), with_mtp=True)


def dspark_errors(dspark: dict, out) -> list[dict]:
    """Per seed position: the draft ids (seed first, as upstream lists them) equal?, and the relative errors of the
    Markov-biased logits and of the confidences."""
    rel = lambda got, want: float((got.double() - want.double()).abs().max() / want.double().abs().max())  # noqa: E731
    errs = []
    for i, pos in enumerate(out.starts):
        want = dspark["drafts"][str(pos)]
        block = dspark["block_size"]
        errs.append({"pos": pos, "ids": [dspark["ids"][pos]] + out.drafts[0, i].tolist() == want["ids"],
                     "logits": rel(out.biased_logits[0, i], torch.tensor(want["logits"]).view(block, -1)),
                     "confidence": rel(out.confidence[0, i], torch.tensor(want["confidence"]))})
    return errs


def upstream_rows(dspark: dict) -> tuple[torch.Tensor, torch.Tensor]:
    T = len(dspark["ids"])
    return torch.tensor([dspark["ids"]]), torch.tensor(dspark["main_hidden"]).view(1, T, dspark["main_hidden_width"])


def draft_upstream_rows(pack_dir, dspark: dict, numerics: str = "deepseek", rounding=None):
    drafter = DSparkDrafter(Oracle(open_pack(pack_dir), numerics=numerics))
    if rounding is not None:
        drafter.rounding = rounding(drafter.rounding)
    tokens, main_hidden = upstream_rows(dspark)
    return dspark_errors(dspark, drafter.draft_on(tokens, main_hidden, SEEDS))


def worst(errs: list[dict]) -> float:
    return max(max(e["logits"], e["confidence"]) for e in errs)


@missing(DSPARK)
@missing(TRUNK)
def test_dspark_reproduces_upstream_drafts(dspark, dspark_pack):
    """Fed upstream's own main_hidden (positions 12-16 carry upstream's decode-path rows, model_forward's README; the
    drafter reads them as given), every seed position's drafts, biased logits and confidences are upstream's."""
    errs = draft_upstream_rows(dspark_pack, dspark)
    for e in errs:
        print(e)
    assert all(e["ids"] for e in errs)
    assert worst(errs) <= DSPARK_BOUND


@missing(DSPARK)
@missing(TRUNK)
def test_dspark_acceptance_needs_the_trunks_logits(dspark, dspark_pack):
    tokens, main_hidden = upstream_rows(dspark)
    drafter = DSparkDrafter(Oracle(open_pack(dspark_pack), numerics="deepseek"))
    with pytest.raises(FidelityError, match="acceptance needs the trunk's logits"):
        acceptance(drafter.draft_on(tokens, main_hidden, [11]))
    with pytest.raises(FidelityError, match=r"main_hidden must be \[1, 17, 48\].*got \[1, 17, 32\]"):
        drafter.draft_on(tokens, main_hidden[..., :32], [11])


@missing(DSPARK)
@missing(TRUNK)
def test_dspark_over_our_trunk_at_the_first_decode_position(dspark, dspark_pack):
    """Our trunk's own taps at seed 11 (where upstream's decode path still equals a one-pass forward): the same
    drafts."""
    tokens, _ = upstream_rows(dspark)
    out = DSparkDrafter(Oracle(open_pack(dspark_pack), numerics="deepseek")).draft(tokens, [11])
    errs = dspark_errors(dspark, out)
    print(errs)
    assert errs[0]["ids"] and worst(errs) <= DSPARK_BOUND


@dataclasses.dataclass(frozen=True)
class WindowKvOff(DeepSeekRounding):
    """The V4.1 rounding with the window KV's switched off (the control)."""

    @classmethod
    def of(cls, rounding: DeepSeekRounding) -> "WindowKvOff":
        return cls(**{f.name: getattr(rounding, f.name) for f in dataclasses.fields(rounding)})

    def window_kv(self, kv, rope_dim):
        return kv


@missing(DSPARK)
@missing(TRUNK)
def test_dspark_controls_depart(dspark, dspark_pack, tmp_path):
    """The bound separates: without the window KV's FP8 rounding (the drafter's only rounding on float32 weights), with
    numerics exact, or with one config field changed (the sliding window 8 -> 7), the drafts move far past it."""
    for label, errs in [
        ("window KV not rounded", draft_upstream_rows(dspark_pack, dspark, rounding=WindowKvOff.of)),
        ("numerics exact", draft_upstream_rows(dspark_pack, dspark, numerics="exact")),
        (
            "sliding_window 7",
            draft_upstream_rows(
                write_upstream_pack(TRUNK, tmp_path / "window7", with_mtp=True, sliding_window=7), dspark
            ),
        ),
    ]:
        print(label, [f"{e['logits']:.2g}/{e['confidence']:.2g}" for e in errs])
        assert worst(errs) > 100 * DSPARK_BOUND


@missing(DSPARK)
@missing(TRUNK)
def test_dspark_rounds_the_inputs_of_its_fp8_stored_linears(dspark, tmp_path):
    """Under numerics deepseek the drafter rounds a linear's input to FP8 (blocks of 32) exactly where the pack stores
    that weight FP8, as the trunk does: main_proj here (its output checked against the formula on the pack's own decoded
    weight) and block 1's wq_b, read under the block's own name; float32 weights (every other one) get none."""
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file
    from testkit.minipacks_v4 import FP8_QC, fp8_ue8m0
    from fidelity.oracle.common import rms_norm
    from fidelity.oracle.deepseek.quant import fake_fp8
    folder = write_upstream_pack(TRUNK, tmp_path / "fp8", with_mtp=True,
                                 quantization_config={**FP8_QC, "weight_block_size": [16, 16]})
    tensors = load_file(folder / "model.safetensors")
    for name in ("mtp.0.main_proj.weight", "mtp.1.attn.wq_b.weight"):
        tensors[name], tensors[name.removesuffix("weight") + "scale"] = fp8_ue8m0(tensors[name], 16)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    pack = open_pack(folder)
    drafter = DSparkDrafter(Oracle(pack, numerics="deepseek"))
    assert [drafter.block_rounding(i).rounds_input("layers.0.attn.wq_b.weight") for i in range(3)] == [
        False,
        True,
        False,
    ]
    assert not drafter.block_rounding(1).rounds_input("layers.0.attn.wq_a.weight")
    _, main_hidden = upstream_rows(dspark)
    weight, norm = pack.tensor("mtp.0.main_proj.weight"), pack.tensor("mtp.0.main_norm.weight")
    want = rms_norm(F.linear(fake_fp8(main_hidden[0], 32), weight), norm, 1e-6)
    assert torch.equal(drafter.main_x(main_hidden[0]), want)
    unrounded = rms_norm(F.linear(main_hidden[0], weight), norm, 1e-6)
    assert (unrounded - want).abs().max() > 1e-3
    assert torch.equal(DSparkDrafter(Oracle(pack)).main_x(main_hidden[0]), unrounded)   # exact: none
