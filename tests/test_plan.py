"""fidelity plan (fidelity/plan.py, fidelity/commands/plan.py): the planner against brute force, its byte arithmetic
against the encoder's stored tensors and a written pack's own bits_per_weight, its refusals, and the proof on a real
encode (slow): on the tiny DeepSeek-V4.1, the plan's pack vs the uniform-K pack of the same bytes, compared on a
held-out panel."""
from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from fidelity.errors import ConfigError
from fidelity.plan import (Budget, Constraints, ErrorTable, Evidence, ExpertTensor, RateModel, exl3_nbytes, make_plan,
                           parse_min_k, sensitivity_draws)

V4 = Path(__file__).parent / "fixtures" / "v4"
PLAN_ENCODINGS = V4 / "tiny_v4_plan_encodings.safetensors"


# -- synthetic instances ----------------------------------------------------------------------------------------------
def instance(rng: np.random.Generator, n_layers=2, n_experts=3, per_tensor=False, candidates=(1, 2, 3, 4)):
    """Random shapes, sensitivities, shares and per-K errors (decreasing in K, not always convex)."""
    shapes = [(64, 64), (200, 96), (130, 260), (128, 384)]
    tensors, errs = [], {}
    for L in range(n_layers):
        for e in range(n_experts):
            for role in ("gate", "up", "down"):
                shape = shapes[int(rng.integers(len(shapes)))]
                t = ExpertTensor(f"layers.{L}.mlp.experts.{e}.{role}_proj.weight", L, e, role, shape)
                tensors.append(t)
                e1 = float(rng.uniform(0.1, 0.4))
                drops = rng.uniform(1.5, 6.0, len(candidates))
                for K, d in zip(candidates, np.cumprod(drops)):
                    errs[(t.name, K)] = e1 * 4.0 / d
    sens = {L: float(rng.lognormal(0, 1.5)) for L in range(n_layers)}
    energy = {}
    token = {}
    for L in range(n_layers):
        w = rng.dirichlet(np.ones(n_experts) * 0.7)
        energy.update({(L, e): float(w[e]) for e in range(n_experts)})
        c = rng.dirichlet(np.ones(n_experts)) * 2
        token.update({(L, e): float(c[e]) for e in range(n_experts)})
    supers = {L: [e for e in range(n_experts) if energy[(L, e)] >= 0.2] for L in range(n_layers)}
    return tensors, Evidence(sens, energy, token, supers), ErrorTable(errs)


def unit_key(t: ExpertTensor, per_tensor: bool):
    return (t.layer, t.expert) + ((t.role,) if per_tensor else ())


def written_out_kl(k: dict, tensors, ev: Evidence, errs: ErrorTable) -> float:
    """sum over tensors of S_L * energy share * e_t(K), written out."""
    return sum(ev.sensitivity[t.layer] * ev.energy_share[(t.layer, t.expert)] * errs.measured[(t.name, k[t.name])]
               for t in tensors)


def cost_bpw(k: dict, tensors, ev: Evidence, per_token: bool) -> float:
    w = {t.name: ev.token_share[(t.layer, t.expert)] if per_token else 1.0 for t in tensors}
    bytes_ = sum(w[t.name] * exl3_nbytes(t.shape, k[t.name]) for t in tensors)
    return 8 * bytes_ / sum(w[t.name] * t.numel for t in tensors)


def brute_force(tensors, ev, errs, budget_bpw, per_token, per_tensor, candidates):
    units: dict = {}
    for t in tensors:
        units.setdefault(unit_key(t, per_tensor), []).append(t)
    best = (math.inf, None)
    for ks in itertools.product(candidates, repeat=len(units)):
        k = {t.name: K for K, ts in zip(ks, units.values()) for t in ts}
        if cost_bpw(k, tensors, ev, per_token) <= budget_bpw * (1 + 1e-12):
            best = min(best, (written_out_kl(k, tensors, ev, errs), k), key=lambda x: x[0])
    return best


