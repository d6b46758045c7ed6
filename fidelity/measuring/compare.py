"""compare(): how far each pack is from the reference on a panel, per domain, with honest uncertainty.

The reference pack is run through the exact fp32 oracle (or read from a reference store); every candidate pack is run
through the same oracle code on the same tokens; per position the full-vocabulary KL(P_ref || Q_pack), top-1 agreement
and true-token NLLs are computed (`fidelity.measuring.metrics`) and summarised with row-bootstrap CIs (`fidelity.measuring.stats`). Every pair
of candidates is compared on the same positions. A noise floor (the reference re-run with a tiny seeded perturbation of
every attention and MLP output, about one bf16 rounding step) says what KL means "indistinguishable from the reference".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from .. import __version__
from ..content_hash import tree_digest
from ..errors import ConfigError, FidelityError, PackError
from .metrics import MetricKernel, PositionMetrics, position_metrics
from ..packs.config_check import check_against_config
from ..panels.panel import Panel, TokenizedRow, load_panel, tokenize_panel, tokenizer_fingerprint
from ..numerics import DEFAULT_NUMERICS, check_numerics
from ..oracle import OracleTaps
from .routing import RoutingCounts
from .result_schema import SCHEMA_VERSION
from .stats import RowGroups, paired_difference, summarize
from .store import ReferenceRun, check_topk, device_row_metrics, load_store, run_reference, scored_index

NOISE_REL = 2.0 ** -8   # one bf16 rounding step is at most 2^-8 relative (half of its 2^-7 spacing near 1)
# On a CPU oracle the reference's logits are kept across packs when all of them fit in this many bytes, so each pack
# after the first computes only its own head (the same tensors: bit-identical numbers, one head GEMM per pack saved)
REF_LOGITS_CACHE_BYTES = 1 << 30


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
    """`settings`: parallel.RunSettings (None: the defaults)."""
    from ..oracle import parallel  # prefetch, and row/expert parallel under torchrun, as for every oracle here
    return parallel.make_oracle(pack, device, settings or parallel.RunSettings(), numerics=numerics)


def other_numerics(pack, numerics: str) -> str | None:
    """The numerics the numerics floor sets against `numerics` ("exact" <-> "deepseek"), or None where the pack's
    family defines only one."""
    from ..oracle.families import family_for
    other = "deepseek" if numerics == "exact" else "exact"
    family = family_for(pack.config)
    family.resolve_names(pack.names())
    try:
        family.set_numerics(other, pack)
    except ConfigError:
        return None
    return other


def perturbed_oracle(pack, device: str = "cpu", seed: int = 0, rel: float = NOISE_REL, numerics: str = DEFAULT_NUMERICS,
                     settings=None):
    """An Oracle whose every layer's attention and MLP outputs are multiplied by (1 + rel * u), u ~ U(-1, 1), from a
    generator seeded per (seed, layer, role): a reproducible stand-in for bf16 rounding of each module output. The
    perturbation is the last stage of the oracle's load chain (`LoadChain.layer`), so prefetch and sharding run below
    it unchanged."""
    from ..oracle import parallel
    return parallel.make_oracle(pack, device, settings or parallel.RunSettings(), layer=(Perturbation(seed, rel),),
                                numerics=numerics)


@dataclass(frozen=True)
class Perturbation:
    """A load-chain layer transform: wraps the sub-blocks each layer class declares by role in its `SUB_BLOCKS`
    (role -> attribute; DeepSeek V4/V4.1 name their MLP `ffn`)."""

    seed: int = 0
    rel: float = NOISE_REL

    def __call__(self, i: int, layer):
        for role, attr in sub_blocks(layer).items():
            setattr(layer, attr, _perturb(getattr(layer, attr), self.seed * 1_000_003 + 2 * i + NOISE_ROLES.index(role),
                                          self.rel))
        return layer


NOISE_ROLES = ("attention", "mlp")   # the order fixes each role's seed offset


def sub_blocks(layer) -> dict[str, str]:
    """The layer's {role: attribute} for every role in NOISE_ROLES, each a callable; a clear error otherwise."""
    name = type(layer).__qualname__
    roles = getattr(type(layer), "SUB_BLOCKS", None)
    if not roles:
        raise ConfigError(f"the noise floor cannot perturb layer class {type(layer).__module__}.{name}: it declares "
                          f"no SUB_BLOCKS (role -> attribute for roles {list(NOISE_ROLES)})")
    missing = [r for r in NOISE_ROLES if r not in roles or not callable(getattr(layer, roles[r], None))]
    if missing:
        raise ConfigError(f"the noise floor cannot perturb layer class {type(layer).__module__}.{name}: roles "
                          f"{missing} are not declared in its SUB_BLOCKS {roles} or name no callable attribute")
    return {r: roles[r] for r in NOISE_ROLES}


