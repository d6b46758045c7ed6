"""fidelity.measuring.attribute on DeepSeek V3, V3.2, V4 and V4.1 packs in every layout the oracle reads (the five EXL3
seed layouts, FP8/MXFP4, native), against independent computations:

- the whole pack's KL equals KL(P_ref || Q_pack) computed here in float64 numpy from `Oracle(pack).logits` (the pack's
  own oracle: its names, its Engram table);
- a swap-one-in group's KL equals the same numpy KL of the oracle on a native pack written here: the reference's
  safetensors with that group's tensors replaced by the pack's decoded ones (V4.1's Engram group: its table too);
- re-running from a kept layer input with the reference's own tensors rebuilt gives the reference's logits bit for bit
  (torch.equal), on every block group: V4.1's cross-layer state (pools, selections, candidate blocks, carried pre) is
  the pass's state at that layer; a group whose pack tensors differ gives KL > 0.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from fidelity import open_pack
from fidelity.measuring.attribute import Settings, _variant, attribute
from fidelity.measuring.attribute_divergence import table_error
from fidelity.measuring.attribute_groups import module_groups
from fidelity.measuring.attribute_trunk import Reader, Trunk
from fidelity.errors import PackError
from fidelity.packs.exl3 import writer as minipacks
from fidelity.packs.exl3.encoder import EncodingCache
from testkit.minipacks_v4 import LAYOUTS, V4MiniSpec, write_all
from testkit.minipacks_v41 import V41_SPEC, build_native_v41, write_all_v41
from fidelity.oracle import Oracle
from fidelity.oracle.deepseek.engram import RowTable
from _deepseek_configs import reference_ties_to_lower_index  # noqa: F401 (autouse)

FIXTURES = Path(__file__).parent / "fixtures"
V3_NATIVE = FIXTURES / "exl3" / "tiny_deepseek"
V4_NATIVE = FIXTURES / "v4" / "tiny_v4"


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> dict[str, tuple[Path, dict[str, Path]]]:
    """generation -> (native, {layout: pack}), from the committed fixtures' encodings (no encoding here)."""
    root = tmp_path_factory.mktemp("deepseek_layouts")
    v3_cache = EncodingCache(FIXTURES / "exl3" / "tiny_deepseek_encodings.safetensors")
    v3 = minipacks.write_all(open_pack(V3_NATIVE), root / "v3", minipacks.MiniPackSpec(), v3_cache)
    cache = EncodingCache(FIXTURES / "v4" / "tiny_v4_encodings.safetensors")
    v4 = write_all(V4_NATIVE, root / "v4", V4MiniSpec(), cache)
    v41_native = build_native_v41(V4_NATIVE, root / "v41native")
    v41 = write_all_v41(v41_native, root / "v41", V41_SPEC, cache)
    assert v3_cache.misses == 0 and cache.misses == 0, "fixture encodings are stale"
    return {"v3": (V3_NATIVE, v3), "v4": (V4_NATIVE, v4), "v41": (v41_native, v41)}


def random_rows(vocab: int, seed: int, lengths=(40, 40, 27)) -> list[list[int]]:
    """Past V4's window (8) and V4.1's candidate blocks; two lengths, so two row batches."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def numpy_kl(ref_logits: list[np.ndarray], logits: list[np.ndarray]) -> float:
    """Mean over every position but each row's last of KL(P_ref || Q), float64 log-softmax."""
    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    kls = []
    for r, q in zip(ref_logits, logits):
        lp, lq = log_softmax(r[:-1].astype(np.float64)), log_softmax(q[:-1].astype(np.float64))
        kls.append((np.exp(lp) * (lp - lq)).sum(-1))
    return float(np.concatenate(kls).mean())


def oracle_logits(path: Path, rows: list[list[int]]) -> list[np.ndarray]:
    """Each row's logits from `Oracle(pack).logits`, rows of one length in one batch (as the oracle batches them: the
    float32 GEMMs then have the same shapes, so the logits are the same bits)."""
    oracle = Oracle(open_pack(path))
    out = {}
    for n in sorted({len(r) for r in rows}):
        idx = [i for i, r in enumerate(rows) if len(r) == n]
        logits = oracle.logits(torch.tensor([rows[i] for i in idx]))
        out.update({i: logits[j].numpy() for j, i in enumerate(idx)})
    return [out[i] for i in range(len(rows))]


