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

import copy
import math
import re
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
import pandas as pd

from ..errors import ConfigError, PackError
from ..oracle import Oracle
from ..oracle.common import Fetch, OracleTaps, layer_call_args, rms_norm
from ..oracle.deepseek.quant import rounds_stored_input
from ..oracle.runner import _slice_rope
from ..pack_settings import PackSettings
from ..packs import open_pack
from ..packs.config_check import check_against_config
from .compare import check_same_vocab, prepare
from .engram_access import EngramAccess
from .metrics import MetricKernel, position_metrics
from .noise_floor import sub_blocks
from .routing import RoutingCounts
from .store import scored_index

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
MODULES = ("layer", "block", "expert")
ERROR_GROUP = 16      # err_scale_corr's group: the k-quants' sub-block (Q2_K..Q6_K: 16; Q4_K/Q5_K's 32 are two of them)
CI_BOOTSTRAP = 2000
NOISE_LEVELS = (2.0 ** -10, 2.0 ** -8, 2.0 ** -6)   # bf16 rounding (2^-8) in the middle; larger levels flip
# routing choices on MoE models, where KL stops being quadratic (tiny V4: quadratic to 1e-2, not at 1e-1)
SUPER_EXPERT_SHARE = 0.2
# Reference layers are kept in memory (built once, reused by every re-run) when all of them fit in this many bytes.
KEEP_LAYERS_BYTES = 8 * 2**30


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
                                                 # tensor's input rounds as the pack stores it (variant_rounding)


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


# -- module groups -------------------------------------------------------------------------------------------
def block_of(name: str) -> str:
    """The block kind of a layer tensor: engram, attention, router, experts, shared_experts, mlp or other."""
    if ".engram." in name:
        return "engram"
    if ".experts." in name:
        return "experts"
    if "shared_expert" in name:
        return "shared_experts"
    if re.search(r"\.gate\.(weight|bias|e_score_correction_bias)$", name) or "e_score_correction_bias" in name:
        return "router"
    if "attn" in name or "input_layernorm" in name:
        return "attention"
    if "mlp" in name or "ffn" in name or "post_attention_layernorm" in name:
        return "mlp"
    return "other"


def table_name(layer: int) -> str:
    """The name a group gives layer `layer`'s Engram table (V4.1): read row by row from the pack its family is bound
    to, never through fetch, so it is swapped as a whole (`Reader.tables`)."""
    return f"layers.{layer}.engram.embed"


def reads_table(family, layer: int) -> bool:
    """Whether the family's layer reads an Engram table (its Engram tensors are among the layer's names)."""
    return hasattr(family, "table") and any(".engram." in n for n in family.layer_names(layer))


def table_layer(name: str) -> int | None:
    m = re.fullmatch(r"layers\.(\d+)\.engram\.embed", name)
    return int(m.group(1)) if m else None


def module_groups(family, modules: str = "block") -> dict[str, list[str]]:
    """Group name -> the tensor names the oracle reads for it (in the reference's spelling; an Engram table as
    `table_name(layer)`). Layer groups are `layers.{i}.{block}` (block mode), `layers.{i}` (layer mode) or also
    `layers.{i}.experts.{e}` (expert mode); then `embedding` and `head` (the final norm and the untied head; with tied
    embeddings the embedding group is the head too)."""
    if modules not in MODULES:
        raise ConfigError(f"--modules {modules!r}: expected one of {list(MODULES)}")
    groups: dict[str, list[str]] = {}
    for i in range(family.n_layers):
        for name in family.layer_names(i) + ([table_name(i)] if reads_table(family, i) else []):
            if modules == "layer":
                key = f"layers.{i}"
            else:
                key = f"layers.{i}.{block_of(name)}"
                if modules == "expert" and ".experts." in name:
                    key += "." + name.split(".experts.")[1].split(".")[0]
            groups.setdefault(key, []).append(name)
    groups["embedding"] = [family.embed_name]
    groups["head"] = [family.norm_name] + ([] if family.tie_word_embeddings else [family.head_name])
    return groups


def first_layer(names: list[str], n_layers: int) -> int:
    """The first place a group's tensors are read: -1 the embeddings, a layer index, or n_layers (norm and head)."""
    where = []
    for n in names:
        m = LAYER.search(n)
        where.append(int(m.group(1)) if m else (-1 if "embed" in n else n_layers))
    return min(where)