def _perturb(fn, seed: int, rel: float):
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        g = torch.Generator(device="cpu").manual_seed(seed)
        u = torch.rand(out.shape, generator=g, dtype=out.dtype).to(out.device).mul_(2).sub_(1)
        return out + out * u * rel
    return wrapped


def reference_logits_cache(ref: ReferenceRun, ref_oracle, budget: int | None = None) -> dict | None:
    """An empty {row index: reference logits} for `_row_metrics` to fill and reuse, or None when the reference's logits
    of every scored position would take more than `budget` bytes (or live on a device)."""
    budget = REF_LOGITS_CACHE_BYTES if budget is None else budget
    if ref_oracle.device.type != "cpu":
        return None
    positions = sum(len(t) for t in ref.targets)
    head = ref_oracle.head_weight()
    return {} if positions * head.shape[0] * 4 <= budget else None


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


class ResumeError(PackError):
    """A pass kept for resuming cannot be trusted (unreadable, other positions, bytes changed): the run stops."""


class WriteError(FidelityError):
    """A file compare keeps (a pass for resuming, the records of `--out`) could not be written (a full disk...): the
    run stops, naming the file; the passes kept before it are resumed by a rerun."""


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
    import re

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
    from ..errors import NonFiniteActivations

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


def prepare(reference, panel: Panel | str | Path | None, *, truncate: bool = False):
    """(reference pack, panel, tokenized rows, tokenizer fingerprint)."""
    from ..packs import open_pack
    from ..packs.tokenizer import load_tokenizer

    ref_pack = reference if hasattr(reference, "names") else open_pack(reference)
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


