"""attribute(): where a pack's error comes from, on the streamed oracle.

One streamed pass of the reference keeps every layer's input, so a variant (the reference with one module group's
tensors taken from the pack, or with noise injected at one layer) re-runs only from the first layer it changes.
Reported (definitions once, here):

- swap-one-in (exllamav3 `model_diff_attrib`'s): for each module group, the reference with only that group's tensors
  read from the pack (groups name tensors as the reference's oracle reads them, `tensors[].pack_tensor` as the pack's
  does: each family resolves its own pack's names, paired in order; a V4.1 Engram table, `layers.L.engram.embed`,
  belongs to its layer's `engram` group); the whole pack is the pack's own oracle, as compare runs it; `kld_mean` = mean
  over scored positions of KL(P_ref || Q_variant) (nats, `fidelity.measuring.metrics`), `share` = its KL / the sum over
  groups, `additivity` = sum of the groups' KL / the whole pack's KL. The noise control replaces each of the group's
  tensors W by W + N with N isotropic Gaussian scaled to exactly ||W_pack - W_ref||_F (`noise_kld_each` per draw,
  `noise_kld_mean` their mean, `x_noise` = kld_mean / noise_kld_mean).
  `x_noise_ci`: a 95 % percentile bootstrap interval of x_noise, resampling rows (paired: the same rows for the pack
  and the control) and the control's draws (needs >= 2 of each); `kl_vs_noise` says "more harmful" / "less harmful"
  when the interval lies above / below 1, "not separable" when it holds 1.
  By KL at equal norm, real quantization error is often NOT separable from isotropic noise (SmolLM2 Q2_K MLPs: x_noise
  0.35-1.28 over layers 3-26 and three draws of 4 random-token rows, direction changing with the layer and, on some
  layers, the rows; layer 11 is 0.35 for every draw). What separates them is structure:
  `err_scale_corr` = Pearson r, over groups of ERROR_GROUP consecutive weights along a row, between the error's RMS
  and the weight's max |w| in the group (a blockwise quantizer's step follows its block's scale; noise independent of W
  has r ~ N(0, 1/n_groups)); per tensor in `tensors`, per group pooled over its 2-D tensors as
  sum(r_i n_i) / sum(n_i), with `err_scale_z` = sum(r_i n_i) / sqrt(sum(n_i)) (~ N(0, 1) under that null; Stouffer);
  `noise_err_scale_corr` / `noise_err_scale_z`: the same for the control's first draw (SmolLM2 Q2_K MLPs: r 0.23-0.89
  per tensor, z > 100; the control |z| < 4). exllamav3's model_diff_attrib controls in activation space instead
  (`Settings.activation_control`, groups within one layer): the reference's output of that layer plus Gaussian noise
  with the real error's norm at every position (and hc stream), re-run from the next layer: `act_kld_each` /
  `act_kld_mean`, `x_act` = kld_mean / act_kld_mean, `x_act_ci`, `kl_vs_act` as for x_noise. Measured on the same
  MLPs: real / control 0.72-1.92 over layers 3-26 (1.2-1.6 on 12-20), so not separable everywhere either.
- layer divergence along one pass of each (both streamed from the same tokens): after each layer, over every
  position, `rel_fro` = ||H_pack - H_ref||_F / ||H_ref||_F, `sqnr_db` = 10 log10(||H_ref||^2 / ||H_pack - H_ref||^2),
  `cosine` = mean over positions of cos(h_pack, h_ref); per tensor the same rel_fro and SQNR of W_pack vs W_ref.
  Hyper-connection models (DeepSeek V4: the residual is [tokens, hc, hidden]): `layers` pools the hc streams (every
  (position, stream) is a vector), `layer_streams` gives the same three numbers for each stream alone.
- routing (MoE): per layer and expert, token counts, `weight_share` (the expert's share of the layer's routing
  weights), `energy_share` (its share of sum ||w_te E_e(x_t)||^2, the routed output's energy); `jaccard` per token =
  |top-k_ref & top-k_pack| / |top-k_ref | top-k_pack| (each side on its own pass); super experts: energy share >= a
  threshold; the pack's routing-weighted bits per weight (`Pack.bits_per_weight(routing=...)`).
- sensitivity: per layer, Gaussian noise of RMS eps * RMS(out) added to the layer's MLP / routed-experts output (the
  sub-block its class declares in SUB_BLOCKS as "mlp"), at two or three eps: KL per level, `dkl_deps2` = the
  least-squares slope of KL on eps^2 through the origin (KL is quadratic in a small perturbation) and `loglog_slope`;
  `kld_row_sums` [level][row]: each row's sum of KL over its scored positions (`summary.scored_per_row`), so a row
  bootstrap can refit the slope (`fidelity.plan`).
- engram_access (V4.1): per Engram table, on the reference's pass (rows hash token ids only, the pack's are the same):
  `lookups` (tokens x n-gram lengths x heads), `distinct_rows`, and the coverage curve: the top N most-read rows'
  share of the lookups at N = 1, 10, 100, ..., 1 % and 10 % of the distinct rows, and all of them (1).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm
import pandas as pd

from ..errors import ConfigError, PackError
from ..oracle import Oracle
from ..pack_settings import PackSettings
from ..packs import open_pack
from ..packs.config_check import check_against_config
from .attribute_divergence import (WeightErrors, error_scale_corr, hidden_divergence, pooled_scale_corr,
                                   stream_divergence)
from .attribute_groups import LAYER, first_layer, module_groups, one_layer, table_layer, table_name
from .attribute_routing import RoutingRecorder, routing_tables
from .attribute_trunk import Reader, Trunk
from .compare import check_same_vocab, prepare
from .engram_access import EngramAccess
from .metrics import MetricKernel
from .noise_floor import sub_blocks
from .store import scored_index

CI_BOOTSTRAP = 2000
NOISE_LEVELS = (2.0 ** -10, 2.0 ** -8, 2.0 ** -6)   # bf16 rounding (2^-8) in the middle; larger levels flip
# routing choices on MoE models, where KL stops being quadratic (tiny V4: quadratic to 1e-2, not at 1e-1)
SUPER_EXPERT_SHARE = 0.2

@dataclass
class Settings:
    modules: str = "block"                       # layer: one group per layer; block: attention / router / experts /
                                                 # shared experts / MLP per layer; expert: each routed expert alone
    groups: list[str] | None = None              # only these groups (names as `module_groups` gives them)
    noise_control: bool = True
    noise_repeats: int = 3                       # isotropic controls, each with its own noise draw (>= 2: x_noise_ci)
    activation_control: bool = False             # also exllamav3's control at the group's layer output (one-layer
                                                 # groups; noise_repeats draws)
    sensitivity: bool = True
    noise_levels: tuple = NOISE_LEVELS
    sensitivity_layers: list[int] | None = None  # only these layers (default all)
    super_expert_share: float = SUPER_EXPERT_SHARE
    seed: int = 0
    keep_layers: bool | None = None              # None: when the reference's layers fit in KEEP_LAYERS_BYTES
    numerics: str = "exact"                      # the oracles' (fidelity.numerics); under "deepseek" a swapped

@dataclass
class Attribution:
    """Tables as lists of row dicts (`pandas.DataFrame(result.swaps)`, `pyarrow.Table.from_pylist`) and `to_json()`."""
    summary: dict
    swaps: list[dict] = field(default_factory=list)
    layers: list[dict] = field(default_factory=list)
    layer_streams: list[dict] = field(default_factory=list)     # hyper-connection models: per layer and stream
    tensors: list[dict] = field(default_factory=list)
    routing: list[dict] = field(default_factory=list)           # per layer and expert
    routing_layers: list[dict] = field(default_factory=list)    # per layer: agreement, super experts
    sensitivity: list[dict] = field(default_factory=list)
    engram_access: list[dict] = field(default_factory=list)     # per Engram table: lookups, coverage curve

    def table(self, name: str):
        return pd.DataFrame(getattr(self, name))

    def to_json(self) -> dict:
        return {
            "summary": self.summary,
            "swaps": self.swaps,
            "layers": self.layers,
            "layer_streams": self.layer_streams,
            "tensors": self.tensors,
            "routing": self.routing,
            "routing_layers": self.routing_layers,
            "sensitivity": self.sensitivity,
            "engram_access": self.engram_access,
        }

class NoisyTable:
    """An Engram table with a fixed noise tensor [rows, dim] added to the rows it gives (the isotropic control)."""

    def __init__(self, table, noise: torch.Tensor):
        self.table, self.noise, self.n_rows, self.dim = table, noise, table.n_rows, table.dim

    def rows(self, index: torch.Tensor, device=None) -> torch.Tensor:
        out = self.table.rows(index, device)
        return out + self.noise[index.cpu()].to(out.device, out.dtype)

def ratio_ci(real: np.ndarray, control: np.ndarray, seed: int, level: float = 0.95,
             draws: int = CI_BOOTSTRAP) -> tuple[float, float] | None:
    """Percentile bootstrap interval of sum(real) / mean_r sum(control[r]): real [rows] per-row KL sums, control
    [repeats, rows]; rows resampled paired, repeats resampled too. None with fewer than 2 rows or 2 repeats."""
    control = np.asarray(control, dtype=np.float64)
    if control.ndim != 2 or control.shape[0] < 2 or control.shape[1] < 2:
        return None
    rng = np.random.default_rng(seed)
    n_rep, n = control.shape
    rows = rng.integers(0, n, (draws, n))
    reps = rng.integers(0, n_rep, (draws, n_rep))
    num = np.asarray(real, dtype=np.float64)[rows].sum(1)
    per = control[:, rows].sum(2).T                              # [draws, repeats]: each repeat on the resampled rows
    den = np.take_along_axis(per, reps, axis=1).mean(1)
    ratio = num[den > 0] / den[den > 0]
    if not ratio.size:
        return None
    a = (1 - level) / 2
    return float(np.quantile(ratio, a)), float(np.quantile(ratio, 1 - a))

class NoisyOutput:
    """Wraps a sub-block: adds Gaussian noise of RMS eps * RMS(out) from a generator seeded per call."""

    def __init__(self, fn, eps: float, seed: int):
        self.fn, self.eps, self.seed, self.calls = fn, eps, seed, 0

    def __call__(self, *args, **kwargs):
        out = self.fn(*args, **kwargs)
        g = torch.Generator().manual_seed(self.seed + self.calls)
        self.calls += 1
        noise = torch.randn(out.shape, generator=g, dtype=torch.float64)
        rms = float(out.double().pow(2).mean().sqrt())
        return out + (noise * (self.eps * rms)).to(out.dtype).to(out.device)

def isotropic_noise(shape, norm: float, seed: int) -> torch.Tensor:
    """Gaussian noise scaled to exactly Frobenius norm `norm`."""
    g = torch.Generator().manual_seed(seed)
    n = torch.randn(shape, generator=g, dtype=torch.float64)
    return (n * (norm / float(n.norm()))).float() if norm else torch.zeros(shape)

# -- the driver ------------------------------------------------------------------------------------------------
def attribute(reference, pack, *, panel=None, rows: list[list[int]] | None = None, settings: Settings | None = None,
              device: str = "cpu", progress: bool = False, activation_budget: int | None = None,
              metric_kernel: MetricKernel = MetricKernel(),
              pack_settings: PackSettings = PackSettings()) -> Attribution:
    """Swap-one-in attribution, layer divergence, routing and sensitivity of `pack` against `reference` (paths or
    packs) on `panel` (its scored positions) or on token `rows` (every position but the last scored).
    `activation_budget`: both oracles' (Oracle(activation_budget=)); `metric_kernel`: KL of logits on a GPU;
    `pack_settings`: how packs given as paths are opened."""
    s = settings or Settings()
    ref = reference if hasattr(reference, "names") else open_pack(reference, pack_settings)
    pack = pack if hasattr(pack, "names") else open_pack(pack, pack_settings)
    check_against_config(ref)
    check_against_config(pack)
    check_same_vocab(ref, pack)
    ref, rows, scored = scored_rows(ref, panel, rows)
    oracle = Oracle(ref, device=device, numerics=s.numerics, activation_budget=activation_budget)
    # the pack read as compare's oracle reads it (names, Engram tables, numerics)
    pack_oracle = Oracle(pack, device=device, numerics=s.numerics, activation_budget=activation_budget)
    fam = oracle.family
    names_in_pack = pack_names(fam, pack_oracle.family, pack)
    groups = chosen_groups(fam, s)
    tables = {i: (fam.table(i), pack_oracle.family.table(i))
              for i in range(fam.n_layers) if table_name(i) in {n for g in groups.values() for n in g}}
    errors = WeightErrors.measure(ref, pack, fam, names_in_pack, tables, progress)

    trunk = Trunk(oracle, rows, scored, s.keep_layers, metric_kernel)
    moe = any(_routed_experts_class(fam, i) for i in range(fam.n_layers))
    ref_rec, pack_rec = (RoutingRecorder(), RoutingRecorder()) if moe else (None, None)
    access = EngramAccess()
    ref_outputs = trunk.reference_pass(recorder=ref_rec, keep_outputs=True, engram_access=access)
    whole, layers, layer_streams = whole_pack_divergence(trunk, ref_outputs, pack_oracle, rows, scored, pack_rec)

    swaps = swap_one_in(trunk, ref, pack, groups, tables, names_in_pack, errors, ref_outputs, s, progress)
    routing, routing_layers, bpw = [], [], None
    if moe:
        routing, routing_layers = routing_tables(ref_rec, pack_rec, s.super_expert_share)
        rows_bpw = pack.bits_per_weight(routing=pack_rec.counts.fractions()).rows
        bpw = {k: v for k, v in rows_bpw.items() if "per_decoded_token" in k}
    sensitivity = sensitivities(trunk, ref, s, progress) if s.sensitivity else []

    parts = sum(r["kld_mean"] for r in swaps)
    summary = {"reference": str(getattr(ref, "path", "")), "pack": str(getattr(pack, "path", "")),
               "modules": s.modules, "numerics": s.numerics,
               "rows": len(rows), "scored_positions": int(sum(len(p) for p in scored)),
               "scored_per_row": [len(p) for p in scored],
               "pack_kld_mean": whole, "sum_of_parts_kld": parts,
               "additivity": parts / whole if whole else None,
               "noise_levels": list(map(float, s.noise_levels)), "seed": s.seed,
               "super_expert_share": s.super_expert_share, "bits_per_weight_routed": bpw,
               "definitions": __doc__.split("Reported (definitions once, here):")[1].strip()}
    return Attribution(summary, swaps, layers, layer_streams, errors.tensors, routing, routing_layers, sensitivity,
                       access.summary())

def scored_rows(ref, panel, rows: list[list[int]] | None) -> tuple[object, list[list[int]], list[torch.Tensor]]:
    """(reference, token rows, each row's scored positions): the panel's rows and scored positions (the reference as
    compare prepares it), or the given `rows` with every position but the last scored."""
    if rows is None:
        ref, _, tok_rows, _ = prepare(ref, panel)
        return ref, [r.tokens for r in tok_rows], [scored_index(r)[0] for r in tok_rows]
    rows = [list(map(int, r)) for r in rows]
    for i, r in enumerate(rows):
        if len(r) < 2:
            raise ConfigError(f"row {i}: needs at least 2 tokens (a position predicts the next one)")
    return ref, rows, [torch.arange(len(r) - 1) for r in rows]

def chosen_groups(fam, s: Settings) -> dict[str, list[str]]:
    """The module groups of `s.modules`, only `s.groups` when given (an unknown one refused)."""
    groups = module_groups(fam, s.modules)
    if s.groups is None:
        return groups
    unknown = [g for g in s.groups if g not in groups]
    if unknown:
        raise ConfigError(f"unknown module group(s) {unknown}; the reference has e.g. {list(groups)[:6]}")
    return {g: groups[g] for g in s.groups}

def whole_pack_divergence(trunk: Trunk, ref_outputs: list, pack_oracle, rows: list[list[int]],
                          scored: list[torch.Tensor], recorder) -> tuple[float, list[dict], list[dict]]:
    """The whole pack: its own oracle's pass (as compare runs it) -> (its KL against the reference, per layer
    divergence, per layer and hyper-connection stream divergence)."""
    fam = trunk.fam
    layers, layer_streams = [], []

    def note(i, xs):
        if not fam.n_layers:
            return
        ref_xs = trunk.inputs[0] if i < 0 else ref_outputs[i]
        where = "embeddings" if i < 0 else f"after layer {i}"
        layers.append({"layer": i, "where": where, **hidden_divergence(ref_xs, xs)})
        layer_streams.extend({"layer": i, "where": where, **r} for r in stream_divergence(ref_xs, xs))
    pack_trunk = Trunk(pack_oracle, rows, scored, keep_layers=False)
    pack_trunk.reference_pass(recorder=recorder, keep_inputs=False, each_output=note)
    return trunk.kld(pack_trunk.ref_logits), layers, layer_streams

def swap_one_in(trunk: Trunk, ref, pack, groups: dict[str, list[str]], tables: dict, names_in_pack: dict[str, str],
                errors: WeightErrors, ref_outputs: list, s: Settings, progress: bool) -> list[dict]:
    """Per group: the reference with that group's tensors from the pack (KL, its share of the groups' sum), with the
    isotropic and activation controls that `s` asks for."""
    fam, swaps = trunk.fam, []
    for g, names in tqdm(groups.items(), desc="swap-one-in", disable=not progress, leave=False):
        err = errors.group_norm(names)
        row = {"group": g, "layer": first_layer(names, fam.n_layers) if g.startswith("layers.") else None,
               "tensors": len(names), "weight_err_norm": err}
        row["err_scale_corr"], row["err_scale_z"] = pooled_scale_corr([errors.scale_corr[n] for n in names
                                                                        if n in errors.scale_corr])
        if err == 0:   # the pack's tensors are the reference's: the variant is the reference, its KL exactly 0
            row.update(kld_mean=0.0, identical=True, noise_kld_mean=0.0 if s.noise_control else None,
                       noise_kld_each=[0.0] * s.noise_repeats if s.noise_control else None)
            swaps.append(row)
            continue
        layer_k = one_layer(names) if s.activation_control else None
        var_out = {}
        swap_tables = {i: tables[i][1] for i in tables if table_name(i) in names}
        row["kld_mean"], real_rows = trunk.kld_rows(_variant(
            trunk, fam, names, Reader(ref, pack, swapped=names, names=names_in_pack, tables=swap_tables),
            each_output=None if layer_k is None else lambda i, xs: var_out.update({i: xs}) if i == layer_k else None))
        row["identical"] = False
        if layer_k is not None:
            row.update(activation_control(trunk, ref_outputs[layer_k], var_out[layer_k], layer_k, row["kld_mean"],
                                          real_rows, s))
        if s.noise_control:
            row.update(isotropic_control(trunk, ref, names, tables, errors, row["kld_mean"], real_rows, s))
        swaps.append(row)
    total = sum(r["kld_mean"] for r in swaps)
    for r in swaps:
        r["share"] = r["kld_mean"] / total if total else 0.0
        nk = r.get("noise_kld_mean")
        r["x_noise"] = r["kld_mean"] / nk if nk else None
    return swaps

def verdict(ci: tuple[float, float] | None) -> str | None:
    """A ratio interval against 1: above, below, or holding it."""
    return None if ci is None else ("more harmful" if ci[0] > 1 else "less harmful" if ci[1] < 1 else "not separable")

def activation_control(trunk: Trunk, ref_out: list, var_out: list, layer: int, kld: float, real_rows: np.ndarray,
                       s: Settings) -> dict:
    """exllamav3's control at the layer's output: the reference's plus noise of the variant's error norm, re-run from
    the next layer, `s.noise_repeats` draws."""
    act, act_rows = [], []
    for rep in range(s.noise_repeats):
        k, by_row = trunk.kld_rows(trunk.run(layer + 1, xs=activation_noise(ref_out, var_out, act_seed(s.seed, rep))))
        act.append(k)
        act_rows.append(by_row)
    mean = float(np.mean(act))
    ci = ratio_ci(real_rows, np.stack(act_rows), s.seed)
    return {"act_kld_each": act, "act_kld_mean": mean, "x_act": kld / mean if mean else None,
            "x_act_ci": list(ci) if ci else None, "kl_vs_act": verdict(ci)}

def isotropic_control(trunk: Trunk, ref, names: list[str], tables: dict, errors: WeightErrors, kld: float,
                      real_rows: np.ndarray, s: Settings) -> dict:
    """Each of the group's tensors plus isotropic Gaussian noise of its error's norm, `s.noise_repeats` draws (the
    first one's err_scale_corr too)."""
    fam, out = trunk.fam, {}
    controls, control_rows = [], []
    for rep in range(s.noise_repeats):
        noise = {n: isotropic_noise(tensor_shape(ref, tables, n), errors.norm.get(n, 0.0),
                                    (s.seed * 7919 + rep) * 100_003 + k) for k, n in enumerate(names)}
        if rep == 0:
            out["noise_err_scale_corr"], out["noise_err_scale_z"] = pooled_scale_corr(
                [error_scale_corr(ref.tensor(n), noise[n]) for n in names
                 if errors.norm.get(n, 0.0) and table_layer(n) is None])
        noisy_tables = {table_layer(n): NoisyTable(tables[table_layer(n)][0], noise.pop(n))
                        for n in list(noise) if table_layer(n) is not None}
        k, by_row = trunk.kld_rows(_variant(trunk, fam, names, Reader(ref, noise=noise, tables=noisy_tables)))
        controls.append(k)
        control_rows.append(by_row)
    ci = ratio_ci(real_rows, np.stack(control_rows), s.seed)
    return {**out, "noise_kld_mean": float(np.mean(controls)), "noise_kld_each": controls,
            "x_noise_ci": list(ci) if ci else None, "kl_vs_noise": verdict(ci)}

def sensitivities(trunk: Trunk, ref, s: Settings, progress: bool) -> list[dict]:
    """Per chosen layer: KL at each noise level added to its MLP / routed output, and the fitted slopes."""
    fam = trunk.fam
    chosen = list(range(fam.n_layers)) if s.sensitivity_layers is None else list(s.sensitivity_layers)
    bad = [i for i in chosen if not 0 <= i < fam.n_layers]
    if bad:
        raise ConfigError(f"sensitivity layers {bad} are outside the model's {fam.n_layers} layers")
    out = []
    for i in tqdm(chosen, desc="sensitivity", disable=not progress, leave=False):
        kls, row_sums = [], []
        for j, eps in enumerate(s.noise_levels):
            def build(k, i=i, eps=eps, j=j):
                if k != i:
                    return None
                layer = trunk.build_layer(i, Reader(ref))
                attr = sub_blocks(layer)["mlp"]
                setattr(layer, attr, NoisyOutput(getattr(layer, attr), eps, noise_seed(s.seed, i, j)))
                return layer
            k, by_row = trunk.kld_rows(trunk.run(i, build=build))
            kls.append(k)
            row_sums.append(by_row.tolist())
        out.append({"layer": i, "levels": list(map(float, s.noise_levels)), "kld_mean": kls,
                    **sensitivity_slopes(s.noise_levels, kls), "kld_row_sums": row_sums})
    return out

def sensitivity_slopes(levels, kls: list[float]) -> dict:
    """`dkl_deps2`: least-squares slope of KL on eps^2 through the origin; `loglog_slope`: of log KL on log eps over
    the positive KLs (None with fewer than two)."""
    e2 = np.asarray(levels, dtype=np.float64) ** 2
    k = np.asarray(kls)
    positive = k > 0
    loglog = float(np.polyfit(np.log(np.sqrt(e2[positive])), np.log(k[positive]), 1)[0]) \
        if positive.sum() >= 2 else None
    return {"dkl_deps2": float((e2 * k).sum() / (e2 * e2).sum()), "loglog_slope": loglog}

def pack_names(ref_family, pack_family, pack) -> dict[str, str]:
    """The reference's name of each tensor its oracle reads -> the pack's name for it: the two families'
    `required_names()`, each resolved against its own pack (`resolve_names`, as compare's oracles resolve them), paired
    in order (a DeepSeek-V4 reference in official names, an EXL3 pack in Hugging Face ones)."""
    ref_names, names = ref_family.required_names(), pack_family.required_names()
    if len(ref_names) != len(names):
        raise PackError(f"the pack's oracle reads {len(names)} tensors, the reference's {len(ref_names)}: attribute "
                        f"swaps tensors between two packs of one model", file=getattr(pack, "path", None))
    out: dict[str, str] = {}
    for r, p in zip(ref_names, names):
        if out.setdefault(r, p) != p:
            raise PackError(f"the reference's tensor {r!r} is read as both {out[r]!r} and {p!r} in the pack",
                            file=getattr(pack, "path", None), tensor=p)
    return out

def tensor_shape(ref, tables: dict, name: str) -> tuple:
    layer = table_layer(name)
    return (tables[layer][0].n_rows, tables[layer][0].dim) if layer is not None else tuple(ref.storage(name).shape)

def noise_seed(seed: int, layer: int, level: int) -> int:
    return seed * 1_000_003 + 1000 * layer + 10 * level

def _routed_experts_class(fam, i: int) -> bool:
    return any(".experts." in n for n in fam.layer_names(i))

def _variant(trunk: Trunk, fam, names: list[str], read: Reader, each_output=None) -> list[torch.Tensor]:
    start = first_layer(names, fam.n_layers)
    touched = {int(m.group(1)) for m in (LAYER.search(n) for n in names) if m}
    head = any(not LAYER.search(n) for n in names)

    def build(i):
        return trunk.build_layer(i, read) if i in touched else None
    return trunk.run(start, build=build, read_head=read if head else None, embed_read=read, each_output=each_output)

def act_seed(seed: int, rep: int) -> int:
    return seed * 1_000_033 + 31 * rep + 17

def activation_noise(ref_out: list[torch.Tensor], var_out: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """exllamav3's control: the reference's layer output plus Gaussian noise with, at every position (and hc stream),
    the norm of the variant's error there; one generator over the batches in order, float64 draws."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r, v in zip(ref_out, var_out):
        e = (v.double() - r.double()).cpu()
        z = torch.randn(e.shape, generator=g, dtype=torch.float64)
        z = z * (e.norm(dim=-1, keepdim=True) / z.norm(dim=-1, keepdim=True))
        out.append(r + z.to(r.dtype).to(r.device))
    return out
