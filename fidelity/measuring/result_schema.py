"""The compare result's JSON, typed and versioned: one dataclass per block, its fields the block's keys in the order
compare writes them, so `to_dict()` gives back the document key for key and a misspelt key in the code that reads a
result is an AttributeError rather than a silent None.

`schema_version` (SCHEMA_VERSION) is the first key of a compare result. A file without it is version 0: written by
fidelity before the version was recorded, in the same layout, and read as such. A file of a version newer than this
fidelity reads (or not a version at all) is refused, naming the file and both versions.

A block read from a file keeps which keys the file left out (`absent`: an older compare, a hand-made result; they read
as None and are not written back) and any key this schema does not declare (`extra`, written back after the declared
ones: `command_line`, `demo_seconds`), so `to_dict(from_dict(x)) == x` for every document this schema reads."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from ..errors import FidelityError

SCHEMA_VERSION = 1


class SchemaVersionError(FidelityError):
    """A compare result of a schema version this fidelity does not read."""


def _one(cls) -> Any:
    return field(default=None, metadata={"block": cls, "shape": "one"})


def _list(cls) -> Any:
    return field(default=None, metadata={"block": cls, "shape": "list"})


def _map(cls) -> Any:
    return field(default=None, metadata={"block": cls, "shape": "map"})


@dataclass
class Block:
    """A JSON object of the result. Its dataclass fields (all but `absent` and `extra`) are its keys, in order."""

    absent: frozenset = field(default=frozenset(), repr=False, compare=False, kw_only=True)
    extra: dict = field(default_factory=dict, repr=False, kw_only=True)

    _INTERNAL: ClassVar[tuple[str, ...]] = ("absent", "extra")

    @classmethod
    def declared(cls) -> list:
        return [f for f in fields(cls) if f.name not in cls._INTERNAL]

    @classmethod
    def from_dict(cls, data: dict, where: str = "") -> "Block":
        if not isinstance(data, dict):
            raise TypeError(f"{where or cls.__name__} is not an object (got {type(data).__name__})")
        declared = cls.declared()
        values = {f.name: _read(data[f.name], f, f"{where}.{f.name}") for f in declared if f.name in data}
        names = {f.name for f in declared}
        return cls(**values, absent=frozenset(names - set(data)),
                   extra={k: v for k, v in data.items() if k not in names})

    def to_dict(self) -> dict:
        out = {f.name: _write(getattr(self, f.name), f) for f in self.declared() if f.name not in self.absent}
        out.update(self.extra)
        return out

    def __getitem__(self, key: str):
        """`block["key"]` for a declared key (KeyError for any other): as `getattr`, for code that names keys."""
        if key in self._INTERNAL or key not in {f.name for f in self.declared()}:
            raise KeyError(f"{type(self).__name__} has no key {key!r}")
        return getattr(self, key)


def _read(value, f, where: str):
    cls, shape = f.metadata.get("block"), f.metadata.get("shape")
    if cls is None or value is None:
        return value
    if shape == "one":
        return cls.from_dict(value, where)
    if shape == "list":
        if not isinstance(value, list):
            raise TypeError(f"{where} is not a list (got {type(value).__name__})")
        return [cls.from_dict(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, dict):
        raise TypeError(f"{where} is not an object (got {type(value).__name__})")
    return {k: cls.from_dict(v, f"{where}.{k}") for k, v in value.items()}


def _write(value, f):
    shape = f.metadata.get("shape")
    if shape is None or value is None:
        return value
    if shape == "one":
        return value.to_dict()
    if shape == "list":
        return [v.to_dict() for v in value]
    return {k: v.to_dict() for k, v in value.items()}


# ---- statistics of one pack (fidelity.measuring.stats.summarize) -----------------------------------------------------

@dataclass
class RowsWorse(Block):
    """Rows whose mean NLL rose, of the scored rows, with the share's 95% interval and the sign test."""

    rows: int | None = None
    worse: int | None = None
    better: int | None = None
    share: float | None = None
    share_ci95: list | None = None
    sign_test_p: float | None = None


@dataclass
class TopKAgreement(Block):
    k: int | None = None
    value: float | None = None
    ci95: list | None = None


@dataclass
class ConfidenceBucket(Block):
    """KL of the positions whose reference top-1 probability lies in `ref_confidence` (domains-equal: kld only)."""

    ref_confidence: list | None = None
    positions: int | None = None
    share: float | None = None
    kld_mean: float | None = None
    kld_mean_ci95: list | None = None
    kld_reverse_mean: float | None = None