def compare(reference, packs: list, *, panel: Panel | str | Path | None = None, reference_store: str | Path | None = None,
            device: str = "cpu", labels: list[str] | None = None, noise_floor: bool = True, n_boot: int = 2000,
            seed: int = 0, truncate: bool = False, progress: bool = True,
            resume: str | Path | None = None, numerics: str = DEFAULT_NUMERICS,
            numerics_floor: bool = True, run_settings=None, metric_kernel: MetricKernel = MetricKernel()) -> CompareResult:
    """Measure each pack in `packs` against `reference` (paths or Pack objects) on `panel` (default: panels/default).
    `resume`: a folder where every finished pass is kept (see `Resume`); a rerun with it recomputes only the rest.
    `numerics`: every oracle's ("exact" | "deepseek", fidelity.numerics). `numerics_floor`: where the reference's
    family defines both, also KL(reference under `numerics` || reference under the other): what the choice alone
    does on this panel. `run_settings`: every oracle's parallel.RunSettings (None: the defaults); `metric_kernel`:
    how logits on a GPU are measured."""
    from ..oracle import parallel
    from ..packs import open_pack

    run_settings = run_settings or parallel.RunSettings()

    cand = [p if hasattr(p, "names") else open_pack(p) for p in packs]
    for p in cand:  # before any work: a config its tensors contradict would be read wrong (a layer left out...)
        check_against_config(p)
    ref_pack, panel, rows, tok_fp = prepare(reference, panel, truncate=truncate)
    for p in cand:
        check_same_vocab(ref_pack, p)
    check_numerics(numerics)
    ref_oracle = _oracle(ref_pack, device, numerics, run_settings)
    truncation = truncation_record(rows, truncate, context_length(ref_pack))
    keep = None
    if resume is not None:
        keep = Resume(resume, {"fidelity_version": __version__, "panel_sha256": panel.sha256, "tokenizer": tok_fp,
                               "truncation": truncation, "reference": ref_pack.fingerprint(),
                               "device": torch.device(device).type, "dtype": str(ref_oracle.dtype),
                               "numerics": numerics}, rows)
    store_path = reference_store
    if reference_store is None and keep is not None:
        store_path = keep.reference_store()
    if store_path is not None:
        ref = load_store(store_path, panel, rows, pack_fingerprint=ref_pack.fingerprint(), tokenizer_fingerprint=tok_fp,
                         oracle=ref_oracle)
    else:
        ref = run_reference(ref_oracle, rows, progress=progress)
        if keep is not None:
            keep.save_reference(ref, ref_oracle, panel, pack_fingerprint=ref_pack.fingerprint(), tokenizer_fingerprint=tok_fp)
    groups = RowGroups.build(np.repeat(np.arange(len(rows)), [len(t) for t in ref.targets]), [r.domain for r in rows])

    routing: dict[str, RoutingCounts | None] = {}
    ref_logits = reference_logits_cache(ref, ref_oracle)

    def measure(name: str, make_oracle, key: dict, desc: str, noise: bool = False) -> PositionMetrics:
        pm = keep.load(name, **key) if keep is not None else None
        if pm is None:
            oracle = make_oracle()
            counts = None if noise else RoutingCounts()
            # the noise floor perturbs the layers only: its hidden states go through the reference's own head
            with oracle.tapped(OracleTaps(routing_counts=counts)):
                pm = _row_metrics(ref, ref_oracle, _pack_hidden(oracle, rows, progress), ref_oracle if noise else oracle,
                                  store_path=store_path, desc=desc, progress=progress, ref_logits_cache=ref_logits,
                                  kernel=metric_kernel)
            if counts is not None:
                _gather_routing(counts, run_settings)
                routing[name] = counts
            if not noise:
                oracle.release()
            if keep is not None:
                keep.save(name, pm, routing=counts, **key)
        elif keep is not None and not noise:
            routing[name] = keep.load_routing(name)
        return pm

    noise = None
    if noise_floor:
        noise_pm = measure("noise-floor", lambda: perturbed_oracle(ref_pack, device=device, seed=seed, numerics=numerics,
                                                                  settings=run_settings),
                           {"noise_seed": seed, "noise_rel": NOISE_REL}, "noise floor", noise=True)
        noise = summarize(noise_pm, groups, n_boot=n_boot, seed=seed)["overall"]
    floor = None
    other = other_numerics(ref_pack, numerics) if numerics_floor else None
    if other is not None:
        floor_pm = measure(f"numerics-floor-{other}", lambda: _oracle(ref_pack, device, other, run_settings),
                           {"other_numerics": other}, f"numerics floor ({numerics} vs {other})", noise=True)
        s = summarize(floor_pm, groups, n_boot=n_boot, seed=seed)
        floor = {"reference_numerics": numerics, "other_numerics": other,
                 "direction": f"KL(reference under {numerics} || reference under {other})",
                 "overall": s["overall"], "domains": s["domains"]}

    results, metrics = [], {}
    taken = set()
    for i, pack in enumerate(cand):
        label = _label(pack.path, labels, i)
        if label in taken:
            label = f"{label}#{i}"
        taken.add(label)
        fingerprint = pack.fingerprint()
        try:
            pm = measure(f"pack-{fingerprint}", lambda: _oracle(pack, device, numerics, run_settings),
                         {"pack": fingerprint}, label)
        except PackError as e:
            # this pack cannot be measured (non-finite activations, a tensor that does not decode): reported as failed,
            # the others still measured. Not the reference's own failures, and not under torchrun, where only the
            # rank that saw it raised (the run fails there, named).
            if isinstance(e, (ReferenceLogitsError, ResumeError)) or parallel.current_group() is not None:
                raise
            results.append({"pack": str(Path(pack.path).resolve()), "label": label, "format": pack.format,
                            "fingerprint": fingerprint, "status": "failed", "error": str(e)})
            continue
        metrics[label] = pm
        summary = summarize(pm, groups, n_boot=n_boot, seed=seed)
        ov = summary["overall"]
        ov["noise_floor_kld"] = noise["kld_mean"] if noise else None
        ov["x_noise_floor"] = (ov["kld_mean"] / noise["kld_mean"]) if noise and noise["kld_mean"] and ov["kld_mean"] is not None else None
        ov["numerics_floor_kld"] = floor["overall"]["kld_mean"] if floor else None
        counts = routing.get(f"pack-{fingerprint}")
        bits = pack.bits_per_weight(routing=counts.fractions() if counts is not None and counts.layers else None).rows
        results.append({"pack": str(Path(pack.path).resolve()), "label": label, "format": pack.format,
                        "fingerprint": fingerprint, "status": "measured",
                        "bpw": (bits.get("all_linear") or bits.get("total") or {}).get("bpw"),
                        "bits_per_weight": bits,
                        "routing": counts.to_json() if counts is not None and counts.layers else None,
                        "overall": ov, "domains": summary["domains"]})
    files = _records_names(list(metrics))
    for r in results:
        if r["label"] in files:
            r["records"] = files[r["label"]]
    labels_ = list(metrics)
    paired = []
    for a in range(len(labels_)):
        for b in range(a + 1, len(labels_)):
            d = paired_difference(metrics[labels_[a]], metrics[labels_[b]], groups, n_boot=n_boot, seed=seed)
            paired.append({"a": labels_[a], "b": labels_[b], **d})
    report = {
        "schema_version": SCHEMA_VERSION,   # fidelity.measuring.result_schema reads it
        "fidelity_version": __version__,
        "direction": "KL(P_reference || Q_pack), nats per scored token",
        "panel": {"name": panel.name, "sha256": panel.sha256, "rows": len(rows), "scored_positions": ref.scored_positions,
                  "domains": panel.domains, "truncation": truncation},
        "reference": {"path": str(Path(ref_pack.path).resolve()), "fingerprint": ref_pack.fingerprint(), "format": ref_pack.format,
                      "store": str(Path(reference_store).resolve()) if reference_store else None},
        "numerics": numerics,
        "numerics_label": getattr(ref_oracle.family, "numerics_label", numerics),
        "noise_floor": noise,
        "numerics_floor": floor,
        "resumed": keep.reused if keep is not None else [],
        "identity": "fingerprints hash format, config, storage and every byte of every file the tensors are read from "
                    "(BLAKE3; MANIFEST.sha256 verified where present)",
        "results": results,
        "failed": [r["label"] for r in results if r["status"] == "failed"],
        "paired": paired,
    }
    return CompareResult(report, metrics, rows, groups)