@pytest.mark.parametrize("per_token,per_tensor", [(False, False), (True, False), (False, True)])
def test_greedy_within_its_bound_of_the_brute_force_optimum(rng_seed, per_token, per_tensor):
    rng = np.random.default_rng(rng_seed)
    cands = (1, 2, 3, 4)
    exact = 0
    for trial in range(12):
        n_layers, n_experts = (2, 1) if per_tensor else (2, 3)      # 6 units: 4^6 assignments
        tensors, ev, errs = instance(rng, n_layers, n_experts, per_tensor, cands)
        lo = cost_bpw({t.name: 1 for t in tensors}, tensors, ev, per_token)
        hi = cost_bpw({t.name: 4 for t in tensors}, tensors, ev, per_token)
        budget = float(rng.uniform(lo, hi))
        plan = make_plan(tensors, ev, errs, Budget(budget, per_token), Constraints(cands, per_tensor=per_tensor))
        opt, _ = brute_force(tensors, ev, errs, budget, per_token, per_tensor, cands)
        got = written_out_kl(plan.k, tensors, ev, errs)
        s = plan.summary
        assert got == pytest.approx(s["predicted_kl"], rel=1e-9)
        assert cost_bpw(plan.k, tensors, ev, per_token) <= budget * (1 + 1e-12)
        assert s["budget"]["planned_bpw"] == pytest.approx(cost_bpw(plan.k, tensors, ev, per_token), rel=1e-12)
        # the LP bound holds for every integer plan (a greedy out of gain-per-byte order breaks it), and where the
        # LP's own optimum is integer (no gap) the plan is the optimum
        assert s["kl_lower_bound"] <= opt * (1 + 1e-9) and opt <= got * (1 + 1e-9)
        assert s["optimality_gap"] == pytest.approx(got - s["kl_lower_bound"], rel=1e-9, abs=1e-15)
        if s["optimality_gap"] <= 1e-12 * got:
            assert got == pytest.approx(opt, rel=1e-9)
        exact += got <= opt * (1 + 1e-9)
        if not per_tensor:       # one K per expert: its three matrices agree
            assert all(len({plan.k[t.name] for t in tensors if (t.layer, t.expert) == (L, e)}) == 1
                       for L in range(n_layers) for e in range(n_experts))
    print(f"greedy optimal on {exact} of 12 instances")


def test_steps_go_by_kl_saved_per_byte():
    """Two experts, one 12x the bytes of the other: the larger saves more KL per step, the smaller more per byte.
    Written out: budget = both at K1 + one small step; the small expert's step (gain 0.3 for 1/12 of the bytes) is
    the one that fits and the one per byte prefers."""
    small = [ExpertTensor(f"layers.0.mlp.experts.0.{r}_proj.weight", 0, 0, r, (64, 64)) for r in ("gate", "up", "down")]
    big = [ExpertTensor(f"layers.0.mlp.experts.1.{r}_proj.weight", 0, 1, r, (384, 512)) for r in ("gate", "up", "down")]
    errs = ErrorTable({(t.name, K): (0.2 / 4 ** (K - 1)) for t in small + big for K in (1, 2)})
    ev = Evidence({0: 1.0}, {(0, 0): 0.5, (0, 1): 0.5}, {(0, 0): 1.0, (0, 1): 1.0}, {0: []})
    cost = {(u, K): sum(exl3_nbytes(t.shape, K) for t in ts) for u, ts in ((0, small), (1, big)) for K in (1, 2)}
    assert (cost[(1, 2)] - cost[(1, 1)]) == 12 * (cost[(0, 2)] - cost[(0, 1)])
    params = sum(t.numel for t in small + big)
    spend = cost[(0, 1)] + cost[(1, 1)] + (cost[(1, 2)] - cost[(1, 1)]) // 2     # half the big step: only small fits
    plan = make_plan(small + big, ev, errs, Budget(8 * spend / params), Constraints((1, 2)))
    assert {plan.k[t.name] for t in small} == {2} and {plan.k[t.name] for t in big} == {1}
    gain = 0.5 * 3 * (0.2 - 0.05)
    assert plan.summary["predicted_kl"] == pytest.approx(0.5 * 3 * 0.2 * 2 - gain, rel=1e-12)
    # the LP bound: the big step's fitting fraction taken too
    left = spend - cost[(0, 2)] - cost[(1, 1)]
    assert plan.summary["kl_lower_bound"] == pytest.approx(
        plan.summary["predicted_kl"] - gain * left / (cost[(1, 2)] - cost[(1, 1)]), rel=1e-12)