# -- weight error ----------------------------------------------------------------------------------------------
def weight_error(ref_w: torch.Tensor, pack_w: torch.Tensor) -> dict:
    r, d = ref_w.double(), pack_w.double() - ref_w.double()
    ref2, err2 = float((r * r).sum()), float((d * d).sum())
    corr, groups = error_scale_corr(r, d) if err2 else (None, 0)
    return {"ref_norm": math.sqrt(ref2), "err_norm": math.sqrt(err2),
            "rel_fro": math.sqrt(err2 / ref2) if ref2 else (0.0 if err2 == 0 else math.inf),
            "sqnr_db": 10 * math.log10(ref2 / err2) if err2 else math.inf,
            "err_scale_corr": corr, "err_scale_groups": groups}


def error_scale_corr(w: torch.Tensor, d: torch.Tensor, group: int = ERROR_GROUP) -> tuple[float | None, int]:
    """Pearson r between the error's RMS and the weight's max |w| over groups of `group` consecutive weights along the
    last axis, and the number of groups; (None, 0) for a tensor that is not 2-D, whose rows do not split into groups,
    or whose error or weights are constant over the groups."""
    if w.dim() != 2 or w.shape[1] % group or w.numel() < 2 * group:
        return None, 0
    e = d.double().reshape(-1, group).pow(2).mean(1).sqrt()
    m = w.double().reshape(-1, group).abs().amax(1)
    e, m = e - e.mean(), m - m.mean()
    den = float(e.norm() * m.norm())
    return (float((e * m).sum()) / den if den else None), e.numel()


TABLE_CHUNK_ROWS = 1 << 16     # Engram table rows read at once for its weight error


def table_error(ref_table, pack_table, chunk_rows: int = TABLE_CHUNK_ROWS, group: int = ERROR_GROUP) -> dict:
    """weight_error of an Engram table ([rows, dim], `RowTable`s of each pack), read `chunk_rows` rows at a time (a
    table need not fit in memory at once); err_scale_corr from running sums over the groups."""
    if (ref_table.n_rows, ref_table.dim) != (pack_table.n_rows, pack_table.dim):
        raise PackError(f"the pack's Engram table is [{pack_table.n_rows}, {pack_table.dim}], the reference's "
                        f"[{ref_table.n_rows}, {ref_table.dim}]", file=pack_table.parts[0][0])
    ref2 = err2 = 0.0
    sums = np.zeros(5)                      # sum e, sum m, sum e^2, sum m^2, sum e m over the groups
    grouped = ref_table.dim % group == 0 and ref_table.n_rows * ref_table.dim >= 2 * group
    for start in range(0, ref_table.n_rows, chunk_rows):
        index = torch.arange(start, min(start + chunk_rows, ref_table.n_rows))
        r = ref_table.rows(index).double()
        d = pack_table.rows(index).double() - r
        ref2 += float((r * r).sum())
        err2 += float((d * d).sum())
        if grouped:
            e = d.reshape(-1, group).pow(2).mean(1).sqrt()
            m = r.reshape(-1, group).abs().amax(1)
            sums += [float(e.sum()), float(m.sum()), float((e * e).sum()), float((m * m).sum()), float((e * m).sum())]
    n = ref_table.n_rows * ref_table.dim // group if grouped and err2 else 0
    corr = None
    if n:
        se, sm, see, smm, sem = sums
        den = math.sqrt(max(see - se * se / n, 0.0) * max(smm - sm * sm / n, 0.0))
        corr = (sem - se * sm / n) / den if den else None
    return {"ref_norm": math.sqrt(ref2), "err_norm": math.sqrt(err2),
            "rel_fro": math.sqrt(err2 / ref2) if ref2 else (0.0 if err2 == 0 else math.inf),
            "sqnr_db": 10 * math.log10(ref2 / err2) if err2 else math.inf,
            "err_scale_corr": corr, "err_scale_groups": n}


class NoisyTable:
    """An Engram table with a fixed noise tensor [rows, dim] added to the rows it gives (the isotropic control)."""

    def __init__(self, table, noise: torch.Tensor):
        self.table, self.noise, self.n_rows, self.dim = table, noise, table.n_rows, table.dim

    def rows(self, index: torch.Tensor, device=None) -> torch.Tensor:
        out = self.table.rows(index, device)
        return out + self.noise[index.cpu()].to(out.device, out.dtype)


