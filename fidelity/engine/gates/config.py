"""gate.toml read and checked, the gates to run chosen, and run against an engine: what `fidelity gate` and the tuning
ladder share. Each section is checked and run by the gate kind registered under its name (`fidelity.registry.GATES`)."""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from ...errors import ConfigError
from ...pack_settings import PackSettings
from ...registry import GATES
from ..client import ClientConfig, EngineClient
from ..reference import reference_from_store
from .kinds import GateCall
from .settings import GateResult, GateSettings

CLIENT_KEYS = {"concurrency", "timeout_s", "retries", "journal", "backoff_s"}
SETTINGS_KEYS = {f.name for f in fields(GateSettings)} | {"prompt_as"}


def always_run_gates() -> list[str]:
    """The gates that run without a config section (oracle-kl, batch-invariance, ...), in their order."""
    return [name for name, kind in GATES.items() if kind.names is None]


def read_toml(path, what: str) -> dict:
    """A TOML file's tables; a missing or malformed file is a ConfigError naming `what` and the path."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist")
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{what} {path} is not valid TOML: {e}")


def load_config(path: str | None) -> dict:
    if not path:
        return {}
    cfg = read_toml(path, "gate config")
    for section, table in cfg.items():
        if section == "settings":
            bad = set(table) - SETTINGS_KEYS - CLIENT_KEYS
            if bad:
                raise ConfigError(
                    f"gate config {path}: unknown key(s) {sorted(bad)} in [settings] "
                    f"(known: {sorted(SETTINGS_KEYS | CLIENT_KEYS)})"
                )
        elif section in GATES:
            GATES[section].check(path, section, table)
        else:
            known = ["suite.NAME" if n == "suite" else n for n in GATES]
            raise ConfigError(f"gate config {path}: unknown section [{section}] (known: settings, {', '.join(known)})")
    cfg["_dir"] = str(Path(path).resolve().parent)
    return cfg


def configured_gates(cfg: dict) -> list[str]:
    """The gates that run only where a config defines them (speed, suite.NAME)."""
    return [g for name, kind in GATES.items() if kind.names is not None and name in cfg for g in kind.names(cfg[name])]


def select_gates(only: str | None, cfg: dict | None = None) -> list[str]:
    known = always_run_gates() + configured_gates(cfg or {})
    if not only:
        return known
    names = [n.strip() for n in only.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad:
        raise ConfigError(f"--only: unknown gate(s) {bad} (known: {', '.join(known)}; speed and suite.NAME need their "
                          f"section in --config)")
    return names


def load_reference(store: str, pack: str | None, panel: str | None, rows_per_domain: int | None,
                   pack_settings: PackSettings):
    return reference_from_store(store, pack, panel, rows_per_domain=rows_per_domain, pack_settings=pack_settings)


async def run_gates(engine: str, model: str, names: list[str], cfg: dict, *, store: str | None = None,
                    reference_pack: str | None = None, panel: str | None = None, rows_per_domain: int | None = None,
                    journal: str | None = None, timeout: float | None = None, retries: int | None = None,
                    concurrency: int | None = None, bwrap: str | None = None,
                    pack_settings: PackSettings = PackSettings()) -> dict:
    """`pack_settings`: how the reference store's pack is opened."""
    st = dict(cfg.get("settings", {}))
    prompt_as = st.pop("prompt_as", "auto")
    client_kw = {k: st.pop(k) for k in list(st) if k in CLIENT_KEYS}
    settings = GateSettings(**st)
    client_kw.update({k: v for k, v in {"journal": journal, "timeout_s": timeout, "retries": retries,
                                        "concurrency": concurrency}.items() if v is not None})
    client_kw.setdefault("concurrency", max(settings.batch_sizes))
    results = []
    async with EngineClient(ClientConfig(engine, model=model, **client_kw)) as client:
        call = GateCall(engine, model, client, settings, prompt_as, cfg.get("_dir"), journal, store,
                        lambda: load_reference(store, reference_pack, panel, rows_per_domain, pack_settings), bwrap)
        for name in names:
            kind, _, sub = name.partition(".")  # suite.NAME: kind "suite", its table [suite.NAME]
            section = cfg.get(kind)
            results.append(await GATES[kind].run(call, name, section[sub] if sub else section))
        stats = client.stats
    return {
        "engine": engine,
        "model": model,
        "reference_store": store,
        "reference_numerics": store_numerics(store),
        "gates": [r.to_dict() for r in results],
        "client": {
            "sent": stats.sent,
            "retries": stats.retries,
            "journal_hits": stats.journal_hits,
            "errors": stats.errors,
        },
        "exit_code": exit_code(results),
        "status": {0: "pass", 1: "fail", 2: "error"}[exit_code(results)],
    }


def store_numerics(store: str | None) -> str | None:
    """The numerics the reference store was built under (its manifest's `oracle_numerics`; "exact" for stores from
    before the choice existed), None without a store."""
    if store is None:
        return None
    from ...measuring.store import StoreError, read_manifest  # noqa: PLC0415 (torch; gate's parser imports this)
    try:
        return read_manifest(store).get("oracle_numerics", "exact")
    except (StoreError, OSError, ValueError):
        return None      # not a store: the gates that read it say so, each as its own could-not-run


def exit_code(results: list[GateResult]) -> int:
    if any(r.status == "fail" for r in results):
        return 1
    if any(r.status == "error" for r in results):
        return 2
    return 0
