"""fidelity plan with donor packs and stage budgets (fidelity/plan_donors.py; seed 003's allocation): the greedy
against brute force with per-stage budgets, the stage refusals, and through the CLI on tiny V4.1 donor packs (EXL3 at
two K and MXFP4) with each stage's bytes recomputed from the donors' safetensors headers."""
from __future__ import annotations

import itertools
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest

from fidelity.errors import ConfigError
from fidelity.plan import Budget, Constraints, ErrorTable, Evidence, ExpertTensor, exl3_nbytes, make_plan
from fidelity.plan_donors import Donor, DonorTensor, Stage, parse_stage_budgets

V4 = Path(__file__).parent / "fixtures" / "v4"
ROLES = ("gate", "up", "down")


# -- synthetic instances ----------------------------------------------------------------------------------------------
def donor_instance(rng, n_layers=3, n_experts=2, labels=("a", "b")):
    """Random shapes, sensitivities, shares, and per donor per tensor random bytes and errors (a donor can be bigger
    and worse: dominated options)."""
    tensors, donors = [], {label: {} for label in labels}
    for L in range(n_layers):
        for e in range(n_experts):
            for role in ROLES:
                shape = (64, 64) if rng.random() < 0.5 else (128, 96)
                t = ExpertTensor(f"layers.{L}.mlp.experts.{e}.{role}_proj.weight", L, e, role, shape)
                tensors.append(t)
                for label in labels:
                    k = int(rng.integers(1, 6)) if rng.random() < 0.7 else None
                    nbytes = int(rng.integers(500, 6000))
                    donors[label][(L, e, role)] = DonorTensor(label, f"{label}:{t.name}", nbytes,
                                                              "exl3" if k else "mxfp4", k, float(rng.uniform(.01, .5)))
    sens = {L: float(rng.lognormal(0, 1)) for L in range(n_layers)}
    energy, token = {}, {}
    for L in range(n_layers):
        w = rng.dirichlet(np.ones(n_experts))
        energy.update({(L, e): float(w[e]) for e in range(n_experts)})
        token.update({(L, e): float(w[e] * 2) for e in range(n_experts)})
    ev = Evidence(sens, energy, token, {L: [] for L in range(n_layers)})
    return tensors, ev, [Donor(label, label, held) for label, held in donors.items()]


def option_bytes(t, opt, donors):
    if isinstance(opt, str):
        return next(d for d in donors if d.label == opt).tensors[(t.layer, t.expert, t.role)].nbytes
    return exl3_nbytes(t.shape, opt)


def option_error(t, opt, donors, errs):
    if isinstance(opt, str):
        return next(d for d in donors if d.label == opt).tensors[(t.layer, t.expert, t.role)].error
    return errs.measured[(t.name, opt)]


def written_out_kl(k, tensors, ev, donors, errs):
    return sum(ev.sensitivity[t.layer] * ev.energy_share[(t.layer, t.expert)] * option_error(t, k[t.name], donors, errs)
               for t in tensors)


