"""plan(): per routed expert (or expert tensor) an EXL3 K or a donor pack's tensor, from measured sensitivity x routing
share x per-candidate error, under a byte budget (or one per stage). Pure: the inputs are an `attribute` result (as
`Attribution.to_json()`), the reference's expert tensors and a table of per-K errors; nothing here runs a model or
an encoder (the command measures errors with the EXL3 reference encoder, fidelity/packs/exl3/encoder.py).

Model (definitions once, here). A unit u is one routed expert of layer L (its three matrices at one K: what the
`exl3_moe_plan.json` layout can state) or, per tensor, one matrix of it. Its predicted KL at K is

    kl_u(K) = S_L * a_Le * sum_{t in u} e_t(K)

- S_L: attribute's `dkl_deps2`, KL per eps^2 where eps = RMS of Gaussian noise added to layer L's MLP / routed output
  relative to that output's RMS (KL is quadratic in a small perturbation), refitted on the levels <= SMALL_NOISE
  where the attribution also measured larger ones;
- a_Le: expert e's `energy_share_ref`, its share of the layer's routed-output energy sum ||w_te E_e(x_t)||^2 on the
  reference's pass;
- e_t(K) = ||W_K - W||_F^2 / ||W||_F^2 of tensor t encoded at K by the EXL3 encoder ("measured"), or, where no encode
  was affordable, the rate model log e = a + b K (+ the tensor's own offset where it has measured points), fitted by
  least squares to the measured points ("rate_model"; fit and residual SD reported).
  It equates an expert's relative output error^2 with the sum of its matrices' relative weight errors^2 and the layer's
  routed energy with its MLP output energy (shared experts, cross terms between experts neglected).
- The plan's predicted KL is the sum over units (additivity: attribute's `summary.additivity` = sum of the groups'
  swap-one-in KL / the whole pack's KL says how well sums hold on the pack it measured).

Cost: the bytes EXL3 stores for t at K (trellis int16 [in_p/16, out_p/16, 16K] + fp16 suh [in_p] + svh [out_p] + the
codebook's 4-byte marker; padded to 128), as `Pack.bits_per_weight` counts them: budget in memory = 8 * sum bytes /
sum params of the routed experts (its `routed_experts` row); per decoded token each tensor counts with its expert's
measured share of the layer's tokens (`routed_experts_per_decoded_token_measured` with the attribution's reference
routing counts).

Solver: a multiple-choice knapsack. Each unit's (cost, kl) points are reduced to their lower convex hull; starting
from every unit at its lowest allowed K, the hull steps are taken in order of KL saved per byte (a step that no longer
fits is skipped, the unit stays there, later smaller steps of other units still fill the budget). On convex hulls
this is the LP relaxation's greedy (Sinha-Zoltners): its value with the first step that did not fit taken
fractionally is a lower bound on any integer plan, reported as `kl_lower_bound`; the plan is within
`optimality_gap` = predicted - lower bound of the best integer plan under the same model.

Donors and stages (fidelity/plan_donors.py): with donors a unit's candidates are also each donor's stored tensors
(cost: the donor's bytes, Storage.nbytes; error: measured against the reference), the option that `Plan.k` names by
the donor's label; a stage is a contiguous layer range with its own budget, and the stages are solved one by one (the
problem is separable across them); the lower bound and the predicted KL are the sums over stages.

Curve prediction and calibration: the linear rule above extrapolates the small-noise quadratic to quantization-size
errors (relative error^2 0.01..0.8), where KL grows far slower. Where the attribution measured KL at larger noise
levels (the command's own attribute run adds QUANTIZATION_LEVELS), `predicted_kl_curve` reads each layer's measured
KL(eps^2) at its load (sum of a_Le x the unit's error: its routed output's relative error^2), log-log between
levels; `calibration` scales it by measured / predicted on one measured plan (--calibrate K2=KL). The plan itself is
still chosen on the linear rule (on the tiny V4.1 it ranks plan and uniform as measured; the curve does not).

Uncertainty: where the attribution keeps each row's KL at each noise level (`sensitivity[].kld_row_sums`,
`summary.scored_per_row`), S_L is refitted on row-bootstrap draws (rows resampled once for every layer: the same
panel rows), the plan held fixed: `predicted_kl_ci95` (percentile). Not included: routing shares' sampling error, the
rate model's residual, and the model's own error (linearity at quantization-size errors, additivity), which the
predicted-vs-measured comparison of an encode shows.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
import numpy as np

from .errors import ConfigError
from .packs.base import tensor_role
from .packs.exl3.codec import HAD, Bitrate
from .packs.exl3.layouts import routed_expert
from .plan_donors import Donor, Stage, check_stages

CANDIDATES = tuple(range(1, 9))
ROLES = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
BOOTSTRAP = 2000
SMALL_NOISE = 2.0 ** -6      # S_L is fitted on the levels up to this eps; larger ones only shape the curve
# plan's own attribute run adds these eps to attribute's: relative error^2 of EXL3 K1..K4 routed outputs is ~0.8..0.01
QUANTIZATION_LEVELS = (0.1, 0.2, 0.4, 0.9)
MARKER_BYTES = {"mul1": 4, "mcg": 4, "3inst": 0}


def exl3_nbytes(shape: tuple[int, int], K: int, codebook: str = "mul1") -> int:
    """Bytes EXL3 stores for a [out, in] linear at K (without bias): trellis + suh + svh + the codebook marker."""
    out_f, in_f = shape
    in_p, out_p = -(-in_f // HAD) * HAD, -(-out_f // HAD) * HAD
    words = Bitrate.of(K).words
    return (in_p // 16) * (out_p // 16) * words * 2 + 2 * in_p + 2 * out_p + MARKER_BYTES[codebook]


@dataclass(frozen=True)
class ExpertTensor:
    name: str                 # the reference's name
    layer: int
    expert: int
    role: str                 # gate / up / down
    shape: tuple[int, int]

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


def expert_tensors(pack) -> list[ExpertTensor]:
    """The routed-expert matrices of the trunk (`layers.*`; a drafter's `mtp.*` experts are not planned), by layer,
    expert and role."""
    out = []
    for name in pack.names():
        shape = tuple(pack.storage(name).shape)
        where = routed_expert(name)
        if where is None or where[0] != "layers" or tensor_role(name, shape) != "routed_expert" or len(shape) != 2:
            continue
        module = name.removesuffix(".weight").rsplit(".", 1)[-1]
        if module not in ROLES:
            raise ConfigError(f"routed-expert tensor {name!r}: unknown matrix {module!r} "
                              f"(expected one of {sorted(ROLES)})")
        out.append(ExpertTensor(name, where[1], where[2], ROLES[module], shape))
    order = {"gate": 0, "up": 1, "down": 2}
    return sorted(out, key=lambda t: (t.layer, t.expert, order[t.role]))


# -- what attribute measured ----------------------------------------------------------------------------------------
@dataclass
class Evidence:
    """The attribution's numbers the plan uses, keyed by layer and (layer, expert)."""
    sensitivity: dict[int, float]
    energy_share: dict[tuple[int, int], float]
    token_share: dict[tuple[int, int], float]
    super_experts: dict[int, list[int]]
    additivity: float | None = None
    levels: list[float] | None = None                      # noise levels (eps)
    row_sums: dict[int, np.ndarray] | None = None          # layer -> [levels, rows] sum of KL per row
    scored_per_row: np.ndarray | None = None
    curves: dict[int, tuple[list[float], list[float]]] | None = None   # layer -> (eps^2 levels, KL at each)

    @classmethod
    def from_attribution(cls, data) -> "Evidence":
        data = data.to_json() if hasattr(data, "to_json") else data
        routing, layers = data.get("routing") or [], data.get("routing_layers") or []
        if not routing:
            raise ConfigError("the attribution has no routing table: it was measured on a model without routed experts "
                              "(or an older attribute): a plan needs per-expert routing")
        if not data.get("sensitivity"):
            raise ConfigError("the attribution has no sensitivity table (attribute was run with --no-sensitivity): a "
                              "plan needs each MoE layer's dKL/d(eps^2)")
        tokens = {r["layer"]: r["tokens"] for r in layers}
        sens = {r["layer"]: small_noise_slope(r) for r in data["sensitivity"]}
        bad = {k: v for k, v in sens.items() if not (math.isfinite(v) and v >= 0)}
        if bad:
            raise ConfigError(f"sensitivity dkl_deps2 must be finite and >= 0; layer(s) {bad}")
        ev = cls(sens, {(r["layer"], r["expert"]): float(r["energy_share_ref"]) for r in routing},
                 {(r["layer"], r["expert"]): r["counts_ref"] / tokens[r["layer"]] for r in routing},
                 {r["layer"]: list(r["super_experts_ref"]) for r in layers},
                 (data.get("summary") or {}).get("additivity"))
        ev.curves = {r["layer"]: ([float(x) ** 2 for x in r["levels"]], [float(k) for k in r["kld_mean"]])
                     for r in data["sensitivity"] if "levels" in r and "kld_mean" in r}
        per_row = (data.get("summary") or {}).get("scored_per_row")
        if per_row is not None and all("kld_row_sums" in r for r in data["sensitivity"]):
            levels = list(data["sensitivity"][0]["levels"])
            small = [j for j, eps in enumerate(levels) if eps <= SMALL_NOISE]
            ev.levels = [levels[j] for j in small]
            ev.row_sums = {r["layer"]: np.asarray(r["kld_row_sums"], dtype=np.float64)[small]
                           for r in data["sensitivity"]}
            ev.scored_per_row = np.asarray(per_row, dtype=np.float64)
        return ev


def small_noise_slope(row: dict) -> float:
    """S_L: attribute's dkl_deps2 where every level is small (<= SMALL_NOISE), else the same least-squares slope
    through the origin refitted on the small levels alone (quantization-size levels shape the curve, not S_L)."""
    levels = row.get("levels")
    if not levels or all(eps <= SMALL_NOISE for eps in levels):
        return float(row["dkl_deps2"])
    small = [(eps * eps, k) for eps, k in zip(levels, row["kld_mean"]) if eps <= SMALL_NOISE]
    if not small:
        raise ConfigError(f"layer {row['layer']}: attribute's noise levels {levels} have none <= {SMALL_NOISE:g}, "
                          f"where KL is quadratic: the plan's sensitivity needs one")
    e2 = np.array([x for x, _ in small])
    k = np.array([y for _, y in small])
    return float((e2 * k).sum() / (e2 * e2).sum())


# -- per-K errors ---------------------------------------------------------------------------------------------------
def relative_error(ref, approx) -> float:
    """||approx - ref||_F^2 / ||ref||_F^2 in float64."""
    r = ref.double()
    d = approx.double() - r
    den = float((r * r).sum())
    if den == 0:
        raise ConfigError("a weight of all zeros has no relative error")
    return float((d * d).sum()) / den


@dataclass
class RateModel:
    """log e = a + b K (+ offset[tensor]) fitted to measured points."""
    a: float
    b: float
    offsets: dict[str, float]
    residual_sd: float | None
    points: int

    @classmethod
    def fit(cls, measured: dict[tuple[str, int], float]) -> "RateModel":
        pts = [(name, K, math.log(e)) for (name, K), e in measured.items() if e > 0]
        if len({K for _, K, _ in pts}) < 2:
            raise ConfigError(f"the rate model needs measured errors at >= 2 values of K; have {len(pts)} point(s) at "
                              f"K {sorted({K for _, K, _ in pts})} (measure more: --measure)")
        K = np.array([p[1] for p in pts], dtype=np.float64)
        y = np.array([p[2] for p in pts])
        b, a = np.polyfit(K, y, 1)
        res = y - (a + b * K)
        offsets: dict[str, list[float]] = {}
        for (name, _, _), r in zip(pts, res):
            offsets.setdefault(name, []).append(float(r))
        within = res - np.array([np.mean(offsets[p[0]]) for p in pts])
        dof = len(pts) - 2 - len(offsets)
        sd = float(np.sqrt((res ** 2).sum() / (len(pts) - 2))) if len(pts) > 2 else None
        return cls(float(a), float(b), {n: float(np.mean(v)) for n, v in offsets.items()},
                   float(np.sqrt((within ** 2).sum() / dof)) if dof > 0 else sd, len(pts))

    def __call__(self, name: str, K: int) -> float:
        return math.exp(self.a + self.b * K + self.offsets.get(name, 0.0))

    def to_json(self) -> dict:
        return {"form": "log e = a + b K + offset[tensor]", "a": self.a, "b": self.b, "points": self.points,
                "residual_sd_log": self.residual_sd, "tensors_with_offset": len(self.offsets)}


class ErrorTable:
    """e_t(K): measured where measured, else the rate model fitted to the measured points."""

    def __init__(self, measured: dict[tuple[str, int], float]):
        bad = {k: v for k, v in measured.items() if not (math.isfinite(v) and v >= 0)}
        if bad:
            raise ConfigError(f"measured errors must be finite and >= 0: {dict(list(bad.items())[:3])}")
        self.measured = dict(measured)
        self.model: RateModel | None = None

    def __call__(self, name: str, K: int) -> tuple[float, str]:
        if (name, K) in self.measured:
            return self.measured[(name, K)], "measured"
        if self.model is None:
            self.model = RateModel.fit(self.measured)
        return self.model(name, K), "rate_model"


# -- settings -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Budget:
    """One budget over every routed expert (`bpw`), or one per stage (`stages`, plan_donors.parse_stage_budgets)."""
    bpw: float | None = None
    per_decoded_token: bool = False
    stages: tuple[Stage, ...] = ()

    @property
    def label(self) -> str:
        return "per decoded token" if self.per_decoded_token else "in memory"

    def resolved(self, layers: list[int]) -> tuple[Stage, ...]:
        if (self.bpw is None) == (not self.stages):
            raise ConfigError("give a budget in bpw (--budget) or per-stage budgets (--stage-budgets), one of them")
        if self.stages:
            check_stages(self.stages, layers, self.per_decoded_token)
            return self.stages
        if not (math.isfinite(self.bpw) and self.bpw > 0):
            raise ConfigError(f"budget {self.bpw:g} bpw: a budget is a positive number of bits per weight")
        return (Stage(min(layers), max(layers), bpw=self.bpw, text=f"{self.bpw:g}bpw"),)


@dataclass(frozen=True)
class Constraints:
    candidates: tuple[int, ...] = CANDIDATES
    keep_super_experts: int | None = None      # super experts fixed at this K
    min_k: dict[int, int] = field(default_factory=dict)   # layer -> lowest K allowed
    per_tensor: bool = False                   # one K per matrix (else per expert, the plan file's layout)
    codebook: str = "mul1"


def parse_min_k(specs: list[str]) -> dict[int, int]:
    """["37-39:3", "0,2:4"] -> {37: 3, 38: 3, 39: 3, 0: 4, 2: 4} (a layer named twice keeps the larger K)."""
    out: dict[int, int] = {}
    for spec in specs:
        layers, sep, k = spec.partition(":")
        try:
            K = int(k)
            chosen = []
            for part in layers.split(","):
                lo, dash, hi = part.partition("-")
                chosen += list(range(int(lo), int(hi) + 1)) if dash else [int(lo)]
        except ValueError:
            raise ConfigError(f"--min-k {spec!r}: expected LAYERS:K, e.g. 37-39:3 or 0,2:4") from None
        if not sep or not chosen:
            raise ConfigError(f"--min-k {spec!r}: expected LAYERS:K, e.g. 37-39:3 or 0,2:4")
        for L in chosen:
            out[L] = max(out.get(L, K), K)
    return out


# -- the plan -------------------------------------------------------------------------------------------------------
@dataclass
class Unit:
    key: str
    layer: int
    expert: int
    tensors: list[ExpertTensor]
    weight: float                  # S_L * a_Le
    cost_scale: float              # 1 in memory, the expert's token share per decoded token
    allowed: list                  # options: an int K (our encoder at K) or a str (the donor of that label)
    why: str                       # why `allowed` is what it is
    donors: dict = field(default_factory=dict)    # label -> [DonorTensor] in `tensors`' order

    def tensor_bytes(self, opt, codebook: str) -> list[int]:
        if isinstance(opt, str):
            return [d.nbytes for d in self.donors[opt]]
        return [exl3_nbytes(t.shape, opt, codebook) for t in self.tensors]

    def cost(self, opt, codebook: str) -> float:
        return self.cost_scale * sum(self.tensor_bytes(opt, codebook))

    def tensor_errors(self, opt, errors: ErrorTable) -> list[tuple[float, str]]:
        if isinstance(opt, str):
            return [(d.error, "measured") for d in self.donors[opt]]
        return [errors(t.name, opt) for t in self.tensors]

    def error(self, opt, errors: ErrorTable) -> float:
        return sum(e for e, _ in self.tensor_errors(opt, errors))

    def k_of(self, opt) -> list[int | None]:
        """The EXL3 K of each tensor under this option (None: a donor tensor that is not EXL3 at an integer K)."""
        if isinstance(opt, str):
            return [d.K for d in self.donors[opt]]
        return [opt] * len(self.tensors)


@dataclass
class Plan:
    k: dict[str, int | str]            # tensor name -> its option: K (our encoder) or a donor's label
    units: list[Unit]
    tensors: list[ExpertTensor]
    summary: dict
    recipe: list[dict]

    def exl3_k(self) -> dict[str, int | None]:
        """tensor name -> the EXL3 K it is stored at under the plan (None: a donor tensor in another format)."""
        out = {}
        for u in self.units:
            out.update(zip((t.name for t in u.tensors), u.k_of(self.k[u.tensors[0].name])))
        return out

    def moe_plan_refusal(self) -> str | None:
        """Why `exl3_moe_plan.json` cannot state this plan, or None."""
        ks = self.exl3_k()
        other = next((t for t in self.tensors if ks[t.name] is None), None)
        if other is not None:
            u = next(u for u in self.units if other in u.tensors)
            d = u.donors[self.k[other.name]][u.tensors.index(other)]
            return (f"{other.name} comes from donor {d.donor}'s {d.name}, stored as {d.format}, not EXL3 at an integer "
                    f"K: exl3_moe_plan.json states EXL3 K only (plan.json's tensors[] names each tensor's donor)")
        per: dict[tuple[int, int], set] = {}
        for t in self.tensors:
            per.setdefault((t.layer, t.expert), set()).add(ks[t.name])
        mixed = next((key for key, v in per.items() if len(v) > 1), None)
        if mixed is not None:
            return (f"layer {mixed[0]} expert {mixed[1]}'s matrices have different K {sorted(per[mixed])}; the "
                    f"deepseek_v41_exl3 layout states one K per expert (write the recipe in a self-describing layout)")
        return None

    def moe_plan(self) -> dict | None:
        """`exl3_moe_plan.json` (the deepseek_v41_exl3 layout: per layer one digit per expert, a drafter section),
        or None when it cannot state the plan (`moe_plan_refusal`)."""
        if self.moe_plan_refusal() is not None:
            return None
        ks = self.exl3_k()
        per: dict[int, dict[int, set[int]]] = {}
        for t in self.tensors:
            per.setdefault(t.layer, {}).setdefault(t.expert, set()).add(ks[t.name])
        layers = {}
        for L, experts in sorted(per.items()):
            n = max(experts) + 1
            if sorted(experts) != list(range(n)):
                raise ConfigError(f"layer {L}: routed experts {sorted(experts)} are not numbered 0..{n - 1}")
            layers[str(L)] = "".join(str(next(iter(experts[e]))) for e in range(n))
        return {"layers": layers, "drafter": {"layers": {}}}


def _units(tensors, evidence: Evidence, budget: Budget, c: Constraints, donors: list[Donor] = ()) -> list[Unit]:
    groups: dict[tuple, list[ExpertTensor]] = {}
    for t in tensors:
        groups.setdefault((t.layer, t.expert) + ((t.role,) if c.per_tensor else ()), []).append(t)
    layers = sorted({t.layer for t in tensors})
    missing = [L for L in layers if L not in evidence.sensitivity]
    if missing:
        raise ConfigError(f"the attribution has no sensitivity for MoE layer(s) {missing} (attribute "
                          f"--sensitivity-layers left them out); measured: {sorted(evidence.sensitivity)}")
    unrouted = sorted({(t.layer, t.expert) for t in tensors} - set(evidence.energy_share))
    if unrouted:
        raise ConfigError(f"the attribution has no routing for expert(s) (layer, expert) {unrouted[:5]}: it was "
                          f"measured on another model")
    out_of_range = sorted(set(c.min_k) - set(layers))
    if out_of_range:
        raise ConfigError(f"--min-k names layer(s) {out_of_range} that have no routed experts; MoE layers: {layers}")
    donor_ks = {d.K for donor in donors for d in donor.tensors.values() if d.K is not None}
    largest = max(set(c.candidates) | donor_ks, default=None)
    for L, K in c.min_k.items():
        if largest is None or K > largest:
            raise ConfigError(f"--min-k {L}:{K} is above the largest candidate K {largest}")
    keep = c.keep_super_experts
    if keep is not None and keep not in set(c.candidates) | donor_ks:
        raise ConfigError(f"--keep-super-experts {keep} is not among the candidate K {list(c.candidates)}"
                          + (f" or the donors' EXL3 K {sorted(donor_ks)}" if donors else ""))
    units = []
    for key, ts in groups.items():
        L, e = key[0], key[1]
        held = {donor.label: [donor.tensors[(t.layer, t.expert, t.role)] for t in ts] for donor in donors
                if all((t.layer, t.expert, t.role) in donor.tensors for t in ts)}
        options: list = list(c.candidates) + list(held)

        def ks(opt, held=held):
            return [d.K for d in held[opt]] if isinstance(opt, str) else [opt]

        floor = c.min_k.get(L)
        allowed = [o for o in options if floor is None or all(k is not None and k >= floor for k in ks(o))]
        why = f"min K {floor} for layer {L}" if floor is not None else ""
        if keep is not None and e in evidence.super_experts.get(L, []):
            if floor is not None and keep < floor:
                raise ConfigError(f"conflicting constraints: layer {L} expert {e} is a super expert kept at K{keep}, "
                                  f"but --min-k asks K >= {floor} for layer {L}")
            allowed = [o for o in options if all(k == keep for k in ks(o))]
            why = f"super expert (energy share {evidence.energy_share[(L, e)]:.3g}) kept at K{keep}"
        name = f"layers.{L}.experts.{e}" + (f".{key[2]}" if c.per_tensor else "")
        if not allowed:
            raise ConfigError(f"{name}: no candidate is left (" + (why or "no encoder K and no donor holds it") +
                              f"; encoder K {list(c.candidates)}, donors holding it: {sorted(held) or 'none'})")
        scale = evidence.token_share[(L, e)] if budget.per_decoded_token else 1.0
        units.append(Unit(name, L, e, ts, evidence.sensitivity[L] * evidence.energy_share[(L, e)], scale, allowed, why,
                          held))
    return units


def _hull(points: list[tuple[int, float, float]]) -> list[tuple[int, float, float]]:
    """Lower convex hull of (K, cost, kl) sorted by cost, keeping only steps that lower kl."""
    pts = sorted(points, key=lambda p: (p[1], p[2]))
    hull: list[tuple[int, float, float]] = []
    for p in pts:
        if hull and p[2] >= hull[-1][2]:
            continue                              # costs more, saves nothing
        while len(hull) >= 2:
            (_, c1, k1), (_, c2, k2) = hull[-2], hull[-1]
            # drop hull[-1] if it lies on or above the segment hull[-2] -> p
            if (k2 - k1) * (p[1] - c1) >= (p[2] - k1) * (c2 - c1):
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


def make_plan(tensors: list[ExpertTensor], evidence: Evidence, errors: ErrorTable, budget: Budget,
              constraints: Constraints = Constraints(), *, donors: list[Donor] = (),
              calibration: tuple[str, float] | None = None, seed: int = 0) -> Plan:
    """The plan minimising predicted KL under `budget`, each stage within its own (see the module docstring)."""
    c = constraints
    if not tensors:
        raise ConfigError("the reference has no routed-expert tensors to plan")
    bad = [K for K in c.candidates if K not in CANDIDATES]
    if bad or not (c.candidates or donors):
        raise ConfigError(f"candidate K {list(c.candidates)}: EXL3 K per expert is an integer 1..8 (one digit in "
                          f"exl3_moe_plan.json); {bad} are not" if bad else "no candidates: give encoder K "
                          "(--candidates) or --donors")
    units = _units(tensors, evidence, budget, c, donors)
    stages = budget.resolved(sorted({u.layer for u in units}))
    k, solved = {}, []
    for stage in stages:
        mine = [u for u in units if stage.holds(u.layer)]
        chosen, arithmetic = _solve_stage(mine, stage, budget, c, errors, single=not budget.stages)
        k.update(chosen)
        solved.append(arithmetic)
    return _finish(k, units, tensors, evidence, errors, budget, c, solved, calibration, seed)


def _solve_stage(units: list[Unit], stage: Stage, budget: Budget, c: Constraints, errors: ErrorTable,
                 single: bool) -> tuple[dict, dict]:
    """The greedy on the units' hulls within the stage's budget: (tensor -> option, the stage's budget arithmetic)."""
    params = sum((u.cost_scale * t.numel) for u in units for t in u.tensors)
    allowed_bytes = stage.allowed_bytes(params)
    tol = 1e-12 * max(allowed_bytes, 1.0)
    table = {i: _hull([(o, u.cost(o, c.codebook), u.weight * u.error(o, errors)) for o in u.allowed])
             for i, u in enumerate(units)}
    low = sum(min(u.cost(o, c.codebook) for o in u.allowed) for u in units)
    high = sum(max(u.cost(o, c.codebook) for o in u.allowed) for u in units)
    bpw = lambda b: 8 * b / params if params else float("nan")     # noqa: E731
    per_token = " per token" if budget.per_decoded_token else ""
    what = (f"budget {budget.bpw:g} bpw ({budget.label})" if single else
            f"stage {stage.layers} ({stage.text}: {allowed_bytes:.0f} bytes{per_token} = {bpw(allowed_bytes):.6g} bpw "
            f"{budget.label})")
    if allowed_bytes < low - tol:
        raise ConfigError(f"{what} is below the smallest plan the constraints allow: {bpw(low):.6g} bpw "
                          f"({low:.0f} bytes{per_token}, every unit at its lowest allowed K)")
    if allowed_bytes > high + tol:
        raise ConfigError(f"{what} is above the largest plan the candidate K {list(c.candidates)}"
                          f"{' and donors' if any(u.donors for u in units) else ''} allow: {bpw(high):.6g} bpw "
                          f"({high:.0f} bytes, every unit at its highest allowed K)")

    # greedy on the hulls: every unit at its cheapest hull point
    at = {i: 0 for i in table}
    spent = sum(table[i][0][1] for i in table)
    kl = sum(table[i][0][2] for i in table)
    heap = [(-(h[0][2] - h[1][2]) / max(h[1][1] - h[0][1], 1e-300), i) for i, h in table.items() if len(h) > 1]
    heapq.heapify(heap)
    lower_bound = None
    while heap:
        _, i = heapq.heappop(heap)
        h, j = table[i], at[i]
        step_cost, step_gain = h[j + 1][1] - h[j][1], h[j][2] - h[j + 1][2]
        if spent + step_cost > allowed_bytes + tol:
            if lower_bound is None:       # the LP relaxation takes this step's fitting fraction and stops
                lower_bound = kl - step_gain * max(allowed_bytes - spent, 0.0) / step_cost
            continue
        spent, kl, at[i] = spent + step_cost, kl - step_gain, j + 1
        if j + 2 < len(h):
            heapq.heappush(heap, (-(h[j + 1][2] - h[j + 2][2]) / max(h[j + 2][1] - h[j + 1][1], 1e-300), i))
    if lower_bound is None:
        lower_bound = kl                  # every useful step fitted: the plan is the unconstrained optimum
    chosen = {t.name: table[i][at[i]][0] for i, u in enumerate(units) for t in u.tensors}
    arithmetic = {"layers": stage.layers, "budget": stage.text, "params": params, "allowed_bytes": allowed_bytes,
                  "planned_bytes": spent, "planned_bpw": bpw(spent), "unused_bytes": allowed_bytes - spent,
                  "smallest_plan_bpw": bpw(low), "largest_plan_bpw": bpw(high), "smallest_plan_bytes": low,
                  "largest_plan_bytes": high, "predicted_kl": kl, "kl_lower_bound": lower_bound}
    return chosen, arithmetic


def predicted_kl(k: dict, units: list[Unit], errors: ErrorTable) -> float:
    return sum(u.weight * u.error(k[u.tensors[0].name], errors) for u in units)


def layer_loads(k: dict[str, int], units: list[Unit], evidence: Evidence, errors: ErrorTable) -> dict[int, float]:
    """Per layer sum over its units of a_Le * e(K): predicted KL = sum_L S_L * load_L."""
    out: dict[int, float] = {}
    for u in units:
        share = evidence.energy_share[(u.layer, u.expert)]
        out[u.layer] = out.get(u.layer, 0.0) + share * u.error(k[u.tensors[0].name], errors)
    return out


def curve_kl(curve: tuple[list[float], list[float]], load: float) -> tuple[float, str]:
    """KL at relative error^2 `load` from a layer's measured (eps^2, KL) points: straight lines in log-log between
    them; below the smallest level KL proportional to eps^2 (the small-noise rule); above the largest the last
    segment's log-log slope, extrapolated. Returns (KL, "inside" | "below" | "extrapolated")."""
    pts = sorted((x, k) for x, k in zip(*curve) if x > 0 and k > 0)
    if load <= 0 or not pts:
        return 0.0, "inside" if load <= 0 else "below"
    if load <= pts[0][0]:
        return pts[0][1] * load / pts[0][0], "below" if load < pts[0][0] else "inside"
    if len(pts) == 1:
        return pts[0][1] * load / pts[0][0], "extrapolated"
    for (x0, k0), (x1, k1) in zip(pts, pts[1:]):
        if load <= x1:
            break
    slope = math.log(k1 / k0) / math.log(x1 / x0)
    return k0 * (load / x0) ** slope, "inside" if load <= x1 else "extrapolated"


def curve_prediction(assignment: dict, units: list[Unit], evidence: Evidence, errors: ErrorTable) -> dict | None:
    """The plan's KL as sum over layers of the layer's measured KL curve at its load (sum of energy share x relative
    error^2 of its units: the relative error^2 of its routed output), or None without curves."""
    if not evidence.curves:
        return None
    loads = layer_loads(assignment, units, evidence, errors)
    if any(L not in evidence.curves for L in loads):
        return None
    layers = {}
    for L, load in sorted(loads.items()):
        kl, where = curve_kl(evidence.curves[L], load)
        layers[str(L)] = {"load": load, "kl": kl, "where": where,
                          "levels_eps2": [min(evidence.curves[L][0]), max(evidence.curves[L][0])]}
    return {"kl": sum(v["kl"] for v in layers.values()), "layers": layers}


def sensitivity_draws(evidence: Evidence, n: int = BOOTSTRAP,
                      seed: int = 0) -> tuple[dict[int, np.ndarray] | None, str]:
    """Row-bootstrap draws of S_L (the same resampled rows for every layer), or (None, why not)."""
    if evidence.row_sums is None:
        return None, ("the attribution keeps no per-row sensitivity KL (sensitivity[].kld_row_sums, "
                      "summary.scored_per_row): rerun attribute")
    rows = evidence.scored_per_row
    if len(rows) < 2:
        return None, f"{len(rows)} row(s): a row bootstrap needs >= 2"
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(rows), (n, len(rows)))
    e2 = np.asarray(evidence.levels, dtype=np.float64) ** 2
    positions = rows[idx].sum(1)                                     # [n]
    out = {}
    for L, sums in evidence.row_sums.items():
        means = sums[:, idx].sum(2) / positions                      # [levels, n]
        out[L] = (e2[:, None] * means).sum(0) / (e2 * e2).sum()
    return out, ""


