"""The compare result's JSON, typed and versioned: one dataclass per block, its fields the block's keys in the order
compare writes them, so `to_dict()` gives back the document key for key and a misspelt key in the code that reads a
result is an AttributeError rather than a silent None.

A block declares its keys in `KEYS`, in order, by family: `keys(type, names)` for plain keys, `estimates(names)` for a
statistic with its 95% interval (`name`, `name_ci95`; `name_se` too with `se=True`), `one`/`many`/`by_name` for nested
blocks. The dataclass fields are made from it; `block.estimate("kld_mean")` reads such a family back as an `Estimate`.

`schema_version` (SCHEMA_VERSION) is the first key of a compare result. A file without it is version 0: written by
fidelity before the version was recorded, in the same layout, and read as such. A file of a version newer than this
fidelity reads (or not a version at all) is refused, naming the file and both versions.

A block read from a file keeps which keys the file left out (`absent`: an older compare, a hand-made result; they read
as None and are not written back) and any key this schema does not declare (`extra`, written back after the declared
ones), so `to_dict(from_dict(x)) == x` for every document this schema reads. What compare writes goes through
`CompareReport.written`, which refuses an undeclared key other than the commands' `KNOWN_EXTRAS`."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from ..errors import FidelityError

SCHEMA_VERSION = 1


class SchemaVersionError(FidelityError):
    """A compare result of a schema version this fidelity does not read."""


class UndeclaredKeyError(FidelityError):
    """A compare result about to be written holds a key the schema does not declare."""


@dataclass(frozen=True)
class Estimate:
    """A statistic with its 95% interval (`[lo, hi]` as written, or None) and standard error (None where the block
    records none)."""

    value: float | None
    ci95: list | None
    se: float | None = None


@dataclass(frozen=True)
class Key:
    """One key of a block: its name and type; `block` and `shape` ("one", "list", "map") for a nested block."""

    name: str
    type: Any
    block: Any = None
    shape: str | None = None


SELF = "the block being declared"  # `block` of a key whose value is a block of the declaring class


def keys(kind, names: str) -> tuple[Key, ...]:
    return tuple(Key(n, kind) for n in names.split())


def estimates(names: str, se: bool = False) -> tuple[Key, ...]:
    """For each name: `name`, `name_ci95` (and `name_se` with `se`)."""
    return tuple(k for n in names.split()
                 for k in (Key(n, float), Key(f"{n}_ci95", list), *((Key(f"{n}_se", float),) if se else ())))


def one(name: str, block) -> Key:
    return Key(name, block, block, "one")


def many(name: str, block) -> Key:
    return Key(name, list, block, "list")


def by_name(name: str, block) -> Key:
    return Key(name, dict, block, "map")


@dataclass
class Block:
    """A JSON object of the result. A subclass lists its keys in `KEYS`; they become its dataclass fields (default
    None), in order, after `absent` and `extra`."""

    absent: frozenset = field(default=frozenset(), repr=False, compare=False, kw_only=True)
    extra: dict = field(default_factory=dict, repr=False, kw_only=True)

    _INTERNAL: ClassVar[tuple[str, ...]] = ("absent", "extra")
    KEYS: ClassVar[tuple[Key, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__annotations__ = {k.name: k.type for k in cls.KEYS}
        for k in cls.KEYS:
            nested = {"block": cls if k.block is SELF else k.block, "shape": k.shape} if k.shape else {}
            setattr(cls, k.name, field(default=None, metadata=nested))
        dataclass(cls)

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

    def estimate(self, key: str) -> Estimate:
        """`key` with its interval (`key_ci95`) and standard error (`key_se`, where the block declares one)."""
        names = {f.name for f in self.declared()}
        if key not in names or f"{key}_ci95" not in names:
            raise KeyError(f"{type(self).__name__} has no estimate {key!r} (a key with its {key}_ci95)")
        return Estimate(getattr(self, key), getattr(self, f"{key}_ci95"),
                        getattr(self, f"{key}_se") if f"{key}_se" in names else None)

    def undeclared(self, where: str = "") -> list[str]:
        """The paths of the keys this schema does not declare, in this block and the blocks in it."""
        found = [f"{where}.{k}" if where else k for k in self.extra]
        for f in self.declared():
            for path, block in _nested(getattr(self, f.name), f, f"{where}.{f.name}" if where else f.name):
                found += block.undeclared(path)
        return found


def _nested(value, f, where: str) -> list:
    """The blocks a field's value holds, each with its path."""
    shape = f.metadata.get("shape")
    if shape is None or value is None:
        return []
    if shape == "one":
        return [(where, value)]
    if shape == "list":
        return [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    return [(f"{where}.{k}", v) for k, v in value.items()]


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

KLD_QUANTILES = "kld_median kld_p90 kld_p99 kld_p999"
# the quantiles' values, their intervals, then why an interval is missing (a quantile has a reason of its own)
QUANTILE_KEYS = (*keys(float, KLD_QUANTILES), *keys(list, " ".join(f"{q}_ci95" for q in KLD_QUANTILES.split())),
                 *keys(str, " ".join(f"{q}_ci95_unavailable" for q in KLD_QUANTILES.split())))


class RowsWorse(Block):
    """Rows whose mean NLL rose, of the scored rows, with the share's 95% interval and the sign test."""

    KEYS = (*keys(int, "rows worse better"), *estimates("share"), *keys(float, "sign_test_p"))


class TopKAgreement(Block):
    KEYS = (*keys(int, "k"), *keys(float, "value"), *keys(list, "ci95"))


class ConfidenceBucket(Block):
    """KL of the positions whose reference top-1 probability lies in `ref_confidence` (domains-equal: kld only)."""

    KEYS = (*keys(list, "ref_confidence"), *keys(int, "positions"), *keys(float, "share"), *estimates("kld_mean"),
            *keys(float, "kld_reverse_mean"))


class DomainsEqual(Block):
    """The statistics with every domain weighted equally (the mean of the domains' own): the values, then their
    intervals, then delta NLL's standard error."""

    _MEANS = "kld_reverse_mean delta_nll_mean delta_p_mean rms_delta_p nll_mean nll_ref_mean rows_worse_share"
    KEYS = (*keys(float, _MEANS), *keys(list, " ".join(f"{m}_ci95" for m in _MEANS.split())),
            *keys(float, "delta_nll_mean_se"), *estimates("kld_mean top1"),
            many("topk_agreement", TopKAgreement), many("kld_by_ref_confidence", ConfidenceBucket), *QUANTILE_KEYS)


class Scope(Block):
    """One pack's statistics over one scope: overall (a pack's `overall`, the noise floor: then `domains_equal` and
    the pooled-only keys are there, `rows` is absent) or one domain (`rows` there; the pooled-only keys absent).
    The noise-floor keys (`noise_floor_kld`, ...) are a measured pack's overall only."""

    KEYS = (
        *keys(int, "rows positions nonfinite"), *estimates("kld_mean kld_domains_equal top1 top1_domains_equal"),
        *keys(float, "tie_margin"),
        *keys(int, "top1_flips_clear clear_positions top1_flips_near_tie near_tie_positions"),
        *estimates("ppl"), *keys(float, "ppl_ref"), *estimates("ln_ppl_ratio kld_reverse_mean"),
        *estimates("delta_nll_mean", se=True), *estimates("nll_mean nll_ref_mean"),
        one("rows_worse", RowsWorse), many("topk_agreement", TopKAgreement), *estimates("delta_p_mean rms_delta_p"),
        many("kld_by_ref_confidence", ConfidenceBucket), *QUANTILE_KEYS,
        *keys(float, "kld_max"), *keys(str, "ci_unavailable"), *keys(int, "bootstrap_replicates"),
        one("domains_equal", DomainsEqual), *keys(float, "noise_floor_kld x_noise_floor numerics_floor_kld"),
    )


class PackReport(Block):
    """One candidate pack: measured (statistics, bits per weight, routing, records file) or failed (`error`)."""

    KEYS = (*keys(str, "pack label format fingerprint status error"), *keys(float, "bpw"),
            *keys(dict, "bits_per_weight routing"), one("overall", Scope), by_name("domains", Scope),
            *keys(str, "records"))


# ---- pairs, floors, the document -------------------------------------------------------------------------------------

class PairedBlock(Block):
    """Pack A - pack B of one KL on the same positions over one scope (pooled: with `domains` and `domains_equal`;
    a domain: with `p_holm`)."""

    KEYS = (*keys(float, "a b"), *estimates("diff", se=True), *estimates("relative_change_pct"),
            *keys(str, "relative_change_pct_unavailable"), *keys(float, "p_value p_value_floor"),
            *keys(str, "method unavailable"), *keys(float, "p_holm"), by_name("domains", SELF),
            one("domains_equal", SELF))


class PairedDifference(Block):
    """Two packs compared on the same positions: KL(P_ref || pack) (`kld`) and KL(pack || P_ref) (`kld_reverse`);
    the top-level numbers are the pooled `kld` ones."""

    KEYS = (*keys(str, "a b"), *keys(int, "positions bootstrap_replicates"), one("kld", PairedBlock),
            one("kld_reverse", PairedBlock), *keys(float, "kld_mean_diff"), *keys(list, "ci95"),
            *keys(float, "p_value"), *keys(str, "method unavailable"))


class NumericsFloor(Block):
    """KL(reference under its numerics || reference under the other numerics its family defines)."""

    KEYS = (*keys(str, "reference_numerics other_numerics direction"), one("overall", Scope),
            by_name("domains", Scope))


class Truncation(Block):
    KEYS = (*keys(bool, "enabled"), *keys(int, "max_len rows_cut tokens_cut scored_tokens_cut"), *keys(list, "row_ids"))


class PanelInfo(Block):
    KEYS = (*keys(str, "name sha256"), *keys(int, "rows scored_positions"), *keys(dict, "domains"),
            one("truncation", Truncation))


class ReferenceInfo(Block):
    KEYS = keys(str, "path fingerprint format store")


class CompareReport(Block):
    """A compare result (`fidelity compare --json`). Read one with `CompareReport.read(data, source)`; write one
    through `CompareReport.written(report)`."""

    KEYS = (
        *keys(int, "schema_version"), *keys(str, "fidelity_version direction"), one("panel", PanelInfo),
        one("reference", ReferenceInfo), *keys(str, "numerics numerics_label"), one("noise_floor", Scope),
        one("numerics_floor", NumericsFloor), *keys(list, "resumed"), *keys(str, "identity"),
        many("results", PackReport), *keys(list, "failed"), many("paired", PairedDifference),
    )
    # the keys the commands add to compare's result (the command line; the demo's wall time), kept after the others
    KNOWN_EXTRAS: ClassVar[tuple[str, ...]] = ("command_line", "demo_seconds")

    @property
    def version(self) -> int:
        """The schema version the document was written in (0: before versions were recorded)."""
        return 0 if "schema_version" in self.absent else self.schema_version

    @classmethod
    def read(cls, data: dict, source: str) -> "CompareReport":
        """A compare result's document, after checking its version (`source` names the file in the error)."""
        check_version(data, source)
        return cls.from_dict(data)

    @classmethod
    def written(cls, data: dict) -> dict:
        """The document compare made, as it is written: read through the schema and back, refusing any key the
        schema does not declare (other than KNOWN_EXTRAS at the top) and any version but this one."""
        report = cls.from_dict(data)
        if report.schema_version != SCHEMA_VERSION:
            raise SchemaVersionError(f"a compare result written now has schema_version {SCHEMA_VERSION}, "
                                     f"not {report.schema_version!r}")
        undeclared = [k for k in report.undeclared() if k not in cls.KNOWN_EXTRAS]
        if undeclared:
            raise UndeclaredKeyError(f"the compare result holds keys fidelity.measuring.result_schema does not "
                                     f"declare: {', '.join(undeclared)} (add them to the block's KEYS)")
        return report.to_dict()


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