def test_greedy_with_donors_and_stages_against_brute_force(rng_seed):
    rng = np.random.default_rng(rng_seed)
    exact = 0
    for trial in range(10):
        tensors, ev, donors = donor_instance(rng)
        cands = (2,) if trial % 2 else ()             # half the instances also offer our encoder's K2
        errs = ErrorTable({(t.name, 2): float(rng.uniform(.05, .3)) for t in tensors})
        options = list(cands) + [d.label for d in donors]
        units = [[t for t in tensors if (t.layer, t.expert) == (L, e)] for L in range(3) for e in range(2)]
        stage_of = {0: 0, 1: 1, 2: 1}
        per_stage = [[u for u in units if stage_of[u[0].layer] == s] for s in (0, 1)]
        lo = [sum(min(sum(option_bytes(t, o, donors) for t in u) for o in options) for u in st) for st in per_stage]
        hi = [sum(max(sum(option_bytes(t, o, donors) for t in u) for o in options) for u in st) for st in per_stage]
        caps = [int(rng.uniform(lo[s], hi[s])) for s in (0, 1)]
        stages = (Stage(0, 0, nbytes=caps[0], text=f"0:{caps[0]}B"),
                  Stage(1, 2, nbytes=caps[1], text=f"1-2:{caps[1]}B"))
        plan = make_plan(tensors, ev, errs, Budget(stages=stages), Constraints(cands), donors=donors)
        # brute force: every unit at every option, each stage within its cap
        best = math.inf
        for choice in itertools.product(options, repeat=len(units)):
            k = {t.name: o for o, u in zip(choice, units) for t in u}
            spent = [sum(option_bytes(t, k[t.name], donors) for u in st for t in u) for st in per_stage]
            if all(spent[s] <= caps[s] for s in (0, 1)):
                best = min(best, written_out_kl(k, tensors, ev, donors, errs))
        got = written_out_kl(plan.k, tensors, ev, donors, errs)
        s = plan.summary
        assert got == pytest.approx(s["predicted_kl"], rel=1e-9)
        for st, stage_units, cap in zip(s["budget"]["stages"], per_stage, caps):
            spent = sum(option_bytes(t, plan.k[t.name], donors) for u in stage_units for t in u)
            assert spent == st["planned_bytes"] and spent <= cap and st["allowed_bytes"] == cap
        assert s["kl_lower_bound"] <= best * (1 + 1e-9) and best <= got * (1 + 1e-9)
        exact += got <= best * (1 + 1e-9)
        # one option per expert, and the recipe names its donor
        for u in units:
            assert len({plan.k[t.name] for t in u}) == 1
        for r in plan.recipe:
            opt = plan.k[r["tensor"]]
            assert r["source"] == ("donor" if isinstance(opt, str) else "encoder")
            assert r.get("donor") == (opt if isinstance(opt, str) else None)
        # exl3_moe_plan.json only when every chosen tensor is EXL3 at one K per expert
        ks = [(r["layer"], r["expert"], r["K"]) for r in plan.recipe]
        writable = all(k is not None for *_, k in ks) and all(
            len({k for (L, e, k) in ks if (L, e) == key}) == 1 for key in {(L, e) for L, e, _ in ks})
        assert (plan.moe_plan() is not None) == writable, plan.moe_plan_refusal()
        whole = {w["donor"]: w for w in s["donors_whole"]}
        for d in donors:
            want = sum(option_bytes(t, d.label, donors) for t in tensors)
            assert whole[d.label]["bytes"] == want
            assert whole[d.label]["predicted_kl"] == pytest.approx(
                written_out_kl({t.name: d.label for t in tensors}, tensors, ev, donors, errs), rel=1e-12)
    print(f"greedy optimal on {exact} of 10 instances")