def _gather_routing(counts: RoutingCounts, settings) -> None:
    """Under row parallel each rank routed its own rows: sum the counts (expert parallel ranks all saw every token)."""
    from ..oracle import parallel

    g = parallel.current_group()
    if g is not None and settings.parallel == "rows":
        counts.all_reduce(g)


def _position_columns(rows: list[TokenizedRow]) -> dict[str, list]:
    """row id, domain, position and target token of every scored position, in metric order."""
    cols = {"row_id": [], "domain": [], "position": [], "token": []}
    for r in rows:
        pos, tgt = scored_index(r)
        cols["row_id"] += [r.id] * len(pos)
        cols["domain"] += [r.domain] * len(pos)
        cols["position"] += (pos + 1).tolist()
        cols["token"] += tgt.tolist()
    return cols


def _write_metrics(path: Path, positions: dict[str, list], pm: PositionMetrics) -> Path:
    """`positions` (from `_position_columns`) and every metric, atomically (a killed run leaves the old file or none):
    a reader never sees half a table."""
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = {**positions, **pm.to_numpy()}
    tmp = path.with_name(path.name + ".partial")
    try:
        pq.write_table(pa.table(cols), tmp)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise WriteError(f"cannot write {path}: {e}") from None
    return path


def records_name(label: str) -> str:
    """The file name of a pack's records in `--out`: the label with anything but letters, digits and . _ - + # = made
    `_`, no leading dot (`--label ../..` or `x/y` never leave the folder or name a subfolder)."""
    import re

    safe = re.sub(r"[^A-Za-z0-9._+#=-]", "_", label).strip(".") or "pack"
    return f"{safe}.parquet"