def with_group_from_pack(native: Path, pack_path: Path, result, group: str, dst: Path) -> Path:
    """The native folder with `group`'s tensors replaced by the pack's decoded ones (float32, the reference's names;
    an Engram table from the pack's rows, into the native's Engram shard). The table's rows are read as the oracle
    reads them: where a layout's config declares ue8m0 scales, `pack.tensor` refuses the table's per-row fp32 scales."""
    shutil.copytree(native, dst)
    pack = open_pack(pack_path)
    in_group = {r["tensor"]: r["pack_tensor"] for r in result.tensors if r["tensor"] in group_names(native, group)}
    assert in_group and set(in_group) == set(group_names(native, group))
    for file in sorted(dst.glob("*.safetensors")):
        w = load_file(str(file))
        for name in [n for n in w if n in in_group]:
            w[name] = pack.tensor(in_group[name]).contiguous()
        table = [n for n in w if n.endswith(".engram.embed.weight") and n[:-len(".weight")] in in_group]
        for name in table:      # rows as the oracle reads them (RowTable), every row
            rows = RowTable.from_pack(pack, in_group[name[:-len(".weight")]])
            w[name] = rows.rows(torch.arange(rows.n_rows)).contiguous()
        save_file(w, str(file), metadata={"format": "pt"})
    return dst


def group_names(native: Path, group: str) -> list[str]:
    return module_groups(Oracle(open_pack(native)).family, "block")[group]


CASES = [("v3", layout) for layout in minipacks.LAYOUTS] + [
    (gen, layout) for gen in ("v4", "v41") for layout in LAYOUTS
]
# groups checked against a written native pack: a routed-experts group (EXL3 at mixed K), attention, and V4.1's Engram
CHECKED_GROUPS = {"v3": ("layers.1.experts", "layers.0.attention"), "v4": ("layers.1.experts", "layers.2.attention"),
                  "v41": ("layers.0.engram", "layers.1.experts", "layers.2.attention")}


@pytest.mark.slow
@pytest.mark.parametrize("gen,layout", CASES)
def test_attribute_every_layout_against_the_oracle(packs, gen, layout, tmp_path, rng_seed):
    native, by_layout = packs[gen]
    pack_path = by_layout[layout]
    vocab = json.loads((native / "config.json").read_text())["vocab_size"]
    rows = random_rows(vocab, rng_seed)
    res = attribute(native, pack_path, rows=rows, settings=Settings(noise_control=False, sensitivity=False))
    ref_logits = oracle_logits(native, rows)
    whole = numpy_kl(ref_logits, oracle_logits(pack_path, rows))
    print(f"{gen} {layout}: whole pack KL {res.summary['pack_kld_mean']:.6g} (numpy {whole:.6g}), additivity "
          f"{res.summary['additivity']:.3f}")
    assert whole > 0 and res.summary["pack_kld_mean"] == pytest.approx(whole, rel=1e-12)
    pack_names = set(open_pack(pack_path).names())
    assert all(r["pack_tensor"] in pack_names for r in res.tensors if ".engram.embed" not in r["tensor"])
    swaps = {r["group"]: r for r in res.swaps}
    for group in CHECKED_GROUPS[gen]:
        hybrid = with_group_from_pack(native, pack_path, res, group, tmp_path / group)
        want = numpy_kl(ref_logits, oracle_logits(hybrid, rows))
        print(f"  {group}: swap KL {swaps[group]['kld_mean']:.6g} (numpy on the written pack {want:.6g})")
        assert want > 0 and swaps[group]["kld_mean"] == pytest.approx(want, rel=1e-12)