def pooled_scale_corr(stats: list[tuple[float | None, int]]) -> tuple[float | None, float | None]:
    """(sum r_i n_i / sum n_i, sum r_i n_i / sqrt(sum n_i)) over the tensors that have r."""
    stats = [(r, n) for r, n in stats if r is not None]
    n = sum(k for _, k in stats)
    if not n:
        return None, None
    s = sum(r * k for r, k in stats)
    return s / n, s / math.sqrt(n)


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


def hidden_divergence(ref_h: list[torch.Tensor], pack_h: list[torch.Tensor]) -> dict:
    """ref_h / pack_h: the batches' activations [..., hidden], same shapes; positions = every leading index."""
    ref2 = err2 = 0.0
    cos_sum, n = 0.0, 0
    for r, p in zip(ref_h, pack_h):
        r, p = r.double().reshape(-1, r.shape[-1]), p.double().reshape(-1, p.shape[-1])
        d = p - r
        ref2 += float((r * r).sum())
        err2 += float((d * d).sum())
        cos_sum += float(F.cosine_similarity(p, r, dim=-1, eps=1e-300).sum())
        n += r.shape[0]
    return {"rel_fro": math.sqrt(err2 / ref2) if ref2 else math.nan,
            "sqnr_db": 10 * math.log10(ref2 / err2) if err2 else math.inf, "cosine": cos_sum / n if n else math.nan}


def stream_divergence(ref_h: list[torch.Tensor], pack_h: list[torch.Tensor]) -> list[dict]:
    """Hyper-connection streams [B, T, hc, hidden]: hidden_divergence of each stream alone; [] for [B, T, hidden]."""
    if not ref_h or ref_h[0].dim() != 4:
        return []
    return [{"stream": s, **hidden_divergence([r[:, :, s] for r in ref_h], [p[:, :, s] for p in pack_h])}
            for s in range(ref_h[0].shape[2])]


# -- routing -------------------------------------------------------------------------------------------------
class RoutingRecorder:
    """An `OracleTaps.expert_outputs` (the sink `RoutedExperts` tells each call's routing and each expert's weighted
    outputs): records every call's expert choices and weights and each expert's routed-output energy for the layer
    `current_layer`, from the outputs the call computes anyway. Every family whose MoE is
    `fidelity.oracle.moe.RoutedExperts` (Qwen3Moe, Mixtral, DeepSeek) is seen."""

    def __init__(self):
        self.current_layer = -1
        self.layers: dict[int, dict] = {}
        self.counts = RoutingCounts()

    def routed(self, experts, indices, weights):
        self.counts.add(experts, indices)
        entry = self.layers.get(self.current_layer)
        if entry is None:
            entry = self.layers[self.current_layer] = {
                "n_experts": experts.n_experts, "indices": [], "weights": [],
                "energy": torch.zeros(experts.n_experts, dtype=torch.float64, device=indices.device)}
        entry["indices"].append(indices.cpu())
        entry["weights"].append(weights.detach().double().cpu())

    def expert_output(self, e: int, y: torch.Tensor):
        """y: expert e's outputs times the tokens' routing weights, as the call adds them; on the device, no sync."""
        self.layers[self.current_layer]["energy"][e] += y.double().pow(2).sum()