def _finish(k, units, tensors, evidence, errors, budget, c, solved: list[dict], calibration, seed) -> Plan:
    params = sum(s["params"] for s in solved)
    allowed_bytes = sum(s["allowed_bytes"] for s in solved)
    spent = sum(s["planned_bytes"] for s in solved)
    kl = sum(s["predicted_kl"] for s in solved)
    lower_bound = sum(s["kl_lower_bound"] for s in solved)
    bpw = lambda b: 8 * b / params          # noqa: E731
    draws, why = sensitivity_draws(evidence, seed=seed)

    def ci(assignment):
        if draws is None:
            return None
        loads = layer_loads(assignment, units, evidence, errors)
        total = sum(draws[L] * load for L, load in loads.items())
        return [float(np.quantile(total, 0.025)), float(np.quantile(total, 0.975))]

    def whole(opt) -> dict:
        """Every unit at one option (constraints ignored): its bytes, predicted KL, and whether each stage fits."""
        holding = [u for u in units if not isinstance(opt, str) or opt in u.donors]
        if len(holding) < len(units):
            return {"bytes": None, "predicted_kl": None, "fits_budget": False,
                    "missing": f"holds {len(holding)} of {len(units)} units"}
        assign = {t.name: opt for t in tensors}
        cost = sum(u.cost(opt, c.codebook) for u in units)
        fits = all(sum(u.cost(opt, c.codebook) for u in units if _stage_of(u, budget, solved) == s["layers"])
                   <= s["allowed_bytes"] * (1 + 1e-12) for s in solved)
        curve = curve_prediction(assign, units, evidence, errors)
        return {"bpw": bpw(cost), "bytes": cost, "predicted_kl": predicted_kl(assign, units, errors),
                "predicted_kl_ci95": ci(assign), "predicted_kl_curve": curve and curve["kl"], "fits_budget": fits}

    uniform = [{"K": K, **whole(K)} for K in c.candidates]
    labels = list(dict.fromkeys(label for u in units for label in u.donors))
    donors_whole = [{"donor": label, **whole(label)} for label in labels]
    curve = curve_prediction(k, units, evidence, errors)
    calibrated = _calibrate(calibration, curve, uniform + donors_whole)
    sources = {}
    recipe = []
    for u in units:
        opt = k[u.tensors[0].name]
        nbytes, errs, ks = u.tensor_bytes(opt, c.codebook), u.tensor_errors(opt, errors), u.k_of(opt)
        for i, t in enumerate(u.tensors):
            e, src = errs[i]
            sources[src] = sources.get(src, 0) + 1
            row = {"tensor": t.name, "layer": t.layer, "expert": t.expert, "role": t.role, "K": ks[i],
                   "source": "donor" if isinstance(opt, str) else "encoder",
                   "shape": list(t.shape), "bytes": nbytes[i],
                   "token_share": evidence.token_share[(t.layer, t.expert)],
                   "sensitivity": evidence.sensitivity[t.layer],
                   "energy_share": evidence.energy_share[(t.layer, t.expert)],
                   "error": e, "error_source": src, "predicted_kl": u.weight * e,
                   "constraint": u.why or None}
            if isinstance(opt, str):
                d = u.donors[opt][i]
                row.update({"donor": d.donor, "donor_tensor": d.name, "donor_format": d.format,
                            "donor_files": list(d.files)})
            recipe.append(row)
    order = {t.name: i for i, t in enumerate(tensors)}
    recipe.sort(key=lambda r: order[r["tensor"]])
    model = errors.model
    counts: dict[str, int] = {}
    for u in units:
        opt = k[u.tensors[0].name]
        key = f"donor:{opt}" if isinstance(opt, str) else str(opt)
        counts[key] = counts.get(key, 0) + 1
    summary = {
        "method": "multiple-choice knapsack: greedy by predicted KL saved per byte on each unit's lower convex hull "
                  "(exact for the LP relaxation; kl_lower_bound bounds every integer plan)" +
                  ("; each stage solved within its own budget" if budget.stages else ""),
        "granularity": "tensor" if c.per_tensor else "expert",
        "budget": {"bpw": budget.bpw, "basis": budget.label, "params": params, "allowed_bytes": allowed_bytes,
                   "planned_bytes": spent, "planned_bpw": bpw(spent), "unused_bytes": allowed_bytes - spent,
                   "smallest_plan_bpw": bpw(sum(s["smallest_plan_bytes"] for s in solved)),
                   "largest_plan_bpw": bpw(sum(s["largest_plan_bytes"] for s in solved)),
                   "bytes_per_tensor": "encoder K: trellis int16 [in_p/16, out_p/16, 16K] + suh fp16 [in_p] + svh "
                                       f"fp16 [out_p] + {MARKER_BYTES[c.codebook]}-byte {c.codebook} marker, "
                                       "in_p/out_p "
                                       "padded to 128" + ("; donor: the bytes the donor stores for the tensor, side "
                                                          "tensors included (Pack.storage().nbytes)" if labels else ""),
                   "params_are": "logical out x in of each routed-expert matrix" + (
                       ", times its expert's token share" if budget.per_decoded_token else ""),
                   **({"stages": solved} if budget.stages else {})},
        "constraints": {"candidates": list(c.candidates), "keep_super_experts": c.keep_super_experts,
                        "min_k": {str(L): K for L, K in sorted(c.min_k.items())},
                        "super_experts": {str(L): v for L, v in sorted(evidence.super_experts.items()) if v}},
        "units_per_K": dict(sorted(counts.items())),
        "predicted_kl": kl,
        "predicted_kl_check": predicted_kl(k, units, errors),
        "predicted_kl_ci95": ci(k),
        "predicted_kl_ci95_unavailable": why or None,
        "uncertainty_included": None if draws is None else
        "row bootstrap of each layer's sensitivity (plan held fixed)",
        "uncertainty_not_included": "routing shares' sampling error; the rate model's residual; the model's own error "
                                    "(quadratic KL at quantization-size errors, additivity across units)",
        "predicted_kl_curve": curve,
        "calibration": calibrated,
        "kl_lower_bound": lower_bound,
        "optimality_gap": kl - lower_bound,
        "uniform": uniform,
        **({"donors_whole": donors_whole} if labels else {}),
        "errors": {"sources": sources, "rate_model": model.to_json() if model is not None else None,
                   "measured_points": len(errors.measured)},
        "additivity": evidence.additivity,
        "assumptions": "kl_u(K) = S_L * energy_share * sum of the unit's relative weight errors^2; units add "
                       "(attribute's additivity measures it on its pack); routed energy = MLP output energy",
    }
    return Plan(k, units, tensors, summary, recipe)


