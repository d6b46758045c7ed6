"""fidelity plan's curve prediction (each layer's measured KL at its noise levels, read at the plan's load) and its
one-scale calibration on a measured plan, against numbers written out here."""
from __future__ import annotations

import math

import numpy as np
import pytest

from fidelity.errors import ConfigError
from fidelity.plan import (Budget, Constraints, ErrorTable, Evidence, ExpertTensor, curve_kl, make_plan,
                           sensitivity_draws)


def test_curve_reads_log_log_between_levels_and_says_where(rng_seed):
    rng = np.random.default_rng(rng_seed)
    e2 = sorted(rng.uniform(1e-5, 1e-1, 3))
    kl = sorted(rng.uniform(1e-4, 1e-1, 3))
    curve = (list(e2), list(kl))
    # between the first two levels: a straight line in log-log
    x = math.sqrt(e2[0] * e2[1])
    slope = math.log(kl[1] / kl[0]) / math.log(e2[1] / e2[0])
    assert curve_kl(curve, x) == (pytest.approx(kl[0] * (x / e2[0]) ** slope, rel=1e-12), "inside")
    assert curve_kl(curve, e2[2]) == (pytest.approx(kl[2], rel=1e-12), "inside")
    # below the smallest level: proportional to eps^2
    assert curve_kl(curve, e2[0] / 7) == (pytest.approx(kl[0] / 7, rel=1e-12), "below")
    # above the largest: the last segment's slope, extrapolated
    last = math.log(kl[2] / kl[1]) / math.log(e2[2] / e2[1])
    assert curve_kl(curve, 3 * e2[2]) == (pytest.approx(kl[2] * 3 ** last, rel=1e-12), "extrapolated")
    assert curve_kl(curve, 0.0) == (0.0, "inside")


def test_curve_prediction_and_calibration_written_out(rng_seed):
    rng = np.random.default_rng(rng_seed)
    tensors, errs = [], {}
    for L in range(2):
        for e in range(2):
            for role in ("gate", "up", "down"):
                t = ExpertTensor(f"layers.{L}.mlp.experts.{e}.{role}_proj.weight", L, e, role, (64, 64))
                tensors.append(t)
                for K in (1, 2, 3):
                    errs[(t.name, K)] = float(rng.uniform(0.5, 1.0)) * 4.0 ** -K
    share = {(L, e): s for L in range(2) for e, s in enumerate(rng.dirichlet([1, 1]))}
    curves = {L: ([1e-4, 1e-2, 0.3], sorted(rng.uniform(1e-4, 0.5, 3))) for L in range(2)}
    ev = Evidence({0: 2.0, 1: 0.5}, share, {k: 1.0 for k in share}, {0: [], 1: []}, curves=curves)
    errors = ErrorTable(errs)
    k2 = 8 * sum(1 for _ in tensors) * (128 * 128 * 2 / 8 + 4 * 128 + 4) / (len(tensors) * 64 * 64)
    measured = float(rng.uniform(0.01, 0.1))
    plan = make_plan(tensors, ev, errors, Budget(k2), Constraints((1, 2, 3)), calibration=("K2", measured))
    s = plan.summary

    def curve_total(k):
        total = 0.0
        for L in range(2):
            load = sum(share[(t.layer, t.expert)] * errs[(t.name, k[t.name])] for t in tensors if t.layer == L)
            total += curve_kl(curves[L], load)[0]
        return total
    uniform2 = curve_total({t.name: 2 for t in tensors})
    row = next(r for r in s["uniform"] if r["K"] == 2)
    assert row["predicted_kl_curve"] == pytest.approx(uniform2, rel=1e-12)
    assert s["predicted_kl_curve"]["kl"] == pytest.approx(curve_total(plan.k), rel=1e-12)
    cal = s["calibration"]
    assert cal["scale"] == pytest.approx(measured / uniform2, rel=1e-12)
    assert cal["predicted_kl_calibrated"] == pytest.approx(measured / uniform2 * curve_total(plan.k), rel=1e-12)
    assert row["predicted_kl_calibrated"] == pytest.approx(measured, rel=1e-12)
    with pytest.raises(ConfigError, match=r"--calibrate K7: not a plan this run predicts; one of \['K1', 'K2', 'K3'\]"):
        make_plan(tensors, ev, errors, Budget(k2), Constraints((1, 2, 3)), calibration=("K7", measured))
    with pytest.raises(ConfigError, match="the measured KL must be a positive number"):
        make_plan(tensors, ev, errors, Budget(k2), Constraints((1, 2, 3)), calibration=("K2", -1.0))
    ev.curves = None
    with pytest.raises(ConfigError, match="needs each layer's measured KL"):
        make_plan(tensors, ev, errors, Budget(k2), Constraints((1, 2, 3)), calibration=("K2", measured))


def attribution(levels, kls, rng, rows=6):
    """A minimal attribute result: one MoE layer, two experts, KL per level and per row."""
    per_row = rng.integers(5, 30, rows)
    row_sums = [list(k * per_row / per_row.sum() * per_row.sum() / rows * rng.uniform(0.5, 1.5, rows)) for k in kls]
    return {"routing": [{"layer": 0, "expert": e, "energy_share_ref": 0.5, "counts_ref": 3} for e in range(2)],
            "routing_layers": [{"layer": 0, "tokens": 6, "super_experts_ref": []}],
            "sensitivity": [{"layer": 0, "levels": list(levels), "kld_mean": list(kls), "dkl_deps2": 123.0,
                             "kld_row_sums": row_sums}],
            "summary": {"scored_per_row": per_row.tolist()}}


def test_sensitivity_from_the_small_levels_curve_from_all(rng_seed):
    rng = np.random.default_rng(rng_seed)
    small = [2.0 ** -10, 2.0 ** -8, 2.0 ** -6]
    kls = sorted(rng.uniform(1e-7, 1e-3, 3)) + sorted(rng.uniform(0.01, 0.3, 2))
    ev = Evidence.from_attribution(attribution(small + [0.2, 0.5], kls, rng))
    e2 = np.asarray(small) ** 2
    assert ev.sensitivity[0] == pytest.approx(float((e2 * kls[:3]).sum() / (e2 * e2).sum()), rel=1e-12)
    assert ev.curves[0] == ([x * x for x in small + [0.2, 0.5]], kls)
    assert ev.levels == small and ev.row_sums[0].shape == (3, 6)     # the bootstrap resamples the small levels only
    draws, _ = sensitivity_draws(ev, n=50)
    assert draws[0].shape == (50,)
    # only small levels: attribute's own dkl_deps2, as it wrote it
    assert Evidence.from_attribution(attribution(small, kls[:3], rng)).sensitivity[0] == 123.0
    with pytest.raises(ConfigError, match=r"noise levels \[0.2, 0.5\] have none <= 0.015625"):
        Evidence.from_attribution(attribution([0.2, 0.5], kls[3:], rng))