def routing_tables(ref: RoutingRecorder, pack: RoutingRecorder, threshold: float) -> tuple[list[dict], list[dict]]:
    per_expert, per_layer = [], []
    for layer in sorted(ref.layers):
        r, p = ref.layers[layer], pack.layers.get(layer)
        if p is None:
            raise PackError(f"layer {layer} routes experts in the reference but not in the pack")
        n = r["n_experts"]
        sides = {}
        for side, entry in (("ref", r), ("pack", p)):
            idx, w = torch.cat(entry["indices"]), torch.cat(entry["weights"])
            counts = torch.bincount(idx.reshape(-1), minlength=n).numpy()
            mass = torch.zeros(n, dtype=torch.float64).index_add_(0, idx.reshape(-1), w.reshape(-1)).numpy()
            energy = entry["energy"].cpu().numpy()
            sides[side] = {"idx": idx, "counts": counts, "weight_share": mass / mass.sum(),
                           "energy_share": energy / energy.sum() if energy.sum() else energy}
        ri, pi = sides["ref"]["idx"], sides["pack"]["idx"]
        if ri.shape != pi.shape:
            raise PackError(f"layer {layer}: the reference routes {list(ri.shape)} token-expert choices, the pack "
                            f"{list(pi.shape)}")
        ref_sets = torch.zeros(ri.shape[0], n, dtype=torch.bool).scatter_(1, ri, True)
        pack_sets = torch.zeros(pi.shape[0], n, dtype=torch.bool).scatter_(1, pi, True)
        jaccard = (ref_sets & pack_sets).sum(1).double() / (ref_sets | pack_sets).sum(1).double()
        for e in range(n):
            per_expert.append({"layer": layer, "expert": e,
                               **{f"{k}_{side}": (int(s[k][e]) if k == "counts" else float(s[k][e]))
                                  for side, s in sides.items() for k in ("counts", "weight_share", "energy_share")}})
        per_layer.append({"layer": layer, "tokens": int(ri.shape[0]), "top_k": int(ri.shape[1]),
                          "jaccard_mean": float(jaccard.mean()), "jaccard_min": float(jaccard.min()),
                          "same_set": float((jaccard == 1).double().mean()),
                          "super_experts_ref": [e for e in range(n) if sides["ref"]["energy_share"][e] >= threshold],
                          "super_experts_pack": [e for e in range(n) if sides["pack"]["energy_share"][e] >= threshold]})
    return per_expert, per_layer


# -- the streamed trunk -----------------------------------------------------------------------------------------
class Reader:
    """read(name) for a variant, `name` in the reference's spelling: the pack's tensor for names in `swapped` (under
    the pack's name for it, `names`), the reference's otherwise; `noise` adds a fixed tensor to a reference tensor
    (the isotropic control). `tables`: layer -> the Engram table that layer reads instead of the reference's."""

    def __init__(self, ref, pack=None, swapped=(), noise: dict[str, torch.Tensor] | None = None,
                 names: dict[str, str] | None = None, tables: dict | None = None):
        self.ref, self.pack, self.swapped, self.noise = ref, pack, set(swapped), noise or {}
        self.names, self.tables = names or {}, tables or {}

    def __call__(self, name: str, **where) -> torch.Tensor:
        if name in self.swapped:
            return self.pack.tensor(self.names.get(name, name), **where)
        t = self.ref.tensor(name, **where)
        return t + self.noise[name].to(t.device) if name in self.noise else t


def variant_rounding(rounding, fam, read: Reader):
    """`rounding` (the reference's, quant.DeepSeekRounding) with its linear-input rule bound to a variant's storage: a
    swapped tensor's input is rounded where the pack stores it FP8/FP4, every other where the reference does (what
    DeepSeek's model.py does with the hybrid's weights)."""
    pack_rounds = rounds_stored_input(read.pack, lambda official: read.names.get(fam.n(official), fam.n(official)))
    return replace(rounding, rounds_input=lambda official: pack_rounds(official)
                               if fam.n(official) in read.swapped else rounding.rounds_input(official))


