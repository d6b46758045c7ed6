"""Read what `fidelity report` is given: compare JSON or run folders, suite-compare JSON, gate JSON; group compare
results by panel."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from ..errors import FidelityError
from ..measuring.result_schema import (
    CompareReport,
    PairedDifference,
    PanelInfo,
    ReferenceInfo,
    SchemaVersionError,
    Scope,
    check_version,
)


class ReportInputError(FidelityError):
    """A file given to the report is unreadable or of a kind the report does not know. Names the file."""


@dataclass
class PackResult:
    """One candidate pack measured against the reference (one entry of compare's `results`)."""

    label: str
    pack: str
    bpw: float | None
    overall: Scope
    domains: dict[str, Scope]
    fingerprint: str | None
    source: str
    format: str | None = None
    original_label: str = ""          # the label in its compare JSON (paired entries refer to it)
    records: str | None = None        # its per-position records' file name in the `--out` folder
    index: int | None = None          # its place in the JSON's `results` (failed packs are skipped here, not there)

    def __post_init__(self):
        self.original_label = self.original_label or self.label


@dataclass
class CompareRun:
    """One compare JSON (read through `fidelity.measuring.result_schema`), with its per-position records when it came
    from an `--out` run folder."""

    source: str
    panel: PanelInfo
    reference: ReferenceInfo
    results: list[PackResult]
    paired: list[PairedDifference]
    report: CompareReport  # the whole document: version, command line (`extra`), floors
    positions: pd.DataFrame | None = None
    pack_positions: dict[str, pd.DataFrame] = field(
        default_factory=dict
    )  # label -> scored positions: row_id, position, token, kl, ...
    token_text: dict[int, str] | None = None      # token id -> text, when the run folder stored it
    warnings: list[str] = field(default_factory=list)   # non-finite numbers, packs that failed in that run

    def local_path(self, value) -> Path | None:
        """A path the compare run recorded, as readable here: absolute, or relative to the result's folder or to the
        cwd."""
        if not value:
            return None
        p = Path(str(value))
        if p.is_absolute():
            return p if p.exists() else None
        src = Path(self.source)
        for base in (src if src.is_dir() else src.parent, Path.cwd()):
            if (base / p).exists():
                return base / p
        return None

    @property
    def panel_key(self) -> tuple[str, str]:
        return (str(self.panel.sha256 or ""), str(self.reference.fingerprint or ""))


@dataclass
class Group:
    """Compare results that can share a plot: the same panel (sha256) and the same reference."""

    panel: PanelInfo
    reference: ReferenceInfo
    runs: list[CompareRun]
    warning: str | None = None

    @property
    def packs(self) -> list[PackResult]:
        return [p for r in self.runs for p in r.results]


@dataclass
class Inputs:
    groups: list[Group]
    suites: list[tuple[str, dict | list]]
    gates: list[tuple[str, dict | list]]
    warnings: list[str]
    speed: list[tuple[str, dict]] = field(default_factory=list)  # `fidelity bench --json` and `fidelity ladder --json`
    attributions: list[tuple[str, dict]] = field(default_factory=list)   # `fidelity attribute --json` documents


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ReportInputError(f"cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ReportInputError(f"{path} is not valid JSON: {e}") from None


def is_attribution(data) -> bool:
    """A `fidelity attribute --json` document."""
    return isinstance(data, dict) and "swaps" in data and "summary" in data and "layers" in data


def classify(data, source: str) -> str:
    """'compare', 'suite', 'gate' or 'speed' (bench / ladder) from a JSON document's shape."""
    if isinstance(data, list) and data and all(isinstance(d, dict) and "gate" in d and "status" in d for d in data):
        return "gate"
    if isinstance(data, list) and data and all(isinstance(d, dict) and "suite" in d for d in data):
        return "suite"
    if isinstance(data, dict):
        if data.get("kind") in ("fidelity-bench", "fidelity-ladder"):
            return "speed"
        if is_attribution(data):
            return "attribute"
        if "results" in data and "panel" in data:
            return "compare"
        if "gates" in data or ("gate" in data and ("passed" in data or "status" in data)):
            return "gate"
        if "suite" in data or "suites" in data:
            return "suite"
    raise ReportInputError(
        f"{source}: not a compare, suite-compare or gate result, nor a bench or ladder (expected keys "
        f"'panel'+'results', 'suite'/'suites', 'gates' or kind fidelity-bench/fidelity-ladder; "
        f"found {sorted(data)[:8] if isinstance(data, dict) else type(data).__name__})"
    )


def _bpw(value) -> float | None:
    """compare writes a number; tolerate a bits table ({category: {bpw}} or [{category, bpw}])."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value) if np.isfinite(value) else None
    rows = value if isinstance(value, list) else [{"category": k, **v} for k, v in value.items() if isinstance(v, dict)]
    by_cat = {r.get("category"): r.get("bpw") for r in rows}
    for cat in ("all_linear", "per_decoded_token", "total"):
        if by_cat.get(cat) is not None:
            return float(by_cat[cat])
    return None


def _check_block(block, where: str, source: str, warnings: list[str]) -> dict:
    """A result block as compare writes it: an object whose numbers are numbers (or null) and whose `*_ci95` are null or
    two numbers. Anything else (a hand edit) is a ReportInputError naming the file and the item; a NaN or infinity is
    kept but warned about, naming them."""
    if not isinstance(block, dict):
        raise ReportInputError(f"{source}: {where} is not an object (got {type(block).__name__})")
    for k, v in block.items():
        item = f"{where}.{k}"
        if k.endswith("_ci95") or k == "ci95":
            if v is None:
                continue
            if not (
                isinstance(v, list)
                and len(v) == 2
                and all(x is None or (isinstance(x, (int, float)) and not isinstance(x, bool)) for x in v)
            ):
                raise ReportInputError(f"{source}: {item} must be null or [low, high] numbers, got {v!r}")
            if any(x is not None and not math.isfinite(x) for x in v):
                warnings.append(f"{source}: {item} is {v} (not finite)")
        elif isinstance(v, float) and not math.isfinite(v):
            warnings.append(f"{source}: {item} is {v} (not finite); shown as such, not as a measurement")
        elif k in _NUMERIC and v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ReportInputError(f"{source}: {item} must be a number or null, got {v!r}")
    return block


_NUMERIC = {"positions", "nonfinite", "kld_mean", "kld_domains_equal", "top1", "top1_domains_equal", "ppl", "ppl_ref",
            "kld_median", "kld_p90", "kld_p99", "kld_p999", "kld_max", "noise_floor_kld", "x_noise_floor",
            "ln_ppl_ratio", "delta_nll_mean", "delta_p_mean", "rms_delta_p", "kld_reverse_mean", "rows",
            "kld_mean_diff", "p_value", "top1_flips_clear", "top1_flips_near_tie", "clear_positions",
            "near_tie_positions"}


def _compare_run(data: dict, source: str) -> CompareRun:
    """A compare document checked (its schema version, every block's numbers; a ReportInputError names the file and the
    item) and read into the result schema's types."""
    try:
        check_version(data, source)
    except SchemaVersionError as e:
        raise ReportInputError(str(e)) from None
    panel, reference = data.get("panel") or {}, data.get("reference") or {}
    if not isinstance(panel, dict) or "sha256" not in panel:
        raise ReportInputError(f"{source}: compare result has no panel sha256 (panel = {panel!r})")
    if not isinstance(reference, dict):
        raise ReportInputError(f"{source}: reference is not an object (got {type(reference).__name__})")
    raw = data.get("results") or []
    if not isinstance(raw, list):
        raise ReportInputError(f"{source}: results is not a list (got {type(raw).__name__})")
    measured, warnings = [], []
    for i, r in enumerate(raw):
        if not isinstance(r, dict):
            raise ReportInputError(f"{source}: results[{i}] is not an object (got {type(r).__name__})")
        if r.get("status") == "failed":
            warnings.append(
                f"{source}: pack {r.get('label') or r.get('pack')!r} failed in that run and has no numbers: "
                f"{r.get('error')}"
            )
            continue
        if "overall" not in r:
            raise ReportInputError(
                f"{source}: results[{i}] ({r.get('label') or r.get('pack')!r}) has no 'overall' block"
            )
        label = str(r.get("label") or Path(str(r.get("pack", f"pack{i}"))).name)
        _check_block(r["overall"], f"results[{i}] ({label}).overall", source, warnings)
        domains = r.get("domains") or {}
        if not isinstance(domains, dict):
            raise ReportInputError(f"{source}: results[{i}] ({label}).domains is not an object")
        for d, block in domains.items():
            _check_block(block, f"results[{i}] ({label}).domains.{d}", source, warnings)
        bpw = r.get("bpw")
        if isinstance(bpw, float) and not math.isfinite(bpw):
            warnings.append(f"{source}: results[{i}] ({label}).bpw is {bpw} (not finite)")
        try:
            bpw = _bpw(bpw)
        except (TypeError, ValueError, AttributeError):
            raise ReportInputError(
                f"{source}: results[{i}] ({label}).bpw is not a number or a bits table: {bpw!r}"
            ) from None
        measured.append((i, label, bpw))
    paired = data.get("paired") or []
    if not isinstance(paired, list):
        raise ReportInputError(f"{source}: paired is not a list (got {type(paired).__name__})")
    for j, d in enumerate(paired):
        _check_block(d, f"paired[{j}]", source, warnings)
    nf = data.get("noise_floor")
    if nf is not None:
        _check_block(nf, "noise_floor", source, warnings)
    try:
        report = CompareReport.from_dict(data)
    except TypeError as e:
        raise ReportInputError(f"{source}: {e}") from None
    results = []
    for i, label, bpw in measured:
        r = report.results[i]
        results.append(PackResult(label=label, pack=str(r.pack if r.pack is not None else label), bpw=bpw,
                                  overall=r.overall, domains=r.domains or {}, fingerprint=r.fingerprint, source=source,
                                  format=r.format, records=r.records, index=i))
    return CompareRun(source=source, panel=report.panel or PanelInfo(), reference=report.reference or ReferenceInfo(),
                      results=results, paired=report.paired or [], report=report, warnings=warnings)


# ---- run folders -----------------------------------------------------------------------------------------------------

def _find_compare_json(folder: Path) -> Path | None:
    for name in ("compare.json", "result.json", "results.json"):
        if (folder / name).is_file():
            return folder / name
    for p in sorted(folder.glob("*.json")):
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(d, dict) and "results" in d and "panel" in d:
            return p
    return None


REFERENCE_COLUMNS = ["row_id", "domain", "position", "token", "scored", "nll", "topk_ids", "topk_logprobs"]


def _is_store(folder: Path) -> bool:
    return (folder / "records.parquet").is_file() and (folder / "manifest.json").is_file()


def _reference_store(run: CompareRun, folder: Path | None) -> Path | None:
    """A reference store (records.parquet + manifest.json): given with the results, in the run folder, a subfolder of it
    or its passes/reference-store, or where the JSON's reference.store says."""
    recorded = run.local_path(run.reference.store)
    candidates = [recorded] if recorded is not None else []
    if folder is not None:  # passes/reference-store: the reference `compare --out` keeps for resuming
        candidates += [
            folder,
            *sorted(p for p in folder.iterdir() if p.is_dir()),
            folder / "passes" / "reference-store",
        ]
    return next((c for c in candidates if c.is_dir() and _is_store(c)), None)


def _attach_records(run: CompareRun, folder: Path | None, store: Path | None = None):
    """Per-position records of a `compare --out` folder: `<label>.parquet` per pack (row_id, domain, position, token,
    kld, ref_top1, pack_top1, ref_pmax, finite, ...), and the reference store's records (every token of every row, the
    reference top-K) when the folder holds or names one: then the worst positions get full text and the reference's top
    tokens."""
    for res in run.results if folder is not None else []:
        named = [folder / Path(res.records).name] if res.records else []
        path = next((p for p in (*named, folder / f"{res.label}.parquet", folder / f"pack-{res.label}.parquet")
                     if p.is_file()), None)
        if path is None:
            continue
        df = pd.read_parquet(path).rename(columns={"kld": "kl", "topk_ids": "top_ids", "topk_logprobs": "top_logprobs"})
        missing = {"row_id", "position", "token", "kl"} - set(df.columns)
        if missing:
            raise ReportInputError(f"{path}: per-position records of pack {res.label!r} lack columns {sorted(missing)}")
        run.pack_positions[res.label] = df
    store = store or _reference_store(run, folder)
    if store is not None and run.positions is None:
        manifest = _read_json(store / "manifest.json")
        sha = (manifest.get("panel") or {}).get("sha256")
        if sha and sha != run.panel.sha256:
            raise ReportInputError(f"{store}: reference store is for panel sha256 {sha[:12]}, the compare result "
                                   f"{run.source} for {str(run.panel.sha256)[:12]}")
        ref = pd.read_parquet(store / "records.parquet", columns=REFERENCE_COLUMNS if _has_columns(store) else None)
        missing = {"row_id", "position", "token", "scored"} - set(ref.columns)
        if missing:
            raise ReportInputError(f"{store / 'records.parquet'}: reference records lack columns {sorted(missing)}")
        run.positions = ref.rename(
            columns={"topk_ids": "ref_top_ids", "topk_logprobs": "ref_top_logprobs", "nll": "ref_nll"}
        )
    vocab = folder / "tokens.json" if folder is not None else None
    if vocab is not None and vocab.is_file():
        run.token_text = {int(k): v for k, v in _read_json(vocab).items()}


def _has_columns(store: Path) -> bool:
    return set(REFERENCE_COLUMNS) <= set(pq.read_schema(store / "records.parquet").names)


def load_compare(item, source: str | None = None) -> CompareRun:
    """A compare JSON file (its folder's `<label>.parquet` records are picked up), a run folder holding one, or a
    dict."""
    if isinstance(item, dict):
        return _compare_run(item, source or "<dict>")
    path = Path(item)
    if path.is_dir():
        j = _find_compare_json(path)
        if j is None:
            raise ReportInputError(
                f"{path}: run folder has no compare JSON (looked for compare.json or any *.json with "
                "'panel' and 'results')"
            )
        run = _compare_run(_read_json(j), str(path))
        _attach_records(run, path)
        return run
    run = _compare_run(_read_json(path), str(path))
    _attach_records(run, path.parent)
    return run


def _attach_folder(folder: Path, runs: list[CompareRun]):
    """A folder given without a compare JSON: a reference store, or `compare --out` records for a compare JSON given
    too."""
    if _is_store(folder):
        sha = (_read_json(folder / "manifest.json").get("panel") or {}).get("sha256")
        matched = [r for r in runs if r.panel.sha256 == sha and r.positions is None]
        for r in matched:
            _attach_records(r, None, store=folder)
        if not matched:
            raise ReportInputError(
                f"{folder}: reference store for panel sha256 {str(sha)[:12]} matches no compare result given "
                "without records of its own"
            )
        return
    names = {p.stem for p in folder.glob("*.parquet")}
    if not names:
        raise ReportInputError(f"{folder}: run folder has no compare JSON and no per-position records (*.parquet)")
    for r in runs:
        if not r.pack_positions and any(res.label in names for res in r.results):
            _attach_records(r, folder)
            return
    raise ReportInputError(
        f"{folder}: its per-position records ({', '.join(sorted(names))}) match the labels of no compare "
        "result given; pass the compare JSON too (`fidelity compare --json`)"
    )


# ---- grouping --------------------------------------------------------------------------------------------------------

def _unique_labels(runs: list[CompareRun]):
    """The same label from two files would be merged in a plot; tell them apart by file name (and a number if that is
    the same too, e.g. one file given twice)."""
    counts: dict[str, int] = {}
    for run in runs:
        for res in run.results:
            counts[res.label] = counts.get(res.label, 0) + 1
    taken: set[str] = set()
    for run in runs:
        for res in run.results:
            new = res.label if counts[res.label] == 1 else f"{res.label} ({Path(run.source).name})"
            base, n = new, 1
            while new in taken:
                n += 1
                new = f"{base} #{n}"
            taken.add(new)
            if new != res.label and res.label in run.pack_positions:
                run.pack_positions[new] = run.pack_positions.pop(res.label)
            res.label = new


def group_runs(runs: list[CompareRun]) -> tuple[list[Group], list[str]]:
    """Group by (panel sha256, reference fingerprint). The main group is the one with the most packs (first seen on a
    tie); every other group carries a warning naming its files and what differs."""
    order: list[tuple[str, str]] = []
    by_key: dict[tuple[str, str], list[CompareRun]] = {}
    for run in runs:
        if run.panel_key not in by_key:
            order.append(run.panel_key)
            by_key[run.panel_key] = []
        by_key[run.panel_key].append(run)
    groups, warnings = [], []
    order.sort(key=lambda k: -sum(len(r.results) for r in by_key[k]))       # stable: first seen wins a tie
    first = by_key[order[0]][0] if order else None
    for i, key in enumerate(order):
        members = by_key[key]
        _unique_labels(members)
        g = Group(panel=members[0].panel, reference=members[0].reference, runs=members)
        if i > 0:
            files = ", ".join(r.source for r in members)
            if key[0] != first.panel_key[0]:
                why = (f"panel {g.panel.name!r} (sha256 {key[0][:12]}) differs from the main group's panel "
                       f"{first.panel.name!r} (sha256 {first.panel_key[0][:12]})")
            else:
                why = (f"reference {g.reference.fingerprint!r} differs from the main group's reference "
                       f"{first.reference.fingerprint!r}")
            g.warning = (f"{files}: {why}; its numbers are not comparable and are shown as a separate group, "
                         "never in the same plot.")
            warnings.append(g.warning)
        groups.append(g)
    return groups, warnings


def load_inputs(items) -> Inputs:
    """Paths (files or run folders) or dicts, in order; compare results are grouped by panel."""
    runs, suites, gates, folders, beside, speed, attributions = [], [], [], [], [], [], []
    for n, item in enumerate(items):
        if isinstance(item, CompareRun):
            runs.append(item)
            continue
        if isinstance(item, dict):
            data, source = item, f"<result {n + 1}>"
        elif isinstance(item, list):
            data, source = item, f"<result {n + 1}>"
        else:
            path = Path(item)
            if not path.exists():
                raise ReportInputError(f"{path}: no such file or folder")
            if path.is_dir():
                if _find_compare_json(path) is None:
                    folders.append(path)
                else:
                    runs.append(load_compare(path))
                continue
            data, source = _read_json(path), str(path)
        kind = classify(data, source)
        if kind == "compare":
            run = load_compare(data, source)
            if not isinstance(item, (dict, list)):
                beside.append((run, Path(item).parent))
            runs.append(run)
        elif kind == "attribute":
            attributions.append((source, data))
        elif kind == "suite":
            suites.append((source, data))
        elif kind == "speed":
            speed.append((source, data))
        else:
            gates.append((source, data))
    for folder in folders:
        _attach_folder(folder, runs)
    for run, folder in beside:   # a compare.json's records lie beside it, unless a folder given holds them
        if not run.pack_positions:
            _attach_records(run, folder)
    if not (runs or suites or gates or speed or attributions):
        raise ReportInputError(
            "nothing to report: give at least one compare, suite-compare, gate, bench, ladder or attribute result"
        )
    groups, warnings = group_runs(runs)
    warnings = [w for r in runs for w in r.warnings] + warnings
    return Inputs(groups=groups, suites=suites, gates=gates, warnings=warnings, speed=speed, attributions=attributions)
