"""fidelity.measuring.attribute on real SmolLM2-135M-Instruct: overlay packs whose only changes are whole layers' MLPs
decoded from the Q2_K GGUF (the demo's llama-quantize file type), the rest the native fp32 pack."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fidelity import open_pack
from fidelity.measuring.attribute import Settings, attribute
from fidelity.commands.demo import build_demo_packs
from fidelity.oracle import Oracle
from fidelity.packs.safetensors_io import write_safetensors

pytestmark = pytest.mark.slow

N_LAYERS = 30


@pytest.fixture(scope="module")
def packs(tmp_path_factory, smollm2_gguf):
    # one cache per test session, shared with test_demo.py / test_compare_smollm2.py
    return build_demo_packs(tmp_path_factory.getbasetemp() / "fidelity_cache" / "demo", formats=("Q2_K",))


def mlp_overlay(folder, native, q2k_pack, layers):
    """An overlay over the native pack holding layers' gate/up/down projections as the Q2_K GGUF decodes them."""
    folder.mkdir()
    names = [f"model.layers.{i}.mlp.{p}.weight" for i in layers for p in ("gate_proj", "up_proj", "down_proj")]
    write_safetensors(folder / "build.safetensors", {n: q2k_pack.tensor(n) for n in names})
    (folder / "fidelity_overlay.json").write_text(json.dumps({"base": str(native)}))
    return open_pack(folder)


@pytest.fixture(scope="module")
def rows(rng_seed_module):
    g = torch.Generator().manual_seed(rng_seed_module)
    return torch.randint(0, 49152, (4, 48), generator=g).tolist()