def _calibrate(calibration: tuple[str, float] | None, curve: dict | None, rows: list[dict]) -> dict | None:
    """One scale on the curve prediction, fitted to one measured plan (a uniform K or a whole donor): measured KL /
    its curve prediction; each row and the plan get `calibrated` = scale x curve prediction."""
    if calibration is None:
        return None
    which, measured = calibration
    if not (math.isfinite(measured) and measured > 0):
        raise ConfigError(f"--calibrate {which}={measured!r}: the measured KL must be a positive number")
    if curve is None:
        raise ConfigError("--calibrate scales the curve prediction, which needs each layer's measured KL at its noise "
                          "levels (attribute's sensitivity[].kld_mean)")
    names = {(f"K{r['K']}" if "K" in r else r["donor"]): r for r in rows}
    row = names.get(which)
    if row is None or row.get("predicted_kl_curve") is None:
        raise ConfigError(f"--calibrate {which}: not a plan this run predicts; one of {sorted(names)}")
    scale = measured / row["predicted_kl_curve"]
    for r in rows:
        r["predicted_kl_calibrated"] = None if r.get("predicted_kl_curve") is None else scale * r["predicted_kl_curve"]
    return {"on": which, "measured_kl": measured, "predicted_kl_curve": row["predicted_kl_curve"], "scale": scale,
            "predicted_kl_calibrated": scale * curve["kl"],
            "note": "one scale fitted to one measured plan; it corrects the curve's level, not its shape"}


def _stage_of(u: Unit, budget: Budget, solved: list[dict]) -> str:
    if not budget.stages:
        return solved[0]["layers"]
    return next(s.layers for s in budget.stages if s.holds(u.layer))
