"""`[suite.NAME]` in gate.toml: run a suite against the engine with a stored baseline run's settings and items, then
apply `suite compare`'s paired verdict (`paired.compare_runs`: McNemar / paired t, fail when the drop exceeds
`threshold` points at p < `alpha`). The new run goes to `out` (default: next to the journal, else a fresh temporary
folder) and resumes there."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

from ..engine.gates.kinds import GateCall, gate_kind, run_gate
from ..engine.gates.settings import Check, GateResult
from ..errors import ConfigError
from . import make_suite

SUITE_GATE_KEYS = {"baseline", "suite", "threshold", "alpha", "out", "data", "unsafe_no_sandbox", "concurrency"}
SUITE_OPTIONS = {"needle": ("lengths", "depths", "seeds"), "toolcall": ("categories",)}


def check_suite_sections(path: str, section: str, table) -> None:
    for name, sub in table.items():
        bad = set(sub) - SUITE_GATE_KEYS if isinstance(sub, dict) else {"(not a table)"}
        if bad or "baseline" not in sub:
            raise ConfigError(f"gate config {path}: [suite.{name}] needs 'baseline' and knows "
                              f"{sorted(SUITE_GATE_KEYS)}" + (f"; unknown: {sorted(bad)}" if bad else ""))


@gate_kind("suite", check=check_suite_sections, names=lambda table: [f"suite.{n}" for n in table])
async def _run_suite_gate(call: GateCall, name: str, section: dict):
    return await run_gate(name, suite_gate, call.engine, call.model, name.removeprefix("suite."), section,
                          config_dir=call.config_dir, journal=call.journal, bwrap=call.bwrap)


def _path(p, config_dir) -> Path:
    p = Path(p)
    return p if p.is_absolute() or config_dir is None else Path(config_dir) / p


async def suite_gate(url: str, model: str, name: str, section: dict, *, config_dir=None, journal=None, bwrap=None):
    # scipy and pyarrow load here: gate's parser imports this module (tests/test_cli_startup.py)
    from .paired import compare_runs  # noqa: PLC0415 (CLI startup)
    from .records import read_manifest  # noqa: PLC0415 (CLI startup)
    from .runner import Settings, run_suite  # noqa: PLC0415 (CLI startup)

    base = _path(section["baseline"], config_dir)
    manifest = read_manifest(base)
    suite_name = section.get("suite", name)
    if manifest.get("suite") != suite_name:
        raise ConfigError(f"[suite.{name}]: baseline {base} is a {manifest.get('suite')!r} run, not {suite_name!r}")
    opts = {k: manifest.get("suite_config", {}).get(k) for k in SUITE_OPTIONS.get(suite_name, ())}
    if section.get("data"):
        opts["data"] = str(_path(section["data"], config_dir))
    if section.get("unsafe_no_sandbox"):
        opts["unsafe_no_sandbox"] = True
    if bwrap and suite_name in ("humaneval", "humaneval+", "mbpp+"):
        opts["bwrap"] = bwrap            # the code suites' sandbox (FIDELITY_BWRAP)
    suite = make_suite(suite_name, **opts)
    settings = Settings(**manifest["settings"])
    if section.get("out"):
        out = _path(section["out"], config_dir)
    elif journal:
        tag = hashlib.sha256(f"{url}|{model}".encode()).hexdigest()[:8]
        out = Path(f"{journal}.suite-{name}-{tag}")
    else:
        out = Path(tempfile.mkdtemp(prefix=f"fidelity-gate-{name}-"))
    summary = await run_suite(suite, out, engine=url, model=model, settings=settings,
                              concurrency=int(section.get("concurrency", 4)))
    threshold, alpha = float(section.get("threshold", 1.0)), float(section.get("alpha", 0.05))
    rep = compare_runs(base, out, threshold_points=threshold, alpha=alpha)
    measured = {"baseline": str(base), "run": str(out), "items": summary.items, "engine_errors": summary.errors,
                "compare": rep}
    notes = [rep["warning"]] if rep.get("warning") else []
    if rep["verdict"] not in ("pass", "fail"):
        return GateResult(
            f"suite.{name}",
            "error",
            measured=measured,
            notes=notes,
            error=f"no verdict: {rep['verdict']} ({summary.errors} engine errors of {summary.items} items)",
        )
    # `suite compare`'s rule as one check: the drop counts where the paired test finds it significant (p < alpha)
    significant = rep["drop"] if rep["p_value"] < alpha else 0.0
    check = Check("significant drop points", significant, "<=", threshold)
    measured.update(drop=rep["drop"], p_value=rep["p_value"], test=rep["test"])
    return GateResult(
        f"suite.{name}", "pass" if check.passed else "fail", checks=[check], measured=measured, notes=notes
    )
