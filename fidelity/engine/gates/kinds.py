"""Gate kinds: each registered in `fidelity.registry.GATES` under its gate.toml section by `@gate_kind` in the module
that implements it (oracle-kl, the invariance gates, `[speed]` in engine/bench.py, `[suite.NAME]` in suites/gate.py),
and `run_gate`, which turns a gate that raises into a could-not-run result."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from ...errors import ConfigError
from ...registry import GATES
from ..client import EngineClient, EngineError
from ..reference import Reference
from .settings import DEFAULT_MINIMUMS, DEFAULT_THRESHOLDS, GateResult, GateSettings


async def run_gate(name: str, fn: Callable, *args, **kw) -> GateResult:
    """A gate that raises could not run: status "error" (exit 2, JSON and JUnit still written), never a pass or fail."""
    t0 = time.monotonic()
    try:
        res = await fn(*args, **kw)
    except EngineError as e:
        res = GateResult(name, "error", error=str(e))
    except Exception as e:  # a reply the gate cannot use in a way no check above named: still an error, not a crash
        res = GateResult(name, "error", error=f"{type(e).__name__}: {e}")
    res.seconds = round(time.monotonic() - t0, 3)
    return res


@dataclass


class GateCall:
    """What `engine.gates.config.run_gates` hands every gate kind's runner."""
    engine: str
    model: str
    client: EngineClient
    settings: GateSettings
    prompt_as: str
    config_dir: str | None
    journal: str | None
    store: str | None  # the reference store (--reference-store); None: not given
    load_reference: Callable[[], Reference]  # reads `store` (oracle-kl only)
    bwrap: str | None = None  # the code suites' bubblewrap (the command line's FIDELITY_BWRAP; [suite.*] gates)


@dataclass(frozen=True)


class GateKind:
    """One kind of gate. `run(call, name, section)` returns its `GateResult` (section: its gate.toml table, or None);
    `check(path, section, table)` raises `ConfigError` for a bad table; `names(table)`, when set, makes the kind run
    only where its section is in the config, as the gates that section defines (`speed`; `suite.NAME`)."""
    run: Callable
    check: Callable[[str, str, object], None]
    names: Callable[[object], list[str]] | None = None

    @property
    def defined_by(self) -> Callable:
        return self.run


def gate_kind(section: str, *, check: Callable[[str, str, object], None], names: Callable | None = None):
    """Decorator: register the runner below as the gate kind of `section`."""
    def add(run: Callable) -> Callable:
        GATES.register(section)(GateKind(run, check, names))
        return run
    return add


def check_thresholds(path: str, section: str, table) -> None:
    known = set(DEFAULT_THRESHOLDS[section]) | set(DEFAULT_MINIMUMS[section])
    bad = set(table) - known
    if bad:
        raise ConfigError(f"gate config {path}: unknown threshold(s) {sorted(bad)} in [{section}] "
                          f"(known: {sorted(known)})")
    for k, v in table.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"gate config {path}: [{section}] {k} must be a number, got {v!r}")
        if k in DEFAULT_MINIMUMS[section] and (not float(v).is_integer() or v < 1):
            raise ConfigError(f"gate config {path}: [{section}] {k} must be a whole number >= 1, got {v!r}")

