"""compare(): how far each pack is from the reference on a panel, per domain, with honest uncertainty.

The reference pack is run through the exact fp32 oracle (or read from a reference store); every candidate pack is run
through the same oracle code on the same tokens; per position the full-vocabulary KL(P_ref || Q_pack), top-1 agreement
and true-token NLLs are computed (`fidelity.measuring.metrics`) and summarised with row-bootstrap CIs
(`fidelity.measuring.stats`). Every pair of candidates is compared on the same positions. A noise floor (the reference
re-run with a tiny seeded perturbation of every attention and MLP output, about one bf16 rounding step:
`noise_floor.py`) says what KL means "indistinguishable from the reference". The run's passes are kept for resuming, and
their records written, by `passes.py`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from .. import __version__
from ..errors import NonFiniteActivations, PackError
from ..numerics import DEFAULT_NUMERICS, check_numerics
from ..oracle import OracleTaps, parallel
from ..pack_settings import PackSettings
from ..packs import open_pack
from ..packs.config_check import check_against_config
from ..packs.tokenizer import load_tokenizer
from ..panels.panel import Panel, TokenizedRow, load_panel, tokenize_panel, tokenizer_fingerprint
from .bootstrap import RowGroups
from .metrics import MetricKernel, PositionMetrics, position_metrics
from .noise_floor import NOISE_REL, other_numerics, perturbed_oracle
from .passes import Resume, ResumeError, position_columns, records_names, reference_logits_cache, write_metrics
from .result_schema import SCHEMA_VERSION, CompareReport
from .routing import RoutingCounts
from .stats import paired_difference, summarize
from .store import ReferenceRun, check_topk, device_row_metrics, load_store, run_reference, scored_index


@dataclass
class CompareResult:
    report: dict                                   # the JSON document
    metrics: dict[str, PositionMetrics] = field(default_factory=dict)   # label -> per scored position
    rows: list[TokenizedRow] = field(default_factory=list)
    groups: RowGroups | None = None


def vocab_size(pack) -> int:
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        if name in pack:
            return int(pack.storage(name).shape[0])
    return int(pack.config.get("vocab_size", 0))


def check_same_vocab(ref, pack) -> None:
    a, b = vocab_size(ref), vocab_size(pack)
    if a != b:
        raise PackError(f"packs have different vocabularies: reference {ref.path} has {a} tokens, {pack.path} has {b}; "
                        f"KL needs one vocabulary", file=pack.path)


def _oracle(pack, device: str, numerics: str = DEFAULT_NUMERICS, settings=None):
    """`settings`: parallel.RunSettings (None: the defaults). Prefetch, and row/expert parallel under torchrun, as for
    every oracle here."""
    return parallel.make_oracle(pack, device, settings or parallel.RunSettings(), numerics=numerics)


def compare(
    reference,
    packs: list,
    *,
    panel: Panel | str | Path | None = None,
    reference_store: str | Path | None = None,
    device: str = "cpu",
    labels: list[str] | None = None,
    noise_floor: bool = True,
    n_boot: int = 2000,
    seed: int = 0,
    truncate: bool = False,
    progress: bool = True,
    resume: str | Path | None = None,
    numerics: str = DEFAULT_NUMERICS,
    numerics_floor: bool = True,
    run_settings=None,
    metric_kernel: MetricKernel = MetricKernel(),
    pack_settings: PackSettings = PackSettings(),
) -> CompareResult:
    """Measure each pack in `packs` against `reference` (paths or Pack objects) on `panel` (default: panels/default).
    `resume`: a folder where every finished pass is kept (see `Resume`); a rerun with it recomputes only the rest.
    `numerics`: every oracle's ("exact" | "deepseek", fidelity.numerics). `numerics_floor`: where the reference's
    family defines both, also KL(reference under `numerics` || reference under the other): what the choice alone
    does on this panel. `run_settings`: every oracle's parallel.RunSettings (None: the defaults); `metric_kernel`:
    how logits on a GPU are measured; `pack_settings`: how the packs given as paths are opened."""
    run_settings = run_settings or parallel.RunSettings()
    cand, (ref_pack, panel, rows, tok_fp) = _checked_inputs(reference, packs, panel, truncate, numerics, pack_settings)
    ref_oracle = _oracle(ref_pack, device, numerics, run_settings)
    truncation = truncation_record(rows, truncate, context_length(ref_pack))
    keep = None
    if resume is not None:
        keep = Resume(resume, {"fidelity_version": __version__, "panel_sha256": panel.sha256, "tokenizer": tok_fp,
                               "truncation": truncation, "reference": ref_pack.fingerprint(),
                               "device": torch.device(device).type, "dtype": str(ref_oracle.dtype),
                               "numerics": numerics}, rows)
    ref, store_path = _reference_run(ref_oracle, ref_pack, panel, rows, tok_fp, reference_store, keep, progress)
    groups = RowGroups.build(np.repeat(np.arange(len(rows)), [len(t) for t in ref.targets]), [r.domain for r in rows])
    run = _Passes(ref, ref_oracle, rows, keep, store_path, run_settings, metric_kernel, progress,
                  reference_logits_cache(ref, ref_oracle))
    stats = dict(n_boot=n_boot, seed=seed)
    noise = _noise_floor(run, ref_pack, device, seed, numerics, groups, stats) if noise_floor else None
    other = other_numerics(ref_pack, numerics) if numerics_floor else None
    floor = _numerics_floor(run, ref_pack, device, numerics, other, groups, stats) if other is not None else None
    results, metrics = [], {}
    for pack, label in zip(cand, _unique_labels(cand, labels)):
        result, pm = _measure_pack(run, pack, label, device, numerics, groups, stats, noise, floor)
        results.append(result)
        if pm is not None:
            metrics[label] = pm
    files = records_names(list(metrics))
    for r in results:
        if r["label"] in files:
            r["records"] = files[r["label"]]
    # through the schema here, where the result is made: a key it does not declare is an error for every caller
    report = CompareReport.written({
        "schema_version": SCHEMA_VERSION,
        "fidelity_version": __version__,
        "direction": "KL(P_reference || Q_pack), nats per scored token",
        "panel": {
            "name": panel.name,
            "sha256": panel.sha256,
            "rows": len(rows),
            "scored_positions": ref.scored_positions,
            "domains": panel.domains,
            "truncation": truncation,
        },
        "reference": {
            "path": str(Path(ref_pack.path).resolve()),
            "fingerprint": ref_pack.fingerprint(),
            "format": ref_pack.format,
            "store": str(Path(reference_store).resolve()) if reference_store else None,
        },
        "numerics": numerics,
        "numerics_label": getattr(ref_oracle.family, "numerics_label", numerics),
        "noise_floor": noise,
        "numerics_floor": floor,
        "resumed": keep.reused if keep is not None else [],
        "identity": "fingerprints hash format, config, storage and every byte of every file the tensors are read from "
        "(BLAKE3; MANIFEST.sha256 verified where present)",
        "results": results,
        "failed": [r["label"] for r in results if r["status"] == "failed"],
        "paired": _paired(metrics, groups, stats),
    })
    return CompareResult(report, metrics, rows, groups)


def _checked_inputs(reference, packs: list, panel, truncate: bool, numerics: str, pack_settings: PackSettings):
    """(candidate packs, `prepare`'s tuple), every check that needs no oracle done first: a config its tensors
    contradict would be read wrong (a layer left out...), and KL needs one vocabulary."""
    cand = [p if hasattr(p, "names") else open_pack(p, pack_settings) for p in packs]
    for p in cand:
        check_against_config(p)
    prepared = prepare(reference, panel, truncate=truncate, pack_settings=pack_settings)
    for p in cand:
        check_same_vocab(prepared[0], p)
    check_numerics(numerics)
    return cand, prepared


def _reference_run(ref_oracle, ref_pack, panel: Panel, rows: list[TokenizedRow], tok_fp: str, reference_store,
                   keep: Resume | None, progress: bool) -> tuple[ReferenceRun, str | Path | None]:
    """The reference's pass (read from `reference_store`, or the one `keep` holds, else run and kept) and the store
    it was read from (None: computed here)."""
    store_path = reference_store
    if reference_store is None and keep is not None:
        store_path = keep.reference_store()
    if store_path is not None:
        return load_store(
            store_path,
            panel,
            rows,
            pack_fingerprint=ref_pack.fingerprint(),
            tokenizer_fingerprint=tok_fp,
            oracle=ref_oracle,
        ), store_path
    ref = run_reference(ref_oracle, rows, progress=progress)
    if keep is not None:
        keep.save_reference(
            ref, ref_oracle, panel, pack_fingerprint=ref_pack.fingerprint(), tokenizer_fingerprint=tok_fp
        )
    return ref, None


@dataclass
class _Passes:
    """The run's passes over the panel against one reference, each measured by `measure` (or read back from `keep`),
    and the expert routing each pack's pass measured."""
    ref: ReferenceRun
    ref_oracle: object
    rows: list[TokenizedRow]
    keep: Resume | None
    store_path: str | Path | None
    settings: object                # parallel.RunSettings
    kernel: MetricKernel
    progress: bool
    ref_logits: dict | None         # reference_logits_cache
    routing: dict[str, RoutingCounts | None] = field(default_factory=dict)

    def measure(self, name: str, make_oracle: Callable, key: dict, desc: str, noise: bool = False) -> PositionMetrics:
        """The pass `name` (identified for resuming by `key`); `noise`: a floor's pass, which perturbs the layers only,
        so its hidden states go through the reference's own head, and has no routing of its own."""
        keep = self.keep
        pm = keep.load(name, **key) if keep is not None else None
        if pm is not None:
            if not noise:
                self.routing[name] = keep.load_routing(name)
            return pm
        oracle = make_oracle()
        counts = None if noise else RoutingCounts()
        with oracle.tapped(OracleTaps(routing_counts=counts)):
            pm = _row_metrics(self.ref, self.ref_oracle, _pack_hidden(oracle, self.rows, self.progress),
                              self.ref_oracle if noise else oracle, store_path=self.store_path, desc=desc,
                              progress=self.progress, ref_logits_cache=self.ref_logits, kernel=self.kernel)
        if counts is not None:
            _gather_routing(counts, self.settings)
            self.routing[name] = counts
        if not noise:
            oracle.release()
        if keep is not None:
            keep.save(name, pm, routing=counts, **key)
        return pm


def _noise_floor(run: _Passes, ref_pack, device: str, seed: int, numerics: str, groups: RowGroups, stats: dict) -> dict:
    pm = run.measure("noise-floor", lambda: perturbed_oracle(ref_pack, device=device, seed=seed, numerics=numerics,
                                                            settings=run.settings),
                     {"noise_seed": seed, "noise_rel": NOISE_REL}, "noise floor", noise=True)
    return summarize(pm, groups, **stats)["overall"]


def _numerics_floor(run: _Passes, ref_pack, device: str, numerics: str, other: str, groups: RowGroups,
                    stats: dict) -> dict:
    pm = run.measure(f"numerics-floor-{other}", lambda: _oracle(ref_pack, device, other, run.settings),
                     {"other_numerics": other}, f"numerics floor ({numerics} vs {other})", noise=True)
    s = summarize(pm, groups, **stats)
    return {"reference_numerics": numerics, "other_numerics": other,
            "direction": f"KL(reference under {numerics} || reference under {other})",
            "overall": s["overall"], "domains": s["domains"]}


def _unique_labels(cand: list, labels: list[str] | None) -> list[str]:
    out, taken = [], set()
    for i, pack in enumerate(cand):
        label = _label(pack.path, labels, i)
        if label in taken:
            label = f"{label}#{i}"
        taken.add(label)
        out.append(label)
    return out


def _measure_pack(run: _Passes, pack, label: str, device: str, numerics: str, groups: RowGroups, stats: dict,
                  noise: dict | None, floor: dict | None) -> tuple[dict, PositionMetrics | None]:
    """One pack's entry of the report's results and its per-position metrics (None: it could not be measured)."""
    fingerprint = pack.fingerprint()
    entry = {"pack": str(Path(pack.path).resolve()), "label": label, "format": pack.format, "fingerprint": fingerprint}
    try:
        pm = run.measure(f"pack-{fingerprint}", lambda: _oracle(pack, device, numerics, run.settings),
                         {"pack": fingerprint}, label)
    except PackError as e:
        # this pack cannot be measured (non-finite activations, a tensor that does not decode): reported as failed,
        # the others still measured. Not the reference's own failures, and not under torchrun, where only the
        # rank that saw it raised (the run fails there, named).
        if isinstance(e, (ReferenceLogitsError, ResumeError)) or parallel.current_group() is not None:
            raise
        return {**entry, "status": "failed", "error": str(e)}, None
    summary = summarize(pm, groups, **stats)
    ov = summary["overall"]
    ov["noise_floor_kld"] = noise["kld_mean"] if noise else None
    ov["x_noise_floor"] = (
        (ov["kld_mean"] / noise["kld_mean"]) if noise and noise["kld_mean"] and ov["kld_mean"] is not None else None
    )
    ov["numerics_floor_kld"] = floor["overall"]["kld_mean"] if floor else None
    counts = run.routing.get(f"pack-{fingerprint}")
    routed = counts is not None and counts.layers
    bits = pack.bits_per_weight(routing=counts.fractions() if routed else None).rows
    return {**entry, "status": "measured", "bpw": (bits.get("all_linear") or bits.get("total") or {}).get("bpw"),
            "bits_per_weight": bits, "routing": counts.to_json() if routed else None,
            "overall": ov, "domains": summary["domains"]}, pm


def _paired(metrics: dict[str, PositionMetrics], groups: RowGroups, stats: dict) -> list[dict]:
    """Every pair of measured packs on the same positions, in the order they were measured."""
    labels = list(metrics)
    return [{"a": a, "b": b, **paired_difference(metrics[a], metrics[b], groups, **stats)}
            for i, a in enumerate(labels) for b in labels[i + 1:]]


def _row_metrics(ref: ReferenceRun, ref_oracle, pack_hidden: list[torch.Tensor], pack_oracle, *, store_path=None,
                 desc: str = "metrics", progress: bool = True, ref_logits_cache: dict | None = None,
                 kernel: MetricKernel = MetricKernel()) -> PositionMetrics:
    if ref_oracle.device.type != "cpu":   # logits stay on the device (store.device_row_metrics)
        return device_row_metrics(ref, ref_oracle, pack_hidden, pack_oracle, store_path=store_path, desc=desc,
                                  progress=progress, kernel=kernel)
    parts = []
    for i in tqdm(range(len(ref.rows)), desc=desc, disable=not progress, unit="row", leave=False):
        ref_logits = ref_logits_cache.get(i) if ref_logits_cache is not None else None
        if ref_logits is None:
            ref_logits = ref_oracle.apply_head(ref.hidden[i]).float()
            _check_reference_logits(ref, i, ref_logits, ref_oracle)
            if ref.topk is not None:
                check_topk(ref, i, ref_logits, store_path)
            if ref_logits_cache is not None:
                ref_logits_cache[i] = ref_logits
        pack_logits = pack_oracle.apply_head(pack_hidden[i]).float()
        parts.append(position_metrics(ref_logits, pack_logits, ref.targets[i], reverse=True, kernel=kernel))
    return PositionMetrics.concat(parts)


class ReferenceLogitsError(PackError):
    """The reference itself yields non-finite logits: no pack can be measured against it."""


def _check_reference_logits(ref: ReferenceRun, i: int, logits: torch.Tensor, oracle) -> None:
    """The reference is the truth every KL is taken against: a non-finite reference logit makes every number of the
    run meaningless, so it is an error naming the pack, the head tensor and the row, not a count of bad positions."""
    if bool(torch.isfinite(logits.sum())):
        return
    bad = ~torch.isfinite(logits)
    pos = int(bad.any(dim=-1).nonzero()[0])
    token = int(bad[pos].nonzero()[0])
    pack = getattr(oracle, "pack", None)
    head = getattr(getattr(oracle, "family", None), "head_name", None) or "lm_head.weight"
    hidden_ok = bool(torch.isfinite(ref.hidden[i]).all())
    what = (f"the head {head!r} turns finite hidden states into a non-finite logit" if hidden_ok
            else "its final hidden states are not finite")
    raise ReferenceLogitsError(f"the reference's logits are not finite (row {ref.rows[i].id!r}, scored position {pos}, "
                    f"vocabulary entry {token}): {what}; no KL can be measured against it",
                    file=getattr(pack, "path", None), tensor=head if hidden_ok else None)


def _nonfinite_weights(pack, layer: int | None, limit: int = 3) -> list[str]:
    """Names of a layer's tensors (the embeddings' for layer None) that hold NaN or Inf."""
    if layer is None:
        names = [n for n in pack.names() if "embed" in n]
    else:
        pat = re.compile(rf"(^|\.)layers\.{layer}\.")
        names = [n for n in pack.names() if pat.search(n)]
    bad = []
    for n in sorted(names):
        try:
            if not bool(torch.isfinite(pack.tensor(n)).all()):
                bad.append(n)
        except Exception:
            continue
        if len(bad) >= limit:
            break
    return bad


def _pack_hidden(oracle, rows: list[TokenizedRow], progress: bool) -> list[torch.Tensor]:
    try:
        full = oracle.hidden_states([r.tokens for r in rows], progress=progress)
    except NonFiniteActivations as e:
        pack = getattr(oracle, "pack", None)
        where = "the embeddings" if e.layer is None else f"layer {e.layer}"
        bad = _nonfinite_weights(pack, e.layer) if pack is not None else []
        culprit = (f"non-finite weights in {', '.join(map(repr, bad))}" if bad else
                   f"the weights of {where} are finite: the values overflowed in its computation")
        raise PackError(f"{e.kind} in the activations after {where}, row {rows[e.row].id!r} (index {e.row}, first at "
                        f"position {e.position}): {culprit}", file=getattr(pack, "path", None),
                        tensor=bad[0] if bad else None) from None
    return [h[scored_index(r)[0]].to(torch.float32) for r, h in zip(rows, full)]


def _label(path, labels, i) -> str:
    if labels and i < len(labels):
        return labels[i]
    p = Path(path)
    return p.stem if p.is_file() else p.name


def prepare(reference, panel: Panel | str | Path | None, *, truncate: bool = False,
            pack_settings: PackSettings = PackSettings()):
    """(reference pack, panel, tokenized rows, tokenizer fingerprint); a path is opened with `pack_settings`."""
    ref_pack = reference if hasattr(reference, "names") else open_pack(reference, pack_settings)
    check_against_config(ref_pack)
    panel = panel if isinstance(panel, Panel) else load_panel(panel)
    tok = load_tokenizer(ref_pack)
    rows = tokenize_panel(panel, tok, max_len=context_length(ref_pack), truncate=truncate)
    return ref_pack, panel, rows, tokenizer_fingerprint(tok)


def context_length(pack) -> int | None:
    """The longest row the reference pack's model takes (config.json's max_position_embeddings), None if unstated."""
    return pack.config.get("max_position_embeddings")


def truncation_record(rows: list[TokenizedRow], truncate: bool, context: int | None) -> dict:
    """What `truncate` did to the tokenized panel: the setting, the length rows were cut to, and the rows and tokens it
    cut. Part of the panel's identity wherever measured positions are kept (the compare JSON, kept passes)."""
    cut = [r for r in rows if r.truncated]
    return {"enabled": truncate, "max_len": context if truncate else None, "rows_cut": len(cut),
            "tokens_cut": sum(r.tokens_cut for r in cut), "scored_tokens_cut": sum(r.scored_cut for r in cut),
            "row_ids": [r.id for r in cut]}


def _gather_routing(counts: RoutingCounts, settings) -> None:
    """Under row parallel each rank routed its own rows: sum the counts (expert parallel ranks all saw every token)."""
    g = parallel.current_group()
    if g is not None and settings.parallel == "rows":
        counts.all_reduce(g)


def write_records(result: CompareResult, out_dir: str | Path) -> list[Path]:
    """Per-position records of every pack (Parquet): row id, domain, position, target token and every metric, in
    `records_name(label)` (each result's `records` key)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    positions = position_columns(result.rows)
    names = {r["label"]: r.get("records") for r in result.report.get("results", [])}
    fallback = records_names(list(result.metrics))
    return [write_metrics(out / (names.get(label) or fallback[label]), positions, pm)
            for label, pm in result.metrics.items()]