class Trunk:
    """The reference's layers streamed over row batches, each layer's input kept; `run(start, ...)` re-runs from a
    layer on with any layer built from another reader or wrapped."""

    def __init__(self, oracle, rows: list[list[int]], scored: list[torch.Tensor], keep_layers: bool | None,
                 kernel: MetricKernel = MetricKernel()):
        self.oracle, self.fam, self.ref = oracle, oracle.family, oracle.pack
        self.kernel = kernel       # measures KL where the logits are on a GPU
        self.taps = OracleTaps()   # the observers of every layer this trunk builds, set for the calls that record
        tokens = [oracle._validate_row(r, i) for i, r in enumerate(rows)]
        self.batches = oracle._batches(tokens)
        self.ids = [torch.stack([tokens[i] for i in idx]).to(oracle.device) for idx in self.batches]
        self.rope = self.fam.rope_tables(max(len(r) for r in rows), oracle.dtype, oracle.device)
        # scored positions and true next tokens per batch, in batch order (flattened b, t)
        self.scored, self.targets = [], []
        self.row_of = [torch.cat([torch.full((len(scored[i]),), i) for i in idx]) for idx in self.batches]
        self.n_rows = len(rows)
        for idx, t in zip(self.batches, self.ids):
            T = t.shape[1]
            pos = torch.cat([scored[i] + j * T for j, i in enumerate(idx)])
            self.scored.append(pos)
            self.targets.append(t.reshape(-1).cpu()[pos + 1])   # scored positions stop before a row's last token
        if keep_layers is None:
            keep_layers = sum(oracle._layer_bytes(i) for i in range(self.fam.n_layers)) <= KEEP_LAYERS_BYTES
        self.keep = keep_layers
        self._layers: dict[int, object] = {}
        self.inputs: list[list[torch.Tensor]] = []      # inputs[i][b]: layer i's input of batch b
        self.states_in: list[list] = []                  # states_in[i][b]: the pass state layer i got (new_pass_state)
        self.final_states: list = []
        self.ref_logits: list[torch.Tensor] = []

    def fetch(self, read):
        return Fetch(read, lambda n: tuple(self.ref.storage(n).shape), self.oracle.device, self.oracle.dtype,
                          taps=self.taps)

    def build_layer(self, i: int, read: Reader):
        """Layer i with its tensors read through `read` and, where `read.tables` has one, that Engram table. Under a
        reference rounding (numerics "deepseek"), the layer is built with it bound to the variant's storage."""
        rounding = getattr(self.fam, "rounding", None)
        if rounding is not None and read.swapped:
            self.fam.rounding = variant_rounding(rounding, self.fam, read)
        try:
            layer = self.fam.load_layer(i, self.fetch(read))
        finally:
            if rounding is not None:
                self.fam.rounding = rounding
        table = read.tables.get(i)
        if table is not None:
            layer.engram.table = table
        return layer

    def ref_layer(self, i: int):
        layer = self._layers.get(i)
        if layer is None:
            layer = self.build_layer(i, Reader(self.ref))
            if self.keep:
                self._layers[i] = layer
        return layer

    def embed(self, read) -> list[torch.Tensor]:
        w = self.fetch(read)(self.fam.embed_name)
        return [self.fam.embed_hook(F.embedding(t, w)) for t in self.ids]

    def call(self, layer, x: torch.Tensor, b: int, state) -> torch.Tensor:
        return layer(x.clone(), _slice_rope(self.rope, x.shape[1]), *layer_call_args(self.fam, self.ids[b], state))

    def new_states(self) -> list:
        """A fresh pass state per batch (Family.new_pass_state; None for families without one)."""
        return [self.fam.new_pass_state() for _ in self.ids]

    def logits(self, xs: list[torch.Tensor], read, states: list) -> list[torch.Tensor]:
        """The final norm and head (read through `read`) at the scored positions of each batch: [n, vocab] float32."""
        fetch = self.fetch(read)
        norm, head = fetch(self.fam.norm_name), fetch(self.fam.head_name)
        out = []
        for x, pos, state in zip(xs, self.scored, states):
            h = rms_norm(self.fam.final_hook(x, fetch, state), norm, self.fam.rms_norm_eps)
            h = h.reshape(-1, h.shape[-1])[pos]
            logits = torch.empty(h.shape[0], head.shape[0], dtype=self.oracle.dtype, device=self.oracle.device)
            self.oracle._head_blocks(h, head, logits)
            out.append(logits.float().cpu())
        return out

    def reference_pass(self, recorder=None, keep_outputs: bool = False, engram_access=None, keep_inputs: bool = True,
                       each_output: Callable[[int, list], None] | None = None) -> list[list[torch.Tensor]]:
        """The oracle's pass over its own pack (logits in `ref_logits`), keeping each layer's input and pass state for
        re-runs (`keep_inputs`); `each_output(i, xs)` sees the embeddings (i = -1) and each layer's output."""
        xs = self.embed(Reader(self.ref))
        if each_output is not None:
            each_output(-1, xs)
        states = self.new_states()
        outputs = []
        for i in range(self.fam.n_layers):
            if keep_inputs:
                self.inputs.append(xs)
                self.states_in.append([copy.copy(s) for s in states])   # a re-run from layer i starts from these
            layer = self.ref_layer(i)
            if recorder is not None:
                recorder.current_layer = i
            self.taps.engram_access = engram_access     # V4.1 Engram layers count their rows on this pass only
            try:
                xs = self._with_recorder(layer, xs, recorder, states)
            finally:
                self.taps.engram_access = None
            if keep_outputs:
                outputs.append(xs)
            if each_output is not None:
                each_output(i, xs)
        self.final, self.final_states = xs, states
        self.ref_logits = self.logits(xs, Reader(self.ref), states)
        return outputs

    def _with_recorder(self, layer, xs, recorder, states):
        self.taps.expert_outputs = recorder
        try:
            return [self.call(layer, x, b, state) for b, (x, state) in enumerate(zip(xs, states))]
        finally:
            self.taps.expert_outputs = None

    def run(self, start: int, build: Callable[[int], object | None] | None = None, read_head=None,
            recorder=None, each_output: Callable[[int, list], None] | None = None,
            embed_read=None, xs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Logits of a variant: from the embeddings (start -1, read through `embed_read`), a layer's kept input (or
        `xs` in its place), or the final hidden states (start = n_layers). `build(i)` gives layer i's replacement or
        None for the reference's."""
        n = self.fam.n_layers
        if start < 0:
            xs = xs if xs is not None else self.embed(embed_read or Reader(self.ref))
            states, start = self.new_states(), 0
        else:   # the reference pass's input (or xs in its place) and its pass state there
            at_end = start >= n
            xs = xs if xs is not None else self.final if at_end else self.inputs[start]
            states = [copy.copy(s) for s in (self.final_states if at_end else self.states_in[start])]
        for i in range(start, n):
            layer = (build(i) if build else None) or self.ref_layer(i)
            if recorder is not None:
                recorder.current_layer = i
            xs = self._with_recorder(layer, xs, recorder, states)
            if each_output is not None:
                each_output(i, xs)
        return self.logits(xs, read_head or Reader(self.ref), states)

    def kld(self, logits: list[torch.Tensor]) -> float:
        return self.kld_rows(logits)[0]

    def kld_rows(self, logits: list[torch.Tensor]) -> tuple[float, np.ndarray]:
        """(mean KL over the scored positions, each row's sum of KL over its scored positions)."""
        if all(torch.equal(r, q) for r, q in zip(self.ref_logits, logits)):
            return 0.0, np.zeros(self.n_rows)   # the same distributions (exp/log rounding leaves ~1e-16 per position)
        pm = [position_metrics(r, q, t, kernel=self.kernel) for r, q, t in zip(self.ref_logits, logits, self.targets)]
        k = torch.cat([p.kld for p in pm])
        sums = torch.zeros(self.n_rows, dtype=torch.float64).index_add_(0, torch.cat(self.row_of), k.double())
        return float(k.mean()), sums.numpy()


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