def test_stage_budgets_parse_and_refusals(rng_seed):
    st = parse_stage_budgets(["10-39:120GB,0-9:40GiB", "40:2.5bpw"])
    assert [(s.first, s.last, s.nbytes, s.bpw) for s in st] == [(0, 9, 40 * 2 ** 30, None), (10, 39, 120e9, None),
                                                                (40, 40, None, 2.5)]
    with pytest.raises(ConfigError, match=r"stages '0-9:1GB' and '5-12:1GB' overlap \(layers 5-9\)"):
        parse_stage_budgets(["0-9:1GB,5-12:1GB"])
    for bad in ("0-9", "0-9:1XB", "9-0:1GB", "a:1GB", "0-9:-1GB", "0-9:0bpw"):
        with pytest.raises(ConfigError, match="--stage-budgets"):
            parse_stage_budgets([bad])

    rng = np.random.default_rng(rng_seed)
    tensors, ev, donors = donor_instance(rng)
    errs = ErrorTable({})

    def plan(spec, per_token=False):
        return make_plan(tensors, ev, errs, Budget(stages=parse_stage_budgets([spec]), per_decoded_token=per_token),
                         Constraints(()), donors=donors)
    with pytest.raises(ConfigError, match=r"MoE layer\(s\) \[2\] are in no stage \(stages: 0, 1; MoE layers: "
                                          r"\[0, 1, 2\]\)"):
        plan("0:1MB,1:1MB")
    with pytest.raises(ConfigError, match=r"stage '3-9:1MB' holds no MoE layer"):
        plan("0-2:1MB,3-9:1MB")
    with pytest.raises(ConfigError, match=r"stage '0-2:1MB' is in bytes, which count memory"):
        plan("0-2:1MB", per_token=True)
    with pytest.raises(ConfigError, match="give a budget in bpw"):
        make_plan(tensors, ev, errs, Budget(2.0, stages=parse_stage_budgets(["0-2:1MB"])), Constraints(()),
                  donors=donors)
    # infeasible: the stage, its bytes and the smallest / largest plan its layers allow, written out
    units = {(L, e): [t for t in tensors if (t.layer, t.expert) == (L, e)] for L in range(3) for e in range(2)}
    unit_bytes = {key: [sum(d.tensors[(t.layer, t.expert, t.role)].nbytes for t in ts) for d in donors]
                  for key, ts in units.items()}
    low1 = sum(min(v) for (L, _), v in unit_bytes.items() if L >= 1)
    high0 = sum(max(v) for (L, _), v in unit_bytes.items() if L == 0)
    with pytest.raises(ConfigError, match=rf"stage 1-2 \(1-2:{low1 - 1}B: {low1 - 1} bytes = .* is below the smallest "
                                          rf"plan the constraints allow: .* \({low1} bytes"):
        plan(f"0:{high0}B,1-2:{low1 - 1}B")
    with pytest.raises(ConfigError, match=rf"stage 0 \(0:{high0 + 1}B: {high0 + 1} bytes .* is above the largest "
                                          rf"plan .* \({high0} bytes"):
        plan(f"0:{high0 + 1}B,1-2:{low1}B")
    # a stage at exactly its smallest plan: every unit at its cheapest donor
    p = plan(f"0:{high0}B,1-2:{low1}B")
    assert p.summary["budget"]["stages"][1]["planned_bytes"] == low1


def test_donor_constraints_and_missing_donor_tensors(rng_seed):
    rng = np.random.default_rng(rng_seed)
    tensors, ev, donors = donor_instance(rng)
    for d in donors:                    # donor a: every tensor EXL3 K2; donor b: K4
        K = 2 if d.label == "a" else 4
        d.tensors = {key: DonorTensor(d.label, t.name, t.nbytes, "exl3", K, t.error) for key, t in d.tensors.items()}
    ev.super_experts = {0: [1]}
    c = Constraints((), keep_super_experts=4, min_k={2: 3})
    # the largest plan: every unit at its largest allowed donor
    units = {(t.layer, t.expert) for t in tensors}
    allowed = {key: (["b"] if key == (0, 1) or key[0] == 2 else ["a", "b"]) for key in units}
    high = sum(max(sum(next(d for d in donors if d.label == o).tensors[(t.layer, t.expert, t.role)].nbytes
                       for t in tensors if (t.layer, t.expert) == key) for o in allowed[key]) for key in units)
    p = make_plan(tensors, ev, ErrorTable({}), Budget(stages=(Stage(0, 2, nbytes=high, text="all"),)), c,
                  donors=donors)
    assert p.k[tensors[3].name] == "b"                                   # layer 0 expert 1: the super expert at K4
    assert all(p.k[t.name] == "b" for t in tensors if t.layer == 2)     # --min-k 2:3 leaves only the K4 donor
    assert p.moe_plan() is not None
    # a unit no candidate can fill: donor b drops one tensor of layer 2
    del donors[1].tensors[(2, 0, "down")]
    with pytest.raises(ConfigError, match=r"layers\.2\.experts\.0: no candidate is left \(min K 3 for layer 2; "
                                          r"encoder K \[\], donors holding it: \['a'\]\)"):
        make_plan(tensors, ev, ErrorTable({}), Budget(stages=(Stage(0, 2, nbytes=high, text="all"),)), c,
                  donors=donors)