def test_constraints_are_kept_and_the_plan_file_layout(rng_seed):
    rng = np.random.default_rng(rng_seed)
    tensors, ev, errs = instance(rng, 3, 4, candidates=(2, 3, 4, 5))
    ev.super_experts = {0: [1], 1: [], 2: [0, 3]}
    hi = cost_bpw({t.name: 5 for t in tensors}, tensors, ev, False)
    floor = cost_bpw({t.name: 5 if t.expert in ev.super_experts[t.layer] else 4 if t.layer == 1 else 2
                      for t in tensors}, tensors, ev, False)
    plan = make_plan(tensors, ev, errs, Budget((floor + hi) / 2),
                     Constraints((2, 3, 4, 5), keep_super_experts=5, min_k={1: 4}))
    for t in tensors:
        K = plan.k[t.name]
        if t.expert in ev.super_experts[t.layer]:
            assert K == 5
        if t.layer == 1:
            assert K >= 4
    moe = plan.moe_plan()
    assert set(moe) == {"layers", "drafter"} and moe["drafter"] == {"layers": {}}
    assert moe["layers"] == {str(L): "".join(str(plan.k[f"layers.{L}.mlp.experts.{e}.gate_proj.weight"])
                                             for e in range(4)) for L in range(3)}
    assert parse_min_k(["37-39:3", "0,2:4", "38:5"]) == {37: 3, 38: 5, 39: 3, 0: 4, 2: 4}


def test_refusals_name_the_numbers(rng_seed):
    rng = np.random.default_rng(rng_seed)
    tensors, ev, errs = instance(rng, 2, 3)
    lo = cost_bpw({t.name: 1 for t in tensors}, tensors, ev, False)
    hi = cost_bpw({t.name: 4 for t in tensors}, tensors, ev, False)
    c = Constraints((1, 2, 3, 4))
    with pytest.raises(ConfigError, match=rf"budget {lo * 0.99:g} bpw \(in memory\) is below .*: {lo:.6g} bpw"):
        make_plan(tensors, ev, errs, Budget(lo * 0.99), c)
    with pytest.raises(ConfigError, match=rf"budget {hi * 1.01:g} bpw .* above .* \[1, 2, 3, 4\] allow: {hi:.6g} bpw"):
        make_plan(tensors, ev, errs, Budget(hi * 1.01), c)
    # a layer's minimum raises the floor: the same budget that fits without it is refused with it
    floor = cost_bpw({t.name: 3 if t.layer == 1 else 1 for t in tensors}, tensors, ev, False)
    make_plan(tensors, ev, errs, Budget(lo * 1.001), c)
    with pytest.raises(ConfigError, match=rf"below the smallest plan the constraints allow: {floor:.6g} bpw"):
        make_plan(tensors, ev, errs, Budget(lo * 1.001), Constraints((1, 2, 3, 4), min_k={1: 3}))
    ev.super_experts = {0: [2], 1: []}
    with pytest.raises(ConfigError, match=r"layer 0 expert 2 is a super expert kept at K2, but --min-k asks K >= 3"):
        make_plan(tensors, ev, errs, Budget(hi), Constraints((1, 2, 3, 4), keep_super_experts=2, min_k={0: 3}))
    with pytest.raises(ConfigError, match=r"--keep-super-experts 6 is not among the candidate K \[1, 2, 3, 4\]"):
        make_plan(tensors, ev, errs, Budget(hi), Constraints((1, 2, 3, 4), keep_super_experts=6))
    with pytest.raises(ConfigError, match=r"--min-k names layer\(s\) \[7\] .* MoE layers: \[0, 1\]"):
        make_plan(tensors, ev, errs, Budget(hi), Constraints((1, 2, 3, 4), min_k={7: 2}))
    with pytest.raises(ConfigError, match=r"candidate K \[0, 2\]: .* \[0\] are not"):
        make_plan(tensors, ev, errs, Budget(hi), Constraints((0, 2)))
    del ev.sensitivity[1]
    with pytest.raises(ConfigError, match=r"no sensitivity for MoE layer\(s\) \[1\]"):
        make_plan(tensors, ev, errs, Budget(hi), c)
    with pytest.raises(ConfigError, match=r"--min-k '3-4': expected LAYERS:K"):
        parse_min_k(["3-4"])