@dataclass
class WeightErrors:
    """Per tensor the oracle reads (Engram tables row by row): `tensors` (the report's rows), `norm` (name ->
    ||W_pack - W_ref||_F) and `scale_corr` (name -> (err_scale_corr, its groups))."""
    tensors: list[dict]
    norm: dict[str, float]
    scale_corr: dict[str, tuple]

    @classmethod
    def measure(cls, ref, pack, fam, names_in_pack: dict[str, str], tables: dict, progress: bool) -> "WeightErrors":
        out = cls([], {}, {})
        for name in tqdm(fam.required_names() + [table_name(i) for i in tables], desc="weights", disable=not progress,
                         leave=False):
            if name in out.norm:
                continue
            stored = names_in_pack.get(name, name)
            layer = table_layer(name)
            if layer is not None:
                e, numel = table_error(*tables[layer]), tables[layer][0].n_rows * tables[layer][0].dim
            else:
                w_ref, w_pack = ref.tensor(name), pack.tensor(stored)
                if tuple(w_ref.shape) != tuple(w_pack.shape):
                    raise PackError(f"pack tensor shape {list(w_pack.shape)} differs from the reference's "
                                    f"{list(w_ref.shape)} (the reference's {name!r})",
                                    file=getattr(pack, "path", None), tensor=stored)
                e, numel = weight_error(w_ref, w_pack), w_ref.numel()
            m = LAYER.search(name)
            out.tensors.append({"tensor": name, "pack_tensor": stored, "layer": int(m.group(1)) if m else None,
                                "block": block_of(name) if m else ("embedding" if "embed" in name else "head"),
                                "numel": numel, **e})
            out.norm[name] = e["err_norm"]
            out.scale_corr[name] = (e["err_scale_corr"], e["err_scale_groups"])
        return out

    def group_norm(self, names: list[str]) -> float:
        return math.sqrt(sum(self.norm.get(n, 0.0) ** 2 for n in names))


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


def one_layer(names: list[str]) -> int | None:
    """The layer a group's tensors all belong to, or None (embedding, head, or several layers)."""
    where = {int(m.group(1)) if m else None for m in (LAYER.search(n) for n in names)}
    return where.pop() if len(where) == 1 and None not in where else None


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