@pytest.fixture(scope="module")
def rng_seed_module():
    import os
    seed = int(os.environ.get("FIDELITY_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"random seed {seed}")
    return seed


def test_one_replaced_mlp_gets_the_whole_share_and_the_oracle_kl(packs, rows, rng_seed_module, tmp_path):
    native = open_pack(packs["native"])
    q2k = open_pack(packs["Q2_K"])
    k = 3 + rng_seed_module % (N_LAYERS - 6)
    pack = mlp_overlay(tmp_path / "one", packs["native"], q2k, [k])
    res = attribute(native, pack, rows=rows, settings=Settings(sensitivity=False, noise_repeats=3,
                                                                activation_control=True))
    by = {r["group"]: r for r in res.swaps}
    top = max(res.swaps, key=lambda r: r["share"])
    print(f"layer {k} MLP from Q2_K: KL {by[f'layers.{k}.mlp']['kld_mean']:.6g}, noise control "
          f"{by[f'layers.{k}.mlp']['noise_kld_mean']:.6g}, x noise {by[f'layers.{k}.mlp']['x_noise']:.3g}")
    assert top["group"] == f"layers.{k}.mlp" and top["share"] == 1.0
    # the swap's KL is the overlay pack's KL, computed here by two plain oracles and textbook log_softmax
    tokens = torch.tensor(rows)
    lp = torch.log_softmax(Oracle(native).logits(tokens)[:, :-1].reshape(-1, 49152).double(), -1)
    lq = torch.log_softmax(Oracle(pack).logits(tokens)[:, :-1].reshape(-1, 49152).double(), -1)
    want = float((lp.exp() * (lp - lq)).sum(-1).mean())
    assert by[f"layers.{k}.mlp"]["kld_mean"] == pytest.approx(want, rel=1e-6)
    assert res.summary["pack_kld_mean"] == pytest.approx(want, rel=1e-6)
    assert res.summary["additivity"] == pytest.approx(1.0, rel=1e-12)
    # layer divergence: nothing before layer k, then the error from there on
    layers = {r["layer"]: r for r in res.layers}
    assert all(layers[i]["rel_fro"] == 0.0 for i in range(-1, k)) and layers[k]["rel_fro"] > 0
    # Separating the real error from its isotropic control of the same weight-error norm. By KL it is not reliably
    # separable, and the ratio depends on the layer and the rows: measured x_noise 0.35-1.28 over layers 3-26 and three
    # row draws (4 random-token rows of 48, 3 draws; layer 11 is 0.35 for every row draw: Q2_K's error there is a third
    # as harmful as noise of its norm, interval [0.30, 0.40]; layer 8 went from 0.46 to 1.22 between two row draws).
    # So the band only checks the control's scale: KL is quadratic in the error, so a control whose norm were off by
    # 2.3x would put the ratio outside (1/5, 5). By structure it separates: the error's RMS over 16-weight groups
    # follows
    # the group's max |w| (Q2_K's sub-block scale), r 0.52-0.62 pooled over the three projections (z 211-252), while the
    # control's |z| <= 1.8 (null: N(0, 1)).
    row = by[f"layers.{k}.mlp"]
    ratio, (lo, hi) = row["x_noise"], row["x_noise_ci"]
    print(f"x_noise CI [{lo:.3f}, {hi:.3f}] ({row['kl_vs_noise']}); err_scale_corr {row['err_scale_corr']:.4f} "
          f"z {row['err_scale_z']:.1f}; control z {row['noise_err_scale_z']:.2f}")
    assert row["noise_kld_mean"] == pytest.approx(np.mean(row["noise_kld_each"]), rel=1e-12)
    assert ratio == pytest.approx(row["kld_mean"] / row["noise_kld_mean"], rel=1e-12)
    assert len(set(row["noise_kld_each"])) == 3 and min(row["noise_kld_each"]) > 0      # three draws, each its own
    assert 1 / 5 < ratio < 5 and lo < ratio < hi, (ratio, lo, hi)
    assert row["kl_vs_noise"] == ("more harmful" if lo > 1 else "less harmful" if hi < 1 else "not separable")
    stats = []
    for p in ("gate_proj", "up_proj", "down_proj"):             # numpy on the two packs' tensors
        n = f"model.layers.{k}.mlp.{p}.weight"
        w = native.tensor(n).double().numpy()
        d = q2k.tensor(n).double().numpy() - w
        e, m = np.sqrt((d.reshape(-1, 16) ** 2).mean(1)), np.abs(w.reshape(-1, 16)).max(1)
        stats.append((np.corrcoef(e, m)[0, 1], e.size))
        assert {r["tensor"]: r for r in res.tensors}[n]["err_scale_corr"] == pytest.approx(stats[-1][0], rel=1e-9)
    s, n = sum(r * c for r, c in stats), sum(c for _, c in stats)
    assert row["err_scale_corr"] == pytest.approx(s / n, rel=1e-9) and row["err_scale_z"] == pytest.approx(
        s / np.sqrt(n), rel=1e-9)
    assert row["err_scale_corr"] > 0.4 and row["err_scale_z"] > 150 and abs(row["noise_err_scale_z"]) < 4.5
    # exllamav3's activation-space control (noise of the error's per-position norm at layer k's output): measured real /
    # control 0.72-1.92 over the same layers and row draws; it does not separate every layer either. The band again
    # checks only the control's scale
    print(f"x act {row['x_act']:.3f} CI {row['x_act_ci']} ({row['kl_vs_act']})")
    assert row["x_act"] == pytest.approx(row["kld_mean"] / np.mean(row["act_kld_each"]), rel=1e-12)
    assert 1 / 5 < row["x_act"] < 5 and len(row["act_kld_each"]) == 3 and min(row["act_kld_each"]) > 0

def test_two_replaced_mlps_add_up(packs, rows, rng_seed_module, tmp_path):
    native = open_pack(packs["native"])
    q2k = open_pack(packs["Q2_K"])
    a = 2 + rng_seed_module % 12
    b = a + 6 + (rng_seed_module // 12) % 10
    pack = mlp_overlay(tmp_path / "two", packs["native"], q2k, [a, b])
    res = attribute(native, pack, rows=rows, settings=Settings(sensitivity=False, noise_control=False))
    by = {r["group"]: r for r in res.swaps}
    ka, kb, whole = by[f"layers.{a}.mlp"]["kld_mean"], by[f"layers.{b}.mlp"]["kld_mean"], res.summary["pack_kld_mean"]
    print(f"layers {a} and {b}: KL {ka:.6g} + {kb:.6g} = {ka + kb:.6g} vs both {whole:.6g}: additivity "
          f"{res.summary['additivity']:.4f}")
    assert res.summary["additivity"] == pytest.approx((ka + kb) / whole, rel=1e-12)
    # Measured (sum of the two layers' KL) / (both at once) on this machine: 0.950-1.054 over 31 random seeds (26 pairs
    # a,
    # b drawn as above), 0.974-1.071 for layers 3 and 14 over 4 other row draws, but 1.242 for seed 229004941 (layers 3
    # and 14; 1.33 reported from another run): the outlier comes from that seed's 192 random-token positions, not the
    # layer pair. The band is symmetric in log ratio (1/1.5, 1.5) and still fails a ratio of 2 or 0.5.
    assert 1 / 1.5 < res.summary["additivity"] < 1.5
    assert sorted(r["group"] for r in res.swaps if r["kld_mean"] > 0) == sorted([f"layers.{a}.mlp", f"layers.{b}.mlp"])