def _records_names(labels: list[str]) -> dict[str, str]:
    out, used = {}, set()
    for i, label in enumerate(labels):
        name = records_name(label)
        if name in used:
            name = name[:-len(".parquet")] + f"-{i}.parquet"
        used.add(name)
        out[label] = name
    return out


def write_records(result: CompareResult, out_dir: str | Path) -> list[Path]:
    """Per-position records of every pack (Parquet): row id, domain, position, target token and every metric, in
    `records_name(label)` (each result's `records` key)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    positions = _position_columns(result.rows)
    names = {r["label"]: r.get("records") for r in result.report.get("results", [])}
    fallback = _records_names(list(result.metrics))
    return [_write_metrics(out / (names.get(label) or fallback[label]), positions, pm)
            for label, pm in result.metrics.items()]


class Resume:
    """compare's finished passes kept in a folder, so a rerun after a kill recomputes only what was unfinished.

    Per pass (each pack, the noise floor): `<name>.parquet` (its per-position records, as `write_records` writes them),
    for a pack `<name>.routing.json` (its measured expert routing), and `<name>.done.json`, written after them, holding
    what the numbers depend on (panel, tokenization, reference and pack fingerprints, device, noise seed, library
    version) and a BLAKE3 checksum of every file of the pass; a pass is reused only when that identity matches exactly,
    and one whose files no longer match their checksum (or with a file the checksum does not list) is refused, naming
    the file. A file that cannot be written (a full disk) stops the run with a `WriteError` naming it.
    The reference run is kept as a reference store (`reference-store/`), which is re-verified when read back: its
    top-K must be reproduced bit for bit from its hidden states on this machine. Under torchrun rank 0 writes and
    decides; every rank must see the folder."""

    def __init__(self, folder: str | Path, identity: dict, rows: list[TokenizedRow]):
        self.folder, self.identity = Path(folder), identity
        self.positions = _position_columns(rows)
        self.reused: list[str] = []

    @property
    def store(self) -> Path:
        return self.folder / "reference-store"

    def _done(self, name: str) -> Path:
        return self.folder / f"{name}.done.json"

    def _routing(self, name: str) -> Path:
        return self.folder / f"{name}.routing.json"

    def _pass_files(self, name: str) -> list[Path]:
        return [self.folder / f"{name}.parquet", self._routing(name)]

    @staticmethod
    def _digest(files: list[Path]) -> dict[str, str]:
        """{file name (a folder's files: their paths inside it): BLAKE3} of those of `files` that exist."""
        out = {}
        for f in files:
            if f.exists():
                out.update(tree_digest(f))
        return out

    def _key(self, name: str, extra: dict) -> dict:
        return {**self.identity, "pass": name, **extra}

    def _finished(self, name: str, data: Path, extra: dict) -> bool:
        """Rank 0's answer, on every rank (so all ranks skip or run a pass together): `data` exists and the pass's
        identity file matches."""
        import json

        from ..oracle import parallel

        try:
            done = json.loads(self._done(name).read_text())
            found = (data.exists() and isinstance(done, dict) and "checksum" in done
                     and {k: v for k, v in done.items() if k != "checksum"} == self._key(name, extra))
        except (OSError, ValueError):
            found = False
        g = parallel.current_group()
        if g is None:
            return found
        flag = torch.tensor([int(found)])
        g.broadcast(flag, src=0)
        return bool(flag.item())

    def _write(self, name: str, extra: dict, write: Callable[[], None], files: list[Path]) -> None:
        """Rank 0 only: the identity file goes, `write()` runs, the identity file comes back with the checksum of
        `files` (so a kill in between leaves a pass that is recomputed, never one that is trusted half-written)."""
        import json

        from ..oracle import parallel

        if not parallel.is_main():
            return
        done = self._done(name)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            done.unlink(missing_ok=True)
            write()
            done.write_text(json.dumps({**self._key(name, extra), "checksum": self._digest(files)}, indent=1) + "\n")
        except OSError as e:
            done.unlink(missing_ok=True)
            where = "" if e.filename else f" ({files[0]})"
            raise WriteError(f"cannot keep the finished pass {name!r} for resuming: {e}{where}") from None

    def _verify(self, name: str, files: list[Path]) -> None:
        """A finished pass whose files differ from the checksum written with them (one changed, went missing, or is
        not listed) is refused, naming the file."""
        import json

        want = json.loads(self._done(name).read_text())["checksum"]
        got = self._digest(files)
        if got != want:
            bad = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
            where = files[0] / bad[0] if files[0].is_dir() else self.folder / bad[0]
            raise ResumeError(f"the finished pass {name!r} kept for resuming changed after it was written (its BLAKE3 "
                            f"checksum differs: {', '.join(bad)}); delete it to recompute it", file=where)

    def load(self, name: str, **extra) -> PositionMetrics | None:
        from dataclasses import fields

        import pyarrow.parquet as pq

        data = self.folder / f"{name}.parquet"
        if not self._finished(name, data, extra):
            return None
        self._verify(name, self._pass_files(name))
        try:
            table = pq.read_table(data)
        except Exception as e:
            raise ResumeError(f"cannot read the finished pass {name!r} kept for resuming ({e}); delete it to recompute it",
                            file=data) from None
        if any(f.name not in table.column_names for f in fields(PositionMetrics)):
            return None     # kept by a version without a metric this one records: recomputed
        if any(table.column(k).to_pylist() != v for k, v in self.positions.items()):
            raise ResumeError(f"the finished pass {name!r} kept for resuming holds other positions than this panel's; "
                            f"delete it to recompute it", file=data)
        self.reused.append(name)
        return PositionMetrics(**{f.name: torch.from_numpy(table.column(f.name).to_numpy().copy())
                                  for f in fields(PositionMetrics)})

    def save(self, name: str, pm: PositionMetrics, routing: RoutingCounts | None = None, **extra) -> None:
        """The pass's records and, where measured, its expert routing, under one checksum (rank 0 only)."""
        import json

        data, routing_file = self._pass_files(name)

        def write():
            routing_file.unlink(missing_ok=True)
            _write_metrics(data, self.positions, pm)
            if routing is not None:
                routing_file.write_text(json.dumps(routing.to_json()) + "\n")

        self._write(name, extra, write, [data, routing_file])

    def load_routing(self, name: str) -> RoutingCounts | None:
        """The routing of a pass `load` has verified (its checksum covers the file); None for a pass without one."""
        import json

        path = self._routing(name)
        if not path.exists():
            return None
        try:
            return RoutingCounts.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ResumeError(f"cannot read the routing of the finished pass {name!r} kept for resuming ({e}); delete "
                              f"the pass to recompute it", file=path) from None

    def reference_store(self) -> Path | None:
        """The kept reference store when it is finished for this identity (and counted as reused), else None."""
        if not self._finished("reference-store", self.store / "manifest.json", {}):
            return None
        self._verify("reference-store", [self.store])
        self.reused.append("reference")
        return self.store

    def save_reference(self, ref: ReferenceRun, oracle, panel: Panel, *, pack_fingerprint: str, tokenizer_fingerprint: str):
        import os
        import shutil

        from .store import write_store

        def write():
            tmp = self.folder / "reference-store.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            write_store(tmp, ref, oracle, panel, pack_fingerprint=pack_fingerprint,
                        tokenizer_fingerprint=tokenizer_fingerprint)
            shutil.rmtree(self.store, ignore_errors=True)
            os.replace(tmp, self.store)

        self._write("reference-store", {}, write, [self.store])