@dataclass
class DomainsEqual(Block):
    """The statistics with every domain weighted equally (the mean of the domains' own)."""

    kld_reverse_mean: float | None = None
    delta_nll_mean: float | None = None
    delta_p_mean: float | None = None
    rms_delta_p: float | None = None
    nll_mean: float | None = None
    nll_ref_mean: float | None = None
    rows_worse_share: float | None = None
    kld_reverse_mean_ci95: list | None = None
    delta_nll_mean_ci95: list | None = None
    delta_p_mean_ci95: list | None = None
    rms_delta_p_ci95: list | None = None
    nll_mean_ci95: list | None = None
    nll_ref_mean_ci95: list | None = None
    rows_worse_share_ci95: list | None = None
    delta_nll_mean_se: float | None = None
    kld_mean: float | None = None
    kld_mean_ci95: list | None = None
    top1: float | None = None
    top1_ci95: list | None = None
    topk_agreement: list[TopKAgreement] | None = _list(TopKAgreement)
    kld_by_ref_confidence: list[ConfidenceBucket] | None = _list(ConfidenceBucket)
    kld_median: float | None = None
    kld_p90: float | None = None
    kld_p99: float | None = None
    kld_p999: float | None = None
    kld_median_ci95: list | None = None
    kld_p90_ci95: list | None = None
    kld_p99_ci95: list | None = None
    kld_p999_ci95: list | None = None
    kld_median_ci95_unavailable: str | None = None
    kld_p90_ci95_unavailable: str | None = None
    kld_p99_ci95_unavailable: str | None = None
    kld_p999_ci95_unavailable: str | None = None


@dataclass
class Scope(Block):
    """One pack's statistics over one scope: overall (a pack's `overall`, the noise floor: then `domains_equal` and
    the pooled-only keys are there, `rows` is absent) or one domain (`rows` there; the pooled-only keys absent).
    The noise-floor keys (`noise_floor_kld`, ...) are a measured pack's overall only."""

    rows: int | None = None
    positions: int | None = None
    nonfinite: int | None = None
    kld_mean: float | None = None
    kld_mean_ci95: list | None = None
    kld_domains_equal: float | None = None
    kld_domains_equal_ci95: list | None = None
    top1: float | None = None
    top1_ci95: list | None = None
    top1_domains_equal: float | None = None
    top1_domains_equal_ci95: list | None = None
    tie_margin: float | None = None
    top1_flips_clear: int | None = None
    clear_positions: int | None = None
    top1_flips_near_tie: int | None = None
    near_tie_positions: int | None = None
    ppl: float | None = None
    ppl_ci95: list | None = None
    ppl_ref: float | None = None
    ln_ppl_ratio: float | None = None
    ln_ppl_ratio_ci95: list | None = None
    kld_reverse_mean: float | None = None
    kld_reverse_mean_ci95: list | None = None
    delta_nll_mean: float | None = None
    delta_nll_mean_ci95: list | None = None
    delta_nll_mean_se: float | None = None
    nll_mean: float | None = None
    nll_mean_ci95: list | None = None
    nll_ref_mean: float | None = None
    nll_ref_mean_ci95: list | None = None
    rows_worse: RowsWorse | None = _one(RowsWorse)
    topk_agreement: list[TopKAgreement] | None = _list(TopKAgreement)
    delta_p_mean: float | None = None
    delta_p_mean_ci95: list | None = None
    rms_delta_p: float | None = None
    rms_delta_p_ci95: list | None = None
    kld_by_ref_confidence: list[ConfidenceBucket] | None = _list(ConfidenceBucket)
    kld_median: float | None = None
    kld_p90: float | None = None
    kld_p99: float | None = None
    kld_p999: float | None = None
    kld_median_ci95: list | None = None
    kld_p90_ci95: list | None = None
    kld_p99_ci95: list | None = None
    kld_p999_ci95: list | None = None
    kld_median_ci95_unavailable: str | None = None
    kld_p90_ci95_unavailable: str | None = None
    kld_p99_ci95_unavailable: str | None = None
    kld_p999_ci95_unavailable: str | None = None
    kld_max: float | None = None
    ci_unavailable: str | None = None
    bootstrap_replicates: int | None = None
    domains_equal: DomainsEqual | None = _one(DomainsEqual)
    noise_floor_kld: float | None = None
    x_noise_floor: float | None = None
    numerics_floor_kld: float | None = None