def test_rate_model_recovers_a_log_linear_law_and_labels_its_values(rng_seed):
    rng = np.random.default_rng(rng_seed)
    a, b = float(rng.uniform(-1, 1)), float(-rng.uniform(1.0, 1.6))
    offsets = {f"t{i}": float(rng.normal(0, 0.3)) for i in range(4)}
    measured = {(n, K): math.exp(a + b * K + o) for n, o in offsets.items() for K in (2, 3, 5)}
    model = RateModel.fit(measured)
    mean_off = np.mean(list(offsets.values()))
    assert model.b == pytest.approx(b, rel=1e-9) and model.a == pytest.approx(a + mean_off, rel=1e-9, abs=1e-9)
    assert model.residual_sd == pytest.approx(0.0, abs=1e-9)
    table = ErrorTable(measured)
    assert table("t1", 3) == (measured[("t1", 3)], "measured")
    value, source = table("t1", 4)
    assert source == "rate_model" and value == pytest.approx(math.exp(a + b * 4 + offsets["t1"]), rel=1e-9)
    assert table("unseen", 4)[0] == pytest.approx(math.exp(model.a + b * 4), rel=1e-9)
    with pytest.raises(ConfigError, match=r"needs measured errors at >= 2 values of K; have 1 point\(s\) at K \[3\]"):
        ErrorTable({("t0", 3): 0.01})("t0", 4)


def test_row_bootstrap_of_the_sensitivity(rng_seed):
    rng = np.random.default_rng(rng_seed)
    levels = [2.0 ** -10, 2.0 ** -8, 2.0 ** -6]
    e2 = np.asarray(levels) ** 2
    rows = rng.integers(5, 40, 9).astype(float)
    ev = Evidence({0: 1.0}, {(0, 0): 1.0}, {(0, 0): 1.0}, {0: []}, levels=levels, scored_per_row=rows)
    # every position of every row has the same KL at each level: each draw's slope is the same number
    per_pos = 3.0 * e2
    ev.row_sums = {0: per_pos[:, None] * rows[None, :]}
    draws, why = sensitivity_draws(ev, n=500, seed=1)
    assert why == "" and np.allclose(draws[0], 3.0, rtol=1e-12)
    # rows that differ: the draws scatter around the slope of the pooled means, written out
    sums = rng.gamma(2.0, 1.0, (3, 9)) * e2[:, None] * rows[None, :]
    ev.row_sums = {0: sums}
    draws, _ = sensitivity_draws(ev, n=4000, seed=2)
    means = sums.sum(1) / rows.sum()
    slope = (e2 * means).sum() / (e2 * e2).sum()
    assert draws[0].std() > 0.02 * slope
    assert abs(np.median(draws[0]) - slope) < 3 * draws[0].std() / math.sqrt(9) + 0.1 * slope
    ev.row_sums = None
    assert sensitivity_draws(ev)[0] is None


def test_exl3_bytes_equal_the_encoders_stored_tensors():
    from fidelity.packs.exl3.encoder import EncodingCache
    from fidelity.packs.exl3.codec import bitrate_from_trellis

    cache = EncodingCache(V4 / "tiny_v4_encodings.safetensors")
    seen = set()
    for key, parts in cache.entries.items():
        trellis = parts["trellis"]
        K = bitrate_from_trellis(tuple(trellis.shape), "mul1").K
        shape = (parts["svh"].shape[0], parts["suh"].shape[0])          # padded [out, in]: the formula pads the same
        stored = sum(t.numel() * t.element_size() for t in parts.values())
        assert exl3_nbytes(shape, K) == stored, key
        seen.add((shape, K))
    assert len(seen) >= 5