def test_v41_exl3_attribute_reads_the_packs_names_and_engram_table(packs, rng_seed):
    """The issue's failure (`the pack has no tensor 'layers.0.attn_norm.weight'` on every EXL3 layout) and the Engram
    table: the whole pack's KL is its own oracle's, table included (a reference-table pass would differ)."""
    native, by_layout = packs["v41"]
    rows = random_rows(256, rng_seed, lengths=(33, 20))
    res = attribute(native, by_layout["exllamav3"], rows=rows,
                    settings=Settings(modules="layer", noise_control=True, noise_repeats=2, sensitivity=False))
    whole = numpy_kl(oracle_logits(native, rows), oracle_logits(by_layout["exllamav3"], rows))
    assert res.summary["pack_kld_mean"] == pytest.approx(whole, rel=1e-12)
    table = {r["tensor"]: r for r in res.tensors}["layers.0.engram.embed"]
    ref_t = open_pack(native).tensor("layers.0.engram.embed.weight").double()
    table_rows = RowTable.from_pack(open_pack(by_layout["exllamav3"]), "layers.0.engram.embed")
    pack_t = table_rows.rows(torch.arange(table_rows.n_rows)).double()
    assert table["err_norm"] == pytest.approx(float((pack_t - ref_t).norm()), rel=1e-12) and table["err_norm"] > 0
    err_rms = ((pack_t - ref_t).reshape(-1, 16) ** 2).mean(1).sqrt().numpy()
    w_max = ref_t.reshape(-1, 16).abs().amax(1).numpy()
    assert table["err_scale_corr"] == pytest.approx(np.corrcoef(err_rms, w_max)[0, 1], rel=1e-9)
    assert table["err_scale_groups"] == len(err_rms)
    in_chunks = table_error(RowTable.from_pack(open_pack(native), "layers.0.engram.embed"), table_rows, chunk_rows=7)
    assert in_chunks["err_norm"] == pytest.approx(table["err_norm"], rel=1e-12)
    assert in_chunks["err_scale_corr"] == pytest.approx(table["err_scale_corr"], rel=1e-9)
    layer0 = {r["group"]: r for r in res.swaps}["layers.0"]
    assert layer0["noise_kld_mean"] > 0 and len(layer0["noise_kld_each"]) == 2


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    """A tiny V3.2 (transformers, Hugging Face names) and a pack of it with the indexer under DeepSeek's official names
    (as the EXL3 layouts leave it) and every indexer weight changed."""
    import transformers as T

    from test_oracle_deepseek_v32 import BASE
    from test_oracle_support import build
    root = tmp_path_factory.mktemp("v32")
    build(T.DeepseekV32Config(**BASE), T.DeepseekV32ForCausalLM, root / "native", seed=20261205)
    shutil.copytree(root / "native", root / "pack")
    w = load_file(str(root / "pack" / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    out = {}
    for name, t in w.items():
        if ".self_attn.indexer." in name:
            layer = name.split(".")[2]
            name = name.replace(f"model.layers.{layer}.self_attn.indexer.", f"layers.{layer}.attn.indexer.")
            t = t * (1 + 0.2 * torch.randn(t.shape, generator=g))
        out[name] = t.contiguous()
    save_file(out, str(root / "pack" / "model.safetensors"), metadata={"format": "pt"})
    return root / "native", root / "pack"


def test_v32_official_indexer_names_are_swapped_in(v32, rng_seed):
    native, pack = v32
    rows = random_rows(89, rng_seed, lengths=(36, 30))
    res = attribute(native, pack, rows=rows, settings=Settings(noise_control=False, sensitivity=False))
    assert res.summary["pack_kld_mean"] == pytest.approx(numpy_kl(oracle_logits(native, rows),
                                                                  oracle_logits(pack, rows)), rel=1e-12)
    swaps = {r["group"]: r for r in res.swaps}
    assert all(swaps[f"layers.{i}.attention"]["kld_mean"] > 0 for i in range(3))
    assert all(swaps[g]["identical"] for g in swaps if not g.endswith(".attention"))
    mapped = {r["tensor"]: r["pack_tensor"] for r in res.tensors}
    assert mapped["model.layers.1.self_attn.indexer.wk.weight"] == "layers.1.attn.indexer.wk.weight"


def reference_trunk(native: Path, rows, keep_layers: bool):
    ref = open_pack(native)
    oracle = Oracle(ref)
    trunk = Trunk(oracle, rows, [torch.arange(len(r) - 1) for r in rows], keep_layers)
    trunk.reference_pass()
    return ref, oracle.family, trunk


@pytest.mark.parametrize("gen", ["v3", "v32", "v4", "v41"])
@pytest.mark.parametrize("keep_layers", [False, True])
def test_swap_of_an_unchanged_module_is_the_reference_bit_for_bit(packs, v32, gen, keep_layers, rng_seed):
    """Every block group re-run from its first layer's kept input (and pass state) with the reference's own tensors
    read again: torch.equal to the reference pass's logits. The control: the same re-run with the FP8 / official-name
    pack's tensors for that group differs (KL > 0) wherever the pack's tensors do."""
    native, control = {"v3": (V3_NATIVE, packs["v3"][1]["exl3-mixed"]), "v32": v32,
                       "v4": (V4_NATIVE, packs["v4"][1]["fp8-mxfp4"]),
                       "v41": (packs["v41"][0], packs["v41"][1]["fp8-mxfp4"])}[gen]
    vocab = json.loads((native / "config.json").read_text())["vocab_size"]
    rows = random_rows(vocab, rng_seed, lengths=(40, 40, 23))
    ref, fam, trunk = reference_trunk(native, rows, keep_layers)
    groups = module_groups(fam, "block")
    res = attribute(native, control, rows=rows, settings=Settings(noise_control=False, sensitivity=False))
    changed = {r["group"] for r in res.swaps if not r["identical"]}
    assert len(changed) >= 3
    names_in_pack = {r["tensor"]: r["pack_tensor"] for r in res.tensors}
    pack = open_pack(control)
    for group, names in groups.items():
        same = _variant(trunk, fam, names, Reader(ref, ref, swapped=names))
        assert all(torch.equal(a, b) for a, b in zip(same, trunk.ref_logits)), (gen, group)
        if group in changed:
            tables = {0: Oracle(pack).family.table(0)} if group == "layers.0.engram" else None
            other = _variant(trunk, fam, names, Reader(ref, pack, swapped=names, names=names_in_pack, tables=tables))
            assert trunk.kld(other) > 0, (gen, group)


def test_a_pack_of_another_model_is_refused(packs):
    """A V4 pack against the V4.1 reference: the two oracles read different tensors, named in the error."""
    with pytest.raises(PackError, match="the pack's oracle reads .* tensors, the reference's"):
        attribute(packs["v41"][0], V4_NATIVE, rows=[[5, 6, 7, 8]],
                  settings=Settings(noise_control=False, sensitivity=False))