# -- through the CLI on tiny V4.1 donors ----------------------------------------------------------------------------
def safetensors_sizes(folder: Path) -> dict[str, int]:
    """Stored tensor name -> its bytes, from each file's header (read here, not through fidelity)."""
    out = {}
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                out[name] = info["data_offsets"][1] - info["data_offsets"][0]
    return out


def test_cli_donors_and_stage_budgets_on_tiny_v41(tmp_path, rng_seed, capsys):
    from fidelity.measuring.attribute import Settings, attribute
    from fidelity.cli import main as cli
    from fidelity.packs.exl3.encoder import EncodingCache
    from testkit.minipacks_v4 import V4MiniSpec, write_v4_minipack
    from testkit.minipacks_v41 import V41_SPEC, build_native_v41
    from fidelity.packs import open_pack

    rng = np.random.default_rng(rng_seed)
    native = build_native_v41(V4 / "tiny_v4", tmp_path / "native")
    cache = EncodingCache(V4 / "tiny_v4_encodings.safetensors")
    cache.entries.update(EncodingCache(V4 / "tiny_v4_plan_encodings.safetensors").entries)
    ref = open_pack(native)
    donors = {"k1": write_v4_minipack(ref, "deepseek_v41_exl3", tmp_path / "k1",
                                      V4MiniSpec(fp8_block=32, expert_k="1"), cache),
              "k3": write_v4_minipack(ref, "deepseek_v41_exl3", tmp_path / "k3",
                                      V4MiniSpec(fp8_block=32, expert_k="3"), cache),
              "mx": write_v4_minipack(ref, "fp8-mxfp4", tmp_path / "mx", V41_SPEC, cache)}
    rows = [rng.integers(0, 256, 40).tolist() for _ in range(8)]
    data = attribute(native, native, rows=rows, settings=Settings(modules="layer", noise_control=False)).to_json()
    (tmp_path / "attr.json").write_text(json.dumps(data, default=str))

    # each expert's bytes per donor, from the files' headers: its stored tensors are <official base>.<part>
    sizes = {label: safetensors_sizes(path) for label, path in donors.items()}

    def expert_bytes(label, L, e):
        base = f"layers.{L}.ffn.experts.{e}."
        return sum(v for n, v in sizes[label].items() if n.startswith(base))
    experts = [(L, e) for L in range(3) for e in range(4)]
    in_stage = {s: [(L, e) for L, e in experts if (L == 0) == (s == 0)] for s in (0, 1)}
    lo = {s: sum(min(expert_bytes(d, L, e) for d in donors) for L, e in in_stage[s]) for s in (0, 1)}
    hi = {s: sum(max(expert_bytes(d, L, e) for d in donors) for L, e in in_stage[s]) for s in (0, 1)}
    caps = {s: int(lo[s] + rng.uniform(0.3, 0.7) * (hi[s] - lo[s])) for s in (0, 1)}
    out = tmp_path / "plan"
    args = ["plan", str(native), "--from", str(tmp_path / "attr.json"), "--donors",
            *[f"{label}={path}" for label, path in donors.items()],
            "--stage-budgets", f"0:{caps[0]}B,1-2:{caps[1]}B", "-o", str(out)]
    assert cli(args) == 0
    doc = json.loads((out / "plan.json").read_text())
    s, recipe = doc["summary"], doc["tensors"]
    printed = capsys.readouterr().out
    print(printed)
    assert len(recipe) == 3 * 4 * 3 and all(r["source"] == "donor" for r in recipe)
    chosen = {}
    for r in recipe:
        chosen.setdefault((r["layer"], r["expert"]), set()).add(r["donor"])
    assert all(len(v) == 1 for v in chosen.values())                   # an expert's three matrices from one donor
    chosen = {key: v.pop() for key, v in chosen.items()}
    for i, st in enumerate(s["budget"]["stages"]):
        spent = sum(expert_bytes(d, L, e) for (L, e), d in chosen.items() if (L == 0) == (i == 0))
        assert spent == st["planned_bytes"] <= caps[i] == st["allowed_bytes"]
    # each donor tensor's error: the donor's decode against the reference, recomputed here
    for r in recipe[:: 7]:
        w = ref.tensor(r["tensor"]).double()
        got = open_pack(donors[r["donor"]]).tensor(r["donor_tensor"]).double()
        assert r["error"] == pytest.approx(float(((got - w) ** 2).sum() / (w ** 2).sum()), rel=1e-12)
        assert r["K"] == {"k1": 1, "k3": 3, "mx": None}[r["donor"]]
    sens = {x["layer"]: x["dkl_deps2"] for x in data["sensitivity"]}
    share = {(x["layer"], x["expert"]): x["energy_share_ref"] for x in data["routing"]}
    assert s["predicted_kl"] == pytest.approx(
        sum(sens[r["layer"]] * share[(r["layer"], r["expert"])] * r["error"] for r in recipe), rel=1e-9)
    written = (out / "exl3_moe_plan.json").exists()
    assert written == ("mx" not in chosen.values())
    if written:
        moe = json.loads((out / "exl3_moe_plan.json").read_text())
        assert moe["layers"] == {str(L): "".join(chosen[(L, e)][1] for e in range(4)) for L in range(3)}
    else:
        assert "stored as mxfp4, not EXL3" in s["exl3_moe_plan_not_written"]
    assert {w["donor"] for w in s["donors_whole"]} == set(donors)
    assert "stage 1-2" in printed and "donor mx" in printed

    # refusals through the CLI: exit 2, the stage and the numbers named
    capsys.readouterr()
    assert cli(args[:-4] + ["--stage-budgets", f"0:{caps[0]}B,1-2:{lo[1] - 1}B", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"stage 1-2 (1-2:{lo[1] - 1}B: {lo[1] - 1} bytes" in err and f"({lo[1]} bytes" in err, err
    assert cli(args[:-4] + ["--stage-budgets", f"0:{caps[0]}B", "-o", str(out)]) == 2
    assert "MoE layer(s) [1, 2] are in no stage" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        cli(args[:-4] + ["--budget", "3", "--stage-budgets", "0-2:1MB", "-o", str(out)])
    assert exit_.value.code == 2 and "not allowed with argument --budget" in capsys.readouterr().err


@pytest.mark.slow
def test_donor_plan_measured_against_uniform_and_whole_donors(tmp_path, rng_seed):
    """Seed 003 on the tiny V4.1: donors at K1 and K3 (EXL3) and MXFP4, stage budgets of uniform K2's bytes per
    stage (layer 0; layers 1-2), EXL3 donors only in the plan (so exl3_moe_plan.json states it and the pack is
    written from the donors' encodings); each plan's experts-only KL measured on held-out rows (each layer's routed
    experts swapped in alone, summed) against the prediction."""
    from fidelity.measuring.attribute import NOISE_LEVELS, Settings, attribute
    from fidelity.cli import main as cli
    from fidelity.packs import open_pack
    from fidelity.packs.exl3.encoder import EncodingCache
    from fidelity.plan import QUANTIZATION_LEVELS, expert_tensors
    from testkit.minipacks_v4 import V4MiniSpec, write_v4_minipack
    from testkit.minipacks_v41 import V41_SPEC, build_native_v41
    from test_plan import planned_spec

    rng = np.random.default_rng(rng_seed)
    native = build_native_v41(V4 / "tiny_v4", tmp_path / "native")
    cache = EncodingCache(V4 / "tiny_v4_encodings.safetensors")
    cache.entries.update(EncodingCache(V4 / "tiny_v4_plan_encodings.safetensors").entries)
    ref = open_pack(native)
    donors = {"k1": write_v4_minipack(ref, "deepseek_v41_exl3", tmp_path / "k1", V4MiniSpec(fp8_block=32, expert_k="1"),
                                      cache),
              "k3": write_v4_minipack(ref, "deepseek_v41_exl3", tmp_path / "k3", V4MiniSpec(fp8_block=32, expert_k="3"),
                                      cache),
              "mx": write_v4_minipack(ref, "fp8-mxfp4", tmp_path / "mx", V41_SPEC, cache)}
    calib = [rng.integers(0, 256, 48).tolist() for _ in range(12)]
    held_out = [rng.integers(0, 256, 48).tolist() for _ in range(24)]
    data = attribute(native, native, rows=calib, settings=Settings(
        modules="layer", noise_control=False, noise_levels=NOISE_LEVELS + QUANTIZATION_LEVELS)).to_json()
    (tmp_path / "attr.json").write_text(json.dumps(data, default=str))
    tensors = expert_tensors(ref)
    k2 = {s: sum(exl3_nbytes(t.shape, 2) for t in tensors if (t.layer == 0) == (s == 0)) for s in (0, 1)}
    out = tmp_path / "plan"
    assert cli(["plan", str(native), "--from", str(tmp_path / "attr.json"), "--donors", f"k1={donors['k1']}",
                f"k3={donors['k3']}", "--stage-budgets", f"0:{k2[0]}B,1-2:{k2[1]}B", "-o", str(out)]) == 0
    s = json.loads((out / "plan.json").read_text())["summary"]
    moe = json.loads((out / "exl3_moe_plan.json").read_text())
    assert [st["planned_bytes"] <= k2[i] for i, st in enumerate(s["budget"]["stages"])] == [True, True]
    # the MXFP4 donor's prediction, from a run that offers it too (its whole-donor row)
    assert cli(["plan", str(native), "--from", str(tmp_path / "attr.json"), "--donors",
                *[f"{label}={path}" for label, path in donors.items()], "--stage-budgets",
                f"0:{k2[0]}B,1-2:{k2[1]}B", "-o", str(tmp_path / "with_mx")]) == 0
    s_mx = json.loads((tmp_path / "with_mx" / "plan.json").read_text())["summary"]

    # seed 003's allocator at the same stage budgets: every expert from the K1 donor, then upgraded to K3 in
    # descending routing frequency (the reference's token counts) while the stage's budget holds
    counts = {(r["layer"], r["expert"]): r["counts_ref"] for r in data["routing"]}
    per_expert = {d: {(t.layer, t.expert): 0 for t in tensors} for d in (1, 3)}
    for t in tensors:
        for d in (1, 3):
            per_expert[d][(t.layer, t.expert)] += exl3_nbytes(t.shape, d)
    seed003 = {key: "1" for key in per_expert[1]}
    for i, (first, last) in enumerate(((0, 0), (1, 2))):
        spent = sum(per_expert[1][key] for key in seed003 if first <= key[0] <= last)
        for key in sorted((k for k in seed003 if first <= k[0] <= last), key=lambda k: (-counts[k], k)):
            step = per_expert[3][key] - per_expert[1][key]
            if spent + step <= k2[i]:
                seed003[key], spent = "3", spent + step
    seed003_moe = {"layers": {str(L): "".join(seed003[(L, e)] for e in range(4)) for L in range(3)}}

    misses = cache.misses
    planned = write_v4_minipack(ref, "deepseek_v41_exl3", tmp_path / "planned", planned_spec(moe), cache)
    by_frequency = write_v4_minipack(ref, "deepseek_v41_exl3", tmp_path / "seed003", planned_spec(seed003_moe), cache)
    uniform = write_v4_minipack(ref, "deepseek_v41_exl3", tmp_path / "uniform",
                                planned_spec({"layers": {L: "2222" for L in moe["layers"]}}), cache)
    assert cache.misses == misses
    # the planned pack's experts are the donors' tensors byte for byte
    a = safetensors_sizes(planned)
    for L, digits in moe["layers"].items():
        for e, d in enumerate(digits):
            base = f"layers.{L}.ffn.experts.{e}.w2"
            assert a[f"{base}.trellis"] == safetensors_sizes(donors[f"k{d}"])[f"{base}.trellis"]

    def experts_kl(path):
        a = attribute(native, path, rows=held_out, settings=Settings(modules="block", noise_control=False,
                                                                        sensitivity=False))
        return sum(r["kld_mean"] for r in a.swaps if r["group"].endswith(".experts"))
    measured = {"plan": experts_kl(planned), "seed 003": experts_kl(by_frequency), "uniform K2": experts_kl(uniform),
                **{f"donor {label}": experts_kl(path) for label, path in donors.items()}}
    rows = {w["donor"]: w for w in s_mx["donors_whole"]}
    k2_bpw = 8 * sum(k2.values()) / sum(t.numel for t in tensors)
    predicted = {"plan": (s["predicted_kl"], s["predicted_kl_curve"]["kl"], s["budget"]["planned_bpw"]),
                 **{f"donor {d}": (rows[d]["predicted_kl"], rows[d]["predicted_kl_curve"], rows[d]["bpw"])
                    for d in donors}}
    print(f"\n{'':10} {'bpw':>7} {'measured':>9} {'linear':>8} {'curve':>8}   plan {moe['layers']}, seed 003 "
          f"{seed003_moe['layers']}; with the MXFP4 donor offered the plan is {s_mx['units_per_K']} at "
          f"{s_mx['budget']['planned_bpw']:.4g} bpw")
    for name, kl in measured.items():
        lin, curve, bpw = predicted.get(name, (None, None, k2_bpw))
        print(f"{name:10} {bpw:7.4f} {kl:9.4g} " + (f"{lin:8.4g} {curve:8.4g}" if lin is not None else ""))
    assert measured["plan"] <= measured["seed 003"] * (1 + 1e-12)


def test_a_donor_of_another_model_or_with_bad_weights_is_refused_naming_the_tensor(tmp_path, rng_seed):
    """read_donors: a donor of another model (other shapes) or decoding to NaN is refused with its file and tensor,
    before any plan is made."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from fidelity.commands.plan import read_donors
    from fidelity.errors import PackError
    from fidelity.packs import open_pack
    from fidelity.plan import expert_tensors
    from test_oracle import make_moe
    from testkit.minipacks_v41 import build_native_v41

    native = build_native_v41(V4 / "tiny_v4", tmp_path / "native")
    ref = open_pack(native)
    tensors = expert_tensors(ref)
    _, qwen = make_moe(tmp_path, "qwen3moe-renorm-sparse-step", rng_seed)
    with pytest.raises(PackError, match=r"donor q: model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight has shape "
                                        r"\[20, 48\], the reference's layers\.0\.ffn\.experts\.0\.w1\.weight "
                                        r"\[64, 64\]"):
        read_donors(ref, tensors, [f"q={qwen.path}"])

    def edited(name, change):
        """A copy of the native pack with one expert tensor changed in its file."""
        out = tmp_path / name
        shutil.copytree(native, out)
        target = "layers.1.ffn.experts.2.w2.weight"
        for f in out.glob("*.safetensors"):
            ts = load_file(str(f))
            if target in ts:
                ts[target] = change(ts[target])
                save_file(ts, str(f), metadata={"format": "pt"})
                return out, f
        raise AssertionError(target)
    nan, nan_file = edited("nan", lambda w: w.index_put((torch.tensor([3]), torch.tensor([5])),
                                                       torch.tensor(float("nan"), dtype=w.dtype)))
    with pytest.raises(PackError,
                       match=r"donor nan: layers\.1\.ffn\.experts\.2\.w2\.weight decodes to non-finite") as e:
        read_donors(ref, tensors, [f"nan={nan}"])
    assert e.value.file == str(nan_file) and e.value.tensor == "layers.1.ffn.experts.2.w2.weight"
    # without decoding (the budget check before any decode) the same donor is read
    assert read_donors(ref, tensors, [f"nan={nan}"], measure=False)[0].tensors[(1, 2, "down")].error == 0.0
    with pytest.raises(ConfigError, match="label 'a' names two donors"):
        read_donors(ref, tensors, [f"a={native}", f"a={native}"])