def test_attribute_keeps_each_rows_sensitivity_kl(tmp_path, rng_seed):
    """attribute's per-row KL sums (what the plan's bootstrap resamples) give back its mean KL at every level, and
    each row's sum is that row's share: rows of different lengths weigh by their positions."""
    from fidelity.measuring.attribute import Settings, attribute
    from testkit.minipacks_v41 import build_native_v41

    rng = np.random.default_rng(rng_seed)
    native = build_native_v41(V4 / "tiny_v4", tmp_path / "native")
    rows = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(12, 40, 5)]
    data = attribute(native, native, rows=rows, settings=Settings(modules="layer", noise_control=False)).to_json()
    per_row = np.asarray(data["summary"]["scored_per_row"], dtype=float)
    assert per_row.tolist() == [len(r) - 1 for r in rows]
    for r in data["sensitivity"]:
        sums = np.asarray(r["kld_row_sums"])
        assert sums.shape == (len(r["levels"]), len(rows)) and (sums >= 0).all()
        assert sums.sum(1) / per_row.sum() == pytest.approx(r["kld_mean"], rel=1e-12, abs=1e-300)
        assert r["kld_mean"][-1] > 0
    ev = Evidence.from_attribution(data)
    draws, why = sensitivity_draws(ev, n=200)
    assert why == "" and set(draws) == {0, 1, 2}


# -- the proof on a real encode ---------------------------------------------------------------------------------------
PROOF_CANDIDATES = "1-3"
UNIFORM_K = 2


def proof_cache():
    """The tiny V4's committed encodings plus every routed expert at K 1..3 (fixtures/v4/make_plan_encodings.py)."""
    from fidelity.packs.exl3.encoder import EncodingCache

    cache = EncodingCache(V4 / "tiny_v4_encodings.safetensors")
    cache.entries.update(EncodingCache(PLAN_ENCODINGS).entries)
    return cache


def planned_spec(moe_plan: dict):
    from testkit.minipacks_v41 import V41_SPEC

    from testkit.minipacks_v4 import V4MiniSpec

    @dataclass(frozen=True)
    class PlannedSpec(V4MiniSpec):
        digits: tuple = ()                    # (layer, digits) of exl3_moe_plan.json

        def expert_bits(self, layout, layer, expert):
            return int(dict(self.digits)[layer][expert])

    return PlannedSpec(fp8_block=V41_SPEC.fp8_block,
                       digits=tuple((int(L), d) for L, d in moe_plan["layers"].items()))


def token_panel(path: Path, rows: list[list[int]], name: str):
    from fidelity.panels.panel import PanelRow, write_panel

    return write_panel(path, [PanelRow(f"r{i}", "random", tokens=r, scored=[False] + [True] * (len(r) - 1))
                              for i, r in enumerate(rows)], name=name)