@dataclass
class PackReport(Block):
    """One candidate pack: measured (statistics, bits per weight, routing, records file) or failed (`error`)."""

    pack: str | None = None
    label: str | None = None
    format: str | None = None
    fingerprint: str | None = None
    status: str | None = None
    error: str | None = None
    bpw: float | None = None
    bits_per_weight: dict | None = None
    routing: dict | None = None
    overall: Scope | None = _one(Scope)
    domains: dict[str, Scope] | None = _map(Scope)
    records: str | None = None


# ---- pairs, floors, the document -------------------------------------------------------------------------------------

@dataclass
class PairedBlock(Block):
    """Pack A - pack B of one KL on the same positions over one scope (pooled: with `domains` and `domains_equal`;
    a domain: with `p_holm`)."""

    a: float | None = None
    b: float | None = None
    diff: float | None = None
    diff_ci95: list | None = None
    diff_se: float | None = None
    relative_change_pct: float | None = None
    relative_change_pct_ci95: list | None = None
    relative_change_pct_unavailable: str | None = None
    p_value: float | None = None
    p_value_floor: float | None = None
    method: str | None = None
    unavailable: str | None = None
    p_holm: float | None = None
    domains: dict[str, "PairedBlock"] | None = None
    domains_equal: "PairedBlock | None" = None


# the recursive fields need the class itself
for _f in fields(PairedBlock):
    if _f.name in ("domains", "domains_equal"):
        _f.metadata = {"block": PairedBlock, "shape": "map" if _f.name == "domains" else "one"}


@dataclass
class PairedDifference(Block):
    """Two packs compared on the same positions: KL(P_ref || pack) (`kld`) and KL(pack || P_ref) (`kld_reverse`);
    the top-level numbers are the pooled `kld` ones."""

    a: str | None = None
    b: str | None = None
    positions: int | None = None
    bootstrap_replicates: int | None = None
    kld: PairedBlock | None = _one(PairedBlock)
    kld_reverse: PairedBlock | None = _one(PairedBlock)
    kld_mean_diff: float | None = None
    ci95: list | None = None
    p_value: float | None = None
    method: str | None = None
    unavailable: str | None = None


@dataclass
class NumericsFloor(Block):
    """KL(reference under its numerics || reference under the other numerics its family defines)."""

    reference_numerics: str | None = None
    other_numerics: str | None = None
    direction: str | None = None
    overall: Scope | None = _one(Scope)
    domains: dict[str, Scope] | None = _map(Scope)


@dataclass
class Truncation(Block):
    enabled: bool | None = None
    max_len: int | None = None
    rows_cut: int | None = None
    tokens_cut: int | None = None
    scored_tokens_cut: int | None = None
    row_ids: list | None = None


@dataclass
class PanelInfo(Block):
    name: str | None = None
    sha256: str | None = None
    rows: int | None = None
    scored_positions: int | None = None
    domains: dict | None = None
    truncation: Truncation | None = _one(Truncation)


@dataclass
class ReferenceInfo(Block):
    path: str | None = None
    fingerprint: str | None = None
    format: str | None = None
    store: str | None = None


@dataclass
class CompareReport(Block):
    """A compare result (`fidelity compare --json`). Read one with `CompareReport.read(data, source)`."""

    schema_version: int | None = None
    fidelity_version: str | None = None
    direction: str | None = None
    panel: PanelInfo | None = _one(PanelInfo)
    reference: ReferenceInfo | None = _one(ReferenceInfo)
    numerics: str | None = None
    numerics_label: str | None = None
    noise_floor: Scope | None = _one(Scope)
    numerics_floor: NumericsFloor | None = _one(NumericsFloor)
    resumed: list | None = None
    identity: str | None = None
    results: list[PackReport] | None = _list(PackReport)
    failed: list | None = None
    paired: list[PairedDifference] | None = _list(PairedDifference)

    @property
    def version(self) -> int:
        """The schema version the document was written in (0: before versions were recorded)."""
        return 0 if "schema_version" in self.absent else self.schema_version

    @classmethod
    def read(cls, data: dict, source: str) -> "CompareReport":
        """A compare result's document, after checking its version (`source` names the file in the error)."""
        check_version(data, source)
        return cls.from_dict(data)


def check_version(data: dict, source: str) -> int:
    """The document's schema version; a SchemaVersionError naming `source` unless this fidelity reads it."""
    version = data.get("schema_version", 0)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise SchemaVersionError(f"{source}: schema_version {version!r} is not a version number (this fidelity reads "
                                 f"compare results of schema versions 0 to {SCHEMA_VERSION})")
    if version > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{source}: compare result of schema_version {version}, newer than this fidelity reads "
            f"(0 to {SCHEMA_VERSION}): upgrade fidelity to read it"
        )
    return version