@pytest.mark.slow
def test_plan_beats_uniform_k_on_a_held_out_panel(tmp_path, rng_seed, capsys):
    from fidelity.measuring.attribute import Settings, attribute
    from fidelity.cli import main as cli
    from testkit.minipacks_v4 import write_v4_minipack
    from testkit.minipacks_v41 import build_native_v41
    from fidelity.measuring.compare import compare
    from fidelity.packs import open_pack
    from fidelity.packs.exl3.layouts import routed_expert

    t0 = time.perf_counter()
    torch.manual_seed(rng_seed)
    rng = np.random.default_rng(rng_seed)
    native = build_native_v41(V4 / "tiny_v4", tmp_path / "native")
    calib = [rng.integers(0, 256, 48).tolist() for _ in range(12)]
    held_out = [rng.integers(0, 256, 48).tolist() for _ in range(24)]

    # sensitivity and routing on the calibration rows; the levels up to 2^-6 give S_L, all of them each layer's curve
    from fidelity.measuring.attribute import NOISE_LEVELS
    from fidelity.plan import QUANTIZATION_LEVELS
    attribution = attribute(native, native, rows=calib, settings=Settings(
        modules="layer", noise_control=False, noise_levels=NOISE_LEVELS + QUANTIZATION_LEVELS))
    data = json.loads(json.dumps(attribution.to_json(), default=str))
    (tmp_path / "attr.json").write_text(json.dumps(data))

    # the plan through the CLI, at the uniform K's bytes, every per-K error decoded from the encodings
    cache = proof_cache()
    cache.save(tmp_path / "enc.safetensors")
    ref = open_pack(native)
    from fidelity.plan import expert_tensors
    tensors = expert_tensors(ref)
    uniform_bpw = 8 * sum(exl3_nbytes(t.shape, UNIFORM_K) for t in tensors) / sum(t.numel for t in tensors)
    out = tmp_path / "plan"
    args = ["plan", str(native), "--from", str(tmp_path / "attr.json"), "--budget", repr(uniform_bpw), "--candidates",
            PROOF_CANDIDATES, "--encodings", str(tmp_path / "enc.safetensors"), "--measure", "0", "-o", str(out)]
    assert cli(args) == 0
    summary = json.loads((out / "plan.json").read_text())["summary"]
    recipe = json.loads((out / "plan.json").read_text())["tensors"]
    moe = json.loads((out / "exl3_moe_plan.json").read_text())
    assert summary["errors"]["sources"] == {"measured": len(tensors)} and summary["errors"]["rate_model"] is None
    assert summary["budget"]["planned_bytes"] <= summary["budget"]["allowed_bytes"]
    assert moe["layers"] != {str(L): "2222" for L in range(3)}, "the plan must differ from the uniform one"
    # refused budgets through the CLI: exit 1, the numbers named
    lo = 8 * sum(exl3_nbytes(t.shape, 1) for t in tensors) / sum(t.numel for t in tensors)
    capsys.readouterr()
    assert cli(args[:4] + ["--budget", str(lo - 0.5)] + args[6:]) == 2
    assert f"budget {lo - 0.5:g} bpw (in memory) is below the smallest plan the constraints allow: {lo:.6g} bpw" in \
        capsys.readouterr().err

    # encode both packs with the EXL3 encoder (cached) in the deepseek_v41_exl3 layout
    misses = cache.misses
    plan_pack = write_v4_minipack(ref, "deepseek_v41_exl3", tmp_path / "planned", planned_spec(moe), cache)
    uniform_pack = write_v4_minipack(ref, "deepseek_v41_exl3", tmp_path / "uniform",
                                     planned_spec({"layers": {L: "2222" for L in moe["layers"]}}), cache)
    assert cache.misses == misses, "an encoding missing from the fixture: regenerate tiny_v4_plan_encodings"
    assert json.loads((plan_pack / "exl3_moe_plan.json").read_text()) == moe   # the writer states the plan we made

    # the budget arithmetic equals each pack's own bits_per_weight (routed experts, in memory and per decoded token)
    shares = {}
    for r in data["routing"]:
        shares[(r["layer"], r["expert"])] = r["counts_ref"] / next(
            x["tokens"] for x in data["routing_layers"] if x["layer"] == r["layer"])
    for path, want_bytes in ((plan_pack, summary["budget"]["planned_bytes"]),
                             (uniform_pack, summary["budget"]["allowed_bytes"])):
        p = open_pack(path)
        routing = {n: shares[routed_expert(n)[1:]] for n in p.names() if routed_expert(n) and n.endswith(".weight")}
        rows = p.bits_per_weight(routing=routing).rows
        assert rows["routed_experts"]["bytes"] == pytest.approx(want_bytes, rel=1e-12)
        assert rows["routed_experts"]["params"] == summary["budget"]["params"]
    per_token = 8 * sum(r["token_share"] * r["bytes"] for r in recipe) / sum(
        r["token_share"] * r["shape"][0] * r["shape"][1] for r in recipe)
    planned = open_pack(plan_pack).bits_per_weight(routing={
        n: shares[routed_expert(n)[1:]] for n in open_pack(plan_pack).names()
        if routed_expert(n) and n.endswith(".weight")}).rows
    assert planned["routed_experts_per_decoded_token_measured"]["bpw"] == pytest.approx(per_token, rel=1e-12)

    # compare both on the held-out panel: the plan's KL lower, the paired interval excluding 0
    panel = token_panel(tmp_path / "panel", held_out, "held-out random tokens")
    res = compare(native, [plan_pack, uniform_pack], panel=panel, labels=["plan", "uniform"], noise_floor=False,
                  numerics_floor=False, progress=False, seed=rng_seed % 1000)
    by = {r["label"]: r["overall"] for r in res.report["results"]}
    paired = res.report["paired"][0]
    assert (paired["a"], paired["b"]) == ("plan", "uniform")
    # predicted vs measured, experts only: each layer's routed experts swapped in alone on the held-out rows
    swaps = {}
    for label, path in (("plan", plan_pack), ("uniform", uniform_pack)):
        a = attribute(native, path, rows=held_out, settings=Settings(modules="block", noise_control=False,
                                                                        sensitivity=False))
        swaps[label] = sum(r["kld_mean"] for r in a.swaps if r["group"].endswith(".experts"))
    uni = next(u for u in summary["uniform"] if u["K"] == UNIFORM_K)
    # calibrated on uniform K2's measured experts-only KL, the plan's KL predicted (held out: the plan's own
    # measurement is not used), through the CLI
    assert cli(args[:-2] + ["--calibrate", f"K{UNIFORM_K}={swaps['uniform']!r}", "-o", str(tmp_path / "cal")]) == 0
    cal = json.loads((tmp_path / "cal" / "plan.json").read_text())["summary"]
    plan_curve = summary["predicted_kl_curve"]["kl"]
    assert cal["calibration"]["predicted_kl_calibrated"] == pytest.approx(
        swaps["uniform"] / uni["predicted_kl_curve"] * plan_curve, rel=1e-12)
    calibrated = cal["calibration"]["predicted_kl_calibrated"]
    lines = [f"{'':8} {'bpw':>8} {'KL measured (whole pack)':>26} {'experts-only swaps':>19} {'predicted':>10} "
             f"{'pred CI95':>22} {'curve':>8} {'calibrated':>10}",
             f"{'plan':8} {summary['budget']['planned_bpw']:8.4f} {by['plan']['kld_mean']:26.5g} {swaps['plan']:19.5g} "
             f"{summary['predicted_kl']:10.4g} {str(np.round(summary['predicted_kl_ci95'], 4)):>22} "
             f"{plan_curve:8.4g} {calibrated:10.4g}",
             f"{'uniform':8} {uni['bpw']:8.4f} {by['uniform']['kld_mean']:26.5g} {swaps['uniform']:19.5g} "
             f"{uni['predicted_kl']:10.4g} {str(np.round(uni['predicted_kl_ci95'], 4)):>22} "
             f"{uni['predicted_kl_curve']:8.4g} {'(fit)':>10}",
             f"plan / measured experts-only: linear {summary['predicted_kl'] / swaps['plan']:.3g}x, curve "
             f"{plan_curve / swaps['plan']:.3g}x, calibrated {calibrated / swaps['plan']:.3g}x; loads "
             + ", ".join(f"L{L} {v['load']:.3g} {v['where']}"
                         for L, v in summary["predicted_kl_curve"]["layers"].items()),
             f"paired plan - uniform: {paired['kld_mean_diff']:.5g} nats, CI95 {paired['ci95']}, "
             f"p {paired['p_value']}; "
             f"plan {summary['units_per_K']}, {moe['layers']}; {time.perf_counter() - t0:.0f} s"]
    print("\n".join(lines))
    assert by["plan"]["kld_mean"] < by["uniform"]["kld_mean"]
    assert paired["ci95"][1] < 0, paired
    assert swaps["plan"] < swaps["uniform"]
    # the calibrated curve predicts the held-out plan closer than the small-noise linear rule does
    assert abs(math.log(calibrated / swaps["plan"])) < abs(math.log(summary["predicted_kl"] / swaps["plan"]))


@pytest.mark.slow
def test_cli_on_a_qwen3_moe_with_the_rate_model(tmp_path, rng_seed):
    """Hugging Face names (gate_proj / up_proj / down_proj), a dense layer between MoE layers, one tensor encoded at
    each candidate K and every other error from the rate model fitted to those points; budget per decoded token;
    super experts kept."""
    from fidelity.cli import main as cli
    from test_oracle import make_moe

    _, pack = make_moe(tmp_path, "qwen3moe-renorm-sparse-step", rng_seed)        # 7 experts, top 3, layer 1 dense
    rng = np.random.default_rng(rng_seed)
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([rng.integers(0, 97, 30).tolist() for _ in range(6)]))
    out = tmp_path / "plan"
    t0 = time.perf_counter()
    # K2 everywhere is 8 * (128 * 128 * 2 / 8 + 4 * 128 + 4) / (20 * 48) bits per weight of a [20, 48] or [48, 20]
    # matrix
    k2 = 8 * (128 * 128 * 2 / 8 + 4 * 128 + 4) / (20 * 48)
    assert cli(["plan", str(pack.path), "--rows", str(rows), "--budget", repr(k2), "--per-decoded-token",
                "--candidates", "1-3", "--keep-super-experts", "3", "--measure", "1", "-o", str(out)]) == 0
    doc = json.loads((out / "plan.json").read_text())
    s, recipe = doc["summary"], doc["tensors"]
    print(f"{time.perf_counter() - t0:.0f} s", s["errors"], s["units_per_K"], s["predicted_kl"], s["predicted_kl_ci95"])
    assert {(r["layer"], r["role"]) for r in recipe} == {(L, role) for L in (0, 2) for role in ("gate", "up", "down")}
    assert len(recipe) == 2 * 7 * 3
    model = s["errors"]["rate_model"]
    assert model["points"] == 3 and model["b"] < -0.9           # ~4x less squared error per bit
    measured = [r for r in recipe if r["error_source"] == "measured"]
    assert len(measured) == 1 and measured[0]["tensor"] == recipe[0]["tensor"]
    assert s["errors"]["sources"] == {"measured": 1, "rate_model": 41}
    # per decoded token: bytes and params weighed by each expert's token share, written out
    share = {(r["layer"], r["expert"]): r["token_share"] for r in recipe}
    for L in (0, 2):
        assert sum(v for (layer, _), v in share.items() if layer == L) == pytest.approx(3.0, rel=1e-12)
    planned = sum(r["token_share"] * (128 * 128 * r["K"] / 8 + 4 * 128 + 4) for r in recipe)
    params = sum(r["token_share"] * 20 * 48 for r in recipe)
    assert s["budget"]["planned_bytes"] == pytest.approx(planned, rel=1e-12)
    # within the budget up to float rounding: all-K2's bytes over params, summed in another order, can be 1 ulp above k2
    assert s["budget"]["planned_bpw"] == pytest.approx(8 * planned / params, rel=1e-12)
    assert s["budget"]["planned_bpw"] <= k2 * (1 + 1e-12)
    supers = {(int(L), e) for L, es in s["constraints"]["super_experts"].items() for e in es}
    assert all(r["K"] == 3 for r in recipe if (r["layer"], r["expert"]) in supers)
    moe = json.loads((out / "exl3_moe_plan.json").read_text())
    assert sorted(moe["layers"]) == ["0", "2"] and all(len(d) == 7 for d in moe["layers"].values())
    assert moe["layers"]["0"] == "".join(str(next(r["K"] for r in recipe if (r["layer"], r["expert"]) == (0, e)))
                                         for e in range(7))
